"""PNG plots of a training run's metrics (metrics.jsonl rows): reward (per step and against wall-clock
time, raw and smoothed), rollout throughput, partial and off-policy token ratios, response-length
histograms; and a baseline-vs-APRIL comparison, whose reward-against-time panel is the view that shows
APRIL's benefit (the same reward sooner)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from april_ext.errors import InvalidArgumentError
from april_ext.persistence import atomic_write


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str, dpi: int) -> str:
    """Writes a matplotlib figure atomically (its format from the path's extension, png without one)."""
    fmt = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    atomic_write(path, lambda temp: fig.savefig(temp, dpi=dpi, format=fmt))
    return path


def smooth(values: Sequence[float], weight: float = 0.8) -> list[float]:
    """Exponential moving average with bias correction (TensorBoard's smoothing): point i averages the
    points up to i with weights ``weight ** age``, so the first points are not pulled toward 0."""
    if not 0 <= weight < 1:
        raise InvalidArgumentError(f"weight={weight!r} is not allowed: a number in [0, 1)")
    out, average, norm = [], 0.0, 0.0
    for value in values:
        average = weight * average + (1 - weight) * value
        norm = weight * norm + (1 - weight)
        out.append(average / norm)
    return out


def wall_clock(history: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds from the start of the run to the end of each step (the sum of the steps' time/step_s)."""
    return np.cumsum([r["time/step_s"] for r in history]).tolist()


def _reward_curves(ax: Any, x: Sequence[float], rewards: Sequence[float], label: str | None = None) -> None:
    """The raw reward faintly, the smoothed one on top in the same colour."""
    (raw,) = ax.plot(x, rewards, alpha=0.3, linewidth=1)
    ax.plot(x, smooth(rewards), color=raw.get_color(), linewidth=2, label=label)


def plot_run(history: Sequence[dict[str, Any]], output_dir: str) -> list[str]:
    """Writes training.png (six panels) and response_lengths.png into output_dir; returns their paths."""
    plt = _pyplot()
    steps = [r["step"] for r in history]
    rewards = [r["rollout/reward_mean"] for r in history]
    fig, axes = plt.subplots(3, 2, figsize=(11, 11))
    ax = axes[0][0]
    _reward_curves(ax, steps, rewards)
    ax.set(title="reward (batch mean; smoothed)", xlabel="step", ylabel="reward")
    ax = axes[2][0]
    _reward_curves(ax, wall_clock(history), rewards)
    ax.set(title="reward against wall-clock time", xlabel="seconds since the start", ylabel="reward")
    ax = axes[2][1]
    evals = [r for r in history if "eval/reward_mean" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval/reward_mean"] for r in evals], marker="o")
        ax.set(title="eval reward (held-out prompts)", xlabel="step", ylabel="mean reward")
    else:
        ax.axis("off")
    ax = axes[0][1]
    ax.plot(steps, [r["rollout/tokens_per_s"] for r in history], marker=".")
    ax.set(title="rollout throughput", xlabel="step", ylabel="generated tokens / s")
    ax = axes[1][0]
    ax.plot(steps, [r["rollout/carried_token_ratio"] for r in history], marker=".", label="from resumed partials")
    ax.plot(steps, [r["rollout/off_policy_token_ratio"] for r in history], marker=".", label="off-policy")
    ax.set(title="token ratios in the batch", xlabel="step", ylabel="fraction of response tokens", ylim=(0, 1))
    ax.legend()
    ax = axes[1][1]
    ax.plot(steps, [r["rollout/occupancy"] for r in history], marker=".")
    ax.set(title="engine occupancy", xlabel="step", ylabel="mean running / capacity", ylim=(0, 1))
    # "mode": rows written before the variant had its own key (april_ext.training.metrics.VARIANT).
    fig.suptitle(f"april-ext train ({history[0].get('variant', history[0].get('mode', ''))})")
    fig.tight_layout()
    training = os.path.join(output_dir, "training.png")
    save_figure(fig, training, dpi=90)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    k = max(1, len(history) // 4)
    for label, rows in (("first steps", history[:k]), ("last steps", history[-k:])):
        lens = np.concatenate([np.asarray(r["rollout/response_lens"]) for r in rows])
        ax.hist(lens, bins=30, alpha=0.6, label=f"{label} ({len(lens)} samples)")
    ax.set(title="response lengths in the batch", xlabel="tokens", ylabel="samples")
    ax.legend()
    fig.tight_layout()
    lengths = os.path.join(output_dir, "response_lengths.png")
    save_figure(fig, lengths, dpi=90)
    plt.close(fig)
    return [training, lengths]


def plot_compare(runs: dict[str, Sequence[dict[str, Any]]], path: str) -> str:
    """Reward per step, reward against wall-clock time (smoothed, raw faint) and rollout throughput per
    step of several runs (e.g. baseline and APRIL) side by side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for name, history in runs.items():
        steps = [r["step"] for r in history]
        rewards = [r["rollout/reward_mean"] for r in history]
        _reward_curves(axes[0], steps, rewards, label=name)
        _reward_curves(axes[1], wall_clock(history), rewards, label=name)
        axes[2].plot(steps, [r["rollout/tokens_per_s"] for r in history], marker=".", label=name)
    axes[0].set(title="reward (smoothed)", xlabel="step", ylabel="batch mean reward")
    axes[1].set(title="reward against wall-clock time", xlabel="seconds since the start", ylabel="batch mean reward")
    axes[2].set(title="rollout throughput", xlabel="step", ylabel="generated tokens / s")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)
    return path


__all__ = ["plot_compare", "plot_run", "save_figure", "smooth", "wall_clock"]
