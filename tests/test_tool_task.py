"""The multi-turn lookup task (april_ext.tasks.lookup): prompts and their hidden tables, the environment's
answer to each kind of turn and its rewards, a scripted perfect policy through step_with_timeout, and the
tool's long-tailed latencies."""

from __future__ import annotations

import asyncio
import math
import pickle
import statistics
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from april_ext.data_source import DataSource, Prompt
from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.protocol import EnvStep, Environment, Segment, Trajectory, step_with_timeout
from april_ext.tasks import LognormalLatency, LookupEnvironment, LookupTask, LookupTaskConfig
from april_ext.tasks import lookup

# Tests that do not time the tool keep its latency near zero.
FAST = {"latency_median_s": 1e-4, "latency_p99_s": 2e-4}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def fast_task(**fields: Any) -> LookupTask:
    return LookupTask(LookupTaskConfig(**{**FAST, **fields}))


async def play(env: LookupEnvironment, prompt: Prompt, turns: list[tuple[int, ...]],
               timeout_s: float = 5.0) -> tuple[Trajectory, EnvStep, Any]:
    """Feeds the scripted turns to the environment as the loop will: each model turn, then the environment's
    tokens, until it is done. Returns the trajectory, the last step and the state."""
    state = await env.start(prompt)
    traj = Trajectory()
    for i, turn in enumerate(turns):
        traj = traj.append(Segment("model", turn, [-0.1] * len(turn), [i] * len(turn)))
        step = await step_with_timeout(env, state, turn, timeout_s)
        if step.done:
            return traj, step, state
        traj = traj.append(Segment("env", step.observation))
    raise AssertionError(f"not done after the scripted turns: {traj.token_ids}")


# Prompts --------------------------------------------------------------------------------------------------------

def test_prompts_are_deterministic_and_well_formed() -> None:
    task = LookupTask(LookupTaskConfig(seed=3, max_hops=3, max_tool_calls=3))
    a, b = task[17], LookupTask(LookupTaskConfig(seed=3, max_hops=3, max_tool_calls=3))[17]
    assert a == b and isinstance(task, DataSource) and len(task) == 1_000_000
    chain, value = a.metadata["chain"], a.metadata["label"]
    assert a.token_ids == (task.bos_id, chain[0], task.sep_id) and a.metadata["task"] == "lookup"
    assert all(task.is_key(k) for k in chain) and len(set(chain)) == len(chain)
    assert len(value) == 1 and task.is_value(value[0]) and not task.is_key(value[0])
    assert all(0 <= t < task.vocab_size for t in (*a.token_ids, *value))
    assert task.prompts(0, 20) != LookupTask(LookupTaskConfig(seed=4, max_hops=3, max_tool_calls=3)).prompts(0, 20)
    with pytest.raises(IndexError):
        LookupTask(LookupTaskConfig(n_prompts=5))[5]


def test_the_value_is_hidden_from_the_prompt() -> None:
    """Prompts with the same key have all sorts of values: only the tool can tell which."""
    task = LookupTask()
    by_key: dict[int, set[int]] = {}
    for p in task.prompts(0, 2000):
        by_key.setdefault(p.token_ids[1], set()).add(p.metadata["label"][0])
    assert len(by_key) == task.config.n_keys
    assert all(len(values) == task.config.n_values for values in by_key.values())


def test_chain_lengths_halve_up_to_the_cap() -> None:
    task = LookupTask(LookupTaskConfig(max_hops=4, max_tool_calls=4, max_turns=5))
    hops = np.array([len(p.metadata["chain"]) for p in task.prompts(0, 4000)])
    share = [float((hops == h).mean()) for h in (1, 2, 3, 4)]
    assert hops.min() == 1 and hops.max() == 4
    assert share[0] == pytest.approx(0.5, abs=0.03) and share[1] == pytest.approx(0.25, abs=0.03)
    assert share[2] == pytest.approx(0.125, abs=0.02) and share[3] == pytest.approx(0.125, abs=0.02)
    assert {len(p.metadata["chain"]) for p in LookupTask().prompts(0, 200)} == {1}


def test_table_and_target() -> None:
    task = LookupTask()
    k0, k1, k2, v = task.key_id(0), task.key_id(5), task.key_id(2), task.value_id(3)
    p = Prompt(id="p", token_ids=(1, k0, 3), metadata={"label": (v,), "chain": (k0, k1, k2)})
    assert task.table(p) == {k0: (k1,), k1: (k2,), k2: (v,)}
    assert task.target(p) == [(k0, task.eot_id), (k1, task.eot_id), (k2, task.eot_id), (v, task.eos_id)]


