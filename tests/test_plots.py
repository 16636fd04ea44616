"""Plots: the smoothing, the wall-clock axis, and the files plot_run / plot_compare write."""

from __future__ import annotations

import pytest

from april_ext.errors import InvalidArgumentError
from april_ext.plots import plot_compare, plot_run, smooth, wall_clock


def _history(n: int, step_s: float, with_eval: bool = False) -> list[dict]:
    rows = []
    for i in range(1, n + 1):
        row = {"step": i, "mode": "april", "rollout/reward_mean": i / n, "rollout/tokens_per_s": 100.0 + i,
               "rollout/carried_token_ratio": 0.3, "rollout/off_policy_token_ratio": 0.2, "rollout/occupancy": 0.5,
               "rollout/response_lens": [i, i + 1], "time/step_s": step_s}
        if with_eval and i % 2 == 0:
            row["eval/reward_mean"] = 0.1 * i
        rows.append(row)
    return rows


def test_smooth_is_a_bias_corrected_moving_average():
    assert smooth([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    # 0.8 * 0.2 * 0 + 0.2 * 1 over 0.8 * 0.2 + 0.2: the first point keeps its value, the second is pulled.
    assert smooth([0.0, 1.0]) == pytest.approx([0.0, 0.2 / 0.36])
    assert smooth([0.0, 1.0], weight=0.0) == [0.0, 1.0]
    with pytest.raises(InvalidArgumentError, match="weight"):
        smooth([1.0], weight=1.0)


def test_wall_clock_adds_up_step_times():
    assert wall_clock(_history(3, 0.5)) == pytest.approx([0.5, 1.0, 1.5])


def test_plot_files_are_written(tmp_path):
    paths = plot_run(_history(8, 0.2, with_eval=True), str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["training.png", "response_lengths.png"]
    assert all((tmp_path / name).stat().st_size > 0 for name in ("training.png", "response_lengths.png"))
    path = plot_compare({"baseline": _history(6, 0.3), "april": _history(6, 0.2)}, str(tmp_path / "compare.png"))
    assert (tmp_path / "compare.png").stat().st_size > 0 and path.endswith("compare.png")
