"""An SGLang-compatible HTTP server for the embedded engine (the subset in shared/sglang-api.md).

Needs aiohttp (`pip install april_ext[sglang]`). The names below are imported on first use, so the
`serve` command can be registered in the CLI without aiohttp installed.
"""

from __future__ import annotations

import importlib
from typing import Any

from april_ext.deprecation import renamed

_EXPORTS = {
    "EmbeddedServer": "april_ext.server.app",
    "ServerConfig": "april_ext.server.app",
    "ServerThread": "april_ext.server.thread",
    "decode_named_tensors": "april_ext.protocol.sglang_wire",
    "encode_named_tensors": "april_ext.protocol.sglang_wire",
}

__all__ = sorted(_EXPORTS)


_renamed = renamed(__name__, {"EngineServer": "april_ext.server.app.EmbeddedServer"})


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        return _renamed(name)
    return getattr(importlib.import_module(_EXPORTS[name]), name)
