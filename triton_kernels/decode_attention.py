"""decode_attention: one query token per sequence over the paged cache, split-KV with a merge stage.

Each program takes all query heads of one kv head (so K/V are read once per group and tl.dot gets
>= 16 rows) and one of num_splits contiguous chunks of the sequence's keys; a second kernel merges the
chunks by their log-sum-exp. Splitting lets a few long sequences fill the whole GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from april_ext.triton_kernels._tile import (attention_outputs, launch_config, load_paged_tile, softmax_args,
                                            softmax_update)
from april_ext.triton_kernels._validation import MAX_SPLITS, check_decode, check_num_splits, check_options
from april_ext.triton_kernels.config import BlockConfig, decode_config, padded_head_dim

@triton.jit
def _decode_split_kernel(
    Q, K_CACHE, V_CACHE, BLOCK_TABLE, SEQ_LENS, O_PART, LSE_PART,
    qk_scale, softcap, window, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    stride_bt,
    stride_ob, stride_oh, stride_os, stride_od,
    stride_lb, stride_lh, stride_ls,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, UPCAST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ_LENS + seq).to(tl.int32)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Chunks are whole tiles so every split but the last runs full tiles.
    chunk = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, seq_len)
    row_pages = BLOCK_TABLE + seq.to(tl.int64) * stride_bt

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q = tl.load(Q + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_H, D_PAD], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        k = load_paged_tile(K_CACHE, row_pages, offs_n, n_mask, offs_d, d_mask, kv_head,
                            stride_kcp, stride_kcs, stride_kch, stride_kcd, PAGE_SIZE, True, True, UPCAST)
        v = load_paged_tile(V_CACHE, row_pages, offs_n, n_mask, offs_d, d_mask, kv_head,
                            stride_vcp, stride_vcs, stride_vch, stride_vcd, PAGE_SIZE, True, True, UPCAST)
        allowed = h_mask[:, None] & n_mask[None, :]
        acc, m_i, l_i = softmax_update(acc, m_i, l_i, q, k, v, allowed, qk_scale, softcap, HAS_SOFTCAP, True)

    # An empty chunk reports lse = -inf and a zero output, so the merge gives it zero weight.
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    out = acc / l_safe[:, None]
    # m_i and log2(l) are in log2 units; x ln 2 gives the natural-log LSE the API reports.
    lse = tl.where(has_keys, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    part = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od
    tl.store(O_PART + part, out.to(O_PART.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    tl.store(LSE_PART + seq.to(tl.int64) * stride_lb + heads * stride_lh + split * stride_ls, lse, mask=h_mask)


@triton.jit
def _decode_merge_kernel(
    O_PART, LSE_PART, OUT, LSE, num_splits,
    stride_pb, stride_ph, stride_ps, stride_pd,
    stride_lpb, stride_lph, stride_lps,
    stride_ob, stride_oh, stride_od,
    stride_lb, stride_lh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(LSE_PART + seq * stride_lpb + head * stride_lph + offs_s * stride_lps, mask=s_mask,
                  other=float("-inf"))
    # seq_len >= 1, so at least one chunk is non-empty and the max is finite.
    m = tl.max(lse, 0)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    parts = tl.load(O_PART + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                    + offs_d[None, :] * stride_pd, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / total
    tl.store(OUT + seq * stride_ob + head * stride_oh + offs_d * stride_od, out.to(OUT.dtype.element_ty),
             mask=d_mask)
    if WRITE_LSE:
        tl.store(LSE + seq * stride_lb + head * stride_lh, m + tl.log(total))


# Constant per device, like config.generation: evaluated while tracing, not in the graph.
@torch.compiler.assume_constant_result
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


# Longest key range one program streams when num_splits is chosen automatically: with rollout lengths
# of 1K-16K in one batch, the longest sequences would otherwise finish long after the rest.
MAX_CHUNK_KEYS = 4096


def choose_num_splits(batch: int, kv_heads: int, max_keys: int, block_n: int, num_sms: int) -> int:
    """Enough chunks for about two programs per SM and for chunks of at most MAX_CHUNK_KEYS keys, never
    more than the longest sequence has tiles."""
    programs = max(1, batch * kv_heads)
    wanted = max(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_keys, MAX_CHUNK_KEYS))
    tiles = max(1, triton.cdiv(max_keys, block_n))
    return max(1, min(wanted, tiles, MAX_SPLITS))


@torch.library.custom_op("april_ext::decode_attention", mutates_args=())
def decode_attention_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, sm_scale: float, window: int | None, softcap: float | None,
                        num_splits: int, return_lse: bool, block_m: int, block_n: int, num_warps: int,
                        num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The launch as the torch op april_ext::decode_attention, which torch.compile and graph capture see.

    It trusts its arguments: decode_attention validates them and picks num_splits first. Returns
    (out, lse); lse is [B, Hq] when return_lse, else empty ([0, Hq]).
    """
    out, lse = attention_outputs(q, return_lse)
    batch, q_heads, head_dim = q.shape
    if batch == 0:
        return out, lse
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    d_pad = padded_head_dim(head_dim)
    o_part = torch.empty((batch, q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((batch, q_heads, num_splits), dtype=torch.float32, device=q.device)
    scalars, flags = softmax_args(_decode_split_kernel, q, sm_scale, window, softcap)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, o_part, lse_part, *scalars, num_splits,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0),
        *o_part.stride(), *lse_part.stride(),
        GROUP=group, BLOCK_H=max(block_m, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        D_PAD=d_pad, PAGE_SIZE=k_cache.shape[1], BLOCK_N=block_n, **flags,
        num_warps=num_warps, num_stages=num_stages,
    )
    _decode_merge_kernel[(batch, q_heads)](
        o_part, lse_part, out, lse, num_splits, *o_part.stride(), *lse_part.stride(), *out.stride(), *lse.stride(),
        HEAD_DIM=head_dim, D_PAD=d_pad,
        SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), WRITE_LSE=return_lse,
        num_warps=4 if d_pad >= 128 else 2,
    )
    return out, lse


