"""extend_attention: packed new tokens of many sequences over their paged prefix and, causally, themselves.

This is the kernel of a resumed sample: prompt + partial response are re-prefilled under new weights
while the rest of the batch already sits in the paged cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from april_ext.errors import InvalidArgumentError
from april_ext.triton_kernels._tile import (attention_outputs, launch_config, load_paged_tile, load_tile,
                                            softmax_args, softmax_update)
from april_ext.triton_kernels._validation import check_extend, check_options
from april_ext.triton_kernels.config import BlockConfig, extend_config, padded_head_dim


@triton.jit
def _load_rows(X, rows, head, offs_d, d_mask, n_mask, stride_t, stride_h, stride_d, MASK_N: tl.constexpr,
               MASK_D: tl.constexpr, UPCAST: tl.constexpr):
    """Rows `rows` of one head of a packed [T, H, D] tensor: [BLOCK_N, D_PAD], masked lanes zero."""
    ptrs = X + rows[:, None] * stride_t + head * stride_h + offs_d[None, :] * stride_d
    return load_tile(ptrs, n_mask, d_mask, MASK_N, MASK_D, UPCAST)


@triton.jit
def _extend_attention_kernel(
    Q, K, V, K_CACHE, V_CACHE, QO_INDPTR, BLOCK_TABLE, PREFIX_LENS, OUT, LSE,
    qk_scale, softcap, window,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    stride_lt, stride_lh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_D: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WRITE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Longest-running blocks (last rows of a sequence: the largest causal range) are scheduled first.
    block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(QO_INDPTR + seq).to(tl.int64)
    extend_len = (tl.load(QO_INDPTR + seq + 1) - q_start).to(tl.int32)
    m_start = block * BLOCK_M
    if m_start >= extend_len:
        return
    prefix_len = tl.load(PREFIX_LENS + seq).to(tl.int32)
    kv_head = head // GROUP
    row_pages = BLOCK_TABLE + seq.to(tl.int64) * stride_bt

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < extend_len
    d_mask = offs_d < HEAD_DIM
    rows = q_start + offs_m.to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix_len + offs_m

    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # Prefix keys (positions 0 .. prefix_len - 1 in the paged cache): all causally visible. Without a
    # window, whole tiles need no mask; the partial last tile and windowed tiles do.
    if HAS_WINDOW:
        lo = tl.maximum(prefix_len + m_start - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        masked_from = lo
    else:
        lo = 0
        masked_from = (prefix_len // BLOCK_N) * BLOCK_N
        for start_n in range(0, masked_from, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            k = load_paged_tile(K_CACHE, row_pages, offs_n, None, offs_d, d_mask, kv_head,
                                stride_kcp, stride_kcs, stride_kch, stride_kcd, PAGE_SIZE, False, MASK_D, UPCAST)
            v = load_paged_tile(V_CACHE, row_pages, offs_n, None, offs_d, d_mask, kv_head,
                                stride_vcp, stride_vcs, stride_vch, stride_vcd, PAGE_SIZE, False, MASK_D, UPCAST)
            acc, m_i, l_i = softmax_update(acc, m_i, l_i, q, k, v, None, qk_scale, softcap, HAS_SOFTCAP, False)
    for start_n in range(masked_from, prefix_len, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_len
        k = load_paged_tile(K_CACHE, row_pages, offs_n, n_mask, offs_d, d_mask, kv_head,
                            stride_kcp, stride_kcs, stride_kch, stride_kcd, PAGE_SIZE, True, MASK_D, UPCAST)
        v = load_paged_tile(V_CACHE, row_pages, offs_n, n_mask, offs_d, d_mask, kv_head,
                            stride_vcp, stride_vcs, stride_vch, stride_vcd, PAGE_SIZE, True, MASK_D, UPCAST)
        allowed = n_mask[None, :]
        if HAS_WINDOW:
            allowed = allowed & ((q_pos[:, None] - offs_n[None, :]) < window)
        acc, m_i, l_i = softmax_update(acc, m_i, l_i, q, k, v, allowed, qk_scale, softcap, HAS_SOFTCAP, True)

    # New keys of this sequence (positions prefix_len + j), causal: j <= i. Without a window, tiles
    # wholly before this query block (j < m_start <= i; BLOCK_M is a multiple of BLOCK_N) need no mask.
    if HAS_WINDOW:
        new_lo = tl.maximum(m_start - window + 1, 0)
        new_lo = (new_lo // BLOCK_N) * BLOCK_N
    else:
        new_lo = m_start
        for start_n in range(0, m_start, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            key_rows = q_start + offs_n.to(tl.int64)
            k = _load_rows(K, key_rows, kv_head, offs_d, d_mask, None, stride_kt, stride_kh, stride_kd,
                           False, MASK_D, UPCAST)
            v = _load_rows(V, key_rows, kv_head, offs_d, d_mask, None, stride_vt, stride_vh, stride_vd,
                           False, MASK_D, UPCAST)
            acc, m_i, l_i = softmax_update(acc, m_i, l_i, q, k, v, None, qk_scale, softcap, HAS_SOFTCAP, False)
    new_hi = tl.minimum(m_start + BLOCK_M, extend_len)
    for start_n in range(new_lo, new_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < extend_len
        key_rows = q_start + offs_n.to(tl.int64)
        k = _load_rows(K, key_rows, kv_head, offs_d, d_mask, n_mask, stride_kt, stride_kh, stride_kd,
                       True, MASK_D, UPCAST)
        v = _load_rows(V, key_rows, kv_head, offs_d, d_mask, n_mask, stride_vt, stride_vh, stride_vd,
                       True, MASK_D, UPCAST)
        allowed = n_mask[None, :] & (offs_n[None, :] <= offs_m[:, None])
        if HAS_WINDOW:
            allowed = allowed & ((offs_m[:, None] - offs_n[None, :]) < window)
        acc, m_i, l_i = softmax_update(acc, m_i, l_i, q, k, v, allowed, qk_scale, softcap, HAS_SOFTCAP, True)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(OUT + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453  # log2 units -> natural log
        tl.store(LSE + rows * stride_lt + head * stride_lh, lse, mask=m_mask)


@torch.library.custom_op("april_ext::extend_attention", mutates_args=())
def extend_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, qo_indptr: torch.Tensor, block_table: torch.Tensor,
                        prefix_lens: torch.Tensor, sm_scale: float, window: int | None, softcap: float | None,
                        max_extend_len: int, return_lse: bool, block_m: int, block_n: int, num_warps: int,
                        num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch as the torch op april_ext::extend_attention, which torch.compile and graph capture see.

    It trusts its arguments: extend_attention validates them first. Returns (out, lse); lse is
    [T, Hq] when return_lse, else empty ([0, Hq]), so no call returns memory it did not write.
    """
    out, lse = attention_outputs(q, return_lse)
    if max_extend_len == 0:
        return out, lse
    head_dim = k_cache.shape[3]
    d_pad = padded_head_dim(head_dim)
    scalars, flags = softmax_args(_extend_attention_kernel, q, sm_scale, window, softcap)
    grid = (triton.cdiv(max_extend_len, block_m), q.shape[1], qo_indptr.shape[0] - 1)
    _extend_attention_kernel[grid](
        q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, out, lse, *scalars,
        *q.stride(), *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0), *out.stride(), *lse.stride(),
        GROUP=q.shape[1] // k_cache.shape[2], HEAD_DIM=head_dim, D_PAD=d_pad, PAGE_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n, MASK_D=d_pad != head_dim, WRITE_LSE=return_lse, **flags,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


