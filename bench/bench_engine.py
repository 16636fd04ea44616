"""Generation throughput of the embedded engine on CPU (pytest-benchmark, or a plain script).

    .venv/bin/python -m pytest bench/bench_engine.py --benchmark-only -q
    .venv/bin/python bench/bench_engine.py          # prints the table

A small Llama-style model (hidden 256, 4 layers, GQA 8/2, vocab 2048, fp32), prompts of 32-128 tokens
and long-tailed response lengths (log-normal, median ~40, capped at 256, EOS ignored) at batch 1, 16
and 64. Reported: generated tokens/s end to end, and the split of step time into prefill (steps that
process prompt tokens) and pure decode steps, each as tokens/s of that phase.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch

from april_ext.engine import EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.protocol import SamplingParams

MODEL = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
BATCHES = (1, 16, 64)


@dataclass
class Result:
    batch: int
    generated: int
    seconds: float
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds

    def row(self) -> str:
        return (f"| {self.batch:5d} | {self.generated:9d} | {self.tokens_per_s:12.1f} | "
                f"{self.prefill_tokens / self.prefill_seconds:15.1f} | {self.decode_tokens / self.decode_seconds:14.1f} |")


def workload(batch: int, seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(batch):
        prompt_len = int(torch.randint(32, 129, (1,), generator=gen))
        # Log-normal lengths: most responses are short, a few reach the cap (the RL long tail).
        length = min(256, max(1, int(math.exp(math.log(40) + 0.9 * float(torch.randn(1, generator=gen))))))
        prompt = torch.randint(0, MODEL.vocab_size, (prompt_len,), generator=gen).tolist()
        requests.append((prompt, SamplingParams(temperature=1.0, seed=i, max_new_tokens=length, ignore_eos=True)))
    return requests


def make_engine() -> EngineCore:
    model = LlamaForCausalLM(MODEL)
    model.init_weights(seed=0)
    return EngineCore(model, EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=64,
                                          max_num_batched_tokens=1024))


def run(core: EngineCore, batch: int) -> Result:
    for prompt, params in workload(batch):
        core.add_request(prompt, params)
    prefill_s = decode_s = 0.0
    start = core.stats()
    begin = time.perf_counter()
    while core.has_unfinished():
        before = core.stats().prefill_tokens
        t = time.perf_counter()
        core.step()
        elapsed = time.perf_counter() - t
        if core.stats().prefill_tokens > before:
            prefill_s += elapsed
        else:
            decode_s += elapsed
    total = time.perf_counter() - begin
    stats = core.stats()
    return Result(batch, stats.generated_tokens - start.generated_tokens, total,
                  stats.prefill_tokens - start.prefill_tokens, prefill_s, stats.decode_tokens - start.decode_tokens,
                  decode_s)


@pytest.mark.parametrize("batch", BATCHES)
def test_generation_throughput(benchmark, batch: int) -> None:
    core = make_engine()
    run(core, 1)  # warm-up
    result = benchmark.pedantic(run, args=(core, batch), rounds=1, iterations=1)
    benchmark.extra_info.update(tokens_per_s=result.tokens_per_s, generated=result.generated,
                                prefill_tokens_per_s=result.prefill_tokens / result.prefill_seconds,
                                decode_tokens_per_s=result.decode_tokens / result.decode_seconds)
    assert result.generated == sum(p.max_new_tokens for _, p in workload(batch))


def main() -> None:
    core = make_engine()
    run(core, 1)
    print(f"torch threads: {torch.get_num_threads()}")
    print("| batch | generated | tokens/s e2e | prefill tok/s | decode tok/s |")
    print("|------:|----------:|-------------:|----------------:|---------------:|")
    for batch in BATCHES:
        print(run(core, batch).row())


if __name__ == "__main__":
    main()
