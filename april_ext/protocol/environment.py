"""The environment side of multi-turn, tool-using rollouts: the Environment protocol an agent's world
implements (start a trajectory from a prompt, answer each model turn with observation tokens or an end),
the typed ToolError and the per-call timeout that turn a failing or slow tool into an ended trajectory
(step_with_timeout), and the segment vocabulary a multi-turn sample is stored in: model segments (trained,
each token with its behavior logprob and policy version) and environment segments (tool output, user
turns: never trained, no logprob).

The rollout loop drives an Environment (april_ext.rollout.trajectories; docs/agentic.md).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import AprilError, InvalidArgumentError

# The scheduler stores token ids as int32 (docs/scheduler.md: on_tokens).
MAX_TOKEN_ID = 2**31 - 1

FINISH_TOOL_ERROR = "tool_error"
"""The finish reason of a trajectory whose tool raised ToolError (step_with_timeout)."""
FINISH_TOOL_TIMEOUT = "tool_timeout"
"""The finish reason of a trajectory whose step outlived its timeout (step_with_timeout)."""

FINISH_START_ERROR = "start_error"
"""The finish reason of a trajectory whose Environment.start raised or outlived the step timeout: it ends with
reward 0 before its first turn, and the run goes on."""

SegmentKind = Literal["model", "env"]
SEGMENT_KINDS: tuple[SegmentKind, ...] = ("model", "env")


class ToolError(AprilError, RuntimeError):
    """A tool an environment called failed (a crashed code runner, a search backend's error). Raised from
    Environment.step; step_with_timeout ends the trajectory with finish reason "tool_error" and reward 0,
    so one failing tool costs one trajectory and nothing else."""


def _token_ids(value: Any, what: str, *, allow_empty: bool) -> tuple[int, ...]:
    """``value`` as a tuple of token ids in [0, MAX_TOKEN_ID]; raises InvalidArgumentError naming ``what``."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise InvalidArgumentError(f"{what} must be a sequence of token ids, got a {type(value).__name__}")
    try:
        ids = np.asarray(value)
    except ValueError:  # ragged nesting
        ids = np.asarray(value, dtype=object)
    if ids.size == 0:
        if allow_empty:
            return ()
        raise InvalidArgumentError(f"{what} must hold at least one token id, got none")
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgumentError(f"{what} must be a 1-D sequence of integer token ids, got {list(value)[:5]!r}")
    bad = ids[(ids < 0) | (ids > MAX_TOKEN_ID)]
    if bad.size:
        raise InvalidArgumentError(f"{what} must be token ids in [0, 2**31 - 1], got {bad[:5].tolist()}")
    return tuple(ids.tolist())


@dataclass(frozen=True)
class EnvStep:
    """The environment's answer to one model turn: either the next turn's observation (tool output, a user
    turn: environment tokens the loop appends, masked out of the loss) or the end of the trajectory.

    observation: the tokens to append; non-empty when not done, empty when done (tokens after the last model
    turn would be trained on nothing). done: the trajectory is over. reward: its final reward, a finite
    number, when done; None otherwise (no reward per turn). finish_reason: why it ended, when done (e.g.
    "answer", "max_turns", "tool_error", "tool_timeout"); "" otherwise. detail: a message for logs (the
    tool's error, the timeout).

    ``EnvStep.observe(tokens)`` and ``EnvStep.finish(reward, reason)`` build the two kinds.
    """

    observation: tuple[int, ...] = ()
    done: bool = False
    reward: float | None = None
    finish_reason: str = ""
    detail: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "observation",
                           _token_ids(self.observation, "EnvStep.observation", allow_empty=True))
        if not isinstance(self.done, bool):
            raise InvalidArgumentError(f"EnvStep.done must be a bool, got {self.done!r}")
        if not isinstance(self.finish_reason, str) or not isinstance(self.detail, str):
            raise InvalidArgumentError(f"EnvStep.finish_reason and .detail must be strings, got "
                                       f"{self.finish_reason!r} and {self.detail!r}")
        if self.done:
            if self.observation:
                raise InvalidArgumentError(f"a done EnvStep carries no observation (nothing trains on tokens after "
                                           f"the last model turn), got {len(self.observation)} tokens")
            if isinstance(self.reward, bool) or not isinstance(self.reward, (int, float)) \
                    or not math.isfinite(self.reward):
                raise InvalidArgumentError(f"a done EnvStep needs its final reward, a finite number, "
                                           f"got {self.reward!r}")
            if not self.finish_reason:
                raise InvalidArgumentError("a done EnvStep needs a finish_reason saying why the trajectory ended "
                                           "(e.g. 'answer', 'max_turns')")
            object.__setattr__(self, "reward", float(self.reward))
        else:
            if not self.observation:
                raise InvalidArgumentError("an EnvStep that is not done must carry observation tokens for the next "
                                           "turn (the model's turn ended at its stop token; it resumes after them)")
            if self.reward is not None or self.finish_reason:
                raise InvalidArgumentError(f"an EnvStep that is not done has no reward and no finish_reason (the "
                                           f"reward is the final one), got reward={self.reward!r}, "
                                           f"finish_reason={self.finish_reason!r}")

    @classmethod
    def observe(cls, observation: Sequence[int] | np.ndarray) -> EnvStep:
        """The trajectory goes on: the model reads ``observation`` and writes its next turn."""
        return cls(observation=observation)

    @classmethod
    def finish(cls, reward: float, finish_reason: str, detail: str = "") -> EnvStep:
        """The trajectory is over with its final reward."""
        return cls(done=True, reward=reward, finish_reason=finish_reason, detail=detail)


