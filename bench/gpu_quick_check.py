"""The fast first part of bench/gpu_check.sh, run before anything slow: which allocator backends
this build has and can use, an allocator smoke test on the GPU (pause frees memory, resume restores
it, a graph captured in a region replays after pause / resume) and one kernel correctness case on
the compiled kernels. Writes a JSON report after each part.

    python bench/gpu_quick_check.py OUT.json

Exit status 0 when every part passed; 1 when one failed (the GPU backend missing or unusable
included: a build that left it out must not pass as a run whose GPU tests all skipped).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import april_ext.memory as mem  # noqa: E402
from _procs import run_in_group  # noqa: E402
from april_ext.memory.devices import gpu_kind  # noqa: E402
from april_ext.persistence import atomic_write_json  # noqa: E402

MiB = 1 << 20
# One case of tests/test_kernels.py, on the compiled kernels: several sequences, shared pages.
KERNEL_CASE = "tests/test_kernels.py::test_extend_matches_one_sequence_at_a_time"
KERNEL_CASE_TIMEOUT_S = 30


def allocator_smoke() -> dict:
    tag = f"quick-{uuid.uuid4().hex[:8]}"
    n = 256 * MiB
    t = mem.empty((n,), torch.uint8, tag=tag, device="cuda", cpu_backup=True)
    t.fill_(5)
    torch.cuda.synchronize()
    free_before = mem.memory_info("cuda")[0]
    mem.pause(tag)
    freed = mem.memory_info("cuda")[0] - free_before
    mem.resume(tag)
    contents_ok = bool((t == 5).all())
    return {"ok": contents_ok and freed >= 0.9 * n, "freed_fraction": freed / n, "contents_ok": contents_ok}


def graph_smoke() -> dict:
    tag = f"quick-graph-{uuid.uuid4().hex[:8]}"
    with mem.region(tag, cpu_backup=True):
        x = torch.randn(256, 256, device="cuda")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            (x @ x).relu()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with mem.capture_graph(g):
            y = (x @ x).relu()
    g.replay()
    want = y.clone()
    mem.pause(tag)
    mem.resume(tag)
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    return {"ok": bool(torch.equal(y, want))}


def kernel_case() -> dict:
    env = {**os.environ, "APRIL_EXT_GPU_TESTS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = run_in_group([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", KERNEL_CASE],
                        KERNEL_CASE_TIMEOUT_S, cwd=ROOT, env=env)
    return {"ok": done.returncode == 0, "case": KERNEL_CASE, "exit_code": done.returncode,
            "output_tail": done.output[-2000:]}


def run_part(report: dict, name: str, part: Callable[[], dict], path: str) -> bool:
    start = time.monotonic()
    try:
        result = part()
    except Exception as exc:  # noqa: BLE001 - recorded; the next part still runs
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "trace": traceback.format_exc()[-3000:]}
    result["seconds"] = round(time.monotonic() - start, 1)
    report[name] = result
    atomic_write_json(path, report, indent=2)
    return bool(result["ok"])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    path = argv[0]
    backends = mem.backends()
    report: dict = {"torch": torch.__version__, "gpu_kind": gpu_kind(),
                    "backends": [dataclasses.asdict(b) for b in backends]}
    usable = any(b.name == gpu_kind() and b.usable for b in backends)
    report["gpu_backend_usable"] = usable and torch.cuda.is_available()
    atomic_write_json(path, report, indent=2)
    if not report["gpu_backend_usable"]:
        print(json.dumps(report, indent=2))
        return 1
    ok = run_part(report, "allocator", allocator_smoke, path)
    ok = run_part(report, "graph", graph_smoke, path) and ok
    ok = run_part(report, "kernel_case", kernel_case, path) and ok
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
