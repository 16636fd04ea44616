"""Trainers: the Trainer protocol and the embedded torch trainer (TorchTrainer, its TrainerConfig, the
token-budget micro-batch split and the log-probability given to tokens top-k / top-p drop)."""

from april_ext.protocol.trainer import ExportedWeights, Trainer
from april_ext.trainer.batching import split_by_token_budget
from april_ext.trainer.config import MIXED_PRECISION, TrainerConfig
from april_ext.trainer.logprobs import DROPPED_LOGPROB
from april_ext.trainer.torch_trainer import TorchTrainer

__all__ = [
    "DROPPED_LOGPROB",
    "MIXED_PRECISION",
    "ExportedWeights",
    "TorchTrainer",
    "Trainer",
    "TrainerConfig",
    "split_by_token_budget",
]
