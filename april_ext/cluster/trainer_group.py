"""TrainerGroup: the trainer of a Ray run, as one Trainer (april_ext.protocol) on the driver over one
actor per rank.

Every call goes to every rank (the trainers' methods are collectives: DDP's all-reduce, Megatron's
gathers, the rank-0 checkpoint write and its barrier) and rank 0's result is returned. Each call waits
at most ``ray_timeout_s``, also the ranks' process-group timeout, so a rank that dies or stalls stops
the run with a ClusterError naming it instead of hanging it; the run's checkpoints are where ``--resume``
continues from.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from april_ext.batch import TrainingBatch
from april_ext.cluster.errors import ClusterError
from april_ext.cluster.rank_broadcast import RankExport, RankHost, RankPoster, StageSource, rank_result
from april_ext.cluster.session import RaySession
from april_ext.cluster.trainer_actor import TrainerRank
from april_ext.errors import AprilError, InvalidStateError
from april_ext.sglang.broadcast import BucketMeta, StagedSource
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import InitialWeights

logger = logging.getLogger(__name__)

_RESUME = "the run stopped; continue it from its last checkpoint with --resume"
# Closing the ranks is a courtesy before they are killed: a rank stuck in a collective never answers.
_CLOSE_TIMEOUT_S = 10.0
# After a rank fails: how long the others may take to fail too (the actor of a killed rank is reported dead
# about 1-2 s after its process ends).
_FAILURE_GRACE_S = 5.0


class TrainerGroup:
    """The Trainer protocol over the rank actors (``actors[r]`` is rank r). ``pids[r]``: rank r's process.
    ``stages[s]``: the ranks of pipeline stage s, in order (one stage of every rank without pipeline
    parallelism); the first of each is the host of its stage's weight group."""

    def __init__(self, actors: list[Any], pids: list[int], version: int, timeout_s: float) -> None:
        self.actors = actors
        self.pids = pids
        self.timeout_s = timeout_s
        self._version = version
        # Ends an export the ranks are still in (see export_weights, begin_broadcast_export).
        self._open_export: Callable[[], None] | None = None
        self.stages: list[list[int]] = []
        self.weight_hosts: list[RankHost] = []
        self.set_stages([(0, 1)] * len(actors))
        # Colocated runs: the rank whose device an engine (by url) shares, which posts its weights to it.
        self.engine_owner: Callable[[str], int | None] | None = None

    def set_stages(self, stages: list[tuple[int, int]]) -> None:
        """The ranks' (pipeline stage, number of stages), in rank order: each stage's first rank hosts its
        weight group."""
        count = stages[0][1]
        self.stages = [[r for r, (stage, _) in enumerate(stages) if stage == s] for s in range(count)]
        self.weight_hosts = [RankHost(self.actors[ranks[0]], ranks[0]) for ranks in self.stages]

    @property
    def version(self) -> int:
        return self._version

    def _all(self, what: str, calls: list[Any]) -> list[Any]:
        """The results of one call per rank (``calls[r]`` is rank r's ObjectRef), in rank order, after an
        export left unread is read to the end (its ranks are busy in the gather until then). When a rank
        fails, the others get a few seconds to fail too (a rank that died makes the others' collectives fail
        at once), so that the error names the rank that died rather than one that lost it."""
        if self._open_export is not None:
            self._open_export()
        return self._wait(what, calls)

    def _wait(self, what: str, calls: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """As _all, without reading an open export first; ``calls[i]`` is rank ``ranks[i]``'s (rank i's
        without ``ranks``)."""
        import ray

        ranks = ranks if ranks is not None else list(range(len(calls)))
        pending = {ref: rank for rank, ref in zip(ranks, calls)}
        results: dict[int, Any] = {}
        failures: dict[int, Exception] = {}
        deadline = time.monotonic() + self.timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if failures:
                    break
                raise ClusterError(f"trainer ranks {sorted(pending.values())} did not finish {what} within "
                                   f"ray_timeout_s={self.timeout_s} s (stalled, or waiting for a dead rank); {_RESUME}")
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except ray.exceptions.RayError as err:
                if not failures:
                    deadline = min(deadline, time.monotonic() + _FAILURE_GRACE_S)
                failures[rank] = err
        if failures:
            raise self._failure(what, failures)
        return [results[r] for r in ranks]

    def _failure(self, what: str, failures: dict[int, Exception]) -> Exception:
        """The error of a failed call: a rank that died, else the first failing rank's error (an april_ext
        error as it was raised)."""
        import ray

        for rank in sorted(failures):
            if isinstance(failures[rank], ray.exceptions.RayActorError):
                return ClusterError(f"trainer rank {rank} (pid {self.pids[rank]}) died during {what} "
                                    f"({type(failures[rank]).__name__}); {_RESUME}")
        rank = min(failures)
        cause = getattr(failures[rank], "cause", failures[rank])
        if isinstance(cause, AprilError):
            return cause
        return ClusterError(f"trainer rank {rank} (pid {self.pids[rank]}) failed in {what}: "
                            f"{type(cause).__name__}: {cause}; {_RESUME}")

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        import ray

        ref = ray.put(batch)  # one copy in the object store, read by every rank
        metrics, self._version = self._all("train_step", [a.train_step.remote(ref) for a in self.actors])[0]
        return metrics

    def export_weights(self, *, to_cpu: bool = False) -> RankExport:
        """Rank 0's export, in three forms (RankExport): a stream the driver pulls bucket by bucket
        (weight_sync_bucket_mb each) while every rank gathers it, so the driver and rank 0 hold about one
        bucket at a time; or ``source``, broadcast by each pipeline stage's first rank itself, stage by stage
        (weight_sync="broadcast"); or ``poster``, posted by the ranks themselves (weight_sync="tensor": see
        post_tensors). Nothing is exported until one of them is read."""
        source = StagedSource(tuple(StageSource(self, host, s) for s, host in enumerate(self.weight_hosts)))
        return RankExport(self._version, self._reading(to_cpu), source, RankPoster(self))

    def _reading(self, to_cpu: bool) -> Iterator[tuple[str, Any]]:
        if self._open_export is not None:
            self._open_export()
        # Rank 0's buckets cross the object store: host copies.
        calls = [a.begin_export.remote(to_cpu or r == 0, r == 0) for r, a in enumerate(self.actors)]
        self._wait("export_weights", calls[:1])
        pulled = self._pulling(calls)
        self._open_export = lambda: collections.deque(pulled, maxlen=0)
        yield from pulled

    def _pulling(self, calls: list[Any]) -> Iterator[tuple[str, Any]]:
        while True:
            calls[0] = self.actors[0].next_bucket.remote()
            bucket = self._wait("export_weights", calls[:1])[0]
            if bucket is None:
                break
            yield from bucket
        self._open_export = None
        self._wait("export_weights", calls)  # the other ranks' part of the gather ended too

    async def begin_broadcast_export(self, version: int, stage: int = 0) -> None:
        """weight_sync="broadcast": the ranks of pipeline stage ``stage`` export their stage of the current
        weights (which must be ``version``), its first rank keeping its export for next_broadcast_bucket; the
        other stages' ranks take no part. An export still open (an update that failed midway) is read to its
        end first."""
        if self._open_export is not None:
            self._open_export()
        ranks = self.stages[stage]
        calls = [self.actors[r].begin_export.remote(False, r == ranks[0], version, True) for r in ranks]
        await rank_result(calls[0], "export_weights", ranks[0])

        def end() -> None:
            self._open_export = None
            self._wait("export_weights", [self.actors[ranks[0]].end_export.remote(), *calls[1:]], ranks)

        self._open_export = end

    async def next_broadcast_bucket(self, stage: int = 0) -> BucketMeta | None:
        """The next bucket of stage ``stage``'s export, held by its first rank for the broadcast: its names,
        dtypes and shapes, or None after the last (the stage's other ranks' part of the export has ended then)."""
        if self._open_export is None:
            raise InvalidStateError("next_broadcast_bucket: no export is open (begin_broadcast_export first)")
        first = self.stages[stage][0]
        meta = await rank_result(self.actors[first].next_bucket_held.remote(), "export_weights", first)
        if meta is None:
            self._open_export()
        return meta

    async def post_tensors(self, urls: list[str], version: int, flush_cache: bool) -> list[str]:
        """weight_sync="tensor": the current weights (which must be ``version``) posted to ``urls``,
        /update_weights_from_tensor per bucket: each engine's by the rank that shares its device (engine_owner,
        colocated runs: all ranks at once, each to its own), the others' by rank 0, while the ranks that post
        nothing export (and drop) theirs; the names loaded. Waits at most ray_timeout_s."""
        if self._open_export is not None:
            self._open_export()
        owned: dict[int, list[str]] = {}
        for url in urls:
            owner = self.engine_owner(url) if self.engine_owner is not None else None
            owned.setdefault(0 if owner is None else owner, []).append(url)
        calls = [a.post_tensors.remote(owned[r], version, flush_cache) if r in owned
                 else a.begin_export.remote(False, False, version) for r, a in enumerate(self.actors)]
        posting = sorted(owned)
        try:
            names = await asyncio.wait_for(asyncio.gather(*(rank_result(calls[r], "posting weights", r)
                                                             for r in posting)), self.timeout_s)
        except asyncio.TimeoutError:
            raise ClusterError(f"trainer ranks {posting} did not post the weights to {urls} within ray_timeout_s="
                               f"{self.timeout_s} s") from None
        self._wait("export_weights", calls)  # the other ranks' part of the export ended too
        return names[0]

    def weight_bytes_sent(self) -> int:
        """Bytes the ranks have broadcast or posted to the engines (each stage's first rank, or rank 0)."""
        return sum(self._all("weight_bytes_sent", [a.weight_bytes_sent.remote() for a in self.actors]))

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        self._all("save_checkpoint", [a.save_checkpoint.remote(os.fspath(path), extra) for a in self.actors])

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        extra, self._version = self._all("load_checkpoint",
                                         [a.load_checkpoint.remote(os.fspath(path)) for a in self.actors])[0]
        return extra

    def offload(self) -> None:
        self._all("offload", [a.offload.remote() for a in self.actors])

    def onload(self) -> None:
        self._all("onload", [a.onload.remote() for a in self.actors])

    def rss_bytes(self) -> list[int]:
        """Each rank's resident memory (colocated runs measure it)."""
        return self._all("rss_bytes", [a.rss_bytes.remote() for a in self.actors])

    def close(self) -> None:
        """Releases the ranks' trainers and process group, then ends the actors (those stuck in a collective too)."""
        import ray

        refs = [a.close.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


@contextlib.contextmanager
def start_trainer_group(session: RaySession, config: TrainConfig, initial: InitialWeights,
                        memory_tag_prefix: str) -> Iterator[TrainerGroup]:
    """One actor per rank in the trainer's placement group, joined in one process group, each with a
    trainer built from ``initial``: a model (shipped through the object store), or TrainConfig.model's
    checkpoint directory, which each rank reads itself (a Megatron rank only its slice)."""
    import ray

    topology = session.topology
    remote = ray.remote(TrainerRank)
    actors = [remote.options(max_restarts=0, **session.actor_options(topology.trainer(rank)))
              .remote(config, rank, topology.trainer_ranks) for rank in range(topology.trainer_ranks)]
    group = TrainerGroup(actors, [-1] * len(actors), 0, config.ray_timeout_s)
    try:
        master = group._all("rendezvous", [actors[0].rendezvous.remote()])[0]
        shipped = initial if isinstance(initial, str) else ray.put(initial)
        group.pids = group._all("setup", [a.setup.remote(master, shipped, memory_tag_prefix) for a in actors])
        group._version = group._all("version", [a.version.remote() for a in actors])[0]
        group.set_stages(group._all("stage", [a.stage.remote() for a in actors]))
        logger.info("trainer: %d ranks on Ray (pids %s), rendezvous %s:%d", len(actors), group.pids, *master)
        yield group
    finally:
        group.close()


__all__ = ["TrainerGroup", "start_trainer_group"]
