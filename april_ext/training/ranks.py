"""A run across the ranks of a torchrun launch: rank 0 runs the training, the other ranks follow its
trainer.

Every rank joins the process group (trainer.distributed) and builds the run's trainer (build_trainer) in
it; the trainer's methods are collective (DDP's or Megatron's all-reduces, gathered exports, sharded
checkpoints), so each must run on every rank in the same order. Rank 0 alone owns the scheduler, the
engine, the rewards, the metrics and the outputs; its TrainingRun gets a ``LeaderTrainer``, which
broadcasts each call (name and arguments: the TrainingBatch, a checkpoint path) to the other ranks over a
gloo group of its own before making it locally, and the other ranks ``follow``: they receive each call
and make it on their trainer (an export only takes part in the gather and keeps nothing), until rank 0
says stop. A Megatron export streams: the ranks gather each tensor while rank 0's consumer reads it, and
an export left unread is read to the end before the next call goes out.

Nothing hangs: a rank that raises exits, and torchrun stops the others (with the failing rank's error in
the output). While rank 0 generates, a keep-alive goes out every quarter of the timeout, so a follower
that hears nothing for distributed_timeout_minutes fails instead of waiting forever (also without
torchrun's watch); rank 0 failing outside a trainer call tells the followers, which exit with its error.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from april_ext.batch import TrainingBatch
from april_ext.errors import ConfigError, InvalidStateError
from april_ext.model import ModelConfig
from april_ext.protocol.trainer import ExportedWeights, Trainer
from april_ext.trainer import distributed
from april_ext.trainer.megatron.parallel import validate_layout
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import InitialWeights, TrainerFactory, build_trainer

_R = TypeVar("_R")

_CALLS = ("train_step", "export_weights", "save_checkpoint", "load_checkpoint", "offload", "onload")
"""The Trainer methods rank 0 makes on every rank."""


@dataclass(frozen=True)
class _Command:
    kind: str
    """A method of _CALLS, or "ping" (keep-alive), "stop" (the run is over), "abort" (rank 0 failed)."""
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def check_world(config: TrainConfig, world_size: int, model: ModelConfig | None = None) -> int:
    """The data-parallel size of ``config``'s run in a world of ``world_size`` ranks; ConfigError when the
    layout does not fit it (with ``model``, the architecture the run trains, first when the layout cannot
    split it: trainer.megatron.parallel.validate_layout; tensor x pipeline x context parallel must divide the
    world; the torch trainer is data parallel over any world; the distributed optimizer needs more than one
    rank) or an optimizer step has fewer samples than data-parallel ranks."""
    dp = world_size
    if config.trainer != "torch":
        split = config.parallel_config()
        if model is not None:
            validate_layout(split, model)
        if world_size % split.model_parallel_size:
            launch = _world_advice(config, world_size)
            raise ConfigError(f"the run has {world_size} rank(s), not a multiple of tensor x pipeline x context "
                              f"parallel = {split.tensor_model_parallel_size} x {split.pipeline_model_parallel_size}"
                              f" x {split.context_parallel_size} = {split.model_parallel_size} "
                              f"(--tensor-model-parallel-size {split.tensor_model_parallel_size}, "
                              f"--pipeline-model-parallel-size {split.pipeline_model_parallel_size}; data parallel "
                              f"takes the rest of the world): {launch} ({split.model_parallel_size} ranks or a "
                              f"multiple)")
        dp = split.data_parallel_size(world_size)
        if split.use_distributed_optimizer and world_size == 1:
            # MegatronTrainer (a world of one) has no distributed optimizer: the flag would be ignored.
            raise ConfigError(f"use_distributed_optimizer=True needs a run across ranks (the run has 1 rank): "
                              f"{_world_advice(config, 1)}, or leave out --use-distributed-optimizer")
    # Each optimizer step's samples are split across the data-parallel ranks: at least one each.
    per_step = config.global_batch_size or config.rollout_batch_size * config.n_samples_per_prompt
    if per_step < dp:
        raise ConfigError(f"an optimizer step of {per_step} samples (global_batch_size, or the whole rollout batch) "
                          f"cannot be split across {dp} data-parallel ranks: give at least {dp}")
    return dp


def _world_advice(config: TrainConfig, world_size: int) -> str:
    """How to give the run another world: a Ray run's trainer ranks are its actors, others its launch's."""
    if config.ray:
        return (f"change --actor-num-nodes ({config.actor_num_nodes}) x --actor-num-gpus-per-node "
                f"({config.actor_num_gpus_per_node})")
    return "launch it with --nproc-per-node or torchrun" if world_size == 1 else \
        "change --nproc-per-node / torchrun's world"


class _Channel:
    """Rank 0's commands to the other ranks: broadcast_object_list on a gloo group of their own (whose
    timeout bounds every wait), one command at a time."""

    def __init__(self, timeout_s: float) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.lock = threading.Lock()
        self.timeout_s = timeout_s

    def send(self, command: _Command) -> None:
        dist.broadcast_object_list([command], src=0, group=self.group)

    def receive(self) -> _Command:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as err:  # gloo's timeout or a closed connection
            raise InvalidStateError(f"no command from rank 0 within {self.timeout_s:g} s "
                                    f"(distributed_timeout_minutes), or rank 0 is gone: {err}") from None
        return box[0]


class LeaderTrainer:
    """Rank 0's Trainer: each call goes to every other rank first (they make it on their trainers), then
    to the local trainer; the collective inside pairs them up."""

    def __init__(self, local: Trainer, channel: _Channel, keepalive_s: float) -> None:
        self.local = local
        self._channel = channel
        self._broken = False
        self._keepalive_error: BaseException | None = None
        # An export whose stream rank 0 has not read to the end (the other ranks are still gathering it).
        self._unread: Iterator[tuple[str, torch.Tensor]] | None = None
        self._stopping = threading.Event()
        self._keepalive = threading.Thread(target=self._keep_alive, args=(keepalive_s,), name="april-ranks-keepalive",
                                           daemon=True)
        self._keepalive.start()

    @property
    def version(self) -> int:
        return self.local.version

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        return self._call("train_step", batch)

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        return self._call("export_weights", to_cpu=to_cpu)

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        # The path is rank 0's; a sharded checkpoint needs it on a file system every rank sees.
        self._call("save_checkpoint", os.fspath(path), extra)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        return self._call("load_checkpoint", os.fspath(path))

    def offload(self) -> None:
        self._call("offload")

    def onload(self) -> None:
        self._call("onload")

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        with self._channel.lock:
            if self._keepalive_error is not None:
                raise InvalidStateError(f"the other ranks stopped listening: {self._keepalive_error}")
            try:
                if self._unread is not None:
                    # The other ranks are still in the last export's gather: finish it so they hear this call.
                    collections.deque(self._unread, maxlen=0)
                self._channel.send(_Command(name, args, kwargs))
                result = getattr(self.local, name)(*args, **kwargs)
                if isinstance(result, ExportedWeights):
                    self._unread = self._reading(result)
                    result = ExportedWeights(result.version, self._unread)
                return result
            except BaseException:
                # The ranks may be inside the call's collective: no further command can pair up.
                self._broken = True
                raise

    def _reading(self, exported: ExportedWeights) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's export, gathered with the other ranks as it is read (Megatron's streams)."""
        yield from exported
        self._unread = None

    def _keep_alive(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            with self._channel.lock:
                if self._stopping.is_set() or self._broken:
                    return
                if self._unread is not None:
                    # The other ranks are in the export's gather (bounded by its own timeout), not listening.
                    continue
                try:
                    self._channel.send(_Command("ping"))
                except Exception as err:  # noqa: BLE001 - reported by the next call
                    self._keepalive_error = err
                    return

    def close(self, error: BaseException | None) -> None:
        """Tells the other ranks that the run is over (``error``: that rank 0 failed, and why), unless a
        call failed half-way (then the collective's timeout or torchrun stops them)."""
        self._stopping.set()
        self._keepalive.join()
        if self._broken or self._keepalive_error is not None:
            return
        with self._channel.lock:
            if error is None:
                self._channel.send(_Command("stop"))
            else:
                self._channel.send(_Command("abort", (f"{type(error).__name__}: {error}",)))
                # Each follower has the reason before this rank exits (and torchrun stops the rest).
                dist.barrier(group=self._channel.group)


def follow(channel: _Channel, trainer: Trainer) -> None:
    """Makes rank 0's trainer calls on ``trainer`` until it says stop; InvalidStateError when rank 0 failed."""
    while True:
        command = channel.receive()
        if command.kind == "stop":
            return
        if command.kind == "abort":
            dist.barrier(group=channel.group)
            raise InvalidStateError(f"rank 0 stopped the run: {command.args[0]}")
        if command.kind == "export_weights":
            # Only rank 0 uses the weights: a follower takes part in the gather (Megatron's, one tensor at a
            # time) without keeping the whole model; a trainer without one (DDP) exports locally, so nothing.
            gather = getattr(trainer, "iter_hf_weights", None)
            if gather is not None:
                collections.deque(gather(), maxlen=0)
        elif command.kind in _CALLS:
            getattr(trainer, command.kind)(*command.args, **command.kwargs)
        elif command.kind != "ping":
            raise InvalidStateError(f"rank 0 sent an unknown command {command.kind!r}")


def run_on_ranks(config: TrainConfig, lead: Callable[[TrainerFactory], _R],
                 initial_weights: Callable[[], InitialWeights]) -> _R | None:
    """This rank's part of a run across the ranks of a torchrun launch: on rank 0 ``lead(factory)`` (the
    run, with a trainer factory whose trainers lead the others) and its result; on the other ranks the
    trainer of ``initial_weights()`` (a checkpoint directory: the trainer reads this rank's slice of it),
    following rank 0, and None."""
    timeout_s = 60.0 * config.distributed_timeout_minutes
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    distributed.initialize(timeout_s)
    try:
        rank, world_size = distributed.world()
        check_world(config, world_size)
        channel = _Channel(timeout_s)
        if rank == 0:
            return lead(_leader_factory(channel, timeout_s / 4))
        with build_trainer(config, initial_weights()) as trainer:
            follow(channel, trainer)
        return None
    finally:
        distributed.shutdown()


def _leader_factory(channel: _Channel, keepalive_s: float) -> TrainerFactory:
    @contextlib.contextmanager
    def factory(config: TrainConfig, initial: InitialWeights, memory_tag_prefix: str) -> Iterator[Trainer]:
        with build_trainer(config, initial, memory_tag_prefix) as local:
            leader = LeaderTrainer(local, channel, keepalive_s)
            try:
                yield leader
            except BaseException as err:
                leader.close(err)
                raise
            leader.close(None)

    return factory


__all__ = ["LeaderTrainer", "check_world", "follow", "run_on_ranks"]
