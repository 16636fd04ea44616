"""``april-ext bench``: the pytest-benchmark microbenchmarks of bench/ (kernels, allocator, scheduler, ...).

The benchmarks live in the source tree's bench/ folder, not in the installed package: this command finds
that folder beside an editable install (or takes ``--bench-dir``) and runs the chosen suites through
pytest in a subprocess, so that a suite's own environment (TRITON_INTERPRET, torch threads) stays its own.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from april_ext.errors import ConfigError

SUITES: dict[str, str] = {
    "scheduler": "bench_scheduler.py",
    "allocator": "bench_memory.py",
    "kernels": "bench_kernels.py",
    "engine": "bench_engine.py",
    "rollout": "bench_rollout.py",
    "training": "bench_training.py",
    "sglang": "bench_sglang.py",
    "megatron": "bench_megatron_trainer.py",
}
"""Each suite's file in bench/. The kernel suite runs on a GPU only (it skips on a CPU)."""

DEFAULT_SUITES = ("scheduler", "allocator", "kernels")


def bench_dir(given: str | None) -> Path:
    """The bench/ folder: ``given``, else the one beside the package's source tree."""
    if given is not None:
        path = Path(given)
        if not (path / SUITES["scheduler"]).is_file():
            raise ConfigError(f"--bench-dir {given}: not april_ext's bench/ folder (no {SUITES['scheduler']} in it)")
        return path
    path = Path(__file__).resolve().parents[2] / "bench"
    if not (path / SUITES["scheduler"]).is_file():
        raise ConfigError(f"no bench/ folder beside the installed package ({path.parent}): the benchmarks ship "
                          "with the source tree; run from an editable install (pip install -e .) or pass "
                          "--bench-dir PATH/TO/april_ext/bench")
    return path


def command(suites: list[str], directory: Path, pytest_args: list[str]) -> list[str]:
    """The pytest command line that runs ``suites`` from ``directory``."""
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ConfigError(f"april-ext bench {' '.join(unknown)}: unknown suite; allowed: {', '.join(SUITES)}")
    files = [str(directory / SUITES[s]) for s in suites]
    # -p no:cacheprovider: the source tree stays as it was; -s: suites print their own tables.
    return [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-s", "--rootdir", str(directory),
            *files, *pytest_args]


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("pytest_benchmark") is None:
        raise ConfigError("april-ext bench needs pytest-benchmark: pip install 'april_ext[bench]'")
    suites = list(args.suites) or list(DEFAULT_SUITES)
    argv = command(suites, bench_dir(args.bench_dir), shlex.split(args.pytest_args))
    print(" ".join(argv), flush=True)
    return subprocess.run(argv, env=dict(os.environ)).returncode


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "bench", help="run the pytest-benchmark microbenchmarks (scheduler, allocator, kernels, ...)",
        description="Runs bench/'s pytest-benchmark suites. Suites: " + ", ".join(
            f"{name} ({file})" for name, file in SUITES.items())
        + f". Default: {' '.join(DEFAULT_SUITES)}. Exits with pytest's status.")
    parser.add_argument("suites", nargs="*", metavar="SUITE", help="suites to run (default: %(default)s)")
    parser.add_argument("--bench-dir", default=None,
                        help="the source tree's bench/ folder (default: the one beside an editable install)")
    parser.add_argument("--pytest-args", default="",
                        help="more pytest arguments, one string: --pytest-args='-k token_events "
                             "--benchmark-json out.json'")
    parser.set_defaults(func=run)
    return parser
