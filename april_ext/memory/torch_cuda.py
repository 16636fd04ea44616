"""Torch integration on CUDA / ROCm: torch allocations inside a region are served by the extension's
pluggable-allocator symbols through one torch.cuda.MemPool per (tag, device, cpu_backup)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator

import torch

from april_ext import _C
from april_ext.errors import ConfigError, InvalidStateError, OutOfMemoryError
from april_ext.memory.devices import gpu_kind

_mem = _C.memory
_lock = threading.Lock()
_pools: dict[tuple[str, int, bool], object] = {}
_pluggable: object | None = None
_active: bool | None = None
PoolId = tuple[int, int]

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


class PoolRouting:
    """The region pools one thread routes its torch allocations to, innermost last.

    Only the innermost pool is routed: torch serves an allocation from the first pool begun for the
    thread, so an open outer pool would serve (from its cached blocks) what an inner region
    allocates, while the malloc hook tags new blocks with the inner region. An outer pool is
    therefore stopped while an inner one is open, and begun again when it closes. torch's begin
    takes a reference on the pool that its end does not give back, so every stop releases one (the
    MemPool object keeps its own).
    """

    def __init__(self, begin: Callable[[int, PoolId], None], end: Callable[[int, PoolId], None],
                 release: Callable[[int, PoolId], None]) -> None:
        self._begin, self._end, self._release = begin, end, release
        # [device, pool id, routed now]
        self._stack: list[list] = []

    def routed(self) -> list[tuple[int, PoolId]]:
        """(device, pool id) of the pools routed now; at most one."""
        return [(d, p) for d, p, on in self._stack if on]

    @contextlib.contextmanager
    def route(self, device: int, pool_id: PoolId) -> Iterator[None]:
        """Routes the thread's allocations to pool_id for the block, in place of the enclosing pool."""
        outer = self._stack[-1] if self._stack else None
        resume_outer = outer is not None and outer[2]
        if resume_outer:
            self._stop(outer)
        entry = [device, pool_id, False]
        try:
            self._start(entry)
            self._stack.append(entry)
            try:
                yield
            finally:
                self._stack.pop()
                if entry[2]:
                    self._stop(entry)
        finally:
            if resume_outer:
                self._start(outer)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[tuple[int, PoolId]]:
        """Stops routing to the innermost pool for the block and routes to it again after; yields its
        (device, pool id). A graph capture into that pool needs it: torch refuses to begin a pool the
        thread is already routed to."""
        if not self._stack or not self._stack[-1][2]:
            raise InvalidStateError("no region pool is routed on this thread: open a region with "
                                    "april_ext.memory.region(tag) first (and not inside another capture)")
        entry = self._stack[-1]
        self._stop(entry)
        try:
            yield entry[0], entry[1]
        finally:
            self._start(entry)

    def _start(self, entry: list) -> None:
        self._begin(entry[0], entry[1])
        entry[2] = True

    def _stop(self, entry: list) -> None:
        self._end(entry[0], entry[1])
        self._release(entry[0], entry[1])
        entry[2] = False


_routing = threading.local()


def routing() -> PoolRouting:
    """The calling thread's PoolRouting over torch's pool-routing calls (the ones use_mem_pool makes)."""
    r = getattr(_routing, "value", None)
    if r is None:
        m = torch.cuda.memory
        r = PoolRouting(m._cuda_beginAllocateCurrentThreadToPool, m._cuda_endAllocateToPool, m._cuda_releasePool)
        _routing.value = r
    return r


@contextlib.contextmanager
def use_pool(pool: object) -> Iterator[None]:
    """Routes this thread's torch allocations to pool (in place of an enclosing region's); a failed
    allocation of ours surfaces as april_ext's OutOfMemoryError with the allocator's reason."""
    try:
        with routing().route(torch.cuda.current_device(), pool.id):
            yield
    except torch.OutOfMemoryError as exc:
        reason = _mem.take_hook_error()
        if reason:
            raise OutOfMemoryError(f"allocation in an april_ext region failed: {reason}") from exc
        raise


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, *, stream: torch.cuda.Stream | None = None,
                  capture_error_mode: str = "global") -> Iterator[torch.cuda.CUDAGraph]:
    """torch.cuda.graph(graph) with its memory in the innermost region's pool (see
    april_ext.memory.capture_graph)."""
    with routing().suspended() as (device, pool_id):
        if device != torch.cuda.current_device():
            raise InvalidStateError(f"the region's pool is on cuda:{device}, the current device is "
                                    f"cuda:{torch.cuda.current_device()}: capture on the region's device")
        with torch.cuda.graph(graph, pool=pool_id, stream=stream, capture_error_mode=capture_error_mode):
            yield graph
