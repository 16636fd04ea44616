"""What the SGLang HTTP path costs over calling the embedded engine directly (pytest-benchmark, or a script).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_sglang.py      # prints the table
    .venv/bin/python -m pytest bench/bench_sglang.py --benchmark-only -q

Side by side in one run, on the same engine settings and requests: AsyncEngine called in-process vs
SGLangEngine -> loopback HTTP -> EmbeddedServer -> AsyncEngine, with the server in a thread of the
benchmark's process (sharing its GIL; streamed, and with stream=False) and in a process of its own (`python -m april_ext.server`,
started by launch_sglang_server, as an SGLang server would be). Two models: "tiny" (hidden 64, 2
layers: compute is negligible, so the ratio is the HTTP path's own cost) and "small" (hidden 256, 4 layers, vocab 2048, as bench_engine.py). Reported:
generated tokens/s (best of 3 after a warm-up round) for 16 concurrent greedy requests of 64 tokens
(stream interval 1, one SSE event per token), and the abort latency (median of 3): from abort() with
16 requests decoding to the end of every stream.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.server import ServerConfig, ServerThread
from april_ext.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangServerArgs,
    launch_sglang_server,
)

MODELS = {
    "tiny": ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
    "small": ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024),
}
REQUESTS = 16
TOKENS = 64
ROUNDS = 3
_prefixes = iter(range(1_000_000))


def make_core(name: str) -> EngineCore:
    model = LlamaForCausalLM(MODELS[name])
    model.init_weights(seed=0)
    config = EngineConfig(block_size=16, num_blocks=512, max_num_seqs=64, max_num_batched_tokens=2048,
                          memory_tag_prefix=f"bench{next(_prefixes)}-")
    return EngineCore(model, config)


def prompts(name: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, MODELS[name].vocab_size, (48,), generator=gen).tolist() for _ in range(REQUESTS)]


async def _throughput(engine: Any, ids: list[list[int]]) -> float:
    """Best of ROUNDS after a warm-up round (first calls pay one-time allocation and dispatch costs)."""
    params = SamplingParams(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)

    async def one(rnd: int, i: int) -> int:
        return sum([len(c.token_ids) async for c in engine.generate(ids[i], params, f"b-{rnd}-{i}")])

    best = 0.0
    for rnd in range(ROUNDS + 1):
        start = time.perf_counter()
        generated = sum(await asyncio.gather(*(one(rnd, i) for i in range(len(ids)))))
        if rnd > 0:
            best = max(best, generated / (time.perf_counter() - start))
    return best


async def _abort_latency(engine: Any, ids: list[list[int]], inflight: Callable[[], int]) -> float:
    """Median of ROUNDS: seconds from abort() with every request decoding to the end of every stream."""
    params = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)
    times = []
    for rnd in range(ROUNDS):
        streams = [asyncio.create_task(_drain(engine, ids[i], params, f"a-{rnd}-{i}")) for i in range(len(ids))]
        while inflight() < len(ids):
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # every request is past its prefill and decoding
        start = time.perf_counter()
        await engine.abort()
        await asyncio.gather(*streams)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


async def _drain(engine: Any, ids: list[int], params: SamplingParams, rid: str) -> None:
    async for _ in engine.generate(ids, params, rid):
        pass


@dataclass
class Row:
    model: str
    path: str
    tokens_per_s: float
    abort_ms: float


async def _direct(name: str) -> Row:
    ids = prompts(name)
    async with AsyncEngine(make_core(name)) as engine:
        rate = await _throughput(engine, ids)
        abort_s = await _abort_latency(engine, ids, lambda: engine.stats().running)
    return Row(name, "AsyncEngine (in-process)", rate, abort_s * 1e3)


async def _http(name: str, url: str, path: str, stream: bool = True) -> Row:
    ids = prompts(name)
    async with SGLangEngine(SGLangEngineConfig(worker_urls=(url,), stream=stream)) as engine:
        rate = await _throughput(engine, ids)
        abort_s = await _abort_latency(engine, ids, lambda: sum(engine.stats().in_flight.values()))
    return Row(name, path, rate, abort_s * 1e3)


def measure(name: str) -> list[Row]:
    direct = asyncio.run(_direct(name))
    with ServerThread(make_core(name), ServerConfig(port=0)) as server:
        threaded = asyncio.run(_http(name, server.url, "SGLangEngine -> HTTP server thread"))
        whole = asyncio.run(_http(name, server.url, "same, stream=False", stream=False))
    with tempfile.TemporaryDirectory() as ckpt:
        save_pretrained(make_core(name).model, ckpt)
        args = SGLangServerArgs(model_path=ckpt, extra_args=("--num-blocks", "512", "--max-num-seqs", "64"))
        with launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"},
                                  timeout_s=300, log_path=os.path.join(ckpt, "server.log")) as server:
            process = asyncio.run(_http(name, server.url, "SGLangEngine -> HTTP server process"))
    return [direct, threaded, whole, process]


@pytest.mark.parametrize("name", list(MODELS))
def test_bench_http_path(benchmark: Any, name: str) -> None:
    rows = benchmark.pedantic(measure, args=(name,), rounds=1, iterations=1)
    benchmark.extra_info.update({f"{r.path} tokens/s": r.tokens_per_s for r in rows})
    assert all(r.tokens_per_s > 0 for r in rows)


def main() -> None:
    torch.set_num_threads(1)
    print(f"{REQUESTS} concurrent greedy requests x {TOKENS} tokens; abort with {REQUESTS} running")
    print("| model | path | tokens/s | HTTP / direct | abort latency (ms) |")
    print("|---|---|---:|---:|---:|")
    for name in MODELS:
        rows = measure(name)
        direct = rows[0]
        for row in rows:
            ratio = row.tokens_per_s / direct.tokens_per_s
            print(f"| {row.model} | {row.path} | {row.tokens_per_s:,.0f} | {ratio:.2f} | {row.abort_ms:.1f} |")


if __name__ == "__main__":
    main()