@runtime_checkable
class Environment(Protocol):
    """The world a multi-turn agent acts in: a tool, a sandbox, a simulated user.

    - ``await start(prompt)``: a fresh state for one trajectory (one sample of the prompt's group). It
      should be quick (no tool call): the loop awaits it before the first turn is generated. One that raises
      (a prompt it cannot start from) or outlives the step timeout ends that trajectory with finish reason
      "start_error" and reward 0; the run goes on.
    - ``await step(state, model_turn)``: the model's turn (its tokens as generated, ending with the stop
      token that ended it) answered: an EnvStep with observation tokens, or done with a reward. It may
      call slow tools; the loop awaits it as a task of its own, bounded by a timeout (step_with_timeout),
      while the engine generates other samples.

    The state is the trajectory's environment state, saved with it, so it must pickle. ``step`` may update
    it in place, but only once it has its answer (after its last ``await``): a step cancelled midway (its
    timeout, a save and a restart while a tool runs) then leaves the state as it was, and the step can be
    run again from it. A tool with side effects that must not happen twice has to be idempotent.

    ``step`` raises ToolError for a tool that failed (the trajectory ends with "tool_error"); any other
    exception is a bug in the environment and fails the run, as a failing reward function does.
    """

    async def start(self, prompt: Prompt) -> Any: ...

    async def step(self, state: Any, model_turn: Sequence[int]) -> EnvStep: ...


async def step_with_timeout(env: Environment, state: Any, model_turn: Sequence[int], timeout_s: float) -> EnvStep:
    """``env.step(state, model_turn)`` bounded by ``timeout_s`` seconds (asyncio.wait_for: the step is
    cancelled at the timeout). A step that raises ToolError ends the trajectory with finish reason
    "tool_error", one that outlives the timeout (or raises TimeoutError itself, a tool's own timeout) with
    "tool_timeout"; both with reward 0.0 and the cause in ``detail``. Other exceptions propagate.

    Raises InvalidArgumentError for an empty or non-integer model_turn, a timeout that is not a positive
    finite number, and a step that returns something other than an EnvStep.
    """
    turn = _token_ids(model_turn, "model_turn", allow_empty=False)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not math.isfinite(timeout_s) \
            or timeout_s <= 0:
        raise InvalidArgumentError(f"timeout_s must be a positive finite number of seconds, got {timeout_s!r}")
    name = type(env).__name__
    try:
        result = await asyncio.wait_for(env.step(state, turn), timeout_s)
    except ToolError as err:
        return EnvStep.finish(0.0, FINISH_TOOL_ERROR, f"{name}.step: {err}")
    except TimeoutError:
        return EnvStep.finish(0.0, FINISH_TOOL_TIMEOUT, f"{name}.step did not answer within {timeout_s} s")
    if not isinstance(result, EnvStep):
        raise InvalidArgumentError(f"{name}.step returned a {type(result).__name__}; an EnvStep is required")
    return result


