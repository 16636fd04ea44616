"""The rollout loop: APRIL and the baseline over the embedded engine, abort timing with slow rewards,
abort results carrying unstreamed tokens, the group filter, a virtual clock, data running out."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
from _loop_utils import ScriptedEngine
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext import (
    InvalidArgumentError,
    ListDataSource,
    Prompt,
    Scheduler,
    SchedulerConfig,
)
from april_ext.algorithms import reject_uniform_groups
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutEngine, RolloutLoop, scheduler_config_for
from april_ext.tasks import CountingTask, CountingTaskConfig

TASK = CountingTask(CountingTaskConfig(n_symbols=2, max_count=8, median_count=3, sigma=0.5, seed=2))


def _scripted_data(lengths: list[int]) -> ListDataSource:
    """Prompt i asks the ScriptedEngine for lengths[i] tokens (the third prompt token is the length)."""
    return ListDataSource([Prompt(f"p{i}", [1, 5, n, 3]) for i, n in enumerate(lengths)])


def _length(ids) -> int:
    return int(ids[2])


def _reward_by_length(prompt: Prompt, response: np.ndarray) -> float:
    return float(len(response) % 3)


def _check_batch(batch, n_groups: int, n: int, cap: int) -> None:
    assert batch.n_groups == n_groups and batch.n_samples == n_groups * n
    for i in range(batch.n_samples):
        a, b = int(batch.offsets[i]), int(batch.offsets[i + 1])
        p = int(batch.prompt_lens[i])
        versions = batch.versions[a + p:b]
        assert 0 < b - a - p <= cap
        assert np.all(np.diff(versions) >= 0) and versions.max() <= batch.policy_version


async def _embedded_run(partial: bool, steps: int) -> list:
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=64))
    model.init_weights(0)
    cfg = scheduler_config_for(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4,
                                               over_sampling_batch_size=6, max_response_len=40), partial)
    sched = Scheduler(cfg, TASK)
    core = EngineCore(model, EngineConfig(num_blocks=256, max_num_seqs=64, memory_tag_prefix=f"rollout-{partial}-"))
    results = []
    async with AsyncEngine(core) as engine:
        assert isinstance(engine, RolloutEngine)
        loop = RolloutLoop(engine, sched, TASK.reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                           seed=3, engine_capacity=64)
        for version in range(steps):
            results.append(await loop.run_step(version))
            await engine.update_weights({}, version + 1)
        await loop.drain_rewards()
    return results


def test_april_over_the_embedded_engine_aborts_and_resumes(one_thread):
    results = asyncio.run(_embedded_run(True, 4))
    for r in results:
        _check_batch(r.batch, 2, 4, 40)
        m = r.metrics
        assert m.batch_groups == 2 and 0.0 <= m.occupancy <= 1.0
        assert m.generated_tokens == 0 or m.tokens_per_s > 0
        # The engine's model steps of this rollout: each yields at most one token per slot (64).
        assert m.generated_tokens <= 64 * m.engine_steps
        assert m.scheduler["batch_groups"] == 2
    # A random-init model stops at random lengths up to the cap: the long tail is aborted and resumed.
    assert sum(r.metrics.aborted_samples for r in results) > 0
    assert sum(r.metrics.engine_steps for r in results) > 0
    assert sum(r.metrics.resumed_requests for r in results) > 0
    assert max(r.metrics.scheduler["carried_token_ratio"] for r in results) > 0
    assert max(r.batch.versions.max() - r.batch.versions[r.batch.versions >= 0].min() for r in results) >= 1


def test_baseline_waits_for_every_sample_and_aborts_nothing(one_thread):
    results = asyncio.run(_embedded_run(False, 2))
    for r in results:
        _check_batch(r.batch, 2, 4, 40)
        m = r.metrics
        assert m.aborted_samples == 0 and m.resumed_requests == 0
        assert m.scheduler["carried_token_ratio"] == 0.0 and m.scheduler["buffered_groups"] == 0
        # Every generated token is in the batch: nothing is left over.
        assert m.generated_tokens == int(r.batch.response_lens.sum())


async def _deterministic_run(step_boundary: str, jitter: int | None, steps: int = 5) -> list:
    """APRIL (N' = 3N) over the embedded engine with deterministic=True. jitter: the seed of random sleeps (up to
    3 ms) before each of the engine's model steps and in each reward call (a worker thread); None: none."""
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, max_position_embeddings=64))
    model.init_weights(0)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=6,
                                      max_response_len=40, step_boundary=step_boundary), TASK)
    core = EngineCore(model, EngineConfig(num_blocks=256, max_num_seqs=64,
                                          memory_tag_prefix=f"det-{step_boundary}-{jitter}-"))
    rng = random.Random(jitter)

    def pause() -> None:
        if jitter is not None:
            time.sleep(rng.random() * 0.003)

    step = core.step
    core.step = lambda: (pause(), step())[1]  # type: ignore[method-assign]

    def reward(prompt: Prompt, response: np.ndarray) -> float:
        pause()
        return TASK.reward(prompt, response)

    out = []
    async with AsyncEngine(core) as engine:
        loop = RolloutLoop(engine, sched, reward, sampling=SamplingParams(stop_token_ids=(TASK.eos_id,)),
                           seed=3, engine_capacity=64, deterministic=True)
        assert loop.deterministic
        for version in range(steps):
            r = await loop.run_step(version)
            b, m = r.batch, r.metrics
            out.append({
                "arrays": [getattr(b, k).tolist() for k in ("tokens", "offsets", "behavior_logprobs", "versions",
                                                            "rewards", "sample_ids", "loss_mask")],
                "metrics": [m.generated_tokens, m.requests, m.resumed_requests, m.aborted_samples, m.engine_steps],
                "scheduler": {k: None if v != v else v for k, v in m.scheduler.items()}})  # NaN: None
            await engine.update_weights({}, version + 1)
        await loop.abort_carried()
        await loop.drain_rewards()
    return out


