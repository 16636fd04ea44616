"""WorkerPool: the SGLang servers behind the adapter, how requests are routed to them and how a call
reaches every one of them (aborts, weights, memory, health).

Requests go to the least-loaded worker url (fewest requests in flight from this client) or round-robin,
or to the router; calls that must reach each worker go to the configured urls, or to those the router
lists (GET /workers, or /list_workers on older routers). Each worker is probed once (profiles.py), so
every call reaches it in the dialect of its SGLang release.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from april_ext.sglang.client import HTTPClient
from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.errors import SGLangHTTPError
from april_ext.sglang.profiles import ServerProfile, probe


class WorkerPool:
    """Routes requests (``pick`` / ``release``) and broadcasts calls to every worker."""

    def __init__(self, config: SGLangEngineConfig, http: HTTPClient) -> None:
        self.config = config
        self._http = http
        self.load = {url: 0 for url in (config.worker_urls or (config.router_url,))}
        self._round_robin = itertools.cycle(list(self.load))
        self._profiles: dict[str, ServerProfile] = {}

    def pick(self) -> str:
        """The url a new request goes to; it counts as in flight there until ``release``."""
        if self.config.router_url is not None or self.config.balance == "round_robin":
            url = next(self._round_robin)
        else:
            url = min(self.load, key=self.load.__getitem__)
        self.load[url] += 1
        return url

    def release(self, url: str) -> None:
        self.load[url] -= 1

    async def worker_urls(self) -> list[str]:
        """The worker urls: the configured ones, or the router's list (GET /workers, else /list_workers)."""
        if self.config.router_url is None:
            return list(self.config.worker_urls)
        router = self.config.router_url
        try:
            answer = await self._http.call("GET", f"{router}/workers", idempotent=True)
        except SGLangHTTPError as exc:
            if exc.status != 404:
                raise
            answer = await self._http.call("GET", f"{router}/list_workers", idempotent=True)
        return _parse_workers(answer, router)

    async def profile(self, url: str) -> ServerProfile:
        """The worker's profile, probed on first use."""
        if url not in self._profiles:
            self._profiles[url] = await probe(self._http, url)
        return self._profiles[url]

    async def profiles(self) -> list[ServerProfile]:
        """Every worker's profile (each probed once, at once)."""
        return list(await asyncio.gather(*(self.profile(u) for u in await self.worker_urls())))

    async def broadcast(self, endpoint: str, payload: Any, method: str = "POST") -> list[tuple[str, Any]]:
        """Sends the call to every worker at once; returns (url, answer) pairs. Any failure raises.
        payload: the body, or a function of a worker's profile returning its body (releases differ)."""
        if callable(payload):
            bodies = [(p.url, payload(p)) for p in await self.profiles()]
        else:
            bodies = [(u, payload) for u in await self.worker_urls()]
        answers = await asyncio.gather(*(self._http.call(method, f"{u}{endpoint}", body, idempotent=True)
                                         for u, body in bodies))
        return [(u, a) for (u, _), a in zip(bodies, answers)]

    async def each(self, call: Callable[[ServerProfile], Any]) -> list[tuple[str, Any]]:
        """Runs call(profile) (a coroutine) for every worker at once; returns (url, result) pairs."""
        profiles = await self.profiles()
        results = await asyncio.gather(*(call(p) for p in profiles))
        return [(p.url, r) for p, r in zip(profiles, results)]

    async def check_health(self) -> dict[str, Any]:
        """GET /health on every worker: {"status": "ok" | "error", "workers": {url: "ok" | reason}, "error"}."""
        try:
            urls = await self.worker_urls()
        except SGLangHTTPError as exc:
            return {"status": "error", "workers": {}, "error": str(exc)}
        results = await asyncio.gather(*(self._http.call("GET", f"{u}/health", idempotent=False) for u in urls),
                                       return_exceptions=True)
        workers = {u: "ok" if not isinstance(r, BaseException) else str(r) for u, r in zip(urls, results)}
        bad = [reason for reason in workers.values() if reason != "ok"]
        return {"status": "error" if bad else "ok", "workers": workers, "error": bad[0] if bad else None}


def _parse_workers(answer: Any, router: str) -> list[str]:
    items: Any = None
    if isinstance(answer, dict):
        items = answer.get("workers", answer.get("urls"))
    elif isinstance(answer, list):
        items = answer
    urls = []
    for item in items if isinstance(items, list) else []:
        url = item.get("url") if isinstance(item, dict) else item
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            urls.append(url.rstrip("/"))
    if not urls:
        raise SGLangHTTPError(router, 200, f"the router lists no worker urls: {answer!r}")
    return urls


__all__ = ["WorkerPool"]
