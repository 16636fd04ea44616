"""Weight-sync time per GB: broadcast vs disk vs tensor, to `april-ext serve` workers on this machine.

    OMP_NUM_THREADS=1 python bench/bench_weight_sync.py [--size-mb 256] [--workers 2] [--rounds 3]

Side by side in one run: `workers` embedded servers (`python -m april_ext.server`, one process each, on a
random-init Llama of about size_mb MiB of fp32 weights) receive the same named tensors through
SGLangEngine.update_weights with weight_sync "broadcast" (gloo group, buckets of --bucket-mb MiB),
"disk" (a safetensors file in a temporary directory, loaded by every worker) and "tensor" (a base64
safetensors blob in each request). Reported per method: the best and the median of `rounds` updates
(after one warm-up update, which for broadcast also builds the group), and seconds per GB of weights
(one copy; every worker receives it). The time is the trainer's: from the call until every worker
answered, the weights loaded into its engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time

import torch

from april_ext.model import LlamaForCausalLM, ModelConfig, save_pretrained
from april_ext.sglang import (
    SGLangEngine,
    SGLangEngineConfig,
    SGLangServerArgs,
    launch_sglang_server,
)

METHODS = ("broadcast", "disk", "tensor")


def model_config(size_mb: float) -> ModelConfig:
    """A Llama whose fp32 weights take about size_mb MiB (layers of hidden 512 added until they do)."""
    hidden, vocab = 512, 8192
    per_layer = 4 * hidden * hidden + 3 * hidden * (3 * hidden) + 2 * hidden
    fixed = 2 * vocab * hidden + hidden
    layers = max(1, round((size_mb * 2**20 / 4 - fixed) / per_layer))
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256)


async def measure(urls: list[str], method: str, tensors: list[tuple[str, torch.Tensor]], rounds: int,
                  bucket_mb: float, sync_dir: str) -> list[float]:
    config = SGLangEngineConfig(worker_urls=tuple(urls), weight_sync=method, weight_bucket_mb=bucket_mb,
                                weight_sync_dir=sync_dir if method == "disk" else None, timeout_s=600.0)
    times = []
    async with SGLangEngine(config) as engine:
        for version in range(rounds + 1):
            started = time.perf_counter()
            await engine.update_weights(tensors, 100 * (METHODS.index(method) + 1) + version)
            if version:  # the first is the warm-up
                times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mb", type=float, default=256.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--methods", default=",".join(METHODS))
    args = parser.parse_args()
    config = model_config(args.size_mb)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as root, contextlib.ExitStack() as stack:
        model.init_weights(seed=0)
        save_pretrained(model, f"{root}/initial")  # what the workers start from
        model.init_weights(seed=1)
        tensors = [(n, t.detach().clone()) for n, t in model.state_dict().items()]
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        gb = nbytes / 1e9
        server_args = SGLangServerArgs(model_path=f"{root}/initial", extra_args=(
            "--num-blocks", "16", "--block-size", "16",
            "--max-request-bytes", str(4 * nbytes + (64 << 20)), "--weight-group-timeout", "300"))
        urls = [stack.enter_context(launch_sglang_server(server_args, module="april_ext.server", timeout_s=300,
                                                         env={"OMP_NUM_THREADS": "1"})).url
                for _ in range(args.workers)]
        print(f"{len(tensors)} tensors, {nbytes / 2**20:.0f} MiB fp32, {args.workers} workers, "
              f"{torch.get_num_threads()} torch threads here")
        print(f"{'method':<10} {'best s':>8} {'median s':>9} {'s/GB':>7}")
        for method in args.methods.split(","):
            times = asyncio.run(measure(urls, method, tensors, args.rounds, args.bucket_mb, f"{root}/sync"))
            best, median = min(times), statistics.median(times)
            print(f"{method:<10} {best:>8.2f} {median:>9.2f} {best / gb:>7.2f}", flush=True)


if __name__ == "__main__":
    main()
