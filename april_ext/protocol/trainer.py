"""The Trainer protocol: what the rollout loop needs from any trainer (torch, Megatron)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from april_ext.batch import TrainingBatch


@dataclass
class ExportedWeights:
    """The policy after an update, in Hugging Face parameter names, tagged with its version."""

    version: int
    tensors: list[tuple[str, torch.Tensor]]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors)


@runtime_checkable
class Trainer(Protocol):
    @property
    def version(self) -> int:
        """The policy version of the current weights (the version the next batch must carry)."""
        ...

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        """One policy update on the batch; returns metrics and advances the version by one."""
        ...

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        """The current weights in Hugging Face names with the current version."""
        ...

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Atomically writes model, optimizer and RNG state, plus ``extra`` (e.g. scheduler state, data
        position) for the caller."""
        ...

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restores a checkpoint exactly; returns the ``extra`` it was saved with."""
        ...

    def offload(self) -> None:
        """Releases the trainer's device memory (colocated mode) until ``onload``."""
        ...

    def onload(self) -> None:
        """Restores the memory released by ``offload``."""
        ...
