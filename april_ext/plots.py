"""PNG plots of a training run's metrics (metrics.jsonl rows): reward, rollout throughput, partial and
off-policy token ratios, response-length histograms; and a baseline-vs-APRIL comparison."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

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


def plot_run(history: Sequence[dict[str, Any]], output_dir: str) -> list[str]:
    """Writes training.png (four panels) and response_lengths.png into output_dir; returns their paths."""
    plt = _pyplot()
    steps = [r["step"] for r in history]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    ax = axes[0][0]
    ax.plot(steps, [r["rollout/reward_mean"] for r in history], marker=".")
    ax.set(title="reward (batch mean)", xlabel="step", ylabel="reward")
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
    fig.suptitle(f"april-ext train ({history[0].get('mode', '')})")
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
    """Reward and rollout throughput per step of several runs (e.g. baseline and APRIL) side by side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, history in runs.items():
        steps = [r["step"] for r in history]
        axes[0].plot(steps, [r["rollout/reward_mean"] for r in history], marker=".", label=name)
        axes[1].plot(steps, [r["rollout/tokens_per_s"] for r in history], marker=".", label=name)
    axes[0].set(title="reward", xlabel="step", ylabel="batch mean reward")
    axes[1].set(title="rollout throughput", xlabel="step", ylabel="generated tokens / s")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=90)
    plt.close(fig)
    return path


__all__ = ["plot_compare", "plot_run", "save_figure"]
