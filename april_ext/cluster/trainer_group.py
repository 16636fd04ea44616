"""TrainerGroup: the trainer of a Ray run, as one Trainer (april_ext.protocol) on the driver over one
actor per rank (trainer_ranks.TrainerRanks).

Every call goes to every rank (the trainers' methods are collectives: DDP's all-reduce, Megatron's
gathers, the rank-0 checkpoint write and its barrier) and rank 0's result is returned. Each call waits
at most ``ray_timeout_s``, so a rank that dies or stalls stops the run with a ClusterError naming it
instead of hanging it; the run's checkpoints are where ``--resume`` continues from.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

from april_ext.batch import TrainingBatch
from april_ext.cluster.session import RaySession
from april_ext.cluster.trainer_ranks import TrainerRanks
from april_ext.protocol.trainer import ExportedWeights
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import InitialWeights


class TrainerGroup:
    """The Trainer protocol over the rank actors (``ranks``), which run in ``session``."""

    def __init__(self, ranks: TrainerRanks, session: RaySession, version: int) -> None:
        self.ranks = ranks
        self.session = session
        self._version = version
        # Held by a train step, and by an export that must be of the version the trainer holds now (a rejoining
        # engine's, which runs beside the training of an asynchronous run): neither starts inside the other.
        self._still = threading.Lock()

    @property
    def actors(self) -> list[Any]:
        """``actors[r]`` is rank r's actor."""
        return self.ranks.actors

    @property
    def pids(self) -> list[int]:
        """``pids[r]`` is rank r's process."""
        return self.ranks.pids

    @property
    def version(self) -> int:
        return self._version

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        import ray

        with self._still:
            ref = ray.put(batch)  # one copy in the object store, read by every rank
            metrics, self._version = self.ranks.all("train_step", [a.train_step.remote(ref) for a in self.actors])[0]
        return metrics

    @contextlib.contextmanager
    def still(self) -> Iterator[bool]:
        """True when no train step runs now, and then none starts until the block ends (an export inside it is of
        the current version); False when one runs."""
        held = self._still.acquire(blocking=False)
        try:
            yield held
        finally:
            if held:
                self._still.release()

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        """Rank 0's export as a stream the driver pulls bucket by bucket (weight_sync_bucket_mb each) while every
        rank gathers it, so the driver and rank 0 hold about one bucket at a time. Nothing is exported until
        it is read. (The weight sync of weight_sync="broadcast" and "tensor" has the ranks send their export
        themselves instead: cluster.rank_export.)"""
        return ExportedWeights(self._version, self._reading(to_cpu))

    def _reading(self, to_cpu: bool) -> Iterator[tuple[str, Any]]:
        ranks = self.ranks
        ranks.finish_export()
        # Rank 0's buckets cross the object store: host copies.
        calls = [a.begin_export.remote(to_cpu or r == 0, r == 0) for r, a in enumerate(self.actors)]
        ranks.wait("export_weights", calls[:1])
        pulled = self._pulling(calls)
        ranks.export_begun(lambda: collections.deque(pulled, maxlen=0))
        yield from pulled

    def _pulling(self, calls: list[Any]) -> Iterator[tuple[str, Any]]:
        ranks = self.ranks
        while True:
            calls[0] = self.actors[0].next_bucket.remote()
            bucket = ranks.wait("export_weights", calls[:1])[0]
            if bucket is None:
                break
            yield from bucket
        ranks.export_ended()
        ranks.wait("export_weights", calls)  # the other ranks' part of the gather ended too

    def weight_bytes_sent(self) -> int:
        """Bytes the ranks have broadcast or posted to the engines (each stage's first rank, or rank 0)."""
        return sum(self.ranks.all("weight_bytes_sent", [a.weight_bytes_sent.remote() for a in self.actors]))

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        self.ranks.all("save_checkpoint", [a.save_checkpoint.remote(os.fspath(path), extra) for a in self.actors])

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        extra, self._version = self.ranks.all("load_checkpoint",
                                         [a.load_checkpoint.remote(os.fspath(path)) for a in self.actors])[0]
        return extra

    def offload(self) -> None:
        self.ranks.all("offload", [a.offload.remote() for a in self.actors])

    def onload(self) -> None:
        self.ranks.all("onload", [a.onload.remote() for a in self.actors])

    def rss_bytes(self) -> list[int]:
        """Each rank's resident memory (colocated runs measure it)."""
        return self.ranks.all("rss_bytes", [a.rss_bytes.remote() for a in self.actors])


@contextlib.contextmanager
def start_trainer_group(session: RaySession, config: TrainConfig, initial: InitialWeights,
                        memory_tag_prefix: str) -> Iterator[TrainerGroup]:
    """The trainer ranks (TrainerRanks.start) as one Trainer, at the version their trainers hold; the ranks end
    on exit."""
    ranks = TrainerRanks.start(session, config, initial, memory_tag_prefix)
    try:
        yield TrainerGroup(ranks, session, ranks.all("version", [a.version.remote() for a in ranks.actors])[0])
    finally:
        ranks.close()


__all__ = ["TrainerGroup", "start_trainer_group"]
