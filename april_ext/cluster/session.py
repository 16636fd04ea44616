"""RaySession: the Ray cluster of a run (joined, or started locally) and its placement groups.

The cluster is ``TrainConfig.ray_address``, else ``RAY_ADDRESS``, else a local one started here
(``ray.init(address="local")``, which never captures a cluster already running on the machine). A
process that called ``ray.init`` itself (a test's shared cluster) keeps its session: the run then only
adds its placement groups and actors, and removes them on exit.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from april_ext.cluster.errors import ClusterError
from april_ext.cluster.network import RunNetwork, new_api_key
from april_ext.cluster.topology import Placement, Topology
from april_ext.training.config import TrainConfig

logger = logging.getLogger(__name__)


class RaySession:
    """``with RaySession(config, topology) as session:`` the cluster is up, each role's placement group
    ready (``session.strategy(placement)`` places an actor); on exit the groups are removed and a
    cluster started here is shut down. ``network``: where the run's servers and rendezvous bind (loopback
    on a cluster of one node) and the run's API key (cluster.network)."""

    def __init__(self, config: TrainConfig, topology: Topology, api_key: str | None = None) -> None:
        self.config = config
        self._api_key = api_key or new_api_key()
        self.topology = topology
        self._groups: dict[str, Any] = {}
        self._started = False
        self.network: RunNetwork | None = None

    def __enter__(self) -> RaySession:
        try:
            import ray
        except ImportError as err:
            raise ClusterError(f"TrainConfig.ray needs Ray ({err}): pip install 'april_ext[ray]'") from None
        if not ray.is_initialized():
            self._init(ray)
        try:
            self.network = RunNetwork(sum(1 for node in ray.nodes() if node.get("Alive")) == 1, self._api_key)
            self._place(ray)
        except BaseException:
            self.close()
            raise
        return self

    def _init(self, ray: Any) -> None:
        address = self.config.ray_address or os.environ.get("RAY_ADDRESS") or "local"
        options: dict[str, Any] = {"address": address, "logging_level": logging.WARNING}
        if address == "local":
            # Logical CPUs: the topology's actors share the machine's cores, however few they are.
            needed = sum(b["CPU"] for role in ("trainer", "rollout") for b in self.topology.bundles(role))
            options.update(num_cpus=max(os.cpu_count() or 1, int(needed + 0.999)), include_dashboard=False)
            # Ray >= 2.5x writes an auth token under HOME for a new cluster unless told not to.
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(**options)
        self._started = True

    def _place(self, ray: Any) -> None:
        from ray.util.placement_group import placement_group

        for role in ("trainer", "rollout"):
            bundles = self.topology.bundles(role)
            if not bundles:
                continue
            group = placement_group(bundles, strategy="PACK")
            self._groups[role] = group
            try:
                ray.get(group.ready(), timeout=self.config.ray_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise ClusterError(
                    f"the {role} placement group ({len(bundles)} x {bundles[0]}) was not ready within "
                    f"ray_timeout_s={self.config.ray_timeout_s} s; the cluster has {ray.available_resources()} "
                    "free: give it more nodes or ask for fewer GPUs / CPUs") from None

    def strategy(self, placement: Placement) -> Any:
        """The scheduling strategy that puts an actor in its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self._groups[placement.role],
                                                placement_group_bundle_index=placement.bundle)

    def actor_options(self, placement: Placement) -> dict[str, Any]:
        return {"num_cpus": placement.num_cpus, "num_gpus": placement.num_gpus,
                "scheduling_strategy": self.strategy(placement)}

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for group in self._groups.values():
            remove_placement_group(group)
        self._groups.clear()
        if self._started:
            ray.shutdown()
            self._started = False

    def __exit__(self, *exc_info: object) -> None:
        self.close()


__all__ = ["RaySession"]
