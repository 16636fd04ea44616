"""CPU stand-ins for the CUDA-only pieces of megatron-core that its model, tensor / pipeline / data
parallel machinery (DDP grad buffers, optimizer, pipeline schedule) touch. Applied by
``apply_cpu_patches()`` only when torch has no usable GPU; with a GPU, megatron-core runs unmodified.

Each patch replaces one attribute and says why. They only change behaviour that would otherwise raise
(CUDA calls on a CPU-only torch), so applying them cannot alter a computation that already worked. The one
exception, ``cuda_type_names`` (Tensor.type() naming CPU tensors as CUDA ones), is therefore not
installed globally: the trainer enters it only around the optimizer's construction and step.
/work/shared/notes/megatron-cpu.md has the measurements behind each patch.

Two stand-ins are about the optimizer, not the device: ``torch_adam_state_loading`` lets megatron-core's
distributed optimizer reload its checkpointed state into torch's Adam (no Apex / Transformer Engine), and
``patch_te_version_check`` lets its OptimizerConfig describe a CPU-offloaded optimizer without
Transformer Engine.
"""

from __future__ import annotations

import contextlib
import importlib
import operator
import threading
from collections.abc import Iterator
from functools import reduce
from typing import Any

import torch

_lock = threading.Lock()
# Held while a Tensor method is temporarily replaced (cuda_type_names, the tied-embedding setup).
_method_lock = threading.RLock()
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
            _patch_current_device()
            _patch_tied_embedding_setup()
            _shim_modules()
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


def _patch_current_device() -> None:
    # torch.cuda.current_device() raises on a CPU-only torch; megatron-core passes it as the device of
    # the DDP grad buffers (param_and_grad_buffer.py), the sequence-parallel gathers (mappings.py), the
    # pipeline's shape exchange (p2p_communication.py) and the distributed optimizer's shards. "cpu" is
    # the device those tensors belong on here.
    torch.cuda.current_device = lambda: "cpu"


def _patch_tied_embedding_setup() -> None:
    # With tied embeddings across pipeline stages, LanguageModule.setup_embeddings_and_output_layer moves
    # the last stage's copy of the embedding with Tensor.cuda() before all-reducing it from the first
    # stage. While it runs on a CPU, Tensor.cuda() leaves the tensor where it is.
    from megatron.core.models.common.language_module.language_module import (
        LanguageModule,
    )

    original = LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self: LanguageModule) -> None:
        cuda = torch.Tensor.cuda
        with _method_lock:
            torch.Tensor.cuda = lambda tensor, *args, **kwargs: tensor  # type: ignore[method-assign]
            try:
                original(self)
            finally:
                torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


# Modules whose global name ``torch`` is replaced by _CpuTorch: they allocate with a literal
# device="cuda" or call torch.cuda.synchronize / streams (file:line in the notes above).
_SHIMMED_MODULES = (
    "megatron.core.utils",  # local grad-norm helpers: device="cuda"
    "megatron.core.optimizer.optimizer",  # FP32Optimizer: device="cuda"
    "megatron.core.optimizer.clip_grads",  # grad norm / clipping: device="cuda"
    "megatron.core.optimizer.distrib_optimizer",  # shard bookkeeping: device="cuda"
    "megatron.core.pipeline_parallel.schedules",  # total_num_tokens: device="cuda"
    "megatron.core.pipeline_parallel.p2p_communication",  # torch.cuda.synchronize()
    # dist_checkpointing save / load: torch.cuda.synchronize() and device="cuda" buffers.
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.exchange_utils",
)


def _shim_modules() -> None:
    for name in _SHIMMED_MODULES:
        module = importlib.import_module(name)
        module.torch = _CpuTorch()  # type: ignore[attr-defined]


def _cpu_device(device: Any) -> Any:
    return "cpu" if device is not None and str(device).startswith("cuda") else device


