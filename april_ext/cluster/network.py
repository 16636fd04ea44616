"""RunNetwork: where a Ray run's own sockets listen, and the key that guards its servers.

On a cluster of one node (every test and CI run, a single workstation) the engine servers, the router and
the trainer's rendezvous (its process group, the weight groups) bind loopback, so nothing of the run is
reachable from the network; on several nodes they bind the node's address, which the other nodes reach.
Either way every engine server and the launched router take one key per run (SGLang's --api-key), drawn
when the run starts and held in memory only: the driver's client, the trainer ranks that post weights and
the router send it, so a peer that reaches a port cannot drive the engines. Ray's own processes are not
the run's to bind: they listen on the node's address as Ray chooses.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

LOOPBACK = "127.0.0.1"


def new_api_key() -> str:
    """A run's key: 256 random bits, URL-safe (it travels in an Authorization header)."""
    return secrets.token_urlsafe(32)


@dataclass(frozen=True)
class RunNetwork:
    """``loopback``: the cluster has one node, so the run binds 127.0.0.1; ``api_key``: the run's key."""

    loopback: bool
    api_key: str = field(default_factory=new_api_key, repr=False)

    def node_address(self) -> str:
        """The address this process's servers bind and announce: loopback, or this node's (in a Ray worker)."""
        if self.loopback:
            return LOOPBACK
        import ray

        return str(ray.util.get_node_ip_address())

    def gloo_env(self) -> dict[str, str]:
        """The environment of a process in a gloo group of the run: on one node its connections use loopback."""
        return {"GLOO_SOCKET_IFNAME": "lo"} if self.loopback else {}


__all__ = ["LOOPBACK", "RunNetwork", "new_api_key"]
