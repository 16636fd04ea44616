"""RL algorithms: advantages, policy losses, off-policy correction and group filters."""

from april_ext.algorithms.advantages import group_advantages, masked_whiten, sample_advantages, token_advantages
from april_ext.algorithms.config import (
    ADVANTAGES,
    AGGREGATIONS,
    KL_SHAPED_ADVANTAGES,
    KL_TYPES,
    LOSSES,
    OFFPOLICY_MASKS,
    AlgorithmConfig,
)
from april_ext.algorithms.filters import reject_uniform_groups
from april_ext.algorithms.kl import approx_kl
from april_ext.algorithms.losses import PolicyLossInputs, PolicyLossOutput, aggregation_weights, policy_loss
from april_ext.algorithms.offpolicy import offpolicy_loss_mask, truncated_is_weights

__all__ = [
    "ADVANTAGES",
    "AGGREGATIONS",
    "KL_SHAPED_ADVANTAGES",
    "KL_TYPES",
    "LOSSES",
    "OFFPOLICY_MASKS",
    "AlgorithmConfig",
    "PolicyLossInputs",
    "PolicyLossOutput",
    "aggregation_weights",
    "approx_kl",
    "group_advantages",
    "masked_whiten",
    "offpolicy_loss_mask",
    "policy_loss",
    "reject_uniform_groups",
    "sample_advantages",
    "token_advantages",
    "truncated_is_weights",
]
