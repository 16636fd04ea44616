"""april-ext bench: runs bench/'s pytest-benchmark suites through pytest, in a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from april_ext.cli.bench import DEFAULT_SUITES, SUITES, bench_dir, command
from april_ext.errors import ConfigError

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "april_ext.cli", "bench", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_every_suite_is_a_file_of_bench():
    assert set(DEFAULT_SUITES) == {"scheduler", "allocator", "kernels"}
    for suite, name in SUITES.items():
        assert (BENCH / name).is_file(), suite


def test_runs_one_benchmark_and_passes_pytest_arguments(tmp_path):
    out = tmp_path / "bench.json"
    proc = _cli("scheduler", "--bench-dir", str(BENCH),
                f"--pytest-args=-k step_boundary --benchmark-min-rounds 2 --benchmark-json {out}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout
    names = [b["name"] for b in json.loads(out.read_text())["benchmarks"]]
    assert names == ["test_step_boundary"]


def test_pytest_failure_is_the_exit_status(tmp_path):
    proc = _cli("scheduler", "--bench-dir", str(BENCH), "--pytest-args=-k no_such_benchmark", cwd=tmp_path)
    assert proc.returncode == 5  # pytest: no tests collected


def test_bad_input_is_refused(tmp_path):
    proc = _cli("nope", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown suite; allowed: scheduler, allocator, kernels" in proc.stderr
    proc = _cli("--bench-dir", str(tmp_path), cwd=tmp_path)
    assert proc.returncode == 2 and "not april_ext's bench/ folder" in proc.stderr
    with pytest.raises(ConfigError, match="unknown suite"):
        command(["scheduler", "kernel"], BENCH, [])


def test_finds_the_source_tree_bench_folder():
    assert bench_dir(None) == BENCH
