"""Servers and routers a run launches end with the run's process, even when a SIGKILL of its process group
cannot reach them (they run in sessions of their own): april_ext.sglang.parent_watch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from april_ext.model import save_pretrained
from april_ext.sglang import parent_watch
from _engine_utils import tiny_model

pytestmark = pytest.mark.skipif(not parent_watch.supported(), reason="the parent-death signal is Linux's")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (not yet reaped by init) has exited too.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ", 1)[1][0] != "Z"


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _kill_group_after_line(script: str, timeout_s: float = 120.0) -> int:
    """Runs ``script`` in a process group of its own, reads the pid it prints, SIGKILLs the group; returns it."""
    runner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + timeout_s
        line = ""
        while not line.strip().isdigit():
            assert time.monotonic() < deadline and runner.poll() is None, runner.stderr.read()
            line = runner.stdout.readline()
        os.killpg(runner.pid, signal.SIGKILL)
        runner.wait(30)
        return int(line)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait(30)


def test_a_watched_command_ends_when_its_parent_is_killed():
    child = _kill_group_after_line(textwrap.dedent(f"""
        import subprocess, sys, os
        from april_ext.sglang import parent_watch
        argv = parent_watch.watched(os.getpid(), [sys.executable, "-c", "import time; time.sleep(600)"])
        p = subprocess.Popen(argv, start_new_session=True)
        print(p.pid, flush=True)
        p.wait()
    """))
    try:
        assert _wait_gone(child, 30), "the watched process outlived its parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_watch_refuses_to_start_once_its_parent_is_gone():
    """The race it closes: a parent that died before the signal was armed."""
    out = subprocess.run(parent_watch.watched(1, [sys.executable, "-c", "print('started')"]),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "started" not in out.stdout and "is gone" in out.stderr


def test_a_launched_server_does_not_outlive_a_sigkill_of_the_runs_process_group(tmp_path):
    save_pretrained(tiny_model(), tmp_path / "ckpt")
    server = _kill_group_after_line(textwrap.dedent(f"""
        import time
        from april_ext.sglang import SGLangServerArgs, launch_sglang_server
        args = SGLangServerArgs(model_path={str(tmp_path / "ckpt")!r},
                                extra_args=("--num-blocks", "64", "--block-size", "4"))
        server = launch_sglang_server(args, module="april_ext.server", env={{"OMP_NUM_THREADS": "1"}},
                                      timeout_s=120)
        print(server.process.pid, flush=True)
        time.sleep(600)
    """))
    try:
        assert _wait_gone(server, 60), "the launched server outlived the run's SIGKILL"
    finally:
        if _alive(server):
            os.killpg(server, signal.SIGKILL)
