"""The process group of a trainer: joins the ranks of a ``torchrun`` launch (WORLD_SIZE, RANK,
MASTER_ADDR / MASTER_PORT in the environment), or makes a world of one through a FileStore in a temporary
directory (no port taken) for a process started on its own. Backend: nccl with a GPU, gloo on a CPU. Every
collective has the given timeout, so a rank that dies makes the others fail instead of waiting forever.

TorchTrainer trains data parallel when the world has more than one rank; the Megatron path
(trainer.megatron.parallel) builds its model-parallel groups on this process group.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.settings import MAX_GROUP_TIMEOUT_S

_lock = threading.Lock()
_owned_dir: str | None = None
_owns_process_group = False


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a multi-process launch (torchrun's environment)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def initialize(timeout_s: float = 600.0) -> None:
    """Creates the default process group unless one exists (then it is reused as it is); ``shutdown``
    destroys only a group created here. ``timeout_s`` limits the rendezvous and every collective."""
    global _owned_dir, _owns_process_group
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) \
            or not 0 < timeout_s <= MAX_GROUP_TIMEOUT_S:
        raise ConfigError(f"timeout_s must be a number in (0, 6e8] seconds, got {timeout_s!r}")
    timeout = timedelta(seconds=timeout_s)
    with _lock:
        if dist.is_initialized():
            return
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if launched_by_torchrun():
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, init_method="env://", timeout=timeout)
        else:
            _owned_dir = tempfile.mkdtemp(prefix="april_ext_pg-")
            store = dist.FileStore(os.path.join(_owned_dir, "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout)
        _owns_process_group = True


def shutdown() -> None:
    """Destroys the process group if ``initialize`` created it."""
    global _owned_dir, _owns_process_group
    with _lock:
        if _owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        if _owned_dir is not None:
            shutil.rmtree(_owned_dir, ignore_errors=True)
        _owned_dir = None
        _owns_process_group = False


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def rank_slice(s0: int, s1: int, rank: int, size: int) -> tuple[int, int]:
    """The ``rank``-th of ``size`` consecutive, about equal parts of the samples [s0, s1)."""
    n = s1 - s0
    if n < size:
        raise InvalidArgumentError(f"a minibatch of {n} samples cannot be split across {size} data-parallel ranks")
    return s0 + (n * rank) // size, s0 + (n * (rank + 1)) // size


def sum_across_ranks(sums: dict[str, float]) -> dict[str, float]:
    """Each name's value added over every rank of the world (a collective: every rank calls it)."""
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sums)
    total: dict[str, float] = {}
    for part in gathered:
        for name, value in (part or {}).items():
            total[name] = total.get(name, 0.0) + value
    return total


def broadcast_from_rank_0(tensors: list[torch.Tensor]) -> None:
    """Every rank's ``tensors`` become rank 0's, in place (a collective), as DistributedDataParallel does to a
    module's parameters when it wraps them."""
    with torch.no_grad():
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def average_across_ranks(tensors: list[torch.Tensor]) -> None:
    """Each tensor, in place, the mean of its values over every rank (a collective), as DistributedDataParallel
    averages a gradient bucket: divided by the world size, then summed."""
    size = dist.get_world_size()
    for tensor in tensors:
        tensor.div_(size)
        dist.all_reduce(tensor)


__all__ = ["average_across_ranks", "broadcast_from_rank_0", "initialize", "launched_by_torchrun", "rank_slice",
           "shutdown", "sum_across_ranks", "world"]
