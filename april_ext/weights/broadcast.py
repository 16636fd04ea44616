"""WeightBroadcaster: the trainer's end of SGLang's collective weight update, split in two so that the
process that holds the tensors need not be the one that talks to the workers.

- WeightSender, the collective side: rank 0 of the group. It hosts the group's rendezvous, holds one bucket
  of tensors at a time and broadcasts it. It runs where the tensors are: in this process (the SGLang adapter
  of a single-process run), or in trainer rank 0's Ray actor (april_ext.cluster.rank_export).
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
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from april_ext.errors import AprilError, InvalidArgumentError
from april_ext.protocol import sglang_wire
from april_ext.protocol.sglang_errors import SGLangHTTPError
from april_ext.weights.sender import LocalHost, LocalSource, WeightSender
from april_ext.weights.sources import BroadcastSource, BucketMeta, GroupHost, Named, StagedSource
from april_ext.weights.workers import Workers

logger = logging.getLogger(__name__)


class WeightBroadcastError(AprilError, RuntimeError):
    """A weight broadcast failed: a worker did not join the group, refused an update, or died or stalled
    during one. The group is dropped; the next update builds a new one."""

    worker_gone: bool = False
    """With failover: the failure was a worker that is gone (nothing listens on its port), which failover
    has removed from the pool, so the update can go to the workers left."""


@dataclass
class _Group:
    host: GroupHost
    name: str
    urls: tuple[str, ...]
    backend: str
    usable: bool = True


class WeightBroadcaster:
    """Sends weights to every worker of ``workers`` by broadcast; see the module docstring."""

    def __init__(self, workers: Workers, *, bucket_bytes: int, timeout_s: float,
                 master_address: str | None = None) -> None:
        self._workers = workers
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
        calls = {u: self._workers.post(u, "/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": 1 + i, "world_size": world,
            "group_name": name, "backend": backend}) for i, u in enumerate(urls)}
        await self._together(joined, calls, f"joining weight group {name!r} at {address}:{port}")
        self._groups[part] = _Group(host, name, urls, backend)
        return self._groups[part]

    async def _send(self, group: _Group, bucket: BucketMeta, version: int, flush_cache: bool) -> None:
        body = {"names": bucket.names, "dtypes": bucket.dtypes, "shapes": bucket.shapes, "group_name": group.name,
                "weight_version": str(version), "flush_cache": flush_cache, "abort_all_requests": False}
        sent = asyncio.ensure_future(group.host.send(group.name))
        calls = {u: self._workers.post(u, "/update_weights_from_distributed", body) for u in group.urls}
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
        error.worker_gone = self._workers.lost(url, cause)
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
        tasks = {asyncio.ensure_future(self._workers.post(u, endpoint, body)): u for u in urls}
        _, pending = await asyncio.wait(tasks, timeout=self.timeout_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        late = TimeoutError(f"no answer within {self.timeout_s} s")
        return {u: (late if t in pending else t.exception() or t.result()) for t, u in tasks.items()}


__all__ = ["WeightBroadcastError", "WeightBroadcaster"]
