"""Where a divided rollout's continuations land on two embedded servers: least-loaded routing by the servers'
reported KV (the SGLang adapter's ``least_loaded``, which a Ray run uses with ``ray_routing = "least_loaded"``)
against sglang-router's ``cache_aware`` (``ray_routing = "router"``).

    OMP_NUM_THREADS=1 python bench/bench_continuation_routing.py [--samples 4 16] [--repeats 3]

Each sample is generated in chunks of ``--chunk`` tokens (greedy, to its length): all samples start at once, and
each chunk that ends is sent again at once as a continuation (prompt + the response so far), as the scheduler
does with ``chunk_tokens``. A continuation on the server that ran its previous chunk finds its KV in that server's
prefix cache; elsewhere it is prefilled again. Reported per routing: the continuations whose server is known (least
loaded: the client's pick; the router does not say) and how many of them landed where their KV is, and for both
the share of the continuations' context that the servers' prefix caches served (their own counters), and the time
of a run. The two routings take turns on the same two servers; every run has prompts of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
import urllib.request
from typing import Any

from april_ext.cluster.router import Router
from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.sglang import SGLangEngine, SGLangEngineConfig, SGLangServerArgs, launch_sglang_server

MODEL = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512, rope_theta=1000.0, eos_token_id=None)
PROMPT_LEN = 24


def counters(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/server_info", timeout=10) as response:
        state = json.loads(response.read())["internal_states"][0]
    return {k: int(state[k]) for k in ("prefill_tokens", "prefix_cache_hit_tokens")}


async def rollout(config: SGLangEngineConfig, samples: int, chunk: int, chunks: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, MODEL.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(samples)]
    params = SamplingParams(max_new_tokens=chunk, temperature=0.0, ignore_eos=True)
    known = kept = context = 0
    async with SGLangEngine(config) as engine:
        direct = config.router_url is None

        async def sample(i: int) -> None:
            nonlocal known, kept, context
            ids, where = list(prompts[i]), None
            for c in range(chunks):
                rid = f"s{seed}-{i}-{c}"
                stream = engine.generate(ids, params, rid)
                first = await anext(stream)
                # The client's pick, read while the request runs (it leaves the table when it ends).
                state = engine._inflight.get(rid) if direct else None
                url = state.url if state is not None else None
                tokens = list(first.token_ids) + [t async for chunk_ in stream for t in chunk_.token_ids]
                if c > 0:
                    context += len(ids)
                    if url is not None and where is not None:
                        known += 1
                        kept += url == where
                ids, where = ids + tokens, url

        await asyncio.gather(*(sample(i) for i in range(samples)))
    return {"known": known, "kept": kept, "continuations": samples * (chunks - 1), "context": context}


async def measure(urls: list[str], router: Router, args: argparse.Namespace) -> dict[tuple[str, int], dict[str, int]]:
    routings = {"least_loaded": SGLangEngineConfig(worker_urls=tuple(urls), balance="least_loaded"),
                "cache_aware router": SGLangEngineConfig(router_url=router.url)}
    totals: dict[tuple[str, int], dict[str, int]] = {}
    seed = 0
    for samples in args.samples:
        for _ in range(args.repeats):
            for name, config in routings.items():
                seed += 1
                before = [counters(u) for u in urls]
                start = time.perf_counter()
                out = await rollout(config, samples, args.chunk, args.chunks, seed)
                out["ms"] = round(1000 * (time.perf_counter() - start))
                after = [counters(u) for u in urls]
                out["hits"] = sum(a["prefix_cache_hit_tokens"] - b["prefix_cache_hit_tokens"]
                                  for a, b in zip(after, before))
                total = totals.setdefault((name, samples), {})
                for key, value in out.items():
                    total[key] = total.get(key, 0) + value
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 16], help="samples at once")
    parser.add_argument("--chunk", type=int, default=32, help="tokens per chunk (chunk_tokens)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks per sample")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaForCausalLM(MODEL)
        model.init_weights(0)
        save_pretrained(model, os.path.join(tmp, "model"))
        extra = ("--num-blocks", "1024", "--block-size", "4", "--max-num-seqs", "16")
        servers = [launch_sglang_server(SGLangServerArgs(model_path=os.path.join(tmp, "model"), extra_args=extra),
                                        module="april_ext.server", env={"OMP_NUM_THREADS": "1"}, timeout_s=180,
                                        log_path=os.path.join(tmp, f"server{i}.log")) for i in range(2)]
        router = None
        try:
            router = Router.launch([s.url for s in servers], os.path.join(tmp, "router.log"), 60, 600)
            totals = asyncio.run(measure([s.url for s in servers], router, args))
        finally:
            if router is not None:
                router.stop()
            for server in servers:
                server.stop()
    print(f"{args.repeats} runs each; chunks of {args.chunk} tokens, {args.chunks} per sample, prompts of "
          f"{PROMPT_LEN} tokens, block size 4")
    print("| routing | samples | continuations | landed where their KV is | context served by the prefix cache | "
          "rollout time (mean) |")
    print("|---|---|---|---|---|---|")
    for (name, samples), t in totals.items():
        landed = f"{t['kept']} of {t['known']}" if t["known"] else "not known"
        print(f"| {name} | {samples} | {t['continuations']} | {landed} | {t['hits'] / t['context']:.0%} | "
              f"{t['ms'] / args.repeats / 1000:.2f} s |")


if __name__ == "__main__":
    main()
