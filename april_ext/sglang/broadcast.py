"""WeightBroadcaster: the trainer's end of SGLang's collective weight update, split in two so that the
process that holds the tensors need not be the one that talks to the workers.

- WeightSender, the collective side: rank 0 of the group. It hosts the group's rendezvous, holds one bucket
  of tensors at a time and broadcasts it. It runs where the tensors are: in this process (the SGLang adapter
  of a single-process run), or in trainer rank 0's Ray actor (april_ext.cluster.weight_sync).
- WeightBroadcaster, the HTTP side: the workers' endpoints. Every worker joins the group through
  /init_weights_update_group (worker i is rank 1 + i; world size 1 + workers); each update opens SGLang's
  weight-update session on every worker, then for each bucket (up to bucket_bytes, in the trainer's order)
  asks the sender for the bucket's names, dtypes and shapes, posts /update_weights_from_distributed with them
  to every worker and has the sender broadcast the bucket meanwhile, then closes the session.

The two meet through a BroadcastSource: the weights of one version, read bucket by bucket from the first
tensor as often as asked (a retry reads them again), and the GroupHost that sends them. A StagedSource is
the weights in parts, each with its own host (a pipeline stage's first rank sends its stage's part): one
group per part, every worker in each, the parts sent in turn, each in its own session. A group is built on
the first update and built again when the worker list or its host changes, after a failed update, or when
reset() says a worker came back (a restarted server has left the groups).

Every wait is bounded by timeout_s: a worker that does not join, or dies or stalls mid-broadcast, raises
WeightBroadcastError naming it (an HTTP failure at once, a silent peer when the group's timeout expires);
nothing hangs. gloo carries CPU tensors, nccl CUDA ones (the backend follows the tensors' device).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import uuid
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from april_ext.errors import AprilError, InvalidArgumentError, InvalidStateError
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


@dataclass(frozen=True)
class BucketMeta:
    """What the workers are told of a bucket before it is broadcast (the body of
    /update_weights_from_distributed), and the group backend its tensors need."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    backend: str


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


@dataclass(frozen=True)
class StagedSource:
    """The weights of one update in parts, each read and sent by its own host (a pipeline stage's first
    trainer rank), in order; the parts' names together are the whole model's."""

    parts: tuple[BroadcastSource, ...]

    def __post_init__(self) -> None:
        if not self.parts:
            raise InvalidArgumentError("StagedSource needs at least one part")


@dataclass
class _Group:
    host: GroupHost
    name: str
    urls: tuple[str, ...]
    backend: str
    usable: bool = True


