"""Exception hierarchy of april_ext. Every error the library raises derives from AprilError.

Errors raised in the C++ core arrive as the class of the same name (see csrc/common/error.h).
"""

from __future__ import annotations


class AprilError(Exception):
    """Base class of every april_ext error."""


class ConfigError(AprilError, ValueError):
    """A configuration field has a value that is not allowed."""


class InvalidArgumentError(AprilError, ValueError):
    """A call received an argument that is not allowed."""


class InvalidStateError(AprilError, RuntimeError):
    """A call is not allowed in the object's current state."""


class UnknownIdError(AprilError, LookupError):
    """An id (sample, group, pointer, tag) that the object does not know."""


class OutOfMemoryError(AprilError, MemoryError):
    """Memory could not be allocated or resumed."""


class CorruptStateError(AprilError, ValueError):
    """A saved state is truncated, corrupted or of another format."""


class DriverError(AprilError, RuntimeError):
    """A GPU driver or runtime call failed."""


class PersistenceError(AprilError, OSError):
    """Reading or writing a state file failed."""


class InternalError(AprilError, RuntimeError):
    """A broken invariant inside april_ext (a bug: please report it)."""


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
]
