"""The rollout loop drives multi-turn, tool-using trajectories (april_ext.rollout.trajectories) on the real
embedded engine: turns that end at a stop token go to the environment as tasks of their own while the engine
generates other samples, observations are appended as never-trained env tokens, the environment's final reward
is the sample's, and a trajectory whose tool is still running at the step boundary waits (it is not in the
engine) and is trained in a later step with every turn token-exact, also across a save and a restart.

The property test draws the environment (turns, latencies, tool failures, timeouts), the scheduler settings and
the moment of a restart from saved state; every trained model token rescored by the served model equals its
behavior logprob, no env token is trained, every env run is exactly what the environment answered, no
trajectory is trained twice and none is lost."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from _torch_threads import one_thread  # noqa: F401 (fixture)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.errors import InvalidArgumentError
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.protocol import EnvStep, SamplingParams, ToolError
from april_ext.rollout import RolloutLoop
from april_ext.tasks import LookupEnvironment, LookupTask, LookupTaskConfig

VOCAB = 23
STOPS = (4, 5, 6, 7, 8, 9)  # a turn's stop tokens: a quarter of the vocabulary, so turns end within a few tokens
MODEL = ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=96, rope_theta=1000.0,
                    eos_token_id=None)


def _model(seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(MODEL)
    model.init_weights(seed)
    return model


def _core(model: LlamaForCausalLM) -> EngineCore:
    return EngineCore(model, EngineConfig(block_size=4, num_blocks=512, max_num_seqs=64))


class ScriptedEnv:
    """Each trajectory's script comes from its prompt: the number of observations before the end, each
    observation's tokens and the tool's latency; a call listed in ``fail`` raises ToolError, one in ``hang``
    outlives any timeout. The reward is a function of the turns the environment saw, so a turn lost or
    repeated changes it. Records every answer given, by (prompt id, turn index)."""

    def __init__(self, latency_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.answers: dict[tuple[Any, int], EnvStep] = {}

    async def start(self, prompt: Prompt) -> dict[str, Any]:
        return {"prompt": prompt.id, "turns": 0, "seen": 0, "script": prompt.metadata}

    async def step(self, state: dict[str, Any], model_turn: Sequence[int]) -> EnvStep:
        script, turn = state["script"], state["turns"]
        latency = script["latency"][turn % len(script["latency"])] if script["latency"] else self.latency_s
        if latency:
            await asyncio.sleep(latency)
        if turn in script.get("fail", ()):
            raise ToolError(f"scripted failure at turn {turn}")
        if turn in script.get("hang", ()):
            await asyncio.sleep(3600)
        seen = state["seen"] + sum(model_turn) * (turn + 1)
        if turn >= script["turns"]:
            answer = EnvStep.finish(float(seen % 97) / 97.0, "answer")
        else:
            answer = EnvStep.observe(tuple(5 + (turn + i) % 7 for i in range(script["obs_len"])))
        state["turns"], state["seen"] = turn + 1, seen  # after the last await: a cancelled step changes nothing
        self.answers[(state["prompt"], turn)] = answer
        return answer


def _prompts(n: int, scripts: Sequence[dict[str, Any]]) -> list[Prompt]:
    return [Prompt(f"p{i}", [1, 2 + i % 9, 3], metadata=dict(scripts[i % len(scripts)])) for i in range(n)]


def _replay(batch: Any, i: int, script: dict[str, Any]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The model turns and env runs of sample i, split by its loss mask."""
    start, end, plen = int(batch.offsets[i]), int(batch.offsets[i + 1]), int(batch.prompt_lens[i])
    tokens, mask = batch.tokens[start + plen:end].tolist(), batch.loss_mask[start + plen:end].tolist()
    runs: list[tuple[int, list[int]]] = []
    for token, m in zip(tokens, mask, strict=True):
        if runs and runs[-1][0] == m:
            runs[-1][1].append(token)
        else:
            runs.append((m, [token]))
    return [tuple(r) for m, r in runs if m], [tuple(r) for m, r in runs if not m]


