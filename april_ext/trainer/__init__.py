"""Trainers: the Trainer protocol and the embedded torch trainer."""

from april_ext.protocol.trainer import ExportedWeights, Trainer
from april_ext.trainer.torch_trainer import (
    MIXED_PRECISION,
    TorchTrainer,
    TrainerConfig,
    split_by_token_budget,
)

__all__ = [
    "MIXED_PRECISION",
    "ExportedWeights",
    "TorchTrainer",
    "Trainer",
    "TrainerConfig",
    "split_by_token_budget",
]
