"""Cost model of the trainer in virtual time: the seconds one training step takes on T trainer GPUs, and the
seconds a weight update takes, derived from the GPU and model specs as the engine's cost presets are.

A step trains every token of its batch (prompt and response): forward and backward are three forward passes
(the backward costs two), and recomputing the old policy's logprobs (what verl's synchronous trainer does in its
old_log_prob phase) is one more. A forward pass of a sequence of L tokens costs 2 x params x L FLOPs in the linear
layers and 4 x layers x q_heads x head_dim x L^2 / 2 in causal attention (QK^T and PV), the engine's prefill
formula. The trainer's GPUs reach ``mfu`` of their dense bf16 peak, an assumption (docs/sim.md, "Asynchronous
modes at scale"); each step adds a fixed ``step_overhead_s`` (optimizer, data movement, logging).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from april_ext.errors import ConfigError
from april_ext.sim.cost import GPUS, MODELS, GpuSpec, ModelSpec


def _number(name: str, value: object, low: float, high: float = math.inf, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):  # type: ignore[operator]
        bound = f"> {low:g}" if low_open else f">= {low:g}"
        allowed = f"a finite number {bound}" + (f" and <= {high:g}" if high < math.inf else "")
        raise ConfigError(f"TrainerCost.{name}={value!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class TrainerCost:
    """Virtual seconds of training on the trainer's GPUs and of publishing the new weights to the engines."""

    gpu: GpuSpec
    model: ModelSpec
    mfu: float = 0.4
    """Achieved / peak dense bf16 FLOPs of training (an assumption: Megatron-LM reports 44-52% of peak for large
    dense models, arXiv 2104.04473; RL's variable-length micro-batches are assumed to reach less)."""
    step_overhead_s: float = 2.0
    """Fixed seconds per training step (optimizer, data movement, logging; an assumption)."""
    recompute_old_logprobs: bool = True
    """One more forward pass per step for the old policy's logprobs (verl's synchronous trainer: its old_log_prob
    phase); False: the engine's behavior logprobs serve (verl's fully_async rows report no old_log_prob)."""
    weight_update_s: float = 0.0
    """Seconds the engines stall while the trainer's new weights land (a stated figure per preset)."""

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, GpuSpec):
            raise ConfigError(f"TrainerCost.gpu is a {type(self.gpu).__name__}; a GpuSpec is required "
                              f"(april_ext.sim.cost.GPUS: {', '.join(GPUS)})")
        if not isinstance(self.model, ModelSpec):
            raise ConfigError(f"TrainerCost.model is a {type(self.model).__name__}; a ModelSpec is required "
                              f"(april_ext.sim.cost.MODELS: {', '.join(MODELS)})")
        _number("mfu", self.mfu, 0.0, 1.0, low_open=True)
        _number("step_overhead_s", self.step_overhead_s, 0.0)
        _number("weight_update_s", self.weight_update_s, 0.0)
        if not isinstance(self.recompute_old_logprobs, bool):
            raise ConfigError(f"TrainerCost.recompute_old_logprobs={self.recompute_old_logprobs!r} is not allowed: "
                              "True or False")

    @property
    def forward_passes(self) -> int:
        """Forward-pass equivalents per trained token: forward + backward (3), and the old logprobs (1)."""
        return 3 + int(self.recompute_old_logprobs)

    def forward_flops(self, sequence_lens: np.ndarray) -> float:
        """FLOPs of one forward pass over sequences of these lengths (prompt + response)."""
        lens = np.asarray(sequence_lens, np.float64)
        m = self.model
        linear = 2.0 * m.params * float(lens.sum())
        attention = 4.0 * m.layers * m.q_heads * m.head_dim * float(np.square(lens).sum()) / 2
        return linear + attention

    def train_seconds(self, sequence_lens: np.ndarray, gpus: int) -> float:
        """Seconds of one training step over sequences of these lengths on ``gpus`` GPUs."""
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise ConfigError(f"trainer gpus={gpus!r} is not allowed: an int >= 1")
        flops = self.forward_passes * self.forward_flops(sequence_lens)
        return self.step_overhead_s + flops / (gpus * self.gpu.bf16_flops * self.mfu)


__all__ = ["TrainerCost"]
