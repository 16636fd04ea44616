"""SamplingParams: how one request draws its tokens, validated at the boundary."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from april_ext.errors import InvalidArgumentError

# Seeds are hashed as unsigned 64-bit integers (engine/sampler.py): a larger one would wrap onto another.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang names).

    temperature 0 means greedy. top_k <= 0 and top_p 1.0 disable those filters. seed None lets the engine
    pick one (from its own seed and the request's arrival order). stop_token_ids end the request when
    sampled (the stop token is kept in the output); the model's eos ids do too unless ignore_eos. priority: a
    scheduling hint (SGLang's request priority): an engine that orders its waiting requests admits higher values
    first, None after every number; the rollout loop sets it from the scheduler's predicted remaining length
    when dispatch_order sorts by it.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    priority: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, Iterable):
            raise InvalidArgumentError(f"SamplingParams.stop_token_ids must be a sequence of integers >= 0, "
                                       f"got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise InvalidArgumentError(
                f"SamplingParams.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise InvalidArgumentError(
                f"SamplingParams.temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise InvalidArgumentError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise InvalidArgumentError(
                f"SamplingParams.top_k must be an integer (<= 0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise InvalidArgumentError(
                f"SamplingParams.seed must be None or an integer in [0, 2**64 - 1], got {self.seed!r}")
        if self.priority is not None and (not isinstance(self.priority, int) or isinstance(self.priority, bool)
                                          or not -2**63 <= self.priority < 2**63):
            raise InvalidArgumentError(
                f"SamplingParams.priority must be None or a signed 64-bit integer, got {self.priority!r}")
        bad = [t for t in self.stop_token_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0]
        if bad:
            raise InvalidArgumentError(f"SamplingParams.stop_token_ids must be integers >= 0, got {bad}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
