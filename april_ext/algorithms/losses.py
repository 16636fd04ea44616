"""Policy losses (PPO-style clip with DAPO's asymmetric range, GSPO) and their aggregation over tokens.

Everything is computed on flat token arrays. The loss of a batch is sum_t weights[t] * loss[t], where
``aggregation_weights`` fixes the weights from the whole batch once; a micro-batch (a set of whole
sequences) contributes the part of the sum over its tokens, so the micro-batch losses add up to the batch
loss exactly and gradient accumulation needs no rescaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from april_ext.algorithms.config import AlgorithmConfig
from april_ext.algorithms.offpolicy import truncated_is_weights
from april_ext.errors import InvalidArgumentError


def aggregation_weights(mask: torch.Tensor, seq_index: torch.Tensor, n_seqs: int, mode: str) -> torch.Tensor:
    """Per-token weights that turn per-token losses into the batch loss.

    "token": mask[t] / (number of loss tokens in the batch).
    "sequence": mask[t] / (loss tokens of t's sequence * sequences with at least one loss token).
    The weights sum to 1 (or are all 0 when nothing is trained).
    """
    mask = mask.to(torch.float32)
    if mode == "token":
        return mask / mask.sum().clamp(min=1.0)
    if mode == "sequence":
        per_seq = _segment_sum(mask, seq_index, n_seqs)
        n_valid = (per_seq > 0).sum().clamp(min=1).to(torch.float32)
        return mask / (per_seq.clamp(min=1.0)[seq_index] * n_valid)
    raise InvalidArgumentError(f"mode must be one of ('token', 'sequence'), got {mode!r}")


@dataclass
class PolicyLossInputs:
    """Flat per-token tensors of whole sequences (a batch or a micro-batch), all of length T.

    logprobs: log pi_theta(token) with gradient. old_logprobs: the same under the weights before this
    step's update (pi_train of the importance weights, the anchor of the clip). behavior_logprobs: from the
    rollout engine. advantages: each token carries its sample's advantage. mask: the effective loss mask.
    weights: from ``aggregation_weights`` over the whole batch. seq_index: 0..n_seqs-1, the sequence of
    each token. ref_logprobs: the reference policy, needed when kl_coef > 0.
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    behavior_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    seq_index: torch.Tensor
    n_seqs: int
    ref_logprobs: torch.Tensor | None = None


@dataclass
class PolicyLossOutput:
    """loss: the (micro-)batch's share of the batch loss. metrics: weighted sums (same weights as the loss),
    so the metrics of micro-batches add up to batch means."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def policy_loss(config: AlgorithmConfig, inputs: PolicyLossInputs) -> PolicyLossOutput:
    """The clipped policy-gradient loss of ``config.loss`` plus the optional KL term, aggregated."""
    _check_shapes(inputs)
    ref_logprobs = inputs.ref_logprobs
    if config.kl_coef > 0 and ref_logprobs is None:
        raise InvalidArgumentError("ref_logprobs must be given when AlgorithmConfig.kl_coef > 0")
    mask = inputs.mask.to(torch.float32)
    log_ratio = (inputs.logprobs - inputs.old_logprobs.detach()) * mask
    if config.loss == "ppo":
        ratio = torch.exp(log_ratio)
        advantages = inputs.advantages
        is_weight = (truncated_is_weights(inputs.old_logprobs, inputs.behavior_logprobs, config.tis_cap,
                                          config.tis_floor) if config.tis_cap is not None else None)
    else:
        counts = _segment_sum(mask, inputs.seq_index, inputs.n_seqs).clamp(min=1.0)
        seq_log_ratio = _segment_sum(log_ratio, inputs.seq_index, inputs.n_seqs) / counts
        ratio = torch.exp(seq_log_ratio)[inputs.seq_index]
        advantages = (_segment_sum(inputs.advantages * mask, inputs.seq_index, inputs.n_seqs) / counts
                      )[inputs.seq_index]
        is_weight = None
        if config.tis_cap is not None:
            seq_log_w = _segment_sum((inputs.old_logprobs - inputs.behavior_logprobs).detach() * mask,
                                     inputs.seq_index, inputs.n_seqs) / counts
            is_weight = torch.exp(seq_log_w).clamp(min=config.tis_floor, max=config.tis_cap)[inputs.seq_index]
    token_loss, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, config.eps_low,
                                                               config.eps_high)
    if is_weight is not None:
        token_loss = token_loss * is_weight
    metrics: dict[str, torch.Tensor] = {}
    w = inputs.weights.to(torch.float32)
    metrics["pg_loss"] = (w * token_loss).sum().detach()
    if config.kl_coef > 0 and ref_logprobs is not None:
        kl = _k3_kl(inputs.logprobs, ref_logprobs.detach()) * mask
        token_loss = token_loss + config.kl_coef * kl
        metrics["kl"] = (w * kl).sum().detach()
    loss = (w * token_loss).sum()
    metrics["clip_frac_low"] = (w * clipped_low).sum()
    metrics["clip_frac_high"] = (w * clipped_high).sum()
    metrics["ratio"] = (w * ratio.detach()).sum()
    if is_weight is not None:
        metrics["tis_weight"] = (w * is_weight).sum()
        metrics["tis_truncated_frac"] = (w * (is_weight >= config.tis_cap).to(torch.float32)).sum()
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, eps_low: float,
                       eps_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token, and where each clip bound was active."""
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    r = ratio.detach()
    low = ((advantages < 0) & (r < 1.0 - eps_low)).to(torch.float32)
    high = ((advantages > 0) & (r > 1.0 + eps_high)).to(torch.float32)
    return loss, low, high


def _k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref): exp(d) - d - 1 with d = log pi_ref - log pi_theta."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


def _segment_sum(values: torch.Tensor, seq_index: torch.Tensor, n_seqs: int) -> torch.Tensor:
    out = torch.zeros(n_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, seq_index, values)


def _check_shapes(inputs: PolicyLossInputs) -> None:
    shape = inputs.logprobs.shape
    if len(shape) != 1:
        raise InvalidArgumentError(f"logprobs must be 1-D (flat tokens), got shape {tuple(shape)}")
    for name in ("old_logprobs", "behavior_logprobs", "advantages", "mask", "weights", "seq_index",
                 "ref_logprobs"):
        value = getattr(inputs, name)
        if value is not None and value.shape != shape:
            raise InvalidArgumentError(f"{name} must have the shape of logprobs {tuple(shape)}, "
                                       f"got {tuple(value.shape)}")
    if inputs.seq_index.numel() and (int(inputs.seq_index.min()) < 0
                                     or int(inputs.seq_index.max()) >= inputs.n_seqs):
        raise InvalidArgumentError(f"seq_index values must lie in [0, n_seqs={inputs.n_seqs}), got range "
                                   f"[{int(inputs.seq_index.min())}, {int(inputs.seq_index.max())}]")
