"""The environment protocol (april_ext.protocol.environment): EnvStep's rules, step_with_timeout turning a
slow or failing tool into an ended trajectory without blocking the event loop, and the segment vocabulary
(Segment, Trajectory) a multi-turn sample is stored in."""

from __future__ import annotations

import asyncio
import math
import pickle
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from april_ext.data_source import Prompt
from april_ext.errors import AprilError, InvalidArgumentError
from april_ext.protocol import EnvStep, Environment, Segment, ToolError, Trajectory, step_with_timeout
from april_ext.protocol.environment import FINISH_TOOL_ERROR, FINISH_TOOL_TIMEOUT

PROMPT = Prompt(id="p", token_ids=(1, 2, 3))


class SleepyEnv:
    """A tool that sleeps ``delay_s`` (a real asyncio sleep), then answers [7] or, with ``fail``, raises."""

    def __init__(self, delay_s: float = 0.0, fail: BaseException | None = None) -> None:
        self.delay_s = delay_s
        self.fail = fail
        self.calls: list[tuple[int, ...]] = []

    async def start(self, prompt: Prompt) -> dict[str, int]:
        return {"turns": 0}

    async def step(self, state: dict[str, int], model_turn: Sequence[int]) -> EnvStep:
        self.calls.append(tuple(model_turn))
        await asyncio.sleep(self.delay_s)
        if self.fail is not None:
            raise self.fail
        state["turns"] += 1
        return EnvStep.observe([7])


class NotAnEnv:
    async def start(self, prompt: Prompt) -> None: ...


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# Protocol ------------------------------------------------------------------------------------------------

def test_an_object_with_start_and_step_is_an_environment() -> None:
    assert isinstance(SleepyEnv(), Environment)
    assert not isinstance(NotAnEnv(), Environment)
    assert issubclass(ToolError, AprilError) and issubclass(ToolError, RuntimeError)


def test_step_with_timeout_passes_the_step_through() -> None:
    env = SleepyEnv()

    async def main() -> tuple[EnvStep, Any]:
        state = await env.start(PROMPT)
        return await step_with_timeout(env, state, np.array([4, 5]), timeout_s=1.0), state

    step, state = run(main())
    assert step == EnvStep(observation=(7,)) and not step.done and step.reward is None
    assert state == {"turns": 1} and env.calls == [(4, 5)]


# EnvStep ---------------------------------------------------------------------------------------------------

def test_env_step_kinds() -> None:
    more = EnvStep.observe(np.array([5, 6]))
    assert more.observation == (5, 6) and not more.done and more.reward is None and more.finish_reason == ""
    end = EnvStep.finish(1, "answer")
    assert end.done and end.reward == 1.0 and isinstance(end.reward, float) and end.observation == ()
    assert EnvStep.finish(0.0, "tool_error", "boom").detail == "boom"


