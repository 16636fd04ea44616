"""Router: the sglang-router (PyPI ``sglang-router``, a Rust binary that also runs on CPU) in front of a
run's engines, launched by the run on the driver or given by url.

Workers are listed, added and removed with its REST API (GET / POST /workers, DELETE /workers/{id});
it keeps a dead worker listed (unhealthy) until it is removed, which the engine pool does. Launched
here it checks its workers' health every second and gives up on a request after ``request_timeout_s``
(its defaults: 60 s and 30 min); its metrics endpoint binds loopback on a free port, so two runs on
one machine do not collide. With the run's ``api_key`` (cluster.network) it is launched with --api-key: it
refuses calls without the key and sends it to its workers; a worker registered here carries it too (POST
/workers takes a per-worker ``api_key``), so a router given by url reaches the run's engines as well.

Routing policy: ``cache_aware`` (the router's default, passed explicitly): a request goes to the worker whose
cached prefixes match it best, unless the workers' loads (requests the router has in flight on each) differ
by more than its thresholds, when it goes to the least loaded. A divided rollout's continuation (prompt +
the response so far, docs/strategies.md) thus returns to the engine holding its KV while the engines are
balanced; ``power_of_two`` or ``round_robin`` send it anywhere, to a re-prefill half of the time with two
engines (measured through sglang-router 0.3.2 on two embedded servers).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import IO, Any

from april_ext.cluster.errors import ClusterError
from april_ext.sglang import free_port, parent_watch

_HTTP_TIMEOUT_S = 10.0
POLICY = "cache_aware"
"""The router's routing policy (prefix affinity, least loaded past the imbalance thresholds; see above)."""


class Router:
    """A router at ``url``; ``process`` when this run launched it (``stop`` ends it). ``api_key``: the run's
    key, sent with every call and given to each worker registered."""

    def __init__(self, url: str, process: subprocess.Popen[bytes] | None = None, log: IO[bytes] | None = None,
                 log_path: str | None = None, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        self._api_key = api_key
        self.process = process
        self._log = log
        self.log_path = log_path

    @classmethod
    def launch(cls, worker_urls: list[str], log_path: str, timeout_s: float, request_timeout_s: float,
               api_key: str | None = None) -> Router:
        """Starts ``python -m sglang_router.launch_router`` on a free loopback port with ``worker_urls`` (and
        ``--api-key``) and waits until it lists every one of them as healthy."""
        port = free_port()
        command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
                   "--worker-urls", *worker_urls, "--policy", POLICY, "--log-level", "warn",
                   "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
                   "--health-check-timeout-secs", "2", "--worker-startup-check-interval", "1",
                   "--request-timeout-secs", str(max(1, int(request_timeout_s)))]
        if api_key is not None:
            command += ["--api-key", api_key]
        os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
        log = open(log_path, "wb")  # noqa: SIM115 - owned by the Router
        # Offline: it would look the workers' model path up on the model hub for a tokenizer it does not need.
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        # Ends with this process, even when it is killed (a session of its own escapes the group's SIGKILL).
        command = parent_watch.watched(os.getpid(), command)
        try:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       env=env, start_new_session=True)
        except OSError as err:
            log.close()
            raise ClusterError(f"could not start the sglang-router ({err}): pip install 'april_ext[ray]'") from None
        router = cls(f"http://127.0.0.1:{port}", process, log, log_path, api_key)
        try:
            router.wait_until(lambda workers: all(workers.get(u, {}).get("is_healthy") for u in worker_urls),
                              timeout_s, f"list {worker_urls} as healthy")
        except BaseException:
            router.stop()
            raise
        return router

    def _request(self, method: str, path: str, body: Any = None, missing_ok: bool = False) -> Any:
        """The router's JSON answer; ``missing_ok``: a 404 (what was asked for is gone) answers None."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=_HTTP_TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            if missing_ok and err.code == 404:
                return None
            raise ClusterError(f"sglang-router {method} {self.url}{path}: HTTP {err.code} "
                               f"{err.read()[:500].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError, ValueError) as err:
            raise ClusterError(f"sglang-router {method} {self.url}{path} failed: {err}") from None

    def workers(self) -> dict[str, dict[str, Any]]:
        """The listed workers by url: their records (``id``, ``is_healthy``, ...)."""
        answer = self._request("GET", "/workers")
        return {w["url"].rstrip("/"): w for w in answer.get("workers", []) if isinstance(w, dict) and "url" in w}

    def add(self, url: str) -> None:
        """Registers a worker, with the run's key (the router adds it in the background; see ``wait_until``)."""
        self._request("POST", "/workers", {"url": url} if self._api_key is None else {"url": url, "api_key": self._api_key})

    def remove(self, url: str, timeout_s: float) -> None:
        """Unregisters a worker, if listed (the engine pool's watch and a failed update's prune may both remove
        one: the second finds it gone), and waits until the router stops listing it (it removes in the
        background): calls that reach every listed worker must not include it once this returns."""
        record = self.workers().get(url.rstrip("/"))
        if record is not None:
            self._request("DELETE", f"/workers/{record['id']}", missing_ok=True)
        self.wait_until(lambda workers: url.rstrip("/") not in workers, timeout_s, f"stop listing {url}")

    def wait_until(self, condition: Any, timeout_s: float, what: str) -> None:
        """Polls the worker list until ``condition(workers())`` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise ClusterError(f"the sglang-router exited with code {self.process.returncode}; log "
                                   f"{self.log_path}:\n{self.log_tail()}")
            with contextlib.suppress(ClusterError):  # not answering yet
                if condition(self.workers()):
                    return
            if time.monotonic() > deadline:
                raise ClusterError(f"the sglang-router at {self.url} did not {what} within {timeout_s} s")
            time.sleep(0.2)

    def log_tail(self, max_bytes: int = 3000) -> str:
        if self.log_path is None:
            return ""
        if self._log is not None and not self._log.closed:
            self._log.flush()
        with open(self.log_path, "rb") as handle:
            handle.seek(max(0, os.path.getsize(self.log_path) - max_bytes))
            return handle.read().decode(errors="replace")

    def stop(self) -> None:
        """Ends a router this run launched (SIGTERM, then SIGKILL); a given one is left running."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        if self._log is not None and not self._log.closed:
            self._log.close()


__all__ = ["Router"]
