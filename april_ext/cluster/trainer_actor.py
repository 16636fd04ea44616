"""TrainerRank: what runs inside one trainer actor. A plain object (Ray wraps it in trainer_ranks), so
the trainers it builds never import Ray.

Two phases, as a torchrun launch: every rank's actor is created, rank 0 names a rendezvous address
(its node and a free port), then every rank joins the process group at once (``setup``), with the
environment torchrun would give it (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so that
trainer.distributed's process-group setup, DDP and the Megatron trainer work unchanged. Ray gives each
actor its own GPU (CUDA_VISIBLE_DEVICES), hence LOCAL_RANK 0.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import os
from collections.abc import Iterator
from typing import Any

import torch

from april_ext.batch import TrainingBatch
from april_ext.cluster.network import RunNetwork
from april_ext.cluster.process_memory import rss_bytes
from april_ext.errors import InvalidStateError
from april_ext.protocol.trainer import StagedTrainer, Trainer
from april_ext.sglang.workers import workers_at
from april_ext.trainer import distributed
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import InitialWeights, build_trainer
from april_ext.weights import BucketMeta, WeightSender, buckets, post_tensors


class TrainerRank:
    def __init__(self, config: TrainConfig, rank: int, world_size: int, network: RunNetwork) -> None:
        self.config = config
        self.network = network
        self.rank = rank
        self.world_size = world_size
        self._stack = contextlib.ExitStack()
        self._trainer: Trainer | None = None
        self._export: Iterator[list[tuple[str, torch.Tensor]]] | None = None
        # Rank 0 of the engines' weight group (weight_sync="broadcast"; cluster.rank_export).
        self._sender = WeightSender(config.weight_sync_timeout_s)
        self._posted = 0  # bytes posted to the engines (weight_sync="tensor")

    def rendezvous(self) -> tuple[str, int]:
        """(this node's address, loopback on a cluster of one node; a free port there): where the other ranks
        (or a weight group's engines) meet this one."""
        from april_ext.sglang import free_port

        address = self.network.node_address()
        return address, free_port(address)

    def setup(self, master: tuple[str, int], initial: InitialWeights, memory_tag_prefix: str) -> int:
        """Joins the process group and builds the trainer (TrainConfig.trainer) from ``initial``: a model, or
        a checkpoint directory the trainer reads itself (a Megatron rank only its slice); returns this
        process's pid."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]), **self.network.gloo_env())
        config = self.config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        if self.world_size > 1:
            distributed.initialize(config.ray_timeout_s)
            self._stack.callback(distributed.shutdown)
        # The rank's own process trains (no child process, which would leave the data-parallel group).
        self._trainer = self._stack.enter_context(
            build_trainer(config, initial, memory_tag_prefix, beside_engine=False))
        return os.getpid()

    @property
    def trainer(self) -> Trainer:
        assert self._trainer is not None, "setup() builds the trainer"
        return self._trainer

    def version(self) -> int:
        return self.trainer.version

    def stage(self) -> tuple[int, int]:
        """(this rank's pipeline stage, the number of stages): (0, 1) for a trainer without stages."""
        trainer = self.trainer
        return trainer.pipeline_stage if isinstance(trainer, StagedTrainer) else (0, 1)

    def train_step(self, batch: TrainingBatch) -> tuple[dict[str, float], int]:
        # Arrays from the object store are read-only views of shared memory; the trainer gets its own.
        metrics = self.trainer.train_step(copy.deepcopy(batch))
        return metrics, self.trainer.version

    def begin_export(self, to_cpu: bool, send: bool, version: int | None = None, stage: bool = False) -> int | None:
        """Every rank exports (with model parallelism a collective, gathered while the export is read);
        ``stage``: only this rank's pipeline stage, with only the stage's ranks (StagedTrainer).
        ``send``: this rank's export is wanted, and ``next_bucket`` hands it out (returns its version);
        otherwise this rank reads it to the end here, taking part in the gather, and keeps nothing.
        ``to_cpu``: host copies (what goes through the object store), else the trainer's own tensors
        (rank 0's broadcast reads them where they are, before any other call of this rank).
        ``version``: the weights must be that version (a rank's calls run one at a time, so no train step
        comes between this check and the export)."""
        self._check_version(version)
        trainer = self.trainer
        weights = (trainer.export_stage_weights(to_cpu=to_cpu) if stage and isinstance(trainer, StagedTrainer)
                   else trainer.export_weights(to_cpu=to_cpu))
        if not send:
            collections.deque(weights, maxlen=0)
            return None
        self._export = buckets(weights, int(self.config.weight_sync_bucket_mb * 2**20))
        return weights.version

    def next_bucket(self) -> list[tuple[str, torch.Tensor]] | None:
        """The next bucket (up to weight_sync_bucket_mb) of the export ``begin_export`` began; None after the
        last."""
        if self._export is None:
            raise InvalidStateError("next_bucket: no export is being read (begin_export first)")
        bucket = next(self._export, None)
        if bucket is None:
            self._export = None
        return bucket

    def _check_version(self, version: int | None) -> None:
        if version is not None and version != self.trainer.version:
            raise InvalidStateError(f"the trainer holds the weights of version {self.trainer.version}, not {version}: "
                                    "they cannot be sent as that version (the next update brings them)")

    def next_bucket_held(self) -> BucketMeta | None:
        """weight_sync="broadcast": the next bucket of the export stays here, held for ``weight_send``; the
        driver gets its names, dtypes and shapes (None after the last)."""
        bucket = self.next_bucket()
        return None if bucket is None else self._sender.hold(bucket)

    def end_export(self) -> None:
        """Reads the rest of an export begun here (an update that failed midway), so the other ranks' part
        of the gather ends too; drops a held bucket."""
        if self._export is not None:
            collections.deque(self._export, maxlen=0)
            self._export = None
        self._sender.drop()

    def weight_endpoint(self) -> tuple[str, int]:
        """(this node's address, a free port) for a weight group's rendezvous hosted here."""
        return self.rendezvous()

    def weight_join(self, address: str, port: int, world_size: int, name: str, backend: str) -> None:
        self._sender.join(address, port, world_size, name, backend)

    def weight_send(self, name: str) -> None:
        self._sender.send(name)

    def weight_leave(self, name: str) -> None:
        self._sender.leave(name)

    def post_tensors(self, urls: list[str], version: int, flush_cache: bool) -> list[str]:
        """weight_sync="tensor": posts this rank's export, which must be ``version``, to ``urls``
        (/update_weights_from_tensor per bucket of weight_sync_bucket_mb, one bucket held at a time); the names."""
        self._check_version(version)
        weights = self.trainer.export_weights()

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                self._posted += tensor.numel() * tensor.element_size()
                yield name, tensor

        bucket_bytes = int(self.config.weight_sync_bucket_mb * 2**20)

        async def post() -> list[str]:
            async with workers_at(urls, self.network.api_key) as workers:
                return await post_tensors(workers, counted(), weights.version, bucket_bytes, flush_cache)

        return asyncio.run(post())

    def weight_bytes_sent(self) -> int:
        """Bytes this rank has broadcast or posted to the engines."""
        return self._sender.bytes_sent + self._posted

    def save_checkpoint(self, path: str, extra: dict[str, Any] | None) -> None:
        self.trainer.save_checkpoint(path, extra)

    def load_checkpoint(self, path: str) -> tuple[dict[str, Any], int]:
        extra = self.trainer.load_checkpoint(path)
        return extra, self.trainer.version

    def offload(self) -> None:
        self.trainer.offload()

    def onload(self) -> None:
        self.trainer.onload()

    def rss_bytes(self) -> int:
        return rss_bytes(os.getpid())

    def close(self) -> None:
        self._stack.close()


__all__ = ["TrainerRank"]
