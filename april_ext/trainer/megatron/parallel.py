"""Process groups for megatron-core: ``torch.distributed`` plus
``parallel_state.initialize_model_parallel``, from one ``MegatronParallelConfig``.

Under ``torchrun`` every rank calls ``initialize``; the data-parallel size is what the world leaves after
tensor x pipeline x context parallel. The process group is trainer.distributed's (torchrun's environment
or a world of one; nccl with a GPU, gloo on a CPU; every collective has the config's timeout, so a rank
that dies makes the others fail instead of waiting forever). ``validate_layout`` refuses a layout the model
cannot be split by before anything is built (``april-ext train`` calls it before it launches ranks).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch.distributed as dist

from april_ext.errors import ConfigError, InvalidStateError
from april_ext.settings import MAX_GROUP_TIMEOUT_S
from april_ext.model import ModelConfig
from april_ext.trainer import distributed
from april_ext.trainer.megatron import compat

_lock = threading.Lock()
_owns_model_parallel = False


@dataclass(frozen=True)
class MegatronParallelConfig:
    """How a model and its optimizer state are split across the ranks (Megatron's flag names, with dashes
    for underscores). The fields are TrainConfig settings too (adopted, with these docs), but for timeout_s,
    which TrainConfig sets from distributed_timeout_minutes."""

    tensor_model_parallel_size: int = 1
    """Ranks sharing each layer (attention heads, MLP columns, the vocabulary); Megatron trainer only."""
    pipeline_model_parallel_size: int = 1
    """Consecutive stages of layers (the 1F1B schedule); Megatron trainer only."""
    context_parallel_size: int = 1
    """Only 1: megatron-core splits a packed sequence across context-parallel ranks only in Transformer
    Engine's attention, which this path does not use."""
    expert_model_parallel_size: int = 1
    """Ranks sharing the experts of a mixture-of-experts model; Megatron trainer only."""
    sequence_parallel: bool = False
    """Layer norms and dropout work on a 1/tp slice of the tokens (needs tensor_model_parallel_size > 1)."""
    use_distributed_optimizer: bool = False
    """Adam state and fp32 main parameters sharded across data-parallel ranks; Megatron trainer only."""
    optimizer_cpu_offload: bool = False
    """Adam state, fp32 main parameters and the update in host memory (megatron-core's
    HybridDeviceOptimizer); needs a GPU and use_distributed_optimizer; Megatron trainer only."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the share of the parameters (by element count) whose optimizer state
    lives in host memory, the rest staying on the GPU; in (0, 1]."""
    timeout_s: float = 600.0
    """The limit of every collective (and of the rendezvous)."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"MegatronParallelConfig.{name} must be an integer >= 1, got {value!r}")
        if self.context_parallel_size != 1:
            raise ConfigError(f"MegatronParallelConfig.context_parallel_size must be 1, got "
                              f"{self.context_parallel_size}: megatron-core splits packed sequences across "
                              f"context-parallel ranks only in Transformer Engine attention, not used here")
        for name in ("sequence_parallel", "use_distributed_optimizer", "optimizer_cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"MegatronParallelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError("MegatronParallelConfig.sequence_parallel needs tensor_model_parallel_size > 1: "
                              "--sequence-parallel splits the tokens over the tensor-parallel ranks, and "
                              "--tensor-model-parallel-size is 1; give it 2 or more, or leave out --sequence-parallel")
        self._check_offload()
        if (not isinstance(self.timeout_s, (int, float)) or isinstance(self.timeout_s, bool)
                or not 0 < self.timeout_s <= MAX_GROUP_TIMEOUT_S):
            raise ConfigError(f"MegatronParallelConfig.timeout_s must be a number in (0, 6e8], got "
                              f"{self.timeout_s!r}")

    def _check_offload(self) -> None:
        fraction = self.optimizer_offload_fraction
        if (not isinstance(fraction, (int, float)) or isinstance(fraction, bool) or not math.isfinite(fraction)
                or not 0 < fraction <= 1):
            raise ConfigError(f"MegatronParallelConfig.optimizer_offload_fraction must be a number in (0, 1], got "
                              f"{fraction!r}")
        if not self.optimizer_cpu_offload:
            if fraction != 1.0:
                raise ConfigError(f"MegatronParallelConfig.optimizer_offload_fraction={fraction!r} applies only with "
                                  "optimizer_cpu_offload=True: set both, or leave the fraction at 1.0")
            return
        if not self.use_distributed_optimizer:
            # Megatron runs the hybrid optimizer through the precision-aware distributed optimizer only.
            raise ConfigError("MegatronParallelConfig.optimizer_cpu_offload=True needs use_distributed_optimizer=True "
                              "(megatron-core offloads through the distributed optimizer's precision-aware path)")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """The data-parallel size of a world of ``world_size`` ranks."""
        if world_size % self.model_parallel_size:
            raise ConfigError(f"the world has {world_size} ranks, not a multiple of tensor x pipeline x context "
                              f"parallel = {self._split_sizes()}: the data-parallel size is the world divided by "
                              f"{self.model_parallel_size}; allowed: a world (--nproc-per-node, or torchrun's) of "
                              f"a multiple of {self.model_parallel_size} ranks")
        dp = world_size // self.model_parallel_size
        if (dp * self.context_parallel_size) % self.expert_model_parallel_size:
            raise ConfigError(f"--expert-model-parallel-size {self.expert_model_parallel_size} must divide the data x "
                              f"context parallel size {dp * self.context_parallel_size} (a world of {world_size} "
                              f"ranks over tensor x pipeline x context parallel = {self._split_sizes()}): expert-"
                              f"parallel ranks are data-parallel ranks; allowed: "
                              f"{_divisors(dp * self.context_parallel_size)}")
        return dp

    def _split_sizes(self) -> str:
        return (f"{self.tensor_model_parallel_size} x {self.pipeline_model_parallel_size} x "
                f"{self.context_parallel_size} = {self.model_parallel_size}")


def validate_layout(parallel: MegatronParallelConfig, model: ModelConfig) -> None:
    """ConfigError naming the flag, its value, the model's numbers and what is allowed when ``parallel`` cannot
    split ``model``: what megatron-core (or this package's weight loading) would otherwise refuse on every
    rank once the model is being built. The world's size is checked by ``data_parallel_size``."""
    _check_tensor_split(parallel, model)
    _check_pipeline_split(parallel, model)
    _check_expert_split(parallel, model)


def _check_tensor_split(parallel: MegatronParallelConfig, model: ModelConfig) -> None:
    tp = parallel.tensor_model_parallel_size
    assert model.num_key_value_heads is not None
    # megatron-core also takes a TP that is a multiple of the KV heads (replicating them), but the sharded
    # weight loading reads whole query groups per rank.
    sizes = {"{} attention heads (num_attention_heads)": model.num_attention_heads,
             "{} KV heads (num_key_value_heads)": model.num_key_value_heads}
    if not all(model.is_moe_layer(i) for i in range(model.num_hidden_layers)):
        sizes["MLP width {} (intermediate_size)"] = model.intermediate_size
    if model.num_experts:
        sizes["expert MLP width {} (moe_intermediate_size)"] = model.moe_intermediate_size
    if any(size % tp for size in sizes.values()):
        *most, last = (label.format(size) for label, size in sizes.items())
        raise ConfigError(f"--tensor-model-parallel-size {tp} must divide the model's {', '.join(most)} and "
                          f"{last}: each tensor-parallel rank holds an equal share of the heads, the KV heads and "
                          f"the MLP columns; allowed: {_divisors(math.gcd(*sizes.values()))}")
    if model.num_experts and tp > 1 and not parallel.sequence_parallel:
        raise ConfigError(f"a mixture-of-experts model with tensor_model_parallel_size > 1 needs "
                          f"sequence_parallel=True (--tensor-model-parallel-size {tp} without --sequence-parallel, "
                          f"{model.num_experts} experts): megatron-core's MoE layer refuses to train without it; "
                          f"add --sequence-parallel")


def _check_pipeline_split(parallel: MegatronParallelConfig, model: ModelConfig) -> None:
    pp, layers = parallel.pipeline_model_parallel_size, model.num_hidden_layers
    if layers % pp:
        verb = "is more than" if pp > layers else "does not divide"
        # megatron-core's uneven first / last stages need flags this package does not expose.
        raise ConfigError(f"--pipeline-model-parallel-size {pp} {verb} the model's {layers} layers "
                          f"(num_hidden_layers): every pipeline stage holds the same number of layers; "
                          f"allowed: {_divisors(layers)}")


def _check_expert_split(parallel: MegatronParallelConfig, model: ModelConfig) -> None:
    ep, experts = parallel.expert_model_parallel_size, model.num_experts
    if ep > 1 and not experts:
        raise ConfigError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts model, and the model "
                          f"(model_type {model.model_type!r}) is dense: num_experts is 0; allowed: 1")
    if experts and experts % ep:
        raise ConfigError(f"--expert-model-parallel-size {ep} does not divide the model's {experts} experts "
                          f"(num_experts): each expert-parallel rank holds an equal share of every MoE layer's "
                          f"experts; allowed: {_divisors(experts)}")


