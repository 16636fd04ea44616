"""TrainerConfig: the optimisation settings of the torch trainer (and of the Megatron trainer, which
shares its RL step), validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from april_ext.algorithms import AlgorithmConfig
from april_ext.errors import ConfigError

MIXED_PRECISION = ("auto", "bf16", "fp32")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation settings of the torch trainer.

    micro_batch_tokens: token budget of one forward/backward (whole samples; a longer sample runs alone).
    micro_batch_size: None, or at most this many samples in one forward/backward besides the token budget
        (slime's --micro-batch-size). Micro-batching changes memory and speed, not the update.
    minibatches: optimizer steps per batch; the batch's groups are split into this many consecutive
        parts, and the PPO clip compares against the logprobs of the weights before the first step.
    mixed_precision: "auto" (bf16 autocast on CUDA / ROCm, fp32 on CPU), "bf16" or "fp32".
    device: None picks "cuda" when available, else "cpu".
    temperature: the rollouts' sampling temperature. pi_train is softmax(logits / temperature), the
        distribution the engine draws from and computes behavior logprobs with, so importance weights
        compare like with like and the gradient is that of the sampling policy; 0 (greedy rollouts) uses
        the raw logits, as the engine's greedy logprobs do.
    top_k, top_p: the rollouts' top-k (<= 0: off) and top-p (1.0: off). When set (and temperature > 0),
        pi_train is the engine's sampling distribution after them (april_ext.model.logits.processed_logprobs): the tokens
        they drop are chosen without gradient, and the log-softmax renormalises over the kept ones; a
        dropped token (an off-policy token outside the current policy's top-p) gets DROPPED_LOGPROB.
    lr_decay_style, lr_warmup_iters, lr_decay_iters, min_lr: Megatron's schedule of the learning rate over
        optimizer steps: a linear warmup from 0 to lr over lr_warmup_iters steps, then "constant" (lr),
        "linear" or "cosine" decay to min_lr at lr_decay_iters (None: no decay; min_lr is held after it).
    reference: a Hugging Face checkpoint directory holding the KL reference policy (slime's --ref-load);
        None: a frozen copy of the initial weights.
    colocated: weights, gradients, optimizer state (and the KL reference) live in april_ext.memory under
        ``memory_tag``, so ``offload`` / ``onload`` release and restore them (weights and optimizer state
        are backed up to host memory; gradients, zero between steps, are not).
    """

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    grad_clip: float | None = 1.0
    micro_batch_tokens: int = 8192
    micro_batch_size: int | None = None
    minibatches: int = 1
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    min_lr: float = 0.0
    reference: str | None = None
    mixed_precision: str = "auto"
    device: str | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    colocated: bool = False
    memory_tag: str = "trainer"

    def __post_init__(self) -> None:
        if not isinstance(self.algorithm, AlgorithmConfig):
            raise ConfigError(f"TrainerConfig.algorithm must be an AlgorithmConfig, got "
                              f"{type(self.algorithm).__name__}")
        _positive("lr", self.lr)
        _positive("adam_eps", self.adam_eps)
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ConfigError(f"TrainerConfig.temperature must be a finite number >= 0 (0: greedy rollouts), "
                              f"got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ConfigError(f"TrainerConfig.top_k must be an integer (<= 0: off), got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"TrainerConfig.top_p must be a number in (0, 1] (1.0: off), got {self.top_p!r}")
        if not _is_number(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"TrainerConfig.weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if (not isinstance(self.betas, tuple) or len(self.betas) != 2
                or not all(_is_number(b) and 0 <= b < 1 for b in self.betas)):
            raise ConfigError(f"TrainerConfig.betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        if self.grad_clip is not None:
            _positive("grad_clip", self.grad_clip, allowed="None or a finite number > 0")
        for name in ("micro_batch_tokens", "minibatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TrainerConfig.{name} must be an integer >= 1, got {value!r}")
        if self.micro_batch_size is not None and (not isinstance(self.micro_batch_size, int)
                                                  or isinstance(self.micro_batch_size, bool)
                                                  or self.micro_batch_size < 1):
            raise ConfigError(f"TrainerConfig.micro_batch_size must be None or an integer >= 1, "
                              f"got {self.micro_batch_size!r}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"TrainerConfig.lr_decay_style must be one of {LR_DECAY_STYLES}, got "
                              f"{self.lr_decay_style!r}")
        if not isinstance(self.lr_warmup_iters, int) or isinstance(self.lr_warmup_iters, bool) or self.lr_warmup_iters < 0:
            raise ConfigError(f"TrainerConfig.lr_warmup_iters must be an integer >= 0, got {self.lr_warmup_iters!r}")
        if self.lr_decay_iters is not None and (not isinstance(self.lr_decay_iters, int)
                                                or isinstance(self.lr_decay_iters, bool)
                                                or self.lr_decay_iters <= self.lr_warmup_iters):
            raise ConfigError(f"TrainerConfig.lr_decay_iters must be None or an integer > lr_warmup_iters "
                              f"({self.lr_warmup_iters}), got {self.lr_decay_iters!r}")
        if not _is_number(self.min_lr) or not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"TrainerConfig.min_lr must be a number in [0, lr={self.lr}], got {self.min_lr!r}")
        if self.reference is not None and (not isinstance(self.reference, str) or not self.reference):
            raise ConfigError(f"TrainerConfig.reference must be None or a checkpoint directory, got {self.reference!r}")
        if self.mixed_precision not in MIXED_PRECISION:
            raise ConfigError(f"TrainerConfig.mixed_precision must be one of {MIXED_PRECISION}, "
                              f"got {self.mixed_precision!r}")
        if not isinstance(self.colocated, bool):
            raise ConfigError(f"TrainerConfig.colocated must be a bool, got {self.colocated!r}")
        if not isinstance(self.memory_tag, str) or not self.memory_tag:
            raise ConfigError(f"TrainerConfig.memory_tag must be a non-empty string, got {self.memory_tag!r}")
        if self.device is not None:
            try:
                torch.device(self.device)
            except (RuntimeError, TypeError, ValueError):
                raise ConfigError(f"TrainerConfig.device must be None or a torch device string such as "
                                  f"'cpu' or 'cuda:0', got {self.device!r}") from None


