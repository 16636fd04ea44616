"""What a reward function is to the rollout loop: one response of a prompt in, one float out."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from april_ext.data_source import Prompt


class RewardFunction(Protocol):
    def __call__(self, prompt: Prompt, response: Sequence[int]) -> float: ...


def score_group(reward_fn: RewardFunction, prompt: Prompt, responses: Sequence[Sequence[int]]) -> list[float]:
    """The rewards of every sample of one group, in order."""
    return [float(reward_fn(prompt, response)) for response in responses]


__all__ = ["RewardFunction", "score_group"]
