"""Torch integration on CUDA / ROCm: torch allocations inside a region are served by the extension's
pluggable-allocator symbols through one torch.cuda.MemPool per (tag, device, cpu_backup)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import torch

from april_ext import _C
from april_ext.errors import ConfigError, OutOfMemoryError
from april_ext.memory.devices import gpu_kind

_mem = _C.memory
_lock = threading.Lock()
_pools: dict[tuple[str, int, bool], object] = {}
_pluggable: object | None = None
_active: bool | None = None

_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def active() -> bool:
    """Whether torch has a GPU and the matching allocator backend is usable."""
    global _active
    if _active is None:
        usable = {b["name"]: b["usable"] for b in _mem.backends()}
        _active = bool(torch.cuda.is_available() and usable.get(gpu_kind(), False))
    return _active


def check_alloc_conf() -> None:
    """Refuses expandable segments: torch then maps its own segments with the VMM API and grows them
    in place, which conflicts with pools whose memory is paused under torch's feet."""
    for var in _ALLOC_CONF_VARS:
        conf = os.environ.get(var, "")
        for item in conf.split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments" and value.strip().lower() == "true":
                raise ConfigError(
                    f"{var}={conf!r} enables expandable_segments, which april_ext.memory regions do not "
                    "support: remove expandable_segments:True (or set it to False)"
                )


def _allocator() -> object:
    global _pluggable
    if _pluggable is None:
        check_alloc_conf()
        malloc_name, free_name = _mem.torch_symbols()
        _mem.set_hook_device_kind(gpu_kind())
        _pluggable = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, malloc_name, free_name)
    return _pluggable


def pool_for_current_device(tag: str, cpu_backup: bool) -> object:
    """The MemPool of (tag, current device, cpu_backup), created on first use."""
    device = torch.cuda.current_device()
    key = (tag, device, cpu_backup)
    with _lock:
        pool = _pools.get(key)
        if pool is None:
            pool = torch.cuda.MemPool(_allocator().allocator())
            _pools[key] = pool
        return pool


def pool_id(tag: str, cpu_backup: bool = False) -> tuple[int, int]:
    """The id of the region pool of tag on the current device, for torch.cuda.graph(pool=...), so
    that a graph captured inside a region keeps its memory in the region."""
    return pool_for_current_device(tag, cpu_backup).id


@contextlib.contextmanager
def use_pool(pool: object) -> Iterator[None]:
    """Routes this thread's torch allocations to pool; a failed allocation of ours surfaces as
    april_ext's OutOfMemoryError with the allocator's reason."""
    try:
        with torch.cuda.use_mem_pool(pool):
            yield
    except torch.OutOfMemoryError as exc:
        reason = _mem.take_hook_error()
        if reason:
            raise OutOfMemoryError(f"allocation in an april_ext region failed: {reason}") from exc
        raise

