"""ServerHost: what runs inside one rollout engine actor: a server process it owns, the embedded engine's
(``python -m april_ext.server``, ``april-ext serve``) or SGLang's, started with the launcher of
april_ext.sglang and stopped with the actor.

The launcher puts the server in a session of its own, so it outlives an actor that is killed. The
server's pid is kept in a file per engine; a restarted actor ends the server of its previous life
before it starts a new one. ``address`` is the driver's liveness check: it answers (actor pid, server
url), and ends the actor when its server has died, so that Ray restarts both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal

from april_ext.cluster.network import RunNetwork
from april_ext.cluster.process_memory import rss_bytes
from april_ext.persistence import atomic_write_text
from april_ext.sglang import SGLangServerArgs, launch_sglang_server


def _end_previous_server(pid_file: str, module: str) -> None:
    """Kills the server process group recorded in ``pid_file`` if it still runs ``module``."""
    try:
        with open(pid_file, encoding="ascii") as handle:
            pid = int(handle.read().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            running = module.encode() in handle.read().split(b"\0")
    except (OSError, ValueError):
        return
    if running:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


class ServerHost:
    def __init__(self, index: int, module: str, args: SGLangServerArgs, run_dir: str, launch_timeout_s: float,
                 network: RunNetwork) -> None:
        os.makedirs(run_dir, exist_ok=True)
        self.index = index
        self.pid_file = os.path.join(run_dir, f"engine_{index}.pid")
        _end_previous_server(self.pid_file, module)
        # Loopback on a cluster of one node; else this node's address, which the driver's node reaches.
        args = dataclasses.replace(args, host=network.node_address(), api_key=network.api_key)
        self.server = launch_sglang_server(args, module=module, timeout_s=launch_timeout_s, env=network.gloo_env(),
                                           log_path=os.path.join(run_dir, f"engine_{index}.{os.getpid()}.log"))
        atomic_write_text(self.pid_file, str(self.server.process.pid))

    def address(self) -> tuple[int, str]:
        """(this actor's pid, the server's url); a dead server ends the actor (Ray restarts it)."""
        if self.server.process.poll() is not None:
            os._exit(1)
        return os.getpid(), self.server.url

    def server_pid(self) -> int:
        return self.server.process.pid

    def rss_bytes(self) -> int:
        """The server process's resident memory."""
        return rss_bytes(self.server.process.pid)

    def stop(self) -> None:
        self.server.stop()
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.pid_file)


__all__ = ["ServerHost"]
