"""MegatronTrainer: the Trainer protocol over a megatron-core GPTModel.

The RL step is the torch trainer's (same advantages, off-policy mask, policy loss, micro-batching and
minibatches): only the model differs. Weights leave and enter in Hugging Face names through the
conversion module, so the embedded engine and SGLang load what ``export_weights`` returns.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from april_ext.errors import ConfigError, InvalidStateError
from april_ext.settings import MAX_SEED
from april_ext.model import ModelConfig, iter_safetensors
from april_ext.model.checkpoint import save_safetensors
from april_ext.protocol.trainer import ExportedWeights
from april_ext.trainer.checkpoint import REFERENCE_FILE
from april_ext.trainer.config import TrainerConfig
from april_ext.trainer.megatron import parallel
from april_ext.trainer.megatron.model import MegatronCausalLM
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.torch_trainer import TorchTrainer

_MODEL_FILE = "model.safetensors"

WeightsSource = str | os.PathLike[str] | Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class MegatronTrainerConfig:
    """model: the architecture (Llama / Qwen2 / Mistral without sliding window).
    trainer: optimisation settings, shared with the torch trainer (algorithm, lr, AdamW betas and eps,
        grad_clip, micro_batch_tokens, minibatches, mixed_precision, device, colocated, memory_tag).
    seed: seeds Megatron's initialisation when no weights are given, and its model-parallel RNG stream.
    parallel: how the model is split across ranks (DistributedMegatronTrainer); MegatronTrainer takes
        only the default, a world of one.
    """

    model: ModelConfig
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    seed: int = 0
    parallel: MegatronParallelConfig = field(default_factory=MegatronParallelConfig)

    def __post_init__(self) -> None:
        if not isinstance(self.model, ModelConfig):
            raise ConfigError(f"MegatronTrainerConfig.model must be a ModelConfig, got {type(self.model).__name__}")
        if not isinstance(self.trainer, TrainerConfig):
            raise ConfigError(f"MegatronTrainerConfig.trainer must be a TrainerConfig, got "
                              f"{type(self.trainer).__name__}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"MegatronTrainerConfig.seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.parallel, MegatronParallelConfig):
            raise ConfigError(f"MegatronTrainerConfig.parallel must be a MegatronParallelConfig, got "
                              f"{type(self.parallel).__name__}")


class MegatronTrainer(TorchTrainer):
    """Trains a megatron-core GPTModel (local layer spec, tensor / pipeline parallel size 1) with the torch
    trainer's RL objective and torch.optim.AdamW.

    weights: a Hugging Face checkpoint directory or (name, tensor) pairs in HF names; None keeps
    Megatron's own initialisation (seeded by ``config.seed``). The parameters are float32 (the
    ``model.dtype`` of a checkpoint is not used for training); ``mixed_precision`` adds bf16 autocast.
    The process group and model-parallel state are created on first use (``parallel.initialize``) and
    torn down by ``parallel.shutdown()``.
    """

    checkpoint_format = "april_ext.megatron_trainer/1"

    def __init__(self, config: MegatronTrainerConfig, weights: WeightsSource | None = None, *,
                 initial_version: int = 0) -> None:
        if not isinstance(config, MegatronTrainerConfig):
            raise ConfigError(f"config must be a MegatronTrainerConfig, got {type(config).__name__}")
        if config.parallel != MegatronParallelConfig():
            raise ConfigError("MegatronTrainer runs in a world of one process; a MegatronTrainerConfig.parallel "
                              "other than the default needs DistributedMegatronTrainer")
        self.megatron_config = config
        parallel.initialize(seed=config.seed)
        if torch.distributed.get_world_size() != 1:
            # Without a gradient all-reduce the ranks would train diverging replicas.
            raise InvalidStateError(f"MegatronTrainer runs in a world of one process, this one has "
                                    f"{torch.distributed.get_world_size()}: use DistributedMegatronTrainer")
        rng = torch.get_rng_state()
        torch.manual_seed(config.seed)
        try:
            model = MegatronCausalLM(config.model)
        finally:
            torch.set_rng_state(rng)
        if weights is not None:
            model.load_weights(_weights(weights))
        super().__init__(model, config.trainer, initial_version=initial_version)  # type: ignore[arg-type]

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], trainer: TrainerConfig | None = None, *,
                        seed: int = 0, initial_version: int = 0) -> MegatronTrainer:
        """A trainer for the Hugging Face checkpoint directory ``path`` (config.json + safetensors)."""
        config = MegatronTrainerConfig(model=ModelConfig.from_pretrained(path), trainer=trainer or TrainerConfig(),
                                       seed=seed)
        return cls(config, path, initial_version=initial_version)

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        """HF-named tensors of the current weights. The fused q/k/v and gate/up parameters are split
        into views where the layout allows (otherwise into copies); ``to_cpu`` always copies."""
        self._require_onloaded("export_weights")
        tensors = [(name, t.to("cpu", copy=True) if to_cpu else t) for name, t in self.model.hf_weights().items()]
        return ExportedWeights(version=self._version, tensors=tensors)

    def _save_weights(self, directory: str) -> None:
        # An HF checkpoint directory, so the policy of a Megatron checkpoint loads straight into an engine.
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        self.megatron_config.model.replace(dtype=dtype).save_pretrained(directory)
        save_safetensors(self.model.hf_weights(), directory, _MODEL_FILE)
        if self.ref_model is not None:
            save_safetensors(self.ref_model.hf_weights(), directory, REFERENCE_FILE)


def _weights(source: WeightsSource) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(source, (str, os.PathLike)):
        return iter_safetensors(source)
    return source

