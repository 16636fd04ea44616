"""Advantages: one scalar per sample from the rewards of its group (GRPO, Dr. GRPO, the
REINFORCE++-baseline's centred reward, REINFORCE++'s raw reward), then per token (slime's REINFORCE++
returns and KL reward shaping, and the optional whitening over the batch's loss tokens)."""

from __future__ import annotations

import numpy as np
import torch

from april_ext.algorithms.config import AlgorithmConfig
from april_ext.errors import InvalidArgumentError

# slime's whitening epsilon (added to the variance).
_WHITEN_EPS = 1e-8


def group_advantages(rewards: torch.Tensor | np.ndarray, group_index: torch.Tensor | np.ndarray, *,
                     normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """A_i = (r_i - mean_g) / (std_g + eps), or r_i - mean_g without std normalisation (Dr. GRPO).

    std_g is the unbiased (n - 1) standard deviation of group g; a group of one sample gets advantage 0.
    Returns float32 [S] on the device of ``rewards``.
    """
    r = torch.as_tensor(rewards).to(torch.float32)
    g = torch.as_tensor(group_index).to(device=r.device, dtype=torch.int64)
    if r.dim() != 1 or g.shape != r.shape:
        raise InvalidArgumentError(f"rewards and group_index must be 1-D of equal length, got shapes "
                                   f"{tuple(r.shape)} and {tuple(g.shape)}")
    if r.numel() == 0:
        return r.clone()
    if int(g.min()) < 0:
        raise InvalidArgumentError(f"group_index must be >= 0, got minimum {int(g.min())}")
    n_groups = int(g.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float32, device=r.device).index_add_(0, g, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float32, device=r.device).index_add_(0, g, r)
    mean = total / count.clamp(min=1.0)
    centered = r - mean[g]
    if not normalize_std:
        return centered
    sq = torch.zeros(n_groups, dtype=torch.float32, device=r.device).index_add_(0, g, centered * centered)
    std = torch.sqrt(sq / (count - 1.0).clamp(min=1.0))
    # Singleton groups have centered == 0 already; the division by eps keeps them at 0.
    return centered / (std[g] + eps)


def sample_advantages(config: AlgorithmConfig, rewards: torch.Tensor | np.ndarray,
                      group_index: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The per-sample part of ``config.advantage``: grpo (r - mean_g) / (std_g + adv_eps); drgrpo and
    reinforce_plus_plus_baseline r - mean_g (slime centres the latter's rewards without std); reinforce_plus_plus
    the raw reward. Float32 [S]."""
    if config.advantage == "reinforce_plus_plus":
        return torch.as_tensor(rewards).to(torch.float32).clone()
    return group_advantages(rewards, group_index, normalize_std=config.advantage == "grpo", eps=config.adv_eps)


def token_advantages(config: AlgorithmConfig, per_sample: torch.Tensor, offsets: torch.Tensor,
                     trainable: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None) -> torch.Tensor:
    """The advantage of every token of a packed batch, float32 [T] on ``trainable``'s device.

    per_sample: ``sample_advantages`` [S]. offsets: [S + 1] sample starts. trainable: the tokens a sample is
    trained on (its response tokens, 0/1 [T]). mask: the effective loss mask (trainable after off-policy
    masking), over which ``normalize_advantages`` whitens. kl: the per-token KL to the reference policy, needed
    when ``config.kl_shaping``; only trainable tokens' KL counts.

    - grpo, drgrpo: each token carries its sample's advantage.
    - reinforce_plus_plus_baseline: the sample's advantage minus kl_coef * KL_t.
    - reinforce_plus_plus: token rewards -kl_coef * KL_t, plus the sample's reward at its last trainable token;
      the advantage is the discounted return G_t = r_t + gamma * G_{t+1} within the sample.
    - normalize_advantages: then (A - mean) / sqrt(var + 1e-8) with the mean and the unbiased variance over
      the tokens of ``mask`` (slime's whitening; unchanged when ``mask`` is empty).
    """
    device = trainable.device
    trainable = trainable.to(torch.float32)
    lengths = offsets.to(torch.int64).diff()
    seq_index = torch.repeat_interleave(torch.arange(lengths.numel()), lengths).to(device)
    per_sample = per_sample.to(device, torch.float32)
    if config.kl_shaping:
        if kl is None or kl.shape != trainable.shape:
            raise InvalidArgumentError(f"kl must be a per-token tensor of shape {tuple(trainable.shape)} when "
                                       f"kl_coef > 0 with advantage={config.advantage!r}, got "
                                       f"{None if kl is None else tuple(kl.shape)}")
        penalty = config.kl_coef * kl.to(device, torch.float32) * trainable
    else:
        penalty = torch.zeros_like(trainable)
    if config.advantage == "reinforce_plus_plus":
        rewards = -penalty
        positions = torch.arange(trainable.numel(), device=device)
        last = torch.full((lengths.numel(),), -1, dtype=torch.int64, device=device).scatter_reduce(
            0, seq_index, torch.where(trainable > 0, positions, -1), reduce="amax")
        has_tokens = last >= 0
        rewards = rewards.index_add(0, last[has_tokens], per_sample[has_tokens])
        advantages = _discounted_returns(rewards, offsets, seq_index, config.gamma)
    else:
        advantages = per_sample[seq_index] - penalty
    if config.normalize_advantages:
        advantages = masked_whiten(advantages, mask)
    return advantages


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8), the mean and the unbiased variance taken over the tokens where
    ``mask`` is 1; ``values`` unchanged when the mask is empty."""
    m = mask.to(torch.float32)
    n = m.sum()
    if float(n) == 0:
        return values
    mean = (values * m).sum() / n
    var = (values * values * m).sum() / n - mean * mean
    if float(n) >= 2:
        var = var * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + _WHITEN_EPS)


def _discounted_returns(rewards: torch.Tensor, offsets: torch.Tensor, seq_index: torch.Tensor,
                        gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} within each sample (G past its last token is 0), on a [S, longest] grid."""
    starts = offsets[:-1].to(rewards.device, torch.int64)
    column = torch.arange(rewards.numel(), device=rewards.device) - starts[seq_index]
    grid = torch.zeros(starts.numel(), int(offsets.diff().max()), dtype=rewards.dtype, device=rewards.device)
    grid[seq_index, column] = rewards
    if gamma == 1.0:
        returns = grid.flip(1).cumsum(1).flip(1)
    else:
        returns = torch.zeros_like(grid)
        running = torch.zeros_like(grid[:, 0])
        for j in range(grid.shape[1] - 1, -1, -1):
            running = grid[:, j] + gamma * running
            returns[:, j] = running
    return returns[seq_index, column]


__all__ = ["group_advantages", "masked_whiten", "sample_advantages", "token_advantages"]
