"""SGLangEngineConfig: where the SGLang servers are and how the adapter talks to them."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from april_ext.errors import ConfigError
from april_ext.settings import MAX_GROUP_TIMEOUT_S

BALANCE = ("least_loaded", "round_robin")
WEIGHT_SYNC = ("disk", "tensor", "broadcast")


@dataclass(frozen=True)
class SGLangEngineConfig:
    """Where the servers are and how to talk to them.

    priority: send each request's SamplingParams.priority (the rollout loop's predicted remaining length when
    dispatch_order sorts by it) as SGLang's request priority; the servers must run with
    --enable-priority-scheduling (higher values first, SGLang's default; without the flag a server may refuse
    requests that carry one).
    worker_urls: SGLang servers; requests go to the least-loaded or round-robin. Least loaded: the fewest KV
    tokens as the server reports them (SGLang's /v1/loads, /get_load before; read every load_interval_s) plus
    the input tokens this client sent it since; ties, and without reports (load_interval_s None), the fewest
    requests in flight from this client. router_url instead: requests go to the router, and the workers it lists
    (GET /workers, or /list_workers on older routers) receive aborts, weight updates and memory calls.
    timeout_s bounds a control call and the silence between two events of a stream. retries with
    exponential backoff from backoff_s apply to connection failures of idempotent calls only.
    initial_weight_version: the version reported for a server's non-numeric label (SGLang's "default").
    abort_timeout_s: how long abort() waits for the aborted streams to end; abort_resend_s: interval at
    which the abort is re-sent meanwhile (an abort can overtake its request on another connection).
    max_connections: the client's connection pool size (0 = unlimited).
    stream: True streams /generate (a chunk per event, so the scheduler sees tokens as they come);
    False sends one non-streaming request per generate() and yields one chunk at its end (or its abort),
    which parses each response once instead of once per event (cumulative events cost O(L^2) for a
    response of L tokens). SGLang holds weight updates until the requests in flight end (unless they
    are aborted), so one response never spans two weight versions. timeout_s then bounds the whole response.
    worker_timeout_s: failover (failover.py). None: off, a dead server's stream raises and a stalled one
    stalls its callers until timeout_s. A number: a worker that refuses connections, or from which nothing
    came (no stream event, no /health answer) for this many seconds, is removed from the pool; the
    requests it was running end as ABORT with every token received (resumable elsewhere), and it rejoins
    once it answers again and holds the current weights. /health is probed every worker_timeout_s / 4.
    weight_sync: how update_weights moves named tensors (april_ext.weights.transport): "disk" writes them to
    weight_sync_dir (which it needs) and has every server load them with /update_weights_from_disk;
    "tensor" sends them in /update_weights_from_tensor requests; "broadcast" broadcasts them from this
    process to every server through a process group (/init_weights_update_group, then
    /update_weights_from_distributed per bucket of weight_bucket_mb MiB), every wait bounded by
    weight_sync_timeout_s; the servers reach this process at weight_sync_master_address (None: the
    address this machine reaches the first worker from). None: "disk" when weight_sync_dir is set, else
    "tensor".
    weight_sync_dir: a directory every server can read at the same path (shared file system).
    api_key: the key of servers (and a router) started with --api-key: sent as ``Authorization: Bearer
    <api_key>`` on every call; never shown by repr.
    """

    worker_urls: tuple[str, ...] = ()
    router_url: str | None = None
    balance: str = "least_loaded"
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    retries: int = 3
    backoff_s: float = 0.2
    initial_weight_version: int = 0
    abort_timeout_s: float = 60.0
    abort_resend_s: float = 0.5
    max_connections: int = 0
    weight_sync: str | None = None
    weight_sync_dir: str | None = None
    weight_bucket_mb: float = 64.0
    weight_sync_timeout_s: float = 60.0
    weight_sync_master_address: str | None = None
    stream: bool = True
    worker_timeout_s: float | None = None
    load_interval_s: float | None = 0.5
    priority: bool = False
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key
                                         or not self.api_key.isprintable() or " " in self.api_key):
            raise ConfigError("SGLangEngineConfig.api_key must be None or a non-empty string of printable "
                              "characters without spaces (it travels in an Authorization header)")
        if isinstance(self.worker_urls, str):
            raise ConfigError("SGLangEngineConfig.worker_urls must be a sequence of urls, not one string")
        if not isinstance(self.worker_urls, Iterable):
            raise ConfigError(f"SGLangEngineConfig.worker_urls must be a sequence of urls, got {self.worker_urls!r}")
        urls = tuple(_base_url(u, "worker_urls") for u in self.worker_urls)
        object.__setattr__(self, "worker_urls", urls)
        if self.router_url is not None:
            object.__setattr__(self, "router_url", _base_url(self.router_url, "router_url"))
        if bool(urls) == (self.router_url is not None):
            raise ConfigError("SGLangEngineConfig needs exactly one of worker_urls (non-empty) or router_url, "
                              f"got worker_urls={list(urls)} router_url={self.router_url!r}")
        if self.balance not in BALANCE:
            raise ConfigError(f"SGLangEngineConfig.balance must be one of {BALANCE}, got {self.balance!r}")
        for name in ("timeout_s", "connect_timeout_s", "abort_timeout_s", "abort_resend_s", "weight_bucket_mb",
                     "weight_sync_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_GROUP_TIMEOUT_S:
                raise ConfigError(f"SGLangEngineConfig.{name} must be a finite number > 0 (at most 6e8), got {value!r}")
        for name in ("retries", "max_connections", "initial_weight_version"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"SGLangEngineConfig.{name} must be an integer >= 0, got {value!r}")
        for name in ("stream", "priority"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SGLangEngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.weight_sync_dir is not None:
            if not isinstance(self.weight_sync_dir, (str, os.PathLike)) or not os.fspath(self.weight_sync_dir):
                raise ConfigError(f"SGLangEngineConfig.weight_sync_dir must be None or a directory path, "
                                  f"got {self.weight_sync_dir!r}")
            object.__setattr__(self, "weight_sync_dir", os.path.abspath(os.fspath(self.weight_sync_dir)))
        if self.worker_timeout_s is not None and (isinstance(self.worker_timeout_s, bool)
                                                  or not isinstance(self.worker_timeout_s, (int, float))
                                                  or not 0 < self.worker_timeout_s < float("inf")):
            raise ConfigError(f"SGLangEngineConfig.worker_timeout_s must be None (no failover) or a finite "
                              f"number of seconds > 0, got {self.worker_timeout_s!r}")
        if self.load_interval_s is not None and (isinstance(self.load_interval_s, bool) or not isinstance(
                self.load_interval_s, (int, float)) or not 0 < self.load_interval_s < float("inf")):
            raise ConfigError(f"SGLangEngineConfig.load_interval_s must be None (no load readings) or a finite "
                              f"number of seconds > 0, got {self.load_interval_s!r}")
        if self.weight_sync is None:
            object.__setattr__(self, "weight_sync", "tensor" if self.weight_sync_dir is None else "disk")
        if self.weight_sync not in WEIGHT_SYNC:
            raise ConfigError(f"SGLangEngineConfig.weight_sync must be one of {WEIGHT_SYNC} or None, "
                              f"got {self.weight_sync!r}")
        if self.weight_sync == "disk" and self.weight_sync_dir is None:
            raise ConfigError("SGLangEngineConfig.weight_sync='disk' needs weight_sync_dir (a directory every "
                              "server reads at the same path)")
        address = self.weight_sync_master_address
        if address is not None and (not isinstance(address, str) or not address):
            raise ConfigError(f"SGLangEngineConfig.weight_sync_master_address must be None or a host address, "
                              f"got {address!r}")
        if isinstance(self.backoff_s, bool) or not isinstance(self.backoff_s, (int, float)) \
                or not 0 <= self.backoff_s < float("inf"):
            raise ConfigError(f"SGLangEngineConfig.backoff_s must be a finite number >= 0, got {self.backoff_s!r}")


def _base_url(url: Any, name: str) -> str:
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"SGLangEngineConfig.{name}: {url!r} is not an http:// or https:// url")
    return url.rstrip("/")


__all__ = ["BALANCE", "WEIGHT_SYNC", "SGLangEngineConfig"]
