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
from april_ext.algorithms.kl import approx_kl
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
    step's update (pi_train of the importance weights, the anchor of the clip: AReaL's proximal policy).
    behavior_logprobs: from the rollout engine. advantages: per token (algorithms.advantages). mask: the
    effective loss mask. weights: from ``aggregation_weights`` over the whole batch. seq_index: 0..n_seqs-1,
    the sequence of each token. ref_logprobs: the reference policy, needed when kl_loss_coef > 0.
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
    """The clipped policy-gradient loss of ``config.loss`` plus the optional KL loss term, aggregated.

    With ``use_decoupled_loss`` (AReaL's decoupled PPO) each token's clipped term is weighted by
    w_t = pi_old / pi_behavior, and by 0 where w_t > behav_imp_weight_cap; the token still counts in the
    aggregation weights."""
    _check_shapes(inputs)
    ref_logprobs = inputs.ref_logprobs
    if config.kl_loss_coef > 0 and ref_logprobs is None:
        raise InvalidArgumentError("ref_logprobs must be given when AlgorithmConfig.kl_loss_coef > 0")
    mask = inputs.mask.to(torch.float32)
    log_ratio = (inputs.logprobs - inputs.old_logprobs.detach()) * mask
    if config.loss == "ppo":
        ratio = torch.exp(log_ratio)
        advantages = inputs.advantages
        is_weight = (truncated_is_weights(inputs.old_logprobs, inputs.behavior_logprobs, config.tis_cap,
                                          config.tis_floor) if config.tis_cap is not None else None)
        behav_weight = _behavior_weights(config, inputs)
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
        # AReaL weights per token under its sequence-level (GSPO) ratio too.
        behav_weight = _behavior_weights(config, inputs)
    token_loss, clipped_low, clipped_high = _clipped_surrogate(ratio, advantages, config.eps_low,
                                                               config.eps_high)
    if is_weight is not None:
        token_loss = token_loss * is_weight
    if behav_weight is not None:
        token_loss = token_loss * behav_weight
    metrics: dict[str, torch.Tensor] = {}
    w = inputs.weights.to(torch.float32)
    metrics["pg_loss"] = (w * token_loss).sum().detach()
    if config.kl_loss_coef > 0 and ref_logprobs is not None:
        kl = approx_kl(inputs.logprobs, ref_logprobs, config.kl_loss_type) * mask
        token_loss = token_loss + config.kl_loss_coef * kl
        metrics["kl"] = (w * kl).sum().detach()
    loss = (w * token_loss).sum()
    metrics["clip_frac_low"] = (w * clipped_low).sum()
    metrics["clip_frac_high"] = (w * clipped_high).sum()
    metrics["ratio"] = (w * ratio.detach()).sum()
    if is_weight is not None:
        metrics["tis_weight"] = (w * is_weight).sum()
        metrics["tis_truncated_frac"] = (w * (is_weight >= config.tis_cap).to(torch.float32)).sum()
    if behav_weight is not None:
        metrics["behav_imp_weight"] = (w * behav_weight).sum()
        metrics["behav_masked_frac"] = (w * (behav_weight == 0).to(torch.float32)).sum()
    return PolicyLossOutput(loss=loss, metrics=metrics)


def _behavior_weights(config: AlgorithmConfig, inputs: PolicyLossInputs) -> torch.Tensor | None:
    """The decoupled loss's per-token pi_old / pi_behavior (0 above behav_imp_weight_cap and off the loss
    mask), without gradient; None without use_decoupled_loss."""
    if not config.use_decoupled_loss:
        return None
    weight = torch.exp((inputs.old_logprobs.detach() - inputs.behavior_logprobs.detach()).to(torch.float32))
    # Off the loss mask the weight is 0 as in AReaL (an overflowed weight there would turn 0 * inf into nan).
    keep = inputs.mask > 0
    if config.behav_imp_weight_cap is not None:
        keep = keep & (weight <= config.behav_imp_weight_cap)
    return torch.where(keep, weight, torch.zeros_like(weight))


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
