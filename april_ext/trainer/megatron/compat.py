"""CPU stand-ins for the few CUDA-only pieces of megatron-core that a tensor/pipeline-parallel size 1
model touches. Applied by ``apply_cpu_patches()`` only when torch has no usable GPU; with a GPU,
megatron-core runs unmodified.

Each patch replaces one module attribute and says why. They only change behaviour that would otherwise
raise (CUDA calls on a CPU-only torch), so applying them cannot alter a computation that already worked.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Iterator
from functools import reduce

import torch

_lock = threading.Lock()
_applied = False


def cpu_patches_needed() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_patches() -> bool:
    """Installs the CPU stand-ins once per process when no GPU is present; returns whether they are active."""
    global _applied
    if not cpu_patches_needed():
        return False
    with _lock:
        if not _applied:
            _patch_rotary_embedding()
            _patch_default_masks()
            _patch_global_memory_buffer()
            _applied = True
    return True


def _patch_rotary_embedding() -> None:
    # RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on its first call when the
    # frequencies live on the CPU, which raises on a CPU-only torch. The CPU version keeps them where
    # the model is and otherwise builds the same [seq, 1, 1, dim] table.
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    def get_emb(self: rope.RotaryEmbedding, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]

    rope.RotaryEmbedding.get_emb = get_emb


def _patch_default_masks() -> None:
    # The torch softmax fallback of FusedScaleMaskSoftmax builds the causal mask with device="cuda"
    # when no mask is passed. fused_softmax imported the helper by name, so it is replaced there.
    from megatron.core.fusions import fused_softmax

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    fused_softmax.get_default_causal_mask = get_default_causal_mask


def _patch_global_memory_buffer() -> None:
    # GlobalMemoryBuffer (the scratch tensor of the local attention's baddbmm) allocates on
    # torch.cuda.current_device(). The CPU version allocates the same reusable buffer in host memory.
    from megatron.core import utils

    def get_tensor(self: utils.GlobalMemoryBuffer, tensor_shape: tuple[int, ...], dtype: torch.dtype,
                   name: str, mem_alloc_context: object = None) -> torch.Tensor:
        required = reduce(operator.mul, tensor_shape, 1)
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < required:
            buf = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
        return buf[:required].view(*tensor_shape)

    utils.GlobalMemoryBuffer.get_tensor = get_tensor


def install_cpu_rng_tracker(seed: int) -> None:
    """Replaces megatron-core's CUDA RNG tracker (which seeds and swaps torch.cuda generator states; the
    local attention forks it around its dropout) with one that keeps named CPU generator states, and adds
    the model-parallel stream seeded as model_parallel_cuda_manual_seed would (seed + 2718 + tp rank 0)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718)
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class CpuRNGStatesTracker:
    """Named CPU RNG streams with the tracker interface megatron-core calls (add, fork, states)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)
        self._is_initialized = True

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG stream {name!r} or seed {seed} is already registered")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()
        self._is_initialized = True

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG stream {name!r} is not registered")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)
