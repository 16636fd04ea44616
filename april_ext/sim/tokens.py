"""Synthetic token ids of the simulator: prompts that carry their index, responses that carry their answer.

Ids below BODY_BASE are reserved: a simulated response that stops ends with CORRECT_TOKEN or
WRONG_TOKEN, so the reward is a function of the tokens alone (like a verifier reading the answer);
a response cut at the cap has no answer token. Body tokens are a per-sample pseudo-random sequence, so
two samples never share a response prefix.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import InvalidArgumentError

VOCAB_SIZE = 151936  # Qwen3's vocabulary
CORRECT_TOKEN = 1
WRONG_TOKEN = 2
PROMPT_MARK = 3
BODY_BASE = 16
_SPAN = VOCAB_SIZE - BODY_BASE
_INDEX_BASE = 1 << 16  # prompt index digits are ids >= BODY_BASE, base 2**16


def as_ids(ids: Any) -> np.ndarray:
    """Token ids as a contiguous int32 array (the canonical form hashed by the simulator)."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgumentError(f"input_ids must be a non-empty 1-D sequence of ints, got shape {arr.shape} "
                                   f"of {arr.dtype}")
    if arr.min() < 0 or arr.max() >= VOCAB_SIZE:
        raise InvalidArgumentError(f"input_ids must be in [0, {VOCAB_SIZE}), got range [{arr.min()}, {arr.max()}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


def prompt_key(prompt_ids: np.ndarray) -> int:
    """The index a synthetic prompt carries, or a stable 62-bit hash of any other prompt."""
    if prompt_ids.size >= 4 and prompt_ids[0] == PROMPT_MARK:
        hi, lo = int(prompt_ids[1]) - BODY_BASE, int(prompt_ids[2]) - BODY_BASE
        if 0 <= hi < _INDEX_BASE and 0 <= lo < _INDEX_BASE:
            return hi * _INDEX_BASE + lo
    digest = hashlib.blake2b(prompt_ids.tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 2


def synthetic_prompt(index: int, length: int) -> list[int]:
    """A prompt of ``length`` >= 4 tokens that encodes ``index`` (< 2**32)."""
    if length < 4:
        raise InvalidArgumentError(f"synthetic prompt length={length} is not allowed: an int >= 4")
    hi, lo = divmod(index, _INDEX_BASE)
    filler = (np.arange(length - 3, dtype=np.int64) * 7919 + index * 104729) % _SPAN + BODY_BASE
    return [PROMPT_MARK, BODY_BASE + hi, BODY_BASE + lo, *filler.tolist()]


class SyntheticPrompts:
    """A DataSource of ``size`` synthetic prompts of ``prompt_len`` tokens; prompt i carries index i."""

    def __init__(self, size: int, prompt_len: int = 256) -> None:
        if not isinstance(size, int) or not 1 <= size < 2**32:
            raise InvalidArgumentError(f"SyntheticPrompts size={size!r} is not allowed: an int in [1, 2**32)")
        if not isinstance(prompt_len, int) or prompt_len < 4:
            raise InvalidArgumentError(f"SyntheticPrompts prompt_len={prompt_len!r} is not allowed: an int >= 4")
        self.size = size
        self.prompt_len = prompt_len

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> Prompt:
        if not 0 <= index < self.size:
            raise IndexError(f"prompt index {index} out of range [0, {self.size})")
        return Prompt(id=index, token_ids=synthetic_prompt(index, self.prompt_len))


def response_tokens(uid: int, start: int, end: int, stop_at: int | None, correct: bool) -> np.ndarray:
    """Tokens [start, end) of sample ``uid``'s response; position ``stop_at - 1`` holds the answer token."""
    pos = np.arange(start, end, dtype=np.int64)
    out = (pos * 40503 + uid * 2654435761) % _SPAN + BODY_BASE
    if stop_at is not None and start <= stop_at - 1 < end:
        out[stop_at - 1 - start] = CORRECT_TOKEN if correct else WRONG_TOKEN
    return out.astype(np.int32)


def response_logprobs(uid: int, start: int, end: int) -> np.ndarray:
    """Finite synthetic behavior logprobs in [-2, -0.05] for tokens [start, end) of sample ``uid``."""
    pos = np.arange(start, end, dtype=np.int64)
    return (-0.05 - ((pos * 2246822519 + uid * 3266489917) % 1000) * (1.95 / 1000)).astype(np.float32)


def answer_reward(response_ids: Sequence[int]) -> float:
    """1.0 when the response ends with the correct-answer token, else 0.0 (wrong answer or cut at the cap)."""
    return 1.0 if len(response_ids) and int(response_ids[-1]) == CORRECT_TOKEN else 0.0


async def score_answer(prompt: Prompt, response: np.ndarray) -> float:
    """answer_reward as the rollout loop's reward function (the prompt does not matter)."""
    return answer_reward(response)


__all__ = ["BODY_BASE", "CORRECT_TOKEN", "PROMPT_MARK", "SyntheticPrompts", "VOCAB_SIZE", "WRONG_TOKEN",
           "answer_reward", "as_ids", "prompt_key", "response_logprobs", "response_tokens", "score_answer",
           "synthetic_prompt"]
