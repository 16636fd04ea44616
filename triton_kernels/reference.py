"""Plain PyTorch references for the paged-attention kernels.

Readable rather than fast: each sequence's pages are gathered into a dense K/V, the logits are
computed in float32, masked, soft-capped and soft-maxed. They validate their arguments exactly like
the kernels. (The embedded engine's CPU path is its own batched one, april_ext.engine.paged_attention.)
"""

from __future__ import annotations

import torch

from april_ext.triton_kernels._validation import (
    AttentionOptions,
    check_decode,
    check_extend,
    check_num_splits,
    check_options,
    check_store,
)


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, *, check_indices: bool = True) -> None:
    """Writes token t of k / v to slot slot_mapping[t] = page * page_size + offset; slot -1 is skipped."""
    cache = check_store(k, v, k_cache, v_cache, slot_mapping, check_indices)
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    pages = slots[keep] // cache.page_size
    offsets = slots[keep] % cache.page_size
    k_cache[pages, offsets] = k[keep]
    v_cache[pages, offsets] = v[keep]


def _gather_pages(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence as a dense [length, kv_heads, head_dim] float32 tensor."""
    page_size = cache.shape[1]
    n_pages = (length + page_size - 1) // page_size
    dense = cache[pages[:n_pages].long()].reshape(-1, cache.shape[2], cache.shape[3])
    return dense[:length].float()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
            opts: AttentionOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked attention of q [n_q, Hq, D] over k, v [n_k, Hkv, D] (float32); returns out and lse [n_q, Hq]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, k) * opts.sm_scale
    if opts.softcap is not None:
        logits = opts.softcap * torch.tanh(logits / opts.softcap)
    allowed = k_pos[None, :] <= q_pos[:, None]
    if opts.window is not None:
        allowed &= (q_pos[:, None] - k_pos[None, :]) < opts.window
    logits = logits.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    probs = torch.exp(logits - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1)


def extend_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, qo_indptr: torch.Tensor, block_table: torch.Tensor,
                               prefix_lens: torch.Tensor, *, sm_scale: float | None = None,
                               window: int | None = None, softcap: float | None = None,
                               return_lse: bool = False, check_indices: bool = True,
                               max_extend_len: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of extend_attention (same arguments and semantics; no config)."""
    shape = check_extend(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, check_indices,
                         max_extend_len)
    opts = check_options(shape.cache.head_dim, sm_scale, window, softcap, return_lse)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    indptr = qo_indptr.tolist()
    for seq, prefix in enumerate(prefix_lens.tolist()):
        lo, hi = indptr[seq], indptr[seq + 1]
        if lo == hi:
            continue
        keys = torch.cat([_gather_pages(k_cache, block_table[seq], prefix), k[lo:hi].float()])
        values = torch.cat([_gather_pages(v_cache, block_table[seq], prefix), v[lo:hi].float()])
        k_pos = torch.arange(prefix + hi - lo, device=q.device)
        q_pos = k_pos[prefix:]
        out[lo:hi], lse[lo:hi] = _attend(q[lo:hi].float(), keys, values, q_pos, k_pos, opts)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, *, sm_scale: float | None = None,
                               window: int | None = None, softcap: float | None = None,
                               num_splits: int | None = None, return_lse: bool = False,
                               check_indices: bool = True) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference of decode_attention (same arguments, no config; num_splits has no effect here)."""
    shape = check_decode(q, k_cache, v_cache, block_table, seq_lens, check_indices)
    opts = check_options(shape.cache.head_dim, sm_scale, window, softcap, return_lse)
    check_num_splits(num_splits)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    for seq, length in enumerate(seq_lens.tolist()):
        keys = _gather_pages(k_cache, block_table[seq], length)
        values = _gather_pages(v_cache, block_table[seq], length)
        k_pos = torch.arange(length, device=q.device)
        q_pos = k_pos[-1:]
        o, l = _attend(q[seq:seq + 1].float(), keys, values, q_pos, k_pos, opts)
        out[seq], lse[seq] = o[0], l[0]
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out
