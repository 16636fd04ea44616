"""train_step throughput of MegatronTrainer (one process, length-bucketed padding, torch AdamW) and
DistributedMegatronTrainer (packed THD rows, Megatron's DDP, optimizer and schedule) next to TorchTrainer
on the same weights and batch (pytest-benchmark, or a plain script that prints the tables).

    .venv/bin/python -m pytest bench/bench_megatron_trainer.py --benchmark-only -q
    .venv/bin/python bench/bench_megatron_trainer.py [--part trainers|packing|ranks ...] [--rounds N]

A Llama-style model (hidden 256, 4 layers, GQA 8/2, vocab 2048, fp32), 4 groups x 4 samples with
32-token prompts and long-tailed responses (log-normal, median 48, capped at 256), micro-batches of
1024 tokens; medians of N interleaved steps after a warm-up step. All trainers run the same RL step;
MegatronTrainer's model right-pads each micro-batch into buckets of similar lengths (reported as padded /
real tokens), the torch model and DistributedMegatronTrainer run the packed tokens only. The script's
parts:
- trainers: the three trainers in one process;
- packing: DistributedMegatronTrainer on the batch as is (packed) and on the same batch with every sample
  right-padded to the longest (what a [samples, longest] layout computes; the padding is outside the
  loss mask), tokens/s counting real tokens only;
- ranks: DistributedMegatronTrainer at equal global batch in one process and on two torchrun ranks (gloo:
  DP=2, and TP=2), every process with 1 torch thread; the one-process median is taken before and after
  the launch (the two show the load's drift).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from april_ext.batch import TrainingBatch
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.trainer import TorchTrainer, TrainerConfig, split_by_token_budget

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'april_ext[megatron]')")

from april_ext.trainer.megatron import MegatronTrainer, MegatronTrainerConfig, parallel
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
from april_ext.trainer.megatron.model import MegatronCausalLM, length_buckets
from april_ext.trainer.megatron.parallel import MegatronParallelConfig

MODEL = ModelConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
TRAINER = TrainerConfig(lr=1e-5, micro_batch_tokens=1024, mixed_precision="fp32")
GROUPS, SAMPLES, PROMPT = 4, 4, 32


def make_batch(version: int, seed: int = 0) -> TrainingBatch:
    gen = np.random.default_rng(seed)
    lengths = [min(256, max(1, int(math.exp(math.log(48) + 0.9 * gen.standard_normal()))))
               for _ in range(GROUPS * SAMPLES)]
    tokens, mask, logprobs, versions, offsets = [], [], [], [], [0]
    for n in lengths:
        tokens += gen.integers(0, MODEL.vocab_size, PROMPT + n).tolist()
        mask += [0] * PROMPT + [1] * n
        logprobs += [0.0] * PROMPT + (-gen.exponential(2.0, n)).tolist()
        versions += [-1] * PROMPT + [version] * n
        offsets.append(len(tokens))
    s = len(lengths)
    return TrainingBatch(
        tokens=np.asarray(tokens, np.int32), offsets=np.asarray(offsets, np.int64),
        prompt_lens=np.full(s, PROMPT, np.int32), loss_mask=np.asarray(mask, np.uint8),
        behavior_logprobs=np.asarray(logprobs, np.float32), versions=np.asarray(versions, np.int32),
        rewards=gen.integers(0, 2, s).astype(np.float32),
        group_index=np.repeat(np.arange(GROUPS), SAMPLES).astype(np.int32),
        sample_ids=np.arange(s, dtype=np.int64), finish_reasons=np.zeros(s, np.uint8), policy_version=version)


def padded_to_longest(batch: TrainingBatch) -> TrainingBatch:
    """``batch`` with every sample right-padded to the longest one (padding tokens 0, outside the loss
    mask): the work of a [samples, longest] layout on the packed trainer."""
    lengths = np.diff(batch.offsets)
    width = int(lengths.max())
    pad = width - lengths
    keep = np.ones(batch.n_tokens + int(pad.sum()), dtype=bool)
    for i in range(batch.n_samples):
        keep[i * width + lengths[i]:(i + 1) * width] = False

    def widen(values: np.ndarray, fill: float) -> np.ndarray:
        out = np.full(keep.shape, fill, dtype=values.dtype)
        out[keep] = values
        return out

    return TrainingBatch(
        tokens=widen(batch.tokens, 0), offsets=np.arange(batch.n_samples + 1, dtype=np.int64) * width,
        prompt_lens=batch.prompt_lens, loss_mask=widen(batch.loss_mask, 0),
        behavior_logprobs=widen(batch.behavior_logprobs, 0.0), versions=widen(batch.versions, -1),
        rewards=batch.rewards, group_index=batch.group_index, sample_ids=batch.sample_ids,
        finish_reasons=batch.finish_reasons, policy_version=batch.policy_version)


def padded_tokens(batch: TrainingBatch) -> int:
    """Tokens the Megatron model runs, padding included: per micro-batch, per length bucket."""
    lengths = np.diff(batch.offsets).tolist()
    total = 0
    for a, b in split_by_token_budget(lengths, TRAINER.micro_batch_tokens):
        for bucket in length_buckets(lengths[a:b], MegatronCausalLM.max_padding):
            total += max(lengths[a + i] for i in bucket) * len(bucket)
    return total


def make_trainers() -> tuple[TorchTrainer, MegatronTrainer, DistributedMegatronTrainer]:
    model = LlamaForCausalLM(MODEL)
    model.init_weights(0)
    config = MegatronTrainerConfig(model=MODEL, trainer=TRAINER)
    megatron = MegatronTrainer(config, model.named_parameters())
    distributed = DistributedMegatronTrainer(config, model.named_parameters())
    return TorchTrainer(copy.deepcopy(model), TRAINER), megatron, distributed


def time_steps(trainers: tuple[object, ...], rounds: int, shape: object = None) -> list[float]:
    """Median seconds of one train_step per trainer on the same samples, the trainers interleaved round
    by round (so load from other processes hits both alike), after one warm-up step each. shape: one
    function per trainer applied to its batch (None: the batch as is)."""
    times: list[list[float]] = [[] for _ in trainers]
    for r in range(rounds + 1):
        for k, trainer in enumerate(trainers):
            batch = make_batch(trainer.version)
            if shape is not None and shape[k] is not None:
                batch = shape[k](batch)
            start = time.perf_counter()
            trainer.train_step(batch)
            if r > 0:
                times[k].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


@pytest.fixture(scope="module")
def trainers():
    parallel.initialize()
    yield make_trainers()
    parallel.shutdown()


@pytest.mark.parametrize("which", ["torch", "megatron", "megatron_packed"])
def test_train_step(benchmark, trainers, which: str) -> None:
    trainer = trainers[["torch", "megatron", "megatron_packed"].index(which)]
    benchmark.pedantic(lambda: trainer.train_step(make_batch(trainer.version)), rounds=3, warmup_rounds=1)


def trainers_part(rounds: int) -> None:
    parallel.initialize()
    try:
        trainers = make_trainers()
        batch = make_batch(0)
        t_torch, t_megatron, t_packed = time_steps(trainers, rounds)
    finally:
        parallel.shutdown()
    n = batch.n_tokens
    print(f"threads={torch.get_num_threads()}  tokens/step={n}  padded/real (megatron)={padded_tokens(batch) / n:.2f}")
    print("| trainer | s/step | tokens/s | / torch |")
    print("|---|---:|---:|---:|")
    for name, t in (("TorchTrainer", t_torch), ("MegatronTrainer (buckets)", t_megatron),
                    ("DistributedMegatronTrainer (packed)", t_packed)):
        print(f"| {name} | {t:6.3f} | {n / t:8.0f} | {t / t_torch:.2f}x |")


def packing_part(rounds: int) -> None:
    model = LlamaForCausalLM(MODEL)
    model.init_weights(0)
    config = MegatronTrainerConfig(model=MODEL, trainer=TRAINER)
    parallel.initialize()
    try:
        trainers = (DistributedMegatronTrainer(config, model.named_parameters()),
                    DistributedMegatronTrainer(config, model.named_parameters()))
        t_packed, t_padded = time_steps(trainers, rounds, shape=(None, padded_to_longest))
    finally:
        parallel.shutdown()
    batch = make_batch(0)
    n, padded = batch.n_tokens, padded_to_longest(batch).n_tokens
    print(f"threads={torch.get_num_threads()}  real tokens/step={n}  padded to the longest={padded} "
          f"({padded / n:.2f}x)")
    print("| DistributedMegatronTrainer | tokens run | s/step | real tokens/s |")
    print("|---|---:|---:|---:|")
    print(f"| packed rows | {n} | {t_packed:6.3f} | {n / t_packed:8.0f} |")
    print(f"| padded to the longest | {padded} | {t_padded:6.3f} | {n / t_padded:8.0f} |")
    print(f"packing gain: {t_padded / t_packed:.2f}x")


RANK_LAYOUTS = {"dp2": MegatronParallelConfig(), "tp2": MegatronParallelConfig(tensor_model_parallel_size=2)}


def rank_worker(out: str, rounds: int) -> None:
    """One torchrun rank: each layout of RANK_LAYOUTS on the same global batch; rank 0 writes the medians."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model = LlamaForCausalLM(MODEL)
    model.init_weights(0)
    medians = {}
    for name, par in RANK_LAYOUTS.items():
        trainer = DistributedMegatronTrainer(MegatronTrainerConfig(model=MODEL, trainer=TRAINER, parallel=par),
                                             model.named_parameters())
        medians[name] = time_steps((trainer,), rounds)[0]
        parallel.shutdown()
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(medians))
    dist.destroy_process_group()


