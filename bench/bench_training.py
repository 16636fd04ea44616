"""Trainer and loss microbenchmarks on the CPU (pytest-benchmark).

    .venv/bin/python -m pytest bench/bench_training.py --benchmark-only -q

train_step of the tiny counting-task model with one micro-batch vs many (token budget 64) on the same
batch; the policy losses (PPO token ratio vs GSPO sequence ratio) on 64K tokens; and the colocated
trainer's offload / onload (allocator pause / resume) of a 13.7M-parameter model after one step:
55 MB of weights and 110 MB of Adam moments with host backups, 55 MB of gradients without.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

import pytest
import torch

import april_ext.memory as mem
from april_ext.algorithms import (
    AlgorithmConfig,
    PolicyLossInputs,
    aggregation_weights,
    policy_loss,
)
from april_ext.model import LlamaForCausalLM
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.trainer import TorchTrainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _reference_rollout import pack_batch, sample_responses  # noqa: E402 - the tests' reference rollout

TASK = CountingTask(CountingTaskConfig(seed=7))


def _model(**overrides) -> LlamaForCausalLM:
    model = LlamaForCausalLM(TASK.model_config(**overrides))
    model.init_weights(0)
    return model


@pytest.fixture(scope="module")
def batch():
    model = _model()
    prompts = TASK.prompts(0, 8)
    groups = sample_responses(model, [p.token_ids for p in prompts], n_samples=8, max_new_tokens=32,
                              eos_ids=[TASK.eos_id], generator=torch.Generator().manual_seed(0))
    rewards = [[TASK.reward(p, r.tokens) for r in g] for p, g in zip(prompts, groups)]
    return pack_batch(prompts, groups, rewards, 0)


@pytest.mark.parametrize("micro_batch_tokens", [100_000, 64], ids=["one-micro-batch", "budget-64"])
def test_train_step(benchmark, batch, micro_batch_tokens):
    trainer = TorchTrainer(_model(), TrainerConfig(algorithm=AlgorithmConfig.dapo(), lr=1e-4, device="cpu",
                                                   micro_batch_tokens=micro_batch_tokens))

    def step():
        batch.policy_version = trainer.version
        return trainer.train_step(batch)

    metrics = benchmark(step)
    benchmark.extra_info["tokens"] = batch.n_tokens
    benchmark.extra_info["tokens_per_s"] = batch.n_tokens / benchmark.stats.stats.mean
    assert metrics["n_loss_tokens"] > 0


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_policy_loss_64k_tokens(benchmark, loss):
    gen = torch.Generator().manual_seed(0)
    n, seqs = 65536, 256
    seq_index = torch.arange(seqs).repeat_interleave(n // seqs)
    mask = torch.ones(n)
    lp = (torch.randn(n, generator=gen) * 0.1 - 1).requires_grad_()
    old = lp.detach() + torch.randn(n, generator=gen) * 0.05
    cfg = AlgorithmConfig(loss=loss, tis_cap=2.0)
    inputs = PolicyLossInputs(lp, old, old - 0.01, torch.randn(n, generator=gen), mask,
                              aggregation_weights(mask, seq_index, seqs, cfg.aggregation), seq_index, seqs)

    def run():
        out = policy_loss(cfg, inputs)
        out.loss.backward()
        return out

    benchmark(run)


def test_colocated_offload_onload(benchmark, batch):
    tag = f"bench-trainer-{uuid.uuid4().hex[:8]}"
    model = _model(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8)
    trainer = TorchTrainer(model, TrainerConfig(lr=1e-4, device="cpu", colocated=True, memory_tag=tag))
    params = sum(p.numel() for p in trainer.params)
    batch.policy_version = trainer.version
    trainer.train_step(batch)

    def cycle():
        trainer.offload()
        trainer.onload()

    benchmark(cycle)
    benchmark.extra_info["parameters"] = params
    benchmark.extra_info["tag_bytes"] = mem.stats()[tag].physical_bytes
