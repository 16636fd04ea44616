"""The weight sync of a Ray run, in one direction: the trainer ranks' export -> the transport ``weight_sync``
names -> every engine that gets requests (and, later, an engine that rejoins). RayEngine runs it; the
transports' wire is the SGLang adapter's (april_ext.sglang.weights: disk and tensor; april_ext.sglang.broadcast:
broadcast), the ranks' end of it is trainer_actor.TrainerRank.

The trainer's weights, by weight_sync:
- "disk": rank 0's export streams through the driver (TrainerGroup.export_weights, one bucket at a time) into
  the weight-sync directory, which every engine loads.
- "tensor": the ranks post their export themselves, /update_weights_from_tensor per bucket (RankPoster): in a
  colocated run each rank to the engine beside it, all at once; otherwise rank 0 to every engine. The driver
  names the engines and the version.
- "broadcast": each pipeline stage's first rank (rank 0 without pipeline parallelism) is rank 0 of a weight
  group of its own with every engine (RankHost) and broadcasts each bucket of its stage's export, which only
  the stage's ranks gather (StageExport); the stages go in turn (a StagedSource). The driver's SGLang client
  posts the HTTP side and gets only each bucket's names, dtypes and shapes. A sending rank holds about one
  bucket, the driver none.

An update that fails because an engine died goes again to the engines that answer, once the others are taken
out; a restarted engine gets the last update before it rejoins. Either way the ranks export the weights again
(the export must still be of the version sent).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from april_ext.cluster.engine_pool import EnginePool
from april_ext.cluster.errors import ClusterError, NoEngineLeftError
from april_ext.cluster.membership import Membership
from april_ext.cluster.trainer_group import TrainerGroup
from april_ext.cluster.trainer_ranks import TrainerRanks, rank_result
from april_ext.errors import InvalidStateError
from april_ext.sglang import SGLangEngine
from april_ext.sglang.broadcast import BucketMeta, StagedSource, WeightBroadcastError
from april_ext.sglang.weights import WeightsSource

logger = logging.getLogger(__name__)

HeldWeights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike[str]
"""Weights held on the driver: named tensors, or a checkpoint directory every engine reads."""


class RankHost:
    """The GroupHost of a weight group: the actor of trainer rank ``rank`` (a pipeline stage's first). A failure
    there is the broadcast's (WeightBroadcastError), which may go again to the engines left."""

    def __init__(self, ranks: TrainerRanks, rank: int) -> None:
        self.actor = ranks.actors[rank]
        self.rank = rank
        self.lock = asyncio.Lock()

    async def endpoint(self, urls: Sequence[str]) -> tuple[str, int]:
        address, port = await rank_result(self.actor.weight_endpoint.remote(), "choosing a weight group's rendezvous",
                                          self.rank, WeightBroadcastError)
        return address, port

    async def join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None:
        await rank_result(self.actor.weight_join.remote(address, port, world_size, name, backend),
                          f"joining weight group {name!r}", self.rank, WeightBroadcastError)

    async def send(self, name: str) -> None:
        await rank_result(self.actor.weight_send.remote(name), f"broadcasting in weight group {name!r}", self.rank,
                          WeightBroadcastError)

    async def leave(self, name: str) -> None:
        await rank_result(self.actor.weight_leave.remote(name), f"leaving weight group {name!r}", self.rank,
                          WeightBroadcastError)


class StageExport:
    """A BroadcastSource: pipeline stage ``stage`` of the trainer's current weights, exported by the stage's ranks
    alone and held bucket by bucket by its first rank (the host of the stage's weight group), from the first
    tensor each time an update, its retry or a rejoining engine reads it."""

    def __init__(self, ranks: TrainerRanks, stage: int) -> None:
        self.ranks = ranks
        self.members = ranks.stages[stage]
        self.host = RankHost(ranks, self.members[0])

    async def rewind(self, version: int) -> None:
        """The stage's ranks export its part of the current weights, which must be ``version``: the first keeps
        its export for next_bucket, the others read theirs to the end (their part of the gather). An export still
        open (an update that failed midway) is read to its end first."""
        ranks, first = self.ranks, self.host.rank
        ranks.finish_export()
        calls = [ranks.actors[r].begin_export.remote(False, r == first, version, True) for r in self.members]
        await rank_result(calls[0], "export_weights", first, WeightBroadcastError)
        ranks.export_begun(lambda: ranks.wait("export_weights", [ranks.actors[first].end_export.remote(), *calls[1:]],
                                              self.members))

    async def next_bucket(self) -> BucketMeta | None:
        """The next bucket, now held by the first rank for the broadcast: its names, dtypes and shapes, or None
        after the last (the other ranks' part of the export has ended then)."""
        if not self.ranks.exporting:
            raise InvalidStateError("StageExport.next_bucket: no export is open (rewind first)")
        first = self.host.rank
        meta = await rank_result(self.ranks.actors[first].next_bucket_held.remote(), "export_weights", first,
                                 WeightBroadcastError)
        if meta is None:
            self.ranks.finish_export()
        return meta


class RankPoster:
    """A TensorPoster: the trainer's current weights, posted by the ranks themselves. ``rank_beside(url)``: the
    rank that shares the device of the engine at ``url`` (colocated runs), which posts to it; rank 0 posts to
    the others."""

    def __init__(self, ranks: TrainerRanks, rank_beside: Callable[[str], int | None]) -> None:
        self.ranks = ranks
        self.rank_beside = rank_beside

    async def post(self, urls: list[str], version: int, flush_cache: bool) -> list[str]:
        """The current weights (which must be ``version``) posted to ``urls``, /update_weights_from_tensor per
        bucket, by the ranks that post (all at once), while the others export (and drop) theirs; the names
        loaded. Waits at most ray_timeout_s."""
        ranks = self.ranks
        ranks.finish_export()
        owned: dict[int, list[str]] = {}
        for url in urls:
            owner = self.rank_beside(url)
            owned.setdefault(0 if owner is None else owner, []).append(url)
        calls = [a.post_tensors.remote(owned[r], version, flush_cache) if r in owned
                 else a.begin_export.remote(False, False, version) for r, a in enumerate(ranks.actors)]
        posting = sorted(owned)
        try:
            names = await asyncio.wait_for(asyncio.gather(*(rank_result(calls[r], "posting weights", r)
                                                             for r in posting)), ranks.timeout_s)
        except asyncio.TimeoutError:
            raise ClusterError(f"trainer ranks {posting} did not post the weights to {urls} within ray_timeout_s="
                               f"{ranks.timeout_s} s") from None
        ranks.wait("export_weights", calls)  # the other ranks' part of the export ended too
        return names[0]


class RayWeightSync:
    """Weights onto the engines of ``engine`` (the driver's SGLang client of the pool's engines), the last update
    kept for an engine that rejoins. ``trainer``: the run's trainer group, whose weights from_trainer sends as
    weight_sync says; None: only weights held on the driver (from_driver)."""

    def __init__(self, engine: SGLangEngine, pool: EnginePool, trainer: TrainerGroup | None = None) -> None:
        self.engine = engine
        self.pool = pool
        self.trainer = trainer
        self.last: tuple[WeightsSource, int] | None = None
        # Made once: a weight group lasts while its host (a StageExport's RankHost) stays the same.
        self._from_ranks = None if trainer is None else _sent_by_ranks(trainer.ranks, engine.config.weight_sync, pool)

    async def from_trainer(self, version: int, members: Membership | None) -> list[str]:
        """The trainer's current weights, which must be ``version``, onto every engine of ``members`` (the
        weight_sync of the module docstring); the names loaded."""
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


def _sent_by_ranks(ranks: TrainerRanks, weight_sync: str | None, pool: EnginePool) -> WeightsSource | None:
    """What the transport reads for the trainer's weights when the ranks send them; None for "disk", whose
    export streams through the driver."""
    if weight_sync == "broadcast":
        return StagedSource(tuple(StageExport(ranks, stage) for stage in range(len(ranks.stages))))
    if weight_sync == "tensor":
        return RankPoster(ranks, pool.rank_beside)
    return None


__all__ = ["HeldWeights", "RankHost", "RankPoster", "RayWeightSync", "StageExport"]
