"""Benchmark cases for the paged-attention kernels and the baselines they are compared with.

Shared by bench/bench_kernels.py (pytest-benchmark) and bench/gpu_kernels_report.py (one JSON report).
Each baseline is built from the same inputs; its setup (gathering pages into dense tensors, building
masks, compiling) happens outside the timed callable, and its output is checked against ours so a
ratio is never measured against a baseline that computes something else.
"""

from __future__ import annotations

import itertools
import math
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch


def import_kernels():
    """april_ext.triton_kernels, also from a plain checkout that was never pip-installed (the GPU machine).

    There the repo root goes on sys.path and the top-level triton_kernels/ folder is mapped to
    april_ext.triton_kernels, as setup.py does. If april_ext's __init__ cannot be imported (it may need
    the compiled extension, which the kernels do not), a bare package over the same folders stands in.
    """
    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        import april_ext
    except ImportError:
        april_ext = types.ModuleType("april_ext")
        april_ext.__path__ = [str(root / "april_ext")]
        sys.modules["april_ext"] = april_ext
    try:
        import april_ext.triton_kernels as kernels
    except ModuleNotFoundError:
        april_ext.__path__.append(str(root))
        import april_ext.triton_kernels as kernels
    return kernels


tk = import_kernels()


@dataclass(frozen=True)
class Shape:
    """One workload. extend: prefix_len cached tokens (shared by each group of group_size sequences, like a
    GRPO prompt) plus new tokens drawn in [min_new, max_new]; decode: sequence lengths in [min_new, max_new]."""

    name: str
    kind: str
    num_seqs: int
    min_new: int
    max_new: int
    prefix_len: int = 0
    group_size: int = 8
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16


SHAPES = {
    s.name: s for s in [
        # Most telling first: a report cut short by its budget still has them.
        Shape("extend_resume_64x1k-16k", "extend", 64, 1024, 16384, prefix_len=512),
        Shape("decode_64x1k-16k", "decode", 64, 1024, 16384),
        Shape("extend_resume_16x1k-4k", "extend", 16, 1024, 4096, prefix_len=512),
        Shape("decode_256x1k-4k", "decode", 256, 1024, 4096),
        Shape("extend_small_4x128-512", "extend", 4, 128, 512, prefix_len=96),
        Shape("decode_small_4x128-512", "decode", 4, 128, 512),
    ]
}