def _divisors(n: int) -> str:
    """'1, 2 or 4': the sizes that divide ``n``."""
    found = [str(d) for d in range(1, n + 1) if n % d == 0]
    return found[0] if len(found) == 1 else f"{', '.join(found[:-1])} or {found[-1]}"


def initialize(config: MegatronParallelConfig | None = None, seed: int = 0) -> None:
    """Makes megatron-core usable in this process with ``config`` (default: everything 1). Reuses a
    process group and model-parallel state that someone else set up (their sizes must equal
    ``config``'s); otherwise creates them and remembers to tear them down in ``shutdown``."""
    global _owns_model_parallel
    config = config or MegatronParallelConfig()
    if not isinstance(config, MegatronParallelConfig):
        raise ConfigError(f"config must be a MegatronParallelConfig, got {type(config).__name__}")
    compat.apply_cpu_patches()
    from megatron.core import parallel_state, tensor_parallel

    with _lock:
        distributed.initialize(config.timeout_s)
        config.data_parallel_size(dist.get_world_size())
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(
                config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                context_parallel_size=config.context_parallel_size,
                expert_model_parallel_size=config.expert_model_parallel_size,
                distributed_timeout_minutes=max(1, math.ceil(config.timeout_s / 60)))
            _owns_model_parallel = True
            if compat.cpu_patches_needed():
                compat.install_cpu_rng_tracker(seed, parallel_state.get_tensor_model_parallel_rank(),
                                               parallel_state.get_expert_model_parallel_rank(),
                                               parallel_state.get_expert_tensor_parallel_rank())
            else:
                tensor_parallel.model_parallel_cuda_manual_seed(seed)
        have = (parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_context_parallel_world_size(),
                parallel_state.get_expert_model_parallel_world_size())
        want = (config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                config.context_parallel_size, config.expert_model_parallel_size)
        if have != want:
            raise InvalidStateError(f"the process's model-parallel state has (tensor, pipeline, context, expert) "
                                    f"sizes {have}, the config asks for {want}")


def shutdown() -> None:
    """Destroys the model-parallel state and the process group, each only if ``initialize`` created it."""
    global _owns_model_parallel
    with _lock:
        if _owns_model_parallel:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            _owns_model_parallel = False
        distributed.shutdown()
