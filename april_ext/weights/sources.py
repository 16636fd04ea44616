"""What a trainer hands the weight sync: its weights in one of the forms the transports read.

- Named tensors in this process (a Mapping, or a stream of (name, tensor) read once: a trainer's
  export_weights), or a checkpoint directory of safetensors that every engine can read.
- A BroadcastSource: the weights of one version held by another process (a Ray trainer rank), read bucket by
  bucket from the first tensor as often as asked (a retry reads them again), with the GroupHost that sends
  them by broadcast (weight_sync "broadcast").
- A StagedSource: the weights in parts, each a BroadcastSource with its own host (a pipeline stage's first
  rank sends its stage's part).
- A TensorPoster: weights that the process holding them posts to the workers itself (weight_sync "tensor").

The trainer side implements these (april_ext.cluster.rank_export for a Ray trainer group); the transports
(april_ext.weights.transport) read them and nothing else of the trainer.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from april_ext.errors import InvalidArgumentError

Named = Sequence[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class BucketMeta:
    """What the workers are told of a bucket before it is broadcast (the body of
    /update_weights_from_distributed), and the group backend its tensors need."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    backend: str


class GroupHost(Protocol):
    """Rank 0 of the group, seen from the HTTP side: a WeightSender here or in another process. ``lock``:
    one update at a time goes through a host (it holds one export and one bucket)."""

    lock: asyncio.Lock

    async def endpoint(self, urls: Sequence[str]) -> tuple[str, int]:
        """Where the workers (``urls``) reach the group's rendezvous: an address of the host's machine and a
        free port."""
        ...

    async def join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None: ...

    async def send(self, name: str) -> None:
        """Broadcasts the bucket the last next_bucket() described."""
        ...

    async def leave(self, name: str) -> None: ...


@runtime_checkable
class BroadcastSource(Protocol):
    """The weights of one update and their host."""

    host: GroupHost

    async def rewind(self, version: int) -> None:
        """Starts reading the weights from the first tensor (again); ``version`` is what they will be labelled."""
        ...

    async def next_bucket(self) -> BucketMeta | None:
        """The next bucket, now held by the host for send(); None after the last."""
        ...


@dataclass(frozen=True)
class StagedSource:
    """The weights of one update in parts, each read and sent by its own host (a pipeline stage's first
    trainer rank), in order; the parts' names together are the whole model's."""

    parts: tuple[BroadcastSource, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise InvalidArgumentError("StagedSource needs at least one part")


@runtime_checkable
class TensorPoster(Protocol):
    """Weights that the process holding them posts to the workers itself (weight_sync "tensor")."""

    async def post(self, urls: list[str], version: int, flush_cache: bool) -> list[str]:
        """/update_weights_from_tensor calls to ``urls`` as push_weights makes them (post_tensors); the names."""
        ...


WeightsSource = (Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | str | os.PathLike[str]
                 | BroadcastSource | StagedSource | TensorPoster)
HELD_ELSEWHERE = (BroadcastSource, StagedSource, TensorPoster)
"""The forms whose tensors another process holds and sends."""


def buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors, in order, grouped while a group stays within bucket_bytes (a larger tensor
    is a bucket of its own). Lazy: a bucket is yielded as soon as the next tensor does not fit, so reading a
    stream holds one bucket and the next tensor."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


__all__ = ["HELD_ELSEWHERE", "BroadcastSource", "BucketMeta", "GroupHost", "Named", "StagedSource", "TensorPoster",
           "WeightsSource", "buckets"]
