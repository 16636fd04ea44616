"""Background work of the adapter: fire-and-forget tasks (an abandoned stream's abort, a failed worker's
removal), which nobody awaits, so a failure is logged instead of lost and the task is kept referenced until it
ends; and stopping long-lived tasks (watchers, pollers) for sure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
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


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any] | None], retry_s: float = 0.5) -> None:
    """Cancels ``tasks`` (None entries skipped) and returns once every one has ended, whatever it raised.
    The cancellation is repeated until then: before Python 3.12, asyncio.wait_for swallows a cancellation
    that arrives as its inner future completes, and the task runs on (a watcher loop would then never end)."""
    pending = {t for t in tasks if t is not None}
    done: set[asyncio.Task[Any]] = set()
    while pending:
        for task in pending:
            task.cancel()
        finished, pending = await asyncio.wait(pending, timeout=retry_s)
        done |= finished
    await asyncio.gather(*done, return_exceptions=True)  # retrieves their exceptions


__all__ = ["cancel_and_wait", "spawn_logged"]
