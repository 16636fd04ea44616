"""The rollout side of APRIL: the RolloutEngine protocol and the asyncio loop that drives the scheduler."""

from april_ext.protocol.rollout_engine import Clock, RolloutEngine, engine_clock
from april_ext.rollout.loop import (
    GroupFilter,
    RewardFn,
    RolloutLoop,
    RolloutMetrics,
    RolloutResult,
)
from april_ext.strategies import scheduler_config_for

__all__ = [
    "Clock",
    "GroupFilter",
    "RewardFn",
    "RolloutEngine",
    "RolloutLoop",
    "RolloutMetrics",
    "RolloutResult",
    "engine_clock",
    "scheduler_config_for",
]
