"""Three places where a planted defect once passed the whole suite (issue 33's mutation run): the version a
carried chunk keeps when it arrives after the next begin_step, the decoupled loss's weight cap at its boundary,
and GRPO / Dr. GRPO advantages by value through the run's settings."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from _scheduler_utils import feed, finish_group, make, reward_all
from april_ext.algorithms import PolicyLossInputs, aggregation_weights, policy_loss, sample_advantages
from april_ext.training.config import TrainConfig
from april_ext.training.trainers import algorithm_config


def test_a_carried_chunk_of_an_older_version_arriving_after_begin_step_keeps_its_version_and_is_masked():
    """carry: tokens the engine made under version 0 reach the scheduler only after begin_step(1). They keep
    version 0 (not the scheduler's current one), are masked under mask_offpolicy and count as off-policy."""
    sched = make(step_boundary="carry", mask_offpolicy=True)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 8
    finish_group(sched, 0, 2, version=0)
    finish_group(sched, 1, 2, version=0)
    for sid in range(4, 8):
        feed(sched, sid, 2, 0)
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    feed(sched, 4, 1, 0)  # made before the update, delivered after begin_step(1)
    feed(sched, 5, 1, 0)
    assert sched.sample(4).versions.tolist() == [0, 0, 0]
    feed(sched, 4, 2, 1)
    feed(sched, 5, 1, 1)
    sched.on_finish(4, "stop")
    sched.on_finish(5, "stop")
    reward_all(sched)
    for sid in (6, 7):  # group 3 finishes under version 1 too, so the step has N = 2 groups
        feed(sched, sid, 1, 1)
        sched.on_finish(sid, "stop")
    reward_all(sched)
    batch = sched.take_batch()
    assert sorted(batch.sample_ids.tolist()) == [4, 5, 6, 7]
    expected = {4: [0, 0, 0, 1, 1], 5: [0, 0, 0, 1], 6: [0, 0, 1], 7: [0, 0, 1]}
    offpolicy = 0
    for i, sid in enumerate(batch.sample_ids.tolist()):
        lo, hi = int(batch.offsets[i]) + int(batch.prompt_lens[i]), int(batch.offsets[i + 1])
        versions = batch.versions[lo:hi].tolist()
        assert versions == expected[sid], sid
        assert batch.loss_mask[lo:hi].tolist() == [int(v == 1) for v in versions], sid
        offpolicy += sum(v == 0 for v in versions)
    stats = sched.stats()
    assert stats["batch_offpolicy_tokens"] == offpolicy == 10
    assert stats["batch_masked_tokens"] == 10


def _loss_at_weight(cap: float, log_weight: float) -> tuple[float, float]:
    """One token with ratio 1 and advantage -1 whose pi_old / pi_behavior is exp(log_weight): (loss, masked
    share). Kept, its loss is the weight; masked by the cap, 0."""
    old = torch.tensor([0.0])
    mask = torch.tensor([1.0])
    seq = torch.tensor([0])
    inputs = PolicyLossInputs(
        logprobs=torch.tensor([0.0], requires_grad=True), old_logprobs=old,
        behavior_logprobs=torch.tensor([-log_weight], dtype=torch.float32),
        advantages=torch.tensor([-1.0]), mask=mask, weights=aggregation_weights(mask, seq, 1, "token"),
        seq_index=seq, n_seqs=1)
    config = algorithm_config(TrainConfig(use_decoupled_loss=True, behav_imp_weight_cap=cap))
    out = policy_loss(config, inputs)
    return out.loss.item(), out.metrics["behav_masked_frac"].item()


def test_the_decoupled_weight_cap_keeps_a_weight_at_the_cap_and_masks_one_just_above():
    cap_log = math.log(2.0)
    # The cap as the float32 weight the loss computes, so "at the cap" is exact.
    at = float(torch.exp(torch.tensor([cap_log], dtype=torch.float32))[0])
    below_loss, below_masked = _loss_at_weight(at, cap_log - 1e-3)
    assert below_masked == 0.0 and below_loss == pytest.approx(math.exp(cap_log - 1e-3), rel=1e-5)
    at_loss, at_masked = _loss_at_weight(at, cap_log)
    assert at_masked == 0.0 and at_loss == pytest.approx(at, rel=1e-6)
    for above in (cap_log + 1e-3, math.log(2.5), math.log(2.99)):  # just above, and within 1 of the cap
        loss, masked = _loss_at_weight(at, above)
        assert (loss, masked) == (0.0, 1.0), above


@pytest.mark.parametrize("algorithm, expected", [("grpo", [1.0, -1.0, 0.0]), ("drgrpo", [2.0, -2.0, 0.0])])
def test_group_advantages_by_value_through_the_runs_settings(algorithm, expected):
    """Rewards [4, 0, 2]: mean 2, unbiased std 2, so GRPO gives [1, -1, 0] and Dr. GRPO (no std) [2, -2, 0]; a
    second group [1, 1, 1] gives zeros either way."""
    config = algorithm_config(TrainConfig(algorithm=algorithm))
    rewards = np.array([4.0, 0.0, 2.0, 1.0, 1.0, 1.0], np.float32)
    groups = np.array([0, 0, 0, 1, 1, 1], np.int32)
    values = sample_advantages(config, rewards, groups).tolist()
    assert values == pytest.approx(expected + [0.0, 0.0, 0.0], abs=1e-5)
