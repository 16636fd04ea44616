"""A rollout step's metrics: RolloutMetrics built in one place from what a driver counted during the step, and
the tail latency it reports (also the simulator's)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from april_ext.batch import TrainingBatch
from april_ext.protocol.rollout_result import RolloutMetrics, RolloutResult


def tail_latency(finish_times: np.ndarray, start: float, end: float, share: float = 0.9) -> float:
    """(end - the time by which ``share`` of the samples had finished) / (end - start). Finish times before
    ``start`` count as ``start``; unknown ones (NaN) are left out. NaN when no time is known or end <= start."""
    times = np.sort(np.asarray(finish_times, np.float64))
    times = times[~np.isnan(times)]
    if times.size == 0 or end <= start:
        return math.nan
    reached = max(start, float(times[math.ceil(share * times.size) - 1]))
    return (end - reached) / (end - start)


def tail_share(finished_at: Sequence[float], start: float, done_at: float) -> float:
    """tail_latency of the samples finished by done_at (RolloutMetrics.tail_share); 0 with fewer than two or no
    time."""
    times = [t for t in finished_at if t <= done_at]
    if len(times) < 2 or done_at <= start:
        return 0.0
    return tail_latency(np.asarray(times), start, done_at)


def step_metrics(policy_version: int, batch: TrainingBatch, *, start: float, done_at: float, end: float,
                 generated: int, requests: int, resumed: int, aborted: int, inflight_area: float, capacity: int,
                 engine_steps: int, finished_at: Sequence[float], scheduler: dict[str, Any],
                 env: dict[str, float]) -> RolloutMetrics:
    """The metrics of a step that began at ``start``, had N groups accepted at ``done_at`` and took ``batch`` by
    ``end``: ``generated`` response tokens, ``requests`` sent (``resumed`` of them partials), ``aborted``
    samples, ``inflight_area`` (samples in flight integrated over the step's time), the finish times of its
    samples, the scheduler's stats and the environment's figures."""
    wall = end - start
    return RolloutMetrics(
        policy_version=policy_version, wall_s=wall, time_to_done_s=done_at - start,
        generated_tokens=generated, tokens_per_s=generated / wall if wall > 0 else 0.0,
        requests=requests, resumed_requests=resumed, aborted_samples=aborted,
        mean_inflight_samples=inflight_area / wall if wall > 0 else 0.0,
        occupancy=inflight_area / wall / capacity if wall > 0 else 0.0,
        batch_groups=batch.n_groups,
        reward_mean=float(batch.rewards.mean()) if batch.n_samples else math.nan,
        response_lens=batch.response_lens.tolist(), engine_steps=engine_steps,
        tail_share=tail_share(finished_at, start, done_at), scheduler=scheduler, env=env)


__all__ = ["RolloutMetrics", "RolloutResult", "step_metrics", "tail_latency", "tail_share"]
