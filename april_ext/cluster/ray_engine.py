"""RayEngine: the RolloutEngine of a Ray run on the driver. Generation, aborts, weight updates and memory
calls go through an SGLangEngine pointed at the router (aborts and weights reach every worker the router
lists: the router has no /abort_request) or, with ray_routing "least_loaded", at the engines themselves
(each request to the least loaded); beside it the engine pool's watch keeps the engines that get requests
to those that answer, and gives a restarted engine the weights of the last update before it rejoins.
Weights go one way (RayWeightSync): the trainer group's export (its ranks send it themselves,
cluster.rank_export, or it streams through the driver with "disk") -> the transport weight_sync names
(april_ext.weights) -> every engine that gets requests. An update that fails because an engine died goes
again to the engines that answer, once the others are taken out; a restarted engine gets the last update
before it rejoins. Weights held on the driver go from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from april_ext.cluster.errors import NoEngineLeftError
from april_ext.cluster.membership import Membership
from april_ext.cluster.rank_export import rank_source
from april_ext.cluster.server_pool import ServerPool
from april_ext.cluster.trainer_group import TrainerGroup
from april_ext.errors import InvalidStateError
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import GenerationChunk, GenerationOutput
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sglang import SGLangEngine
from april_ext.sglang.background import cancel_and_wait
from april_ext.weights import WeightBroadcastError, WeightsSource

logger = logging.getLogger(__name__)

HeldWeights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike[str]
"""Weights held on the driver: named tensors, or a checkpoint directory every engine reads."""


class RayWeightSync:
    """Weights onto the engines of ``engine`` (the driver's SGLang client of the pool's engines), the last update
    kept for an engine that rejoins. ``trainer``: the run's trainer group, whose weights from_trainer sends as
    weight_sync says; None: only weights held on the driver (from_driver)."""

    def __init__(self, engine: SGLangEngine, pool: ServerPool, trainer: TrainerGroup | None = None) -> None:
        self.engine = engine
        self.pool = pool
        self.trainer = trainer
        self.last: tuple[WeightsSource, int] | None = None
        # Made once: a weight group lasts while its host (a StageExport's RankHost) stays the same.
        self._from_ranks = (None if trainer is None
                            else rank_source(trainer.ranks, engine.config.weight_sync, pool.rank_beside))

    async def from_trainer(self, version: int, members: Membership | None) -> list[str]:
        """The trainer's current weights, which must be ``version``, onto every engine of ``members`` (the
        transports of cluster.rank_export); the names loaded."""
        if self.trainer is None:
            raise InvalidStateError("RayWeightSync.from_trainer: this sync was built without the trainer group")
        if self._from_ranks is not None:
            return await self._push(self._from_ranks, version, self._from_ranks, members)
        return await self._push(self.trainer.export_weights(), version, self._sync_dir(), members)

    async def from_driver(self, weights: HeldWeights, version: int, members: Membership | None) -> list[str]:
        """Weights held here onto every engine of ``members``, sent from the driver: a checkpoint directory; or
        named tensors, streamed into the weight-sync directory with weight_sync "disk" and else held here whole
        (for a retry and a rejoin). The names loaded."""
        if isinstance(weights, (str, os.PathLike)):
            return await self._push(weights, version, weights, members)
        if self.engine.config.weight_sync == "disk":
            return await self._push(weights, version, self._sync_dir(), members)
        tensors = list(weights.items() if isinstance(weights, Mapping) else weights)
        return await self._push(tensors, version, tensors, members)

    async def onto(self, engine: SGLangEngine) -> None:
        """The last update onto a restarted engine (``engine``: a client of it alone), before it rejoins."""
        if self.last is not None:
            await engine.update_weights(*self.last)

    @contextlib.contextmanager
    def last_readable(self) -> Iterator[bool]:
        """Whether the last update can be read again now (and stays readable until the block ends): weights held
        here or on disk always; the trainer ranks' own export only while they hold its version and no train step
        runs (in an asynchronous run they train while the engines generate, and a newer export would be
        labelled with the older version)."""
        if self.last is None or self.last[0] is not self._from_ranks or self.trainer is None:
            yield True
            return
        with self.trainer.still() as still:
            yield still and self.trainer.version == self.last[1]

    def _sync_dir(self) -> str:
        directory = self.engine.config.weight_sync_dir
        assert directory is not None  # SGLangEngineConfig requires it for "disk"
        return directory

    async def _push(self, weights: WeightsSource, version: int, kept: WeightsSource,
                    members: Membership | None) -> list[str]:
        """``weights`` onto the engines, then ``kept`` (the same weights, as a rejoining engine reads them). A
        broadcast that fails (an engine died mid-update) goes again to the engines that answer, once the others
        are taken out of ``members`` (off the router, or out of the driver's worker pool): by the pool's prune
        (an actor that does not answer, or a server that does not answer over HTTP) or by its watch, which may
        have taken the dead engine out while the update ran. Raises the failure when no engine was taken out
        (then no engine's death explains it), NoEngineLeftError when none is left."""
        while True:
            serving = self.pool.serving()  # the engines this attempt goes to
            try:
                names = await self.engine.update_weights(weights, version)
                break
            except WeightBroadcastError as err:
                if members is None:
                    raise
                await self.pool.prune(members)
                left = self.pool.serving()
                # Each retry has fewer engines (a rejoin waits for this update): a bounded loop.
                if not left < serving:
                    raise
                if not left:
                    raise NoEngineLeftError(f"weight update {version} failed ({err}) and no engine is left to take "
                                            f"it: {sorted(serving)} are all down") from err
                logger.warning("weight update %d failed (%s); sending it again to the engines left (%s; %s out)",
                               version, err, sorted(left), sorted(serving - left))
        self.last = (kept, version)
        return names


class RayEngine:
    """``inner``: the driver's SGLang client of ``pool``'s engines; ``trainer``: the run's trainer group, whose
    weights update_from_trainer sends (None: only weights held on the driver, update_weights)."""

    def __init__(self, inner: SGLangEngine, pool: ServerPool, trainer: TrainerGroup | None = None) -> None:
        self.inner = inner
        self.pool = pool
        self.weights = RayWeightSync(inner, pool, trainer)
        self._lock = asyncio.Lock()  # one weight push at a time: an update, or a rejoining engine's
        self._released: set[str] = set()  # memory tags released on every engine now
        self._watch: asyncio.Task[None] | None = None
        self._members: Membership | None = None  # who gets requests, from the pool once entered
        # Restarted engines that wait for the next update to load (url -> its rejoin's wait).
        self._pending: dict[str, asyncio.Future[None]] = {}
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

    async def abort_all(self) -> None:
        """Every request on every engine's server, whoever sent it (protocol.AbortAllEngine), through the SGLang
        client as the other aborts go."""
        await self.inner.abort_all()

    async def update_weights(self, weights: HeldWeights, version: int) -> list[str]:
        """Weights held on the driver (named tensors, or a checkpoint directory every engine reads) onto every
        engine that gets requests, sent from here (RayWeightSync.from_driver); the names loaded."""
        async with self._lock:
            names = await self.weights.from_driver(weights, version, self._members)
            await self._load_pending()
            return names

    async def update_from_trainer(self, version: int) -> list[str]:
        """The trainer group's current weights, which must be ``version``, onto every engine that gets requests,
        the way weight_sync says (RayWeightSync.from_trainer); what the run's weight hand-off calls
        (protocol.TrainerFedEngine). The names loaded."""
        async with self._lock:
            names = await self.weights.from_trainer(version, self._members)
            await self._load_pending()
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
        stops awaiting its old url (an actor that was only stalled comes back on the same one). When the last
        update cannot be read again now (the trainer ranks train past it: RayWeightSync.last_readable), the
        engine loads the next update, sent to it right after the others, and rejoins then."""
        async with self._lock:
            if old_url != url:
                self.inner.forget_worker(old_url)
            if self.weights.last is None and not self._released:
                return
            with self.weights.last_readable() as now:
                if now:
                    await self._load(url)
                    self.rejoins += 1
                    return
            waiter = self._pending[url] = asyncio.get_running_loop().create_future()
        logger.warning("rollout engine at %s rejoins with the next weight update (the trainer trains past "
                       "update %s)", url, self.weights.last[1] if self.weights.last else None)
        await waiter
        self.rejoins += 1

    async def _load_pending(self) -> None:
        """The update just sent onto the engines waiting for it (_rejoin); one that fails to load is told so (its
        rejoin raises, and the pool's watch tries again)."""
        for url, waiter in list(self._pending.items()):
            with self.weights.last_readable() as now:
                if not now:
                    continue
                del self._pending[url]
                try:
                    await self._load(url)
                except Exception as err:  # the rejoin's failure, not the update's: its waiter raises it
                    if not waiter.done():
                        waiter.set_exception(err)
                    continue
            if not waiter.done():
                waiter.set_result(None)

    async def _load(self, url: str) -> None:
        """The last update and the others' memory state onto the engine at ``url``, through a client of it alone
        (without failover: it only loads)."""
        last = self.weights.last
        version = last[1] if last is not None else self.inner.config.initial_weight_version
        alone = dataclasses.replace(self.inner.config, worker_urls=(url,), router_url=None,
                                    initial_weight_version=version, worker_timeout_s=None)
        async with SGLangEngine(alone) as engine:
            await self.weights.onto(engine)
            if self._released:
                await engine.release_memory(sorted(self._released))

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


__all__ = ["HeldWeights", "RayEngine", "RayWeightSync"]
