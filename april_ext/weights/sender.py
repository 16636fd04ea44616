"""Rank 0 of a weight group, in the process that holds the tensors (the collective side of the broadcast):
WeightSender joins groups by name, holds one bucket at a time and broadcasts it. It runs in this process (a
single-process run: LocalHost, LocalSource) or in a Ray trainer rank's actor (april_ext.cluster.rank_export).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator, Sequence
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from april_ext.errors import InvalidStateError
from april_ext.weights.group import broadcast_tensors, destroy_weight_group, dtype_name, join_weight_group
from april_ext.weights.sources import BucketMeta, Named, buckets

logger = logging.getLogger(__name__)


class WeightSender:
    """Rank 0 of weight groups, in the process that holds the tensors: joins groups by name, holds one
    bucket, broadcasts it. Its calls block (on the other ranks), each at most timeout_s."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._held: list[torch.Tensor] | None = None
        self.bytes_sent = 0

    @staticmethod
    def endpoint(address: str) -> tuple[str, int]:
        """(address, a free port on it) for a new group's rendezvous, hosted here."""
        return address, _free_port(address)

    def join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None:
        self._groups[name] = join_weight_group(address, port, 0, world_size, name, backend, self.timeout_s)

    def hold(self, bucket: Named) -> BucketMeta:
        """Keeps the bucket's tensors (on the device its backend carries) for send(); returns what the workers
        are told of it."""
        backend = "nccl" if bucket[0][1].is_cuda else "gloo"
        device = "cuda" if backend == "nccl" else "cpu"
        self._held = [t.detach().to(device).contiguous() for _, t in bucket]
        return BucketMeta([n for n, _ in bucket], [dtype_name(t.dtype) for _, t in bucket],
                          [list(t.shape) for _, t in bucket], backend)

    def send(self, name: str) -> None:
        """Broadcasts the held bucket in group ``name``, then drops it."""
        group = self._groups.get(name)
        if group is None:
            raise InvalidStateError(f"WeightSender.send: no weight group {name!r} here (join() first)")
        tensors, self._held = self._held, None
        if tensors is None:
            raise InvalidStateError("WeightSender.send: no bucket is held (hold() first)")
        try:
            broadcast_tensors(group, tensors)
        except RuntimeError:  # a peer died or stalled: the group cannot carry another broadcast
            self.leave(name)
            raise
        self.bytes_sent += sum(t.numel() * t.element_size() for t in tensors)

    def drop(self) -> None:
        """Forgets a held bucket (an update that failed before sending it)."""
        self._held = None

    def leave(self, name: str) -> None:
        group = self._groups.pop(name, None)
        if group is None:
            return
        try:
            destroy_weight_group(group)
        except (RuntimeError, ValueError) as exc:  # the process is leaving the group either way
            logger.warning("destroying weight group %r: %s", name, exc)


class LocalHost:
    """A WeightSender in this process; the workers reach it at ``master_address`` (None: the address of this
    machine that the first worker is reached from)."""

    def __init__(self, sender: WeightSender, master_address: str | None) -> None:
        self.sender = sender
        self.master_address = master_address
        self.lock = asyncio.Lock()

    async def endpoint(self, urls: Sequence[str]) -> tuple[str, int]:
        return self.sender.endpoint(self.master_address or master_address_for(urls))

    async def join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None:
        await asyncio.to_thread(self.sender.join, address, port, world_size, name, backend)

    async def send(self, name: str) -> None:
        await asyncio.to_thread(self.sender.send, name)

    async def leave(self, name: str) -> None:
        self.sender.leave(name)


class LocalSource:
    """Named tensors in this process, cut into buckets of ``bucket_bytes`` each time they are read."""

    def __init__(self, tensors: Named, host: LocalHost, bucket_bytes: int) -> None:
        self.tensors = tensors
        self.host = host
        self.bucket_bytes = bucket_bytes
        self._buckets: Iterator[list[tuple[str, torch.Tensor]]] = iter(())

    async def rewind(self, version: int) -> None:
        self._buckets = buckets(self.tensors, self.bucket_bytes)

    async def next_bucket(self) -> BucketMeta | None:
        bucket = next(self._buckets, None)
        return None if bucket is None else self.host.sender.hold(bucket)


def master_address_for(urls: Sequence[str]) -> str:
    """The address of this machine that the first worker reaches it by (loopback for a local worker): the
    source address of a route to the worker (a UDP connect sends nothing)."""
    host = urlsplit(urls[0]).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def _free_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]


__all__ = ["LocalHost", "LocalSource", "WeightSender", "master_address_for"]
