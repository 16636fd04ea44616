"""Tasks: prompt sources with verifiable rewards (the synthetic counting task, math answers) and the multi-turn
lookup task with its tool environment."""

from april_ext.tasks.counting import CountingTask, CountingTaskConfig
from april_ext.tasks.lookup import LognormalLatency, LookupEnvironment, LookupTask, LookupTaskConfig
from april_ext.tasks.math_verify import math_reward, parse_answer, verify_math_answer
from april_ext.tasks.reward import MathReward, RewardFunction, score_group

__all__ = [
    "CountingTask",
    "CountingTaskConfig",
    "LognormalLatency",
    "LookupEnvironment",
    "LookupTask",
    "LookupTaskConfig",
    "MathReward",
    "RewardFunction",
    "math_reward",
    "parse_answer",
    "score_group",
    "verify_math_answer",
]