def _check_batch(batch: Any, reference: LlamaForCausalLM, env: ScriptedEnv, cap: int) -> None:
    """Model tokens have the served model's logprobs; env tokens are masked, logprob 0, version -1, and are
    exactly the environment's answers in order; the reward is the environment's."""
    with torch.inference_mode():
        for i in range(batch.n_samples):
            start, end, plen = int(batch.offsets[i]), int(batch.offsets[i + 1]), int(batch.prompt_lens[i])
            ids = torch.as_tensor(batch.tokens[start:end], dtype=torch.int64)
            rescored = torch.log_softmax(reference(ids).float(), -1)[plen - 1:-1].gather(
                -1, ids[plen:, None]).squeeze(-1).numpy()
            mask = batch.loss_mask[start + plen:end].astype(bool)
            held = batch.behavior_logprobs[start + plen:end]
            np.testing.assert_allclose(held[mask], rescored[mask], atol=2e-3)
            assert (held[~mask] == 0).all() and (batch.versions[start + plen:end][~mask] == -1).all()
            prompt_id = batch.prompt_ids[int(batch.group_index[i])]
            turns, env_runs = _replay(batch, i, {})
            for k, run in enumerate(env_runs):
                expected = env.answers[(prompt_id, k)].observation
                assert run == expected[:len(run)] and (len(run) == len(expected) or end - start - plen == cap)
            assert all(t[-1] in STOPS for t in turns[:len(env_runs)])


def _sampling() -> SamplingParams:
    return SamplingParams(temperature=1.0, stop_token_ids=STOPS)


async def _steps(config: SchedulerConfig, prompts: list[Prompt], env: ScriptedEnv, steps: int | None, *,
                 restart_at: int | None = None, tool_timeout_s: float = 30.0, deterministic: bool = False,
                 seed: int = 0) -> tuple[list[Any], LlamaForCausalLM]:
    """``steps`` rollout steps on the embedded engine (None: until the data ran out and a step trains nothing);
    with ``restart_at``, the loop's and the scheduler's states are saved after that many steps and a new
    scheduler, engine and loop continue from them."""
    reference = _model(seed)

    def build(state: dict[str, Any] | None) -> tuple[Scheduler, RolloutLoop, AsyncEngine]:
        sched = Scheduler(config, ListDataSource(prompts))
        if state is not None:
            sched.load_state_dict(state)
        engine = AsyncEngine(_core(_model(seed)))
        loop = RolloutLoop(engine, sched, None, sampling=_sampling(), environment=env, seed=seed,
                           tool_timeout_s=tool_timeout_s, deterministic=deterministic)
        return sched, loop, engine

    results = []
    async with contextlib.AsyncExitStack() as stack:
        sched, loop, engine = build(None)
        await stack.enter_async_context(engine)
        for step in range(steps if steps is not None else 60):
            if steps is None and results and results[-1].batch.n_groups == 0:
                break
            if step == restart_at:
                await loop.drain_rewards()
                state, saved = sched.state_dict(), loop.environment_state()
                await loop.abort_carried()
                await loop.close()  # the old run's tool calls die with it
                sched, loop, engine = build(state)
                await stack.enter_async_context(engine)
                assert saved is not None
                loop.load_environment_state(saved)
            results.append(await asyncio.wait_for(loop.run_step(0), 60))
        await loop.close()
    return results, reference


def _assert_every_group_trained_once(results: list[Any], prompts: list[Prompt], n: int) -> None:
    """Run until the data ran out: every prompt's group was trained, once, whole (none lost, none twice)."""
    assert results[-1].batch.n_groups == 0
    counts: dict[Any, int] = {}
    for pid, _ in _trained(results):
        counts[pid] = counts.get(pid, 0) + 1
    assert counts == {p.id: n for p in prompts}


def _trained(results: list[Any]) -> list[Any]:
    return [(r.batch.prompt_ids[int(r.batch.group_index[i])], int(r.batch.sample_ids[i]))
            for r in results for i in range(r.batch.n_samples)]


APRIL = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4, max_response_len=40)


