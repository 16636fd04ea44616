"""Virtual-memory pause/resume allocator.

Memory allocated under a *tag* can be paused (physical memory given back, virtual addresses kept,
contents optionally copied to host) and resumed (fresh physical memory at the same addresses,
contents restored), so raw pointers and CUDA / HIP graphs stay valid. See docs/memory.md.
"""

from __future__ import annotations

from april_ext.errors import (
    AprilError,
    ConfigError,
    DriverError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
    UnknownIdError,
)
from april_ext.memory.control import (
    BackendInfo,
    TagStats,
    backends,
    backup_cache,
    capture_graph,
    cpu_capacity,
    current_region,
    granularity,
    memory_info,
    pause,
    region,
    resume,
    set_backup_cache_limit,
    set_cpu_capacity,
    stats,
)
from april_ext.memory.tensors import (
    allocation_info,
    empty,
    move_module_to_region,
    move_optimizer_to_region,
    to_region,
)

__all__ = [
    "AprilError",
    "BackendInfo",
    "ConfigError",
    "DriverError",
    "InvalidArgumentError",
    "InvalidStateError",
    "OutOfMemoryError",
    "TagStats",
    "UnknownIdError",
    "allocation_info",
    "backends",
    "backup_cache",
    "capture_graph",
    "cpu_capacity",
    "current_region",
    "empty",
    "granularity",
    "memory_info",
    "move_module_to_region",
    "move_optimizer_to_region",
    "pause",
    "region",
    "resume",
    "set_backup_cache_limit",
    "set_cpu_capacity",
    "stats",
    "to_region",
]
