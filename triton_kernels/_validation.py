"""Argument checks shared by the kernel launchers and the references.

Every check runs before a launch and raises InvalidArgumentError (a ValueError) naming the argument,
the bad value and what is allowed, so a kernel never reads or writes out of bounds. Index ranges are
checked on the host: one small device-to-host copy per index tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from april_ext.errors import InvalidArgumentError
from april_ext.triton_kernels.config import BlockConfig

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256
MAX_SPLITS = 64
# Integer arguments reach the kernels as int64.
MAX_INT = 2**63 - 1


@dataclass(frozen=True)
class CacheShape:
    num_pages: int
    page_size: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ExtendShape:
    batch: int
    tokens: int
    q_heads: int
    cache: CacheShape
    max_extend_len: int


@dataclass(frozen=True)
class DecodeShape:
    batch: int
    q_heads: int
    cache: CacheShape
    max_seq_len: int


@dataclass(frozen=True)
class AttentionOptions:
    sm_scale: float
    window: int | None
    softcap: float | None


def _fail(name: str, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"{name}: {message}")


def _tensor(name: str, value: object, ndim: int, dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _fail(name, f"expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise _fail(name, f"expected {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise _fail(name, f"dtype {str(value.dtype).replace('torch.', '')} is not allowed (allowed: {allowed})")
    return value


def _optional_int(name: str, value: object) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _fail(name, f"expected an int or None, got {type(value).__name__}")
    return value


def _same_device(tensors: dict[str, torch.Tensor]) -> None:
    first_name, first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.device != first.device:
            raise _fail(name, f"is on {t.device} but {first_name} is on {first.device}; all tensors must share one device")


def _shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != expected:
        raise _fail(name, f"expected shape {expected}, got {tuple(t.shape)}")


def check_cache(k_cache: object, v_cache: object) -> CacheShape:
    kc = _tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    vc = _tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    if kc.shape != vc.shape:
        raise _fail("v_cache", f"shape {tuple(vc.shape)} differs from k_cache shape {tuple(kc.shape)}")
    if kc.dtype != vc.dtype:
        raise _fail("v_cache", f"dtype {vc.dtype} differs from k_cache dtype {kc.dtype}")
    num_pages, page_size, kv_heads, head_dim = kc.shape
    if page_size < 1 or kv_heads < 1:
        raise _fail("k_cache", f"page_size and kv_heads must be >= 1, got shape {tuple(kc.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise _fail("k_cache", f"head_dim {head_dim} is not allowed (allowed: 1..{MAX_HEAD_DIM})")
    return CacheShape(num_pages, page_size, kv_heads, head_dim)


def _check_cache_dtype(cache_dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != cache_dtype:
            raise _fail(name, f"dtype {t.dtype} differs from the cache dtype {cache_dtype}")


def _check_inputs(check_indices: object, k_cache: object, v_cache: object, rows: dict[str, object],
                  indices: dict[str, tuple[object, int]]) -> tuple[CacheShape, list[torch.Tensor]]:
    """The checks every call starts with: check_indices a bool; the cache pair; each of rows a 3-d tensor
    in the cache's dtype; each of indices (name: (value, dimensions)) an int32 / int64 tensor; all of them
    on one device. Returns the cache shape and the tensors, rows then indices."""
    check_flag("check_indices", check_indices)
    cache = check_cache(k_cache, v_cache)
    row_tensors = {name: _tensor(name, value, 3, FLOAT_DTYPES) for name, value in rows.items()}
    index_tensors = {name: _tensor(name, value, ndim, INDEX_DTYPES) for name, (value, ndim) in indices.items()}
    _same_device({**row_tensors, "k_cache": k_cache, "v_cache": v_cache, **index_tensors})
    _check_cache_dtype(k_cache.dtype, **row_tensors)
    return cache, [*row_tensors.values(), *index_tensors.values()]


def _check_query(q: torch.Tensor, cache: CacheShape) -> tuple[int, int]:
    """q [rows, Hq, D] against the cache: its head dim, and Hq a multiple of the kv heads. Returns (rows, Hq)."""
    rows, q_heads, head_dim = q.shape
    if head_dim != cache.head_dim:
        raise _fail("q", f"head_dim {head_dim} differs from the cache head_dim {cache.head_dim}")
    if q_heads < 1 or q_heads % cache.kv_heads != 0:
        raise _fail("q", f"query heads {q_heads} must be a positive multiple of the cache's kv heads {cache.kv_heads}")
    return rows, q_heads


def _check_new_kv(k: torch.Tensor, v: torch.Tensor, tokens: int, cache: CacheShape) -> None:
    """k / v: the keys and values of `tokens` new tokens, [tokens, Hkv, D] as in the cache."""
    _shape("k", k, (tokens, cache.kv_heads, cache.head_dim))
    _shape("v", v, (tokens, cache.kv_heads, cache.head_dim))


def _check_block_table(block_table: torch.Tensor, batch: int, lens: torch.Tensor, lens_name: str,
                       cache: CacheShape) -> int:
    """Checks lens against the block table's capacity and the pages they use; returns max(lens)."""
    if block_table.shape[0] != batch:
        raise _fail("block_table", f"has {block_table.shape[0]} rows but the batch has {batch} sequences")
    capacity = block_table.shape[1] * cache.page_size
    lens_host = lens.to("cpu", torch.int64)
    if batch == 0:
        return 0
    if int(lens_host.min()) < 0:
        raise _fail(lens_name, f"contains a negative length {int(lens_host.min())}")
    longest = int(lens_host.max())
    if longest > capacity:
        seq = int(lens_host.argmax())
        raise _fail(lens_name, f"sequence {seq} has length {longest}, over the block table capacity "
                               f"{block_table.shape[1]} pages x {cache.page_size} = {capacity}")
    pages_used = (lens_host + cache.page_size - 1) // cache.page_size
    table = block_table.to("cpu", torch.int64)
    used = torch.arange(table.shape[1])[None, :] < pages_used[:, None]
    bad = used & ((table < 0) | (table >= cache.num_pages))
    if bool(bad.any()):
        seq, col = (int(i) for i in bad.nonzero()[0])
        raise _fail("block_table", f"entry [{seq}, {col}] = {int(table[seq, col])} is outside [0, {cache.num_pages}) "
                                   f"but sequence {seq} uses {int(pages_used[seq])} pages")
    return longest


