"""Trainers: the Trainer protocol and the embedded torch trainer."""

from april_ext.trainer.protocol import ExportedWeights, Trainer
from april_ext.trainer.sampling import SampledResponse, pack_batch, sample_responses
from april_ext.trainer.torch_trainer import MIXED_PRECISION, TorchTrainer, TrainerConfig, split_by_token_budget

__all__ = [
    "MIXED_PRECISION",
    "ExportedWeights",
    "SampledResponse",
    "TorchTrainer",
    "Trainer",
    "TrainerConfig",
    "pack_batch",
    "sample_responses",
    "split_by_token_budget",
]