def test_turns_go_to_the_environment_and_its_tokens_are_never_trained(one_thread) -> None:
    env = ScriptedEnv()
    prompts = _prompts(40, [{"turns": t, "obs_len": 3, "latency": [0.01]} for t in (0, 1, 2, 3)])
    results, reference = asyncio.run(_steps(APRIL, prompts, env, 4))
    for r in results:
        assert r.batch.n_groups == 2
        _check_batch(r.batch, reference, env, APRIL.max_response_len)
        assert r.metrics.env["tool_calls"] >= 0 and r.metrics.scheduler["batch_env_tokens"] >= 0
    trained = _trained(results)
    assert len(set(s for _, s in trained)) == len(trained)
    env_tokens = sum(r.metrics.scheduler["batch_env_tokens"] for r in results)
    assert env_tokens > 0 and sum(r.metrics.env["observations"] for r in results) > 0


def test_the_rewards_are_the_environments_and_a_reward_fn_is_refused(one_thread) -> None:
    env = ScriptedEnv()
    prompts = _prompts(20, [{"turns": 1, "obs_len": 2, "latency": []}])
    results, _ = asyncio.run(_steps(APRIL, prompts, env, 2))
    for r in results:
        b = r.batch
        for i in range(b.n_samples):
            if b.finish_reasons[i] == 0:  # stopped: the environment ended it with its reward
                prompt_id = b.prompt_ids[int(b.group_index[i])]
                turns, _ = _replay(b, i, {})
                final = env.answers[(prompt_id, len(turns) - 1)]
                assert final.done
    with pytest.raises(InvalidArgumentError, match="takes its rewards from the environment"):
        RolloutLoop(AsyncEngine(_core(_model())), Scheduler(APRIL, ListDataSource(prompts)), lambda p, r: 1.0,
                    environment=env)
    with pytest.raises(InvalidArgumentError, match="reward_fn=None is not callable"):
        RolloutLoop(AsyncEngine(_core(_model())), Scheduler(APRIL, ListDataSource(prompts)), None)


def test_a_trajectory_whose_tool_runs_at_the_step_boundary_waits_and_is_trained_later_whole(one_thread) -> None:
    # Slow tools on half the prompts: the fast ones complete the step while the slow ones still wait.
    env = ScriptedEnv()
    scripts = [{"turns": 1, "obs_len": 2, "latency": [0.0]}, {"turns": 1, "obs_len": 2, "latency": [0.4]}]
    results, reference = asyncio.run(_steps(APRIL, _prompts(40, scripts), env, 6))
    waiting = [r.metrics.env["waiting_at_boundary"] for r in results]
    assert max(waiting) > 0, waiting
    slow = [pid for pid, _ in _trained(results) if int(pid[1:]) % 2 == 1]
    assert slow, "no slow trajectory was trained"
    for r in results:
        _check_batch(r.batch, reference, env, APRIL.max_response_len)


def test_tool_errors_and_timeouts_end_one_trajectory_with_reward_0(one_thread) -> None:
    env = ScriptedEnv()
    scripts = [{"turns": 2, "obs_len": 2, "latency": [], "fail": (0,)},
               {"turns": 2, "obs_len": 2, "latency": [], "hang": (1,)},
               {"turns": 1, "obs_len": 2, "latency": []}]
    results, _ = asyncio.run(_steps(APRIL, _prompts(30, scripts), env, 4, tool_timeout_s=0.3))
    finished = {k: sum(r.metrics.env.get(k, 0) for r in results) for k in ("tool_errors", "tool_timeouts")}
    assert finished["tool_errors"] > 0 and finished["tool_timeouts"] > 0, finished
    for r in results:
        b = r.batch
        for i in range(b.n_samples):
            script = int(b.prompt_ids[int(b.group_index[i])][1:]) % 3
            turns, env_runs = _replay(b, i, {})
            if script == 0 and turns and turns[0][-1] in STOPS:
                assert b.rewards[i] == 0.0 and not env_runs  # its first call failed
            if script == 1 and len(env_runs) == 1 and b.finish_reasons[i] == 0:
                assert b.rewards[i] == 0.0  # its second call timed out


