"""What the engine hands back: streamed chunks and whole-request outputs."""

from __future__ import annotations

from dataclasses import dataclass

from april_ext.batch import FinishReason


@dataclass(frozen=True)
class GenerationChunk:
    """New tokens of one request from one engine step, all produced by `weight_version`.

    finish_reason is None while the request runs; the last chunk carries it (an abort's last chunk may
    carry no tokens). matched_stop is the stop token that ended the request, if any.
    """

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int
    finish_reason: FinishReason | None = None
    matched_stop: int | None = None


@dataclass(frozen=True)
class GenerationOutput:
    """A request's whole output: response tokens, behavior logprobs and the version of each token."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason | None
    matched_stop: int | None = None
    num_preemptions: int = 0


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's load and counters (tokens/s over the recent window of steps)."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    weight_version: int
    steps: int
    prefill_tokens: int
    decode_tokens: int
    generated_tokens: int
    preemptions: int
    prefix_cache_hit_tokens: int
    tokens_per_s: float
    paused_tags: tuple[str, ...]
