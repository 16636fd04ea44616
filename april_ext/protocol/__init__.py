"""The rollout vocabulary every engine, trainer and loop shares: sampling parameters, generation outputs,
request ids, memory tags, the RolloutEngine, ServableEngine, Trainer and Environment protocols (with the
segments a multi-turn trajectory is stored in), the RolloutDriver protocol and the RolloutResult a step
returns, the checks and the stream every engine shares at its boundary (engine_base), and the SGLang wire
format (``april_ext.protocol.sglang_wire``, imported on its own: it needs safetensors).

This package sits at the bottom of the import graph: it imports nothing of april_ext but errors, batch and
data_source (tests/test_layering.py checks it).
"""

from april_ext.protocol.environment import EnvStep, Environment, Segment, ToolError, Trajectory, step_with_timeout
from april_ext.protocol.memory_tags import MEMORY_TAGS, memory_tags
from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.rollout_driver import RolloutDriver
from april_ext.protocol.rollout_engine import (
    HOLD_MODES,
    AbortAllEngine,
    Clock,
    LockstepEngine,
    PausableEngine,
    PrefixIsolatingEngine,
    RolloutEngine,
    ServableEngine,
    TrainerFedEngine,
    engine_clock,
)
from april_ext.protocol.rollout_result import RolloutMetrics, RolloutResult
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.protocol.trainer import ExportedWeights, StagedTrainer, Trainer

__all__ = [
    "HOLD_MODES",
    "MEMORY_TAGS",
    "AbortAllEngine",
    "Clock",
    "EngineStats",
    "EnvStep",
    "Environment",
    "ExportedWeights",
    "GenerationChunk",
    "GenerationOutput",
    "LockstepEngine",
    "PausableEngine",
    "PrefixIsolatingEngine",
    "RolloutDriver",
    "RolloutEngine",
    "RolloutMetrics",
    "RolloutResult",
    "SamplingParams",
    "Segment",
    "ServableEngine",
    "StagedTrainer",
    "ToolError",
    "Trainer",
    "Trajectory",
    "engine_clock",
    "memory_tags",
    "step_with_timeout",
]
