"""The built-in synthetic task: "emit symbol X exactly N times, then EOS", with long-tailed N.

Prompt: [BOS, X, COUNT_N, SEP]. Target response: X repeated N times, then EOS. N is drawn log-normally
(capped), so most answers are short and a few are long: the length profile APRIL is built for. The reward
gives partial credit, so a randomly initialised model already earns small, varied rewards in a group:

    content = (number of the first N response positions that hold X) / N
    length  = max(0, 1 - |L - N| / N) if the response ends with EOS after L tokens, else 0
    reward  = (content + length) / 2        (1 exactly for the target response)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import ConfigError

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SEP_ID = 3
_FIRST_SYMBOL = 4


@dataclass(frozen=True)
class CountingTaskConfig:
    """n_symbols: how many distinct X tokens. max_count: the cap of N. median_count, sigma: N is
    round(median_count * exp(sigma * z)) for standard normal z, clipped to [1, max_count]. seed: the stream.
    n_prompts: the length of the stream as a data source (prompts are generated on access)."""

    n_symbols: int = 8
    max_count: int = 52
    median_count: float = 6.0
    sigma: float = 0.8
    seed: int = 0
    n_prompts: int = 1_000_000

    def __post_init__(self) -> None:
        for name in ("n_symbols", "max_count", "n_prompts"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"CountingTaskConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("median_count", "sigma"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
                    or value < 0 or (name == "median_count" and value < 1):
                bound = ">= 1" if name == "median_count" else ">= 0"
                raise ConfigError(f"CountingTaskConfig.{name} must be a finite number {bound}, got {value!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"CountingTaskConfig.seed must be an integer >= 0, got {self.seed!r}")

    @property
    def vocab_size(self) -> int:
        return _FIRST_SYMBOL + self.n_symbols + self.max_count


class CountingTask:
    """Prompt generator (a scheduler DataSource), reward function and vocabulary of the task."""

    pad_id = PAD_ID
    bos_id = BOS_ID
    eos_id = EOS_ID
    sep_id = SEP_ID

    def __init__(self, config: CountingTaskConfig | None = None) -> None:
        self.config = config or CountingTaskConfig()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def symbol_id(self, index: int) -> int:
        return _FIRST_SYMBOL + index

    def count_id(self, n: int) -> int:
        return _FIRST_SYMBOL + self.config.n_symbols + n - 1

    def __len__(self) -> int:
        return self.config.n_prompts

    def __getitem__(self, position: int) -> Prompt:
        """The prompt at a stream position; the same (seed, position) always gives the same prompt."""
        if not 0 <= position < self.config.n_prompts:
            raise IndexError(f"position {position} is outside [0, n_prompts={self.config.n_prompts})")
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, position])
        symbol = int(rng.integers(cfg.n_symbols))
        n = int(np.clip(round(cfg.median_count * math.exp(cfg.sigma * rng.standard_normal())), 1, cfg.max_count))
        tokens = (BOS_ID, self.symbol_id(symbol), self.count_id(n), SEP_ID)
        return Prompt(id=f"count-{cfg.seed}-{position}", token_ids=tokens,
                      metadata={"label": n, "symbol": self.symbol_id(symbol), "task": "counting"})

    def prompts(self, start: int, count: int) -> list[Prompt]:
        return [self[p] for p in range(start, start + count)]

    def target(self, prompt: Prompt) -> list[int]:
        """The response that earns reward 1."""
        return [prompt.metadata["symbol"]] * int(prompt.metadata["label"]) + [EOS_ID]

    def max_response_len(self) -> int:
        """Long enough for the longest target (max_count symbols + EOS)."""
        return self.config.max_count + 1

    def reward(self, prompt: Prompt, response: Sequence[int]) -> float:
        """Partial credit in [0, 1] (module docstring); 1 only for the exact target."""
        content, length = self.reward_parts(prompt, response)
        return 0.5 * (content + length)

    def reward_parts(self, prompt: Prompt, response: Sequence[int]) -> tuple[float, float]:
        """(content, length) credits of the module docstring, each in [0, 1]."""
        n = int(prompt.metadata["label"])
        symbol = int(prompt.metadata["symbol"])
        tokens = list(response)
        ended = EOS_ID in tokens
        body = tokens[:tokens.index(EOS_ID)] if ended else tokens
        content = sum(1 for t in body[:n] if t == symbol) / n
        length = max(0.0, 1.0 - abs(len(body) - n) / n) if ended else 0.0
        return content, length

    def model_config(self, **overrides: Any) -> Any:
        """A tiny Llama ModelConfig for this vocabulary (hidden 64, 2 layers, 4 heads) that learns the task
        on a CPU."""
        from april_ext.model import ModelConfig

        fields: dict[str, Any] = {
            "vocab_size": self.vocab_size, "hidden_size": 64, "intermediate_size": 192,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 4 + self.max_response_len() + 8, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        }
        fields.update(overrides)
        return ModelConfig(**fields)
