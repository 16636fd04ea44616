"""Serving an engine as the process's one job, until SIGINT or SIGTERM (`april-ext serve`); ServerThread
(thread.py) serves one beside other work instead."""

from __future__ import annotations

import asyncio
import signal

from april_ext.protocol import ServableEngine
from april_ext.server.app import EmbeddedServer, ServerConfig


async def serve(engine: ServableEngine, config: ServerConfig) -> None:
    """Serves `engine` until SIGINT / SIGTERM, then aborts every request and stops."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = EmbeddedServer(engine, config)
    url = await server.start()
    print(f"april_ext serve: listening on {url} (weight_version {config.weight_version})", flush=True)
    try:
        await stop.wait()
    finally:
        await server.stop()


__all__ = ["serve"]
