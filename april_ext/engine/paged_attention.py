"""Attention over the paged KV cache for one engine step: the engine's AttentionBackend.

A step's tokens are laid out decode-first: `num_decode` sequences contributing one token each, then
the extend sequences (a prompt chunk, or a recomputed prefix) with several tokens each. Every layer
stores its new K/V at `slot_mapping` and attends over the sequence's cached prefix plus, causally,
its own new tokens. Two implementations of the same semantics: the Triton kernels (GPU, or the CPU
interpreter when forced) and a batched PyTorch path (page gather + masked SDPA) for CPU serving.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from april_ext.errors import InternalError


def check_step(tables: list[list[int]], prefix_lens: list[int], seq_lens: list[int], *, num_blocks: int,
               block_size: int) -> None:
    """Validates one step's layout on the host before it becomes device tensors.

    Every sequence needs 0 <= prefix_len < seq_len and a block table holding ceil(seq_len / block_size)
    pages, each in [0, num_blocks). Slots derive from those pages, so they lie in the cache, and lens lie
    within the (padded) table's capacity. The Triton kernels then run with check_indices=False: a bad index
    would read or write out of bounds on the device instead of raising.
    """
    for row, (table, prefix, length) in enumerate(zip(tables, prefix_lens, seq_lens)):
        if not 0 <= prefix < length:
            raise InternalError(f"step row {row}: prefix_len {prefix} and seq_len {length} are not allowed "
                                "(0 <= prefix_len < seq_len)")
        pages = -(-length // block_size)
        if len(table) < pages:
            raise InternalError(f"step row {row}: block table has {len(table)} pages, seq_len {length} needs "
                                f"{pages} of {block_size} tokens")
        for page in table[:pages]:
            if not 0 <= page < num_blocks:
                raise InternalError(f"step row {row}: block table entry {page} is not allowed "
                                    f"(a block in [0, {num_blocks}))")


@dataclass
class StepMetadata:
    """Tensors describing one step's token layout (all on the cache's device).

    slot_mapping [N]: cache slot (page * page_size + offset) of each new token.
    block_table [S, max_pages] (int32, padded with 0): pages of each sequence, decode rows first.
    prefix_lens [S]: tokens already cached before this step; seq_lens [S] = prefix + new tokens.
    qo_indptr [S_ext + 1]: token offsets of the extend sequences, relative to the first extend token.
    """

    num_decode: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    seq_lens: torch.Tensor
    qo_indptr: torch.Tensor
    max_new: int


class PagedAttention:
    """AttentionBackend over per-layer caches [num_pages, page_size, Hkv, D] for one step."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], meta: StepMetadata,
                 *, use_triton: bool) -> None:
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.meta = meta
        self.use_triton = use_triton
        # Per group (keyed by its first row): pages, key length and masks, the same in every layer.
        self._layouts: dict[int, tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        kc, vc, m = self.k_caches[layer], self.v_caches[layer], self.meta
        d = m.num_decode  # one token per decode sequence
        if self.use_triton:
            from april_ext.triton_kernels import decode_attention, extend_attention, store_kv

            # check_step validated the indices once for the step: no per-layer host copy and sync.
            store_kv(k, v, kc, vc, m.slot_mapping, check_indices=False)
            outs = []
            if m.num_decode:
                outs.append(decode_attention(q[:d], kc, vc, m.block_table[:m.num_decode], m.seq_lens[:m.num_decode],
                                             sm_scale=scale, check_indices=False))
            if q.shape[0] > d:
                outs.append(extend_attention(q[d:], k[d:], v[d:], kc, vc, m.qo_indptr, m.block_table[m.num_decode:],
                                             m.prefix_lens[m.num_decode:], sm_scale=scale, check_indices=False,
                                             max_extend_len=m.max_new))
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        _store(k, v, kc, vc, m.slot_mapping)
        outs = []
        if m.num_decode:
            outs.append(self._torch_attention(q[:d], kc, vc, slice(0, m.num_decode), 1, scale))
        if q.shape[0] > d:
            outs.append(self._torch_attention(q[d:], kc, vc, slice(m.num_decode, None), m.max_new, scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _torch_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rows: slice,
                         max_new: int, scale: float) -> torch.Tensor:
        """Pads the group's queries to [S, max_new], gathers its pages and runs one masked SDPA."""
        hkv, groups = kc.shape[2], q.shape[1] // kc.shape[2]
        pages, max_len, valid_q, row_mask = self._layout(rows, max_new, kc.shape[1], groups)
        s = pages.shape[0]
        keys = kc[pages].flatten(1, 2)[:, :max_len].transpose(1, 2)  # [S, Hkv, L, D]
        values = vc[pages].flatten(1, 2)[:, :max_len].transpose(1, 2)
        if max_new == 1:
            padded = q[:, None]
        else:
            padded = q.new_zeros(s, max_new, q.shape[1], q.shape[2])
            padded[valid_q] = q
        # GQA without copying K/V per query head: the G query heads of a KV head become G query rows.
        q_rows = padded.view(s, max_new, hkv, groups, q.shape[2]).permute(0, 2, 1, 3, 4)
        q_rows = q_rows.reshape(s, hkv, max_new * groups, q.shape[2])
        out = F.scaled_dot_product_attention(q_rows, keys, values, attn_mask=row_mask, scale=scale)
        out = out.view(s, hkv, max_new, groups, q.shape[2]).permute(0, 2, 1, 3, 4).reshape(padded.shape)
        return out[:, 0] if max_new == 1 else out[valid_q]

    def _layout(self, rows: slice, max_new: int, page_size: int,
                groups: int) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]:
        """The group's pages [S, P], key length L, valid query slots [S, max_new] and SDPA mask
        [S, 1, max_new * groups, L]: built by the first layer, reused by the others."""
        layout = self._layouts.get(rows.start)
        if layout is not None:
            return layout
        m = self.meta
        prefix, seq_lens = m.prefix_lens[rows], m.seq_lens[rows]
        new = seq_lens - prefix
        s = new.shape[0]
        max_len = int(seq_lens.max())
        pages = m.block_table[rows, :-(-max_len // page_size)].long()
        device = seq_lens.device
        # Query j of sequence i sits at position prefix[i] + j and sees keys 0..prefix[i] + j.
        offsets = torch.arange(max_new, device=device)
        valid_q = offsets[None, :] < new[:, None]
        q_pos = prefix[:, None] + offsets[None, :]
        k_pos = torch.arange(max_len, device=device)
        mask = k_pos[None, None, :] <= q_pos[:, :, None]
        mask &= valid_q[:, :, None]
        mask[:, :, 0] = True  # padded query rows attend to key 0 so their softmax stays finite
        row_mask = mask[:, None, :, None, :].expand(s, 1, max_new, groups, max_len).reshape(s, 1, -1, max_len)
        layout = self._layouts[rows.start] = (pages, max_len, valid_q, row_mask)
        return layout


def _store(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> None:
    kc.view(-1, kc.shape[2], kc.shape[3]).index_copy_(0, slots, k)
    vc.view(-1, vc.shape[2], vc.shape[3]).index_copy_(0, slots, v)
