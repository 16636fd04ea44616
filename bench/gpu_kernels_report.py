"""GPU report for the paged-attention kernels: correctness tests, then benchmarks, as one JSON file.

    python bench/gpu_kernels_report.py REPORT.json [--budget-s 480] [--shapes NAME,...] [--skip-tests]

Runs on a CUDA / ROCm machine from a plain checkout (april_ext need not be installed: the kernels are
imported from the source tree). Steps:
  1. environment (torch / triton versions, device, the block-size generation picked);
  2. tests/test_kernels.py under pytest with APRIL_EXT_GPU_TESTS=1 (compiled kernels, not the
     interpreter), in a subprocess, results parsed from its JUnit XML;
  3. for each benchmark shape: our kernel and each baseline (SDPA over gathered K/V, flex_attention,
     flash-attn when installed, the reference on small shapes): median time, TFLOP/s (and KV GB/s for
     decode), speed ratio, and the baseline's max abs difference from our output.
The JSON is rewritten after every step, so a run cut short still leaves what it measured. A failing
baseline is recorded with its error and does not stop the run. The budget skips the remaining
benchmarks once spent.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import _kernel_cases as kc  # noqa: E402  (makes april_ext importable from a plain checkout)
from _procs import run_in_group  # noqa: E402
from april_ext.persistence import atomic_write_text  # noqa: E402

# The dense reference materializes the logits: only run it where they fit in a few GB.
REFERENCE_MAX_PAIRS = 64 * 2**20


class Report:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": []}

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, indent=2, default=str))

    def step(self, name: str) -> None:
        self.data["steps"].append({"step": name, "at": round(time.monotonic() - START, 1)})
        print(f"[{time.monotonic() - START:7.1f}s] {name}", flush=True)
        self.save()


START = time.monotonic()


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_available": torch.cuda.is_available(),
        "hip": getattr(torch.version, "hip", None),
        "cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                   memory_gib=round(props.total_memory / 2**30, 1),
                   generation=kc.tk.generation(torch.device("cuda", 0)))
    for package in ("flash_attn", "flashinfer"):
        try:
            env[package] = importlib.import_module(package).__version__
        except Exception as exc:  # noqa: BLE001 (a broken install must not stop the report)
            env[package] = None if isinstance(exc, ImportError) else f"broken: {type(exc).__name__}: {exc}"[:300]
    return env


def run_tests(timeout_s: int) -> dict:
    """tests/test_kernels.py on the GPU (compiled kernels), in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "junit.xml"
        # Compiling the many kernel variants dominates: spread the tests over processes when xdist is there.
        parallel = ["-n", "8"] if importlib.util.find_spec("xdist") is not None else []
        # tests/conftest.py maps the source tree when april_ext is not installed (APRIL_EXT_GPU_TESTS=1).
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *parallel, "--junitxml",
               str(xml_path), "tests/test_kernels.py"]
        env = {**os.environ, "APRIL_EXT_GPU_TESTS": "1"}
        env.pop("TRITON_INTERPRET", None)
        started = time.monotonic()
        # In a process group of its own: a timeout kills pytest's xdist workers too.
        proc = run_in_group(cmd, timeout_s, cwd=ROOT, env=env)
        if proc.returncode is None:
            return {"error": f"timed out after {timeout_s} s", "output_tail": proc.output[-4000:]}
        result: dict = {"exit_code": proc.returncode, "seconds": round(time.monotonic() - started, 1),
                        "output_tail": proc.output[-4000:]}
        if xml_path.exists():
            suite = ET.parse(xml_path).getroot()
            suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
            result.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
            result["failed"] = [
                {"test": case.get("name"), "message": (child.get("message") or "")[:500]}
                for case in suite.iter("testcase") for child in case
                if child.tag in ("failure", "error")
            ]
        return result


def kernel_resources() -> list[dict]:
    """Registers / spills / shared memory of our compiled kernel variants (best effort: the cache layout
    of JITFunction differs between Triton versions)."""
    from april_ext.triton_kernels import decode_attention as dec
    from april_ext.triton_kernels import extend_attention as ext
    from april_ext.triton_kernels import store_kv as st

    out = []
    for name, fn in (("extend", ext._extend_attention_kernel), ("decode_split", dec._decode_split_kernel),
                     ("decode_merge", dec._decode_merge_kernel), ("store_kv", st._store_kv_kernel)):
        caches = getattr(fn, "device_caches", None) or {}
        for entry in caches.values():
            cache = entry[0] if isinstance(entry, tuple) else entry
            for kernel in getattr(cache, "values", lambda: [])():
                try:
                    kernel._init_handles()
                except Exception:  # noqa: BLE001 - resources are informative only
                    pass
                out.append({"kernel": name, "registers": getattr(kernel, "n_regs", None),
                            "spills": getattr(kernel, "n_spills", None),
                            "shared": getattr(getattr(kernel, "metadata", None), "shared", None)})
    return out


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_one(fn, rep_ms: int) -> float:
    return float(do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))