def one_process_median(rounds: int) -> float:
    model = LlamaForCausalLM(MODEL)
    model.init_weights(0)
    parallel.initialize()
    try:
        trainer = DistributedMegatronTrainer(MegatronTrainerConfig(model=MODEL, trainer=TRAINER),
                                             model.named_parameters())
        return time_steps((trainer,), rounds)[0]
    finally:
        parallel.shutdown()


def ranks_part(rounds: int, timeout_s: float = 1800) -> None:
    """One process (1 torch thread), then two ranks (1 thread each), then one process again: the two
    one-process medians show how much the machine's load drifted meanwhile."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = one_process_median(rounds)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        root = Path(__file__).resolve().parents[1]
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "ranks.json")
            env = {**os.environ, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                            "--master-addr=127.0.0.1", f"--master-port={port}", __file__, "--worker", out,
                            "--rounds", str(rounds)], env=env, check=True, timeout=timeout_s, cwd=root)
            medians = json.loads(Path(out).read_text())
        after = one_process_median(rounds)
    finally:
        torch.set_num_threads(threads)
    n = make_batch(0).n_tokens
    one = (before + after) / 2
    print(f"global batch: {n} tokens/step; every process 1 torch thread; two ranks on gloo")
    print("| DistributedMegatronTrainer | s/step | tokens/s | / one process |")
    print("|---|---:|---:|---:|")
    print(f"| one process, before / after | {before:6.3f} / {after:6.3f} | {n / one:8.0f} | 1.00x |")
    for name, t in medians.items():
        print(f"| two ranks, {name[:2].upper()}=2 | {t:6.3f} | {n / t:8.0f} | {one / t:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", action="append", choices=["trainers", "packing", "ranks"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        rank_worker(args.worker, args.rounds)
        return
    for part in args.part or ["trainers", "packing", "ranks"]:
        {"trainers": trainers_part, "packing": packing_part, "ranks": ranks_part}[part](args.rounds)


if __name__ == "__main__":
    main()