@extend_attention_op.register_fake
def _extend_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, qo_indptr: torch.Tensor, block_table: torch.Tensor,
                           prefix_lens: torch.Tensor, sm_scale: float, window: int | None, softcap: float | None,
                           max_extend_len: int, return_lse: bool, block_m: int, block_n: int, num_warps: int,
                           num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_outputs(q, return_lse)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, qo_indptr: torch.Tensor, block_table: torch.Tensor,
                     prefix_lens: torch.Tensor, *, sm_scale: float | None = None, window: int | None = None,
                     softcap: float | None = None, return_lse: bool = False, config: BlockConfig | None = None,
                     check_indices: bool = True,
                     max_extend_len: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of packed new tokens over their paged prefix and causally over themselves.

    q [T, Hq, D], k / v [T, Hkv, D]: the new tokens of B sequences packed back to back, sequence b
    owning rows qo_indptr[b] .. qo_indptr[b + 1]. k_cache / v_cache [pages, page_size, Hkv, D] hold
    prefix_lens[b] earlier tokens of sequence b in the pages block_table[b, :]. New token i of a
    sequence sits at position p = prefix_lens[b] + i and sees cache positions 0 .. prefix_lens[b] - 1
    and new tokens 0 .. i; window=W keeps keys with p - key_pos < W; softcap=c maps each scaled logit
    x to c * tanh(x / c). Returns out [T, Hq, D] in q's dtype, and lse [T, Hq] float32 (natural log
    of the softmax denominator) when return_lse. config overrides the per-GPU block sizes.

    The index checks copy qo_indptr, prefix_lens and block_table to the host (a synchronization). A
    caller that validated them already (e.g. once per step, not per layer) passes check_indices=False
    and max_extend_len (the longest sequence's new tokens), and the call neither synchronizes nor
    checks index ranges: out-of-range indices are then the caller's responsibility.
    """
    shape = check_extend(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, check_indices,
                         max_extend_len)
    opts = check_options(shape.cache.head_dim, sm_scale, window, softcap, return_lse)
    cfg = launch_config(_extend_attention_kernel, q, shape.cache.head_dim, config, extend_config)
    if cfg.block_m % cfg.block_n:
        raise InvalidArgumentError(f"config: block_m {cfg.block_m} must be a multiple of block_n {cfg.block_n} "
                                   "for extend_attention")
    out, lse = extend_attention_op(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, opts.sm_scale,
                                   opts.window, opts.softcap, shape.max_extend_len, return_lse, cfg.block_m,
                                   cfg.block_n, cfg.num_warps, cfg.num_stages)
    return (out, lse) if return_lse else out
