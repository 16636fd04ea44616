"""april_ext.cluster: a training run on Ray (TrainConfig.ray; docs/scaling.md).

The driver keeps the scheduler, the rollout loop, the data and the rewards; Ray runs the rest:

- topology: who runs where, from slime's flags (actor_num_nodes, actor_num_gpus_per_node, rollout_num_gpus,
  rollout_num_gpus_per_engine, num_gpus_per_node, colocate), on GPUs or CPUs;
- session: the cluster (joined or local) and one placement group per role;
- trainer_actor / trainer_ranks / trainer_group: one actor per trainer rank in one process group, the calls to
  them, and the Trainer over them;
- server_host / server_pool / router / membership: one actor per engine owning its server, behind
  sglang-router or routed to by the driver's least-loaded pick (ray_routing), restarted by Ray and given the
  current weights before it rejoins;
- rank_export: the trainer group's weights in the forms april_ext.weights sends (posted or broadcast by the
  ranks; disk through the driver); ray_engine: the RolloutEngine over the engines, which sends them;
  topology_run: the factories TrainingRun builds from.

Trainers and engines stay plain objects that an actor wraps; none of them imports Ray.
"""

from __future__ import annotations

from april_ext.cluster.errors import ClusterError
from april_ext.cluster.topology import Placement, Topology
from april_ext.cluster.topology_run import RayTopologyRun

__all__ = ["ClusterError", "Placement", "RayTopologyRun", "Topology"]
