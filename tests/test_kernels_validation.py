"""Argument validation of the kernels and references: a mistake raises ValueError naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from april_ext.errors import InvalidArgumentError
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

PAGES, PAGE, HKV, HQ, D = 4, 4, 2, 4, 16
needs_interpreter = pytest.mark.skipif(not interpreting(_extend_attention_kernel),
                                       reason="launches on CPU tensors: needs TRITON_INTERPRET=1")


def extend_args() -> dict[str, object]:
    return {
        "q": torch.randn(5, HQ, D), "k": torch.randn(5, HKV, D), "v": torch.randn(5, HKV, D),
        "k_cache": torch.randn(PAGES, PAGE, HKV, D), "v_cache": torch.randn(PAGES, PAGE, HKV, D),
        "qo_indptr": torch.tensor([0, 2, 5], dtype=torch.int32),
        "block_table": torch.tensor([[0, 1], [3, -1]], dtype=torch.int32),
        "prefix_lens": torch.tensor([6, 3], dtype=torch.int32),
    }


def decode_args() -> dict[str, object]:
    return {
        "q": torch.randn(2, HQ, D),
        "k_cache": torch.randn(PAGES, PAGE, HKV, D), "v_cache": torch.randn(PAGES, PAGE, HKV, D),
        "block_table": torch.tensor([[0, 1], [3, -1]], dtype=torch.int32),
        "seq_lens": torch.tensor([6, 3], dtype=torch.int32),
    }


def store_args() -> dict[str, object]:
    return {
        "k": torch.randn(3, HKV, D), "v": torch.randn(3, HKV, D),
        "k_cache": torch.zeros(PAGES, PAGE, HKV, D), "v_cache": torch.zeros(PAGES, PAGE, HKV, D),
        "slot_mapping": torch.tensor([0, -1, 15]),
    }


def _set(name: str, value: object) -> Callable[[dict], None]:
    def apply(args: dict) -> None:
        args[name] = value() if callable(value) else value
    return apply


EXTEND_CASES = [
    ("q", _set("q", lambda: torch.randn(5, HQ)), "dimensions"),
    ("q", _set("q", lambda: torch.randn(5, 3, D)), "multiple"),
    ("q", _set("q", lambda: torch.randn(5, HQ, D, dtype=torch.float64)), "float64"),
    ("q", _set("q", lambda: torch.randn(5, HQ, D).half()), "cache dtype"),
    ("q", _set("q", lambda: torch.randn(5, HQ, 8)), "head_dim"),
    ("q", _set("q", [[1.0]]), "torch.Tensor"),
    ("k", _set("k", lambda: torch.randn(4, HKV, D)), "shape"),
    ("v", _set("v", lambda: torch.randn(5, 1, D)), "shape"),
    ("v_cache", _set("v_cache", lambda: torch.randn(PAGES, PAGE, HKV, D).half()), "dtype"),
    ("v_cache", _set("v_cache", lambda: torch.randn(PAGES + 1, PAGE, HKV, D)), "shape"),
    ("k_cache", _set("k_cache", lambda: torch.randn(PAGES, PAGE, HKV)), "dimensions"),
    ("qo_indptr", _set("qo_indptr", lambda: torch.tensor([0, 6, 5], dtype=torch.int32)), "monotone"),
    ("qo_indptr", _set("qo_indptr", lambda: torch.tensor([0, 2, 6], dtype=torch.int32)), "token count"),
    ("qo_indptr", _set("qo_indptr", lambda: torch.tensor([1, 2, 5], dtype=torch.int32)), "start at 0"),
    ("qo_indptr", _set("qo_indptr", lambda: torch.tensor([0.0, 2.0, 5.0])), "float32"),
    ("prefix_lens", _set("prefix_lens", lambda: torch.tensor([6, 3, 0], dtype=torch.int32)), "shape"),
    ("prefix_lens", _set("prefix_lens", lambda: torch.tensor([6, -1], dtype=torch.int32)), "negative"),
    ("prefix_lens", _set("prefix_lens", lambda: torch.tensor([9, 3], dtype=torch.int32)), "capacity"),
    ("block_table", _set("block_table", lambda: torch.tensor([[0, 4], [3, -1]], dtype=torch.int32)), "[0, 1] = 4"),
    ("block_table", _set("block_table", lambda: torch.tensor([[0, 1], [-1, 2]], dtype=torch.int32)), "[1, 0] = -1"),
    ("block_table", _set("block_table", lambda: torch.tensor([[0, 1]], dtype=torch.int32)), "rows"),
    ("sm_scale", _set("sm_scale", -1.0), "not allowed"),
    ("sm_scale", _set("sm_scale", float("nan")), "not allowed"),
    ("window", _set("window", 0), "not allowed"),
    ("window", _set("window", 2.5), "not allowed"),
    ("softcap", _set("softcap", 0.0), "not allowed"),
    ("softcap", _set("softcap", "big"), "float"),
]


@pytest.mark.parametrize("fn", [extend_attention, extend_attention_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize(("name", "mutate", "fragment"), EXTEND_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(EXTEND_CASES)])
def test_extend_rejects(fn: Callable, name: str, mutate: Callable[[dict], None], fragment: str) -> None:
    args = extend_args()
    mutate(args)
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        fn(**args)
    assert isinstance(info.value, InvalidArgumentError)
    assert fragment in str(info.value)


DECODE_CASES = [
    ("seq_lens", _set("seq_lens", lambda: torch.tensor([6, 0], dtype=torch.int32)), ">= 1 key"),
    ("block_table", _set("seq_lens", lambda: torch.tensor([6, 5], dtype=torch.int32)), "[1, 1] = -1"),
    ("seq_lens", _set("seq_lens", lambda: torch.tensor([6, 9], dtype=torch.int32)), "capacity"),
    ("seq_lens", _set("q", lambda: torch.randn(3, HQ, D)), "shape (3,)"),
    ("q", _set("q", lambda: torch.randn(2, HQ, D).bfloat16()), "cache dtype"),
    ("num_splits", _set("num_splits", 0), "not allowed"),
    ("num_splits", _set("num_splits", 65), "not allowed"),
    ("window", _set("window", -3), "not allowed"),
]


@pytest.mark.parametrize("fn", [decode_attention, decode_attention_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize(("name", "mutate", "fragment"), DECODE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(DECODE_CASES)])
def test_decode_rejects(fn: Callable, name: str, mutate: Callable[[dict], None], fragment: str) -> None:
    args = decode_args()
    mutate(args)
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        fn(**args)
    assert fragment in str(info.value)


STORE_CASES = [
    ("slot_mapping", _set("slot_mapping", lambda: torch.tensor([0, -2, 1])), "-2"),
    ("slot_mapping", _set("slot_mapping", lambda: torch.tensor([0, 16, 1])), "outside [0, 16)"),
    ("slot_mapping", _set("slot_mapping", lambda: torch.tensor([5, -1, 5])), "same slot"),
    ("slot_mapping", _set("slot_mapping", lambda: torch.tensor([0, 1])), "shape"),
    ("k", _set("k", lambda: torch.randn(3, HKV, D).half()), "cache dtype"),
    ("v", _set("v", lambda: torch.randn(3, HKV + 1, D)), "shape"),
]


@pytest.mark.parametrize("fn", [store_kv, store_kv_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize(("name", "mutate", "fragment"), STORE_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(STORE_CASES)])
def test_store_rejects_and_leaves_cache_untouched(fn: Callable, name: str, mutate: Callable[[dict], None],
                                                  fragment: str) -> None:
    args = store_args()
    mutate(args)
    with pytest.raises(ValueError, match=rf"^{name}: ") as info:
        fn(**args)
    assert fragment in str(info.value)
    assert not args["k_cache"].any() and not args["v_cache"].any()


@needs_interpreter
def test_unused_block_table_entries_are_not_checked() -> None:
    # Padding (-1) past a sequence's pages is normal and must be accepted.
    args = extend_args()
    args["block_table"] = torch.tensor([[0, 1, -1, 99], [3, -1, -7, 5]], dtype=torch.int32)
    out = extend_attention(**args)
    assert torch.allclose(out, extend_attention_reference(**args), atol=1e-5)


def test_block_config_is_validated() -> None:
    with pytest.raises(ValueError, match="BlockConfig.block_m: 8"):
        BlockConfig(block_m=8, block_n=16, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="BlockConfig.block_n: 48"):
        BlockConfig(block_m=16, block_n=48, num_warps=4, num_stages=1)
    with pytest.raises(ValueError, match="BlockConfig.num_warps: 3"):
        BlockConfig(block_m=16, block_n=16, num_warps=3, num_stages=1)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from april_ext.triton_kernels import _tile

    monkeypatch.setattr(_tile, "interpreting", lambda kernel: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        extend_attention(**extend_args())
