"""LoopTaskEngine: the lifecycle shared by engines that one background asyncio task drives.

AsyncEngine (a real model) and SimulatedEngine (a virtual clock) start, stop and report health the same
way; only what their task does differs.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import ClassVar, Self

from april_ext.errors import InvalidStateError
from april_ext.protocol.outputs import GenerationOutput


class LoopTaskEngine(ABC):
    """Start / close / ``async with`` around one background task running ``_loop``.

    ``_loop`` waits on ``_wake`` and returns once it sees ``_closing``; ``_notify`` wakes it.
    """

    _task_name: ClassVar[str]

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._closing = False
        self.last_error: BaseException | None = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        if self._task is None:
            self._wake = asyncio.Event()
            self._closing = False
            self._task = asyncio.create_task(self._loop(), name=self._task_name)

    async def close(self) -> None:
        """Aborts every request and stops the loop task."""
        if self._task is None:
            return
        await self.abort()
        self._closing = True
        self._notify()
        await self._task
        self._task = None

    @abstractmethod
    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        """Ends the requests (all when None) and returns their partial outputs."""

    @abstractmethod
    async def _loop(self) -> None:
        """The task body: serves until ``_closing`` is set."""

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _require_running(self) -> None:
        if self._task is None or self._closing:
            raise InvalidStateError(f"the engine is not running: use `async with {type(self).__name__}(...)` "
                                    "or start()")

    def _status(self, paused: bool) -> str:
        """The health status: "stopped", "error" (the last step or clock advance failed), "paused" or "ok"."""
        if self._task is None or self._task.done():
            return "stopped"
        if self.last_error is not None:
            return "error"
        return "paused" if paused else "ok"


__all__ = ["LoopTaskEngine"]
