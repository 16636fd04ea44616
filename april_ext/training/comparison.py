"""Runs of one task set side by side as a user waits for them: the wall-clock of each whole run, the time it took
to reach the reference run's final reward, and the reward at equal steps and at equal wall time.

A run's reward over time is the mean of its last ``window`` steps' mean rewards (a quarter of the shortest run's
steps: the window of summarize's "reward (last 1/4)"), read at each row's ``time/elapsed_s``, the seconds from
the run's first step to the end of that row's step. One step's mean reward is too noisy to compare at a point.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from april_ext.errors import InvalidArgumentError

ELAPSED = "time/elapsed_s"
REWARD = "rollout/reward_mean"


@dataclasses.dataclass(frozen=True)
class RunComparison:
    """One run beside the reference run (the first given to :func:`compare_runs`)."""

    wall_clock_s: float
    """The whole run as its caller timed it: building the model and engine, every step, evaluations, saves."""
    steps_s: float
    """From the first step's start to the last step's end (the last row's time/elapsed_s)."""
    wall_clock_ratio: float
    """wall_clock_s over the reference run's."""
    reward_at_equal_steps: float
    """Mean reward of the last ``window`` steps: every run trains the same number of steps."""
    time_to_reference_reward_s: float | None
    """Seconds from the first step until the trailing reward first reached the reference run's reward at equal
    steps; None when it never did."""
    reward_at_equal_time: float
    """The trailing reward at the end of the last step every run had finished by the shortest run's steps_s."""


def trailing_rewards(history: list[dict[str, Any]], window: int) -> np.ndarray:
    """The mean of each row's last ``window`` step rewards (fewer at the start of the run)."""
    rewards = np.asarray([row[REWARD] for row in history], dtype=float)
    sums = np.cumsum(rewards)
    starts = np.maximum(np.arange(len(rewards)) - window, -1)
    before = np.where(starts >= 0, sums[np.clip(starts, 0, None)], 0.0)
    return (sums - before) / (np.arange(len(rewards)) - starts)


def compare_runs(histories: dict[str, list[dict[str, Any]]],
                 wall_clock_s: dict[str, float]) -> dict[str, RunComparison]:
    """Each run's figures against the first one's (the reference: the synchronous baseline in ``--compare``)."""
    if not histories or set(histories) != set(wall_clock_s):
        raise InvalidArgumentError(f"compare_runs needs the same runs in histories and wall_clock_s; got "
                                   f"{sorted(histories)} and {sorted(wall_clock_s)}")
    for name, history in histories.items():
        if not history or any(ELAPSED not in row for row in history):
            raise InvalidArgumentError(f"run {name!r} has no rows, or rows without {ELAPSED}: it cannot be timed")
    window = max(1, min(len(h) for h in histories.values()) // 4)
    reference = next(iter(histories))
    trailing = {name: trailing_rewards(history, window) for name, history in histories.items()}
    target = float(trailing[reference][-1])
    equal_time = min(history[-1][ELAPSED] for history in histories.values())
    out = {}
    for name, history in histories.items():
        elapsed = np.asarray([row[ELAPSED] for row in history], dtype=float)
        reached = np.flatnonzero(trailing[name] >= target)
        at_time = max(int(np.searchsorted(elapsed, equal_time, side="right")) - 1, 0)
        out[name] = RunComparison(
            wall_clock_s=wall_clock_s[name], steps_s=float(elapsed[-1]),
            wall_clock_ratio=wall_clock_s[name] / wall_clock_s[reference],
            reward_at_equal_steps=float(trailing[name][-1]),
            time_to_reference_reward_s=float(elapsed[reached[0]]) if reached.size else None,
            reward_at_equal_time=float(trailing[name][at_time]))
    return out


__all__ = ["ELAPSED", "RunComparison", "compare_runs", "trailing_rewards"]
