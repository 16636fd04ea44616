"""What the transports need of an engine's workers: their urls and releases, and calls to them. The SGLang
adapter's WorkerPool is one (april_ext.sglang.workers); the transports know nothing else of the adapter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from april_ext.protocol.sglang_wire import SGLangDialect


class WorkerProfile(Protocol):
    """One worker as its answers describe it: its url, its SGLang release and the dialect that release speaks."""

    url: str
    version: str | None
    dialect: SGLangDialect

    def fields(self, endpoint: str, payload: dict[str, Any]) -> dict[str, Any]:
        """``payload`` with only the fields this release defines for ``endpoint``."""
        ...


class Workers(Protocol):
    """The workers a weight update goes to. ``broadcast`` and ``each`` call every worker (with failover, one
    whose connection fails is removed and left out); ``post`` calls one and raises its failure; ``lost`` says
    whether a failed call's worker is gone for good and, with failover, removes it."""

    async def worker_urls(self) -> list[str]: ...

    async def profiles(self) -> list[WorkerProfile]: ...

    async def broadcast(self, endpoint: str, payload: Any) -> list[tuple[str, Any]]: ...

    async def each(self, call: Callable[[WorkerProfile], Any]) -> list[tuple[str, Any]]: ...

    async def post(self, url: str, endpoint: str, body: dict[str, Any]) -> Any: ...

    def lost(self, url: str, cause: BaseException) -> bool: ...


__all__ = ["WorkerProfile", "Workers"]
