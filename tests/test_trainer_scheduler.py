"""The scheduler feeding the torch trainer: counting-task prompts from the scheduler's data source,
plain-torch generation in chunks with aborts and resumes (APRIL over-sampling), DAPO's group filter,
and TrainingBatches that train across policy versions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _reference_rollout import sample_responses
from _torch_threads import one_thread  # noqa: F401 (fixture)
from _trainer_utils import TASK, make_model

from april_ext import Scheduler, SchedulerConfig
from april_ext.algorithms import AlgorithmConfig, reject_uniform_groups
from april_ext.batch import FinishReason, TrainingBatch
from april_ext.trainer import TorchTrainer, TrainerConfig

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 2


def run_step(sched: Scheduler, trainer: TorchTrainer, gen: torch.Generator) -> TrainingBatch:
    """One APRIL step: generate in chunks until N groups are accepted, abort the rest, train."""
    sched.begin_step(trainer.version)
    running: dict[int, tuple[list[int], int]] = {}  # sample -> (prompt + tokens so far, tokens left)
    while not sched.step_done:
        for r in sched.dispatch():
            running[r.sample_id] = (r.input_ids.tolist(), r.max_new_tokens)
        ids = sorted(running)
        outs = sample_responses(trainer.model, [running[s][0] for s in ids], n_samples=1, max_new_tokens=CHUNK,
                                eos_ids=[TASK.eos_id], generator=gen)
        for sid, (out,) in zip(ids, outs):
            seq, left = running[sid]
            tokens, logprobs = out.tokens[:left], out.logprobs[:left]
            left -= len(tokens)
            if TASK.eos_id in tokens or left == 0:
                reason = FinishReason.STOP if TASK.eos_id in tokens else FinishReason.LENGTH
                sched.on_finish(sid, reason, tokens, logprobs, trainer.version)
                del running[sid]
            else:
                sched.on_tokens(sid, tokens, logprobs, trainer.version)
                running[sid] = (seq + tokens, left)
        for group in sched.pop_completed_groups():
            rewards = [TASK.reward(group.prompt, r.tolist()) for r in group.responses]
            sched.report_rewards(group.group_id, rewards, accepted=reject_uniform_groups(rewards))
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, FinishReason.ABORT)
    batch = sched.take_batch()
    assert batch.n_groups == sched.config.rollout_batch_size
    # The dynamic-sampling filter let no group with uniform rewards through.
    assert all(np.ptp(batch.rewards[batch.group_index == g]) > 0 for g in range(batch.n_groups))
    return batch


def test_scheduler_batches_train_across_versions(tmp_path):
    config = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
                             max_response_len=TASK.max_response_len())
    sched = Scheduler(config, TASK)
    trainer = TorchTrainer(make_model(), TrainerConfig(
        algorithm=AlgorithmConfig.dapo(offpolicy_mask="offpolicy"), lr=1e-2, device="cpu"))
    gen = torch.Generator().manual_seed(0)
    resumes = offpolicy = 0
    for _ in range(3):
        batch = run_step(sched, trainer, gen)
        # Tokens produced by an older policy (resumed partials) are exactly the ones masked out.
        response = batch.loss_mask == 1
        starts = np.zeros(batch.n_tokens, bool)
        starts[batch.offsets[:-1]] = True
        old = response & ~starts & (batch.versions < batch.policy_version)
        metrics = trainer.train_step(batch)
        assert metrics["n_masked_offpolicy_tokens"] == old.sum()
        assert metrics["n_loss_tokens"] == (response & ~starts).sum() - old.sum()
        assert metrics["offpolicy_token_frac"] == pytest.approx(
            (batch.versions[response] < batch.policy_version).mean())
        resumes += sched.stats()["resume_requests"]
        offpolicy += int(old.sum())
    assert trainer.version == 3
    # Over-sampling 2x leaves unfinished groups at every step: they are aborted, resumed under the next
    # version and trained with tokens of two versions.
    assert resumes > 0 and offpolicy > 0
    # The loop checkpoints the scheduler (with its buffered partials) inside the trainer checkpoint.
    trainer.save_checkpoint(tmp_path / "ckpt", extra={"scheduler": sched.state_dict()})
    restored = Scheduler(config, TASK)
    restored.load_state_dict(TorchTrainer(make_model(seed=1), trainer.config).load_checkpoint(
        tmp_path / "ckpt")["scheduler"])
    for key in ("prompts_consumed", "buffered_samples", "buffered_tokens"):
        assert restored.stats()[key] == sched.stats()[key], key