def check_options(head_dim: int, sm_scale: object, window: object, softcap: object,
                  return_lse: object) -> AttentionOptions:
    """The keyword options every attention call takes (sm_scale None: 1 / sqrt(head_dim))."""
    if sm_scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(sm_scale, bool) or not isinstance(sm_scale, (int, float)):
            raise _fail("sm_scale", f"expected a float, got {type(sm_scale).__name__}")
        scale = float(sm_scale)
        if not math.isfinite(scale) or scale <= 0:
            raise _fail("sm_scale", f"{sm_scale!r} is not allowed (a finite value > 0)")
    if _optional_int("window", window) is not None and not 1 <= window <= MAX_INT:
        raise _fail("window", f"{window!r} is not allowed (None or an int in 1..2**63 - 1)")
    cap = None
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
            raise _fail("softcap", f"expected a float, got {type(softcap).__name__}")
        cap = float(softcap)
        if not math.isfinite(cap) or cap <= 0:
            raise _fail("softcap", f"{softcap!r} is not allowed (None or a finite value > 0)")
    check_flag("return_lse", return_lse)
    return AttentionOptions(scale, window, cap)


def check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, f"expected a bool, got {type(value).__name__}")
    return value


def check_config(config: object) -> BlockConfig | None:
    if config is not None and not isinstance(config, BlockConfig):
        raise _fail("config", f"expected a BlockConfig or None, got {type(config).__name__}")
    return config


