"""Subprocesses of the GPU check scripts. A child runs in a process group of its own, and the whole
group is killed when it times out or returns: a timed-out pytest's xdist workers must not keep the
GPU busy during the steps after it."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: killed at the timeout
    output: str  # stdout and stderr together


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone already


def run_in_group(cmd: list[str], timeout_s: float, **popen_kwargs) -> Finished:
    """Runs cmd with a timeout; on return or timeout, kills what is left of its process group."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **popen_kwargs)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return Finished(proc.returncode, out)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # a process that left the group still holds the pipe
            proc.kill()
            out = ""
        return Finished(None, out or "")
    finally:
        _kill_group(proc.pid)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
