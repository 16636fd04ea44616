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

__version__ = "0.1.0"

__all__ = [
    "AprilError",
    "ConfigError",
    "CorruptStateError",
    "DriverError",
    "InternalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "OutOfMemoryError",
    "PersistenceError",
    "UnknownIdError",
    "__version__",
]
