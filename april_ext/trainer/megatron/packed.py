"""Packed (THD) sequences for megatron-core's local layer spec.

Megatron's packed format puts the samples of a micro-batch one after another in a single [T, 1, hidden]
row and describes them with ``PackedSeqParams`` (cu_seqlens): RoPE restarts at each sample
(rope_utils' THD path) and attention stays inside each sample. Its local ``DotProductAttention`` refuses
packed input (only Transformer Engine's takes it), so ``PackedDotProductAttention`` adds it: causal
attention per sample with PyTorch's scaled_dot_product_attention, so the work is that of the real tokens
(no padding, no T x T mask). Unpacked input goes to megatron-core's own code.

Imports megatron-core: import this module only where megatron-core is needed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from april_ext.errors import InvalidArgumentError


class PackedDotProductAttention(DotProductAttention):
    """DotProductAttention that also takes THD input: query [T, heads, dim], key / value
    [T, groups, dim] of the samples ``packed_seq_params.cu_seqlens_q`` delimits -> [T, heads x dim]."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> torch.Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd" or attention_bias is not None:
            raise InvalidArgumentError(f"packed attention takes qkv_format 'thd' without attention bias, got "
                                       f"{packed_seq_params.qkv_format!r}")
        bounds = packed_seq_params.cu_seqlens_q.tolist()
        # [T, h, d] -> [h, T, d]; each sample is a contiguous slice of the token dimension.
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(bounds):
            out[:, start:end] = F.scaled_dot_product_attention(
                q[:, start:end], k[:, start:end], v[:, start:end], is_causal=True, scale=self.softmax_scale,
                enable_gqa=q.shape[0] != k.shape[0])
        return out.transpose(0, 1).reshape(query.shape[0], -1)


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm built as megatron-core builds its norms. megatron-core's own torch norm refuses
    sequence parallelism, though a norm needs nothing for it but this: each tensor-parallel rank normalises
    its slice of the tokens, so the weight's gradient is partial per rank, and the ``sequence_parallel``
    mark makes finalize_model_grads all-reduce it across the tensor-parallel group."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **unused: Any) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]


def packed_layer_spec(spec: ModuleSpec, config: Any) -> Any:
    """The block spec of the distributed trainer from a local GPT layer spec: its core attention replaced
    by PackedDotProductAttention and, under ``config.sequence_parallel``, its norms (and the final one)
    by SequenceParallelRMSNorm."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    layer = spec.submodules
    attention = layer.self_attention.submodules
    if attention.core_attention is not DotProductAttention:
        raise InvalidArgumentError(f"packed_layer_spec takes the local layer spec (DotProductAttention), got "
                                   f"{attention.core_attention}")
    attention.core_attention = PackedDotProductAttention
    if not config.sequence_parallel:
        return spec
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
    # What megatron-core builds from a layer spec (this stage's layers), with our final norm.
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config),
                                      layer_norm=SequenceParallelRMSNorm)


@dataclass(frozen=True)
class PackedMicroBatch:
    """The model inputs of samples packed into one row: input_ids and position_ids [1, T + pad]; the
    sample bounds ``cu_seqlens`` [S + 1] of the real tokens (T of them); ``pad`` filler tokens close the
    row as one extra sample so that T + pad divides by ``multiple`` (sequence parallelism splits the row
    across the tensor-parallel ranks)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    params: PackedSeqParams
    n_tokens: int
    pad: int


def pack(tokens: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int = 1) -> PackedMicroBatch:
    """Packs the samples of ``tokens`` [T] (bounds ``cu_seqlens`` [S + 1], rising strictly from 0 to T)."""
    n = tokens.numel()
    cu = cu_seqlens.to("cpu", torch.int64)
    if tokens.dim() != 1 or n == 0 or int(cu[0]) != 0 or int(cu[-1]) != n or bool((cu.diff() < 1).any()):
        raise InvalidArgumentError(f"pack takes a non-empty [T] tensor of tokens and cu_seqlens rising strictly "
                                   f"from 0 to T = {n}, got shape {tuple(tokens.shape)} and {cu.tolist()[:6]}")
    pad = -n % multiple
    bounds = torch.cat((cu, cu.new_tensor([n + pad]))) if pad else cu
    lengths = bounds.diff()
    positions = torch.arange(n + pad) - torch.repeat_interleave(bounds[:-1], lengths)
    ids = torch.cat((tokens, tokens.new_zeros(pad))) if pad else tokens
    device = tokens.device
    cu32 = bounds.to(device, torch.int32)
    longest = int(lengths.max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu32, cu_seqlens_kv=cu32, max_seqlen_q=longest,
                             max_seqlen_kv=longest)
    return PackedMicroBatch(input_ids=ids[None], position_ids=positions.to(device)[None], cu_seqlens=cu,
                            params=params, n_tokens=n, pad=pad)


__all__ = ["PackedDotProductAttention", "PackedMicroBatch", "SequenceParallelRMSNorm", "pack", "packed_layer_spec"]
