"""Allocator microbenchmarks on the CPU backend (pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_memory.py --benchmark-only -q

pause / resume latency per GiB with and without a CPU backup; the backup and restore copy bandwidth
as a ratio to a plain memcpy of the same bytes measured in the same run; the cost of an allocation
next to torch's default CPU allocator for the same sizes.
"""

from __future__ import annotations

import ctypes
import time
import uuid

import numpy as np
import pytest
import torch

import april_ext.memory as mem

MiB = 1 << 20
GiB = 1 << 30
SIZE = 256 * MiB


def _tensor(cpu_backup: bool) -> tuple[str, torch.Tensor]:
    tag = f"bench-{uuid.uuid4().hex[:8]}"
    t = mem.empty((SIZE,), torch.uint8, tag=tag, cpu_backup=cpu_backup)
    t.fill_(1)
    return tag, t


@pytest.mark.parametrize("cpu_backup", [False, True], ids=["no-backup", "backup"])
def test_pause_latency(benchmark, cpu_backup):
    tag, t = _tensor(cpu_backup)

    def setup():
        if mem.stats()[tag].paused:
            mem.resume(tag)

    benchmark.pedantic(mem.pause, args=(tag,), setup=setup, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["bytes"] = SIZE
    benchmark.extra_info["seconds_per_gib"] = benchmark.stats.stats.median * GiB / SIZE
    mem.resume(tag)
    del t


@pytest.mark.parametrize("cpu_backup", [False, True], ids=["no-backup", "backup"])
def test_resume_latency(benchmark, cpu_backup):
    tag, t = _tensor(cpu_backup)

    def setup():
        if not mem.stats()[tag].paused:
            mem.pause(tag)

    benchmark.pedantic(mem.resume, args=(tag,), setup=setup, rounds=5, iterations=1, warmup_rounds=1)
    benchmark.extra_info["bytes"] = SIZE
    benchmark.extra_info["seconds_per_gib"] = benchmark.stats.stats.median * GiB / SIZE
    del t


def _memcpy_seconds(dst: np.ndarray, src: np.ndarray) -> float:
    start = time.perf_counter()
    ctypes.memmove(dst.ctypes.data, src.ctypes.data, src.nbytes)
    return time.perf_counter() - start


@pytest.mark.parametrize("cache", [False, True], ids=["fresh-backup", "cached-backup"])
def test_backup_copy_bandwidth_vs_memcpy(benchmark, cache):
    """Backup (device -> host buffer) and restore (host -> device) copy bandwidth, each over a plain
    single memcpy of the same bytes, interleaved in the same run. Without the backup cache the
    backup's destination is freshly mapped host memory, so it is compared both with a memcpy into an
    already-touched buffer (warm) and with one into a fresh buffer (the same first-touch cost); with
    the cache the buffer of the previous cycle is reused."""
    tag, t = _tensor(cpu_backup=True)
    mem.set_backup_cache_limit(SIZE if cache else 0)
    src = np.ones(SIZE, np.uint8)
    warm = np.zeros(SIZE, np.uint8)
    backup, restore, memcpy_warm, memcpy_fresh = [], [], [], []

    def cycle():
        mem.pause(tag)
        mem.resume(tag)
        s = mem.stats()[tag]
        backup.append(s.last_pause_copy_seconds)
        restore.append(s.last_resume_copy_seconds)
        memcpy_warm.append(_memcpy_seconds(warm, src))
        fresh = np.empty(SIZE, np.uint8)
        memcpy_fresh.append(_memcpy_seconds(fresh, src))
        del fresh

    benchmark.pedantic(cycle, rounds=5, iterations=1, warmup_rounds=1)
    med = lambda xs: float(np.median(xs))  # noqa: E731
    info = benchmark.extra_info
    info["backup_gbps"] = SIZE / med(backup) / 1e9
    info["restore_gbps"] = SIZE / med(restore) / 1e9
    info["memcpy_warm_gbps"] = SIZE / med(memcpy_warm) / 1e9
    info["memcpy_fresh_gbps"] = SIZE / med(memcpy_fresh) / 1e9
    info["backup_over_memcpy_warm"] = med(memcpy_warm) / med(backup)
    info["backup_over_memcpy_fresh"] = med(memcpy_fresh) / med(backup)
    info["restore_over_memcpy_warm"] = med(memcpy_warm) / med(restore)
    print({k: round(v, 3) for k, v in info.items()})
    mem.set_backup_cache_limit(0)
    del t


@pytest.mark.parametrize("nbytes", [4096, MiB, 64 * MiB], ids=["4KiB", "1MiB", "64MiB"])
@pytest.mark.parametrize("allocator", ["april", "torch"])
def test_allocation_cost(benchmark, allocator, nbytes):
    """Allocate and drop one tensor: the allocator's VMM path next to torch.empty."""
    tag = f"bench-alloc-{uuid.uuid4().hex[:8]}"
    if allocator == "april":
        benchmark(lambda: mem.empty((nbytes,), torch.uint8, tag=tag))
    else:
        benchmark(lambda: torch.empty((nbytes,), dtype=torch.uint8))
    benchmark.extra_info["bytes"] = nbytes
