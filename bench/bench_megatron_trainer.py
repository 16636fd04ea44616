"""train_step throughput of MegatronTrainer (one process, length-bucketed padding, torch AdamW) and
DistributedMegatronTrainer (a world of one here: packed THD rows, Megatron's DDP, optimizer and schedule)
next to TorchTrainer on the same weights and batch (pytest-benchmark, or a plain script that prints the
side-by-side table).

    .venv/bin/python -m pytest bench/bench_megatron_trainer.py --benchmark-only -q
    .venv/bin/python bench/bench_megatron_trainer.py

A Llama-style model (hidden 256, 4 layers, GQA 8/2, vocab 2048, fp32), 4 groups x 4 samples with
32-token prompts and long-tailed responses (log-normal, median 48, capped at 256), micro-batches of
1024 tokens; medians of 5 interleaved steps. All trainers run the same RL step; MegatronTrainer's model
right-pads each micro-batch into buckets of similar lengths (reported as padded / real tokens), the
torch model and DistributedMegatronTrainer run the packed tokens only.
"""

from __future__ import annotations

import copy
import math
import statistics
import time

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


def time_steps(trainers: tuple[object, ...], rounds: int) -> list[float]:
    """Median seconds of one train_step per trainer on the same samples, the trainers interleaved round
    by round (so load from other processes hits both alike), after one warm-up step each."""
    times: list[list[float]] = [[] for _ in trainers]
    for r in range(rounds + 1):
        for k, trainer in enumerate(trainers):
            batch = make_batch(trainer.version)
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


def main() -> None:
    parallel.initialize()
    try:
        trainers = make_trainers()
        batch = make_batch(0)
        t_torch, t_megatron, t_packed = time_steps(trainers, 5)
    finally:
        parallel.shutdown()
    n = batch.n_tokens
    print(f"threads={torch.get_num_threads()}  tokens/step={n}  padded/real (megatron)={padded_tokens(batch) / n:.2f}")
    print("| trainer | s/step | tokens/s | / torch |")
    print("|---|---:|---:|---:|")
    for name, t in (("TorchTrainer", t_torch), ("MegatronTrainer (buckets)", t_megatron),
                    ("DistributedMegatronTrainer (packed)", t_packed)):
        print(f"| {name} | {t:6.3f} | {n / t:8.0f} | {t / t_torch:.2f}x |")


if __name__ == "__main__":
    main()
