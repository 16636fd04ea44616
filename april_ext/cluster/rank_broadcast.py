"""Weights sent by trainer rank 0 in a Ray run, never through the driver.

weight_sync="broadcast": rank 0's actor is rank 0 of the engines' weight group: it hosts the group's
rendezvous on its node and broadcasts each bucket straight from its own export (april_ext.sglang.broadcast.WeightSender in
trainer_actor.TrainerRank). The driver keeps the HTTP side (the SGLangEngine's WeightBroadcaster: the group's
init on every engine, the session, /update_weights_from_distributed per bucket) and receives only each
bucket's names, dtypes and shapes. Rank 0 holds about one bucket at a time; the driver none. A retry (an
engine gone mid-update) or an engine that rejoins has the trainer export the same weights again.

weight_sync="tensor": rank 0 posts its export to the engines the driver names, /update_weights_from_tensor
per bucket (april_ext.sglang.weights.post_tensors), e.g. to the engine that shares its device in a
colocated run; the driver keeps the engines' list and the version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from april_ext.cluster.errors import ClusterError
from april_ext.errors import AprilError
from april_ext.protocol.trainer import ExportedWeights
from april_ext.sglang.broadcast import BucketMeta

if TYPE_CHECKING:
    from april_ext.cluster.trainer_group import TrainerGroup


async def rank_result(ref: Any, what: str) -> Any:
    """A rank-0 call's value: an april_ext error raised there arrives as itself; a dead rank as ClusterError.
    Unbounded here: the WeightBroadcaster bounds every wait on its host."""
    import ray

    try:
        return await asyncio.wrap_future(ref.future())
    except ray.exceptions.RayActorError as err:
        raise ClusterError(f"trainer rank 0 died during {what} ({type(err).__name__}); the run stopped; continue "
                           "it from its last checkpoint with --resume") from None
    except ray.exceptions.RayTaskError as err:
        cause = err.cause
        if isinstance(cause, AprilError):
            raise cause from None
        raise RuntimeError(f"trainer rank 0 failed in {what}: {type(cause).__name__}: {cause}") from None


class RankZeroHost:
    """The GroupHost of the weight group: trainer rank 0's actor."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor
        self.lock = asyncio.Lock()

    async def endpoint(self, urls: Sequence[str]) -> tuple[str, int]:
        address, port = await rank_result(self.actor.weight_endpoint.remote(), "choosing a weight group's rendezvous")
        return address, port

    async def join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None:
        await rank_result(self.actor.weight_join.remote(address, port, world_size, name, backend),
                      f"joining weight group {name!r}")

    async def send(self, name: str) -> None:
        await rank_result(self.actor.weight_send.remote(name), f"broadcasting in weight group {name!r}")

    async def leave(self, name: str) -> None:
        await rank_result(self.actor.weight_leave.remote(name), f"leaving weight group {name!r}")


class RankZeroSource:
    """The BroadcastSource of a Ray run: the trainer group's current weights, exported by every rank and read
    by rank 0, bucket by bucket, each time an update (or a retry, or a rejoining engine) asks."""

    def __init__(self, group: TrainerGroup, host: RankZeroHost) -> None:
        self.group = group
        self.host = host

    async def rewind(self, version: int) -> None:
        await self.group.begin_broadcast_export(version)

    async def next_bucket(self) -> BucketMeta | None:
        return await self.group.next_broadcast_bucket()


class RankZeroPoster:
    """The TensorPoster of a Ray run: the trainer group's current weights, posted by rank 0."""

    def __init__(self, group: TrainerGroup) -> None:
        self.group = group

    async def post(self, urls: list[str], version: int, flush_cache: bool) -> list[str]:
        return await self.group.post_tensors(urls, version, flush_cache)


class RankExport(ExportedWeights):
    """TrainerGroup.export_weights(): rank 0's export as a stream the driver pulls (read lazily: nothing moves
    until it is iterated); ``source``, the same weights broadcast by rank 0, and ``poster``, posted by rank 0,
    without passing the driver."""

    def __init__(self, version: int, tensors: Any, source: RankZeroSource, poster: RankZeroPoster) -> None:
        super().__init__(version, tensors)
        self.source = source
        self.poster = poster


__all__ = ["RankExport", "RankZeroHost", "RankZeroPoster", "RankZeroSource", "rank_result"]