@pytest.mark.parametrize("step_boundary", ["abort", "carry"])
def test_deterministic_rollouts_repeat_whatever_the_engine_and_reward_timing(one_thread, step_boundary):
    """deterministic=True: random delays in the engine thread's steps and in the reward threads change nothing;
    the batches (tokens, logprobs, versions, rewards, their order), where the aborts cut and every counter are
    equal to those of an undelayed run."""
    plain = asyncio.run(_deterministic_run(step_boundary, None))
    # Samples were cut at a step's end: aborted and resumed, or carried.
    cut = "carried_samples" if step_boundary == "carry" else "resume_requests"
    assert any(step["scheduler"][cut] > 0 for step in plain)
    for jitter in (1, 2):
        assert asyncio.run(_deterministic_run(step_boundary, jitter)) == plain


def test_deterministic_needs_an_engine_that_steps_in_lockstep():
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1), _scripted_data([2]))
    assert not RolloutLoop(ScriptedEngine(_length), sched, _reward_by_length, deterministic=True).deterministic
    with pytest.raises(InvalidArgumentError, match="deterministic"):
        RolloutLoop(ScriptedEngine(_length), sched, _reward_by_length, deterministic=1)  # type: ignore[arg-type]


def test_baseline_config_is_one_flag():
    cfg = SchedulerConfig(rollout_batch_size=4, over_sampling_batch_size=8, refill="continuous")
    assert scheduler_config_for(cfg, True) is cfg
    base = scheduler_config_for(cfg, False)
    assert base.over_sampling_batch_size == 4 and base.refill == "batch"
    with pytest.raises(InvalidArgumentError, match="partial_rollout"):
        scheduler_config_for(cfg, 1)


