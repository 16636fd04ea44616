"""Prompts and the data sources the scheduler pulls them from.

A data source is anything with ``__len__`` and ``__getitem__(index) -> Prompt`` (random access by
position). The scheduler takes prompts in order, 0, 1, 2, ...; its position is part of the saved
scheduler state, so a restarted run continues where it stopped. Metadata stays on the Python side:
the compiled core only sees prompt indices and token ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from april_ext.errors import InvalidArgumentError


@dataclass(frozen=True)
class Prompt:
    """One prompt: an id of the caller's choosing, its token ids and arbitrary metadata (e.g. the answer)."""

    id: Any
    token_ids: Sequence[int]
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class DataSource(Protocol):
    """Random-access prompts. ``len()`` bounds the run: when the scheduler reaches it, data has run out."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Prompt: ...


class ListDataSource:
    """An in-memory list of prompts."""

    def __init__(self, prompts: Sequence[Prompt]) -> None:
        for i, p in enumerate(prompts):
            if not isinstance(p, Prompt):
                raise InvalidArgumentError(f"prompts[{i}] is a {type(p).__name__}; a Prompt is required")
        self._prompts = list(prompts)

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, index: int) -> Prompt:
        return self._prompts[index]


def prompt_token_array(prompt: Prompt, index: int) -> np.ndarray:
    """The prompt's token ids as a 1-D int32 array; raises InvalidArgumentError naming the prompt otherwise."""
    if not isinstance(prompt, Prompt):
        raise InvalidArgumentError(f"data source item {index} is a {type(prompt).__name__}; a Prompt is required")
    ids = np.asarray(prompt.token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InvalidArgumentError(
            f"prompt {prompt.id!r} (index {index}): token_ids must be a non-empty 1-D sequence of ints, "
            f"got shape {ids.shape} of {ids.dtype}")
    if ids.min() < 0 or ids.max() > np.iinfo(np.int32).max:
        raise InvalidArgumentError(
            f"prompt {prompt.id!r} (index {index}): token ids must be in [0, 2**31 - 1], "
            f"got range [{ids.min()}, {ids.max()}]")
    return ids.astype(np.int32, copy=False)


__all__ = ["DataSource", "ListDataSource", "Prompt", "prompt_token_array"]
