"""The rollout vocabulary every engine, trainer and loop shares: sampling parameters, generation outputs,
request ids, memory tags, the RolloutEngine and Trainer protocols, and the SGLang wire format
(``april_ext.protocol.sglang_wire``, imported on its own: it needs safetensors).

This package sits at the bottom of the import graph: it imports nothing of april_ext but errors and batch.
"""

from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.rollout_engine import Clock, RolloutEngine, engine_clock
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.protocol.trainer import ExportedWeights, Trainer

__all__ = [
    "Clock",
    "EngineStats",
    "ExportedWeights",
    "GenerationChunk",
    "GenerationOutput",
    "RolloutEngine",
    "SamplingParams",
    "Trainer",
    "engine_clock",
]
