"""RayEngine: the RolloutEngine of a Ray run on the driver. Generation, aborts, weight updates and memory
calls go through an SGLangEngine pointed at the router (aborts and weights reach every worker the router
lists: the router has no /abort_request) or, with ray_routing "least_loaded", at the engines themselves
(each request to the least loaded); beside it the engine pool's watch keeps the engines that get requests
to those that answer, and gives a restarted engine the weights of the last update before it rejoins.
Weights go as cluster.weight_sync says: the trainer's sent by its ranks (or streamed through the driver with
"disk"), weights held on the driver from here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from april_ext.cluster.engine_pool import EnginePool
from april_ext.cluster.membership import Membership
from april_ext.cluster.trainer_group import TrainerGroup
from april_ext.cluster.weight_sync import HeldWeights, RayWeightSync
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import GenerationChunk, GenerationOutput
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sglang import SGLangEngine
from april_ext.sglang.background import cancel_and_wait

logger = logging.getLogger(__name__)


class RayEngine:
    """``inner``: the driver's SGLang client of ``pool``'s engines; ``trainer``: the run's trainer group, whose
    weights update_from_trainer sends (None: only weights held on the driver, update_weights)."""

    def __init__(self, inner: SGLangEngine, pool: EnginePool, trainer: TrainerGroup | None = None) -> None:
        self.inner = inner
        self.pool = pool
        self.weights = RayWeightSync(inner, pool, trainer)
        self._lock = asyncio.Lock()  # one weight push at a time: an update, or a rejoining engine's
        self._released: set[str] = set()  # memory tags released on every engine now
        self._watch: asyncio.Task[None] | None = None
        self._members: Membership | None = None  # who gets requests, from the pool once entered
        self.rejoins = 0

    async def __aenter__(self) -> RayEngine:
        self._members = self.pool.membership(self.inner)
        self._watch = asyncio.create_task(self.pool.watch(self._rejoin, self._members))
        self._watch.add_done_callback(_report_watch_end)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await cancel_and_wait([self._watch])

    def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        return self.inner.generate(input_ids, params, request_id)

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        return await self.inner.abort(request_ids)

    async def update_weights(self, weights: HeldWeights, version: int) -> list[str]:
        """Weights held on the driver (named tensors, or a checkpoint directory every engine reads) onto every
        engine that gets requests, sent from here (RayWeightSync.from_driver); the names loaded."""
        async with self._lock:
            return await self.weights.from_driver(weights, version, self._members)

    async def update_from_trainer(self, version: int) -> list[str]:
        """The trainer group's current weights, which must be ``version``, onto every engine that gets requests,
        the way weight_sync says (RayWeightSync.from_trainer); what the run's weight hand-off calls
        (protocol.TrainerFedEngine). The names loaded."""
        async with self._lock:
            return await self.weights.from_trainer(version, self._members)

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        async with self._lock:
            await self.inner.release_memory(tags)
            self._released |= set(memory_tags(tags))

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        async with self._lock:
            await self.inner.resume_memory(tags)
            self._released -= set(memory_tags(tags))

    async def _rejoin(self, old_url: str, url: str) -> None:
        """A restarted engine's server gets the last update's weights (it started from the run's initial
        checkpoint) and the memory state of the others, before it gets requests again. Failover
        stops awaiting its old url (an actor that was only stalled comes back on the same one)."""
        async with self._lock:
            if old_url != url:
                self.inner.forget_worker(old_url)
            last = self.weights.last
            if last is None and not self._released:
                return
            version = last[1] if last is not None else self.inner.config.initial_weight_version
            # The driver's client for this engine alone, without failover: it only loads the weights and memory state.
            alone = dataclasses.replace(self.inner.config, worker_urls=(url,), router_url=None,
                                        initial_weight_version=version, worker_timeout_s=None)
            async with SGLangEngine(alone) as engine:
                await self.weights.onto(engine)
                if self._released:
                    await engine.release_memory(sorted(self._released))
            self.rejoins += 1

    def stats(self) -> Any:
        return self.inner.stats()

    def health(self) -> dict[str, Any]:
        """The SGLang engine's health plus each engine actor's state ("up", "down": waiting for its
        restart, "dead": no restarts left)."""
        return {**self.inner.health(), "engines": self.pool.states()}

    def pool_health(self) -> dict[str, Any]:
        """The SGLang engine's failover view (live, removed, removals, rejoins), for the run's metrics rows."""
        return self.inner.pool_health()

    async def weight_versions(self) -> dict[str, str]:
        return await self.inner.weight_versions()


def _report_watch_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("the rollout engine watch stopped: %r; dead engines are no longer replaced", task.exception())


__all__ = ["RayEngine"]