def test_a_save_and_restart_while_tools_run_loses_and_repeats_nothing(one_thread) -> None:
    env = ScriptedEnv()
    scripts = [{"turns": 2, "obs_len": 3, "latency": [0.0, 0.3]}, {"turns": 1, "obs_len": 2, "latency": [0.2]}]
    prompts = _prompts(16, scripts)
    results, reference = asyncio.run(_steps(APRIL, prompts, env, None, restart_at=2))
    assert results[1].metrics.env["waiting_at_boundary"] > 0, [r.metrics.env for r in results[:2]]
    for r in results:
        _check_batch(r.batch, reference, env, APRIL.max_response_len)
    _assert_every_group_trained_once(results, prompts, APRIL.n_samples_per_prompt)


def test_a_deterministic_run_with_tools_repeats_exactly(one_thread) -> None:
    scripts = [{"turns": t, "obs_len": 2, "latency": [0.01, 0.03]} for t in (0, 1, 2)]

    def run() -> list[tuple[Any, ...]]:
        results, _ = asyncio.run(_steps(APRIL, _prompts(40, scripts), ScriptedEnv(), 4, deterministic=True))
        return [(r.batch.tokens.tolist(), r.batch.loss_mask.tolist(), r.batch.rewards.tolist(),
                 r.batch.sample_ids.tolist()) for r in results]

    assert run() == run()


@st.composite
def _scenario(draw: st.DrawFn) -> dict[str, Any]:
    n_groups, n = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    scripts = [{"turns": draw(st.integers(0, 3)), "obs_len": draw(st.integers(1, 12)),
                "latency": draw(st.lists(st.sampled_from([0.0, 0.002, 0.02, 0.08]), min_size=1, max_size=3)),
                "fail": tuple(draw(st.sets(st.integers(0, 3), max_size=1))),
                "hang": tuple(draw(st.sets(st.integers(0, 3), max_size=1)))}
               for _ in range(draw(st.integers(1, 4)))]
    tail = draw(st.booleans())
    config = SchedulerConfig(
        rollout_batch_size=n_groups, n_samples_per_prompt=n, over_sampling_batch_size=n_groups + draw(st.integers(0, 2)),
        tail_batching=tail, tail_extra_samples=draw(st.integers(0, 1)) if tail else 0,
        max_response_len=draw(st.sampled_from([12, 24, 40])),
        step_boundary=draw(st.sampled_from(["abort", "carry"])),
        max_staleness=draw(st.sampled_from([None, 0, 1])),
        staleness_policy=draw(st.sampled_from(["keep", "mask", "restart"])))
    return {"config": config, "scripts": scripts, "prompts": draw(st.integers(2, 8)),
            "restart_at": draw(st.one_of(st.none(), st.integers(1, 3)))}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_scenario())
def test_property_every_trained_token_is_the_served_models_and_no_env_token_is_trained(one_thread, scenario) -> None:
    env = ScriptedEnv()
    config = scenario["config"]
    prompts = _prompts(scenario["prompts"], scenario["scripts"])
    results, reference = asyncio.run(_steps(config, prompts, env, None, restart_at=scenario["restart_at"],
                                            tool_timeout_s=0.2))
    for r in results[:-1]:
        assert r.batch.n_groups in range(1, config.rollout_batch_size + 1)
        _check_batch(r.batch, reference, env, config.max_response_len)
    _assert_every_group_trained_once(results, prompts, config.n_samples_per_prompt)


def test_the_lookup_task_runs_on_the_loop_and_a_perfect_trajectory_scores_1(one_thread) -> None:
    task = LookupTask(LookupTaskConfig(latency_median_s=0.001, latency_p99_s=0.01, max_hops=2))
    prompts = task.prompts(0, 50)
    config = dataclasses.replace(APRIL, max_response_len=task.max_response_len())

    async def run() -> list[Any]:
        model = LlamaForCausalLM(task.model_config())
        model.init_weights(0)
        sched = Scheduler(config, ListDataSource(prompts))
        async with AsyncEngine(EngineCore(model, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=32))) as eng:
            loop = RolloutLoop(eng, sched, None, sampling=SamplingParams(stop_token_ids=task.stop_token_ids),
                               environment=LookupEnvironment(task))
            out = [await asyncio.wait_for(loop.run_step(0), 60) for _ in range(3)]
            await loop.close()
            return out

    results = asyncio.run(run())
    for r in results:
        b = r.batch
        assert b.n_groups == 2 and set(np.unique(b.rewards)) <= {0.0, 0.5, 1.0}
        assert r.metrics.scheduler["batch_env_tokens"] == int(
            sum(b.offsets[i + 1] - b.offsets[i] - b.prompt_lens[i] for i in range(b.n_samples)) - b.loss_mask.sum())


