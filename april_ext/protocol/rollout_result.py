"""What one rollout step hands the run: the batch and the step's metrics (RolloutResult, RolloutMetrics).

Plain data, here in the protocol so that the rollout driver protocol (rollout_driver.py) can name it; the
rollout layer builds it (april_ext.rollout.step_metrics).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from april_ext.batch import TrainingBatch


@dataclass(frozen=True)
class RolloutMetrics:
    """What one rollout step did, timed with the loop's clock (the engine's, for a simulated engine)."""

    policy_version: int
    wall_s: float
    """From begin_step to the batch in hand."""
    time_to_done_s: float
    """From begin_step until N groups were accepted (the abort is issued right then)."""
    generated_tokens: int
    """Response tokens the engine produced during the step (streamed and in abort results)."""
    tokens_per_s: float
    requests: int
    resumed_requests: int
    aborted_samples: int
    mean_inflight_samples: float
    occupancy: float
    """mean_inflight_samples / capacity (the engine's concurrency, else the scheduler's dispatch cap)."""
    batch_groups: int
    reward_mean: float
    response_lens: list[int]
    engine_steps: int
    """Model steps (iterations) the engine ran during the step, when its stats() count them (EngineStats.steps);
    else 0. generated_tokens / engine_steps is the mean batch: a throughput figure that no machine load moves."""
    tail_share: float
    """The long tail: the share of time_to_done_s spent after 90% of the samples that finished during it had
    finished (stop, or the response cap; not a chunk boundary); 0 when fewer than two finished."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """Scheduler.stats() after the step (partial / off-policy ratios, buffered and surplus groups, the samples
    carried into the step and their tokens, the re-prefilled tokens, ...)."""
    env: dict[str, float] = field(default_factory=dict)
    """Multi-turn runs (an environment): the step's turns handed to the environment (tool_calls), answers,
    observations and their env_tokens, tool_wait_p50_s / p99_s, trajectories finished by reason
    (finished_<reason>, tool_errors, tool_timeouts), waiting_at_boundary (trajectories whose turn was with the
    environment when the step's batch was taken) and engine_idle_while_tools (the share of the time some turn
    was with the environment during which the engine had no request). Empty without an environment."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutResult:
    batch: TrainingBatch
    metrics: RolloutMetrics


__all__ = ["RolloutMetrics", "RolloutResult"]
