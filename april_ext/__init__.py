"""april_ext: Active Partial Rollouts (APRIL) for LLM reinforcement learning."""

from __future__ import annotations

from april_ext.errors import (
    AprilError,
    ConfigError,
    CorruptStateError,
    DriverError,
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
    PersistenceError,
    UnknownIdError,
)
from april_ext.data_source import DataSource, ListDataSource, Prompt
from april_ext.scheduler import CompletedGroup, GenerationRequest, Scheduler, SchedulerConfig

__version__ = "0.1.0"

__all__ = [
    "AprilError",
    "CompletedGroup",
    "ConfigError",
    "CorruptStateError",
    "DataSource",
    "DriverError",
    "GenerationRequest",
    "InternalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "ListDataSource",
    "OutOfMemoryError",
    "PersistenceError",
    "Prompt",
    "Scheduler",
    "SchedulerConfig",
    "UnknownIdError",
    "__version__",
]