def test_an_observation_that_completes_a_group_drops_the_end_of_its_cancelled_sample(one_thread) -> None:
    # Two answers reach one hand-over: sample 0's observation fills it to the cap (its group's n-th sample done),
    # which cancels surplus sample 1 (tail_extra_samples), whose own end must then be dropped, not applied.
    config = SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=1,
                             max_response_len=6, tail_batching=True, tail_extra_samples=1)
    env = ScriptedEnv()
    prompts = _prompts(4, [{"turns": 1, "obs_len": 6, "latency": []}])

    async def run() -> tuple[Scheduler, list[str]]:
        sched = Scheduler(config, ListDataSource(prompts))
        loop = RolloutLoop(AsyncEngine(_core(_model())), sched, None, environment=env)
        sched.begin_step(0)
        requests = sched.dispatch()
        for r in requests:
            await loop._env.start(r.sample_id, r.group_id, prompts[r.prompt_index])
            sched.on_tokens(r.sample_id, [STOPS[0]], [-1.0], 0)
            sched.on_env_wait(r.sample_id)
        loop._env._live[0].answer = EnvStep.observe((5, 5, 5, 5, 5, 5))
        loop._env._live[1].answer = EnvStep.finish(1.0, "answer")
        loop._flush()
        return sched, [sched.sample(s).state for s in (0, 1)]

    sched, states = asyncio.run(run())
    assert states == ["done", "cancelled"]
    (group,) = sched.pop_completed_groups()
    assert group.sample_ids.tolist() == [0]


class FailingStartEnv(ScriptedEnv):
    """ScriptedEnv whose start raises for a script with "start": "raise" and outlives any timeout for "hang"."""

    async def start(self, prompt: Prompt) -> dict[str, Any]:
        if prompt.metadata.get("start") == "raise":
            raise KeyError("this record has no table")
        if prompt.metadata.get("start") == "hang":
            await asyncio.sleep(3600)
        return await super().start(prompt)


def test_a_start_that_fails_ends_its_trajectory_with_reward_0_and_the_run_goes_on(one_thread) -> None:
    env = FailingStartEnv()
    scripts = [{"turns": 1, "obs_len": 2, "latency": [0.01]}, {"turns": 1, "obs_len": 2, "latency": [], "start": "raise"},
               {"turns": 0, "obs_len": 1, "latency": [], "start": "hang"}]
    prompts = _prompts(9, scripts)
    results, reference = asyncio.run(_steps(APRIL, prompts, env, None, tool_timeout_s=0.3))
    assert sum(r.metrics.env.get("finished_start_error", 0) for r in results) == 2 * 6  # 6 prompts of 2 samples
    for r in results[:-1]:
        _check_batch(r.batch, reference, env, APRIL.max_response_len)
        b = r.batch
        for i in range(b.n_samples):
            if b.metadata[int(b.group_index[i])].get("start"):  # never started: no token, reward 0
                assert int(b.offsets[i + 1] - b.offsets[i]) == int(b.prompt_lens[i]) and b.rewards[i] == 0.0
    _assert_every_group_trained_once(results, prompts, APRIL.n_samples_per_prompt)


