"""Comparing two trainers that run torch.optim.AdamW on the same batches (the Megatron trainer against the
torch trainer) without putting a tolerance on reduction-order noise.

Weights after Adam cannot be compared with a fixed tolerance: where a gradient is near zero, Adam's
g / sqrt(v) turns a 1e-7 difference into a visible one, and which elements those are depends on the
reduction order. So the comparison is in two parts:

1. The gradients each optimizer step is fed (after clipping) are compared directly, per tensor:
   ||g - g'|| <= GRAD_RTOL ||g'||. Gradients are not magnified the way Adam's step is; the norm-wise error
   measured over these tests' runs is at most 3.6e-5 (an element-wise one can be 10x that, on a single
   element of a later step, after the weights have drifted). GRAD_RTOL sits 28x above the noise and 10x
   below the smallest planted defect (one gradient 1% off).
2. The weights are compared element by element against a bound derived from AdamW's update given the
   gradient differences measured in 1. With bias-corrected moments m, v of gradients g and g' that differ
   by at most D (over the steps so far), and s = sqrt(v) of the reference run:
       |u - u'| <= min(2 B, D (1 + B) / (s + eps)),    u = m / (sqrt(v) + eps),
   where B bounds |m| / sqrt(v) (Cauchy-Schwarz over Adam's two averages: B = 1 at the first step).
   The weights' difference is at most lr times the sum of that over the steps, plus the fp32 rounding of
   the updates themselves. The bound is tight where the gradient is large and loose only where it is not,
   which is where the noise is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

import torch

from april_ext.trainer import TorchTrainer

GRAD_RTOL = 1e-3
# fp32 rounding of each update and weight (a few ulps per step), relative to the weight's magnitude.
_ROUNDING = 4 * torch.finfo(torch.float32).eps


def hf_gradients(trainer: TorchTrainer) -> dict[str, torch.Tensor]:
    """The trainer's current gradients in Hugging Face names (a Megatron model's fused q/k/v and gate/up
    gradients split as its weights are)."""
    model = trainer.model
    gpt = getattr(model, "gpt", None)
    if gpt is not None:
        from april_ext.trainer.megatron.conversion import megatron_to_hf

        grads = {name: p.grad.detach() for name, p in gpt.named_parameters()}
        return {name: g.clone() for name, g in megatron_to_hf(grads, model.config).items()}
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


class GradientLog(Protocol):
    """The gradients (HF names) each optimizer step of the compared run was fed: an OptimizerRecord, or those
    a distributed run's ranks gathered (tests/megatron_dist_worker.py)."""

    @property
    def gradients(self) -> list[dict[str, torch.Tensor]]: ...


class OptimizerRecord:
    """What a trainer's optimizer saw at each of its steps: the gradients (HF names) and, after the step,
    sqrt of the bias-corrected second moment of every parameter (for the reference run's bound)."""

    def __init__(self, trainer: TorchTrainer) -> None:
        self.trainer = trainer
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.second_moments: list[dict[str, torch.Tensor]] = []
        self._names = {id(p): name for name, p in trainer.model.named_parameters()}
        trainer.optimizer.register_step_pre_hook(lambda *_: self.gradients.append(hf_gradients(trainer)))
        trainer.optimizer.register_step_post_hook(lambda *_: self.second_moments.append(self._sqrt_v_hat()))

    def _sqrt_v_hat(self) -> dict[str, torch.Tensor]:
        _, beta2 = self.trainer.config.betas
        out = {}
        for p, state in self.trainer.optimizer.state.items():
            step = float(state["step"])
            out[self._names[id(p)]] = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt()
        return out


def adam_ratio_bound(step: int, betas: tuple[float, float]) -> float:
    """An upper bound of |m_hat| / sqrt(v_hat) at Adam step ``step`` (1-based), for any gradients."""
    beta1, beta2 = betas
    w1 = [(1 - beta1) * beta1 ** (step - i) / (1 - beta1 ** step) for i in range(1, step + 1)]
    w2 = [(1 - beta2) * beta2 ** (step - i) / (1 - beta2 ** step) for i in range(1, step + 1)]
    return math.sqrt(sum(a * a / b for a, b in zip(w1, w2)))


def assert_same_gradients(got: GradientLog, expected: OptimizerRecord) -> None:
    assert len(got.gradients) == len(expected.gradients), "the trainers took different numbers of optimizer steps"
    for step, (mine, theirs) in enumerate(zip(got.gradients, expected.gradients)):
        assert sorted(mine) == sorted(theirs), step
        for name, g in theirs.items():
            error = float((mine[name] - g).norm())
            assert error <= GRAD_RTOL * float(g.norm()), (
                f"optimizer step {step + 1}: the gradient of {name} is off by {error:.3g}, "
                f"{error / max(float(g.norm()), 1e-30):.3g} of its norm (allowed: {GRAD_RTOL})")


def assert_weights_within_adam_bound(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                                     got_record: GradientLog, expected_record: OptimizerRecord) -> None:
    """The weights after the recorded steps differ by no more than AdamW can make of the recorded
    gradient differences (module docstring). Both trainers must have started from the same weights."""
    config = expected_record.trainer.config
    # Decoupled weight decay scales both weights by 1 - lr * wd: it shrinks their difference, so the bound holds;
    # a learning-rate schedule only lowers lr below config.lr, which the bound uses.
    assert config.lr * config.weight_decay <= 1, "the bound needs the weight decay to contract the weights"
    assert sorted(got) == sorted(expected)
    for name, theirs in expected.items():
        bound = torch.zeros_like(theirs)
        worst = torch.zeros_like(theirs)
        for step, (g_mine, g_theirs, s) in enumerate(zip(got_record.gradients, expected_record.gradients,
                                                         expected_record.second_moments), start=1):
            worst = torch.maximum(worst, (g_mine[name] - g_theirs[name]).abs())
            ratio = adam_ratio_bound(step, config.betas)
            bound += torch.minimum(torch.full_like(bound, 2 * ratio), worst * (1 + ratio) / (s[name] + config.adam_eps))
        steps = len(expected_record.gradients)
        limit = config.lr * bound + steps * _ROUNDING * (theirs.abs() + config.lr)
        excess = (got[name] - theirs).abs() - limit
        assert bool((excess <= 0).all()), (
            f"{name}: {int((excess > 0).sum())} elements differ by more than Adam's bound; the largest excess "
            f"{float(excess.max()):.3g} over a bound of {float(limit.flatten()[excess.argmax()]):.3g}")
