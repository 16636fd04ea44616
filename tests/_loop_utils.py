"""Helpers of the rollout-loop and training tests: a scripted RolloutEngine on a virtual clock, tiny configs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from april_ext.batch import FinishReason
from april_ext.protocol import GenerationChunk, GenerationOutput, SamplingParams


class ScriptedEngine:
    """A RolloutEngine whose responses are scripted: ``length_of(input_ids)`` tokens (the prompt's target
    length), one token per ``tick`` virtual seconds, token id = 10 + position. Its clock is virtual: it
    advances by ``tick`` per generated round, so durations measured with ``clock()`` do not depend on
    the machine; ``delay`` real seconds pass per token (0: just yield to the event loop).
    ``abort_extra_tokens`` tokens are produced by an abort without ever being streamed (as an HTTP
    engine whose final abort response carries text the stream did not deliver). With
    ``preempt_first_after=k`` the engine itself ends its first request with ABORT after k tokens (as an
    engine that drops a request under memory pressure)."""

    def __init__(self, length_of: Callable[[Sequence[int]], int], *, tick: float = 0.01, delay: float = 0.0,
                 abort_extra_tokens: int = 0, preempt_first_after: int | None = None) -> None:
        self.length_of = length_of
        self.tick = tick
        self.delay = delay
        self.abort_extra_tokens = abort_extra_tokens
        self.preempt_first_after = preempt_first_after
        self.requests = 0
        self.version = 0
        self.now = 0.0
        self.abort_calls: list[float] = []
        self.memory_calls: list[tuple[str, tuple[str, ...] | None]] = []
        self._running: dict[str, dict[str, Any]] = {}

    def clock(self) -> float:
        return self.now

    async def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        params = params or SamplingParams()
        rid = request_id or f"r{len(self._running)}"
        prompt_len = next(i for i, t in enumerate(input_ids) if t == 3) + 1  # up to the counting task's SEP
        done = len(input_ids) - prompt_len
        target = min(self.length_of(input_ids), done + params.max_new_tokens)
        state = {"tokens": [], "versions": [], "aborted": False, "done": done, "target": target}
        self._running[rid] = state
        preempt_at = self.preempt_first_after if self.requests == 0 else self._preempt_at(self.requests)
        self.requests += 1
        while True:
            await asyncio.sleep(self.delay)
            if state["aborted"]:
                yield GenerationChunk(rid, [], [], self.version, FinishReason.ABORT)
                return
            position = done + len(state["tokens"])
            if preempt_at is not None and len(state["tokens"]) == preempt_at:
                self._running.pop(rid, None)
                yield GenerationChunk(rid, [], [], self.version, FinishReason.ABORT)
                return
            if position >= target:
                self._running.pop(rid, None)
                reason = FinishReason.LENGTH if target - done >= params.max_new_tokens else FinishReason.STOP
                yield GenerationChunk(rid, [], [], self.version, reason)
                return
            self.now += self.tick / max(1, len(self._running))
            token = 10 + position
            state["tokens"].append(token)
            state["versions"].append(self.version)
            yield GenerationChunk(rid, [token], [-0.5], self.version)

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        self.abort_calls.append(self.now)
        ids = list(self._running) if request_ids is None else (
            [request_ids] if isinstance(request_ids, str) else list(request_ids))
        outputs = []
        for rid in ids:
            state = self._running.pop(rid)
            state["aborted"] = True
            extra = self._abort_extra(state)
            tokens = state["tokens"] + extra
            outputs.append(GenerationOutput(rid, [], tokens, [-0.5] * len(tokens),
                                            state["versions"] + [self.version] * len(extra), FinishReason.ABORT))
        return outputs

    def _preempt_at(self, request: int) -> int | None:
        """After how many tokens the engine itself ends request number ``request`` (from 0) with ABORT."""
        return None

    def _abort_extra(self, state: dict[str, Any]) -> list[int]:
        """Tokens an abort result carries that the request's stream never delivered."""
        return [99] * self.abort_extra_tokens

    async def update_weights(self, weights: Any, version: int) -> None:
        self.version = version

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        self.memory_calls.append(("release", None if tags is None else tuple(tags)))

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        self.memory_calls.append(("resume", None if tags is None else tuple(tags)))

    def stats(self) -> dict[str, Any]:
        return {"running": len(self._running)}

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "weight_version": self.version}


class SampleLengthEngine(ScriptedEngine):
    """A ScriptedEngine whose sample ``sid`` (read from the rollout loop's request id, ``prefix-sid-n``)
    generates ``length_of_sample(sid)`` tokens in all, across its resumes: token id 10 + position. An abort
    result carries up to ``abort_extra_tokens`` more of the same sequence (generated, not streamed yet), and
    with ``preempt_every=k`` the engine itself ends every k-th request with ABORT after 2 tokens."""

    def __init__(self, length_of_sample: Callable[[int], int], *, preempt_every: int = 0, **kwargs: Any) -> None:
        super().__init__(lambda ids: 0, **kwargs)
        self.length_of_sample = length_of_sample
        self.preempt_every = preempt_every

    def _preempt_at(self, request: int) -> int | None:
        return 2 if self.preempt_every and request % self.preempt_every == self.preempt_every - 1 else None

    def _abort_extra(self, state: dict[str, Any]) -> list[int]:
        position = state["done"] + len(state["tokens"])
        return [10 + p for p in range(position, min(position + self.abort_extra_tokens, state["target"]))]

    def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        length = self.length_of_sample(int(str(request_id).split("-")[1]))
        self.length_of = lambda ids: length  # read before the generator's first await
        return super().generate(input_ids, params, request_id)


def assert_logprobs_are_the_models(model: Any, batch: Any) -> None:
    """Every response token of ``batch``, rescored by ``model`` (temperature 1) in one forward pass, has the
    behavior logprob the batch holds: a token lost, duplicated or generated over the wrong KV changes the rest."""
    with torch.inference_mode():
        for i in range(batch.n_samples):
            start, end, plen = int(batch.offsets[i]), int(batch.offsets[i + 1]), int(batch.prompt_lens[i])
            ids = torch.as_tensor(batch.tokens[start:end], dtype=torch.int64)
            logprobs = torch.log_softmax(model(ids).float(), dim=-1)[plen - 1:-1]
            rescored = logprobs.gather(-1, ids[plen:, None]).squeeze(-1).numpy()
            np.testing.assert_allclose(batch.behavior_logprobs[start + plen:end], rescored, atol=2e-3)
