"""The Megatron-core trainer: GPTModel + the torch trainer's RL step, HF <-> Megatron weight conversion,
and the CPU compatibility layer. Needs the ``megatron`` extra (megatron-core); importing this package
does not import megatron-core, constructing a trainer does."""

from april_ext.trainer.megatron.conversion import (
    LAYOUTS,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    split_qkv,
)
from april_ext.trainer.megatron.trainer import MegatronTrainer, MegatronTrainerConfig

__all__ = [
    "LAYOUTS",
    "MegatronTrainer",
    "MegatronTrainerConfig",
    "fuse_qkv",
    "hf_to_megatron",
    "megatron_to_hf",
    "split_qkv",
]
