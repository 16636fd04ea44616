"""RayEngine: the RolloutEngine of a Ray run on the driver. Generation, aborts, weight updates and memory
calls go through an SGLangEngine pointed at the router (aborts and weights reach every worker the router
lists: the router has no /abort_request) or, with ray_routing "least_loaded", at the engines themselves
(each request to the least loaded); beside it the engine pool's watch keeps the engines that get requests
to those that answer, and gives a restarted engine the weights of the last update before it rejoins.
With weight_sync="broadcast" trainer rank 0 broadcasts the weights, with "tensor" it posts them
(cluster.rank_broadcast): the driver holds none of them, and a rejoining engine has them exported and sent
again.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from april_ext.cluster.engine_pool import EnginePool
from april_ext.cluster.membership import Membership
from april_ext.cluster.rank_broadcast import RankExport
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import GenerationChunk, GenerationOutput
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.sglang.background import cancel_and_wait
from april_ext.sglang.broadcast import WeightBroadcastError

logger = logging.getLogger(__name__)


class RayEngine:
    def __init__(self, inner: SGLangEngine, pool: EnginePool) -> None:
        self.inner = inner
        self.pool = pool
        self._lock = asyncio.Lock()  # one weight push at a time: an update, or a rejoining engine's
        self._weights: tuple[Any, int] | None = None
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

    async def update_weights(self, weights: Any, version: int) -> list[str]:
        """New weights on every registered engine; kept for engines that rejoin later: with weight_sync
        "broadcast" or "tensor" and the trainer group's export, as its source (rank 0 broadcasts them, or
        posts them, and exports them again for a rejoining engine); with "disk" as the weight-sync directory
        the update wrote (the trainer's export streams through); otherwise as the tensors themselves, on the
        driver.
        A broadcast that fails (an engine died mid-update) goes again to the engines that answer, once the
        others are taken out (off the router, or out of the driver's worker pool)."""
        async with self._lock:
            config = self.inner.config
            kept: Any = weights
            if config.weight_sync == "broadcast" and isinstance(weights, RankExport):
                weights = kept = weights.source
            elif config.weight_sync == "tensor" and isinstance(weights, RankExport):
                weights = kept = weights.poster
            elif config.weight_sync == "disk" and not isinstance(weights, (str, os.PathLike)):
                assert config.weight_sync_dir is not None  # SGLangEngineConfig requires it for "disk"
                kept = config.weight_sync_dir
            elif not isinstance(weights, (str, os.PathLike)):
                weights = kept = list(weights.items() if isinstance(weights, dict) else weights)
            while True:
                try:
                    names = await self.inner.update_weights(weights, version)
                    break
                except WeightBroadcastError as err:
                    if self._members is None or not await self.pool.prune(self._members):  # each retry has fewer engines: a bounded loop
                        raise
                    logger.warning("weight update %d failed (%s); sending it again to the engines left", version, err)
            self._weights = (kept, version)
            return names

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
            if self._weights is None and not self._released:
                return
            config = self.inner.config
            version = self._weights[1] if self._weights is not None else config.initial_weight_version
            async with SGLangEngine(SGLangEngineConfig(
                    worker_urls=(url,), initial_weight_version=version, weight_sync=config.weight_sync,
                    weight_sync_dir=config.weight_sync_dir, weight_bucket_mb=config.weight_bucket_mb,
                    weight_sync_timeout_s=config.weight_sync_timeout_s)) as engine:
                if self._weights is not None:
                    await engine.update_weights(*self._weights)
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
