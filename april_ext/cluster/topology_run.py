"""RayTopologyRun: the trainer and engine factories of a training run on Ray (TrainConfig.ray), sharing
one Ray session. TrainingRun enters the trainer factory first (the session: cluster and placement groups,
then the trainer actor group) and the engine factory second (the initial checkpoint, the engine actors,
the router unless ray_routing is "least_loaded", the RayEngine); it leaves them in the reverse order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

from april_ext.cluster.engine_pool import EnginePool
from april_ext.cluster.ray_engine import RayEngine
from april_ext.cluster.session import RaySession
from april_ext.cluster.topology import Topology
from april_ext.cluster.trainer_group import TrainerGroup, start_trainer_group
from april_ext.model import ModelConfig
from april_ext.protocol.rollout_engine import RolloutEngine
from april_ext.protocol.trainer import Trainer
from april_ext.sglang import SGLangEngine, SGLangEngineConfig
from april_ext.training.config import TrainConfig
from april_ext.training.engines import SGLANG_DIR, write_hf_checkpoint
from april_ext.training.trainers import InitialWeights


class RayTopologyRun:
    """``trainer_factory`` / ``engine_factory`` for TrainingRun (see training.trainers / training.engines)."""

    def __init__(self, config: TrainConfig) -> None:
        self.topology = Topology.from_config(config)
        self._session: RaySession | None = None
        self.trainer: TrainerGroup | None = None
        self.engine: RayEngine | None = None

    def factories(self) -> dict[str, Any]:
        """TrainingRun's (and train()'s) factory keywords."""
        return {"trainer_factory": self.trainer_factory, "engine_factory": self.engine_factory}

    @contextlib.contextmanager
    def trainer_factory(self, config: TrainConfig, initial: InitialWeights, memory_tag_prefix: str) -> Iterator[Trainer]:
        with RaySession(config, self.topology) as session:
            self._session = session
            try:
                with start_trainer_group(session, config, initial, memory_tag_prefix) as group:
                    self.trainer = group
                    yield group
            finally:
                self._session = self.trainer = None

    @contextlib.asynccontextmanager
    async def engine_factory(self, config: TrainConfig, trainer: Trainer, model_config: ModelConfig,
                             memory_tag_prefix: str) -> AsyncIterator[RolloutEngine]:
        """Engines on a checkpoint of the trainer's current weights (after a resume, the checkpoint's),
        labelled with its version. New weights reach them as in engine='sglang' (weight_sync): by default
        written to the weight-sync directory (sglang_weight_sync_dir, which every node must see) and loaded
        from disk, or broadcast by trainer rank 0 to every engine through a process group (rank_broadcast).
        Requests go through the router or straight to the least loaded engine (ray_routing). Failover as in
        engine='sglang' (sglang_worker_timeout_s): a server that died or stopped answering gets no more
        requests, its requests return to the scheduler as partials."""
        assert self._session is not None, "TrainingRun enters the trainer factory first"
        root = os.path.abspath(os.path.join(config.output_dir, SGLANG_DIR))
        initial = write_hf_checkpoint(trainer, model_config, os.path.join(root, "initial_model"),
                                      shard_bytes=int(config.weight_sync_bucket_mb * 2**20))
        pool = await EnginePool.start(self._session, config, initial, trainer.version)
        if self.topology.colocate and isinstance(trainer, TrainerGroup):
            # Engine i sits in trainer rank i's bundle (Topology.engine): that rank posts its weights to it.
            trainer.engine_owner = lambda url: next((s.index for s in pool.slots if s.url == url), None)
        try:
            async with SGLangEngine(client_config(config, pool, trainer.version, root)) as inner, \
                    RayEngine(inner, pool) as engine:
                self.engine = engine
                yield engine
        finally:
            self.engine = None
            pool.stop()


def client_config(config: TrainConfig, pool: EnginePool, version: int, root: str) -> SGLangEngineConfig:
    """The driver's SGLang client of the pool's engines, labelled ``version`` at start: requests through the
    router, or (ray_routing "least_loaded") straight to the engine with the fewest KV tokens as each reports
    them. The weight-sync directory defaults to ``<root>/weight_sync``."""
    routing: dict[str, Any] = ({"router_url": pool.router.url} if config.ray_routing == "router" else
                               {"worker_urls": tuple(s.url for s in pool.slots), "balance": "least_loaded"})
    return SGLangEngineConfig(**routing, initial_weight_version=version, weight_sync=config.weight_sync,
                              weight_bucket_mb=config.weight_sync_bucket_mb,
                              weight_sync_timeout_s=config.weight_sync_timeout_s,
                              weight_sync_dir=config.sglang_weight_sync_dir or os.path.join(root, "weight_sync"),
                              stream=config.sglang_stream, worker_timeout_s=config.sglang_worker_timeout_s,
                              priority=config.sglang_priority)


__all__ = ["RayTopologyRun", "client_config"]
