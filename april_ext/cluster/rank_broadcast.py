"""Weights sent by the trainer ranks in a Ray run, never through the driver.

weight_sync="broadcast": each pipeline stage's first rank (rank 0 without pipeline parallelism) is rank 0 of
a weight group of its own with the engines: it hosts the group's rendezvous on its node and broadcasts each
bucket straight from its stage's export (april_ext.sglang.broadcast.WeightSender in trainer_actor.TrainerRank),
which only its stage's ranks gather; the stages send in turn (a StagedSource, one part per stage). The driver
keeps the HTTP side (the SGLangEngine's WeightBroadcaster: the groups' init on every engine, the sessions,
/update_weights_from_distributed per bucket) and receives only each bucket's names, dtypes and shapes. A
sending rank holds about one bucket at a time; the driver none. A retry (an engine gone mid-update) or an
engine that rejoins has the trainer export the same weights again.

weight_sync="tensor": the ranks post their export to the engines the driver names, /update_weights_from_tensor
per bucket (april_ext.sglang.weights.post_tensors): in a colocated run each rank to the engine that shares its
device, all at once; otherwise rank 0 to every engine. The driver keeps the engines' list and the version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from april_ext.cluster.errors import ClusterError
from april_ext.errors import AprilError
from april_ext.protocol.trainer import ExportedWeights
from april_ext.sglang.broadcast import BucketMeta, StagedSource

if TYPE_CHECKING:
    from april_ext.cluster.trainer_group import TrainerGroup


async def rank_result(ref: Any, what: str, rank: int = 0) -> Any:
    """A call's value from trainer rank ``rank``: an april_ext error raised there arrives as itself; a dead
    rank as ClusterError. Unbounded here: the WeightBroadcaster bounds every wait on its host."""
    import ray

    try:
        return await asyncio.wrap_future(ref.future())
    except ray.exceptions.RayActorError as err:
        raise ClusterError(f"trainer rank {rank} died during {what} ({type(err).__name__}); the run stopped; "
                           "continue it from its last checkpoint with --resume") from None
    except ray.exceptions.RayTaskError as err:
        cause = err.cause
        if isinstance(cause, AprilError):
            raise cause from None
        raise RuntimeError(f"trainer rank {rank} failed in {what}: {type(cause).__name__}: {cause}") from None


class RankHost:
    """The GroupHost of a weight group: the actor of trainer rank ``rank`` (a pipeline stage's first)."""

    def __init__(self, actor: Any, rank: int) -> None:
        self.actor = actor
        self.rank = rank
        self.lock = asyncio.Lock()

    async def endpoint(self, urls: Sequence[str]) -> tuple[str, int]:
        address, port = await rank_result(self.actor.weight_endpoint.remote(), "choosing a weight group's rendezvous",
                                          self.rank)
        return address, port

    async def join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None:
        await rank_result(self.actor.weight_join.remote(address, port, world_size, name, backend),
                          f"joining weight group {name!r}", self.rank)

    async def send(self, name: str) -> None:
        await rank_result(self.actor.weight_send.remote(name), f"broadcasting in weight group {name!r}", self.rank)

    async def leave(self, name: str) -> None:
        await rank_result(self.actor.weight_leave.remote(name), f"leaving weight group {name!r}", self.rank)


class StageSource:
    """A BroadcastSource of a Ray run: pipeline stage ``stage`` of the trainer group's current weights,
    exported by the stage's ranks and read by its first rank (the host), bucket by bucket, each time an update
    (or a retry, or a rejoining engine) asks."""

    def __init__(self, group: TrainerGroup, host: RankHost, stage: int) -> None:
        self.group = group
        self.host = host
        self.stage = stage

    async def rewind(self, version: int) -> None:
        await self.group.begin_broadcast_export(version, self.stage)

    async def next_bucket(self) -> BucketMeta | None:
        return await self.group.next_broadcast_bucket(self.stage)


class RankPoster:
    """The TensorPoster of a Ray run: the trainer group's current weights, posted by the ranks
    (TrainerGroup.post_tensors)."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group

    async def post(self, urls: list[str], version: int, flush_cache: bool) -> list[str]:
        return await self.group.post_tensors(urls, version, flush_cache)


class RankExport(ExportedWeights):
    """TrainerGroup.export_weights(): rank 0's export as a stream the driver pulls (read lazily: nothing moves
    until it is iterated); ``source``, the same weights broadcast by each pipeline stage's first rank, and
    ``poster``, posted by the ranks, without passing the driver."""

    def __init__(self, version: int, tensors: Any, source: StagedSource, poster: RankPoster) -> None:
        super().__init__(version, tensors)
        self.source = source
        self.poster = poster


__all__ = ["RankExport", "RankHost", "RankPoster", "StageSource", "rank_result"]
