"""Named long-tail strategies: each is a SchedulerConfig built from a base one (docs/strategies.md).

A strategy only sets scheduler settings that already exist; it is a name for a combination, so that
``april-ext train --strategy NAME`` and ``april-ext simulate --strategies a,b`` run the same thing. The
base config's batch shape (N, samples per prompt, response cap, staleness policy) is kept.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from april_ext.errors import ConfigError
from april_ext.scheduler import SchedulerConfig

Strategy = Callable[[SchedulerConfig], SchedulerConfig]


def _on_policy(config: SchedulerConfig) -> SchedulerConfig:
    """No over-sampling: N' = N, nothing left running at a step's end."""
    return replace(config, over_sampling_batch_size=config.rollout_batch_size)


def _chunk(config: SchedulerConfig) -> int:
    """Seer's divided rollout: a long sample comes back about eight times over its budget."""
    return max(1, config.max_response_len // 8)


STRATEGIES: dict[str, Strategy] = {
    "april": lambda c: c,
    "april_carry": lambda c: replace(c, step_boundary="carry"),
    "seer": lambda c: replace(_on_policy(c), dispatch_order="longest_predicted_first", chunk_tokens=_chunk(c)),
    "april_seer": lambda c: replace(c, dispatch_order="longest_predicted_first", chunk_tokens=_chunk(c)),
    "rollpacker": lambda c: replace(c, tail_batching=True, tail_batching_restart=True),
    "april_tail": lambda c: replace(c, tail_batching=True),
    "sortedrl": lambda c: replace(c, dispatch_order="shortest_first"),
}
"""Strategy name -> the SchedulerConfig it makes of a base config."""


def apply_strategy(config: SchedulerConfig, name: str) -> SchedulerConfig:
    """``config`` with strategy ``name``'s settings; ConfigError naming the strategies for an unknown name."""
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name!r} is not allowed: one of {', '.join(repr(n) for n in STRATEGIES)}")
    return STRATEGIES[name](config)
