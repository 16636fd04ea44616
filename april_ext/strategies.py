"""Named long-tail strategies: each is a SchedulerConfig built from a base one (docs/strategies.md); and the
synchronous baselines they are measured against.

A strategy only sets scheduler settings that already exist; it is a name for a combination, so that
``april-ext train --strategy NAME`` and ``april-ext simulate --strategies a,b`` run the same thing. The
base config's batch shape (N, samples per prompt, response cap, staleness policy) is kept; a strategy reads
nothing else of it. The baselines (BASELINES: :func:`synchronous`, :func:`synchronous_dapo`), picked by
:func:`scheduler_config_for`, are the one place the training run and the simulator take the settings of a run
without partial rollout from.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, Callable, Mapping

from april_ext.errors import ConfigError, InvalidArgumentError
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


_KEPT = frozenset({"step_boundary"})
"""Strategy fields a baseline keeps as configured: with N' = N nothing is running when its batch is taken, so the
step boundary changes nothing it does (april_carry's baseline is the plain one, recorded with "carry")."""

_REFERENCE = SchedulerConfig()
_STRATEGY_FIELDS = frozenset(
    f.name for f in fields(SchedulerConfig) for strategy in STRATEGIES.values()
    if getattr(strategy(_REFERENCE), f.name) != getattr(_REFERENCE, f.name)) - _KEPT
"""The scheduler fields some strategy sets (found by applying each to the default config), which the synchronous
baseline puts back to SchedulerConfig's defaults so that it is the same whatever the strategy."""


def synchronous(config: SchedulerConfig) -> SchedulerConfig:
    """The synchronous baseline (GRPO without partial rollout): N' = N with batch refill, so every launched group
    runs to completion and nothing is aborted or carried over; dispatched in the paper's order, whole, without tail
    batching (every field a strategy sets at SchedulerConfig's default, but the step boundary)."""
    pinned = {"over_sampling_batch_size": config.rollout_batch_size, "refill": "batch", "over_sampling": "fixed",
              "target_inflight_samples": None, "resume_priority": True}
    return replace(config, **{**{name: getattr(_REFERENCE, name) for name in _STRATEGY_FIELDS}, **pinned})


def synchronous_dapo(config: SchedulerConfig) -> SchedulerConfig:
    """slime's DAPO dynamic sampling without partial rollout: its default N' = N, more groups launched whenever fewer
    than N are in flight or accepted (continuous refill with nothing to over-sample: the groups still needed),
    stopped once N pass the filter, the unfinished and surplus groups thrown away (max_staleness 0 with the drop
    policy)."""
    return replace(config, over_sampling_batch_size=config.rollout_batch_size, refill="continuous",
                   over_sampling="fixed", target_inflight_samples=None, max_staleness=0, staleness_policy="drop")


BASELINES: dict[str, Strategy] = {"synchronous": synchronous, "synchronous_dapo": synchronous_dapo}
"""Baseline name -> the SchedulerConfig of a run without partial rollout made of the run's config."""


def scheduler_config_for(config: SchedulerConfig, partial_rollout: bool,
                         baseline: str = "synchronous") -> SchedulerConfig:
    """The scheduler settings of a run: APRIL (or a long-tail strategy) as configured, or the baseline named
    ``baseline`` (one of BASELINES; ``synchronous``: N' = N with batch refill, so nothing is aborted or carried
    over). The one place training and the simulator take a baseline run's settings from."""
    if not isinstance(partial_rollout, bool):
        raise InvalidArgumentError(f"partial_rollout={partial_rollout!r} is not allowed: True or False")
    if baseline not in BASELINES:
        raise ConfigError(f"baseline={baseline!r} is not allowed: one of {', '.join(repr(n) for n in BASELINES)}")
    return config if partial_rollout else BASELINES[baseline](config)


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
