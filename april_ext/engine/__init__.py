"""The embedded rollout engine: paged KV cache, continuous batching, abort / resume, weight updates.

The request vocabulary it speaks (SamplingParams, GenerationChunk, GenerationOutput, EngineStats) lives in
april_ext.protocol and is re-exported here for convenience.
"""

from __future__ import annotations

from april_ext.engine.async_engine import AsyncEngine
from april_ext.engine.config import EngineConfig
from april_ext.engine.core import EngineCore
from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.sampling_params import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "GenerationChunk",
    "GenerationOutput",
    "SamplingParams",
]
