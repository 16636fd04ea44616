"""The APRIL training loop: TrainConfig, the run (scheduler + engine + rewards + trainer), checkpoints."""

from april_ext.training.checkpoint import CheckpointInfo, CheckpointManager
from april_ext.training.config import TrainConfig
from april_ext.training.run import (
    METRICS_FILE,
    StepMemory,
    TrainingRun,
    TrainResult,
    summarize,
    train,
    train_async,
    train_side_by_side,
)

__all__ = [
    "METRICS_FILE",
    "CheckpointInfo",
    "CheckpointManager",
    "StepMemory",
    "TrainConfig",
    "TrainResult",
    "TrainingRun",
    "summarize",
    "train",
    "train_async",
    "train_side_by_side",
]