@dataclass(frozen=True)
class Segment:
    """A run of one kind of token of a trajectory's response.

    kind "model": tokens the policy generated, each with its behavior logprob (finite) and the policy
    version that produced it (an integer >= 0, non-decreasing), as the scheduler stores a response today.
    kind "env": tokens the environment inserted (tool output, a user turn): never trained, so no logprobs
    and no versions. token_ids: at least one, each in [0, 2**31 - 1]. Sequences are stored as tuples.
    """

    kind: SegmentKind
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in SEGMENT_KINDS:
            raise InvalidArgumentError(f"Segment.kind must be one of {list(SEGMENT_KINDS)}, got {self.kind!r}")
        ids = _token_ids(self.token_ids, f"a {self.kind} Segment's token_ids", allow_empty=False)
        object.__setattr__(self, "token_ids", ids)
        if self.kind == "env":
            if len(self.logprobs) or len(self.versions):
                raise InvalidArgumentError(f"an env Segment carries no logprobs and no versions (its tokens are never "
                                           f"trained), got {len(self.logprobs)} logprobs and "
                                           f"{len(self.versions)} versions")
            object.__setattr__(self, "logprobs", ())
            object.__setattr__(self, "versions", ())
            return
        try:
            logprobs = np.asarray(self.logprobs, dtype=np.float64)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"a model Segment's logprobs must be numbers, got {list(self.logprobs)[:5]!r}") \
                from None
        if logprobs.shape != (len(ids),):
            raise InvalidArgumentError(f"a model Segment needs one logprob per token: {len(ids)} tokens, "
                                       f"got {len(self.logprobs)} logprobs")
        if not np.isfinite(logprobs).all():
            raise InvalidArgumentError(f"a model Segment's logprobs must be finite, got "
                                       f"{logprobs[~np.isfinite(logprobs)][:5].tolist()}")
        versions = np.asarray(self.versions)
        if versions.shape != (len(ids),):
            raise InvalidArgumentError(f"a model Segment needs one version per token: {len(ids)} tokens, "
                                       f"got {len(self.versions)} versions")
        if not np.issubdtype(versions.dtype, np.integer) or (versions < 0).any():
            raise InvalidArgumentError(f"a model Segment's versions must be integers >= 0, got "
                                       f"{list(self.versions)[:5]!r}")
        if (np.diff(versions) < 0).any():
            raise InvalidArgumentError(f"a model Segment's versions must be non-decreasing (later tokens come from "
                                       f"the same or a newer policy), got {versions.tolist()[:8]}")
        object.__setattr__(self, "logprobs", tuple(logprobs.tolist()))
        object.__setattr__(self, "versions", tuple(versions.tolist()))

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class Trajectory:
    """A multi-turn response: segments in order, starting with a model segment (an env segment answers a
    model turn) and alternating kinds (``append`` merges a segment into the last one of its kind, so a model
    turn resumed after an abort stays one segment). Model versions are non-decreasing across the whole
    trajectory, as within a sample today.

    The per-token arrays follow TrainingBatch's response positions: ``loss_mask()`` 1 on model tokens, 0
    on env tokens; ``behavior_logprobs()`` 0.0 and ``versions()`` -1 on env tokens (the values a batch
    holds on prompt positions). Staleness counts model tokens only.
    """

    segments: tuple[Segment, ...] = ()

    def __post_init__(self) -> None:
        segments = tuple(self.segments)
        object.__setattr__(self, "segments", segments)
        for i, segment in enumerate(segments):
            if not isinstance(segment, Segment):
                raise InvalidArgumentError(f"Trajectory.segments[{i}] is a {type(segment).__name__}; a Segment "
                                           f"is required")
        if segments and segments[0].kind != "model":
            raise InvalidArgumentError("a Trajectory starts with a model segment (an env segment is the answer to "
                                       "a model turn)")
        last_version = -1
        for i, segment in enumerate(segments):
            if i and segment.kind == segments[i - 1].kind:
                raise InvalidArgumentError(f"Trajectory segments alternate between 'model' and 'env': "
                                           f"segments[{i - 1}] and segments[{i}] are both {segment.kind!r} "
                                           f"(append() merges them)")
            if segment.kind == "model":
                if segment.versions[0] < last_version:
                    raise InvalidArgumentError(f"Trajectory versions must be non-decreasing across model segments: "
                                               f"segments[{i}] starts at version {segment.versions[0]} after "
                                               f"version {last_version}")
                last_version = segment.versions[-1]

    def append(self, segment: Segment) -> Trajectory:
        """A new Trajectory with ``segment`` at the end, merged into the last segment when of the same kind."""
        if not isinstance(segment, Segment):
            raise InvalidArgumentError(f"Trajectory.append takes a Segment, got a {type(segment).__name__}")
        if self.segments and self.segments[-1].kind == segment.kind:
            last = self.segments[-1]
            merged = Segment(last.kind, last.token_ids + segment.token_ids, last.logprobs + segment.logprobs,
                             last.versions + segment.versions)
            return Trajectory(self.segments[:-1] + (merged,))
        return Trajectory(self.segments + (segment,))

    def __len__(self) -> int:
        return sum(len(s) for s in self.segments)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every response token in order, model and env alike (what the engine's context holds)."""
        return tuple(t for s in self.segments for t in s.token_ids)

    @property
    def model_token_count(self) -> int:
        return sum(len(s) for s in self.segments if s.kind == "model")

    @property
    def env_token_count(self) -> int:
        return sum(len(s) for s in self.segments if s.kind == "env")

    def loss_mask(self) -> np.ndarray:
        """uint8 per response token: 1 on model tokens, 0 on env tokens."""
        return self._per_token(np.uint8, lambda s: np.ones(len(s)), 0)

    def behavior_logprobs(self) -> np.ndarray:
        """float32 per response token: the model tokens' behavior logprobs, 0.0 on env tokens."""
        return self._per_token(np.float32, lambda s: s.logprobs, 0.0)

    def versions(self) -> np.ndarray:
        """int32 per response token: the model tokens' policy versions, -1 on env tokens."""
        return self._per_token(np.int32, lambda s: s.versions, -1)

    def staleness(self, policy_version: int) -> int:
        """policy_version minus the oldest model token's version (0 without model tokens); env tokens,
        having no version, never make a trajectory stale."""
        model = [s for s in self.segments if s.kind == "model"]
        return policy_version - model[0].versions[0] if model else 0

    def _per_token(self, dtype: type, model_values: Any, env_value: float) -> np.ndarray:
        out = np.empty(len(self), dtype=dtype)
        at = 0
        for s in self.segments:
            out[at:at + len(s)] = model_values(s) if s.kind == "model" else env_value
            at += len(s)
        return out


__all__ = [
    "FINISH_START_ERROR",
    "FINISH_TOOL_ERROR",
    "FINISH_TOOL_TIMEOUT",
    "MAX_TOKEN_ID",
    "SEGMENT_KINDS",
    "EnvStep",
    "Environment",
    "Segment",
    "SegmentKind",
    "ToolError",
    "Trajectory",
    "step_with_timeout",
]
