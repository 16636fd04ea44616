"""Compiles the Triton kernels ahead of time for GPU targets, on a machine without a GPU.

The interpreter checks semantics but not what only a GPU compile enforces (tl.dot tile minimums,
constructs the code generator rejects, shared-memory use against the per-generation block sizes).
Triton's bundled ptxas and AMD backend compile for sm_80 / sm_86 / sm_90 / gfx942 offline.

Run without TRITON_INTERPRET (the kernels must be JITFunctions): python tests/_kernels_aot.py [--all]
prints one JSON record per compiled variant. tests/test_kernels_compile.py runs it in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from april_ext.triton_kernels import config
from april_ext.triton_kernels.decode_attention import _decode_merge_kernel, _decode_split_kernel
from april_ext.triton_kernels.extend_attention import _extend_attention_kernel
from april_ext.triton_kernels.store_kv import _store_kv_kernel

# Shared memory per block (bytes) that a kernel may use on each target.
SMEM_LIMIT = {"hopper": 227 * 1024, "ampere": 163 * 1024, "ampere_small_smem": 99 * 1024, "mi300": 64 * 1024}
TARGETS = {
    "hopper": GPUTarget("cuda", 90, 32),
    "ampere": GPUTarget("cuda", 80, 32),
    "ampere_small_smem": GPUTarget("cuda", 86, 32),
    "mi300": GPUTarget("hip", "gfx942", 64),
}
_TYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
# Runtime scalars that are never multiples of 16 in general (no divisibility hint).
_PLAIN_INTS = {"window", "num_splits", "stride_bt", "stride_lt", "stride_lh", "stride_lb", "stride_ls",
               "stride_lps", "stride_lph", "stride_lpb"}
# Last-dimension strides: 1 at run time, which Triton specializes to a constant.
_UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_kcd", "stride_vcd", "stride_od", "stride_pd"}


@dataclass
class Result:
    kernel: str
    generation: str
    variant: str
    ok: bool
    shared_bytes: int = 0
    registers: int = 0
    spill_bytes: int = 0
    error: str = ""


def _signature(kernel: object, constexprs: dict, pointer_types: dict[str, str], default_ptr: str) -> tuple:
    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.isupper():
            sig[name] = pointer_types.get(name, default_ptr)
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("qk_scale", "softcap"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name not in _PLAIN_INTS:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _resources(cubin: bytes) -> tuple[int, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(tok.split(":") for line in text.splitlines() if "REG:" in line for tok in line.split())
    return int(fields.get("REG", 0)), int(fields.get("STACK", 0))


def compile_one(kernel: object, name: str, gen: str, variant: str, constexprs: dict, pointer_types: dict[str, str],
                default_ptr: str, num_warps: int, num_stages: int) -> Result:
    constexprs = {**{s: 1 for s in _UNIT_STRIDES if s in kernel.arg_names}, **constexprs}
    sig, attrs = _signature(kernel, constexprs, pointer_types, default_ptr)
    try:
        compiled = triton.compile(ASTSource(kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                                  target=TARGETS[gen], options={"num_warps": num_warps, "num_stages": num_stages})
    except Exception as exc:  # noqa: BLE001 - any compiler failure is the finding being reported
        return Result(name, gen, variant, False, error=f"{type(exc).__name__}: {str(exc)[-1500:]}")
    regs, spill = _resources(compiled.asm["cubin"]) if "cubin" in compiled.asm else (0, 0)
    return Result(name, gen, variant, True, compiled.metadata.shared, regs, spill)


def variants(gen: str, cases: list[tuple[torch.dtype, int]]) -> list[Result]:
    """Extend and decode-split for each (dtype, head_dim) with the table's block sizes, then merge and store."""
    out = []
    for dtype, head_dim in cases:
        ptr = "*" + _TYPE[dtype]
        d_pad = config.padded_head_dim(head_dim)
        ext = config._EXTEND[(gen, config.row_tier(head_dim, dtype))]
        dec = config._DECODE[(gen, config.row_tier(head_dim, dtype))]
        tag = f"{_TYPE[dtype]} d{head_dim}"
        # The plain variant (interior tiles unmasked) for every case; all options on for the first.
        for options in ((False,), (False, True)) if not out else ((False,),):
            flag = options[-1]
            out.append(compile_one(
                _extend_attention_kernel, "extend", gen, tag + (" window+softcap+lse" if flag else ""),
                {"GROUP": 4, "HEAD_DIM": head_dim, "D_PAD": d_pad, "PAGE_SIZE": 16, "BLOCK_M": ext.block_m,
                 "BLOCK_N": ext.block_n, "MASK_D": d_pad != head_dim, "HAS_WINDOW": flag, "HAS_SOFTCAP": flag, "WRITE_LSE": flag,
                 "UPCAST": False},
                {"QO_INDPTR": "*i32", "BLOCK_TABLE": "*i32", "PREFIX_LENS": "*i32", "LSE": "*fp32"}, ptr,
                ext.num_warps, ext.num_stages))
        out.append(compile_one(
            _decode_split_kernel, "decode_split", gen, tag,
            {"GROUP": 4, "BLOCK_H": dec.block_m, "HEAD_DIM": head_dim, "D_PAD": d_pad, "PAGE_SIZE": 16,
             "BLOCK_N": dec.block_n, "HAS_WINDOW": True, "HAS_SOFTCAP": True, "UPCAST": False},
            {"BLOCK_TABLE": "*i32", "SEQ_LENS": "*i32", "O_PART": "*fp32", "LSE_PART": "*fp32"}, ptr,
            dec.num_warps, dec.num_stages))
    out.append(compile_one(
        _decode_merge_kernel, "decode_merge", gen, "bf16 d128",
        {"HEAD_DIM": 128, "D_PAD": 128, "SPLITS_PAD": 16, "WRITE_LSE": True},
        {"O_PART": "*fp32", "LSE_PART": "*fp32", "LSE": "*fp32"}, "*bf16", 4, 1))
    out.append(compile_one(
        _store_kv_kernel, "store_kv", gen, "bf16 d128",
        {"KV_HEADS": 8, "HEAD_DIM": 128, "H_PAD": 8, "D_PAD": 128, "PAGE_SIZE": 16},
        {"SLOTS": "*i64"}, "*bf16", 4, 1))
    return out


# The CI subset: each table row of the generations the project targets (H100/H200, MI300) once.
QUICK = {
    "hopper": [(torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float32, 128)],
    "mi300": [(torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float32, 256)],
}


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("run without TRITON_INTERPRET=1: the kernels must be compiled, not interpreted", file=sys.stderr)
        return 2
    if "--all" in sys.argv[1:]:
        every = [(dtype, d) for dtype in (torch.bfloat16, torch.float16, torch.float32) for d in (64, 80, 96, 128, 256)]
        plan = {gen: every for gen in TARGETS}
    else:
        plan = QUICK
    for gen, cases in plan.items():
        for result in variants(gen, cases):
            record = asdict(result)
            record["shared_limit"] = SMEM_LIMIT[gen]
            print(json.dumps(record), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
