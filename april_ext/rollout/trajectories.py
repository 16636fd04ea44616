"""Trajectories: the rollout loop's side of multi-turn, tool-using samples (docs/agentic.md).

A multi-turn sample is one scheduler sample whose response holds the model's turns and the environment's
observations in order; the scheduler keeps the tokens and which are whose. This module keeps the rest,
which is Python state the C++ core cannot hold: each live trajectory's environment state, the step task
of a turn handed to the environment (a tool call running while the engine generates other samples), its
answer until the loop hands it to the scheduler, and the final reward and finish reason the environment
gave. It is the "sidecar" of the design: saved beside the scheduler's state in a checkpoint (``dumps`` /
``loads``), so a tool call interrupted by a save and a restart is run again from the state it started
from (the Environment contract: ``step`` changes the state only after its last await).

A trajectory restarted by the scheduler (staleness ``restart``) is started again: its next dispatch is a
fresh request, which replaces the trajectory, so the late answer of the old one is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import CorruptStateError, InvalidArgumentError
from april_ext.protocol.environment import (
    FINISH_START_ERROR,
    FINISH_TOOL_ERROR,
    FINISH_TOOL_TIMEOUT,
    Environment,
    EnvStep,
    step_with_timeout,
)

logger = logging.getLogger(__name__)
_FORMAT = "april_ext.trajectories/1"
FINISH_LENGTH = "length"
"""The finish reason of a trajectory cut by max_response_len (the environment is not asked: reward 0)."""


@dataclass
class _Live:
    """One live trajectory: its environment state and where its current turn stands."""

    group_id: int
    state: Any
    pending: bool = False
    """A turn was handed to the environment and its answer has not reached the scheduler."""
    answer: EnvStep | None = None
    """The environment's answer, until the loop hands it to the scheduler."""
    reward: float | None = None
    finish_reason: str = ""


@dataclass
class ToolStats:
    """What the environment did during one rollout step (RolloutMetrics.env)."""

    tool_calls: int = 0
    """Turns handed to the environment (each a step; a tool call when the environment runs one)."""
    answered: int = 0
    observations: int = 0
    env_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    """Trajectories ended, by finish reason (the environment's, "length", "tool_error", "tool_timeout")."""
    waits_s: list[float] = field(default_factory=list)
    """Wall seconds from each answered turn's hand-over to its answer."""

    def as_metrics(self) -> dict[str, float]:
        waits = np.asarray(self.waits_s, np.float64)
        out = {"tool_calls": float(self.tool_calls), "tool_answers": float(self.answered),
               "observations": float(self.observations), "env_tokens": float(self.env_tokens),
               "tool_wait_p50_s": float(np.percentile(waits, 50)) if waits.size else math.nan,
               "tool_wait_p99_s": float(np.percentile(waits, 99)) if waits.size else math.nan,
               "tool_errors": float(self.finished.get(FINISH_TOOL_ERROR, 0)),
               "tool_timeouts": float(self.finished.get(FINISH_TOOL_TIMEOUT, 0))}
        out.update({f"finished_{reason}": float(n) for reason, n in sorted(self.finished.items())})
        return out


