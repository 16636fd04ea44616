"""The Megatron-core trainers: MegatronTrainer (one process, the torch trainer's RL step on a GPTModel)
and DistributedMegatronTrainer (tensor / pipeline / data parallel across torchrun ranks with
megatron-core's DDP, optimizer and schedule), HF <-> Megatron weight conversion, and the CPU
compatibility layer. Needs the ``megatron`` extra (megatron-core); importing this package
does not import megatron-core, constructing a trainer does."""

from april_ext.trainer.megatron.conversion import (
    LAYOUTS,
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    split_qkv,
)
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.trainer import MegatronTrainer, MegatronTrainerConfig

__all__ = [
    "LAYOUTS",
    "DistributedMegatronTrainer",
    "MegatronParallelConfig",
    "MegatronTrainer",
    "MegatronTrainerConfig",
    "fuse_qkv",
    "hf_to_megatron",
    "megatron_to_hf",
    "split_qkv",
]
