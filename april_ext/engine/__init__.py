"""The embedded rollout engine: paged KV cache, continuous batching, abort / resume, weight updates."""

from __future__ import annotations

from april_ext.engine.async_engine import AsyncEngine
from april_ext.engine.config import EngineConfig
from april_ext.engine.core import EngineCore
from april_ext.engine.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.engine.sampler import processed_logprobs
from april_ext.engine.sampling import SamplingParams

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineCore",
    "EngineStats",
    "GenerationChunk",
    "GenerationOutput",
    "SamplingParams",
    "processed_logprobs",
]
