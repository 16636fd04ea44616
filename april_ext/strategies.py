"""Named long-tail strategies: each is a SchedulerConfig built from a base one (docs/strategies.md); and the
synchronous baselines they are measured against.

A strategy only sets scheduler settings that already exist; it is a name for a combination, so that
``april-ext train --strategy NAME`` and ``april-ext simulate --strategies a,b`` run the same thing. The
base config's batch shape (N, samples per prompt, response cap, staleness policy) is kept; a strategy reads
nothing else of it. The baselines (:func:`synchronous`, :func:`synchronous_dapo`) are the one place the rollout
loop and the simulator take the settings of a run without partial rollout from.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Callable, Mapping

from april_ext.errors import ConfigError
from april_ext.scheduler import SchedulerConfig

Strategy = Callable[[SchedulerConfig], SchedulerConfig]


def _on_policy(config: SchedulerConfig) -> SchedulerConfig:
    """No over-sampling: N' = N, nothing left running at a step's end."""
    return replace(config, over_sampling_batch_size=config.rollout_batch_size)


def _chunk(config: SchedulerConfig) -> int:
    """Seer's divided rollout: a long sample comes back about eight times over its budget."""
    return max(1, config.max_response_len // 8)


def _extra_samples(config: SchedulerConfig) -> int:
    """RollPacker's response over-provisioning: a quarter more samples per prompt in short rounds (rounded up)."""
    return -(-config.n_samples_per_prompt // 4)


STRATEGIES: dict[str, Strategy] = {
    "april": lambda c: c,
    "april_carry": lambda c: replace(c, step_boundary="carry"),
    "seer": lambda c: replace(_on_policy(c), dispatch_order="longest_predicted_first", chunk_tokens=_chunk(c)),
    "april_seer": lambda c: replace(c, dispatch_order="longest_predicted_first", chunk_tokens=_chunk(c)),
    "rollpacker": lambda c: replace(c, tail_batching=True, tail_batching_restart=True),
    "rollpacker_extra": lambda c: replace(c, tail_batching=True, tail_batching_restart=True,
                                          tail_extra_samples=_extra_samples(c)),
    "april_tail": lambda c: replace(c, tail_batching=True),
    "sortedrl": lambda c: replace(c, dispatch_order="shortest_first"),
}
"""Strategy name -> the SchedulerConfig it makes of a base config."""


def apply_strategy(config: SchedulerConfig, name: str) -> SchedulerConfig:
    """``config`` with strategy ``name``'s settings; ConfigError naming the strategies for an unknown name."""
    if name not in STRATEGIES:
        raise ConfigError(f"strategy={name!r} is not allowed: one of {', '.join(repr(n) for n in STRATEGIES)}")
    return STRATEGIES[name](config)


def synchronous(config: SchedulerConfig) -> SchedulerConfig:
    """The synchronous baseline (GRPO without partial rollout): N' = N with batch refill, so every launched group
    runs to completion and nothing is aborted or carried over; dispatched in the paper's order, whole, without tail
    batching."""
    return replace(config, over_sampling_batch_size=config.rollout_batch_size, refill="batch", over_sampling="fixed",
                   target_inflight_samples=None, dispatch_order="fifo", resume_priority=True, chunk_tokens=None,
                   tail_batching=False, tail_batching_restart=False, tail_extra_samples=0)


def synchronous_dapo(config: SchedulerConfig) -> SchedulerConfig:
    """slime's DAPO dynamic sampling without partial rollout: its default N' = N, more groups launched whenever fewer
    than N are in flight or accepted (continuous refill with nothing to over-sample: the groups still needed),
    stopped once N pass the filter, the unfinished and surplus groups thrown away (max_staleness 0 with the drop
    policy)."""
    return replace(config, over_sampling_batch_size=config.rollout_batch_size, refill="continuous",
                   over_sampling="fixed", target_inflight_samples=None, max_staleness=0, staleness_policy="drop")


_SHAPE = ("rollout_batch_size", "n_samples_per_prompt", "max_response_len")
"""What a strategy reads of its base config."""


def configure(settings: Mapping[str, Any], strategy: str | None) -> SchedulerConfig:
    """The SchedulerConfig of ``settings`` (SchedulerConfig fields) with ``strategy``'s settings where ``settings``
    leaves them at their defaults. Validated once, on the combination: a setting given may rely on one the
    strategy sets (``tail_extra_samples`` on rollpacker's ``tail_batching``)."""
    if strategy is None:
        return SchedulerConfig(**settings)
    defaults = {f.name: f.default for f in fields(SchedulerConfig)}
    given = {name: value for name, value in settings.items() if value != defaults[name]}
    base = SchedulerConfig(**{name: given[name] for name in _SHAPE if name in given})
    preset = apply_strategy(base, strategy)
    changed = {name: getattr(preset, name) for name in defaults if getattr(preset, name) != getattr(base, name)}
    return SchedulerConfig(**{**settings, **{name: v for name, v in changed.items() if name not in given}})