@dataclass
class Case:
    shape: Shape
    q: torch.Tensor
    k: torch.Tensor | None
    v: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    new_lens: list[int]
    prefix_lens: list[int]

    @property
    def qo_indptr(self) -> torch.Tensor:
        return torch.tensor([0, *itertools.accumulate(self.new_lens)], dtype=torch.int32, device=self.q.device)

    @property
    def prefix_tensor(self) -> torch.Tensor:
        return torch.tensor(self.prefix_lens, dtype=torch.int32, device=self.q.device)

    @property
    def seq_lens(self) -> torch.Tensor:
        return torch.tensor(self.prefix_lens, dtype=torch.int32, device=self.q.device)

    def flops(self) -> float:
        """Multiply-adds x 2 of QK^T and PV over the causally visible (query, key) pairs."""
        s = self.shape
        if s.kind == "decode":
            pairs = sum(self.prefix_lens)
        else:
            pairs = sum(n * p + n * (n + 1) // 2 for n, p in zip(self.new_lens, self.prefix_lens))
        return 4.0 * s.q_heads * s.head_dim * pairs

    def kv_bytes(self) -> float:
        """Bytes of K and V a decode step must read at least once."""
        s = self.shape
        elem = torch.empty((), dtype=s.dtype).element_size()
        return 2.0 * sum(self.prefix_lens) * s.kv_heads * s.head_dim * elem


def make_case(shape: Shape, device: torch.device, page_size: int | None = None, seed: int = 0) -> Case:
    """Random inputs; pages are shuffled, and each group's sequences share the pages of their prompt."""
    ps = page_size or shape.page_size
    gen = torch.Generator().manual_seed(seed)
    new = torch.randint(shape.min_new, shape.max_new + 1, (shape.num_seqs,), generator=gen).tolist()
    prefix = [shape.prefix_len] * shape.num_seqs if shape.kind == "extend" else new
    # The first prefix_len // ps pages (whole prompt pages) are shared inside a group.
    shared = (shape.prefix_len // ps) if shape.kind == "extend" else 0
    own = [math.ceil(p / ps) - shared for p in prefix]
    groups = math.ceil(shape.num_seqs / shape.group_size)
    num_pages = groups * shared + sum(own)
    perm = torch.randperm(num_pages, generator=gen)
    cols = max(math.ceil(p / ps) for p in prefix)
    table = torch.zeros(shape.num_seqs, cols, dtype=torch.int32)
    cursor = groups * shared
    for b in range(shape.num_seqs):
        g = b // shape.group_size
        table[b, :shared] = perm[g * shared:(g + 1) * shared]
        table[b, shared:shared + own[b]] = perm[cursor:cursor + own[b]]
        cursor += own[b]

    def randn(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, device=device, dtype=shape.dtype)

    cache_shape = (max(num_pages, 1), ps, shape.kv_heads, shape.head_dim)
    if shape.kind == "extend":
        tokens = sum(new)
        return Case(shape, randn(tokens, shape.q_heads, shape.head_dim), randn(tokens, shape.kv_heads, shape.head_dim),
                    randn(tokens, shape.kv_heads, shape.head_dim), randn(*cache_shape), randn(*cache_shape),
                    table.to(device), new, prefix)
    return Case(shape, randn(shape.num_seqs, shape.q_heads, shape.head_dim), None, None, randn(*cache_shape),
                randn(*cache_shape), table.to(device), [1] * shape.num_seqs, prefix)


# --- the runners: each returns a zero-argument callable producing the output ([T or B, Hq, D]) ----------

def ours(case: Case, checked: bool = False, **opts: object) -> Callable[[], torch.Tensor]:
    """Our kernel as an engine calls it per layer: indices validated once, so check_indices=False (no host
    synchronization); checked=True measures the validating call."""
    if case.shape.kind == "extend":
        args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.qo_indptr, case.block_table,
                case.prefix_tensor)
        if not checked:
            opts = {"check_indices": False, "max_extend_len": max(case.new_lens), **opts}
        return lambda: tk.extend_attention(*args, **opts)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    if not checked:
        # Unchecked, auto splits would be sized from the block table's width; the engine knows the
        # longest sequence, so pass the split count the checked call would choose.
        opts = {"check_indices": False, "num_splits": auto_splits(case), **opts}
    return lambda: tk.decode_attention(*args, **opts)


def auto_splits(case: Case) -> int:
    from april_ext.triton_kernels.decode_attention import _num_sms, choose_num_splits

    cfg = tk.config.decode_config(case.q.device, case.shape.head_dim, case.shape.dtype)
    return choose_num_splits(case.shape.num_seqs, case.shape.kv_heads, max(case.prefix_lens), cfg.block_n,
                             _num_sms(case.q.device))


def reference(case: Case) -> Callable[[], torch.Tensor]:
    if case.shape.kind == "extend":
        args = (case.q, case.k, case.v, case.k_cache, case.v_cache, case.qo_indptr, case.block_table,
                case.prefix_tensor)
        return lambda: tk.extend_attention_reference(*args)
    args = (case.q, case.k_cache, case.v_cache, case.block_table, case.seq_lens)
    return lambda: tk.decode_attention_reference(*args)


def _dense_kv(case: Case, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys / values, [L, Hkv, D]: cached pages gathered, then its new tokens."""
    ps = case.k_cache.shape[1]
    n_prefix = case.prefix_lens[b]
    pages = case.block_table[b, :math.ceil(n_prefix / ps)].long()
    k = case.k_cache[pages].flatten(0, 1)[:n_prefix]
    v = case.v_cache[pages].flatten(0, 1)[:n_prefix]
    if case.shape.kind == "extend":
        lo = sum(case.new_lens[:b])
        hi = lo + case.new_lens[b]
        k = torch.cat([k, case.k[lo:hi]])
        v = torch.cat([v, case.v[lo:hi]])
    return k, v


def gather_time_fn(case: Case) -> Callable[[], object]:
    """What a dense baseline pays first: gathering every sequence's pages into contiguous K/V."""
    return lambda: [_dense_kv(case, b) for b in range(case.shape.num_seqs)]


def sdpa(case: Case) -> Callable[[], torch.Tensor]:
    """torch SDPA over contiguously gathered K/V (heads expanded for GQA), one call per sequence for extend
    (queries aligned to the end: causal_lower_right), one padded batched call with a key mask for decode."""
    import torch.nn.functional as F

    s = case.shape
    group = s.q_heads // s.kv_heads
    if s.kind == "extend":
        from torch.nn.attention.bias import causal_lower_right

        per_seq = []
        lo = 0
        for b, n in enumerate(case.new_lens):
            k, v = _dense_kv(case, b)
            q = case.q[lo:lo + n].transpose(0, 1).unsqueeze(0)
            k = k.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
            v = v.repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0).contiguous()
            per_seq.append((q, k, v, causal_lower_right(n, k.shape[2])))
            lo += n

        def run() -> torch.Tensor:
            outs = [F.scaled_dot_product_attention(q, k, v, attn_mask=mask) for q, k, v, mask in per_seq]
            return torch.cat([o.squeeze(0).transpose(0, 1) for o in outs])

        return run
    longest = max(case.prefix_lens)
    k_pad = torch.zeros(s.num_seqs, s.q_heads, longest, s.head_dim, device=case.q.device, dtype=s.dtype)
    v_pad = torch.zeros_like(k_pad)
    for b in range(s.num_seqs):
        k, v = _dense_kv(case, b)
        k_pad[b, :, :k.shape[0]] = k.repeat_interleave(group, dim=1).transpose(0, 1)
        v_pad[b, :, :v.shape[0]] = v.repeat_interleave(group, dim=1).transpose(0, 1)
    lens = torch.tensor(case.prefix_lens, device=case.q.device)
    mask = (torch.arange(longest, device=case.q.device)[None, :] < lens[:, None])[:, None, None, :]
    q = case.q.unsqueeze(2)
    return lambda: F.scaled_dot_product_attention(q, k_pad, v_pad, attn_mask=mask).squeeze(2)


def flex(case: Case) -> Callable[[], torch.Tensor]:
    """torch flex_attention (compiled) over gathered K/V: all sequences packed into one row for extend,
    with a mask that keeps each query to its own sequence's keys at positions <= its own; a padded batch
    with a length mask for decode."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    s = case.shape
    dev = case.q.device
    compiled = torch.compile(flex_attention, dynamic=False)
    if s.kind == "extend":
        ks, vs, q_doc, q_pos, k_doc, k_pos = [], [], [], [], [], []
        for b, n in enumerate(case.new_lens):
            k, v = _dense_kv(case, b)
            ks.append(k)
            vs.append(v)
            q_doc.append(torch.full((n,), b, dtype=torch.int32))
            q_pos.append(torch.arange(case.prefix_lens[b], case.prefix_lens[b] + n, dtype=torch.int32))
            k_doc.append(torch.full((k.shape[0],), b, dtype=torch.int32))
            k_pos.append(torch.arange(k.shape[0], dtype=torch.int32))
        q_doc_t, q_pos_t = torch.cat(q_doc).to(dev), torch.cat(q_pos).to(dev)
        k_doc_t, k_pos_t = torch.cat(k_doc).to(dev), torch.cat(k_pos).to(dev)
        k_all = torch.cat(ks).transpose(0, 1).unsqueeze(0).contiguous()
        v_all = torch.cat(vs).transpose(0, 1).unsqueeze(0).contiguous()
        q = case.q.transpose(0, 1).unsqueeze(0)

        def mask_mod(b, h, qi, ki):
            return (q_doc_t[qi] == k_doc_t[ki]) & (k_pos_t[ki] <= q_pos_t[qi])

        block_mask = create_block_mask(mask_mod, None, None, q.shape[2], k_all.shape[2], device=dev, _compile=True)
        return lambda: compiled(q, k_all, v_all, block_mask=block_mask, enable_gqa=True).squeeze(0).transpose(0, 1)
    longest = max(case.prefix_lens)
    k_pad = torch.zeros(s.num_seqs, s.kv_heads, longest, s.head_dim, device=dev, dtype=s.dtype)
    v_pad = torch.zeros_like(k_pad)
    for b in range(s.num_seqs):
        k, v = _dense_kv(case, b)
        k_pad[b, :, :k.shape[0]] = k.transpose(0, 1)
        v_pad[b, :, :v.shape[0]] = v.transpose(0, 1)
    lens = torch.tensor(case.prefix_lens, device=dev)

    def len_mask(b, h, qi, ki):
        return ki < lens[b]

    block_mask = create_block_mask(len_mask, s.num_seqs, None, 1, longest, device=dev, _compile=True)
    q = case.q.unsqueeze(2)
    return lambda: compiled(q, k_pad, v_pad, block_mask=block_mask, enable_gqa=True).squeeze(2)


def flash_attn(case: Case) -> Callable[[], torch.Tensor]:
    """flash-attn's paged path (page size 256, as it requires), when the package is installed. It reads
    every key from the cache, so for extend the new tokens are written behind each prefix first (setup)."""
    from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

    k_cache, v_cache, table, lens = _filled_cache(case, 256)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=case.q.device)
    if case.shape.kind == "decode":
        q = case.q.unsqueeze(1)
        return lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens_t, block_table=table,
                                               causal=True).squeeze(1)
    cu_q = case.qo_indptr
    cu_k = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=case.q.device)
    return lambda: flash_attn_varlen_func(case.q, k_cache, v_cache, cu_q, cu_k, max(case.new_lens), max(lens),
                                          causal=True, block_table=table)


def flashinfer(case: Case) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged wrappers (NHD layout, the case's page size), when the package is installed: the
    decode wrapper for decode, the prefill wrapper with a causal mask aligned to each sequence's end for
    extend. Like flash-attn it reads every key from the cache, so the new tokens are written behind each
    prefix first (setup); plan() is setup too, as a serving engine plans once per batch."""
    import flashinfer as fi

    s = case.shape
    dev = case.q.device
    ps = case.k_cache.shape[1]
    k_cache, v_cache, table, lens = _filled_cache(case, ps)
    pages = [math.ceil(n / ps) for n in lens]
    indptr = torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32, device=dev)
    indices = torch.cat([table[b, :pages[b]] for b in range(s.num_seqs)]).to(torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * ps for n, p in zip(lens, pages)], dtype=torch.int32, device=dev)
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    if s.kind == "decode":
        wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(indptr, indices, last_page_len, s.q_heads, s.kv_heads, s.head_dim, ps,
                     q_data_type=s.dtype, kv_data_type=s.dtype)
    else:
        wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(case.qo_indptr, indptr, indices, last_page_len, s.q_heads, s.kv_heads, s.head_dim, ps,
                     causal=True, q_data_type=s.dtype, kv_data_type=s.dtype)
    return lambda: wrapper.run(case.q, (k_cache, v_cache))


