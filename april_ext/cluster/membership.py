"""Membership: which engines of a Ray run get requests (TrainConfig.ray_routing). The engine pool's watch
takes an engine out when its actor is down and puts it back once it holds the current weights; how depends
on who routes: the sglang-router (its worker list) or the driver's SGLang client itself (its worker pool,
least loaded by the engines' reported KV)."""

from __future__ import annotations

import asyncio
from typing import Protocol

from april_ext.cluster.router import Router
from april_ext.sglang import SGLangEngine


class Membership(Protocol):
    async def join(self, url: str) -> None:
        """The engine at ``url`` (holding the current weights) gets requests from when this returns."""

    async def leave(self, url: str, reason: str) -> None:
        """The engine at ``url`` gets no new requests."""


class RouterMembership:
    """The engines the sglang-router lists get its requests."""

    def __init__(self, router: Router, timeout_s: float) -> None:
        self.router = router
        self.timeout_s = timeout_s

    async def join(self, url: str) -> None:
        await asyncio.to_thread(self.router.add, url)
        await asyncio.to_thread(self.router.wait_until, lambda w: w.get(url, {}).get("is_healthy"), self.timeout_s,
                                f"list {url} as healthy")

    async def leave(self, url: str, reason: str) -> None:
        # Until the router stops listing it: a weight update sent again to the engines left must not include it.
        await asyncio.to_thread(self.router.remove, url, self.timeout_s)


class DirectMembership:
    """The engines in the SGLang client's worker pool get its requests straight; one that leaves has its
    requests end as resumable partials (with failover, sglang_worker_timeout_s)."""

    def __init__(self, engine: SGLangEngine) -> None:
        self.engine = engine

    async def join(self, url: str) -> None:
        self.engine.admit_worker(url)

    async def leave(self, url: str, reason: str) -> None:
        self.engine.drop_worker(url, reason)


__all__ = ["DirectMembership", "Membership", "RouterMembership"]
