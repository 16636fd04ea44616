"""Fire-and-forget work of the adapter (an abandoned stream's abort, a failed worker's removal): nobody
awaits it, so a failure is logged instead of lost, and the task is kept referenced until it ends."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from april_ext.errors import AprilError


def spawn_logged(tasks: set[asyncio.Task[Any]], coro: Coroutine[Any, Any, None], logger: logging.Logger,
                 what: str) -> None:
    """Runs ``coro`` in the background, held in ``tasks`` until it ends; an AprilError it raises is logged
    to ``logger`` as "<what>: <error>"."""
    async def logged() -> None:
        try:
            await coro
        except AprilError as exc:
            logger.warning("%s: %s", what, exc)

    task = asyncio.ensure_future(logged())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


__all__ = ["spawn_logged"]
