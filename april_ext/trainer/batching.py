"""A TrainingBatch on the trainer's side: validated, moved to the device with its advantages and loss
mask, and cut into minibatches (whole groups, one optimizer step each) and micro-batches (whole
samples within a token budget and an optional sample count, one forward / backward each)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from april_ext.algorithms import (
    AlgorithmConfig,
    approx_kl,
    offpolicy_loss_mask,
    sample_advantages,
    token_advantages,
)
from april_ext.batch import TrainingBatch
from april_ext.errors import InvalidArgumentError, InvalidStateError


def split_by_token_budget(lengths: list[int], budget: int,
                          max_samples: int | None = None) -> list[tuple[int, int]]:
    """Consecutive [start, end) runs of samples whose total length fits the budget and, when max_samples
    is given, of at most that many samples; a sample longer than the budget forms a run of its own."""
    runs: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if i > start and (used + n > budget or (max_samples is not None and i - start >= max_samples)):
            runs.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        runs.append((start, len(lengths)))
    return runs


def minibatch_bounds(group_index: torch.Tensor, minibatches: int) -> list[tuple[int, int]]:
    """Sample ranges of ``minibatches`` parts with whole groups and about equal numbers of groups."""
    starts = [0] + (torch.nonzero(group_index.diff() != 0).flatten() + 1).tolist()
    n_groups = len(starts)
    parts = min(minibatches, n_groups)
    bounds = [starts[(n_groups * k) // parts] for k in range(parts)] + [int(group_index.shape[0])]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


def validate_batch(batch: TrainingBatch) -> None:
    """Raises InvalidArgumentError naming the first array whose shape or order is wrong."""
    s, t = batch.n_samples, batch.n_tokens
    if s < 1:
        raise InvalidArgumentError("the batch has no samples")
    if int(batch.offsets[0]) != 0 or int(batch.offsets[-1]) != t or bool((np.diff(batch.offsets) < 1).any()):
        raise InvalidArgumentError(f"batch.offsets must rise strictly from 0 to len(tokens)={t}, got "
                                   f"{batch.offsets[:4].tolist()}...{batch.offsets[-2:].tolist()}")
    for name in ("loss_mask", "behavior_logprobs", "versions"):
        if getattr(batch, name).shape != (t,):
            raise InvalidArgumentError(f"batch.{name} must have length len(tokens)={t}, got shape "
                                       f"{getattr(batch, name).shape}")
    for name in ("prompt_lens", "rewards", "group_index"):
        if getattr(batch, name).shape != (s,):
            raise InvalidArgumentError(f"batch.{name} must have one entry per sample ({s}), got shape "
                                       f"{getattr(batch, name).shape}")
    if bool((np.diff(batch.group_index) < 0).any()):
        raise InvalidArgumentError("batch.group_index must be non-decreasing (samples of a group contiguous)")



def validate_step_batch(batch: TrainingBatch, version: int) -> None:
    """validate_batch, and the batch must be built for the trainer's current policy version."""
    validate_batch(batch)
    if batch.policy_version != version:
        raise InvalidStateError(f"batch.policy_version is {batch.policy_version} but the trainer holds "
                                f"version {version}; the batch must be built for the current version")

@dataclass
class StepInputs:
    """One batch on the trainer's device. Per token [T]: tokens, seq_index, token_advantages, versions,
    trainable (loss mask without sample starts), mask (trainable after off-policy masking), behavior.
    Per sample: offsets [S + 1] (CPU), group_index [S] (CPU), advantages [S] (the per-sample part,
    algorithms.sample_advantages)."""

    tokens: torch.Tensor
    offsets: torch.Tensor
    seq_index: torch.Tensor
    group_index: torch.Tensor
    advantages: torch.Tensor
    token_advantages: torch.Tensor
    versions: torch.Tensor
    trainable: torch.Tensor
    mask: torch.Tensor
    behavior: torch.Tensor


def prepare_inputs(batch: TrainingBatch, algo: AlgorithmConfig, device: torch.device) -> StepInputs:
    """Device tensors of the batch plus advantages and the effective loss mask. With ``algo.kl_shaping``
    the token advantages are computed with a KL of 0: the trainer recomputes them with ``apply_kl_shaping``
    once it has the log-probs."""
    data = batch.to_torch()
    offsets = data["offsets"].to(torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(batch.n_samples), offsets.diff()).to(device)
    advantages = sample_advantages(algo, data["rewards"], data["group_index"]).to(device)
    versions = data["versions"].to(device)
    # The first token of a sample has no prediction to train.
    trainable = data["loss_mask"].to(device, torch.float32).index_fill(0, offsets[:-1].to(device), 0.0)
    mask = offpolicy_loss_mask(trainable, versions, batch.policy_version, mode=algo.offpolicy_mask,
                               max_staleness=algo.max_staleness)
    return StepInputs(tokens=data["tokens"].to(device, torch.int64), offsets=offsets, seq_index=seq_index,
                      group_index=data["group_index"], advantages=advantages,
                      token_advantages=token_advantages(algo, advantages, offsets, trainable, mask,
                                                        torch.zeros_like(trainable) if algo.kl_shaping else None),
                      versions=versions, trainable=trainable, mask=mask,
                      behavior=data["behavior_logprobs"].to(device, torch.float32))


def apply_kl_shaping(inputs: StepInputs, algo: AlgorithmConfig, logprobs: torch.Tensor,
                     ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Recomputes ``inputs.token_advantages`` with the KL reward shaping of ``algo`` (kl_shaping), from the
    per-token log-probs of the whole batch under the weights before the update and under the reference;
    returns the per-token KL (0 off the trainable tokens)."""
    kl = approx_kl(logprobs, ref_logprobs, algo.kl_loss_type) * inputs.trainable
    inputs.token_advantages = token_advantages(algo, inputs.advantages, inputs.offsets, inputs.trainable,
                                               inputs.mask, kl)
    return kl


__all__ = ["StepInputs", "apply_kl_shaping", "minibatch_bounds", "prepare_inputs", "split_by_token_budget",
           "validate_batch", "validate_step_batch"]
