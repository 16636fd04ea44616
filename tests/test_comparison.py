"""training.comparison: the figures --compare and bench/bench_async.py report, on histories with known answers."""

from __future__ import annotations

import numpy as np
import pytest

from april_ext.errors import AprilError
from april_ext.training.comparison import compare_runs, trailing_rewards


def _history(rewards: list[float], seconds_per_step: float) -> list[dict[str, float]]:
    return [{"rollout/reward_mean": r, "time/elapsed_s": (i + 1) * seconds_per_step} for i, r in enumerate(rewards)]


def test_trailing_rewards_average_the_last_window_steps():
    history = _history([1.0, 2.0, 3.0, 4.0, 5.0], 1.0)
    assert trailing_rewards(history, 2).tolist() == [1.0, 1.5, 2.5, 3.5, 4.5]
    assert trailing_rewards(history, 1).tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert trailing_rewards(history, 10).tolist() == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0])


def test_the_figures_of_a_faster_run_that_learns_alike_and_a_slower_one():
    # 8 steps each, a window of 2. The baseline ends at mean(0.6, 0.8) = 0.7 after 16 s of steps.
    base = _history([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8], 2.0)
    fast = _history([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8], 1.0)
    slow = _history([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.1], 3.0)
    out = compare_runs({"baseline": base, "fast": fast, "slow": slow},
                       {"baseline": 20.0, "fast": 12.0, "slow": 30.0})
    assert out["baseline"].wall_clock_ratio == 1.0 and out["fast"].wall_clock_ratio == pytest.approx(0.6)
    assert out["fast"].steps_s == 8.0 and out["slow"].steps_s == 24.0
    assert out["baseline"].reward_at_equal_steps == pytest.approx(0.7)
    assert out["fast"].reward_at_equal_steps == pytest.approx(0.7)
    # Reached at the last step: 16 s for the baseline, 8 s for the run twice as fast; never for the slow one.
    assert out["baseline"].time_to_reference_reward_s == 16.0
    assert out["fast"].time_to_reference_reward_s == 8.0
    assert out["slow"].time_to_reference_reward_s is None
    # Equal wall time: the fast run's 8 s. The baseline has then done 4 steps (0.2, 0.3), the slow one 2 (0, 0).
    assert out["fast"].reward_at_equal_time == pytest.approx(0.7)
    assert out["baseline"].reward_at_equal_time == pytest.approx(0.25)
    assert out["slow"].reward_at_equal_time == 0.0


def test_a_run_that_cannot_be_timed_is_refused():
    with pytest.raises(AprilError, match="same runs"):
        compare_runs({"a": _history([0.0], 1.0)}, {"b": 1.0})
    with pytest.raises(AprilError, match="time/elapsed_s"):
        compare_runs({"a": [{"rollout/reward_mean": 0.0}]}, {"a": 1.0})
    with pytest.raises(AprilError, match="no rows"):
        compare_runs({"a": []}, {"a": 1.0})
    assert np.isfinite(compare_runs({"a": _history([0.5], 1.0)}, {"a": 2.0})["a"].reward_at_equal_time)
