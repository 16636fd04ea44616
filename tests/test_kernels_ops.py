"""The kernels as torch custom ops (april_ext::extend_attention, decode_attention, store_kv).

torch.library.opcheck runs each op for real (the Triton interpreter on this CPU) and checks its schema,
its fake implementation against the real one, and its use under AOT dispatch with dynamic shapes;
torch.compile(fullgraph=True) must trace the ops, and the public functions with check_indices=False,
without a graph break and match eager.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._subclasses.fake_tensor import FakeTensorMode

from april_ext.triton_kernels import decode_attention, extend_attention, store_kv
from april_ext.triton_kernels._tile import interpreting
from april_ext.triton_kernels.extend_attention import _extend_attention_kernel

pytestmark = pytest.mark.skipif(not interpreting(_extend_attention_kernel),
                                reason="launches on CPU tensors: needs TRITON_INTERPRET=1")

ops = torch.ops.april_ext
PAGES, PAGE, HKV, HQ, D = 6, 4, 1, 2, 16
# Block sizes of the op's own arguments: block_m, block_n, num_warps, num_stages.
TILES = (16, 16, 1, 1)


def cache(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(PAGES, PAGE, HKV, D, generator=g).to(dtype),
            torch.randn(PAGES, PAGE, HKV, D, generator=g).to(dtype))


def extend_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Two ragged sequences: 3 new tokens over a 5-token prefix (pages 2, 0), 2 over 1 (page 5)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, HQ, D, generator=g).to(dtype)
    k = torch.randn(5, HKV, D, generator=g).to(dtype)
    v = torch.randn(5, HKV, D, generator=g).to(dtype)
    return (q, k, v, *cache(dtype), torch.tensor([0, 3, 5], dtype=torch.int32),
            torch.tensor([[2, 0], [5, -1]], dtype=torch.int32), torch.tensor([5, 1], dtype=torch.int32))


def decode_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    q = torch.randn(2, HQ, D, generator=torch.Generator().manual_seed(2)).to(dtype)
    return (q, *cache(dtype), torch.tensor([[2, 0], [5, -1]], dtype=torch.int32),
            torch.tensor([6, 2], dtype=torch.int32))


def store_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(3)
    return (torch.randn(4, HKV, D, generator=g), torch.randn(4, HKV, D, generator=g), *cache(),
            torch.tensor([0, 9, -1, 23]))


def _assert_passes(report: dict[str, str]) -> None:
    assert report and all(result == "SUCCESS" for result in report.values()), report


def test_store_kv_declares_that_it_writes_the_cache() -> None:
    written = {a.name for a in ops.store_kv.default._schema.arguments if a.alias_info is not None
               and a.alias_info.is_write}
    assert written == {"k_cache", "v_cache"}
    for op in (ops.extend_attention, ops.decode_attention):
        assert not any(a.alias_info is not None for a in op.default._schema.arguments)


# sm_scale, window, softcap, max_extend_len, return_lse
@pytest.mark.parametrize("options", [(0.25, None, None, 3, True), (0.25, 2, 5.0, 3, False)],
                         ids=["lse", "window-softcap"])
def test_opcheck_extend_attention(options: tuple) -> None:
    _assert_passes(torch.library.opcheck(ops.extend_attention.default, (*extend_inputs(), *options, *TILES)))


# sm_scale, window, softcap, num_splits, return_lse
@pytest.mark.parametrize("options", [(0.25, None, None, 2, True), (0.25, 3, 5.0, 1, False)],
                         ids=["split-lse", "window-softcap"])
def test_opcheck_decode_attention(options: tuple) -> None:
    _assert_passes(torch.library.opcheck(ops.decode_attention.default, (*decode_inputs(), *options, *TILES)))


def test_opcheck_store_kv() -> None:
    _assert_passes(torch.library.opcheck(ops.store_kv.default, store_inputs()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("return_lse", [True, False])
def test_fake_implementations_give_the_output_shapes_and_dtypes(dtype: torch.dtype, return_lse: bool) -> None:
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        ext = [mode.from_tensor(t) for t in extend_inputs(dtype)]
        out, lse = ops.extend_attention(*ext, 0.25, None, None, 3, return_lse, *TILES)
        assert (out.shape, out.dtype) == ((5, HQ, D), dtype)
        assert (lse.shape, lse.dtype) == ((5 if return_lse else 0, HQ), torch.float32)
        dec = [mode.from_tensor(t) for t in decode_inputs(dtype)]
        out, lse = ops.decode_attention(*dec, 0.25, None, None, 2, return_lse, *TILES)
        assert (out.shape, out.dtype) == ((2, HQ, D), dtype)
        assert (lse.shape, lse.dtype) == ((2 if return_lse else 0, HQ), torch.float32)
        assert ops.store_kv(*[mode.from_tensor(t) for t in store_inputs()]) is None


def _ops_step(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, slots, seq_lens):
    ops.store_kv(k, v, k_cache, v_cache, slots)
    out, lse = ops.extend_attention(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, 0.25, 2, None,
                                    3, True, *TILES)
    dec, _ = ops.decode_attention(q[:2], k_cache, v_cache, block_table, seq_lens, 0.25, None, 5.0, 2, False,
                                  *TILES)
    return out * lse[..., None], dec + 1


def _public_step(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, slots, seq_lens):
    # check_indices=False (with max_extend_len) is the host-synchronization-free path a compiled or
    # captured step uses; the checked path copies indices to the host and breaks the graph.
    store_kv(k, v, k_cache, v_cache, slots, check_indices=False)
    out, lse = extend_attention(q, k, v, k_cache, v_cache, qo_indptr, block_table, prefix_lens, window=2,
                                return_lse=True, check_indices=False, max_extend_len=3)
    dec = decode_attention(q[:2], k_cache, v_cache, block_table, seq_lens, softcap=5.0, num_splits=2,
                           check_indices=False)
    return out * lse[..., None], dec + 1


@pytest.mark.parametrize("step", [_ops_step, _public_step], ids=["ops", "public"])
def test_compile_fullgraph_traces_the_ops_and_matches_eager(step) -> None:
    def inputs() -> tuple[torch.Tensor, ...]:
        q, k, v, kc, vc, indptr, table, prefix = extend_inputs()
        slots = torch.tensor([1, 2, 3, -1, 21])  # page 0 (sequence 0's second page) and page 5
        return q, k, v, kc, vc, indptr, table, prefix, slots, torch.tensor([6, 2], dtype=torch.int32)

    torch._dynamo.reset()
    eager_args, compiled_args = inputs(), inputs()
    expected = step(*eager_args)
    explanation = torch._dynamo.explain(step)(*inputs())
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    called = {str(n.target).removesuffix(".default") for n in explanation.graphs[0].graph.nodes
              if n.op == "call_function"}
    assert {"april_ext.store_kv", "april_ext.extend_attention", "april_ext.decode_attention"} <= called, called
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled_args)
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e)
    # store_kv's writes reach the caller's cache in the compiled step too.
    assert torch.equal(compiled_args[3], eager_args[3]) and torch.equal(compiled_args[4], eager_args[4])
    assert not torch.equal(compiled_args[3], inputs()[3])