@pytest.mark.parametrize("kind", ["async", "thread"])
def test_slow_reward_of_a_surplus_group_does_not_delay_the_abort(kind):
    """Groups 0 and 1 finish together; group 0 is rewarded at once (step done), group 1's reward takes
    0.5 s; group 2 is long (1.5 s). The abort must be issued before group 1's reward finishes, and that
    reward must still reach the scheduler (group 1 is the next step's batch, without generating)."""
    engine = ScriptedEngine(_length, delay=0.01)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=3,
                                      max_response_len=200), _scripted_data([3, 3, 150]))
    slow_done: list[float] = []

    if kind == "async":
        async def reward(prompt: Prompt, response: np.ndarray) -> float:
            if prompt.id == "p1":
                await asyncio.sleep(0.5)
                slow_done.append(time.perf_counter())
            return float(response[0] % 2 + len(response))
    else:
        def reward(prompt: Prompt, response: np.ndarray) -> float:
            if prompt.id == "p1":
                time.sleep(0.5)
                slow_done.append(time.perf_counter())
            return float(response[0] % 2 + len(response))

    async def run():
        loop = RolloutLoop(engine, sched, reward, clock=time.perf_counter)
        first = await loop.run_step(0)
        abort_at = time.perf_counter()
        pending = loop.pending_rewards
        await engine.update_weights({}, 1)
        second = await loop.run_step(1)
        return first, abort_at, pending, second

    first, abort_at, pending, second = asyncio.run(run())
    assert first.batch.prompt_ids == ["p0"]
    assert first.metrics.aborted_samples == 2  # group 2 (long) was cut
    assert pending >= 1 and slow_done and abort_at < slow_done[0]
    assert first.metrics.wall_s < 0.5
    # Group 1's reward arrived after the abort; it is the next batch, and group 2 resumes meanwhile.
    assert second.batch.prompt_ids == ["p1"]
    assert second.metrics.scheduler["carried_token_ratio"] == 1.0


@pytest.mark.parametrize("policy", ["restart", "drop"])
def test_a_surplus_groups_pending_reward_is_in_before_the_next_step_can_take_the_group_back(policy):
    """Group 1 completes first but its reward takes 0.2 s; group 0 completes later and makes step 0. At step 1
    group 1's tokens are past max_staleness 0, so begin_step restarts or drops it: its reward must have reached
    the scheduler before (it once arrived after and failed the run with InvalidStateError / UnknownIdError)."""
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=2,
                                      max_response_len=50, max_staleness=0, staleness_policy=policy),
                      _scripted_data([3, 1, 2, 2, 2, 2]))

    async def reward(prompt: Prompt, response: np.ndarray) -> float:
        if prompt.id == "p1":
            await asyncio.sleep(0.2)
        return 1.0

    async def run():
        engine = ScriptedEngine(_length, delay=0.001)
        loop = RolloutLoop(engine, sched, reward)
        batches = []
        for version in range(3):
            batches.append((await loop.run_step(version)).batch)
            await engine.update_weights({}, version + 1)
        await loop.drain_rewards()
        return batches

    batches = asyncio.run(run())
    # Rewarded before step 1, group 1 is accepted surplus: its tokens are too stale for step 1 under either
    # policy, so it is not trained with them.
    assert batches[0].prompt_ids == ["p0"]
    assert all(b.n_groups == 1 and b.versions.max() <= b.policy_version for b in batches)
    assert all(int(b.versions[b.loss_mask.astype(bool)].min()) == b.policy_version for b in batches)


def test_abort_results_deliver_tokens_the_stream_never_sent():
    engine = ScriptedEngine(_length, delay=0.002, abort_extra_tokens=2)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=2,
                                      max_response_len=100), _scripted_data([2, 80, 2]))

    async def run():
        loop = RolloutLoop(engine, sched, _reward_by_length)
        first = await loop.run_step(0)
        long_sample = sched.sample_ids("queued")
        views = [sched.sample(s) for s in long_sample]
        return first, views

    first, views = asyncio.run(run())
    assert first.metrics.aborted_samples == 1 and len(views) == 1
    tokens = views[0].token_ids.tolist()
    # Streamed tokens 10, 11, ... then the two abort-only tokens, all kept in order for the resume.
    assert tokens[-2:] == [99, 99] and tokens[:-2] == list(range(10, 10 + len(tokens) - 2))
    assert first.metrics.generated_tokens == 2 + len(tokens)