def _filled_cache(case: Case, page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Every sequence's keys / values (_dense_kv) in a fresh cache of ``page_size`` pages, each sequence's pages
    consecutive; returns it, its block table and the lengths."""
    s = case.shape
    dense = [_dense_kv(case, b) for b in range(s.num_seqs)]
    lens = [k.shape[0] for k, _ in dense]
    pages = [math.ceil(n / page_size) for n in lens]
    k_cache = torch.zeros(sum(pages), page_size, s.kv_heads, s.head_dim, device=case.q.device, dtype=s.dtype)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(s.num_seqs, max(pages), dtype=torch.int32, device=case.q.device)
    start = 0
    for b, (k, v) in enumerate(dense):
        table[b, :pages[b]] = torch.arange(start, start + pages[b], device=case.q.device)
        k_cache.view(-1, s.kv_heads, s.head_dim)[start * page_size:start * page_size + lens[b]] = k
        v_cache.view(-1, s.kv_heads, s.head_dim)[start * page_size:start * page_size + lens[b]] = v
        start += pages[b]
    return k_cache, v_cache, table, lens


# flex_attention last: its compilation is the slowest setup.
BASELINES: dict[str, Callable[[Case], Callable[[], torch.Tensor]]] = {
    "sdpa": sdpa,
    "flash_attn": flash_attn,
    "flashinfer": flashinfer,
    "reference": reference,
    "flex_attention": flex,
}