def check_extend(q: object, k: object, v: object, k_cache: object, v_cache: object, qo_indptr: object,
                 block_table: object, prefix_lens: object, check_indices: bool = True,
                 max_extend_len: object = None) -> ExtendShape:
    """Shapes, dtypes and devices always; index ranges (a host copy of the index tensors) when check_indices.

    max_extend_len, when given, must bound every sequence's new tokens; with check_indices=False it spares
    the launcher its only host synchronization.
    """
    cache, (q, k, v, qo_indptr, block_table, prefix_lens) = _check_inputs(
        check_indices, k_cache, v_cache, {"q": q, "k": k, "v": v},
        {"qo_indptr": (qo_indptr, 1), "block_table": (block_table, 2), "prefix_lens": (prefix_lens, 1)})
    tokens, q_heads = _check_query(q, cache)
    _check_new_kv(k, v, tokens, cache)
    if qo_indptr.shape[0] < 1:
        raise _fail("qo_indptr", "must have B + 1 >= 1 entries")
    batch = qo_indptr.shape[0] - 1
    _shape("prefix_lens", prefix_lens, (batch,))
    if _optional_int("max_extend_len", max_extend_len) is not None and not 0 <= max_extend_len <= tokens:
        raise _fail("max_extend_len", f"{max_extend_len!r} is not allowed (None or an int in 0..{tokens}, "
                                      "the token count)")
    if not check_indices:
        if max_extend_len is None:
            max_extend_len = int((qo_indptr[1:] - qo_indptr[:-1]).max()) if batch else 0
        return ExtendShape(batch, tokens, q_heads, cache, max_extend_len)
    indptr = qo_indptr.to("cpu", torch.int64)
    if int(indptr[0]) != 0 or int(indptr[-1]) != tokens:
        raise _fail("qo_indptr", f"must start at 0 and end at the token count {tokens}, "
                                 f"got {int(indptr[0])} .. {int(indptr[-1])}")
    extend_lens = indptr[1:] - indptr[:-1]
    if batch and int(extend_lens.min()) < 0:
        seq = int(extend_lens.argmin())
        raise _fail("qo_indptr", f"is not monotone: entry {seq + 1} = {int(indptr[seq + 1])} < "
                                 f"entry {seq} = {int(indptr[seq])}")
    _check_block_table(block_table, batch, prefix_lens, "prefix_lens", cache)
    max_extend = int(extend_lens.max()) if batch else 0
    if max_extend_len is not None and max_extend_len < max_extend:
        seq = int(extend_lens.argmax())
        raise _fail("max_extend_len", f"{max_extend_len} is below sequence {seq}'s {max_extend} new tokens")
    return ExtendShape(batch, tokens, q_heads, cache, max_extend)


def check_decode(q: object, k_cache: object, v_cache: object, block_table: object, seq_lens: object,
                 check_indices: bool = True) -> DecodeShape:
    """As check_extend; without check_indices, max_seq_len is the block table's capacity (no host copy)."""
    cache, (q, block_table, seq_lens) = _check_inputs(
        check_indices, k_cache, v_cache, {"q": q}, {"block_table": (block_table, 2), "seq_lens": (seq_lens, 1)})
    batch, q_heads = _check_query(q, cache)
    _shape("seq_lens", seq_lens, (batch,))
    if not check_indices:
        return DecodeShape(batch, q_heads, cache, block_table.shape[1] * cache.page_size)
    if batch and int(seq_lens.min()) < 1:
        seq = int(seq_lens.argmin())
        raise _fail("seq_lens", f"sequence {seq} has length {int(seq_lens[seq])}; a decode step needs >= 1 key "
                                "(the current token, already stored)")
    max_seq = _check_block_table(block_table, batch, seq_lens, "seq_lens", cache)
    return DecodeShape(batch, q_heads, cache, max_seq)


def check_store(k: object, v: object, k_cache: object, v_cache: object, slot_mapping: object,
                check_indices: bool = True) -> CacheShape:
    cache, (k, v, slots) = _check_inputs(check_indices, k_cache, v_cache, {"k": k, "v": v},
                                         {"slot_mapping": (slot_mapping, 1)})
    tokens = k.shape[0]
    _check_new_kv(k, v, tokens, cache)
    _shape("slot_mapping", slots, (tokens,))
    if tokens == 0 or not check_indices:
        return cache
    host = slots.to("cpu", torch.int64)
    capacity = cache.num_pages * cache.page_size
    bad = (host < -1) | (host >= capacity)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise _fail("slot_mapping", f"entry {i} = {int(host[i])} is outside [0, {capacity}) "
                                    f"({cache.num_pages} pages x {cache.page_size}) and is not -1 (skip)")
    valid = host[host >= 0]
    if valid.numel() != torch.unique(valid).numel():
        raise _fail("slot_mapping", "two tokens map to the same slot; the result would depend on write order")
    return cache


def check_num_splits(num_splits: object) -> None:
    if _optional_int("num_splits", num_splits) is not None and not 1 <= num_splits <= MAX_SPLITS:
        raise _fail("num_splits", f"{num_splits!r} is not allowed (None or an int in 1..{MAX_SPLITS})")
