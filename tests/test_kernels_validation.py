"""Argument validation of the kernels and references: a mistake raises InvalidArgumentError (a ValueError)
naming the argument."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from april_ext.errors import AprilError, InvalidArgumentError
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
    ("window", _set("window", 2.5), "got float"),
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

# (function, argument builder, parameter, wrong-typed value, the type it reports, the type it expects)
WRONG_TYPES = [
    (extend_attention, extend_args, "config", {"block_m": 16}, "dict", "BlockConfig or None"),
    (extend_attention, extend_args, "config", "small", "str", "BlockConfig or None"),
    (extend_attention, extend_args, "config", (16, 16, 1, 1), "tuple", "BlockConfig or None"),
    (extend_attention, extend_args, "q", None, "NoneType", "torch.Tensor"),
    (extend_attention, extend_args, "prefix_lens", [6, 3], "list", "torch.Tensor"),
    (extend_attention, extend_args, "return_lse", "yes", "str", "bool"),
    (extend_attention, extend_args, "check_indices", 1, "int", "bool"),
    (extend_attention, extend_args, "sm_scale", "0.5", "str", "float"),
    (extend_attention, extend_args, "softcap", True, "bool", "float"),
    (extend_attention, extend_args, "window", 2.0, "float", "int or None"),
    (extend_attention, extend_args, "max_extend_len", 3.0, "float", "int or None"),
    (extend_attention_reference, extend_args, "return_lse", 0, "int", "bool"),
    (extend_attention_reference, extend_args, "check_indices", None, "NoneType", "bool"),
    (decode_attention, decode_args, "config", {"block_m": 16}, "dict", "BlockConfig or None"),
    (decode_attention, decode_args, "config", "default", "str", "BlockConfig or None"),
    (decode_attention, decode_args, "q", 1.0, "float", "torch.Tensor"),
    (decode_attention, decode_args, "num_splits", 2.0, "float", "int or None"),
    (decode_attention, decode_args, "num_splits", True, "bool", "int or None"),
    (decode_attention, decode_args, "window", "4", "str", "int or None"),
    (decode_attention, decode_args, "return_lse", 1, "int", "bool"),
    (decode_attention, decode_args, "check_indices", "no", "str", "bool"),
    (decode_attention_reference, decode_args, "return_lse", 1, "int", "bool"),
    (decode_attention_reference, decode_args, "check_indices", "no", "str", "bool"),
    (store_kv, store_args, "slot_mapping", [0, -1, 15], "list", "torch.Tensor"),
    (store_kv, store_args, "k_cache", None, "NoneType", "torch.Tensor"),
    (store_kv, store_args, "check_indices", "no", "str", "bool"),
    (store_kv_reference, store_args, "check_indices", 0, "int", "bool"),
]


@pytest.mark.parametrize(("fn", "make_args", "name", "value", "received", "expected"), WRONG_TYPES,
                         ids=[f"{c[0].__name__}-{c[2]}-{i}" for i, c in enumerate(WRONG_TYPES)])
def test_wrong_types_raise_invalid_argument_naming_the_types(fn: Callable, make_args: Callable[[], dict], name: str,
                                                             value: object, received: str, expected: str) -> None:
    args = make_args()
    args[name] = value
    with pytest.raises(AprilError, match=rf"^{name}: ") as info:
        fn(**args)
    assert isinstance(info.value, InvalidArgumentError)
    assert received in str(info.value) and expected in str(info.value)


@pytest.mark.parametrize("field", ["block_m", "block_n", "num_warps", "num_stages"])
@pytest.mark.parametrize("value", ["16", 16.0, None])
def test_block_config_fields_must_be_ints(field: str, value: object) -> None:
    fields = {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1, field: value}
    with pytest.raises(InvalidArgumentError, match=rf"^BlockConfig.{field}: expected an int, got {type(value).__name__}"):
        BlockConfig(**fields)


def test_max_extend_len_is_bounded_by_the_token_count() -> None:
    # Without the bound an unchecked call would launch a grid sized by any int it is given.
    args = extend_args()
    with pytest.raises(InvalidArgumentError, match=r"^max_extend_len: 6 is not allowed \(None or an int in 0..5"):
        extend_attention(**args, check_indices=False, max_extend_len=6)
