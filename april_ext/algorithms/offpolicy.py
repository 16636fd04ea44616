"""Off-policy correction from the behavior logprobs and policy versions the scheduler stores per token."""

from __future__ import annotations

import torch

from april_ext.errors import InvalidArgumentError


def offpolicy_loss_mask(loss_mask: torch.Tensor, versions: torch.Tensor, policy_version: int, *,
                        mode: str, max_staleness: int | None = None) -> torch.Tensor:
    """The loss mask with off-policy tokens removed.

    A token's staleness is ``policy_version - versions[t]``. mode "none" keeps the mask as is; "stale"
    drops tokens whose staleness exceeds ``max_staleness``; "offpolicy" drops every token with staleness > 0.
    Returns a float32 mask of 0/1 with the shape of ``loss_mask``.
    """
    mask = loss_mask.to(torch.float32)
    if versions.shape != loss_mask.shape:
        raise InvalidArgumentError(f"versions and loss_mask must have one shape, got {tuple(versions.shape)} "
                                   f"and {tuple(loss_mask.shape)}")
    if mode == "none":
        return mask
    staleness = policy_version - versions.to(torch.int64)
    if mode == "stale":
        if max_staleness is None:
            raise InvalidArgumentError("max_staleness must be an integer >= 0 for mode 'stale', got None")
        return mask * (staleness <= max_staleness).to(torch.float32)
    if mode == "offpolicy":
        return mask * (staleness <= 0).to(torch.float32)
    raise InvalidArgumentError(f"mode must be one of ('none', 'stale', 'offpolicy'), got {mode!r}")


def truncated_is_weights(train_logprobs: torch.Tensor, behavior_logprobs: torch.Tensor,
                         cap: float, floor: float = 0.0) -> torch.Tensor:
    """Per-token truncated importance weights min(pi_train / pi_behavior, cap), at least ``floor``, without
    gradient."""
    if cap <= 0:
        raise InvalidArgumentError(f"cap must be > 0, got {cap!r}")
    log_w = (train_logprobs.detach() - behavior_logprobs.detach()).to(torch.float32)
    # exp may overflow to inf for very unlikely behavior tokens; the clamp maps inf to the cap.
    return torch.exp(log_w).clamp(min=floor, max=cap)