def test_a_request_the_engine_drops_is_resumed_within_the_step():
    engine = ScriptedEngine(_length, preempt_first_after=3)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=1, over_sampling_batch_size=2,
                                      max_response_len=20), _scripted_data([8, 5]))

    async def run():
        return await RolloutLoop(engine, sched, _reward_by_length).run_step(0)

    result = asyncio.run(run())
    batch = result.batch
    assert result.metrics.resumed_requests == 1 and result.metrics.aborted_samples == 0
    i = batch.prompt_ids.index("p0")
    dropped = batch.tokens[batch.offsets[i] + batch.prompt_lens[i]:batch.offsets[i + 1]].tolist()
    assert dropped == list(range(10, 18))  # 3 tokens, then the resume's 5, in order


def test_metrics_use_the_engine_clock():
    """A simulated engine's clock is virtual: the loop's durations are read from it, not from time.*."""
    engine = ScriptedEngine(_length, tick=1.0)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=1, over_sampling_batch_size=2,
                                      max_response_len=50), _scripted_data([4, 10]))

    async def run():
        return await RolloutLoop(engine, sched, _reward_by_length).run_step(0)

    start = time.perf_counter()
    result = asyncio.run(run())
    real = time.perf_counter() - start
    m = result.metrics
    assert real < 5.0
    # 10 rounds of generation: the first 4 with both requests running, then one.
    assert m.wall_s == pytest.approx(10.0, abs=1.01)
    assert m.tokens_per_s == pytest.approx(14 / m.wall_s)
    assert m.mean_inflight_samples == pytest.approx(14 / m.wall_s, rel=0.2)


def test_group_filter_drops_uniform_groups_and_launches_more():
    engine = ScriptedEngine(_length)
    # One group at a time; only p2's samples earn different rewards (the first sample of each group is
    # dispatched first and gets the lower sample id).
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=1,
                                      max_response_len=20), _scripted_data([3, 3, 3, 3]))
    first_sample = {}

    async def reward(prompt: Prompt, response: np.ndarray) -> float:
        await asyncio.sleep(0)
        if prompt.id != "p2":
            return 0.5
        return float(first_sample.setdefault(prompt.id, 0) == 0 and not first_sample.update({prompt.id: 1}))

    async def run():
        return await RolloutLoop(engine, sched, reward, group_filter=reject_uniform_groups).run_step(0)

    result = asyncio.run(run())
    assert result.batch.prompt_ids == ["p2"]
    assert result.metrics.scheduler["groups_filtered"] == 2


def test_data_running_out_ends_with_smaller_then_empty_batches():
    engine = ScriptedEngine(_length, tick=0.001)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=1, over_sampling_batch_size=2,
                                      max_response_len=20), _scripted_data([2, 3, 4]))

    async def run():
        loop = RolloutLoop(engine, sched, _reward_by_length)
        out = []
        for v in range(3):
            out.append(await loop.run_step(v))
            await engine.update_weights({}, v + 1)
        return out

    sizes = [r.batch.n_groups for r in asyncio.run(run())]
    assert sizes == [2, 1, 0]


def test_a_failing_reward_function_fails_the_step():
    engine = ScriptedEngine(_length, tick=0.001)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=1,
                                      max_response_len=20), _scripted_data([2, 3]))

    def reward(prompt: Prompt, response: np.ndarray) -> float:
        raise ValueError("verifier crashed on p0")

    async def run():
        await RolloutLoop(engine, sched, reward).run_step(0)

    with pytest.raises(ValueError, match="verifier crashed on p0"):
        asyncio.run(run())


def test_bad_arguments_are_named():
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1), _scripted_data([2]))
    with pytest.raises(InvalidArgumentError, match="a RolloutEngine needs generate"):
        RolloutLoop(object(), sched, _reward_by_length)  # type: ignore[arg-type]
    engine = ScriptedEngine(_length)
    with pytest.raises(InvalidArgumentError, match="reward_fn"):
        RolloutLoop(engine, sched, 3)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="engine_capacity=0"):
        RolloutLoop(engine, sched, _reward_by_length, engine_capacity=0)