@decode_attention_op.register_fake
def _decode_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                           seq_lens: torch.Tensor, sm_scale: float, window: int | None, softcap: float | None,
                           num_splits: int, return_lse: bool, block_m: int, block_n: int, num_warps: int,
                           num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_outputs(q, return_lse)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, *, sm_scale: float | None = None, window: int | None = None,
                     softcap: float | None = None, num_splits: int | None = None, return_lse: bool = False,
                     config: BlockConfig | None = None,
                     check_indices: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One query per sequence over its paged cache.

    q [B, Hq, D]; seq_lens[b] keys of sequence b (including the current token, already stored) in the
    pages block_table[b, :]. The query sits at position seq_lens[b] - 1; window=W keeps keys with
    position >= seq_lens[b] - W; softcap as in extend_attention. num_splits chunks the keys (None:
    chosen from the batch, the heads and the SM count). Returns out [B, Hq, D] in q's dtype, and lse
    [B, Hq] float32 when return_lse. config overrides the per-GPU block sizes.

    check_indices=False skips the index-range checks and their host synchronization (for a caller that
    validated seq_lens / block_table already, or captures the call in a CUDA graph); num_splits is then
    chosen from the block table's capacity instead of the longest sequence.
    """
    shape = check_decode(q, k_cache, v_cache, block_table, seq_lens, check_indices)
    opts = check_options(shape.cache.head_dim, sm_scale, window, softcap, return_lse)
    check_num_splits(num_splits)
    cfg = launch_config(_decode_split_kernel, q, shape.cache.head_dim, config, decode_config)
    max_keys = min(shape.max_seq_len, opts.window) if opts.window is not None else shape.max_seq_len
    splits = num_splits or choose_num_splits(shape.batch, shape.cache.kv_heads, max_keys, cfg.block_n,
                                             _num_sms(q.device))
    out, lse = decode_attention_op(q, k_cache, v_cache, block_table, seq_lens, opts.sm_scale, opts.window,
                                   opts.softcap, splits, return_lse, cfg.block_m, cfg.block_n, cfg.num_warps,
                                   cfg.num_stages)
    return (out, lse) if return_lse else out
