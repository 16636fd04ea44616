"""Regions, pause / resume and statistics: the tag-level controls of the allocator."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from april_ext import _C
from april_ext.errors import InvalidArgumentError, InvalidStateError
from april_ext.memory import torch_cuda
from april_ext.memory.devices import resolve

_mem = _C.memory
# The C++ core counts bytes in size_t.
MAX_BYTES = 2**64 - 1


@dataclass(frozen=True)
class TagStats:
    """Usage of one tag. Bytes are summed over its live allocations."""

    tag: str
    paused: bool
    allocations: int
    logical_bytes: int  # what callers asked for
    physical_bytes: int  # rounded up to the backend's granularity
    resident_bytes: int  # physical bytes mapped now (0 while paused)
    backup_bytes: int  # host bytes holding backups now
    pauses: int
    resumes: int
    last_pause_seconds: float
    last_resume_seconds: float
    last_pause_copied_bytes: int
    last_resume_copied_bytes: int
    last_pause_copy_seconds: float  # the backup copy alone, within last_pause_seconds
    last_resume_copy_seconds: float  # the restore copy alone, within last_resume_seconds


@dataclass(frozen=True)
class BackendInfo:
    """Whether a backend was compiled into this build and whether it can be used on this machine."""

    name: str
    compiled: bool
    usable: bool
    reason: str  # why it is not usable; empty when it is


def _check_tag(tag: object, name: str = "tag") -> str:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgumentError(f"{name}={tag!r} is not allowed: use a non-empty string")
    return tag


def _check_optional_tag(tag: object) -> str | None:
    return None if tag is None else _check_tag(tag)


def backends() -> list[BackendInfo]:
    """The cpu, cuda and hip backends: compiled in or not, usable now or not (and why)."""
    return [BackendInfo(**b) for b in _mem.backends()]


def granularity(device: str | torch.device = "cpu") -> int:
    """Bytes that allocations on device are rounded up to."""
    kind, index, _ = resolve(device)
    return int(_mem.granularity(kind, index))


def memory_info(device: str | torch.device = "cpu") -> tuple[int, int]:
    """(free, total) bytes of device as its backend sees them (the simulated capacity on the CPU
    when one is set)."""
    kind, index, _ = resolve(device)
    free, total = _mem.memory_info(kind, index)
    return int(free), int(total)


def set_cpu_capacity(nbytes: int | None) -> None:
    """Simulates a device of nbytes on the CPU backend: creating physical memory beyond it raises
    OutOfMemoryError, as a full GPU would. None removes the limit."""
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool)
                               or not 0 < nbytes <= MAX_BYTES):
        raise InvalidArgumentError(f"nbytes={nbytes!r} is not allowed: use a positive int up to {MAX_BYTES} "
                                   "(2**64 - 1) or None")
    _mem.set_cpu_capacity(0 if nbytes is None else nbytes)


def cpu_capacity() -> int | None:
    """The simulated CPU device size set by set_cpu_capacity, or None."""
    cap = int(_mem.cpu_capacity())
    return cap or None


def set_backup_cache_limit(nbytes: int) -> None:
    """Keeps host buffers of resumed backups, up to nbytes in all, for the next pause of the same
    size: repeated pause / resume cycles then copy into memory that is already faulted in instead of
    fresh pages. Kept buffers hold host memory while their tags are active. 0 (the default) keeps
    none; lowering the limit frees what no longer fits."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 <= nbytes <= MAX_BYTES:
        raise InvalidArgumentError(f"nbytes={nbytes!r} is not allowed: use an int in 0..{MAX_BYTES} (2**64 - 1)")
    _mem.set_backup_cache_limit(nbytes)


def backup_cache() -> tuple[int, int]:
    """(limit, bytes kept now) of the backup buffer cache."""
    return int(_mem.backup_cache_limit()), int(_mem.backup_cache_held())


def current_region() -> tuple[str, bool] | None:
    """(tag, cpu_backup) of the innermost region open on this thread, or None."""
    frame = _mem.current_region()
    return None if frame is None else (frame[0], bool(frame[1]))


@contextlib.contextmanager
def region(tag: str, cpu_backup: bool = False) -> Iterator[None]:
    """Tags what is allocated inside the block on this thread (regions nest; the innermost wins).

    On the CPU the tag is the default of to_region / move_module_to_region. On CUDA / ROCm torch
    allocations inside the block come from the allocator too (a torch MemPool per tag, device and
    backup setting over the extension's pluggable-allocator symbols); an enclosing region's pool
    stops serving them until the block ends. Capture CUDA graphs inside it with capture_graph.
    """
    _check_tag(tag)
    if not isinstance(cpu_backup, bool):
        raise InvalidArgumentError(f"cpu_backup={cpu_backup!r} is not allowed: use True or False")
    pool = torch_cuda.pool_for_current_device(tag, cpu_backup) if torch_cuda.active() else None
    _mem.push_region(tag, cpu_backup)
    try:
        if pool is None:
            yield
        else:
            with torch_cuda.use_pool(pool):
                yield
    finally:
        _mem.pop_region()


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, *, stream: torch.cuda.Stream | None = None,
                  capture_error_mode: str = "global") -> Iterator[torch.cuda.CUDAGraph]:
    """Captures a CUDA / HIP graph whose memory is in the current region's tag: use it in place of
    ``torch.cuda.graph(graph)`` inside ``with region(tag):`` (stream and capture_error_mode as there).

    Why a helper: the region routes the thread's allocations to its pool, and torch refuses to
    capture into a pool the thread is routed to ("beginAllocateToPool: already recording to
    mempool_id"); a capture after the region closed reaches the allocator with no region open and
    fails as out of memory. So for the capture the routing stops, the capture allocates into the
    region's pool with the region still open (its tag and cpu_backup apply), and the routing resumes
    after. Raises InvalidStateError outside a region or without a usable GPU backend.
    """
    if current_region() is None:
        raise InvalidStateError("capture_graph is only allowed inside `with april_ext.memory.region(tag):` "
                                "(the graph's memory goes to that region's tag)")
    if not torch_cuda.active():
        raise InvalidStateError("capture_graph needs a CUDA / ROCm device whose allocator backend is usable "
                                "(see april_ext.memory.backends())")
    with torch_cuda.capture_graph(graph, stream=stream, capture_error_mode=capture_error_mode):
        yield graph


def pause(tag: str | None = None) -> None:
    """Releases the physical memory of tag (every active tag when None), keeping its addresses.

    The devices of the tag finish their queued work first. Allocations made with cpu_backup=True
    are copied to host memory first. Raises InvalidStateError
    when the named tag is already paused, UnknownIdError for a tag never used, OutOfMemoryError when
    the host cannot hold the backups (then the tag stays active).
    """
    tag = _check_optional_tag(tag)
    _mem.pause(tag)


def resume(tag: str | None = None) -> None:
    """Maps fresh physical memory at the addresses of tag (every paused tag when None) and restores
    backups. Raises InvalidStateError when the named tag is active. On OutOfMemoryError the tag stays
    paused and unchanged: free memory and call resume again."""
    tag = _check_optional_tag(tag)
    _mem.resume(tag)


def stats() -> dict[str, TagStats]:
    """Usage statistics per tag, keyed by tag."""
    return {s["tag"]: TagStats(**s) for s in _mem.stats()}
