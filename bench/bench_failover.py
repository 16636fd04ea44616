"""How fast SGLang failover reacts (april_ext.sglang.failover), on `april-ext serve` processes on loopback.

    OMP_NUM_THREADS=1 python bench/bench_failover.py [--trials 3] [--timeout 2.0]

Two servers, direct urls, worker_timeout_s = --timeout. Per trial, with 8 long greedy requests in
flight on both, one server gets SIGKILL (then is restarted on its port) or SIGSTOP (then SIGCONT).
Reported per fault, median and max over the trials: from the signal to the worker's removal, from the
signal to the end (as ABORT) of the last request it was running, and from the restart / SIGCONT to its
rejoin with the current weights (pushed as version 1 before the trials).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import tempfile
import time

import torch

from april_ext.batch import FinishReason
from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained
from april_ext.protocol import SamplingParams
from april_ext.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangServerArgs,
    SGLangServerProcess,
    free_port,
    launch_sglang_server,
)

CONFIG = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=512, rope_theta=1000.0, eos_token_id=None)
LONG = SamplingParams(max_new_tokens=400, temperature=0.0, ignore_eos=True)


def launch(ckpt: str, port: int, log: str) -> SGLangServerProcess:
    args = SGLangServerArgs(model_path=ckpt, port=port, extra_args=("--num-blocks", "1024", "--block-size", "4",
                                                                    "--max-num-seqs", "4"))
    return launch_sglang_server(args, module="april_ext.server", env={"OMP_NUM_THREADS": "1"}, timeout_s=120,
                                log_path=log)


async def until(predicate, timeout_s: float = 60.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


async def trial(engine: SGLangEngine, servers: list[SGLangServerProcess], fault: str, ckpt: str, tmp: str,
                rejoins: int) -> tuple[float, float, float]:
    victim = servers[0]
    ended: dict[str, float] = {}
    on_victim: set[str] = set()

    async def consume(i: int) -> None:
        rid = f"{fault}-{rejoins}-{i}"
        async for chunk in engine.generate([3 + i, 7, 11], LONG, rid):
            if chunk.token_ids and engine._inflight.get(rid) is not None \
                    and engine._inflight[rid].url == victim.url:
                on_victim.add(rid)
            if chunk.finish_reason is FinishReason.ABORT:
                ended[rid] = time.monotonic()

    tasks = [asyncio.create_task(consume(i)) for i in range(8)]
    await until(lambda: len(on_victim) >= 2)
    signalled = time.monotonic()
    os.killpg(victim.process.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    removed = signalled + await until(lambda: victim.url in engine.pool_health()["removed"])
    await until(lambda: on_victim <= set(ended))
    last_end = max(ended[r] for r in on_victim)
    await engine.abort()
    await asyncio.gather(*tasks)
    if fault == "kill":
        victim.stop()
        servers[0] = await asyncio.to_thread(launch, ckpt, int(victim.url.rsplit(":", 1)[1]), f"{tmp}/again.log")
    else:
        os.killpg(victim.process.pid, signal.SIGCONT)
    back = time.monotonic()
    await until(lambda: engine.pool_health()["rejoins"] == rejoins + 1)
    return removed - signalled, last_end - signalled, time.monotonic() - back


async def main(trials: int, timeout_s: float) -> None:
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="bench-failover-")
    served, trained = LlamaForCausalLM(CONFIG), LlamaForCausalLM(CONFIG)
    served.init_weights(1)
    trained.init_weights(2)
    save_pretrained(served, f"{tmp}/ckpt")
    servers = [launch(f"{tmp}/ckpt", free_port(), f"{tmp}/server{i}.log") for i in range(2)]
    try:
        config = SGLangEngineConfig(worker_urls=tuple(s.url for s in servers), worker_timeout_s=timeout_s,
                                    weight_sync_dir=f"{tmp}/sync", abort_timeout_s=20.0)
        async with SGLangEngine(config) as engine:
            await engine.update_weights(dict(trained.named_parameters()), version=1)
            results: dict[str, list[tuple[float, float, float]]] = {"kill": [], "stop": []}
            rejoins = 0
            for fault in ("kill", "stop"):
                for _ in range(trials):
                    results[fault].append(await trial(engine, servers, fault, f"{tmp}/ckpt", tmp, rejoins))
                    rejoins += 1
            assert set((await engine.weight_versions()).values()) == {"1"}
    finally:
        for server in servers:
            try:
                os.killpg(server.process.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            server.stop()
    print(f"worker_timeout_s = {timeout_s}, {trials} trials each (median / max, seconds)")
    print(f"{'fault':<8}{'removed':>16}{'requests ended':>18}{'rejoined':>16}")
    for fault, rows in results.items():
        cells = ["{:.2f} / {:.2f}".format(statistics.median(c), max(c)) for c in zip(*rows)]
        print(f"{fault:<8}{cells[0]:>16}{cells[1]:>18}{cells[2]:>16}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=2.0)
    cli = parser.parse_args()
    asyncio.run(main(cli.trials, cli.timeout))