def _on_cpu(factory: Any) -> Any:
    def make(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return make


class _NullStream:
    """A CUDA stream / event stand-in whose waits and records do nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class _CpuCuda:
    """torch.cuda as the shimmed modules see it: synchronisation and streams do nothing (CPU work is
    synchronous), everything else is torch.cuda's."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*args: Any, **kwargs: Any) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def stream(*args: Any, **kwargs: Any) -> contextlib.nullcontext[None]:
        return contextlib.nullcontext()

    @staticmethod
    def current_stream(*args: Any, **kwargs: Any) -> _NullStream:
        return _NullStream()

    Stream = Event = _NullStream


class _CpuTorch:
    """The torch module with device="cuda" in its tensor factories mapped to the CPU."""

    cuda = _CpuCuda()
    tensor = staticmethod(_on_cpu(torch.tensor))
    zeros = staticmethod(_on_cpu(torch.zeros))
    ones = staticmethod(_on_cpu(torch.ones))
    empty = staticmethod(_on_cpu(torch.empty))
    full = staticmethod(_on_cpu(torch.full))
    arange = staticmethod(_on_cpu(torch.arange))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """While active, ``Tensor.type()`` without arguments names a CPU float tensor as its CUDA type
    (torch.cuda.FloatTensor): megatron-core's optimizer accepts parameters by comparing those strings
    (optimizer.py, distrib_optimizer.py, clip_grads.py). A no-op with a GPU or outside the CPU patches."""
    if not cpu_patches_needed():
        yield
        return
    original = torch.Tensor.type

    def cuda_named_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if args or kwargs or self.device.type != "cpu":
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    with _method_lock:
        torch.Tensor.type = cuda_named_type  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.Tensor.type = original  # type: ignore[method-assign]


@contextlib.contextmanager
def torch_adam_state_loading(optimizer: Any) -> Iterator[None]:
    """Lets megatron-core 0.16's DistributedOptimizer load a ``fully_reshardable`` checkpoint into torch's
    Adam, its fallback without Apex / Transformer Engine; enter it around building the loading state dict
    and ``optimizer.load_state_dict``. Two faults, both about Adam's per-parameter "step" tensor (FusedAdam
    keeps the step in the param groups instead):
    - ``state_dict()`` (called by ``sharded_state_dict(is_loading=True)``) reads every parameter's step, but
      torch's Adam creates its state at the first step only: a fresh optimizer fails an assertion. Here
      each distributed optimizer's empty states get Adam's initial state (step 0, zero moments), which the
      load overwrites.
    - ``load_state_dict`` restores the step from the param groups as ONE tensor shared by every parameter,
      then ``load_parameter_state_from_fully_reshardable`` hands each parameter's state without "step" to
      ``_set_main_param_and_optimizer_states``, which copies every key of the optimizer's state: KeyError
      'step'. The setter here first gives each parameter its own copy of the restored step (a shared
      tensor would be incremented once per parameter by every Adam step).
    A no-op where megatron-core found Apex or Transformer Engine."""
    from megatron.core.optimizer import distrib_optimizer

    if distrib_optimizer.HAVE_APEX_OR_TE:
        yield
        return
    cls = distrib_optimizer.DistributedOptimizer
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(part, cls):
            inner = part.optimizer
            for group in inner.param_groups:
                for param in group["params"]:
                    if not inner.state[param]:
                        inner.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                              "exp_avg_sq": torch.zeros_like(param)}
    original = cls._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        group_index, group_order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][group_order]]
        if "step" in state and "step" not in tensors:
            state["step"] = state["step"].detach().clone()
            tensors = {**tensors, "step": state["step"]}
        original(self, model_param, tensors)

    with _method_lock:
        cls._set_main_param_and_optimizer_states = set_states  # type: ignore[method-assign]
        try:
            yield
        finally:
            cls._set_main_param_and_optimizer_states = original  # type: ignore[method-assign]


def _no_te_min_version(version: str, check_equality: bool = True) -> bool:
    return False


def patch_te_version_check() -> None:
    """Without Transformer Engine, makes OptimizerConfig's ``is_te_min_version`` answer False. megatron-core
    0.16.1's ``OptimizerConfig.__post_init__`` asks it for every precision-aware optimizer (which CPU
    offload is), and it compares TE's version, None when TE is absent, with a version: a TypeError on any
    device. False is what it means there (no TE >= 2.1: ``store_param_remainders`` off). A no-op with TE."""
    from megatron.core.optimizer import optimizer_config
    from megatron.core.utils import get_te_version

    if get_te_version() is None:
        optimizer_config.is_te_min_version = _no_te_min_version


def install_cpu_rng_tracker(seed: int, tp_rank: int = 0, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Replaces megatron-core's CUDA RNG tracker (which seeds and swaps torch.cuda generator states; the
    local attention forks it around its dropout) with one that keeps named CPU generator states, and adds
    the three streams model_parallel_cuda_manual_seed registers, seeded as it seeds them: data-parallel
    (seed), model-parallel (seed + 2718 + tp rank) and expert-parallel (seed + 1024 + 100 x ep rank +
    expert-tp rank)."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
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