class WeightBroadcaster:
    """Sends weights to every worker of ``workers`` by broadcast; see the module docstring."""

    def __init__(self, workers: WorkerPool, http: HTTPClient, *, bucket_bytes: int, timeout_s: float,
                 master_address: str | None = None) -> None:
        self._workers = workers
        self._http = http
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.local = LocalHost(WeightSender(timeout_s), master_address)
        self._groups: dict[int, _Group] = {}  # by part (a StagedSource's index; 0 otherwise)

    async def push(self, weights: Named | BroadcastSource | StagedSource, version: int, *,
                   flush_cache: bool = True) -> list[str]:
        """Loads the weights on every worker, labelled str(version), and returns their names; flush_cache as
        SGLang's field (False while requests are held by an in_place pause). Named tensors are broadcast from
        this process (held for the whole update: the retry below sends them again); a BroadcastSource from
        its host, which reads them bucket by bucket; a StagedSource part by part, each from its host. With
        failover, a worker found gone during the update leaves the pool as on every other call, and the update
        goes again to the workers left (new groups), reading the weights again from the first tensor."""
        if isinstance(weights, StagedSource):
            sources = list(weights.parts)
        elif isinstance(weights, BroadcastSource):
            sources = [weights]
        else:
            sources = [LocalSource(weights, self.local, self.bucket_bytes)]
        async with contextlib.AsyncExitStack() as held:
            for host in dict.fromkeys(s.host for s in sources):
                await held.enter_async_context(host.lock)
            while True:
                try:
                    return await self._push_once(sources, version, flush_cache)
                except WeightBroadcastError as exc:
                    if not exc.worker_gone:
                        raise

    async def _push_once(self, sources: list[BroadcastSource], version: int, flush_cache: bool) -> list[str]:
        """One attempt: every part to the workers listed now (the same workers get every part)."""
        try:
            urls = tuple(await self._workers.worker_urls())
            profiles = await self._workers.profiles()
        except SGLangHTTPError as exc:
            raise WeightBroadcastError(f"weight broadcast: a worker could not be reached: {exc}") from exc
        old = [f"{p.url} (SGLang {p.version})" for p in profiles if p.dialect is not sglang_wire.CURRENT]
        if old:
            raise InvalidArgumentError(f"weight_sync='broadcast' speaks SGLang {sglang_wire.SGLANG_RELEASE}'s "
                                       f"collective update; {', '.join(old)} predate it: use weight_sync='disk'")
        names: list[str] = []
        for part, source in enumerate(sources):
            names += await self._push_part(part, source, urls, version, flush_cache)
        return sorted(names)

    async def _push_part(self, part: int, source: BroadcastSource, urls: tuple[str, ...], version: int,
                         flush_cache: bool) -> list[str]:
        """One part, in its group, inside a session of its own on every worker; the names sent."""
        await self._bounded(source.rewind(version), "reading the weights")
        bucket = await self._bounded(source.next_bucket(), "reading the weights")
        if bucket is None:
            raise InvalidArgumentError("a weight broadcast needs at least one tensor in each part")
        group = self._groups.get(part)
        if (group is None or not group.usable or group.urls != urls or group.backend != bucket.backend
                or group.host is not source.host):
            group = await self._build(part, source.host, urls, bucket.backend)
        names: list[str] = []
        try:
            try:
                await self._each(urls, "/begin_weight_update", {})
                while bucket is not None:
                    await self._send(group, bucket, version, flush_cache)
                    names.extend(bucket.names)
                    bucket = await self._bounded(source.next_bucket(), "reading the weights")
            except BaseException:
                await self._end_sessions(urls)
                raise
            await self._each(urls, "/end_weight_update", {})
        except BaseException:
            group.usable = False  # a broken group carries no further broadcast: the next update builds a new one
            raise
        return names

    def reset(self) -> None:
        """A worker restarted and left the groups: the next update builds new ones."""
        for group in self._groups.values():
            group.usable = False

    async def close(self) -> None:
        """Leaves the groups on every worker and on their hosts (best effort: the workers may be gone)."""
        groups, self._groups = self._groups, {}
        for group in groups.values():
            await self._leave(group, group.urls)

    async def _leave(self, group: _Group, urls: Sequence[str]) -> None:
        """Group ``group`` is left by ``urls`` and its host (best effort: they may be gone, or have dropped it
        after a failed broadcast)."""
        await self._post_all(urls, "/destroy_weights_update_group", {"group_name": group.name})
        try:
            await self._bounded(group.host.leave(group.name), f"leaving weight group {group.name!r}")
        except WeightBroadcastError as exc:
            logger.warning("%s", exc)

    async def _build(self, part: int, host: GroupHost, urls: tuple[str, ...], backend: str) -> _Group:
        old = self._groups.pop(part, None)
        if old is not None:  # left by the workers still listed (one that left the list may not answer)
            await self._leave(old, [u for u in old.urls if u in urls])
        address, port = await self._bounded(host.endpoint(urls), "choosing the weight group's rendezvous")
        name = f"april_ext_weights_{uuid.uuid4().hex[:12]}"  # torch keeps group names for the process's life
        world = 1 + len(urls)
        joined = asyncio.ensure_future(host.join(address, port, world, name, backend))
        calls = {u: self._http.call("POST", f"{u}/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": 1 + i, "world_size": world,
            "group_name": name, "backend": backend}, idempotent=False) for i, u in enumerate(urls)}
        await self._together(joined, calls, f"joining weight group {name!r} at {address}:{port}")
        self._groups[part] = _Group(host, name, urls, backend)
        return self._groups[part]

    async def _send(self, group: _Group, bucket: BucketMeta, version: int, flush_cache: bool) -> None:
        body = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes, "group_name": group.name,
                "weight_version": str(version), "flush_cache": flush_cache, "abort_all_requests": False}
        sent = asyncio.ensure_future(group.host.send(group.name))
        calls = {u: self._http.call("POST", f"{u}/update_weights_from_distributed", body, idempotent=False)
                 for u in group.urls}
        await self._together(sent, calls, f"broadcasting {len(bucket.names)} tensors in group {group.name!r}")

    async def _bounded(self, call: Awaitable[Any], what: str) -> Any:
        """The host's answer within 2 x timeout_s (it may be another process, which may die or stall; after a
        failed update it may first have to leave a collective, which takes up to timeout_s)."""
        limit = 2 * self.timeout_s
        try:
            return await asyncio.wait_for(call, limit)
        except asyncio.TimeoutError:
            raise WeightBroadcastError(f"{what}: the trainer's side did not answer within {limit} s") from None
        except (RuntimeError, OSError) as exc:
            if isinstance(exc, AprilError):
                raise
            raise WeightBroadcastError(f"{what}: the trainer's side failed: {exc}") from exc

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


__all__ = ["BroadcastSource", "BucketMeta", "GroupHost", "LocalHost", "LocalSource", "StagedSource",
           "WeightBroadcastError", "WeightBroadcaster", "WeightSender", "buckets", "master_address_for"]
