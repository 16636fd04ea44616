"""The process group of SGLang's weight broadcast, joined the way SGLang joins it, so that a trainer and a
server (SGLang's or the embedded one) meet in the same group.

Rank 0 (the trainer process holding the weights) hosts the rendezvous store at master_address:master_port;
each server joins as rank rank_offset (+ its TP rank). The group lives beside any default process group of
the process (a trainer rank keeps its own world): it is built from its own store, keyed by the group name,
with torch's helper for named groups, as SGLang's init_custom_process_group does. Every collective of the
group is bounded by ``timeout_s``: a peer that dies mid-broadcast fails the survivors when it expires
(gloo does not notice a dead peer sooner).

Tensors travel one broadcast each from rank 0, in the order of the request's names, with the dtypes and
shapes the request lists (SGLang's default load format).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from april_ext.errors import InvalidArgumentError

BACKENDS = ("gloo", "nccl")


def join_weight_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
                      backend: str, timeout_s: float) -> dist.ProcessGroup:
    """Joins (rank 0: hosts) the named group; returns once every rank has joined. Raises when the
    others do not join within timeout_s (torch's DistStoreError / RuntimeError)."""
    if backend not in BACKENDS:
        raise InvalidArgumentError(f"weight group backend must be one of {list(BACKENDS)}, got {backend!r}")
    timeout = datetime.timedelta(seconds=timeout_s)
    store, _, _ = next(c10d.rendezvous(f"tcp://{_host(master_address)}:{master_port}", rank, world_size,
                                       timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name), backend_options=None, timeout=timeout)
    # dist.broadcast(group=...) maps group ranks to global ones through this table: here they are the same.
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy_weight_group(group: dist.ProcessGroup) -> None:
    dist.destroy_process_group(group)


def broadcast_tensors(group: dist.ProcessGroup, tensors: Sequence[torch.Tensor]) -> None:
    """One broadcast from rank 0 per tensor, in order: rank 0 sends its tensors, the others fill theirs."""
    for tensor in tensors:
        dist.broadcast(tensor, src=0, group=group)


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype as SGLang's request names it ("bfloat16")."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"{name!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
    return dtype


def _host(address: str) -> str:
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


__all__ = ["BACKENDS", "broadcast_tensors", "destroy_weight_group", "dtype_name", "join_weight_group", "parse_dtype"]
