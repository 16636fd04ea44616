"""Reward functions: score one response (token ids) of a prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from april_ext.data_source import Prompt
from april_ext.errors import ConfigError
from april_ext.protocol.reward import RewardFunction, score_group
from april_ext.tasks.math_verify import math_reward


RM_TYPES = ("math", "deepscaler", "dapo")
"""slime's built-in math rewards (--rm-type) that MathReward scores."""


class MathReward:
    """Decodes the response with the tokenizer and checks its final answer against ``prompt.metadata["label"]``.

    rm_type: slime's name of the scoring: "math" 1 for a right answer, else 0; "deepscaler" the same for the
    text after the last ``</think>`` (0 when the response has none: it never finished thinking); "dapo" 1 for
    a right answer, else -1."""

    def __init__(self, tokenizer: Any, rm_type: str = "math") -> None:
        if rm_type not in RM_TYPES:
            raise ConfigError(f"MathReward.rm_type must be one of {RM_TYPES}, got {rm_type!r}")
        self.tokenizer = tokenizer
        self.rm_type = rm_type

    def __call__(self, prompt: Prompt, response: Sequence[int]) -> float:
        text = self.tokenizer.decode(list(response), skip_special_tokens=True)
        if self.rm_type == "deepscaler":
            if "</think>" not in text:
                return 0.0
            text = text.rsplit("</think>", 1)[1]
        right = math_reward(text, prompt.metadata["label"]) == 1.0
        if self.rm_type == "dapo":
            return 1.0 if right else -1.0
        return 1.0 if right else 0.0


__all__ = ["RM_TYPES", "MathReward", "RewardFunction", "score_group"]
