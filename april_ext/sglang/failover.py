"""Failover: finds the workers that died or stopped answering, takes them out of the pool with the
requests they were running, and brings them back once they answer again and hold the current weights.

A worker is removed when a connection to it is refused (nothing listens: the process is gone), or when
nothing came from it for worker_timeout_s: no stream event and no /health answer (a stopped or hung
process). /health is probed every worker_timeout_s / 4, each probe bounded by worker_timeout_s, so a
stall is found between worker_timeout_s and 1.25 x worker_timeout_s after the worker's last answer.

The requests a removed worker was running end as ABORT with every token received so far (the caller,
e.g. the rollout loop's scheduler, resumes them elsewhere). With direct worker urls they are known by
their url. Behind a router a request's worker is not known: a stream that has been silent for
worker_timeout_s is ended when some worker was removed since it started, is removed and not back yet, or
is not answering now.

A removed worker whose /health answers again is brought up to date (``resync``: its requests aborted,
the current weights pushed and their version checked) and rejoins the pool (behind a router: added back).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from april_ext.errors import AprilError, InternalError
from april_ext.sglang.background import cancel_and_wait, spawn_logged
from april_ext.sglang.client import HTTPClient, refused
from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.errors import SGLangHTTPError, SGLangNoWorkerError
from april_ext.sglang.requests import RequestState
from april_ext.sglang.workers import WorkerPool

logger = logging.getLogger(__name__)

PROBES_PER_TIMEOUT = 4


class Failover:
    """Watches the workers of ``workers`` while started. ``cut(states)`` ends requests as ABORT on this
    side; ``resync(url)`` brings a returning worker up to date (it raises if it cannot)."""

    def __init__(self, config: SGLangEngineConfig, http: HTTPClient, workers: WorkerPool,
                 inflight: Mapping[str, RequestState], cut: Callable[[list[RequestState]], Awaitable[None]],
                 resync: Callable[[str], Awaitable[None]]) -> None:
        if config.worker_timeout_s is None:
            raise InternalError("Failover needs config.worker_timeout_s")
        self.timeout_s = float(config.worker_timeout_s)
        self.interval_s = self.timeout_s / PROBES_PER_TIMEOUT
        self._http = http
        self._workers = workers
        self._inflight = inflight
        self._cut = cut
        self._resync = resync
        self._router = config.router_url is not None
        self._last_seen: dict[str, float] = {}
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._rejoining: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._last_tick: float | None = None
        self._removed_at: dict[str, float] = {}
        workers.listen(self._on_removed)

    def start(self) -> None:
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch())

    async def close(self) -> None:
        await cancel_and_wait([self._watcher, *self._probes.values(), *self._rejoining.values(), *self._tasks])
        self._watcher = None

    def seen(self, url: str) -> None:
        """Something came from the worker (a stream event): it is alive."""
        self._last_seen[url] = _now()

    def suspect(self, url: str | None) -> None:
        """A stream from url (None: through the router, from some worker) broke: probe now."""
        for target in [url] if url is not None else self._workers.live():
            self._probe(target)

    # Watching -----------------------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            try:
                await self._tick()
            except AprilError as exc:  # e.g. the router did not answer: a tick later, again
                logger.warning("SGLang failover: %s", exc)
            await asyncio.sleep(self.interval_s)

    async def _tick(self) -> None:
        now = _now()
        # A late tick means this process did not run (a blocking call, a stopped debugger): whatever the
        # workers sent meanwhile is not read yet, so their silence is not theirs.
        lagged = self._last_tick is not None and now - self._last_tick > 2 * self.interval_s + 1.0
        self._last_tick = now
        try:
            live = await self._workers.worker_urls()
        except SGLangNoWorkerError:
            live = []
        # A url out of the live list is not watched; when it is listed again (the owner of the list took it out
        # and put it back, e.g. a Ray engine pool after its actor stalled) its silence counts from now, not
        # from before it left.
        for url in set(self._last_seen) - set(live):
            del self._last_seen[url]
        for url in live:
            if lagged or url not in self._last_seen:
                self._last_seen[url] = now
            self._probe(url)
            silent = now - self._last_seen[url]
            if silent >= self.timeout_s:
                self._workers.remove(url, f"no answer (no stream event, no /health) for {silent:.1f} s")
        for url in list(self._workers.removed):
            if url not in self._rejoining:
                self._rejoining[url] = asyncio.create_task(self._rejoin(url))
        if self._router:
            await self._cut_silent_streams(now)

    def _probe(self, url: str) -> None:
        if url in self._probes and not self._probes[url].done():
            return

        async def probe() -> None:
            try:
                await self._http.call("GET", f"{url}/health", idempotent=False, timeout_s=self.timeout_s)
            except SGLangHTTPError as exc:
                if refused(exc):
                    self._workers.remove(url, f"refused connections ({exc})")
                return
            self._last_seen[url] = _now()

        self._probes[url] = asyncio.create_task(probe())

    async def _cut_silent_streams(self, now: float) -> None:
        # A removed worker counts until it is back: the router deletes it in the background, so a request
        # (e.g. a resumed partial) opened after the removal may still have been routed to it.
        unanswering = bool(self._workers.removed) or any(now - self._last_seen.get(u, now) > 2 * self.interval_s
                                                         for u in self._workers.live())
        silent = [s for s in self._inflight.values() if not s.done.is_set() and now - s.last_event >= self.timeout_s
                  and (unanswering or any(at >= s.opened for at in self._removed_at.values()))]
        if silent:
            logger.warning("SGLang failover: %d request(s) silent for %.1f s while a worker is not answering "
                           "end as ABORT with their tokens so far", len(silent), self.timeout_s)
            await self._cut(silent)

    # Removal and rejoin -------------------------------------------------------------------------------

    def _on_removed(self, url: str) -> None:
        self._removed_at[url] = _now()
        self._last_seen.pop(url, None)
        logger.warning("SGLang failover: worker %s removed: %s", url, self._workers.removed[url].reason)
        self._spawn(self._workers.detach(url) if self._router else self._cut_requests_on(url))

    async def _cut_requests_on(self, url: str) -> None:
        # Chosen when it runs: a request that was refused there is already sent to another worker.
        states = [s for s in self._inflight.values() if s.url == url and not s.done.is_set()]
        if states:
            await self._cut(states)

    async def _rejoin(self, url: str) -> None:
        try:
            await self._http.call("GET", f"{url}/health", idempotent=False, timeout_s=self.timeout_s)
            await self._resync(url)
            await self._workers.rejoin(url)
        except AprilError as exc:
            logger.debug("SGLang failover: %s does not rejoin yet: %s", url, exc)
            return
        finally:
            del self._rejoining[url]
        self._last_seen[url] = _now()
        logger.warning("SGLang failover: worker %s rejoined with the current weights", url)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        spawn_logged(self._tasks, coro, logger, "SGLang failover")


def _now() -> float:
    return asyncio.get_running_loop().time()


__all__ = ["PROBES_PER_TIMEOUT", "Failover"]
