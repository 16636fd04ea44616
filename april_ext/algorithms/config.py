"""AlgorithmConfig: which advantage estimator, policy loss, aggregation and off-policy correction to train with."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from april_ext.errors import ConfigError

ADVANTAGES = ("grpo", "drgrpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
KL_SHAPED_ADVANTAGES = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
"""The estimators whose advantages take the KL reward shaping of kl_coef (slime's; the others ignore it)."""
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSSES = ("ppo", "gspo")
AGGREGATIONS = ("token", "sequence")
OFFPOLICY_MASKS = ("none", "stale", "offpolicy")


@dataclass(frozen=True)
class AlgorithmConfig:
    """The RL objective of one training step.

    advantage: "grpo" normalises rewards by the group mean and std; "drgrpo" subtracts the mean only;
        "reinforce_plus_plus": per-token discounted returns (gamma) of the reward at the sample's last loss
        token plus -kl_coef * KL at every loss token; "reinforce_plus_plus_baseline": the reward minus its
        group mean, minus kl_coef * KL per token (slime's estimators; algorithms.advantages).
    loss: "ppo" clips the per-token ratio; "gspo" clips the length-normalised sequence ratio.
    eps_low / eps_high: the clip range [1 - eps_low, 1 + eps_high] (DAPO's clip-higher: eps_high > eps_low).
    aggregation: "token" averages over all loss tokens of the batch; "sequence" averages each sequence's
        tokens first, then the sequences.
    kl_loss_coef: weight of the KL loss term to the reference policy (slime's --kl-loss-coef; 0: none).
    kl_coef: KL reward shaping before the advantages (slime's --kl-coef): the per-token KL of the trainer's
        log-probs before the update to the reference enters the token rewards of the reinforce_plus_plus
        estimators; grpo and drgrpo ignore it, as slime does.
    kl_loss_type: the KL estimator of both ("k1": log pi - log pi_ref; "k2": its square / 2; "k3":
        exp(-d) + d - 1 with d = log pi - log pi_ref; "low_var_kl": k3 clipped to [-10, 10]); slime's
        --kl-loss-type, default k1 as there.
    gamma: discount of the reinforce_plus_plus returns (slime's --gamma).
    normalize_advantages: whiten the per-token advantages over the batch's loss tokens (zero mean, unit
        variance; slime's --normalize-advantages).
    tis_cap: truncated importance sampling cap C: each token's loss is weighted by
        min(pi_train / pi_behavior, C); None disables the correction.
    tis_floor: the lower clip of that weight, max(weight, tis_floor) (slime's --tis-clip-low; 0: none).
    offpolicy_mask: "none"; "stale" drops tokens older than max_staleness versions; "offpolicy" drops every
        token not produced by the policy version being trained.
    max_staleness: the bound for offpolicy_mask="stale".
    use_decoupled_loss: AReaL's decoupled PPO: the ratio is clipped against the proximal policy (the
        trainer's weights before this step's update, as always here) and each token's loss is weighted by
        pi_prox / pi_behavior (behavior: the rollout log-probs stored per token).
    behav_imp_weight_cap: with use_decoupled_loss, tokens whose pi_prox / pi_behavior exceeds this (> 1) get
        weight 0 (they still count in the aggregation, as AReaL's); None: no cap.
    entropy_coef: weight of the entropy bonus: the loss is the policy loss minus entropy_coef times the
        aggregated entropy of pi_train at the loss tokens (slime's --entropy-coef; 0: none).
    dynamic_sampling: the rollout loop should install `reject_uniform_groups` as the group filter (DAPO).
    adv_eps: added to the group std before dividing (grpo).
    """

    advantage: str = "grpo"
    loss: str = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.2
    aggregation: str = "token"
    kl_loss_coef: float = 0.0
    kl_coef: float = 0.0
    kl_loss_type: str = "k1"
    gamma: float = 1.0
    normalize_advantages: bool = False
    tis_cap: float | None = None
    tis_floor: float = 0.0
    offpolicy_mask: str = "none"
    max_staleness: int | None = None
    use_decoupled_loss: bool = False
    behav_imp_weight_cap: float | None = None
    entropy_coef: float = 0.0
    dynamic_sampling: bool = False
    adv_eps: float = 1e-6

    def __post_init__(self) -> None:
        _choice("advantage", self.advantage, ADVANTAGES)
        _choice("loss", self.loss, LOSSES)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("offpolicy_mask", self.offpolicy_mask, OFFPOLICY_MASKS)
        _choice("kl_loss_type", self.kl_loss_type, KL_TYPES)
        _number("eps_low", self.eps_low, low=0.0, high=1.0, allowed="a number in [0, 1)", high_open=True)
        _number("eps_high", self.eps_high, low=0.0, high=math.inf, allowed="a finite number >= 0")
        _number("kl_loss_coef", self.kl_loss_coef, low=0.0, high=math.inf, allowed="a finite number >= 0")
        _number("kl_coef", self.kl_coef, low=0.0, high=math.inf, allowed="a finite number >= 0")
        _number("entropy_coef", self.entropy_coef, low=0.0, high=math.inf, allowed="a finite number >= 0")
        _number("gamma", self.gamma, low=0.0, high=1.0, allowed="a number in [0, 1]")
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
        for name in ("dynamic_sampling", "normalize_advantages", "use_decoupled_loss"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"AlgorithmConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.behav_imp_weight_cap is not None:
            if not self.use_decoupled_loss:
                raise ConfigError(f"AlgorithmConfig.behav_imp_weight_cap must be None unless use_decoupled_loss, "
                                  f"got {self.behav_imp_weight_cap!r}")
            _number("behav_imp_weight_cap", self.behav_imp_weight_cap, low=1.0, high=math.inf,
                    allowed="None or a finite number > 1", low_open=True)
        if self.use_decoupled_loss and self.tis_cap is not None:
            # Both weight each token by pi_train / pi_behavior: together they would apply it twice.
            raise ConfigError(f"AlgorithmConfig.tis_cap must be None with use_decoupled_loss (the decoupled loss "
                              f"weights by pi_prox / pi_behavior itself, capped by behav_imp_weight_cap), got "
                              f"{self.tis_cap!r}")

    @property
    def kl_shaping(self) -> bool:
        """The advantages take the KL reward shaping (kl_coef > 0 with a reinforce_plus_plus estimator)."""
        return self.kl_coef > 0 and self.advantage in KL_SHAPED_ADVANTAGES

    @property
    def needs_reference(self) -> bool:
        """A frozen reference policy is needed: for the KL loss or for the KL reward shaping."""
        return self.kl_loss_coef > 0 or self.kl_shaping

    def unused_kl_coef_note(self) -> str | None:
        """The line to log when kl_coef is set but the estimator ignores it (slime computes the KL and
        ignores it for grpo / gspo); None otherwise."""
        if self.kl_coef == 0 or self.kl_shaping:
            return None
        return (f"kl_coef={self.kl_coef} has no effect with advantage={self.advantage!r}: the KL reward shaping "
                f"(slime's --kl-coef) only enters the {KL_SHAPED_ADVANTAGES} estimators; the KL loss weight is "
                f"kl_loss_coef (slime's --kl-loss-coef)")

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
    def reinforce_plus_plus(cls, **changes: Any) -> AlgorithmConfig:
        """REINFORCE++: per-token discounted returns of the reward and the KL reward shaping (kl_coef)."""
        return cls(**{"advantage": "reinforce_plus_plus", **changes})

    @classmethod
    def reinforce_plus_plus_baseline(cls, **changes: Any) -> AlgorithmConfig:
        """REINFORCE++-baseline: the reward minus its group mean, minus kl_coef * KL per token."""
        return cls(**{"advantage": "reinforce_plus_plus_baseline", **changes})

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
