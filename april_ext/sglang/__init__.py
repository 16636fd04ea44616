"""The SGLang adapter: a rollout engine that drives SGLang servers (or a router) over HTTP, and a
launcher for SGLang servers. Needs aiohttp (`pip install april_ext[sglang]`); SGLang itself only on
the machines that run the servers."""

from __future__ import annotations

from april_ext.sglang.config import SGLangEngineConfig
from april_ext.sglang.engine import SGLangEngine, SGLangEngineStats
from april_ext.sglang.errors import (
    SGLangBadRequestError,
    SGLangConnectionError,
    SGLangHTTPError,
    SGLangLaunchError,
    SGLangNoWorkerError,
)
from april_ext.sglang.launcher import SGLangServerArgs, SGLangServerProcess, free_port, launch_sglang_server
from april_ext.sglang.requests import wire_rid

__all__ = [
    "SGLangBadRequestError",
    "SGLangConnectionError",
    "SGLangEngine",
    "SGLangEngineConfig",
    "SGLangEngineStats",
    "SGLangHTTPError",
    "SGLangLaunchError",
    "SGLangNoWorkerError",
    "SGLangServerArgs",
    "SGLangServerProcess",
    "free_port",
    "launch_sglang_server",
    "wire_rid",
]