def bench_shape(shape: kc.Shape, rep_ms: int, deadline: float, device: torch.device | None = None,
                entry: dict | None = None, save=lambda: None) -> dict:
    """Measures one shape into `entry` (a dict already in the report), calling save() after each variant."""
    device = device or torch.device("cuda", 0)
    case = kc.make_case(shape, device)
    entry = entry if entry is not None else {}
    entry |= {"shape": {k: str(v) for k, v in vars(shape).items()}, "flops": case.flops(),
              "kv_bytes": case.kv_bytes(), "tokens": sum(case.new_lens), "results": {}}

    def record(name: str, fn, out_ref: torch.Tensor | None) -> torch.Tensor | None:
        if time.monotonic() > deadline:
            entry["results"][name] = {"skipped": "time budget spent"}
            return None
        t0 = time.monotonic()
        try:
            out = fn()
            _synchronize(device)
            ms = bench_one(fn, rep_ms)
            res = {"ms": ms, "tflops": case.flops() / ms / 1e9}
            if shape.kind == "decode":
                res["kv_gbps"] = case.kv_bytes() / ms / 1e6
            if out_ref is not None:
                res["max_abs_diff_vs_ours"] = (out.float() - out_ref.float()).abs().max().item()
        except Exception as exc:  # noqa: BLE001 - one failing baseline must not end the report
            res = {"error": f"{type(exc).__name__}: {str(exc)[:800]}", "trace": traceback.format_exc()[-1500:]}
            out = None
        res["wall_s"] = round(time.monotonic() - t0, 1)
        entry["results"][name] = res
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
        return out

    ours_out = record("ours", kc.ours(case), None)
    record("ours_checked", kc.ours(case, checked=True), ours_out)
    if shape.kind == "decode":
        entry["auto_splits"] = kc.auto_splits(case)
        for splits in (1, 4, 16):
            record(f"ours_splits{splits}", kc.ours(case, num_splits=splits), ours_out)
    else:
        paged256 = kc.make_case(shape, device, page_size=256)
        record("ours_page256", kc.ours(paged256), None)
        del paged256
    try:
        entry["results"]["gather_kv"] = {"ms": bench_one(kc.gather_time_fn(case), rep_ms)}
    except Exception as exc:  # noqa: BLE001
        entry["results"]["gather_kv"] = {"error": str(exc)[:500]}
    pairs = case.flops() / (4.0 * shape.q_heads * shape.head_dim)
    for name, make in kc.BASELINES.items():
        if name == "reference" and pairs * shape.q_heads > REFERENCE_MAX_PAIRS:
            entry["results"][name] = {"skipped": "too large for the dense reference"}
            continue
        try:
            fn = make(case)
        except ImportError as exc:
            entry["results"][name] = {"skipped": f"not installed: {exc}"}
            continue
        except Exception as exc:  # noqa: BLE001
            entry["results"][name] = {"error": f"setup {type(exc).__name__}: {str(exc)[:800]}",
                                      "trace": traceback.format_exc()[-1500:]}
            continue
        record(name, fn, ours_out)
        del fn
    ours_ms = entry["results"].get("ours", {}).get("ms")
    if ours_ms:
        entry["speedup_vs"] = {name: res["ms"] / ours_ms for name, res in entry["results"].items()
                               if isinstance(res, dict) and "ms" in res and name not in ("ours", "gather_kv")}
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=Path, help="where to write the JSON report")
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget for the whole run")
    parser.add_argument("--tests-timeout-s", type=int, default=300)
    parser.add_argument("--rep-ms", type=int, default=200, help="do_bench measuring time per variant")
    parser.add_argument("--shapes", default=",".join(kc.SHAPES), help="comma-separated shape names")
    parser.add_argument("--skip-tests", action="store_true")
    args = parser.parse_args()
    unknown = [s for s in args.shapes.split(",") if s not in kc.SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {unknown}; allowed: {', '.join(kc.SHAPES)}")

    report = Report(args.report)
    report.data["environment"] = environment()
    report.step("environment")
    if not torch.cuda.is_available():
        report.data["error"] = "no CUDA / ROCm device: nothing to measure"
        report.save()
        return 1
    if not args.skip_tests:
        report.data["tests"] = run_tests(args.tests_timeout_s)
        report.step("tests")
    deadline = START + args.budget_s
    report.data["benchmarks"] = []
    for name in args.shapes.split(","):
        if time.monotonic() > deadline:
            report.data["benchmarks"].append({"shape": name, "skipped": "time budget spent"})
            continue
        entry: dict = {"name": name}
        report.data["benchmarks"].append(entry)
        try:
            bench_shape(kc.SHAPES[name], args.rep_ms, deadline, entry=entry, save=report.save)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory on one shape; go on with the next
            entry.update(error=f"{type(exc).__name__}: {str(exc)[:800]}", trace=traceback.format_exc()[-1500:])
        torch.cuda.empty_cache()
        report.step(f"bench {name}")
    report.data["kernel_resources"] = kernel_resources()
    report.step("done")
    tests = report.data.get("tests", {})
    return 0 if not tests or (tests.get("failures", 1) == 0 and tests.get("errors", 1) == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