def lr_at(config: TrainerConfig, iteration: int) -> float:
    """The learning rate of the optimizer step after ``iteration`` steps under the config's schedule, as
    Megatron's OptimizerParamScheduler computes it (its first warmup step has lr 0): linear warmup, then the
    decay style down to min_lr."""
    if config.lr_warmup_iters > 0 and iteration <= config.lr_warmup_iters:
        return config.lr * iteration / config.lr_warmup_iters
    if config.lr_decay_style == "constant" or config.lr_decay_iters is None:
        return config.lr
    span = config.lr_decay_iters - config.lr_warmup_iters
    progress = min(1.0, (iteration - config.lr_warmup_iters) / span)
    if config.lr_decay_style == "linear":
        factor = 1.0 - progress
    else:
        factor = 0.5 * (math.cos(math.pi * progress) + 1.0)
    return config.min_lr + (config.lr - config.min_lr) * factor


def set_scheduled_lr(optimizer: Any, config: TrainerConfig, iteration: int) -> float:
    """Sets the learning rate of the optimizer step after ``iteration`` steps on every parameter group (a
    torch optimizer's or megatron-core's) and returns it."""
    lr = lr_at(config, iteration)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, value: object, allowed: str = "a finite number > 0") -> None:
    if not _is_number(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(f"TrainerConfig.{name} must be {allowed}, got {value!r}")


__all__ = ["LR_DECAY_STYLES", "MIXED_PRECISION", "TrainerConfig", "lr_at", "set_scheduled_lr"]
