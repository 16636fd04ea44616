"""GPU allocator report: run on a CUDA / ROCm machine, writes a JSON report.

    python bench/gpu_memory_report.py --out gpu_memory_report.json [--sizes-gib 1 4] [--rounds 3]

Per size: device memory freed by pause (torch.cuda.mem_get_info), pause / resume latency with and
without a CPU backup, the backup / restore copy bandwidth next to torch's own device <-> host copies
of the same bytes (pageable and pinned) in the same run, and the allocation cost next to torch's
caching allocator on a cold cache (cudaMalloc). Also checks that a CUDA graph captured in a region
replays after a pause / resume. The report is written after each size and again with the graph
check's result (its error when it fails), so a failure or a timeout keeps what was measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
import traceback
import uuid
from collections.abc import Callable

import torch

import april_ext.memory as mem
from april_ext.persistence import atomic_write_json

GiB = 1 << 30


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def measure_size(nbytes: int, rounds: int) -> dict:
    out: dict = {"bytes": nbytes}
    for backup in (False, True):
        tag = f"report-{uuid.uuid4().hex[:8]}"
        t = mem.empty((nbytes,), torch.uint8, tag=tag, device="cuda", cpu_backup=backup)
        t.fill_(3)
        pause_s, resume_s, freed, copy_down, copy_up = [], [], [], [], []
        for _ in range(rounds):
            torch.cuda.synchronize()
            free_before, _ = torch.cuda.mem_get_info()
            pause_s.append(_timed(lambda: mem.pause(tag)))
            free_paused, _ = torch.cuda.mem_get_info()
            freed.append(free_paused - free_before)
            resume_s.append(_timed(lambda: mem.resume(tag)))
            s = mem.stats()[tag]
            if backup:
                copy_down.append(s.last_pause_copy_seconds)
                copy_up.append(s.last_resume_copy_seconds)
        key = "backup" if backup else "no_backup"
        out[key] = {
            "pause_seconds_per_gib": _median(pause_s) * GiB / nbytes,
            "resume_seconds_per_gib": _median(resume_s) * GiB / nbytes,
            "freed_fraction": _median([f / nbytes for f in freed]),
        }
        if backup:
            out[key]["backup_gbps"] = nbytes / _median(copy_down) / 1e9
            out[key]["restore_gbps"] = nbytes / _median(copy_up) / 1e9
            out[key]["contents_ok"] = bool((t[:: 1 << 20] == 3).all())
        del t
        torch.cuda.synchronize()

    src = torch.full((nbytes,), 3, dtype=torch.uint8, device="cuda")
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable.fill_(0)
    torch_copy = {}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        down = _median([_timed(lambda h=host: h.copy_(src)) for _ in range(rounds)])
        up = _median([_timed(lambda h=host: src.copy_(h)) for _ in range(rounds)])
        torch_copy[name] = {"d2h_gbps": nbytes / down / 1e9, "h2d_gbps": nbytes / up / 1e9}
    out["torch_copy"] = torch_copy
    out["backup_over_torch_pinned_d2h"] = out["backup"]["backup_gbps"] / torch_copy["pinned"]["d2h_gbps"]
    out["restore_over_torch_pinned_h2d"] = out["backup"]["restore_gbps"] / torch_copy["pinned"]["h2d_gbps"]
    out["backup_over_torch_pageable_d2h"] = out["backup"]["backup_gbps"] / torch_copy["pageable"]["d2h_gbps"]
    del src, pageable, pinned
    torch.cuda.empty_cache()

    # The allocation alone on both sides: each tensor is kept until its time is taken (a dropped
    # one would count our free and unmap in; torch's drop only returns the block to its cache).
    tag = f"report-alloc-{uuid.uuid4().hex[:8]}"
    held: list[torch.Tensor] = []
    ours = []
    for _ in range(rounds):
        ours.append(_timed(lambda: held.append(mem.empty((nbytes,), torch.uint8, tag=tag, device="cuda"))))
        held.clear()
    theirs = []
    for _ in range(rounds):
        torch.cuda.empty_cache()
        theirs.append(_timed(lambda: held.append(torch.empty((nbytes,), dtype=torch.uint8, device="cuda"))))
        held.clear()
    out["alloc_seconds"] = {"april": _median(ours), "torch_cold_cache": _median(theirs)}
    return out


def graph_check() -> dict:
    tag = f"report-graph-{uuid.uuid4().hex[:8]}"
    with mem.region(tag, cpu_backup=True):
        x = torch.randn(2048, 2048, device="cuda")
        w = torch.randn(2048, 2048, device="cuda")
        y = torch.empty(2048, 2048, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.matmul(x, w, out=y)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with mem.capture_graph(g):
            torch.matmul(x, w, out=y)
    g.replay()
    want = y.clone()
    mem.pause(tag)
    mem.resume(tag)
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    return {"graph_replay_after_resume_ok": bool(torch.equal(y, want))}


def write_report(path: str, report: dict, sizes: list[int], measure: Callable[[int], dict],
                 check: Callable[[], dict]) -> dict:
    """Fills report with measure(size) per size and then the graph check, writing it to path after
    each, so a failing check or a timeout keeps the sizes. A failing check is recorded as its error."""
    report["sizes"] = []
    for nbytes in sizes:
        report["sizes"].append(measure(nbytes))
        atomic_write_json(path, report, indent=2)
    try:
        report.update(check())
    except Exception as exc:  # noqa: BLE001 - recorded in the report, which keeps the sizes
        report["graph_replay_after_resume_ok"] = False
        report["graph_error"] = f"{type(exc).__name__}: {exc}"[:2000]
        report["graph_trace"] = traceback.format_exc()[-3000:]
    atomic_write_json(path, report, indent=2)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu_memory_report.json")
    parser.add_argument("--sizes-gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to report", file=sys.stderr)
        return 2
    report: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "backends": [dataclasses.asdict(b) for b in mem.backends()],
        "granularity": mem.granularity("cuda"),
    }
    write_report(args.out, report, [int(size * GiB) for size in args.sizes_gib],
                 lambda nbytes: measure_size(nbytes, args.rounds), graph_check)
    print(json.dumps(report, indent=2))
    return 0 if report["graph_replay_after_resume_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
