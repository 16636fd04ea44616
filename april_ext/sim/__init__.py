"""Rollout simulator: a simulated engine on a virtual clock driven by the real scheduler and rollout loop."""

from __future__ import annotations

from april_ext.sim.cost import CLUSTER_PRESETS, ClusterConfig, CostModel, GpuSpec, ModelSpec, cluster_preset
from april_ext.sim.counters import ClusterCounters
from april_ext.sim.engine import SimulatedEngine
from april_ext.sim.lengths import (LENGTH_PRESETS, LengthModel, LogNormalLengths, SampleDraw, TraceLengths,
                                   length_preset)
from april_ext.sim.metrics import OccupancyBound, StepReport, full_occupancy_bound
from april_ext.sim.pipeline import (ASYNC_MODES, PIPELINE_PRESETS, AsyncMode, PipelineConfig, PipelineResult,
                                    simulate_mode)
from april_ext.sim.runner import (MODES, SimConfig, SimResult, compare, compare_strategies, gain, simulate,
                                  simulate_async)
from april_ext.sim.tokens import SyntheticPrompts, answer_reward
from april_ext.sim.training import TrainerCost
from april_ext.sim.turns import TURN_PRESETS, TrajectoryPlan, TurnModel, turn_preset

__all__ = [
    "ASYNC_MODES",
    "AsyncMode",
    "CLUSTER_PRESETS",
    "ClusterConfig",
    "ClusterCounters",
    "CostModel",
    "GpuSpec",
    "LENGTH_PRESETS",
    "LengthModel",
    "LogNormalLengths",
    "MODES",
    "ModelSpec",
    "OccupancyBound",
    "PIPELINE_PRESETS",
    "PipelineConfig",
    "PipelineResult",
    "SampleDraw",
    "SimConfig",
    "SimResult",
    "SimulatedEngine",
    "StepReport",
    "SyntheticPrompts",
    "TURN_PRESETS",
    "TraceLengths",
    "TrainerCost",
    "TrajectoryPlan",
    "TurnModel",
    "answer_reward",
    "cluster_preset",
    "compare",
    "compare_strategies",
    "full_occupancy_bound",
    "gain",
    "length_preset",
    "simulate",
    "simulate_async",
    "simulate_mode",
    "turn_preset",
]
