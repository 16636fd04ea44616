"""The loss of one minibatch, micro-batch by micro-batch: forward, policy loss, backward (gradients
accumulate), and the metrics a train_step reports.

Data parallel (dp_size > 1, ``model`` wrapped in DistributedDataParallel, or a colocated trainer's plain
model): data-parallel rank r trains the r-th of dp_size consecutive slices of each minibatch. Its loss is
its slice's share of the minibatch loss (aggregation weights over the whole minibatch) times dp_size, and
the gradients are averaged over the ranks (by DDP, or by the colocated trainer after accumulate_gradients),
so the update equals one process training the whole minibatch (DistributedMegatronTrainer's convention).
Gradients are reduced once per minibatch, after its last micro-batch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from april_ext.algorithms import AlgorithmConfig, PolicyLossInputs, aggregation_weights, policy_loss
from april_ext.batch import TrainingBatch
from april_ext.model import LlamaForCausalLM
from april_ext.trainer.batching import StepInputs, split_by_token_budget
from april_ext.trainer.distributed import rank_slice
from april_ext.trainer.logprobs import PolicyLogprobs


@dataclass(frozen=True)
class LossStep:
    """What a minibatch's backward needs: the policy (its DistributedDataParallel wrapper when
    dp_size > 1), the frozen KL reference (None without KL), how pi_train is computed, the objective, the
    micro-batch token budget and this process's data-parallel rank and size."""

    model: torch.nn.Module
    ref_model: LlamaForCausalLM | None
    logprobs: PolicyLogprobs
    algorithm: AlgorithmConfig
    micro_batch_tokens: int
    micro_batch_size: int | None = None
    dp_rank: int = 0
    dp_size: int = 1

    def accumulate_gradients(self, inputs: StepInputs, s0: int, s1: int, old_logprobs: torch.Tensor | None,
                             sums: dict[str, float]) -> None:
        """Forward and backward of this rank's slice of samples [s0, s1) in micro-batches; adds their
        metrics to ``sums``. The aggregation weights cover the whole minibatch, so the micro-batches' losses
        (of all ranks) add up to its loss."""
        offsets, seq_index = inputs.offsets, inputs.seq_index
        t0, t1 = int(offsets[s0]), int(offsets[s1])
        weights = aggregation_weights(inputs.mask[t0:t1], seq_index[t0:t1] - s0, s1 - s0,
                                      self.algorithm.aggregation)
        m0, m1 = rank_slice(s0, s1, self.dp_rank, self.dp_size)
        runs = split_by_token_budget(offsets[m0:m1 + 1].diff().tolist(), self.micro_batch_tokens,
                                     self.micro_batch_size)
        for i, (a, b) in enumerate(runs):
            a, b = a + m0, b + m0
            # Ranks may run different numbers of micro-batches: only the last backward reduces gradients.
            defer = isinstance(self.model, DistributedDataParallel) and i < len(runs) - 1
            with self.model.no_sync() if defer else contextlib.nullcontext():  # type: ignore[operator]
                self._micro_batch(inputs, a, b, weights[int(offsets[a]) - t0:int(offsets[b]) - t0], old_logprobs,
                                  sums)

    def _micro_batch(self, inputs: StepInputs, a: int, b: int, weights: torch.Tensor,
                     old_logprobs: torch.Tensor | None, sums: dict[str, float]) -> None:
        """Forward, loss and backward of samples [a, b) (their token weights given)."""
        offsets = inputs.offsets
        u0, u1 = int(offsets[a]), int(offsets[b])
        cu = offsets[a:b + 1] - offsets[a]
        tokens = inputs.tokens[u0:u1]
        bonus = self.algorithm.entropy_coef
        logprobs, entropy = self.logprobs(self.model, tokens, cu, with_entropy=True, entropy_grad=bonus > 0)
        ref = self.logprobs.no_grad(self.ref_model, tokens, cu) if self.ref_model is not None else None
        out = policy_loss(self.algorithm, PolicyLossInputs(
            logprobs=logprobs,
            old_logprobs=old_logprobs[u0:u1] if old_logprobs is not None else logprobs.detach(),
            behavior_logprobs=inputs.behavior[u0:u1], advantages=inputs.token_advantages[u0:u1],
            mask=inputs.mask[u0:u1], weights=weights, seq_index=inputs.seq_index[u0:u1] - a, n_seqs=b - a,
            ref_logprobs=ref))
        mean_entropy = (weights * entropy).sum()
        loss = out.loss - bonus * mean_entropy if bonus > 0 else out.loss
        (loss * self.dp_size).backward()
        _accumulate(sums, "loss", float(loss.detach()))
        _accumulate(sums, "entropy", float(mean_entropy.detach()))
        for name, value in out.metrics.items():
            _accumulate(sums, name, float(value))


def step_metrics(batch: TrainingBatch, inputs: StepInputs, sums: dict[str, float], grad_norms: list[float],
                 lr: float, version: int, elapsed: float, shaping_kl: torch.Tensor | None = None) -> dict[str, float]:
    """The metrics of one train_step: the loss metrics averaged over its optimizer steps, then the
    batch's rewards, advantages, lengths, off-policy fractions and throughput; with ``shaping_kl`` (the
    per-token KL of the KL reward shaping) its mean over the loss tokens as ``kl_shaping``."""
    parts = len(grad_norms)
    metrics = {name: value / parts for name, value in sums.items()}
    staleness = (batch.policy_version - inputs.versions.to(torch.int64))[inputs.trainable.bool()]
    rewards = torch.from_numpy(batch.rewards).to(torch.float32)
    metrics.update({
        "grad_norm": sum(grad_norms) / parts,
        "lr": lr,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "advantage_abs_mean": float(inputs.advantages.abs().mean()),
        "token_advantage_abs_mean": _masked_mean(inputs.token_advantages.abs(), inputs.mask),
        "response_len_mean": float(batch.response_lens.mean()),
        "n_tokens": float(batch.n_tokens),
        "n_loss_tokens": float(inputs.mask.sum()),
        "n_masked_offpolicy_tokens": float(inputs.trainable.sum() - inputs.mask.sum()),
        "offpolicy_token_frac": float((staleness > 0).float().mean()) if staleness.numel() else 0.0,
        "max_staleness": float(staleness.max()) if staleness.numel() else 0.0,
        "optimizer_steps": float(parts),
        "step_time_s": elapsed,
        "tokens_per_s": batch.n_tokens / elapsed if elapsed > 0 else 0.0,
        "version": float(version),
    })
    if shaping_kl is not None:
        metrics["kl_shaping"] = _masked_mean(shaping_kl, inputs.mask)
    return metrics


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1.0))


def _accumulate(sums: dict[str, float], name: str, value: float) -> None:
    sums[name] = sums.get(name, 0.0) + value


__all__ = ["LossStep", "step_metrics"]