def test_carry_keeps_trajectories_in_the_engine_across_the_update_mid_turn_beside_others_mid_tool(one_thread) -> None:
    """step_boundary="carry" with an environment and a new policy each step: at the boundaries some trajectories
    are in the engine mid-turn (carried, their KV kept in place through the update) while others wait on their
    tool. Every trained model token has the logprob the engine streamed for it (token-exact bookkeeping across the
    boundary); where its whole context was computed by the weights of the version it is stamped with (not after a
    mid-turn update, which keeps the older weights' KV by design), rescoring by that version's weights gives it.
    Env tokens are never trained and are the environment's answers; samples are trained with a version change
    inside one model turn (carried) and across a tool call (waited, then re-prefilled)."""
    config = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=6,
                             max_response_len=48, step_boundary="carry")
    env = ScriptedEnv()
    scripts = [{"turns": 2, "obs_len": 2, "latency": [0.0, 0.2]}, {"turns": 1, "obs_len": 3, "latency": [0.1]}]
    prompts = _prompts(80, scripts)
    steps = 6
    models = [_model(seed) for seed in range(steps + 1)]
    boundaries: list[tuple[int, float]] = []
    streamed: dict[tuple[int, int], float] = {}  # (sample id, response position) -> the logprob the engine streamed

    async def main() -> list[Any]:
        results = []
        sched = Scheduler(config, ListDataSource(prompts))
        async with AsyncEngine(_core(_model(0))) as engine:
            generate = engine.generate

            async def recorded(input_ids: list[int], params: Any = None, request_id: Any = None) -> Any:
                sid, at = int(request_id.split("-")[1]), len(input_ids) - 3  # every prompt has 3 tokens
                async for chunk in generate(input_ids, params, request_id):
                    for lp in chunk.logprobs:
                        streamed[(sid, at)] = lp
                        at += 1
                    yield chunk

            engine.generate = recorded  # type: ignore[method-assign]
            loop = RolloutLoop(engine, sched, None, sampling=SamplingParams(temperature=1.0, stop_token_ids=(4, 5)),
                               environment=env, seed=1)
            for version in range(steps):
                result = await asyncio.wait_for(loop.run_step(version), 60)
                results.append(result)
                boundaries.append((loop.carried, result.metrics.env["waiting_at_boundary"]))
                await engine.update_weights(dict(models[version + 1].state_dict()), version + 1)
            await loop.abort_carried()
            await loop.close()
        return results

    results = asyncio.run(main())
    assert any(carried > 0 and waiting > 0 for carried, waiting in boundaries[:-1]), boundaries
    assert sum(r.metrics.scheduler["carried_samples"] for r in results[1:]) > 0
    mid_turn = mid_tool = carried_after_tool = rescored_tokens = 0
    with torch.inference_mode():
        for r in results:
            b = r.batch
            for i in range(b.n_samples):
                start, end, plen = int(b.offsets[i]), int(b.offsets[i + 1]), int(b.prompt_lens[i])
                sid = int(b.sample_ids[i])
                ids = torch.as_tensor(b.tokens[start:end], dtype=torch.int64)
                mask = b.loss_mask[start + plen:end].astype(bool)
                versions = b.versions[start + plen:end]
                held = b.behavior_logprobs[start + plen:end]
                assert (held[~mask] == 0).all() and (versions[~mask] == -1).all() and (versions[mask] >= 0).all()
                model_at = np.flatnonzero(mask)
                assert [streamed[(sid, int(k))] for k in model_at] == pytest.approx(held[mask].tolist(), abs=1e-6)
                # Tokens of a turn after a version change inside it ran on the older weights' KV (carry).
                exact = mask.copy()
                for a, c in zip(model_at[:-1], model_at[1:]):
                    if versions[c] != versions[a]:
                        if c == a + 1:
                            mid_turn += 1
                            # A trajectory carried in a later turn: its KV spans model and env tokens.
                            carried_after_tool += bool((~mask[:a]).any())
                            k = c
                            while k < len(mask) and mask[k]:
                                exact[k] = False
                                k += 1
                        else:
                            mid_tool += 1
                for v in set(versions[exact].tolist()):
                    rescored = torch.log_softmax(models[v](ids).float(), -1)[plen - 1:-1].gather(
                        -1, ids[plen:, None]).squeeze(-1).numpy()
                    pick = exact & (versions == v)
                    np.testing.assert_allclose(held[pick], rescored[pick], atol=2e-3)
                    rescored_tokens += int(pick.sum())
                prompt_id = b.prompt_ids[int(b.group_index[i])]
                _, env_runs = _replay(b, i, {})
                for k, run in enumerate(env_runs):
                    assert run == env.answers[(prompt_id, k)].observation[:len(run)]
    assert mid_turn > 0 and mid_tool > 0 and carried_after_tool > 0 and rescored_tokens > 0, (
        mid_turn, mid_tool, carried_after_tool, rescored_tokens)
