"""An SGLang-compatible HTTP server for the embedded engine (the subset in shared/sglang-api.md).

Needs aiohttp (`pip install april_ext[sglang]`).
"""

from __future__ import annotations

from april_ext.server.app import EngineServer, ServerConfig
from april_ext.server.protocol import decode_named_tensors, encode_named_tensors
from april_ext.server.thread import ServerThread

__all__ = ["EngineServer", "ServerConfig", "ServerThread", "decode_named_tensors", "encode_named_tensors"]
