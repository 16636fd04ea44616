"""TrainerRanks: the actors of a Ray run's trainer ranks and every call made to them, by the trainer group (the
Trainer protocol, trainer_group.py) and by the weight export (rank_export.py) alike.

One actor per rank in the trainer's placement group, joined in one process group as torchrun would join
them (trainer_actor.TrainerRank). Every call waits at most ``ray_timeout_s``, also the ranks' process-group
timeout, so a rank that dies or stalls stops the run with a ClusterError naming it instead of hanging it.
One export at a time: the ranks of an export are busy in its gather until it is read to its end, so an
export left unread is finished before any other call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from april_ext.cluster.errors import ClusterError
from april_ext.cluster.session import RaySession
from april_ext.cluster.trainer_actor import TrainerRank
from april_ext.errors import AprilError
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import InitialWeights

logger = logging.getLogger(__name__)

RESUME = "the run stopped; continue it from its last checkpoint with --resume"
# Closing the ranks is a courtesy before they are killed: a rank stuck in a collective never answers.
_CLOSE_TIMEOUT_S = 10.0
# After a rank fails: how long the others may take to fail too (the actor of a killed rank is reported dead
# about 1-2 s after its process ends).
_FAILURE_GRACE_S = 5.0


async def rank_result(ref: Any, what: str, rank: int = 0, error: type[AprilError] = ClusterError) -> Any:
    """A call's value from trainer rank ``rank``: an april_ext error raised there arrives as itself, a dead rank
    as ClusterError, any other failure as ``error``. Unbounded here: the caller bounds the wait."""
    import ray

    try:
        return await asyncio.wrap_future(ref.future())
    except ray.exceptions.RayActorError as err:
        raise ClusterError(f"trainer rank {rank} died during {what} ({type(err).__name__}); {RESUME}") from None
    except ray.exceptions.RayTaskError as err:
        cause = err.cause
        if isinstance(cause, AprilError):
            raise cause from None
        raise error(f"trainer rank {rank} failed in {what}: {type(cause).__name__}: {cause}") from None


class TrainerRanks:
    """``actors[r]`` is rank r, ``pids[r]`` its process; ``stages[s]``: the ranks of pipeline stage s, in order
    (one stage of every rank without pipeline parallelism). ``start`` makes them."""

    def __init__(self, actors: list[Any], timeout_s: float) -> None:
        self.actors = actors
        self.timeout_s = timeout_s
        # Known once the ranks are set up (start).
        self.pids = [-1] * len(actors)
        self.stages = [list(range(len(actors)))]
        self._unfinished: Callable[[], None] | None = None

    @classmethod
    def start(cls, session: RaySession, config: TrainConfig, initial: InitialWeights,
              memory_tag_prefix: str) -> TrainerRanks:
        """One actor per rank, joined in one process group, each with a trainer built from ``initial``: a model
        (shipped through the object store once), or TrainConfig.model's checkpoint directory, which each rank
        reads itself (a Megatron rank only its slice). The actors are ended again when this fails."""
        import ray

        topology = session.topology
        remote = ray.remote(TrainerRank)
        ranks = cls([remote.options(max_restarts=0, **session.actor_options(topology.trainer(rank)))
                     .remote(config, rank, topology.trainer_ranks, session.network)
                     for rank in range(topology.trainer_ranks)],
                    config.ray_timeout_s)
        try:
            master = ranks.all("rendezvous", [ranks.actors[0].rendezvous.remote()])[0]
            shipped = initial if isinstance(initial, str) else ray.put(initial)
            ranks.pids = ranks.all("setup", [a.setup.remote(master, shipped, memory_tag_prefix) for a in ranks.actors])
            stages = ranks.all("stage", [a.stage.remote() for a in ranks.actors])
            ranks.stages = [[r for r, (stage, _) in enumerate(stages) if stage == s] for s in range(stages[0][1])]
        except BaseException:
            ranks.close()
            raise
        logger.info("trainer: %d ranks on Ray (pids %s), rendezvous %s:%d", len(ranks.actors), ranks.pids, *master)
        return ranks

    def export_begun(self, finish: Callable[[], None]) -> None:
        """The ranks are in an export now; ``finish`` reads it to its end (and waits for its ranks)."""
        self._unfinished = finish

    def export_ended(self) -> None:
        """The export was read to its end."""
        self._unfinished = None

    @property
    def exporting(self) -> bool:
        return self._unfinished is not None

    def finish_export(self) -> None:
        """Reads an export left unread to its end, so that its ranks are free for the next call."""
        finish, self._unfinished = self._unfinished, None
        if finish is not None:
            finish()

    def all(self, what: str, calls: list[Any]) -> list[Any]:
        """The results of one call per rank (``calls[r]`` is rank r's ObjectRef), in rank order, after an export
        left unread is finished."""
        self.finish_export()
        return self.wait(what, calls)

    def wait(self, what: str, calls: list[Any], ranks: list[int] | None = None) -> list[Any]:
        """The results of ``calls`` (``calls[i]`` is rank ``ranks[i]``'s; rank i's without ``ranks``). When a rank
        fails, the others get a few seconds to fail too (a rank that died makes the others' collectives fail at
        once), so that the error names the rank that died rather than one that lost it."""
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
                                   f"ray_timeout_s={self.timeout_s} s (stalled, or waiting for a dead rank); {RESUME}")
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
                                    f"({type(failures[rank]).__name__}); {RESUME}")
        rank = min(failures)
        cause = getattr(failures[rank], "cause", failures[rank])
        if isinstance(cause, AprilError):
            return cause
        return ClusterError(f"trainer rank {rank} (pid {self.pids[rank]}) failed in {what}: "
                            f"{type(cause).__name__}: {cause}; {RESUME}")

    def close(self) -> None:
        """Releases the ranks' trainers and process group, then ends the actors (those stuck in a collective too)."""
        import ray

        refs = [a.close.remote() for a in self.actors]
        ray.wait(refs, num_returns=len(refs), timeout=_CLOSE_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


__all__ = ["RESUME", "TrainerRanks", "rank_result"]
