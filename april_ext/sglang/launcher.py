"""launch_sglang_server: starts `python -m sglang.launch_server` with the flags RL needs, waits for
/health, and stops the whole process group when the `with` block ends.

`module` replaces sglang.launch_server by any server module that takes the same flags, e.g.
"april_ext.server" (the embedded engine), which is how the launcher is tested without SGLang.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO

from april_ext.errors import ConfigError
from april_ext.sglang import parent_watch
from april_ext.sglang.errors import SGLangLaunchError


@dataclass(frozen=True)
class SGLangServerArgs:
    """The launch flags. port None picks a free port. enable_memory_saver allows releasing memory
    between rollouts (colocated RL); skip_tokenizer_init makes the server token-only;
    enable_weights_cpu_backup keeps a host copy of released weights. api_key: the server's --api-key (every
    call but /health then needs it as a Bearer token; never shown by repr or in an error). extra_args are
    appended as given."""

    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None
    tp: int = 1
    mem_fraction_static: float | None = None
    enable_memory_saver: bool = True
    skip_tokenizer_init: bool = True
    enable_weights_cpu_backup: bool = False
    extra_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ConfigError(f"SGLangServerArgs.model_path must be a non-empty string, got {self.model_path!r}")
        # Both travel as the value after a flag on the server's command line, where "-x" would read as a flag.
        if not isinstance(self.host, str) or not self.host or self.host.startswith("-"):
            raise ConfigError(f"SGLangServerArgs.host must be a non-empty string not starting with '-', "
                              f"got {self.host!r}")
        if self.port is not None and (not isinstance(self.port, int) or isinstance(self.port, bool)
                                      or not 1 <= self.port <= 65535):
            raise ConfigError(f"SGLangServerArgs.port must be None or an integer in [1, 65535], got {self.port!r}")
        if not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ConfigError(f"SGLangServerArgs.tp must be an integer >= 1, got {self.tp!r}")
        fraction = self.mem_fraction_static
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ConfigError(f"SGLangServerArgs.mem_fraction_static must be None or a number in (0, 1], "
                              f"got {fraction!r}")
        for name in ("enable_memory_saver", "skip_tokenizer_init", "enable_weights_cpu_backup"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SGLangServerArgs.{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.extra_args, str) or not isinstance(self.extra_args, Iterable):
            raise ConfigError(f"SGLangServerArgs.extra_args must be a sequence of arguments, got {self.extra_args!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isprintable() or " " in self.api_key
                                         or self.api_key.startswith("-")):
            raise ConfigError("SGLangServerArgs.api_key must be None or a non-empty string of printable characters "
                              "without spaces, not starting with '-' (it travels in an Authorization header and "
                              "on the server's command line)")
        object.__setattr__(self, "extra_args", tuple(str(a) for a in self.extra_args))

    def argv(self, port: int) -> list[str]:
        args = ["--model-path", self.model_path, "--host", self.host, "--port", str(port), "--tp", str(self.tp)]
        if self.mem_fraction_static is not None:
            args += ["--mem-fraction-static", str(self.mem_fraction_static)]
        for flag, on in (("--enable-memory-saver", self.enable_memory_saver),
                         ("--skip-tokenizer-init", self.skip_tokenizer_init),
                         ("--enable-weights-cpu-backup", self.enable_weights_cpu_backup)):
            if on:
                args.append(flag)
        if self.api_key is not None:
            args += ["--api-key", self.api_key]
        return args + list(self.extra_args)


def _redacted(command: list[str]) -> list[str]:
    """``command`` with the value of each --api-key hidden, for messages and logs."""
    return [("<hidden>" if i > 0 and command[i - 1] == "--api-key" else arg) for i, arg in enumerate(command)]


def _absolute(arg: str) -> str:
    """A relative path that exists in this directory, made absolute; anything else (flags, values, hub
    model ids) unchanged."""
    return os.path.abspath(arg) if not arg.startswith("-") and not os.path.isabs(arg) and os.path.exists(arg) \
        else arg


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (another process may still take it before the server binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class SGLangServerProcess:
    """A launched server: `url`, `process`, `log_path`. stop() (or leaving the `with` block) sends
    SIGTERM to its process group, then SIGKILL after `stop_timeout_s`."""

    def __init__(self, process: subprocess.Popen[bytes], url: str, log_path: str, log: IO[bytes],
                 stop_timeout_s: float = 30.0) -> None:
        self.process = process
        self.url = url
        self.log_path = log_path
        self._log = log
        self.stop_timeout_s = stop_timeout_s

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=timeout_s) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Polls /health until 200; raises SGLangLaunchError (with the log tail) if the process exits
        or the time runs out, after stopping it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise SGLangLaunchError(f"the server exited with code {self.process.returncode} before it was "
                                        f"healthy; log {self.log_path}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise SGLangLaunchError(f"the server at {self.url} was not healthy within {timeout_s} s; "
                                f"log {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, max_bytes: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(self.log_path) - max_bytes))
            return handle.read().decode(errors="replace")

    def stop(self) -> int:
        """Stops the server and its children; returns its exit code. Safe to call twice."""
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        if not self._log.closed:
            self._log.close()
        return int(self.process.returncode)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except ProcessLookupError:
            return

    def __enter__(self) -> SGLangServerProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def launch_sglang_server(args: SGLangServerArgs, *, module: str = "sglang.launch_server",
                         python: str = sys.executable, env: Mapping[str, str] | None = None,
                         timeout_s: float = 600.0, log_path: str | None = None) -> SGLangServerProcess:
    """Starts `python -m module <args>` in its own process group, waits until /health answers 200 and
    returns the running server (a context manager). The server ends with this process, even when it is
    killed (april_ext.sglang.parent_watch, on Linux). The output goes to log_path (default: server.log in
    the server's directory, kept for inspection).

    The server runs in a new temporary directory: `python -m` imports from its working directory first,
    so a source checkout there would shadow the installed packages. Relative paths that exist here
    (model_path, extra_args values, the interpreter) and PYTHONPATH entries are passed as absolute paths."""
    port = args.port if args.port is not None else free_port(args.host)
    workdir = tempfile.mkdtemp(prefix="sglang-server-")
    if log_path is None:
        log_path = os.path.join(workdir, "server.log")
    log = open(log_path, "wb")  # noqa: SIM115 - owned by the returned SGLangServerProcess
    args = dataclasses.replace(args, model_path=_absolute(args.model_path),
                               extra_args=tuple(_absolute(a) for a in args.extra_args))
    # Watched by this process: a SIGKILL of the run does not leave the server running (parent_watch).
    command = parent_watch.watched(os.getpid(), [_absolute(python), "-m", module, *args.argv(port)],
                                   python=_absolute(python))
    full_env = {**os.environ, **(env or {})}
    if full_env.get("PYTHONPATH"):  # entries relative to this directory keep meaning what they mean here
        full_env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p) for p in full_env["PYTHONPATH"].split(os.pathsep))
    try:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   env=full_env, start_new_session=True, cwd=workdir)
    except OSError as exc:
        log.close()
        raise SGLangLaunchError(f"could not start {_redacted(command)!r}: {exc}") from exc
    # A server bound to every interface is reached over loopback.
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]"}.get(args.host, args.host)
    host = host if ":" not in host or host.startswith("[") else f"[{host}]"
    server = SGLangServerProcess(process, f"http://{host}:{port}", log_path, log)
    server.wait_healthy(timeout_s)
    return server
