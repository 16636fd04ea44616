"""Rollout throughput of APRIL vs the synchronous baseline on the embedded engine, side by side, and
the rollout loop's own overhead per token (pytest-benchmark, or a plain script).

    .venv/bin/python -m pytest bench/bench_rollout.py --benchmark-only -q
    .venv/bin/python bench/bench_rollout.py          # prints the table

Side by side: two RolloutLoops (baseline: N' = N; APRIL: N' = 1.5 N, batch refill) over two embedded
engines with the same random-init model, stepping in turn so both see the same machine load. Response
lengths are those of a trained long-tail policy: each prompt has a target length (log-normal, median
16, capped at 192), enforced through max_new_tokens with EOS ignored (the engine generates for real).
Reported: generated tokens / rollout second of each mode and APRIL's gain, for a tiny model (hidden
64, 2 layers) and a small one (hidden 256, 4 layers).

Loop overhead: the loop and scheduler alone, over an engine that produces tokens at no cost.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import torch

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.batch import FinishReason
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.protocol import GenerationChunk, GenerationOutput, SamplingParams
from april_ext.rollout import RolloutLoop, scheduler_config_for

N, N_SAMPLES, CAP, STEPS = 8, 8, 192, 6
MODELS = {"tiny": (64, 2), "small": (256, 4)}


def _prompts(count: int, seed: int = 0) -> tuple[ListDataSource, dict[tuple[int, ...], int]]:
    rng = np.random.default_rng(seed)
    prompts, lengths = [], {}
    for i in range(count):
        ids = (1, 4 + i // 64, 4 + i % 64, 3)
        lengths[ids] = int(min(CAP, max(1, round(16 * math.exp(1.1 * rng.standard_normal())))))
        prompts.append(Prompt(f"p{i}", ids))
    return ListDataSource(prompts), lengths


class TargetLengthEngine:
    """The embedded AsyncEngine, each request stopped at its prompt's target length (EOS ignored)."""

    def __init__(self, engine: AsyncEngine, lengths: dict[tuple[int, ...], int]) -> None:
        self.engine = engine
        self.lengths = lengths

    def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        params = params or SamplingParams()
        remaining = self.lengths[tuple(input_ids[:4])] - (len(input_ids) - 4)
        params = replace(params, max_new_tokens=max(1, min(params.max_new_tokens, remaining)), ignore_eos=True)
        return self.engine.generate(input_ids, params, request_id)

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        return await self.engine.abort(request_ids)

    async def update_weights(self, weights: Any, version: int) -> Any:
        return await self.engine.update_weights(weights, version)

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        await self.engine.release_memory(tags)

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        await self.engine.resume_memory(tags)

    def stats(self) -> Any:
        return self.engine.stats()

    def health(self) -> dict[str, Any]:
        return self.engine.health()


def _reward(prompt: Prompt, response: np.ndarray) -> float:
    return float(len(response) % 7)


async def side_by_side(model_name: str) -> dict[str, float]:
    hidden, layers = MODELS[model_name]
    config = ModelConfig(vocab_size=128, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CAP + 8)
    model = LlamaForCausalLM(config)
    model.init_weights(0)
    data, lengths = _prompts(N * STEPS * 3)
    loops, engines, totals = {}, [], {}
    for mode, partial in (("baseline", False), ("april", True)):
        core = EngineCore(model, EngineConfig(num_blocks=4096, max_num_seqs=256, memory_tag_prefix=f"bench-{mode}-"))
        engine = AsyncEngine(core)
        await engine.start()
        engines.append(engine)
        cfg = scheduler_config_for(SchedulerConfig(rollout_batch_size=N, n_samples_per_prompt=N_SAMPLES,
                                                   over_sampling_batch_size=N * 3 // 2, max_response_len=CAP), partial)
        loops[mode] = RolloutLoop(TargetLengthEngine(engine, lengths), Scheduler(cfg, data), _reward,
                                  engine_capacity=256)
        totals[mode] = [0, 0.0]
    try:
        for _ in range(STEPS):
            for mode, loop in loops.items():
                metrics = (await loop.run_step(0)).metrics
                totals[mode][0] += metrics.generated_tokens
                totals[mode][1] += metrics.wall_s
    finally:
        for engine in engines:
            await engine.close()
    out = {f"{mode}_tokens_per_s": tokens / seconds for mode, (tokens, seconds) in totals.items()}
    out["april_gain"] = out["april_tokens_per_s"] / out["baseline_tokens_per_s"] - 1
    return out


class FreeEngine:
    """Produces every token at once (no model): what remains is the loop's and scheduler's own cost."""

    def __init__(self, length: int) -> None:
        self.length = length

    async def generate(self, input_ids: Sequence[int], params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        rid = request_id or "r"
        for i in range(self.length):
            await asyncio.sleep(0)
            yield GenerationChunk(rid, [5], [-1.0], 0)
        yield GenerationChunk(rid, [], [], 0, FinishReason.STOP)

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        return []

    async def update_weights(self, weights: Any, version: int) -> None:
        return None

    async def release_memory(self, tags: Iterable[str] | None = None) -> None:
        return None

    async def resume_memory(self, tags: Iterable[str] | None = None) -> None:
        return None

    def stats(self) -> dict[str, Any]:
        return {}

    def health(self) -> dict[str, Any]:
        return {"status": "ok"}


async def loop_overhead(length: int = 64) -> float:
    data = ListDataSource([Prompt(f"p{i}", (1, 4, 5, 3)) for i in range(64)])
    sched = Scheduler(SchedulerConfig(rollout_batch_size=8, n_samples_per_prompt=8, over_sampling_batch_size=8,
                                      max_response_len=length), data)
    loop = RolloutLoop(FreeEngine(length), sched, _reward, clock=time.perf_counter)
    metrics = (await loop.run_step(0)).metrics
    return metrics.generated_tokens / metrics.wall_s


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_april_vs_baseline_rollout_throughput(benchmark, model_name):
    result = benchmark.pedantic(lambda: asyncio.run(side_by_side(model_name)), rounds=1, iterations=1)
    benchmark.extra_info.update(result)


def test_loop_overhead_tokens_per_s(benchmark):
    rate = benchmark.pedantic(lambda: asyncio.run(loop_overhead()), rounds=3, iterations=1)
    benchmark.extra_info["tokens_per_s"] = rate


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("| model | baseline tokens/s | APRIL tokens/s | APRIL gain |")
    print("|---|---|---|---|")
    for name in MODELS:
        r = asyncio.run(side_by_side(name))
        print(f"| {name} | {r['baseline_tokens_per_s']:.0f} | {r['april_tokens_per_s']:.0f} | {r['april_gain']:+.1%} |")
    print(f"loop + scheduler alone: {asyncio.run(loop_overhead()):.0f} tokens/s")
