"""Aborter: ends requests on their SGLang servers and waits for their streams to end.

An abort can overtake its request on another connection and find nothing to abort, so it is re-sent
every abort_resend_s until every stream ended; after abort_timeout_s the streams are cut on this side.
Aborts of abandoned streams run in the background (nobody awaits them), and close() drains them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from april_ext.batch import FinishReason
from april_ext.protocol.outputs import GenerationChunk
from april_ext.sglang.background import spawn_logged
from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.requests import RequestState, wire_rid
from april_ext.sglang.workers import WorkerPool

logger = logging.getLogger(__name__)


class Aborter:
    """Sends /abort_request for given requests (to their server, or to every worker behind a router) or
    abort_all to every worker, and waits for the aborted streams."""

    def __init__(self, config: SGLangEngineConfig, workers: WorkerPool) -> None:
        self.config = config
        self._workers = workers
        self._background: set[asyncio.Task[Any]] = set()

    async def abort_all(self, states: list[RequestState], version: int) -> None:
        """abort_all on every worker; returns once the given streams ended."""
        await self._until_done(states, self.send_abort_all, version)

    async def send_abort_all(self) -> None:
        """One abort_all to every worker, whoever sent their requests; returns once each answered."""
        await self._workers.call_each(await self._workers.worker_urls(), "/abort_request",
                                      {"rid": "", "abort_all": True})

    async def abort_states(self, states: list[RequestState], version: int) -> None:
        """Aborts each request by its rid; returns once their streams ended."""
        async def send() -> None:
            pending = [s for s in states if not s.done.is_set()]
            workers = await self._workers.worker_urls() if self.config.router_url is not None else None
            await asyncio.gather(*(self._workers.call_each(workers if workers is not None else [s.url],
                                                           "/abort_request", {"rid": wire_rid(s.request_id)})
                                   for s in pending))
        await self._until_done(states, send, version)

    async def _until_done(self, states: list[RequestState], send: Callable[[], Awaitable[None]],
                          version: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.abort_timeout_s
        while True:
            await send()
            waiting = [s for s in states if not s.done.is_set()]
            if not waiting:
                return
            left = deadline - loop.time()
            if left <= 0:
                break
            waiters = [asyncio.ensure_future(s.done.wait()) for s in waiting]
            try:
                await asyncio.wait(waiters, timeout=min(self.config.abort_resend_s, left))
            finally:
                for waiter in waiters:
                    waiter.cancel()
        await self.cut(states, version)

    async def cut(self, states: list[RequestState], version: int) -> None:
        """Ends the streams still running on this side (their reader tasks are cancelled): each ends with
        an ABORT chunk, the output keeps the tokens received so far."""
        for state in states:
            if not state.done.is_set() and state.task is not None:
                state.task.cancel()
                state.finish_reason = FinishReason.ABORT
                state.queue.put_nowait(GenerationChunk(state.request_id, [], [], version, FinishReason.ABORT))
        await asyncio.gather(*(s.task for s in states if s.task is not None), return_exceptions=True)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Runs a fire-and-forget abort (of an abandoned stream); a failure is logged, since nobody awaits it."""
        spawn_logged(self._background, coro, logger, "SGLang background abort failed")

    async def drain(self) -> None:
        """Waits for the background aborts."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


__all__ = ["Aborter"]