@pytest.mark.parametrize("kwargs, match", [
    ({"done": True, "reward": 1.0, "finish_reason": "answer", "observation": (3,)}, "carries no observation"),
    ({"done": True, "finish_reason": "answer"}, "final reward, a finite number, got None"),
    ({"done": True, "reward": math.nan, "finish_reason": "answer"}, "finite number"),
    ({"done": True, "reward": True, "finish_reason": "answer"}, "finite number, got True"),
    ({"done": True, "reward": 0.0}, "needs a finish_reason"),
    ({}, "must carry observation tokens"),
    ({"observation": (3,), "reward": 0.5}, "has no reward and no finish_reason"),
    ({"observation": (3,), "finish_reason": "answer"}, "has no reward and no finish_reason"),
    ({"observation": (3,), "done": 1}, "done must be a bool"),
    ({"observation": (-1,)}, r"in \[0, 2\*\*31 - 1\], got \[-1\]"),
    ({"observation": (2**31,)}, r"got \[2147483648\]"),
    ({"observation": (1.5,)}, "integer token ids"),
    ({"observation": "ab"}, "sequence of token ids, got a str"),
    ({"observation": (3,), "detail": None}, "must be strings"),
])
def test_env_step_rules(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        EnvStep(**kwargs)


# Timeouts, tool errors, concurrency ----------------------------------------------------------------------------

def test_a_step_past_its_timeout_ends_the_trajectory_without_waiting_for_the_tool() -> None:
    env = SleepyEnv(delay_s=5.0)

    async def main() -> tuple[EnvStep, float, dict[str, int]]:
        state = await env.start(PROMPT)
        start = time.perf_counter()
        step = await step_with_timeout(env, state, [4], timeout_s=0.05)
        return step, time.perf_counter() - start, state

    step, elapsed, state = run(main())
    assert step.done and step.reward == 0.0 and step.finish_reason == FINISH_TOOL_TIMEOUT == "tool_timeout"
    assert step.observation == () and "SleepyEnv.step did not answer within 0.05 s" in step.detail
    assert elapsed < 2.0  # cancelled at the timeout, not after the tool's 5 s
    assert state == {"turns": 0}  # the cancelled step changed nothing


def test_a_tools_own_timeout_error_is_a_tool_timeout() -> None:
    step = run(step_with_timeout(SleepyEnv(fail=TimeoutError("backend timed out")), {"turns": 0}, [4], 1.0))
    assert step.finish_reason == FINISH_TOOL_TIMEOUT and step.reward == 0.0


def test_a_tool_error_ends_the_trajectory_with_its_message() -> None:
    step = run(step_with_timeout(SleepyEnv(fail=ToolError("sandbox crashed")), {"turns": 0}, [4], 1.0))
    assert step.done and step.reward == 0.0 and step.finish_reason == FINISH_TOOL_ERROR == "tool_error"
    assert step.detail == "SleepyEnv.step: sandbox crashed"


def test_other_exceptions_are_bugs_and_propagate() -> None:
    with pytest.raises(KeyError, match="oops"):
        run(step_with_timeout(SleepyEnv(fail=KeyError("oops")), {"turns": 0}, [4], 1.0))


def test_a_step_that_returns_no_env_step_is_refused() -> None:
    class Sloppy(SleepyEnv):
        async def step(self, state: Any, model_turn: Sequence[int]) -> Any:
            return [7]

    with pytest.raises(InvalidArgumentError, match="Sloppy.step returned a list; an EnvStep is required"):
        run(step_with_timeout(Sloppy(), {}, [4], 1.0))


@pytest.mark.parametrize("turn, timeout_s, match", [
    ([], 1.0, "model_turn must hold at least one token id"),
    ([4, -2], 1.0, "model_turn must be token ids"),
    ("44", 1.0, "model_turn must be a sequence of token ids"),
    ([4], 0, "timeout_s must be a positive finite number"),
    ([4], -1.0, "positive finite"),
    ([4], math.inf, "positive finite"),
    ([4], True, "positive finite"),
])
def test_step_with_timeout_checks_its_arguments(turn: Any, timeout_s: Any, match: str) -> None:
    env = SleepyEnv()
    with pytest.raises(InvalidArgumentError, match=match):
        run(step_with_timeout(env, {"turns": 0}, turn, timeout_s))
    assert env.calls == []


def test_tool_calls_of_two_trajectories_overlap_and_the_loop_keeps_running() -> None:
    """Two trajectories' tool calls (real asyncio sleeps of 300 and 400 ms) take about the longer one, not
    the sum, and an engine-like task keeps stepping on the event loop while they run."""
    slow, slower = SleepyEnv(delay_s=0.3), SleepyEnv(delay_s=0.4)

    async def main() -> tuple[float, int, list[EnvStep]]:
        ticks = 0
        stop = asyncio.Event()

        async def generate() -> None:  # stands for the engine's token stream
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        engine = asyncio.create_task(generate())
        start = time.perf_counter()
        steps = await asyncio.gather(step_with_timeout(slow, {"turns": 0}, [4], 5.0),
                                     step_with_timeout(slower, {"turns": 0}, [5], 5.0))
        elapsed = time.perf_counter() - start
        stop.set()
        await engine
        return elapsed, ticks, steps

    elapsed, ticks, steps = run(main())
    assert [s.observation for s in steps] == [(7,), (7,)]
    assert 0.39 <= elapsed < 0.6, elapsed  # the longer call is 0.4 s; the sum would be 0.7 s
    assert ticks >= 20, ticks  # ~80 at 5 ms while the tools ran


# Segment -----------------------------------------------------------------------------------------------------

def test_segments_store_tuples() -> None:
    model = Segment("model", np.array([4, 5], dtype=np.int32), np.array([-0.5, -1.0], dtype=np.float32), [0, 1])
    assert model.token_ids == (4, 5) and model.logprobs == (-0.5, -1.0) and model.versions == (0, 1)
    assert all(type(t) is int for t in model.token_ids + model.versions) and len(model) == 2
    env = Segment("env", [9])
    assert env.logprobs == () and env.versions == ()
    assert pickle.loads(pickle.dumps(model)) == model


@pytest.mark.parametrize("args, match", [
    (("tool", [1]), r"kind must be one of \['model', 'env'\], got 'tool'"),
    (("env", []), "env Segment's token_ids must hold at least one token id"),
    (("env", [1], [-0.1]), "env Segment carries no logprobs and no versions"),
    (("env", [1], (), [0]), "got 0 logprobs and 1 versions"),
    (("model", [1, 2], [-0.1], [0, 0]), "one logprob per token: 2 tokens, got 1 logprobs"),
    (("model", [1, 2], [-0.1, -0.2], [0]), "one version per token: 2 tokens, got 1 versions"),
    (("model", [1], [math.inf], [0]), "logprobs must be finite"),
    (("model", [1], ["x"], [0]), "logprobs must be numbers"),
    (("model", [1], [-0.1], [-1]), "versions must be integers >= 0"),
    (("model", [1], [-0.1], [0.5]), "versions must be integers >= 0"),
    (("model", [1, 2], [-0.1, -0.2], [2, 1]), "versions must be non-decreasing"),
    (("model", [1, [2]], [-0.1, -0.2], [0, 0]), "integer token ids"),
    (("model", [True], [-0.1], [0]), "integer token ids"),
])
def test_segment_rules(args: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        Segment(*args)


# Trajectory --------------------------------------------------------------------------------------------------

def _model(ids: Sequence[int], version: int = 0) -> Segment:
    return Segment("model", ids, [-0.25] * len(ids), [version] * len(ids))


def test_trajectory_arrays_follow_the_batch_conventions() -> None:
    traj = Trajectory((_model([10, 11, 4]), Segment("env", [5, 20]), _model([20, 2], version=1)))
    assert traj.token_ids == (10, 11, 4, 5, 20, 20, 2) and len(traj) == 7
    assert traj.model_token_count == 5 and traj.env_token_count == 2
    assert traj.loss_mask().dtype == np.uint8 and traj.loss_mask().tolist() == [1, 1, 1, 0, 0, 1, 1]
    assert traj.behavior_logprobs().dtype == np.float32
    assert traj.behavior_logprobs().tolist() == [-0.25, -0.25, -0.25, 0.0, 0.0, -0.25, -0.25]
    assert traj.versions().dtype == np.int32 and traj.versions().tolist() == [0, 0, 0, -1, -1, 1, 1]
    assert pickle.loads(pickle.dumps(traj)) == traj


def test_append_merges_a_resumed_turn_into_its_segment() -> None:
    traj = Trajectory().append(_model([10], version=0)).append(_model([11, 4], version=1))
    assert len(traj.segments) == 1 and traj.segments[0].versions == (0, 1, 1)
    traj = traj.append(Segment("env", [5])).append(Segment("env", [20]))
    assert [s.kind for s in traj.segments] == ["model", "env"] and traj.segments[1].token_ids == (5, 20)
    with pytest.raises(InvalidArgumentError, match="append takes a Segment, got a list"):
        traj.append([1])  # type: ignore[arg-type]


def test_staleness_counts_model_tokens_only() -> None:
    assert Trajectory().staleness(5) == 0
    traj = Trajectory((_model([10], version=2),))
    assert traj.staleness(5) == 3
    # Environment tokens arriving under a newer policy carry no version: the trajectory is no staler.
    assert traj.append(Segment("env", [5])).staleness(5) == 3
    assert traj.append(Segment("env", [5])).append(_model([4], version=5)).staleness(5) == 3


def test_an_empty_trajectory_has_empty_arrays() -> None:
    traj = Trajectory()
    assert len(traj) == 0 and traj.token_ids == () and traj.loss_mask().shape == (0,)
    assert traj.model_token_count == traj.env_token_count == 0


@pytest.mark.parametrize("segments, match", [
    ((Segment("env", [5]),), "starts with a model segment"),
    ((_model([1]), _model([2])), r"segments\[0\] and segments\[1\] are both 'model' \(append\(\) merges them\)"),
    ((_model([1]), Segment("env", [5]), Segment("env", [6])), "are both 'env'"),
    ((_model([1], version=3), Segment("env", [5]), _model([2], version=2)),
     r"segments\[2\] starts at version 2 after version 3"),
    ((_model([1]), (5,)), r"segments\[1\] is a tuple; a Segment is required"),
])
def test_trajectory_rules(segments: tuple[Any, ...], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        Trajectory(segments)


def test_append_keeps_versions_non_decreasing() -> None:
    with pytest.raises(InvalidArgumentError, match="non-decreasing"):
        Trajectory((_model([1], version=3),)).append(_model([2], version=2))


_segment_specs = st.lists(st.tuples(st.sampled_from(["model", "env"]), st.integers(1, 6), st.integers(0, 2)),
                          max_size=12)


@settings(max_examples=60, deadline=None)
@given(_segment_specs)
def test_appended_segments_line_up_token_by_token(specs: list[tuple[str, int, int]]) -> None:
    """Whatever is appended (model runs of rising versions, env runs, in any order after a first model run),
    the per-token arrays line up with token_ids and the mask marks exactly the model tokens."""
    traj, version, expected = Trajectory(), 0, []
    for i, (kind, length, bump) in enumerate(specs):
        if not i:
            kind = "model"
        ids = [100 + len(expected) + j for j in range(length)]
        if kind == "model":
            version += bump
            traj = traj.append(Segment("model", ids, [-float(j) for j in range(length)], [version] * length))
        else:
            traj = traj.append(Segment("env", ids))
        expected += [(t, kind) for t in ids]
    assert traj.token_ids == tuple(t for t, _ in expected)
    mask = traj.loss_mask()
    assert mask.tolist() == [int(kind == "model") for _, kind in expected]
    assert int(mask.sum()) == traj.model_token_count and len(traj) - traj.model_token_count == traj.env_token_count
    assert ((traj.versions() == -1) == (mask == 0)).all()
    assert (traj.behavior_logprobs()[mask == 0] == 0).all()
    assert all(a.kind != b.kind for a, b in zip(traj.segments, traj.segments[1:]))
