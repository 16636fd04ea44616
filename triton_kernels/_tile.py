"""Helpers shared by the attention kernels: paged K/V tile loads and the online-softmax update on the device;
on the host, the launch prologue: the interpreter check, the block sizes, the outputs and the softmax arguments."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from april_ext.triton_kernels._validation import check_config
from april_ext.triton_kernels.config import BlockConfig

LOG2E = 1.4426950408889634


def interpreting(kernel: object) -> bool:
    """True when `kernel` was decorated under TRITON_INTERPRET=1 (the decision is made at import time)."""
    return type(kernel).__name__ == "InterpretedFunction"


def check_launchable(kernel: object, device_type: str) -> None:
    """Raises when the tensors' device cannot run `kernel` (CPU tensors need the interpreter)."""
    from april_ext.errors import InvalidArgumentError

    if device_type == "cpu" and not interpreting(kernel):
        raise InvalidArgumentError(
            "q: CPU tensors need TRITON_INTERPRET=1 set before april_ext.triton_kernels is imported "
            f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} now); use the *_reference functions on CPU")


def lse_shape(q: torch.Tensor, return_lse: bool) -> tuple[int, int]:
    """The lse output of an attention op: a row per query row when requested, else none (so an op never
    returns memory it did not write)."""
    return (q.shape[0] if return_lse else 0, q.shape[1])


def attention_outputs(q: torch.Tensor, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What an attention op returns, unwritten: out like q and a float32 lse of lse_shape."""
    return torch.empty_like(q), q.new_empty(lse_shape(q, return_lse), dtype=torch.float32)


def launch_config(kernel: object, q: torch.Tensor, head_dim: int, config: object,
                  table: Callable[[torch.device, int, torch.dtype], BlockConfig]) -> BlockConfig:
    """The block sizes of an attention launch: config when given, else the device's row of `table`
    (config.extend_config or config.decode_config). Raises first when config is not a BlockConfig or
    q's device cannot run `kernel`."""
    check_config(config)
    check_launchable(kernel, q.device.type)
    return config if config is not None else table(q.device, head_dim, q.dtype)


def softmax_args(kernel: object, q: torch.Tensor, sm_scale: float, window: int | None,
                 softcap: float | None) -> tuple[tuple[float, float, int], dict[str, bool]]:
    """The arguments every attention kernel takes for its softmax_update calls: the scalars (qk_scale,
    softcap, window), 1.0 / 0 standing for no soft-cap / window, and the flags HAS_WINDOW, HAS_SOFTCAP
    and UPCAST (bf16 tiles loaded as float32 under the interpreter). qk_scale includes the log2 factor
    unless there is a soft-cap, which applies it after capping (see softmax_update)."""
    qk_scale = sm_scale if softcap is not None else sm_scale * LOG2E
    scalars = (qk_scale, softcap if softcap is not None else 1.0, window or 0)
    flags = {"HAS_WINDOW": window is not None, "HAS_SOFTCAP": softcap is not None,
             "UPCAST": q.dtype == torch.bfloat16 and interpreting(kernel)}
    return scalars, flags


@triton.jit
def load_tile(ptrs, n_mask, d_mask, MASK_N: tl.constexpr, MASK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Loads the [BLOCK_N, D_PAD] tile at ptrs, masked lanes zero: rows outside n_mask when MASK_N, the
    head-dim padding outside d_mask when MASK_N or MASK_D (no predicate at all otherwise); float32 when
    UPCAST."""
    if MASK_N:
        tile = tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    elif MASK_D:
        tile = tl.load(ptrs, mask=d_mask[None, :], other=0.0)
    else:
        tile = tl.load(ptrs)
    if UPCAST:
        tile = tile.to(tl.float32)
    return tile


@triton.jit
def load_paged_tile(CACHE, row_pages, offs_n, n_mask, offs_d, d_mask, kv_head, stride_p, stride_s, stride_h,
                    stride_d, PAGE_SIZE: tl.constexpr, MASK_N: tl.constexpr, MASK_D: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Loads cache rows for key positions offs_n of one sequence: [BLOCK_N, D_PAD], masked lanes zero.

    row_pages points at the sequence's block-table row; each position reads its page id from it, so
    pages may be in any order and shared with other sequences. MASK_N=False promises every position is
    inside the sequence (interior tiles skip the predicate); MASK_D masks the head-dim padding.
    """
    if MASK_N:
        page = tl.load(row_pages + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    else:
        page = tl.load(row_pages + offs_n // PAGE_SIZE).to(tl.int64)
    slot = (offs_n % PAGE_SIZE).to(tl.int64)
    ptrs = (CACHE + page[:, None] * stride_p + slot[:, None] * stride_s + kv_head * stride_h
            + offs_d[None, :] * stride_d)
    return load_tile(ptrs, n_mask, d_mask, MASK_N, MASK_D, UPCAST)


@triton.jit
def softmax_update(acc, m_i, l_i, q, k, v, allowed, qk_scale, softcap, HAS_SOFTCAP: tl.constexpr,
                   HAS_MASK: tl.constexpr):
    """One online-softmax step over a key tile, in the log2 domain.

    acc [M, D_PAD] float32, m_i / l_i [M] running max and sum; q [M, D_PAD], k / v [N, D_PAD];
    allowed [M, N] the mask, applied when HAS_MASK (interior tiles have none). With a soft-cap,
    qk_scale is the plain softmax scale and the log2 factor is applied after the cap; otherwise
    qk_scale already includes it. m_i starts finite (-1e30) so a row without any allowed key stays
    NaN-free.
    """
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if HAS_SOFTCAP:
        # tanh(x) = 2 * sigmoid(2x) - 1: portable across Triton versions and backends.
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634
    if HAS_MASK:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return acc, m_new, l_i
