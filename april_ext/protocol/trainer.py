"""The Trainer protocol: what the rollout loop needs from any trainer (torch, Megatron)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, runtime_checkable

import torch

from april_ext.batch import TrainingBatch
from april_ext.errors import InvalidStateError


class ExportedWeights:
    """The policy after an update, in Hugging Face parameter names, tagged with its version: a one-pass
    stream of (name, tensor). A sharded trainer gathers each tensor while the stream is read (a collective
    its other ranks take part in), so no rank holds the whole model; read it once, to the end, before the
    trainer's next update (the tensors may be views of the live parameters). ``tensors`` and iteration
    hand out the same stream: a second read raises InvalidStateError."""

    def __init__(self, version: int, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.version = version
        self._source: Iterable[tuple[str, torch.Tensor]] | None = tensors

    @property
    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream of (name, tensor); only once."""
        if self._source is None:
            raise InvalidStateError(f"the exported weights of version {self.version} were already read: an export "
                                    f"streams its tensors once; call export_weights() again for another pass")
        source, self._source = self._source, None
        return iter(source)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.tensors


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


@runtime_checkable
class StagedTrainer(Protocol):
    """A trainer split into pipeline stages (Megatron; pipeline_model_parallel_size 1 is one stage):
    each stage's part of the weights can be exported by that stage's ranks alone, so that each stage's first
    rank sends its part to the engines itself (the collective weight update, one group per stage)."""

    @property
    def pipeline_stage(self) -> tuple[int, int]:
        """(this rank's stage, the number of stages)."""
        ...

    def export_stage_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        """This stage's part of ``export_weights`` (the stages' parts, in stage order, are the whole)."""
        ...
