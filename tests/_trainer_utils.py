"""Shared helpers of the trainer tests: a tiny counting-task model and freshly sampled batches."""

from __future__ import annotations

import torch
from _reference_rollout import pack_batch, sample_responses

from april_ext.batch import TrainingBatch
from april_ext.model import LlamaForCausalLM
from april_ext.tasks import CountingTask, CountingTaskConfig

TASK = CountingTask(CountingTaskConfig(median_count=3, sigma=0.5, max_count=8, seed=1))


def make_model(seed: int = 0) -> LlamaForCausalLM:
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64))
    model.init_weights(seed)
    return model


def make_batch(model: LlamaForCausalLM, version: int, *, seed: int = 0, groups: int = 3) -> TrainingBatch:
    prompts = TASK.prompts(seed * groups, groups)
    sampled = sample_responses(model, [p.token_ids for p in prompts], n_samples=4, max_new_tokens=9,
                               eos_ids=[TASK.eos_id], generator=torch.Generator().manual_seed(seed))
    rewards = [[TASK.reward(p, r.tokens) for r in g] for p, g in zip(prompts, sampled)]
    return pack_batch(prompts, sampled, rewards, version)


def cli_flags(settings: dict) -> list[str]:
    """TrainConfig settings as `april-ext train` flags (booleans as --name / --no-name)."""
    out = []
    for key, value in settings.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        else:
            out += [flag, str(value)]
    return out
