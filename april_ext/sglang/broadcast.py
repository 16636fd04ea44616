"""WeightBroadcaster: the trainer's end of SGLang's collective weight update.

The process that holds the exported weights (trainer rank 0, the one running the SGLang adapter) is rank 0
of one process group with every worker (worker i is rank 1 + i; world size 1 + workers): it hosts the
group's rendezvous and every worker joins through /init_weights_update_group. The group is built on the
first update and built again when the worker list changes, after a failed update, or when reset() says a
worker came back (a restarted server has left the group). Each update opens SGLang's weight-update session
on every worker, then for each bucket of tensors (up to bucket_bytes, in the trainer's order) posts
/update_weights_from_distributed to every worker and broadcasts the bucket's tensors meanwhile, then closes
the session.

Every wait is bounded by timeout_s: a worker that does not join, or dies or stalls mid-broadcast, raises
WeightBroadcastError naming it (an HTTP failure at once, a silent peer when the group's timeout expires);
nothing hangs. gloo carries CPU tensors, nccl CUDA ones (the backend follows the tensors' device).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import uuid
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from april_ext.errors import AprilError, InvalidArgumentError
from april_ext.protocol import sglang_wire
from april_ext.protocol.weight_group import broadcast_tensors, destroy_weight_group, dtype_name, join_weight_group
from april_ext.sglang.client import HTTPClient, refused
from april_ext.sglang.errors import SGLangHTTPError
from april_ext.sglang.workers import WorkerPool

logger = logging.getLogger(__name__)

Named = Sequence[tuple[str, torch.Tensor]]


class WeightBroadcastError(AprilError, RuntimeError):
    """A weight broadcast failed: a worker did not join the group, refused an update, or died or stalled
    during one. The group is dropped; the next update builds a new one."""

    worker_gone: bool = False
    """With failover: the failure was a worker that is gone (nothing listens on its port), which failover
    has removed from the pool, so the update can go to the workers left."""


@dataclass
class _Group:
    handle: dist.ProcessGroup
    name: str
    urls: tuple[str, ...]
    backend: str


class WeightBroadcaster:
    """Sends named tensors to every worker of ``workers`` by broadcast; see the module docstring."""

    def __init__(self, workers: WorkerPool, http: HTTPClient, *, bucket_bytes: int, timeout_s: float,
                 master_address: str | None = None) -> None:
        self._workers = workers
        self._http = http
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self._master_address = master_address
        self._group: _Group | None = None

    async def push(self, tensors: Named, version: int, *, flush_cache: bool = True) -> None:
        """Loads the tensors on every worker, labelled str(version); flush_cache as SGLang's field (False while
        requests are held by an in_place pause). With failover, a worker found gone during the update leaves
        the pool as on every other call, and the update goes again to the workers left (a new group).
        Memory: ``tensors`` is a sequence held for the whole update, since that retry sends it again; so this
        process holds the whole model where the tensors live (the disk and tensor syncs stream instead)."""
        while True:
            try:
                return await self._push_once(tensors, version, flush_cache)
            except WeightBroadcastError as exc:
                if not exc.worker_gone:
                    raise

    async def _push_once(self, tensors: Named, version: int, flush_cache: bool) -> None:
        if not tensors:
            raise InvalidArgumentError("a weight broadcast needs at least one tensor")
        backend = "nccl" if tensors[0][1].is_cuda else "gloo"
        try:
            urls = tuple(await self._workers.worker_urls())
            profiles = await self._workers.profiles()
        except SGLangHTTPError as exc:
            raise WeightBroadcastError(f"weight broadcast: a worker could not be reached: {exc}") from exc
        old = [f"{p.url} (SGLang {p.version})" for p in profiles if p.dialect is not sglang_wire.CURRENT]
        if old:
            raise InvalidArgumentError(f"weight_sync='broadcast' speaks SGLang {sglang_wire.SGLANG_RELEASE}'s "
                                       f"collective update; {', '.join(old)} predate it: use weight_sync='disk'")
        if self._group is None or self._group.urls != urls or self._group.backend != backend:
            await self._build(urls, backend)
        group = self._group
        assert group is not None
        try:
            try:
                await self._each(urls, "/begin_weight_update", {})
                for bucket in buckets(tensors, self.bucket_bytes):
                    await self._send(group, bucket, version, flush_cache)
            except BaseException:
                await self._end_sessions(urls)
                raise
            await self._each(urls, "/end_weight_update", {})
        except BaseException:
            self._group = None  # a broken group carries no further broadcast: the next update builds a new one
            raise

    def reset(self) -> None:
        """Forgets the group (a worker restarted and left it): the next update builds a new one."""
        self._group = None

    async def close(self) -> None:
        """Leaves the group on every worker and here (best effort: the workers may be gone)."""
        group, self._group = self._group, None
        if group is None:
            return
        await self._post_all(group.urls, "/destroy_weights_update_group", {"group_name": group.name})
        try:
            destroy_weight_group(group.handle)
        except (RuntimeError, ValueError) as exc:  # the process is leaving the group either way
            logger.warning("destroying weight group %r: %s", group.name, exc)

    async def _build(self, urls: tuple[str, ...], backend: str) -> None:
        self._group = None
        address = self._master_address or master_address_for(urls)
        port = _free_port(address)
        name = f"april_ext_weights_{uuid.uuid4().hex[:12]}"  # torch keeps group names for the process's life
        world = 1 + len(urls)
        joined = asyncio.ensure_future(asyncio.to_thread(join_weight_group, address, port, 0, world, name, backend,
                                                         self.timeout_s))
        calls = {u: self._http.call("POST", f"{u}/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": 1 + i, "world_size": world,
            "group_name": name, "backend": backend}, idempotent=False) for i, u in enumerate(urls)}
        await self._together(joined, calls, f"joining weight group {name!r} at {address}:{port}")
        self._group = _Group(joined.result(), name, urls, backend)

    async def _send(self, group: _Group, bucket: Named, version: int, flush_cache: bool) -> None:
        body = {"names": [n for n, _ in bucket], "dtypes": [dtype_name(t.dtype) for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket], "group_name": group.name,
                "weight_version": str(version), "flush_cache": flush_cache, "abort_all_requests": False}
        device = "cuda" if group.backend == "nccl" else "cpu"
        payload = [t.detach().to(device).contiguous() for _, t in bucket]
        sent = asyncio.ensure_future(asyncio.to_thread(broadcast_tensors, group.handle, payload))
        calls = {u: self._http.call("POST", f"{u}/update_weights_from_distributed", body, idempotent=False)
                 for u in group.urls}
        await self._together(sent, calls, f"broadcasting {len(bucket)} tensors in group {group.name!r}")

    async def _together(self, local: asyncio.Future[Any], calls: dict[str, Awaitable[Any]], what: str) -> None:
        """Waits for this process's side and every worker's answer; the first failure raises at once
        (the local side, blocked in a collective, ends when the group's timeout expires)."""
        tasks = {asyncio.ensure_future(c): u for u, c in calls.items()}
        # Retrieved even when a worker's failure is raised first: asyncio would log it as never retrieved.
        local.add_done_callback(lambda f: f.cancelled() or f.exception())
        done, pending = await asyncio.wait([local, *tasks], timeout=2 * self.timeout_s,
                                           return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            if task is not local:
                task.cancel()
        for task in [*tasks, local]:
            if task in done and task.exception() is not None:
                exc = task.exception()
                if task in tasks:
                    raise self._failure(tasks[task], f"{what}: worker {tasks[task]} failed: {exc}", exc)
                raise WeightBroadcastError(f"{what}: the trainer's side failed: {exc}") from exc
        if pending:
            late = [tasks.get(t, "the trainer's side") for t in pending]
            raise WeightBroadcastError(f"{what}: no answer from {', '.join(late)} within {2 * self.timeout_s} s")

    def _failure(self, url: str, message: str, cause: BaseException) -> WeightBroadcastError:
        """The error for a worker's failed call; with failover, a worker that is gone is removed from the pool
        (whose listeners cut its requests and take it off the router) and the error says so."""
        error = WeightBroadcastError(message)
        error.__cause__ = cause
        if self._workers.failover and refused(cause):
            self._workers.remove(url, f"refused connections ({cause})")
            error.worker_gone = True
        return error

    async def _end_sessions(self, urls: Sequence[str]) -> None:
        """After a failed update: closes the sessions of the workers that still answer, so that the next
        update can open them again (a worker that is gone cannot, and need not)."""
        await self._post_all(urls, "/end_weight_update", {})

    async def _each(self, urls: Sequence[str], endpoint: str, body: dict[str, Any]) -> None:
        """The call on every worker; any failure, or no answer within timeout_s, raises."""
        for url, answer in (await self._post_all(urls, endpoint, body)).items():
            if isinstance(answer, BaseException):
                raise self._failure(url, f"{url}{endpoint} failed: {answer}", answer)

    async def _post_all(self, urls: Sequence[str], endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        """POSTs to every worker at once; each url's answer, or the exception it raised (TimeoutError when
        it did not answer within timeout_s: a stopped server keeps its connection open)."""
        tasks = {asyncio.ensure_future(self._http.call("POST", f"{u}{endpoint}", body, idempotent=False)): u
                 for u in urls}
        _, pending = await asyncio.wait(tasks, timeout=self.timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        late = TimeoutError(f"no answer within {self.timeout_s} s")
        return {u: (late if t in pending else t.exception() or t.result()) for t, u in tasks.items()}


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


__all__ = ["WeightBroadcastError", "WeightBroadcaster", "buckets", "master_address_for"]
