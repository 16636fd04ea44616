"""Triton paged-attention kernels against their PyTorch references.

On CPU the kernels run in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any
import); with APRIL_EXT_GPU_TESTS=1 on a CUDA / ROCm machine the same tests run the compiled kernels.
Block tables are shuffled and share pages between sequences, and windows make the mask depend on
positions, so a kernel that reads the wrong page or the wrong position fails here.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from april_ext.triton_kernels import (
    BlockConfig,
    decode_attention,
    decode_attention_reference,
    extend_attention,
    extend_attention_reference,
    store_kv,
    store_kv_reference,
)
from april_ext.triton_kernels._tile import interpreting
from april_ext.triton_kernels.extend_attention import _extend_attention_kernel

GPU_RUN = os.environ.get("APRIL_EXT_GPU_TESTS") == "1"
DEVICE = torch.device("cuda" if GPU_RUN else "cpu")
if GPU_RUN and not torch.cuda.is_available():
    pytest.skip("APRIL_EXT_GPU_TESTS=1 but no CUDA / ROCm device", allow_module_level=True)

# Max abs error against the fp32 reference, per input dtype (outputs are O(1): values are N(0, 1)).
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
LSE_ATOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMALL = BlockConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def test_interpreter_took_effect() -> None:
    # Without it the kernels would try to compile for a GPU that is not there.
    assert interpreting(_extend_attention_kernel) != GPU_RUN


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    qo_indptr: torch.Tensor
    block_table: torch.Tensor
    prefix_lens: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.q, self.k, self.v, self.k_cache, self.v_cache, self.qo_indptr, self.block_table,
                self.prefix_lens)


def make_block_table(lens: list[int], page_size: int, num_pages: int, gen: torch.Generator,
                     spare_cols: int = 1) -> torch.Tensor:
    """Shuffled page ids; sequence b > 0 borrows its first page from sequence b - 1 when both have one.

    Unused columns hold -1 (never read). Pages are drawn without replacement otherwise.
    """
    need = [math.ceil(n / page_size) for n in lens]
    cols = max(need + [0]) + spare_cols
    perm = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(lens), cols), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        for c in range(n):
            table[b, c] = perm.pop()
        if b > 0 and n > 0 and need[b - 1] > 0:
            table[b, 0] = table[b - 1, 0]
    return table


def make_batch(prefix: list[int], extend: list[int], *, page_size: int = 4, q_heads: int = 4, kv_heads: int = 2,
               head_dim: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0, spare_pages: int = 3) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(math.ceil(n / page_size) for n in prefix) + spare_pages
    tokens = sum(extend)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    return Batch(
        q=randn(tokens, q_heads, head_dim),
        k=randn(tokens, kv_heads, head_dim),
        v=randn(tokens, kv_heads, head_dim),
        k_cache=randn(num_pages, page_size, kv_heads, head_dim),
        v_cache=randn(num_pages, page_size, kv_heads, head_dim),
        qo_indptr=torch.tensor([0] + torch.tensor(extend).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE),
        block_table=make_block_table(prefix, page_size, num_pages, gen).to(DEVICE),
        prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=DEVICE),
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    err = (actual.float() - expected.float()).abs().max().item() if actual.numel() else 0.0
    assert err <= atol, f"max abs error {err:.3g} > {atol:.3g}"


def check_extend(batch: Batch, dtype: torch.dtype = torch.float32, config: BlockConfig | None = None,
                 **opts: object) -> None:
    out, lse = extend_attention(*batch.args(), return_lse=True, config=config, **opts)
    ref, ref_lse = extend_attention_reference(*batch.args(), return_lse=True, **opts)
    assert out.dtype == batch.q.dtype and out.shape == batch.q.shape
    assert lse.dtype == torch.float32 and lse.shape == batch.q.shape[:2]
    assert_close(out, ref, ATOL[dtype])
    assert_close(lse, ref_lse, LSE_ATOL[dtype])


# --- extend_attention -------------------------------------------------------------------------------

RAGGED = ([0, 5, 8, 13], [6, 1, 9, 4])  # empty prefix, one-token extend, prefixes not multiples of 4


@pytest.mark.parametrize("opts", [{}, {"window": 3}, {"window": 7, "softcap": 2.0}, {"softcap": 1.5},
                                  {"sm_scale": 0.3}])
def test_extend_ragged_shuffled_shared_pages(opts: dict) -> None:
    check_extend(make_batch(*RAGGED), **opts)


@pytest.mark.parametrize("page_size", [1, 3, 16, 256])
def test_extend_page_sizes(page_size: int) -> None:
    check_extend(make_batch([0, 7, 19], [5, 3, 2], page_size=page_size, seed=page_size), window=6)


@pytest.mark.parametrize("heads", [(4, 1), (4, 4), (6, 2)], ids=["mqa", "mha", "gqa3"])
def test_extend_head_layouts(heads: tuple[int, int]) -> None:
    check_extend(make_batch(*RAGGED, q_heads=heads[0], kv_heads=heads[1]), window=5)


@pytest.mark.parametrize("head_dim", [80, 96, 128, 256])
def test_extend_head_dims(head_dim: int) -> None:
    check_extend(make_batch([3, 9], [4, 2], q_heads=2, kv_heads=1, head_dim=head_dim), softcap=3.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_extend_half_dtypes(dtype: torch.dtype) -> None:
    check_extend(make_batch(*RAGGED, dtype=dtype), dtype=dtype, window=4)


@pytest.mark.parametrize("opts", [{}, {"window": 20}, {"window": 5, "softcap": 4.0}])
def test_extend_many_tiles(opts: dict) -> None:
    # 16x16 tiles over prefixes and extends of several tiles each, windows crossing tile edges (window 20:
    # the first visible key of sequence 2 is 31, the last key of a tile).
    check_extend(make_batch([0, 37, 50], [40, 23, 17], page_size=5, seed=3), config=SMALL, **opts)


def test_extend_without_lse_and_zero_length_sequences() -> None:
    batch = make_batch([4, 6, 0, 2], [3, 0, 0, 2])
    out = extend_attention(*batch.args(), window=2)
    assert isinstance(out, torch.Tensor)
    assert_close(out, extend_attention_reference(*batch.args(), window=2), ATOL[torch.float32])


def test_extend_empty_batch() -> None:
    batch = make_batch([3, 0], [0, 0])
    out, lse = extend_attention(*batch.args(), return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_extend_strided_inputs() -> None:
    # q / k / v as views of one fused projection, as a model produces them.
    base = make_batch(*RAGGED)
    fused = torch.cat([base.q, base.k, base.v], dim=1)
    q, k, v = fused[:, :4], fused[:, 4:6], fused[:, 6:]
    assert not q.is_contiguous()
    strided = Batch(q, k, v, base.k_cache, base.v_cache, base.qo_indptr, base.block_table, base.prefix_lens)
    out = extend_attention(*strided.args(), window=4)
    assert_close(out, extend_attention_reference(*base.args(), window=4), ATOL[torch.float32])


def test_extend_matches_one_sequence_at_a_time() -> None:
    batch = make_batch([9, 2, 14], [3, 8, 5], seed=7)
    whole = extend_attention(*batch.args(), window=6)
    indptr = batch.qo_indptr.tolist()
    for b in range(3):
        lo, hi = indptr[b], indptr[b + 1]
        one = extend_attention(batch.q[lo:hi], batch.k[lo:hi], batch.v[lo:hi], batch.k_cache, batch.v_cache,
                               torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE),
                               batch.block_table[b:b + 1], batch.prefix_lens[b:b + 1], window=6)
        assert torch.equal(one, whole[lo:hi])


# --- decode_attention -------------------------------------------------------------------------------

def make_decode(seq_lens: list[int], *, page_size: int = 4, q_heads: int = 4, kv_heads: int = 2,
                head_dim: int = 64, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    batch = make_batch(seq_lens, [1] * len(seq_lens), page_size=page_size, q_heads=q_heads, kv_heads=kv_heads,
                       head_dim=head_dim, dtype=dtype, seed=seed)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return batch.q, batch.k_cache, batch.v_cache, batch.block_table, lens


def check_decode(args: tuple[torch.Tensor, ...], dtype: torch.dtype = torch.float32, **opts: object) -> None:
    out, lse = decode_attention(*args, return_lse=True, **opts)
    ref_opts = {key: val for key, val in opts.items() if key != "config"}
    ref, ref_lse = decode_attention_reference(*args, return_lse=True, **ref_opts)
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    assert_close(out, ref, ATOL[dtype])
    assert_close(lse, ref_lse, LSE_ATOL[dtype])


DECODE_LENS = [1, 9, 40, 23, 64]


@pytest.mark.parametrize("num_splits", [1, 3, 7])
@pytest.mark.parametrize("opts", [{}, {"window": 10}, {"softcap": 2.0, "window": 17}])
def test_decode_splits(num_splits: int, opts: dict) -> None:
    check_decode(make_decode(DECODE_LENS, page_size=5), num_splits=num_splits, config=SMALL, **opts)


def test_decode_auto_splits_default_config() -> None:
    check_decode(make_decode(DECODE_LENS, page_size=16), window=30)


@pytest.mark.parametrize("heads", [(8, 1), (2, 2), (12, 4)], ids=["mqa8", "mha", "gqa3"])
def test_decode_head_layouts(heads: tuple[int, int]) -> None:
    check_decode(make_decode(DECODE_LENS, q_heads=heads[0], kv_heads=heads[1]), num_splits=2, window=11)


@pytest.mark.parametrize("head_dim", [80, 256])
@pytest.mark.parametrize("page_size", [1, 256])
def test_decode_head_dims_and_page_sizes(head_dim: int, page_size: int) -> None:
    check_decode(make_decode([3, 30], page_size=page_size, head_dim=head_dim, q_heads=2, kv_heads=1),
                 num_splits=2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_dtypes(dtype: torch.dtype) -> None:
    check_decode(make_decode(DECODE_LENS, dtype=dtype), dtype=dtype, num_splits=3, softcap=5.0)


def test_decode_more_splits_than_tiles() -> None:
    # Most chunks are empty: they must carry zero weight in the merge.
    check_decode(make_decode([2, 5], page_size=2), num_splits=16, config=SMALL)


def test_decode_equals_last_row_of_extend() -> None:
    # A decode step is an extend of one token whose prefix is everything before it.
    q, k_cache, v_cache, table, lens = make_decode([12, 30, 7], seed=5)
    out = decode_attention(q, k_cache, v_cache, table, lens, num_splits=3, window=9)
    pages = torch.tensor([math.ceil(n / 4) for n in lens.tolist()])
    kv_last = torch.stack([k_cache[table[b, (n - 1) // 4], (n - 1) % 4] for b, n in enumerate(lens.tolist())])
    v_last = torch.stack([v_cache[table[b, (n - 1) // 4], (n - 1) % 4] for b, n in enumerate(lens.tolist())])
    assert int(pages.max()) <= table.shape[1]
    ext = extend_attention(q, kv_last, v_last, k_cache, v_cache,
                           torch.arange(4, dtype=torch.int32, device=DEVICE), table, lens - 1, window=9)
    assert_close(out, ext, 1e-5)


# --- store_kv ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_matches_reference(dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    pages, page_size, kv_heads, head_dim = 6, 5, 3, 80
    k = torch.randn(11, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(11, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    slots = torch.randperm(pages * page_size, generator=gen)[:11]
    slots[[2, 7]] = -1
    slots = slots.to(slot_dtype).to(DEVICE)
    caches = [torch.randn(pages, page_size, kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)
              for _ in range(2)]
    expected = [c.clone() for c in caches]
    assert store_kv(k, v, caches[0], caches[1], slots) is None
    store_kv_reference(k, v, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    written = slots[slots >= 0].long()
    assert torch.equal(caches[0].view(-1, kv_heads, head_dim)[written], k[slots >= 0])


def test_store_then_attend_roundtrip() -> None:
    # Store every token with store_kv, then attending from the last token over that cached prefix must
    # equal the last row of a causal extend over the same tokens packed as new tokens.
    lens, page_size = [10, 7], 3
    batch = make_batch([0, 0], lens, page_size=page_size, seed=11, spare_pages=8)
    pages = torch.randperm(batch.k_cache.shape[0], generator=torch.Generator().manual_seed(0))
    table = torch.stack([pages[:4], pages[4:8]]).to(torch.int32).to(DEVICE)
    slots = [int(table[b, i // page_size]) * page_size + i % page_size for b, n in enumerate(lens) for i in range(n)]
    store_kv(batch.k, batch.v, batch.k_cache, batch.v_cache, torch.tensor(slots, device=DEVICE))
    full = extend_attention(*batch.args())
    for b, hi in enumerate([10, 17]):
        last = extend_attention(batch.q[hi - 1:hi], batch.k[hi - 1:hi], batch.v[hi - 1:hi], batch.k_cache,
                                batch.v_cache, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), table[b:b + 1],
                                torch.tensor([lens[b] - 1], dtype=torch.int32, device=DEVICE))
        assert_close(last, full[hi - 1:hi], 1e-5)


# --- the references themselves ----------------------------------------------------------------------

def naive_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], key_pos: list[int],
                    q_pos: int, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """One query vector [D] over explicit key / value vectors, with plain Python loops."""
    logits, kept = [], []
    for key, value, pos in zip(keys, values, key_pos):
        if pos > q_pos or (window is not None and q_pos - pos >= window):
            continue
        x = float(q.double() @ key.double()) * scale
        if softcap is not None:
            x = softcap * math.tanh(x / softcap)
        logits.append(x)
        kept.append(value.double())
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    return sum(w * val for w, val in zip(weights, kept)) / sum(weights)


@pytest.mark.parametrize("opts", [{"window": None, "softcap": None}, {"window": 4, "softcap": 1.5}])
def test_extend_reference_against_naive_loop(opts: dict) -> None:
    batch = make_batch([5, 0], [3, 2], q_heads=4, kv_heads=2, head_dim=16, page_size=2, seed=2)
    ref = extend_attention_reference(*batch.args(), **opts).cpu()
    scale = 1 / math.sqrt(16)
    for b, (lo, hi) in enumerate([(0, 3), (3, 5)]):
        prefix = int(batch.prefix_lens[b])
        pages = batch.block_table[b].tolist()
        for h in range(4):
            kvh = h // 2
            keys = [batch.k_cache[pages[p // 2], p % 2, kvh] for p in range(prefix)]
            values = [batch.v_cache[pages[p // 2], p % 2, kvh] for p in range(prefix)]
            keys += [batch.k[t, kvh] for t in range(lo, hi)]
            values += [batch.v[t, kvh] for t in range(lo, hi)]
            for i in range(hi - lo):
                expect = naive_attention(batch.q[lo + i, h].cpu(), [x.cpu() for x in keys],
                                         [x.cpu() for x in values], list(range(prefix + hi - lo)), prefix + i,
                                         scale, **opts)
                assert_close(ref[lo + i, h], expect, 1e-5)


def test_decode_reference_against_naive_loop() -> None:
    q, k_cache, v_cache, table, lens = make_decode([6, 3], page_size=2, head_dim=16, seed=4)
    ref = decode_attention_reference(q, k_cache, v_cache, table, lens, window=4, softcap=2.0).cpu()
    for b, n in enumerate(lens.tolist()):
        pages = table[b].tolist()
        for h in range(4):
            keys = [k_cache[pages[p // 2], p % 2, h // 2].cpu() for p in range(n)]
            values = [v_cache[pages[p // 2], p % 2, h // 2].cpu() for p in range(n)]
            expect = naive_attention(q[b, h].cpu(), keys, values, list(range(n)), n - 1, 0.25, 4, 2.0)
            assert_close(ref[b, h], expect, 1e-5)


# --- without index checks (no host synchronization) --------------------------------------------------

def test_unchecked_calls_give_the_same_results() -> None:
    batch = make_batch(*RAGGED, seed=9)
    checked = extend_attention(*batch.args(), window=5)
    unchecked = extend_attention(*batch.args(), window=5, check_indices=False, max_extend_len=9)
    assert torch.equal(checked, unchecked)
    # Without max_extend_len it is read from qo_indptr.
    assert torch.equal(checked, extend_attention(*batch.args(), window=5, check_indices=False))
    q, k_cache, v_cache, table, lens = make_decode(DECODE_LENS, page_size=5)
    # Unchecked decode sizes its splits from the block table's capacity.
    assert_close(decode_attention(q, k_cache, v_cache, table, lens, check_indices=False),
                 decode_attention_reference(q, k_cache, v_cache, table, lens), ATOL[torch.float32])
    caches = [torch.zeros_like(k_cache), torch.zeros_like(v_cache)]
    slots = torch.tensor([3, -1, 7], device=DEVICE)
    store_kv(q[:3, :2], q[:3, 2:], caches[0], caches[1], slots, check_indices=False)
    assert torch.equal(caches[0].view(-1, 2, 64)[7], q[2, :2])


def test_max_extend_len_is_checked_when_indices_are() -> None:
    batch = make_batch(*RAGGED)
    with pytest.raises(ValueError, match=r"^max_extend_len: 8 is below sequence 2's 9 new tokens"):
        extend_attention(*batch.args(), max_extend_len=8)
    with pytest.raises(ValueError, match=r"^max_extend_len: -1 is not allowed"):
        extend_attention(*batch.args(), max_extend_len=-1, check_indices=False)


def test_auto_split_count() -> None:
    from april_ext.triton_kernels.decode_attention import choose_num_splits

    # A full GPU already (64 x 8 programs on 132 SMs): split only so that no chunk exceeds 4096 keys.
    assert choose_num_splits(64, 8, 16384, 64, 132) == 4
    assert choose_num_splits(64, 8, 4096, 64, 132) == 1
    # One long sequence: enough chunks for two programs per SM.
    assert choose_num_splits(1, 8, 100_000, 64, 132) == 33
    # Never more chunks than tiles, nor than 64.
    assert choose_num_splits(4, 2, 10, 64, 132) == 1
    assert choose_num_splits(1, 1, 10**7, 16, 132) == 64


# --- random ragged batches ----------------------------------------------------------------------------

@st.composite
def ragged_batches(draw: st.DrawFn) -> tuple[dict, dict]:
    batch = draw(st.integers(1, 4))
    kv_heads = draw(st.sampled_from([1, 2]))
    layout = {
        "prefix": draw(st.lists(st.integers(0, 40), min_size=batch, max_size=batch)),
        "extend": draw(st.lists(st.integers(0, 20), min_size=batch, max_size=batch)),
        "page_size": draw(st.sampled_from([1, 2, 7, 16])),
        "kv_heads": kv_heads,
        "q_heads": kv_heads * draw(st.sampled_from([1, 3])),
        "head_dim": draw(st.sampled_from([16, 48])),
        "seed": draw(st.integers(0, 2**16)),
    }
    opts = {"window": draw(st.one_of(st.none(), st.integers(1, 30))),
            "softcap": draw(st.one_of(st.none(), st.floats(0.5, 10.0)))}
    return layout, opts


@settings(max_examples=12, deadline=None, derandomize=True)
@given(ragged_batches())
def test_extend_random_ragged_batches(case: tuple[dict, dict]) -> None:
    layout, opts = case
    check_extend(make_batch(**layout), config=SMALL, **opts)
