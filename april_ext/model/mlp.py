"""The feed-forward blocks of a decoder layer: the SwiGLU MLP and Qwen3-MoE's top-k routed experts.

Parameter names equal Hugging Face's (``gate_proj`` / ``up_proj`` / ``down_proj``; ``gate`` and
``experts.{e}.*`` for the sparse block), so published checkpoints load as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from april_ext.model.config import ModelConfig


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE routing: (weights [N, k], expert indices [N, k]) of the k experts of highest softmax
    probability (the softmax in float32), renormalised to sum to 1 when `normalize`."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), experts


class SparseMoeBlock(nn.Module):
    """Each token's output is the routing-weighted sum of its top-k experts' SwiGLU outputs (no shared
    expert, no capacity limit: no token is dropped)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.normalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = route(self.gate(x), self.top_k, self.normalize)
        out = torch.zeros_like(x)
        # Without gradients only the experts some token chose run (one host sync for the list). With
        # gradients every expert runs, on no rows if none chose it, so that each has a (zero) gradient as
        # in megatron-core's SequentialMLP: the optimizers then treat the two models' parameters alike, and
        # data-parallel wrappers see every parameter used.
        experts = range(len(self.experts)) if torch.is_grad_enabled() else torch.unique(chosen).tolist()
        for e in experts:
            rows, slot = torch.where(chosen == e)
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, slot, None])
        return out
