"""ServerThread: an EmbeddedServer on its own event loop in a background thread.

For tests, notebooks and in-process rollouts: the caller keeps its own (sync or async) code and talks
to the engine over loopback HTTP exactly as it would to a separate SGLang server.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from april_ext.engine import AsyncEngine, EngineCore
from april_ext.errors import InvalidStateError
from april_ext.protocol import ServableEngine
from april_ext.server.app import EmbeddedServer, ServerConfig

T = TypeVar("T")


class ServerThread:
    """`with ServerThread(engine, ServerConfig(port=0)) as server: server.url` serves `engine` until the block
    ends. `engine`: a ServableEngine not yet started (it starts on the server's loop), or an EngineCore,
    which is served through an AsyncEngine."""

    def __init__(self, engine: EngineCore | ServableEngine, config: ServerConfig | None = None) -> None:
        self.engine = AsyncEngine(engine) if isinstance(engine, EngineCore) else engine
        self.config = config or ServerConfig(port=0)
        self.server: EmbeddedServer | None = None
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    def start(self, timeout: float = 60.0) -> str:
        """Starts the thread and returns the base url once the server listens."""
        if self._thread is not None:
            raise InvalidStateError("ServerThread.start: already started")
        self._thread = threading.Thread(target=self._run, name="april_ext-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise InvalidStateError(f"ServerThread.start: the server did not listen within {timeout} s")
        if self._error is not None:
            self._thread.join()
            self._thread = None
            raise self._error
        assert self.url is not None
        return self.url

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            self.server = EmbeddedServer(self.engine, self.config)
            self.url = loop.run_until_complete(self.server.start())
        except BaseException as exc:  # handed to start(), which raises it in the caller's thread
            self._error = exc
            self._ready.set()
            loop.close()
            return
        self._loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(self.server.stop())
            loop.close()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Runs a coroutine on the server's loop (e.g. `server.call(server.server.engine.abort())`)."""
        if self._loop is None:
            coro.close()
            raise InvalidStateError("ServerThread.call: the server is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Aborts every request, stops the server and joins the thread."""
        if self._thread is None:
            return
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
        self._thread = None
        self._loop = None

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
