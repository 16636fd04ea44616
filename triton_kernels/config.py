"""Block sizes per GPU generation.

One fixed table, no autotuning: the first call compiles exactly one variant per (dtype, head_dim,
page_size, flags), so a resumed prefill never waits on a tuning sweep. The entries keep shared memory
under each generation's limit (Hopper 227 KiB, A100 163 KiB, consumer Ampere/Ada 99 KiB, MI300 64 KiB
LDS) for the padded head dim; tests/test_kernels_compile.py compiles them offline for sm_80 / sm_90 /
gfx942 to keep it that way. Every tile is >= 16 in each dot dimension (tl.dot's minimum on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from april_ext.errors import InvalidArgumentError


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch options of one kernel.

    block_m: query rows per program (extend), block_n: keys per inner iteration,
    num_warps / num_stages: Triton launch options.
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "num_warps", "num_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidArgumentError(f"BlockConfig.{name}: expected an int, got {type(value).__name__}")
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise InvalidArgumentError(f"BlockConfig.{name}: {value} is not allowed (a power of two >= 16)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise InvalidArgumentError(f"BlockConfig.num_warps: {self.num_warps} is not allowed (1, 2, 4, 8 or 16)")
        if not 1 <= self.num_stages <= 6:
            raise InvalidArgumentError(f"BlockConfig.num_stages: {self.num_stages} is not allowed (1..6)")


# Keyed by (generation, tier); the tier (see row_tier) is "narrow" for 16-bit inputs with a padded head dim
# <= 128, "wide" for 16-bit 256, "fp32" for float32 inputs, whose dots run on FMA units without tensor
# cores and need small tiles not to spill registers (tests/_kernels_aot.py --all: no spills on sm_90;
# on sm_80 / sm_86 at most 112 bytes, in a few extend rows). For decode, block_m is the least number of rows of
# the head tile (the query heads of one kv head, padded up for tl.dot).
_EXTEND = {
    ("hopper", "narrow"): BlockConfig(128, 64, 8, 3),
    ("hopper", "wide"): BlockConfig(64, 32, 8, 2),
    ("hopper", "fp32"): BlockConfig(16, 16, 4, 2),
    ("ampere", "narrow"): BlockConfig(128, 32, 8, 2),
    ("ampere", "wide"): BlockConfig(64, 32, 8, 2),
    ("ampere", "fp32"): BlockConfig(32, 16, 4, 2),
    ("ampere_small_smem", "narrow"): BlockConfig(64, 64, 8, 2),
    ("ampere_small_smem", "wide"): BlockConfig(32, 32, 4, 1),
    ("ampere_small_smem", "fp32"): BlockConfig(16, 16, 4, 1),
    ("mi300", "narrow"): BlockConfig(128, 64, 8, 2),
    ("mi300", "wide"): BlockConfig(64, 32, 4, 1),
    ("mi300", "fp32"): BlockConfig(16, 16, 4, 1),
    ("default", "narrow"): BlockConfig(64, 32, 4, 1),
    ("default", "wide"): BlockConfig(32, 16, 4, 1),
    ("default", "fp32"): BlockConfig(16, 16, 4, 1),
}
_DECODE = {
    ("hopper", "narrow"): BlockConfig(16, 64, 4, 3),
    ("hopper", "wide"): BlockConfig(16, 32, 4, 2),
    ("hopper", "fp32"): BlockConfig(16, 32, 8, 2),
    ("ampere", "narrow"): BlockConfig(16, 64, 4, 2),
    ("ampere", "wide"): BlockConfig(16, 32, 4, 2),
    ("ampere", "fp32"): BlockConfig(16, 32, 4, 2),
    ("ampere_small_smem", "narrow"): BlockConfig(16, 64, 4, 2),
    ("ampere_small_smem", "wide"): BlockConfig(16, 32, 4, 1),
    ("ampere_small_smem", "fp32"): BlockConfig(16, 16, 4, 1),
    ("mi300", "narrow"): BlockConfig(16, 64, 4, 1),
    ("mi300", "wide"): BlockConfig(16, 32, 4, 1),
    ("mi300", "fp32"): BlockConfig(16, 16, 4, 1),
    ("default", "narrow"): BlockConfig(16, 32, 4, 1),
    ("default", "wide"): BlockConfig(16, 16, 4, 1),
    ("default", "fp32"): BlockConfig(16, 16, 4, 1),
}
# The interpreter runs one program at a time in numpy: few large tiles are fastest.
_INTERPRETER_EXTEND = BlockConfig(64, 64, 1, 1)
_INTERPRETER_DECODE = BlockConfig(16, 64, 1, 1)


def padded_head_dim(head_dim: int) -> int:
    """The power of two >= head_dim (and >= 16) that the kernels tile with; extra lanes are masked."""
    return max(16, 1 << (head_dim - 1).bit_length())


@lru_cache(maxsize=None)
def _generation(device: torch.device) -> str:
    if device.type != "cuda":
        return "interpreter"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        arch = getattr(props, "gcnArchName", "")
        return "mi300" if arch.startswith("gfx94") or arch.startswith("gfx95") else "default"
    major, minor = props.major, props.minor
    if major in (9, 10):
        return "hopper"
    if (major, minor) == (8, 0):
        return "ampere"
    if major >= 8:
        return "ampere_small_smem"  # sm_86/89 and consumer Blackwell: about 100 KiB of shared memory
    return "default"


# A device's generation never changes: torch.compile evaluates it once while tracing, not in the graph.
@torch.compiler.assume_constant_result
def generation(device: torch.device) -> str:
    """The table row used for a device: hopper, ampere, ampere_small_smem, mi300, default or interpreter."""
    return _generation(torch.device(device))


def row_tier(head_dim: int, dtype: torch.dtype) -> str:
    """narrow / wide / fp32: the row of the block-size table for these inputs."""
    if dtype == torch.float32:
        return "fp32"
    return "narrow" if padded_head_dim(head_dim) <= 128 else "wide"


def extend_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> BlockConfig:
    gen = generation(device)
    return _INTERPRETER_EXTEND if gen == "interpreter" else _EXTEND[(gen, row_tier(head_dim, dtype))]


def decode_config(device: torch.device, head_dim: int, dtype: torch.dtype) -> BlockConfig:
    gen = generation(device)
    return _INTERPRETER_DECODE if gen == "interpreter" else _DECODE[(gen, row_tier(head_dim, dtype))]
