"""Reward functions: score one response (token ids) of a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from april_ext.data_source import Prompt
from april_ext.protocol.reward import RewardFunction, score_group
from april_ext.tasks.math_verify import math_reward


class MathReward:
    """Decodes the response with the tokenizer and checks its final answer against ``prompt.metadata["label"]``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, prompt: Prompt, response: Sequence[int]) -> float:
        text = self.tokenizer.decode(list(response), skip_special_tokens=True)
        return math_reward(text, prompt.metadata["label"])


__all__ = ["MathReward", "RewardFunction", "score_group"]
