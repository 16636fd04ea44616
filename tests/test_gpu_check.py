"""bench/gpu_check.sh and its helpers without a GPU: the script's steps run as stand-ins (a dry run)
so their order, limits and results files are checked; the process-group runner and the memory
report's write order run for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _procs import run_in_group  # noqa: E402

STEPS = ["env", "build", "quick", "gpu_tests", "memory_report", "async_run", "kernels_report"]
# At most 7 of a lent machine's 15 minutes of command time, so a rerun fits after its start.
BUDGET_S = 420


def dry_run(tmp_path: Path, fail: str = "") -> tuple[int, list[dict]]:
    env = {**os.environ, "OUT": str(tmp_path), "APRIL_GPU_CHECK_DRY_RUN": "1", "APRIL_GPU_CHECK_DRY_RUN_FAIL": fail}
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=120)
    rows = []
    for line in (tmp_path / "steps.tsv").read_text().splitlines():
        name, limit, rc, seconds, results = line.split("\t")
        rows.append({"name": name, "limit": int(limit), "rc": int(rc), "results": tmp_path / results})
    return proc.returncode, rows


def test_the_check_fits_the_budget_and_writes_each_steps_results_in_order(tmp_path):
    rc, rows = dry_run(tmp_path)
    assert rc == 0
    assert [r["name"] for r in rows] == STEPS  # the fast part (build, quick) before the slow ones
    assert sum(r["limit"] for r in rows) <= BUDGET_S
    written = []
    for r in rows:
        assert json.loads(r["results"].read_text())["step"] == r["name"]
        written.append(r["results"].stat().st_mtime_ns)
    assert written == sorted(written)


def test_steps_run_the_intended_commands(tmp_path):
    dry_run(tmp_path)
    command = {name: json.loads((tmp_path / res).read_text())["command"]
               for name, res in [("quick", "quick.json"), ("gpu_tests", "gpu_tests.xml")]}
    assert "bench/gpu_quick_check.py" in command["quick"]
    assert "pytest" in command["gpu_tests"]
    assert not {"-x", "--exitfirst"} & set(command["gpu_tests"]), "one failing GPU test must not hide the rest"


def test_a_failing_step_does_not_stop_the_steps_after_it(tmp_path):
    rc, rows = dry_run(tmp_path, fail="gpu_tests")
    assert rc != 0
    assert [r["name"] for r in rows] == STEPS
    assert [r["rc"] for r in rows] == [0, 0, 0, 1, 0, 0, 0]


def test_a_failing_build_ends_the_check(tmp_path):
    rc, rows = dry_run(tmp_path, fail="build")
    assert rc != 0
    assert [(r["name"], r["rc"]) for r in rows] == [("env", 0), ("build", 1)]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_timed_out_command_is_killed_with_its_children():
    """As pytest with xdist workers: the parent times out, its children must not live on."""
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(60)\n")
    start = time.monotonic()
    done = run_in_group([sys.executable, "-c", script], timeout_s=3)
    assert done.returncode is None and time.monotonic() - start < 30
    child = int(done.output.split()[0])
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_finished_command_returns_its_status_and_output():
    done = run_in_group([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout_s=30)
    assert done.returncode == 3 and done.output.strip() == "out"


def test_the_memory_report_is_written_before_the_graph_check_and_keeps_its_error(tmp_path):
    import gpu_memory_report

    path = tmp_path / "memory_report.json"

    def failing_check() -> dict:
        on_disk = json.loads(path.read_text())
        assert [s["bytes"] for s in on_disk["sizes"]] == [1, 2]  # every size is saved already
        raise RuntimeError("beginAllocateToPool: already recording to mempool_id")

    report = gpu_memory_report.write_report(str(path), {"device": "none"}, [1, 2], lambda n: {"bytes": n},
                                            failing_check)
    on_disk = json.loads(path.read_text())
    assert on_disk == report
    assert [s["bytes"] for s in on_disk["sizes"]] == [1, 2]
    assert on_disk["graph_replay_after_resume_ok"] is False
    assert "already recording" in on_disk["graph_error"]

    report = gpu_memory_report.write_report(str(path), {}, [1], lambda n: {"bytes": n},
                                            lambda: {"graph_replay_after_resume_ok": True})
    assert json.loads(path.read_text())["graph_replay_after_resume_ok"] is True and "graph_error" not in report

