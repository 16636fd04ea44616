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
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise InvalidArgumentError(f"BlockConfig.{name}: {value} is not allowed (a power of two >= 16)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise InvalidArgumentError(f"BlockConfig.num_warps: {self.num_warps} is not allowed (1, 2, 4, 8 or 16)")
        if not 1 <= self.num_stages <= 6:
            raise InvalidArgumentError(f"BlockConfig.num_stages: {self.num_stages} is not allowed (1..6)")


# Keyed by (generation, padded head_dim <= 128). For decode, block_m is the least number of rows of the
# head tile (the query heads of one kv head, padded up for tl.dot).
_EXTEND = {
    ("hopper", True): BlockConfig(128, 64, 8, 3),
    ("hopper", False): BlockConfig(64, 32, 4, 2),
    ("ampere", True): BlockConfig(128, 64, 8, 2),
    ("ampere", False): BlockConfig(64, 32, 4, 2),
    ("ampere_small_smem", True): BlockConfig(64, 64, 4, 2),
    ("ampere_small_smem", False): BlockConfig(32, 32, 4, 1),
    ("mi300", True): BlockConfig(128, 64, 8, 2),
    ("mi300", False): BlockConfig(64, 32, 4, 1),
    ("default", True): BlockConfig(64, 32, 4, 1),
    ("default", False): BlockConfig(32, 16, 4, 1),
    # The interpreter runs one program at a time in numpy: few large tiles are fastest.
    ("interpreter", True): BlockConfig(64, 64, 1, 1),
    ("interpreter", False): BlockConfig(64, 64, 1, 1),
}
_DECODE = {
    ("hopper", True): BlockConfig(16, 64, 4, 3),
    ("hopper", False): BlockConfig(16, 32, 4, 2),
    ("ampere", True): BlockConfig(16, 64, 4, 2),
    ("ampere", False): BlockConfig(16, 32, 4, 2),
    ("ampere_small_smem", True): BlockConfig(16, 64, 4, 2),
    ("ampere_small_smem", False): BlockConfig(16, 32, 4, 1),
    ("mi300", True): BlockConfig(16, 64, 4, 1),
    ("mi300", False): BlockConfig(16, 32, 4, 1),
    ("default", True): BlockConfig(16, 32, 4, 1),
    ("default", False): BlockConfig(16, 16, 4, 1),
    ("interpreter", True): BlockConfig(16, 64, 1, 1),
    ("interpreter", False): BlockConfig(16, 64, 1, 1),
}


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


def generation(device: torch.device) -> str:
    """The table row used for a device: hopper, ampere, ampere_small_smem, mi300, default or interpreter."""
    return _generation(torch.device(device))


def extend_config(device: torch.device, head_dim: int) -> BlockConfig:
    return _EXTEND[(generation(device), padded_head_dim(head_dim) <= 128)]


def decode_config(device: torch.device, head_dim: int) -> BlockConfig:
    return _DECODE[(generation(device), padded_head_dim(head_dim) <= 128)]
