"""The counting task is learnable: GRPO (and REINFORCE++ with the KL reward shaping) updates of the torch
trainer on self-sampled groups raise the reward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _reference_rollout import pack_batch, sample_responses
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.algorithms import AlgorithmConfig
from april_ext.model import LlamaForCausalLM
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.trainer import TorchTrainer, TrainerConfig


@pytest.mark.parametrize("algorithm", [
    AlgorithmConfig.dapo(),
    # slime's REINFORCE++ with KL reward shaping (k3 to the initial policy) and whitened advantages.
    AlgorithmConfig.reinforce_plus_plus(kl_coef=0.01, kl_loss_type="k3", normalize_advantages=True),
], ids=["dapo", "reinforce_plus_plus_kl"])
def test_rl_raises_counting_reward_from_random_init(one_thread, algorithm):
    task = CountingTask(CountingTaskConfig(median_count=3, sigma=0.5, max_count=8, seed=1))
    model = LlamaForCausalLM(task.model_config())
    model.init_weights(0)
    trainer = TorchTrainer(model, TrainerConfig(algorithm=algorithm, lr=3e-3, device="cpu"))
    gen = torch.Generator().manual_seed(0)
    rewards = []
    for step in range(40):
        prompts = task.prompts(step * 8, 8)
        groups = sample_responses(model, [p.token_ids for p in prompts], n_samples=8,
                                  max_new_tokens=task.max_response_len(), eos_ids=[task.eos_id], generator=gen)
        scores = [[task.reward(p, r.tokens) for r in g] for p, g in zip(prompts, groups)]
        rewards.append(trainer.train_step(pack_batch(prompts, groups, scores, trainer.version))["reward_mean"])
    # Seen (dapo): ~0.14 over the first 10 steps, ~0.35 over the last 10.
    assert np.mean(rewards[-10:]) > np.mean(rewards[:10]) + 0.08, rewards
