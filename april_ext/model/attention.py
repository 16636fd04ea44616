"""How a decoder layer's attention sees the other tokens: the seam between the model and its callers.

The model works on a flat run of tokens [N, ...]. An AttentionBackend receives one layer's rotated
q [N, Hq, D] and new k, v [N, Hkv, D] and returns [N, Hq, D]. The trainer uses CausalAttention (packed
full sequences, differentiable); the engine passes its paged-KV backend.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from april_ext.errors import InvalidArgumentError


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor: ...


def expand_kv_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., Hkv, D] -> [..., Hkv * groups, D]: each KV head serves `groups` consecutive query heads."""
    return x if groups == 1 else torch.repeat_interleave(x, groups, dim=-2)


class CausalAttention:
    """Causal self-attention within each of the packed sequences delimited by `cu_seqlens`.

    cu_seqlens: int tensor [S + 1] of cumulative lengths starting at 0; tokens of different sequences
    never attend to each other.
    """

    def __init__(self, cu_seqlens: torch.Tensor) -> None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0:
            raise InvalidArgumentError(
                f"cu_seqlens must be a 1-D tensor [S + 1] starting at 0, got {cu_seqlens.tolist()}")
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if bool((lengths < 1).any()):
            raise InvalidArgumentError(f"cu_seqlens must be strictly increasing, got {cu_seqlens.tolist()}")
        self.lengths = [int(n) for n in lengths.tolist()]
        self.total = int(cu_seqlens[-1])

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        k, v = expand_kv_heads(k, groups), expand_kv_heads(v, groups)
        if len(set(self.lengths)) == 1:
            # Equal lengths: one batched SDPA call over [S, H, L, D].
            s, n = len(self.lengths), self.lengths[0]

            def batched(x: torch.Tensor) -> torch.Tensor:
                return x.view(s, n, x.shape[1], x.shape[2]).transpose(1, 2)

            out = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=scale)
            return out.transpose(1, 2).reshape(q.shape)
        outs = []
        for qs, ks, vs in zip(q.split(self.lengths), k.split(self.lengths), v.split(self.lengths)):
            o = F.scaled_dot_product_attention(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1),
                                               is_causal=True, scale=scale)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs, dim=0)
