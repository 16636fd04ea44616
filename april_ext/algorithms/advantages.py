"""Group-relative advantages (GRPO, Dr. GRPO): one scalar per sample, from the rewards of its group."""

from __future__ import annotations

import numpy as np
import torch

from april_ext.errors import InvalidArgumentError


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
