"""A Ray trainer group's weight export, in the forms april_ext.weights' transports read (its sources): the
ranks hold the tensors and send them themselves, the driver only names the engines and the version. The
ranks' end of each call is trainer_actor.TrainerRank; RayEngine hands these to the transport.

The trainer's weights, by weight_sync:
- "disk": rank 0's export streams through the driver (TrainerGroup.export_weights, one bucket at a time) into
  the weight-sync directory, which every engine loads (no source here).
- "tensor": the ranks post their export themselves, /update_weights_from_tensor per bucket (RankPoster, a
  TensorPoster): in a colocated run each rank to the engine beside it, all at once; otherwise rank 0 to every
  engine.
- "broadcast": each pipeline stage's first rank (rank 0 without pipeline parallelism) is rank 0 of a weight
  group of its own with every engine (RankHost, a GroupHost) and broadcasts each bucket of its stage's export,
  which only the stage's ranks gather (StageExport, a BroadcastSource); the stages go in turn (a StagedSource).
  The driver's SGLang client posts the HTTP side and gets only each bucket's names, dtypes and shapes. A
  sending rank holds about one bucket, the driver none.

Every read starts a new export, which must still be of the version sent: a retry and a rejoining engine read
the weights again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from april_ext.cluster.errors import ClusterError
from april_ext.cluster.trainer_ranks import TrainerRanks, rank_result
from april_ext.errors import InvalidStateError
from april_ext.weights import BucketMeta, StagedSource, WeightBroadcastError, WeightsSource


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


def rank_source(ranks: TrainerRanks, weight_sync: str | None, rank_beside: Callable[[str], int | None]
                ) -> WeightsSource | None:
    """The trainer group's current weights in the form ``weight_sync``'s transport reads when the ranks send
    them (april_ext.weights.sources); None for "disk", whose export streams through the driver
    (TrainerGroup.export_weights). ``rank_beside(url)``: the rank that shares the device of the engine at
    ``url``, which posts to it ("tensor")."""
    if weight_sync == "broadcast":
        return StagedSource(tuple(StageExport(ranks, stage) for stage in range(len(ranks.stages))))
    if weight_sync == "tensor":
        return RankPoster(ranks, rank_beside)
    return None


__all__ = ["RankHost", "RankPoster", "StageExport", "rank_source"]