@pytest.mark.parametrize("fields, match", [
    ({"n_keys": 0}, "n_keys must be an integer >= 1"),
    ({"value_len": 1.5}, "value_len must be an integer >= 1"),
    ({"max_hops": 9}, r"max_hops must be <= n_keys \(8"),
    ({"max_hops": 2, "max_tool_calls": 1}, r"max_tool_calls must be >= max_hops \(2\)"),
    ({"max_hops": 3, "max_tool_calls": 3, "max_turns": 3}, r"max_turns must be >= max_hops \+ 1 \(4"),
    ({"found_credit": 1.0}, r"found_credit must be a number in \[0, 1\)"),
    ({"found_credit": -0.1}, "found_credit"),
    ({"seed": -1}, "seed must be an integer >= 0"),
    ({"latency_median_s": 0.0}, "latency_median_s / latency_p99_s: LognormalLatency.median_s must be a positive"),
    ({"latency_median_s": 0.5, "latency_p99_s": 0.1}, r"p99_s must be >= median_s \(0.5\)"),
    ({"latency_p99_s": math.inf}, "p99_s must be a positive finite number"),
])
def test_config_validation(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LookupTaskConfig(**fields)


def test_model_config_fits_the_vocabulary_and_the_responses() -> None:
    task = LookupTask(LookupTaskConfig(max_hops=2, max_tool_calls=2, value_len=2))
    cfg = task.model_config()
    assert cfg.vocab_size == task.vocab_size == 7 + 8 + 8
    # 2 hops: K0 EOT | RESULT K1 | K1 EOT | RESULT V V | V V EOS = 12 tokens; twice that.
    assert task.max_response_len() == 24
    assert cfg.max_position_embeddings >= 3 + task.max_response_len()
    assert task.model_config(hidden_size=32).hidden_size == 32


# Environment -----------------------------------------------------------------------------------------------------

def test_the_environment_implements_the_protocol_and_its_state_pickles() -> None:
    task = fast_task()
    env = LookupEnvironment(task)
    assert isinstance(env, Environment)
    state = run(env.start(task[0]))
    assert pickle.loads(pickle.dumps(state)) == state


@pytest.mark.parametrize("max_hops", [1, 3])
def test_a_perfect_policy_earns_reward_one(max_hops: int) -> None:
    """The scripted policy copies: the prompt's key into the first call, each tool output into the next
    turn, ending with the value and EOS. The model tokens are exactly the target turns, the rest masked."""
    task = fast_task(max_hops=max_hops, max_tool_calls=max_hops, max_turns=max_hops + 1)
    env = LookupEnvironment(task)
    for prompt in task.prompts(0, 40):
        traj, step, state = run(play(env, prompt, task.target(prompt)))
        assert step == EnvStep.finish(1.0, "answer")
        chain = prompt.metadata["chain"]
        assert state.tool_calls == len(chain) and state.turns == len(chain) + 1 and state.found
        model = [t for t, m in zip(traj.token_ids, traj.loss_mask()) if m]
        assert model == [t for turn in task.target(prompt) for t in turn]
        env_tokens = [s.token_ids for s in traj.segments if s.kind == "env"]
        last = (task.result_id, *prompt.metadata["label"])
        assert env_tokens == [(task.result_id, nxt) for nxt in chain[1:]] + [last]
        assert len(traj) <= task.max_response_len() // 2


def _one_hop() -> tuple[LookupTask, Prompt, int, int]:
    task = fast_task()
    k, v = task.key_id(2), task.value_id(5)
    return task, Prompt(id="p", token_ids=(1, k, 3), metadata={"label": (v,), "chain": (k,)}), k, v


def test_rewards() -> None:
    task, p, k, v = _one_hop()
    env, eot, eos = LookupEnvironment(task), task.eot_id, task.eos_id
    wrong = task.value_id(6)

    def final(turns: list[tuple[int, ...]]) -> EnvStep:
        return run(play(env, p, turns))[1]

    assert final([(k, eot), (v, eos)]).reward == 1.0
    # Junk before the key and before the value is ignored: the last key / value token counts.
    assert final([(task.key_id(0), 9, k, 3, eot), (wrong, 1, v, eos)]).reward == 1.0
    # The tool returned the value, the answer is wrong: found_credit.
    assert final([(k, eot), (wrong, eos)]) == EnvStep.finish(0.5, "answer")
    assert final([(k, eot), (eos,)]).reward == 0.5
    # A right guess without the tool earns nothing; so does a wrong key's lookup.
    assert final([(v, eos)]) == EnvStep.finish(0.0, "answer")
    assert final([(task.key_id(3), eot), (v, eos)]).reward == 0.0
    binary = LookupEnvironment(fast_task(found_credit=0.0))
    assert run(play(binary, p, [(k, eot), (wrong, eos)]))[1].reward == 0.0


def test_unknown_keys_and_keyless_calls_answer_not_found() -> None:
    task, p, k, v = _one_hop()
    env = LookupEnvironment(task)

    async def main() -> tuple[list[EnvStep], Any]:
        state = await env.start(p)
        steps = [await env.step(state, (task.key_id(7), task.eot_id)),  # a key not in the table: a tool call
                 await env.step(state, (task.value_id(1), task.eot_id))]  # no key: a turn, no tool call
        return steps, state

    steps, state = run(main())
    assert [s.observation for s in steps] == [(task.result_id, task.not_found_id)] * 2
    assert state.turns == 2 and state.tool_calls == 1 and not state.found


def test_turn_and_tool_call_limits() -> None:
    task, p, k, v = _one_hop()
    eot, other = task.eot_id, task.key_id(7)
    # Three tool calls are allowed; the fourth call ends the trajectory (max_turns 5 leaves room for it).
    env = LookupEnvironment(fast_task(max_tool_calls=3, max_turns=5))
    traj, step, state = run(play(env, p, [(other, eot)] * 3 + [(k, eot)]))
    assert step.done and step.finish_reason == "max_tool_calls" and step.reward == 0.0 and state.tool_calls == 3
    # After finding the value, running out still earns the found credit.
    env = LookupEnvironment(fast_task(max_tool_calls=1, max_turns=5))
    assert run(play(env, p, [(k, eot), (k, eot)]))[1] == EnvStep.finish(
        0.5, "max_tool_calls", "a tool call after 1 calls")
    # A call in the last turn leaves no turn to answer: max_turns, without calling the tool.
    env = LookupEnvironment(fast_task(max_tool_calls=3, max_turns=3))
    traj, step, state = run(play(env, p, [(task.value_id(0), eot), (other, eot), (k, eot)]))
    assert step.finish_reason == "max_turns" and step.reward == 0.0 and state.tool_calls == 1 and state.turns == 3


def test_a_turn_must_end_with_a_stop_token() -> None:
    task, p, k, v = _one_hop()
    env = LookupEnvironment(task)
    state = run(env.start(p))
    with pytest.raises(InvalidArgumentError, match=r"ends with EOT \(4: a tool call\) or EOS \(2: the answer\)"):
        run(env.step(state, (k,)))
    assert task.stop_token_ids == (task.eot_id, task.eos_id)


def test_a_tool_past_the_timeout_ends_the_trajectory_and_leaves_the_state() -> None:
    task = LookupTask(LookupTaskConfig(latency_median_s=5.0, latency_p99_s=5.0))
    prompt = task[0]
    env = LookupEnvironment(task)

    async def main() -> tuple[EnvStep, Any]:
        state = await env.start(prompt)
        return await step_with_timeout(env, state, (prompt.token_ids[1], task.eot_id), timeout_s=0.05), state

    step, state = run(main())
    assert step == EnvStep.finish(0.0, "tool_timeout", "LookupEnvironment.step did not answer within 0.05 s")
    assert state.turns == 0 and state.tool_calls == 0 and not state.found


# Latency ------------------------------------------------------------------------------------------------------

_Z99 = statistics.NormalDist().inv_cdf(0.99)


@pytest.mark.parametrize("median_s, p99_s", [(0.02, 0.5), (0.1, 10.0), (0.3, 0.3)])
def test_latency_quantiles_match_the_configuration(median_s: float, p99_s: float) -> None:
    """A big seeded sample's p99 and median match the configured ones within sampling error: in log space
    a sample quantile q of n normal draws has standard error sqrt(q (1 - q) / n) / phi(z_q) sigmas; the
    test allows 4 of them."""
    latency = LognormalLatency(median_s, p99_s)
    n = 200_000
    draws = latency.sample(np.random.default_rng(0), n)
    assert draws.shape == (n,) and (draws > 0).all()
    normal = statistics.NormalDist()
    for q, configured in ((0.99, p99_s), (0.5, median_s)):
        stderr = latency.sigma * math.sqrt(q * (1 - q) / n) / normal.pdf(normal.inv_cdf(q))
        assert abs(math.log(np.quantile(draws, q) / configured)) <= 4 * stderr + 1e-12
    assert latency.sigma == pytest.approx(math.log(p99_s / median_s) / _Z99)


def test_the_environment_waits_the_configured_long_tailed_latencies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tool call sleeps one draw of the config's lognormal, from the environment's seeded stream:
    the same seed gives the same waits; the defaults' p99 is 25x their median."""
    task = LookupTask()
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)

    # Only the lookup module's asyncio: the event loop itself keeps the real one.
    monkeypatch.setattr(lookup, "asyncio", SimpleNamespace(sleep=record))

    def waits(env: LookupEnvironment, n: int) -> list[float]:
        slept.clear()

        async def main() -> None:
            for prompt in task.prompts(0, n):
                state = await env.start(prompt)
                await env.step(state, (prompt.token_ids[1], task.eot_id))

        run(main())
        return list(slept)

    first = waits(LookupEnvironment(task), 20_000)
    assert len(first) == 20_000
    assert np.median(first) == pytest.approx(0.02, rel=0.05)
    assert np.quantile(first, 0.99) == pytest.approx(0.5, rel=0.15)
    assert waits(LookupEnvironment(task), 50) == first[:50]
    assert waits(LookupEnvironment(LookupTask(LookupTaskConfig(seed=1))), 50) != first[:50]
