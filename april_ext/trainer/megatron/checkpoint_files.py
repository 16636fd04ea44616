"""The files of a megatron-core distributed checkpoint (dist_checkpointing's torch_dist format), checked
before it is loaded: ``metadata.json``, ``common.pt``, ``.metadata`` and every shard file ``.metadata``
lists (``__R_I.distcp``, written by rank R of the saving run). A load at any layout reads all of them
across its ranks; one that is missing otherwise fails inside torch.distributed.checkpoint on the ranks that
read it (a FileNotFoundError in one process; under torchrun those ranks die and the rest are stopped).
The layout the checkpoint was saved at is recorded in its common state (``layout``), for the message.
"""

from __future__ import annotations

import os
import pickle
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from april_ext.errors import CorruptStateError, PersistenceError
from april_ext.trainer.megatron.parallel import MegatronParallelConfig

_FIXED = {"metadata.json": "megatron-core's format record", "common.pt": "the common state",
          ".metadata": "the index of the shards"}
_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class Layout:
    """The split of a run's ranks that a checkpoint records (saved) or a load asks for."""

    tensor: int
    pipeline: int
    expert: int
    data: int

    @classmethod
    def of(cls, parallel: MegatronParallelConfig, data_parallel_size: int) -> Layout:
        return cls(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                   parallel.expert_model_parallel_size, data_parallel_size)

    @classmethod
    def from_dict(cls, raw: Any) -> Layout | None:
        """The layout a checkpoint's common state records; None when it records none (saved before it did)."""
        try:
            return cls(**raw)
        except TypeError:
            return None

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    def __str__(self) -> str:
        return f"TP={self.tensor} PP={self.pipeline} EP={self.expert} DP={self.data}"


def check_files(path: str | os.PathLike[str], requested: Layout) -> None:
    """PersistenceError naming the first file the distributed checkpoint at ``path`` lacks, with what it
    holds, the layout it was saved at and ``requested``, the layout loading it. A directory holding none of
    the checkpoint's fixed files is not refused here (the load says what it is not)."""
    path = os.fspath(path)
    present = [name for name in _FIXED if os.path.isfile(os.path.join(path, name))]
    if not present:
        return
    missing = next(((name, what) for name, what in _FIXED.items() if name not in present), None)
    if missing is None:
        missing = _missing_shard(path)
    if missing is None:
        return
    name, what = missing
    saved = _recorded_layout(path)
    raise PersistenceError(
        f"{os.path.join(path, name)}: missing from the distributed checkpoint ({what}); it was saved at "
        f"{saved or 'a layout it does not record'}, this run loads it at {requested}, and a load at any "
        f"layout reads every file its ranks wrote: restore the file, or resume from another checkpoint")


def _missing_shard(path: str) -> tuple[str, str] | None:
    """(file, what it holds) of the first shard file ``.metadata`` lists that is not there."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        storage = FileSystemReader(path).read_metadata().storage_data
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
        raise CorruptStateError(f"{os.path.join(path, '.metadata')}: not a torch.distributed.checkpoint index "
                                f"({type(err).__name__}: {err})") from None
    held: dict[str, list[str]] = {}
    for index, info in storage.items():
        held.setdefault(info.relative_path, []).append(index.fqn)
    for name in sorted(held):
        if not os.path.isfile(os.path.join(path, name)):
            match = _SHARD.match(name)
            writer = f"written by rank {match[1]} of the saving run, " if match else ""
            tensors = sorted(set(held[name]))
            return name, f"{writer}pieces of {len(tensors)} tensor(s), such as {', '.join(tensors[:3])}"
    return None


def _recorded_layout(path: str) -> Layout | None:
    try:
        common = torch.load(os.path.join(path, "common.pt"), map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, pickle.UnpicklingError):
        return None  # the message names the missing file all the same
    trainer = common.get("trainer") if isinstance(common, dict) else None
    return Layout.from_dict(trainer.get("layout")) if isinstance(trainer, dict) else None


__all__ = ["Layout", "check_files"]
