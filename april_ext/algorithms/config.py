"""AlgorithmConfig: which advantage estimator, policy loss, aggregation and off-policy correction to train with."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from april_ext.errors import ConfigError

ADVANTAGES = ("grpo", "drgrpo")
LOSSES = ("ppo", "gspo")
AGGREGATIONS = ("token", "sequence")
OFFPOLICY_MASKS = ("none", "stale", "offpolicy")


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL objective of one training step.

    advantage: "grpo" normalises rewards by the group mean and std; "drgrpo" subtracts the mean only.
    loss: "ppo" clips the per-token ratio; "gspo" clips the length-normalised sequence ratio.
    eps_low / eps_high: the clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: eps_high > eps_low).
    aggregation: "token" averages over all loss tokens of the batch; "sequence" averages each sequence's
        tokens first, then the sequences.
    kl_coef: weight of the k3 KL estimate to the reference policy (0 disables it and the reference model).
    tis_cap: truncated importance sampling cap C: each token's loss is weighted by
        min(pi_train / pi_behavior, C); None disables the correction.
    tis_floor: the lower clip of that weight, max(weight, tis_floor) (slime's --tis-clip-low; 0: none).
    offpolicy_mask: "none"; "stale" drops tokens older than max_staleness versions; "offpolicy" drops every
        token not produced by the policy version being trained.
    max_staleness: the bound for offpolicy_mask="stale".
    dynamic_sampling: the rollout loop should install `reject_uniform_groups` as the group filter (DAPO).
    adv_eps: added to the group std before dividing (grpo).
    """

    advantage: str = "grpo"
    loss: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "token"
    kl_coef: float = 0.0
    tis_cap: float | None = None
    tis_floor: float = 0.0
    offpolicy_mask: str = "none"
    max_staleness: int | None = None
    dynamic_sampling: bool = False
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        _choice("advantage", self.advantage, ADVANTAGES)
        _choice("loss", self.loss, LOSSES)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("offpolicy_mask", self.offpolicy_mask, OFFPOLICY_MASKS)
        _number("eps_low", self.eps_low, low=0.0, high=1.0, allowed="a number in [0, 1)", high_open=True)
        _number("eps_high", self.eps_high, low=0.0, high=math.inf, allowed="a finite number >= 0")
        _number("kl_coef", self.kl_coef, low=0.0, high=math.inf, allowed="a finite number >= 0")
        _number("adv_eps", self.adv_eps, low=0.0, high=math.inf, allowed="a finite number >= 0")
        if self.tis_cap is not None:
            _number("tis_cap", self.tis_cap, low=0.0, high=math.inf, allowed="None or a finite number > 0",
                    low_open=True)
        _number("tis_floor", self.tis_floor, low=0.0, high=math.inf if self.tis_cap is None else self.tis_cap,
                allowed="a finite number >= 0 and below tis_cap", high_open=self.tis_cap is not None)
        if self.max_staleness is not None and (
                not isinstance(self.max_staleness, int) or isinstance(self.max_staleness, bool)
                or self.max_staleness < 0):
            raise ConfigError(f"AlgorithmConfig.max_staleness must be None or an integer >= 0, "
                              f"got {self.max_staleness!r}")
        if self.offpolicy_mask == "stale" and self.max_staleness is None:
            raise ConfigError("AlgorithmConfig.max_staleness must be set (an integer >= 0) when "
                              "offpolicy_mask='stale', got None")
        if not isinstance(self.dynamic_sampling, bool):
            raise ConfigError(f"AlgorithmConfig.dynamic_sampling must be a bool, got {self.dynamic_sampling!r}")

    def replace(self, **changes: Any) -> AlgorithmConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def grpo(cls, **changes: Any) -> AlgorithmConfig:
        """GRPO: group-normalised advantages, symmetric PPO clip, token-level loss."""
        return cls(**changes)

    @classmethod
    def drgrpo(cls, **changes: Any) -> AlgorithmConfig:
        """Dr. GRPO: no std normalisation of the advantages."""
        return cls(**{"advantage": "drgrpo", **changes})

    @classmethod
    def dapo(cls, **changes: Any) -> AlgorithmConfig:
        """DAPO: clip-higher (0.2 / 0.28), dynamic sampling, token-level loss, no KL."""
        return cls(**{"eps_low": 0.2, "eps_high": 0.28, "dynamic_sampling": True, "aggregation": "token",
                      **changes})

    @classmethod
    def gspo(cls, **changes: Any) -> AlgorithmConfig:
        """GSPO: sequence-level ratio with the paper's narrow clip range (3e-4 / 4e-4), sequence-level loss."""
        return cls(**{"loss": "gspo", "eps_low": 3e-4, "eps_high": 4e-4, "aggregation": "sequence", **changes})


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"AlgorithmConfig.{name} must be one of {allowed}, got {value!r}")


def _number(name: str, value: object, *, low: float, high: float, allowed: str,
            low_open: bool = False, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    if not ok:
        raise ConfigError(f"AlgorithmConfig.{name} must be {allowed}, got {value!r}")
