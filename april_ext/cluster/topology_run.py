"""RayTopologyRun: the trainer and engine factories of a training run on Ray (TrainConfig.ray). TrainingRun
enters the trainer factory first: the Ray session (cluster and placement groups) and the trainer group in
it; then, after a resume, the engine factory, given that trainer group: the initial checkpoint, the engine
actors in the same session, the router unless ray_routing is "least_loaded", the driver's SGLang client and
the RayEngine over them, which sends the trainer group's weights (april_ext.weights, cluster.rank_export). It leaves them in the
reverse order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from april_ext.cluster.network import new_api_key
from april_ext.cluster.ray_engine import RayEngine
from april_ext.cluster.server_pool import ServerPool
from april_ext.cluster.session import RaySession
from april_ext.cluster.topology import Topology
from april_ext.cluster.trainer_group import TrainerGroup, start_trainer_group
from april_ext.errors import InvalidArgumentError
from april_ext.model import ModelConfig
from april_ext.protocol.rollout_engine import RolloutEngine
from april_ext.protocol.trainer import Trainer
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.training.config import TrainConfig
from april_ext.training.engines import sglang_dir, sglang_engine_config, write_hf_checkpoint
from april_ext.training.trainers import InitialWeights


class RayTopologyRun:
    """``trainer_factory`` / ``engine_factory`` for TrainingRun (see training.trainers / training.engines)."""

    def __init__(self, config: TrainConfig) -> None:
        self.topology = Topology.from_config(config)
        # The run's key (cluster.network), for its servers, its router and its clients; in memory only.
        self.api_key = new_api_key()

    def __repr__(self) -> str:
        return f"RayTopologyRun({self.topology!r})"

    def factories(self) -> dict[str, Any]:
        """TrainingRun's (and train()'s) factory keywords."""
        return {"trainer_factory": self.trainer_factory, "engine_factory": self.engine_factory}

    @contextlib.contextmanager
    def trainer_factory(self, config: TrainConfig, initial: InitialWeights, memory_tag_prefix: str) -> Iterator[Trainer]:
        with RaySession(config, self.topology, self.api_key) as session, \
                start_trainer_group(session, config, initial, memory_tag_prefix) as group:
            yield group

    @contextlib.asynccontextmanager
    async def engine_factory(self, config: TrainConfig, trainer: Trainer, model_config: ModelConfig,
                             memory_tag_prefix: str) -> AsyncIterator[RolloutEngine]:
        """Engines on a checkpoint of the trainer's current weights (after a resume, the checkpoint's),
        labelled with its version, in the trainer group's session. New weights reach them as weight_sync says
        (april_ext.weights): by default written to the weight-sync directory (sglang_weight_sync_dir, which
        every node must see) and loaded from disk, or broadcast or posted by the trainer ranks. Requests go
        through the router or straight to the least loaded engine (ray_routing). Failover as in
        engine='sglang' (sglang_worker_timeout_s): a server that died or stopped answering gets no more
        requests, its requests return to the scheduler as partials."""
        if not isinstance(trainer, TrainerGroup):
            raise InvalidArgumentError(f"RayTopologyRun.engine_factory takes the TrainerGroup its trainer_factory "
                                       f"built, got a {type(trainer).__name__}")
        initial = write_hf_checkpoint(trainer, model_config, os.path.join(sglang_dir(config), "initial_model"),
                                      shard_bytes=int(config.weight_sync_bucket_mb * 2**20))
        pool = await ServerPool.start(trainer.session, config, initial, trainer.version)
        try:
            async with SGLangEngine(client_config(config, pool, trainer.version)) as inner, \
                    RayEngine(inner, pool, trainer) as engine:
                yield engine
        finally:
            pool.stop()


def client_config(config: TrainConfig, pool: ServerPool, version: int) -> SGLangEngineConfig:
    """The driver's SGLang client of the pool's engines, labelled ``version`` at start: requests through the
    router, or (ray_routing "least_loaded") straight to the engine with the fewest KV tokens as each reports
    them; with the run's API key."""
    if config.ray_routing == "router":
        return sglang_engine_config(config, version, router_url=pool.router.url, api_key=pool.network.api_key)
    return sglang_engine_config(config, version, worker_urls=tuple(s.url for s in pool.slots),
                                api_key=pool.network.api_key)


__all__ = ["RayTopologyRun", "client_config"]
