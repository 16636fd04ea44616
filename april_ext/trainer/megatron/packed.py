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


def packed_layer_spec(block: Any, config: Any) -> Any:
    """The block spec of the distributed trainer from megatron-core's local block spec (this stage's
    layers, dense or MoE): every layer's core attention replaced by PackedDotProductAttention and, under
    ``config.sequence_parallel``, its norms (and the final one) by SequenceParallelRMSNorm. Layer specs
    may share submodule objects (megatron-core reuses one spec for every dense layer), so each is
    changed once."""
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    for spec in {id(s): s for s in block.layer_specs}.values():
        layer = spec.submodules
        attention = layer.self_attention.submodules
        if attention.core_attention not in (DotProductAttention, PackedDotProductAttention):
            raise InvalidArgumentError(f"packed_layer_spec takes the local layer spec (DotProductAttention), got "
                                       f"{attention.core_attention}")
        attention.core_attention = PackedDotProductAttention
        if config.sequence_parallel:
            layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelRMSNorm
            # Qwen3's per-head q/k norms: megatron-core's torch norm refuses to be built under sequence
            # parallelism; their partial gradients (each rank normalises its own heads) are summed over
            # TP by finalize_model_grads either way.
            if config.qk_layernorm:
                attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    norm = SequenceParallelRMSNorm if config.sequence_parallel else block.layer_norm
    return TransformerBlockSubmodules(layer_specs=list(block.layer_specs), layer_norm=norm)


@dataclass(frozen=True)
class PackedMicroBatch:
    """The model inputs of samples packed into one row: input_ids and position_ids [1, T + pad]; the
    sample bounds ``cu_seqlens`` [S + 1] of the real tokens (T of them); ``pad`` filler tokens close the
    row as one extra sample so that T + pad reaches the requested length and divides by ``multiple``
    (sequence parallelism splits the row across the tensor-parallel ranks)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    params: PackedSeqParams
    n_tokens: int
    pad: int


def pack(tokens: torch.Tensor, cu_seqlens: torch.Tensor, multiple: int = 1, length: int = 0) -> PackedMicroBatch:
    """Packs the samples of ``tokens`` [T] (bounds ``cu_seqlens`` [S + 1], rising strictly from 0 to T) into
    a row of at least ``length`` tokens. T may be 0 (``cu_seqlens`` [0]) when ``length`` > 0: a row of
    filler only, for ranks that must run as many micro-batches as their expert-parallel peers."""
    n = tokens.numel()
    cu = cu_seqlens.to("cpu", torch.int64)
    if (tokens.dim() != 1 or n + length == 0 or cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != n
            or bool((cu.diff() < 1).any())):
        raise InvalidArgumentError(f"pack takes a [T] tensor of tokens and cu_seqlens rising strictly from 0 to "
                                   f"T = {n} (T = 0 only with a length), got shape {tuple(tokens.shape)} and "
                                   f"{cu.tolist()[:6]}")
    pad = max(n, length) - n
    pad += -(n + pad) % multiple
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
