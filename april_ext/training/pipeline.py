"""Asynchronous APRIL on one machine: the rollout of the next batches runs while the trainer trains, up to a
bound d (``max_head_offpolicyness``) on how many versions the rollout may run ahead of the trainer.

The batch trained at version b is generated as soon as the trainer has published version b - d (its weights are
in every engine); until then the rollout waits. The rollout driver runs that batch's step at the version the
engines hold when it begins (the scheduler's version: every token keeps the version the engine had when it made
it), and the run trains the batch at version b. New weights reach the engine between two rollout steps, never
inside one: the weight sync waits for the running rollout step to end (with ``carry`` its running samples are
paused in place with their KV cache; with ``abort`` they were aborted and are resumed from their partial). The
version advances only once the engine holds the new weights: a failed sync raises and advances nothing.

With d = 0 the rollout of batch b waits for version b: the synchronous loop, one step after the other. With
d = 1 (the default) the rollout of batch b + 1 runs beside the training of batch b, and a seeded run over an
engine that steps in lockstep repeats exactly: batch b is always generated under version b - 1 (under b when its
step follows a checkpoint, which it waits for). With d >= 2 the version a batch starts under can depend on timing
(docs/async.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from april_ext.errors import InvalidArgumentError
from april_ext.rollout import RolloutResult


@dataclass
class PipelineTimes:
    """Where one step's time went in an asynchronous run (seconds)."""

    trainer_idle_s: float
    """The trainer waited for its batch."""
    engine_idle_s: float
    """The rollout waited: for the bound (the trainer's published version), or for a weight sync."""
    weight_update_s: float
    """The weight sync itself (the engine between rollout steps)."""


class RolloutPipeline:
    """Runs ``rollout(version)`` ahead of the trainer in a task of its own; call from one event loop.

    ``rollout(v)`` generates the next batch under the published version v (a rollout driver's ``run_step``);
    batches come out in the order of the versions they are trained at, b = first, first + 1, .... ``first`` is the
    trainer's version now and ``last`` the version of the run's last batch: nothing after it is generated (None: the
    run ends when the data does).
    ``held(b)`` says whether batch b waits for :meth:`release` of b, which the run calls once the step before it
    has ended: a checkpoint is written there, and a batch taken from the scheduler and not yet trained would be
    missing from its state."""

    def __init__(self, rollout: Callable[[int], Awaitable[RolloutResult]], lag: int, first: int, last: int | None,
                 held: Callable[[int], bool]) -> None:
        if not isinstance(lag, int) or isinstance(lag, bool) or lag < 0:
            raise InvalidArgumentError(f"lag={lag!r} is not allowed: an int >= 0 (versions the rollout may run ahead)")
        self._rollout = rollout
        self.lag = lag
        self._published = first
        self._next = first
        self._last = last
        self._held = held
        self._released = first
        self._ready: collections.deque[RolloutResult] = collections.deque()
        self._changed = asyncio.Condition()
        self._engine = asyncio.Lock()
        """Held for a rollout step, a weight sync and an evaluation: each needs the engine to itself."""
        self._engine_idle = 0.0
        self._ended = False
        self._task: asyncio.Task[None] | None = None

    @property
    def published(self) -> int:
        """The newest version every engine holds."""
        return self._published

    @property
    def ready(self) -> int:
        """Batches generated and not yet handed to the trainer."""
        return len(self._ready)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._produce())

    async def next_batch(self) -> tuple[RolloutResult, float]:
        """The next batch (in version order) and how long the trainer waited for it; raises the rollout's
        failure."""
        self.start()
        start = time.perf_counter()
        async with self._changed:
            await self._changed.wait_for(lambda: bool(self._ready) or self._ended)
        if not self._ready:
            assert self._task is not None and self._task.done()
            self._task.result()  # the rollout's failure, if any
            raise InvalidArgumentError("the rollout pipeline has ended: no batch follows")
        return self._ready.popleft(), time.perf_counter() - start

    async def publish(self, version: int, sync: Callable[[], Awaitable[None]]) -> float:
        """Runs ``sync`` (the trainer's weights at ``version`` into every engine) between two rollout steps,
        then lets the rollout generate under them; returns the sync's seconds. A sync that raises publishes
        nothing."""
        async with self._engine:
            start = time.perf_counter()
            await sync()
            seconds = time.perf_counter() - start
        async with self._changed:
            self._published = version
            self._changed.notify_all()
        return seconds

    async def with_engine(self, work: Callable[[], Awaitable[Any]]) -> Any:
        """``work`` with the engine to itself, between rollout steps (evaluation pinned to the published
        version)."""
        async with self._engine:
            return await work()

    async def release(self, version: int) -> None:
        """The step before batch ``version`` has ended (its checkpoint is written): a held batch may start."""
        async with self._changed:
            self._released = max(self._released, version)
            self._changed.notify_all()

    def take_engine_idle(self) -> float:
        idle, self._engine_idle = self._engine_idle, 0.0
        return idle

    async def _can_generate(self) -> bool:
        """Waits until the next batch may be generated (False: the run has ended it)."""
        b = self._next
        if self._last is not None and b > self._last:
            return False
        async with self._changed:
            await self._changed.wait_for(lambda: self._ended or (
                self._published >= b - self.lag and (not self._held(b) or self._released >= b)))
        return not self._ended

    async def _produce(self) -> None:
        try:
            while True:
                start = time.perf_counter()
                if not await self._can_generate():
                    return
                async with self._engine:
                    self._engine_idle += time.perf_counter() - start
                    result = await self._rollout(self._published)
                async with self._changed:
                    self._next += 1
                    self._ready.append(result)
                    self._changed.notify_all()
                if result.batch.n_groups == 0 or result.metrics.scheduler.get("data_exhausted"):
                    return
        finally:
            async with self._changed:
                self._ended = True
                self._changed.notify_all()

    async def stop(self) -> None:
        """Ends the rollout after the step it is running (the end of the run); its failure is raised."""
        async with self._changed:
            self._ended = True
            self._changed.notify_all()
        if self._task is not None:
            await self._task

    async def cancel(self) -> None:
        """Stops the rollout at once (a run that failed); the step it was running is cancelled."""
        self._ended = True
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def settle(self) -> None:
        """Waits until no rollout step is running (before a checkpoint: the scheduler's state is whole)."""
        async with self._engine:
            pass


__all__ = ["PipelineTimes", "RolloutPipeline"]
