"""WorkerPool: the SGLang servers behind the adapter, how requests are routed to them, how a call
reaches every one of them (aborts, weights, memory, health), and which of them are in the pool.

Requests go to the least-loaded live worker url or round-robin, or to the router. Least loaded: the fewest KV
tokens, as the worker last reported them (its release's load report, read every config.load_interval_s by
``read_loads``) plus the input tokens of the requests this client sent it since; ties, and workers without a
report, by the fewest requests in flight from this client. calls that must reach each worker go to the configured urls, or to those
the router lists (GET /workers, or /list_workers on older routers). Each worker is probed once
(profiles.py), so every call reaches it in the dialect of its SGLang release.

With failover (config.worker_timeout_s, see failover.py) a worker can be removed: it gets no requests and
no calls any more (behind a router it is deleted from the router, DELETE /workers/{id}), a call still
waiting on it ends, and a connection failure of a call removes the worker instead of failing the call.
It is added back (router: POST /workers) by ``rejoin`` once it holds the current weights.

With direct urls the pool's membership can also be driven from outside (a Ray run routing straight to its
engines, april_ext.cluster): ``drop`` takes a worker out as ``remove`` does but for good (failover does not
bring it back), and ``admit`` adds a worker, new or dropped, once it holds the current weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from april_ext.errors import InvalidStateError
from april_ext.protocol.sglang_wire import load_tokens
from april_ext.sglang.client import HTTPClient, refused
from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.errors import SGLangConnectionError, SGLangHTTPError, SGLangNoWorkerError
from april_ext.sglang.profiles import ServerProfile, probe


@dataclasses.dataclass(frozen=True)
class Removal:
    """Why and when (time.time()) a worker left the pool."""

    reason: str
    at: float


class WorkerPool:
    """Routes requests (``pick`` / ``release``), broadcasts calls to every live worker, and keeps which
    workers are removed (``remove`` / ``rejoin``)."""

    def __init__(self, config: SGLangEngineConfig, http: HTTPClient) -> None:
        self.config = config
        self._http = http
        self.load = {url: 0 for url in (config.worker_urls or (config.router_url,))}
        self.reported: dict[str, int] = {}
        """KV tokens (in use and queued) each worker reported at its last reading."""
        self._sent: dict[str, int] = {}
        self._turn = itertools.count()
        self._profiles: dict[str, ServerProfile] = {}
        self.removed: dict[str, Removal] = {}
        self.removals = 0
        self.rejoins = 0
        self._listed: list[str] = list(config.worker_urls)
        self._gone: dict[str, asyncio.Event] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._forgotten: set[str] = set()
        self.dropped: dict[str, str] = {}
        """Workers taken out by ``drop`` and not admitted since: why."""

    @property
    def failover(self) -> bool:
        return self.config.worker_timeout_s is not None

    def pick(self, tokens: int = 0) -> str:
        """The url a new request of ``tokens`` input tokens goes to; it counts as in flight there until
        ``release``. Raises SGLangNoWorkerError when failover removed (or ``drop`` took out) every worker."""
        live = self.live()
        if not live and (self.removed or self.dropped):
            raise SGLangNoWorkerError({**{url: r.reason for url, r in self.removed.items()}, **self.dropped})
        if self.config.router_url is not None:
            url = self.config.router_url
        elif self.config.balance == "round_robin":
            url = live[next(self._turn) % len(live)]
        else:
            url = min(live, key=self._estimate)
        self.load[url] += 1
        self._sent[url] = self._sent.get(url, 0) + tokens
        return url

    def _estimate(self, url: str) -> tuple[int, int]:
        """(KV tokens: reported at the last reading + sent since, requests in flight from this client). Before
        its first reading (or a worker that reports none), the tokens sent since it joined."""
        return self.reported.get(url, 0) + self._sent.get(url, 0), self.load[url]

    async def read_loads(self) -> None:
        """Reads every live worker's load report (a worker whose release has none, or that fails to answer,
        keeps its last reading: failover deals with dead workers)."""
        urls = self.live()
        sent = {url: self._sent.get(url, 0) for url in urls}

        async def read(url: str) -> int | None:
            profile = await self.profile(url)
            return load_tokens(await self._http.call("GET", f"{url}{profile.dialect.load_path}", idempotent=True))

        answers = await asyncio.gather(*(read(u) for u in urls), return_exceptions=True)
        for url, tokens in zip(urls, answers):
            if isinstance(tokens, int) and url not in self.removed and url not in self.dropped:
                # The requests sent while the reading was on its way may be in it or not: counted once more.
                self.reported[url] = tokens
                self._sent[url] = self._sent.get(url, 0) - sent[url]
            elif isinstance(tokens, BaseException) and not isinstance(tokens, (SGLangHTTPError, OSError)):
                raise tokens

    def release(self, url: str) -> None:
        self.load[url] -= 1

    def live(self) -> list[str]:
        """The workers in the pool as last seen (the router's list as of its last reading)."""
        return [u for u in self._listed if u not in self.removed]

    async def worker_urls(self) -> list[str]:
        """The live worker urls: the configured ones, or the router's list (GET /workers, else
        /list_workers), less the removed ones."""
        if self.config.router_url is not None:
            listed = [url for url, _ in await self._router_workers()]
            self._listed = listed
            live = [u for u in listed if u not in self.removed]
            if not live and self.removed:
                raise SGLangNoWorkerError({url: r.reason for url, r in self.removed.items()})
            if not live:
                raise SGLangHTTPError(self.config.router_url, 200, "the router lists no worker urls")
            return live
        return self.live()

    async def _router_workers(self) -> list[tuple[str, str | None]]:
        """(url, id) of every worker the router lists (ids only from the current REST API)."""
        router = self.config.router_url
        try:
            answer = await self._http.call("GET", f"{router}/workers", idempotent=True)
        except SGLangHTTPError as exc:
            if exc.status != 404:
                raise
            answer = await self._http.call("GET", f"{router}/list_workers", idempotent=True)
        return _parse_workers(answer)

    # Membership (failover) ----------------------------------------------------------------------------

    def listen(self, on_removed: Callable[[str], None]) -> None:
        """on_removed(url) runs whenever a worker is removed."""
        self._listeners.append(on_removed)

    def remove(self, url: str, reason: str) -> bool:
        """Takes the worker out of the pool (no requests, no calls; the calls waiting on it end); False
        when it already was. Behind a router, ``detach`` deletes it there."""
        if url in self.removed or url in self._forgotten:
            return False
        self.removed[url] = Removal(reason, time.time())
        self.removals += 1
        # What comes back on this url starts unread.
        self.reported.pop(url, None)
        self._sent.pop(url, None)
        self._gone.setdefault(url, asyncio.Event()).set()
        self._profiles.pop(url, None)  # whatever comes back on this url is probed anew
        for listener in self._listeners:
            listener(url)
        return True

    async def detach(self, url: str) -> None:
        """Deletes a removed worker from the router (DELETE /workers/{id}), so that it routes nothing to it."""
        router = self.config.router_url
        ids = [wid for u, wid in await self._router_workers() if u == url]
        for wid in ids:
            if wid is None:
                raise SGLangHTTPError(f"{router}/workers", 404, "the router has no REST worker API (GET /workers "
                                      f"with ids, DELETE /workers/{{id}}): {url} cannot be removed from it")
            await self._http.call("DELETE", f"{router}/workers/{wid}", idempotent=True)

    async def rejoin(self, url: str) -> None:
        """Puts a removed worker back (it must hold the current weights). Behind a router, it is added
        there (POST /workers) and back in the pool once the router lists it."""
        router = self.config.router_url
        if router is not None:
            # The router calls the worker with the key it was registered with (servers started with --api-key).
            body = {"url": url} if self.config.api_key is None else {"url": url, "api_key": self.config.api_key}
            await self._http.call("POST", f"{router}/workers", body, idempotent=False)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + float(self.config.worker_timeout_s or self.config.timeout_s)
            while url not in (listed := [u for u, _ in await self._router_workers()]):
                if loop.time() > deadline:
                    raise SGLangHTTPError(f"{router}/workers", 202, f"the router did not list {url} in time")
                await asyncio.sleep(0.1)
            self._listed = listed
        if url not in self.removed:
            raise InvalidStateError(f"{url} cannot rejoin: it was dropped or forgotten meanwhile")
        del self.removed[url]
        self._gone[url] = asyncio.Event()
        self.rejoins += 1

    def forget(self, url: str) -> None:
        """Drops a removed worker for good: its server is gone and a replacement serves elsewhere (a Ray
        engine restarts on a new url), so it is neither awaited back nor reported removed any more, and a
        late failure of a call to it removes nothing."""
        self._forgotten.add(url)
        self.removed.pop(url, None)
        self._gone.pop(url, None)
        self.dropped.pop(url, None)
        self._listed = [u for u in self._listed if u != url]

    def drop(self, url: str, reason: str) -> None:
        """Takes a worker out until ``admit`` brings it back (its owner found it down): the calls waiting on it
        end and so do its requests, as with ``remove``, but failover does not bring it back by itself."""
        self.remove(url, reason)
        self.forget(url)
        self.dropped[url] = reason

    def admit(self, url: str) -> None:
        """Adds a worker (a new one, or one dropped or forgotten before) that holds the current weights: it gets
        requests and calls from now on."""
        if self.config.router_url is not None:
            raise InvalidStateError(f"admit({url!r}): behind a router its list is the pool's, not this client's")
        self._forgotten.discard(url)
        self.dropped.pop(url, None)
        self.removed.pop(url, None)
        if url not in self._listed:
            self._listed.append(url)
        self.load.setdefault(url, 0)
        self._gone[url] = asyncio.Event()
        self.rejoins += 1

    def only(self, url: str) -> WorkerPool:
        """A pool of this one worker, without failover (a call to it fails if it fails): for bringing a
        removed worker up to date before it rejoins."""
        pool = WorkerPool(dataclasses.replace(self.config, worker_urls=(url,), router_url=None, worker_timeout_s=None),
                          self._http)
        pool._profiles = self._profiles
        return pool

    # Calls to every worker ----------------------------------------------------------------------------

    async def profile(self, url: str) -> ServerProfile:
        """The worker's profile, probed on first use."""
        if url not in self._profiles:
            self._profiles[url] = await probe(self._http, url)
        return self._profiles[url]

    async def profiles(self) -> list[ServerProfile]:
        """Every live worker's profile (each probed once, at once)."""
        urls = await self.worker_urls()
        found = await self._each_url(urls, self.profile)
        return [p for _, p in found]

    async def broadcast(self, endpoint: str, payload: Any, method: str = "POST") -> list[tuple[str, Any]]:
        """Sends the call to every live worker at once; returns (url, answer) pairs. Any failure raises,
        except (with failover) a worker's lost connection, which removes that worker.
        payload: the body, or a function of a worker's profile returning its body (releases differ)."""
        if callable(payload):
            bodies = {p.url: payload(p) for p in await self.profiles()}
        else:
            bodies = {u: payload for u in await self.worker_urls()}
        return await self._each_url(list(bodies), lambda u: self._http.call(method, f"{u}{endpoint}", bodies[u],
                                                                           idempotent=True))

    async def each(self, call: Callable[[ServerProfile], Any]) -> list[tuple[str, Any]]:
        """Runs call(profile) (a coroutine) for every live worker at once; returns (url, result) pairs (as
        broadcast does: with failover, a worker whose connection fails is removed and left out)."""
        profiles = {p.url: p for p in await self.profiles()}
        return await self._each_url(list(profiles), lambda u: call(profiles[u]))

    async def post(self, url: str, endpoint: str, body: dict[str, Any]) -> Any:
        """One POST to one worker, not retried (a weight update's call is not idempotent); its failure raises."""
        return await self._http.call("POST", f"{url}{endpoint}", body, idempotent=False)

    def lost(self, url: str, cause: BaseException) -> bool:
        """Whether ``cause`` (a failed call to ``url``) says the worker is gone (nothing listens on its port);
        with failover such a worker is removed, as a lost connection removes it on every other call."""
        if not (self.failover and refused(cause)):
            return False
        self.remove(url, f"refused connections ({cause})")
        return True

    async def call_each(self, urls: list[str], endpoint: str, payload: Any) -> None:
        """POSTs payload to each of urls, as broadcast does (a removed one is skipped)."""
        live = [u for u in urls if u not in self.removed]
        await self._each_url(live, lambda u: self._http.call("POST", f"{u}{endpoint}", payload, idempotent=True))

    async def _each_url(self, urls: list[str], call: Callable[[str], Any]) -> list[tuple[str, Any]]:
        if not self.failover:
            results = await asyncio.gather(*(call(u) for u in urls))
            return list(zip(urls, results))
        results = await asyncio.gather(*(self._unless_removed(u, call(u)) for u in urls), return_exceptions=True)
        answered = []
        for url, result in zip(urls, results):
            if isinstance(result, SGLangConnectionError):
                self.remove(url, str(result))
            elif isinstance(result, BaseException):
                raise result
            elif url not in self.removed:
                answered.append((url, result))
        if urls and not answered and not self.live():
            raise SGLangNoWorkerError({url: r.reason for url, r in self.removed.items()})
        return answered

    async def _unless_removed(self, url: str, coro: Any) -> Any:
        """The call's answer, or None once the worker is removed meanwhile (the call is cancelled)."""
        gone = self._gone.setdefault(url, asyncio.Event())
        call = asyncio.ensure_future(coro)
        waiter = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({call, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not call.done():
            call.cancel()
            await asyncio.gather(call, return_exceptions=True)
            return None
        return call.result()

    async def check_health(self) -> dict[str, Any]:
        """GET /health on every live worker: {"status": "ok" | "error", "workers": {url: "ok" | reason},
        "removed": {url: reason} (failover), "error"}."""
        removed = {url: r.reason for url, r in self.removed.items()}
        try:
            urls = await self.worker_urls()
        except (SGLangHTTPError, SGLangNoWorkerError) as exc:
            return {"status": "error", "workers": {}, "removed": removed, "error": str(exc)}
        results = await asyncio.gather(*(self._http.call("GET", f"{u}/health", idempotent=False) for u in urls),
                                       return_exceptions=True)
        workers = {u: "ok" if not isinstance(r, BaseException) else str(r) for u, r in zip(urls, results)}
        bad = [reason for reason in workers.values() if reason != "ok"]
        return {"status": "error" if bad else "ok", "workers": workers, "removed": removed,
                "error": bad[0] if bad else None}


def _parse_workers(answer: Any) -> list[tuple[str, str | None]]:
    items: Any = None
    if isinstance(answer, dict):
        items = answer.get("workers", answer.get("urls"))
    elif isinstance(answer, list):
        items = answer
    workers = []
    for item in items if isinstance(items, list) else []:
        url = item.get("url") if isinstance(item, dict) else item
        wid = item.get("id") if isinstance(item, dict) else None
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            workers.append((url.rstrip("/"), str(wid) if wid is not None else None))
    return workers


@contextlib.asynccontextmanager
async def workers_at(urls: Sequence[str], api_key: str | None = None) -> AsyncIterator[WorkerPool]:
    """A pool of ``urls`` with an HTTP client of its own (the adapter's defaults, the servers' ``api_key``), for
    a process that calls the workers itself: a Ray trainer rank that posts its weights (weight_sync "tensor")."""
    config = SGLangEngineConfig(worker_urls=tuple(urls), weight_sync="tensor", api_key=api_key)
    http = HTTPClient.of(config)
    await http.start()
    try:
        yield WorkerPool(config, http)
    finally:
        await http.close()


__all__ = ["Removal", "WorkerPool", "workers_at"]
