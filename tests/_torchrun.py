"""Launching a test worker under torchrun on loopback (gloo), with a timeout, and the check both
multi-process suites share: a rank that raises stops every rank, well within the launch timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def torchrun(worker: Path, nproc: int, timeout_s: float, *args: str) -> subprocess.CompletedProcess[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={port}", str(worker), *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)


def check_a_failing_rank_stops_every_rank(worker: Path, out: Path, timeout_s: float) -> None:
    """The worker's "raise" mode makes rank 1 raise: the launch must fail with its message, not hang."""
    start = time.monotonic()
    proc = torchrun(worker, 2, timeout_s, str(out), "raise")
    assert proc.returncode != 0
    assert "rank 1 failed on purpose" in proc.stderr
    assert time.monotonic() - start < timeout_s / 2
