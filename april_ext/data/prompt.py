"""Prompt: one data-source item as the rollout loop consumes it; PromptSource: where prompts come from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Prompt:
    """Token ids of the prompt, a stable id, and metadata; ``metadata["label"]`` holds the reference answer."""

    id: str
    token_ids: tuple[int, ...]
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> Any:
        return self.metadata.get("label")


@runtime_checkable
class PromptSource(Protocol):
    """A deterministic stream of prompts addressed by position (0, 1, 2, ...).

    The position is what the scheduler saves as its data-source position, so a restarted run continues
    with the same prompts. ``size`` is the number of distinct prompts, or None for an endless generator.
    """

    @property
    def size(self) -> int | None: ...

    def prompt_at(self, position: int) -> Prompt: ...