class Trajectories:
    """The live trajectories of a rollout loop over ``env``.

    tool_timeout_s bounds each step (step_with_timeout: a step past it ends its trajectory with
    "tool_timeout"); max_concurrent_tool_calls caps the steps running at once (None: no cap; real tools
    have rate limits), the others wait their turn in hand-over order. ``notify`` is called whenever an
    answer arrives (it wakes the loop).
    """

    def __init__(self, env: Environment, *, tool_timeout_s: float = 30.0,
                 max_concurrent_tool_calls: int | None = None, notify: Callable[[], None] | None = None) -> None:
        if not isinstance(env, Environment):
            raise InvalidArgumentError(f"environment is a {type(env).__name__}; an Environment needs async start(prompt) "
                                       f"and async step(state, model_turn)")
        if isinstance(tool_timeout_s, bool) or not isinstance(tool_timeout_s, (int, float)) \
                or not math.isfinite(tool_timeout_s) or tool_timeout_s <= 0:
            raise InvalidArgumentError(f"tool_timeout_s={tool_timeout_s!r} is not allowed: a positive finite number "
                                       f"of seconds")
        if max_concurrent_tool_calls is not None and (isinstance(max_concurrent_tool_calls, bool) or not isinstance(
                max_concurrent_tool_calls, int) or max_concurrent_tool_calls < 1):
            raise InvalidArgumentError(f"max_concurrent_tool_calls={max_concurrent_tool_calls!r} is not allowed: None "
                                       f"or an int >= 1")
        self.env = env
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_concurrent_tool_calls = max_concurrent_tool_calls
        self._notify = notify or (lambda: None)
        self._live: dict[int, _Live] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._gate = asyncio.Semaphore(max_concurrent_tool_calls) if max_concurrent_tool_calls else None
        self.failures: list[BaseException] = []
        """Exceptions of steps other than a tool's failure (bugs in the environment): the loop raises them."""
        self._rerun: list[int] = []
        self.stats = ToolStats()

    # ------------------------------------------------------------------ the loop's calls

    @property
    def pending(self) -> int:
        """Trajectories whose turn is with the environment (its answer not handed to the scheduler yet)."""
        return sum(1 for live in self._live.values() if live.pending)

    @property
    def running(self) -> int:
        """Steps still running (an answer not in yet)."""
        return len(self._tasks)

    @property
    def busy(self) -> bool:
        """A step is running or an answer waits to be handed to the scheduler: the loop will hear from it."""
        return bool(self._tasks) or any(live.answer is not None for live in self._live.values())

    async def start(self, sample_id: int, group_id: int, prompt: Prompt) -> bool:
        """A fresh trajectory for ``sample_id`` (its first dispatch, or a restart): env.start(prompt), bounded by
        tool_timeout_s. False when it raised or timed out: the trajectory is over with finish reason
        "start_error" and reward 0 (the cause is logged), and the caller ends its sample."""
        old = self._tasks.pop(sample_id, None)
        if old is not None:
            old.cancel()
        try:
            state = await asyncio.wait_for(self.env.start(prompt), self.tool_timeout_s)
        except Exception as err:  # noqa: BLE001 - a prompt the environment cannot start from costs its trajectory
            cause = f"did not answer within {self.tool_timeout_s} s" if isinstance(err, TimeoutError) else \
                f"raised {type(err).__name__}: {err}"
            logger.warning("%s.start %s on prompt %r: sample %d ends with %r", type(self.env).__name__, cause,
                           prompt.id, sample_id, FINISH_START_ERROR)
            self._live[sample_id] = _Live(group_id, None, reward=0.0, finish_reason=FINISH_START_ERROR)
            self._count_finish(FINISH_START_ERROR)
            return False
        self._live[sample_id] = _Live(group_id, state)
        return True

    def knows(self, sample_id: int) -> bool:
        return sample_id in self._live

    def hand_over(self, sample_id: int, turn: Sequence[int]) -> None:
        """The sample's turn ended at a stop token and the scheduler has it waiting: the environment's step
        runs as a task of its own."""
        live = self._live.get(sample_id)
        if live is None:
            raise InvalidArgumentError(f"sample {sample_id} has no trajectory (it was never started)")
        live.pending, live.answer = True, None
        self.stats.tool_calls += 1
        self._tasks[sample_id] = asyncio.create_task(self._step(sample_id, live, tuple(int(t) for t in turn)))

    def cut(self, sample_id: int) -> None:
        """The scheduler finished the sample with "length" (the response cap): reward 0, no step."""
        live = self._live.get(sample_id)
        if live is not None:
            live.pending, live.answer, live.reward, live.finish_reason = False, None, 0.0, FINISH_LENGTH
        self._count_finish(FINISH_LENGTH)

    def answers(self) -> list[tuple[int, EnvStep]]:
        """The answers that arrived, in sample-id order (each returned once: the loop hands them over)."""
        out = [(sid, live.answer) for sid, live in sorted(self._live.items()) if live.answer is not None]
        for sid, _ in out:
            self._live[sid].answer = None
        return out  # type: ignore[return-value]

    def delivered(self, sample_id: int, answer: EnvStep) -> None:
        """The scheduler took ``answer``: an observation queued the sample, an end finished it."""
        live = self._live[sample_id]
        live.pending = False
        if answer.done:
            live.reward, live.finish_reason = answer.reward, answer.finish_reason
            self._count_finish(answer.finish_reason)
        else:
            self.stats.observations += 1
            self.stats.env_tokens += len(answer.observation)

    def dropped(self, sample_id: int) -> None:
        """The scheduler refused an answer (the sample was cancelled, restarted or dropped meanwhile)."""
        live = self._live.get(sample_id)
        if live is not None:
            live.pending = False

    def observation_cut(self, sample_id: int) -> None:
        """An observation filled the response to its cap: the scheduler finished the sample with "length"."""
        live = self._live[sample_id]
        live.reward, live.finish_reason = 0.0, FINISH_LENGTH
        self._count_finish(FINISH_LENGTH)

    def rewards(self, sample_ids: Iterable[int]) -> list[float]:
        """The final rewards the environment gave (0.0 for a trajectory cut by the response cap)."""
        return [float(self._live[int(s)].reward or 0.0) if int(s) in self._live else 0.0 for s in sample_ids]

    def forget_group(self, group_id: int) -> None:
        """The group was rewarded: its trajectories are over."""
        self._forget([s for s, live in self._live.items() if live.group_id == group_id])

    def keep_only(self, sample_ids: set[int]) -> None:
        """Forgets the trajectories of samples the scheduler no longer holds (a dropped group's)."""
        self._forget([s for s in self._live if s not in sample_ids])

    def _forget(self, sample_ids: list[int]) -> None:
        for sid in sample_ids:
            task = self._tasks.pop(sid, None)
            if task is not None:
                task.cancel()
            del self._live[sid]

    def rerun_pending(self, turns: Callable[[int], Sequence[int] | None]) -> None:
        """After ``loads``: the steps that were running when the state was saved run again, from the state
        they started from; ``turns(sid)`` is the sample's turn (None: the scheduler no longer waits on it)."""
        for sid in self._rerun:
            turn = turns(sid)
            if turn is None:
                self._live[sid].pending = False
            else:
                self.stats.tool_calls -= 1  # the turn was counted when it was first handed over
                self.hand_over(sid, turn)
        self._rerun = []

    async def wait_all(self) -> None:
        """Until every running step has answered."""
        while self._tasks:
            await asyncio.wait(set(self._tasks.values()))

    def take_stats(self) -> ToolStats:
        stats, self.stats = self.stats, ToolStats()
        return stats

    async def close(self) -> None:
        """Cancels every running step (the end of a run; a saved state keeps them as pending)."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    # ------------------------------------------------------------------ persistence

    def dumps(self) -> bytes:
        """The trajectories as bytes for a checkpoint: states, pending turns, answers not handed over yet,
        final rewards. A pending turn without an answer is run again after ``loads``."""
        records = {sid: (live.group_id, live.state, live.pending, live.answer, live.reward, live.finish_reason)
                   for sid, live in self._live.items()}
        return pickle.dumps({"format": _FORMAT, "trajectories": records})

    def loads(self, data: bytes) -> None:
        """Restores ``dumps``'s trajectories (replacing any held); pending turns without an answer are run
        again at ``rerun_pending``. CorruptStateError for bytes that are not such a state."""
        try:
            loaded = pickle.loads(data)  # noqa: S301 - the run's own checkpoint, checked by its manifest
            if not isinstance(loaded, dict) or loaded.get("format") != _FORMAT:
                raise ValueError(f"not a {_FORMAT} state")
            records = loaded["trajectories"]
        except Exception as err:  # noqa: BLE001 - any failure to read is a corrupt file
            raise CorruptStateError(f"the trajectories' state cannot be read: {err}") from None
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        self._live, self._rerun = {}, []
        for sid, (group_id, state, pending, answer, reward, reason) in sorted(records.items()):
            self._live[int(sid)] = _Live(int(group_id), state, pending, answer, reward, reason)
            if pending and answer is None:
                self._rerun.append(int(sid))

    # ------------------------------------------------------------------ steps

    async def _step(self, sample_id: int, live: _Live, turn: tuple[int, ...]) -> None:
        start = time.monotonic()
        try:
            if self._gate is None:
                answer = await step_with_timeout(self.env, live.state, turn, self.tool_timeout_s)
            else:
                async with self._gate:
                    answer = await step_with_timeout(self.env, live.state, turn, self.tool_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001 - a bug in the environment fails the run, in the loop
            self.failures.append(err)
            self._notify()
            return
        finally:
            if self._tasks.get(sample_id) is asyncio.current_task():
                del self._tasks[sample_id]
        if self._live.get(sample_id) is not live:
            return  # restarted or forgotten meanwhile
        live.answer = answer
        self.stats.answered += 1
        self.stats.waits_s.append(time.monotonic() - start)
        self._notify()

    def _count_finish(self, reason: str) -> None:
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1


def turn_of(token_ids: np.ndarray, env_mask: np.ndarray | None) -> np.ndarray:
    """The sample's last turn: its tokens after the last environment token (all of them in the first turn)."""
    if env_mask is None or not env_mask.any():
        return token_ids
    return token_ids[int(np.flatnonzero(env_mask)[-1]) + 1:]


__all__ = ["FINISH_LENGTH", "ToolStats", "Trajectories", "turn_of"]
