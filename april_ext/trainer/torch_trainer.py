"""TorchTrainer: the embedded trainer. Same model code as the embedded engine, AdamW, micro-batching by
token budget, gradient clipping, bf16 autocast on GPUs, atomic checkpoints."""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from april_ext.algorithms import (
    AlgorithmConfig,
    PolicyLossInputs,
    aggregation_weights,
    group_advantages,
    offpolicy_loss_mask,
    policy_loss,
)
from april_ext.batch import TrainingBatch
from april_ext.errors import (
    ConfigError,
    CorruptStateError,
    InvalidArgumentError,
    InvalidStateError,
    PersistenceError,
)
from april_ext.model import LlamaForCausalLM, iter_safetensors, save_pretrained
from april_ext.model.checkpoint import iter_safetensors_file, save_safetensors
from april_ext.model.logits import processed_logprobs
from april_ext.persistence import atomic_directory, atomic_write, ensure_dir
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.protocol.trainer import ExportedWeights

MIXED_PRECISION = ("auto", "bf16", "fp32")
_STATE_FILE = "trainer_state.pt"
_REFERENCE_FILE = "reference.safetensors"
_FORMAT = "april_ext.torch_trainer/1"
# pi_train of a token that top-k / top-p drop (probability 0): finite, so that PPO ratios, TIS weights and
# the KL term stay finite (exp(50) fits in float32) and masked products stay 0; it carries no gradient.
DROPPED_LOGPROB = -50.0


@dataclass(frozen=True)
class TrainerConfig:
    """Optimisation settings of the torch trainer.

    micro_batch_tokens: token budget of one forward/backward (whole samples; a longer sample runs alone).
    minibatches: optimizer steps per batch; the batch's groups are split into this many consecutive
        parts, and the PPO clip compares against the logprobs of the weights before the first step.
    mixed_precision: "auto" (bf16 autocast on CUDA / ROCm, fp32 on CPU), "bf16" or "fp32".
    device: None picks "cuda" when available, else "cpu".
    temperature: the rollouts' sampling temperature. pi_train is softmax(logits / temperature), the
        distribution the engine draws from and computes behavior logprobs with, so importance weights
        compare like with like and the gradient is that of the sampling policy; 0 (greedy rollouts) uses
        the raw logits, as the engine's greedy logprobs do.
    top_k, top_p: the rollouts' top-k (<= 0: off) and top-p (1.0: off). When set (and temperature > 0),
        pi_train is the engine's sampling distribution after them (engine.processed_logprobs): the tokens
        they drop are chosen without gradient, and the log-softmax renormalises over the kept ones; a
        dropped token (an off-policy token outside the current policy's top-p) gets DROPPED_LOGPROB.
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
    minibatches: int = 1
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
            except (RuntimeError, TypeError):
                raise ConfigError(f"TrainerConfig.device must be None or a torch device string such as "
                                  f"'cpu' or 'cuda:0', got {self.device!r}") from None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(name: str, value: object, allowed: str = "a finite number > 0") -> None:
    if not _is_number(value) or value <= 0:  # type: ignore[operator]
        raise ConfigError(f"TrainerConfig.{name} must be {allowed}, got {value!r}")


def split_by_token_budget(lengths: list[int], budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) runs of samples whose total length fits the budget; a sample longer than
    the budget forms a run of its own."""
    runs: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            runs.append((start, i))
            start, used = i, 0
        used += n
    if start < len(lengths):
        runs.append((start, len(lengths)))
    return runs


@dataclass
class _StepInputs:
    """One batch on the trainer's device. Per token [T]: tokens, seq_index, token_advantages, versions,
    trainable (loss mask without sample starts), mask (trainable after off-policy masking), behavior.
    Per sample: offsets [S + 1] (CPU), group_index [S] (CPU), advantages [S]."""

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


class TorchTrainer:
    """Trains a LlamaForCausalLM on TrainingBatches with the configured RL objective.

    The reference policy for the KL term (kl_coef > 0) is a frozen copy of the model at construction.
    ``version`` starts at ``initial_version`` and grows by one per ``train_step``.
    """

    # Saved in the trainer state; a checkpoint loads only into a trainer of the same format (the
    # optimizer state is keyed by parameter order, which differs between trainers).
    checkpoint_format = _FORMAT

    def __init__(self, model: LlamaForCausalLM, config: TrainerConfig | None = None, *,
                 initial_version: int = 0) -> None:
        self.config = config or TrainerConfig()
        device = self.config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.model.train()
        self._autocast = _use_bf16_autocast(self.config.mixed_precision, self.device)
        c = self.config
        # The rollouts' top-k / top-p, as the engine's sampler takes them; None when neither filters.
        self._filters = (SamplingParams(temperature=c.temperature, top_p=c.top_p, top_k=c.top_k)
                         if c.temperature > 0 and (c.top_k > 0 or c.top_p < 1) else None)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.lr, betas=self.config.betas,
                                           eps=self.config.adam_eps, weight_decay=self.config.weight_decay)
        self.ref_model: LlamaForCausalLM | None = None
        if self.config.algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self._version = int(initial_version)
        self.step = 0
        self.offloaded = False
        self._optimizer_in_region = False
        if self.config.colocated:
            self._colocate()

    @property
    def version(self) -> int:
        return self._version

    # ----- training -------------------------------------------------------------------------------------

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self._require_onloaded("train_step")
        _validate_batch(batch)
        if batch.policy_version != self._version:
            raise InvalidStateError(f"batch.policy_version is {batch.policy_version} but the trainer holds "
                                    f"version {self._version}; the batch must be built for the current version")
        start = time.perf_counter()
        inputs = self._prepare(batch)
        parts = _minibatch_bounds(inputs.group_index, self.config.minibatches)
        old_logprobs = self._logprobs_no_grad(self.model, inputs.tokens, inputs.offsets) if len(parts) > 1 else None
        sums: dict[str, float] = {}
        grad_norms = []
        clip = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        for s0, s1 in parts:
            self._accumulate_gradients(inputs, s0, s1, old_logprobs, sums)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, clip)))
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=False)
            if self.config.colocated and not self._optimizer_in_region:
                self._move_optimizer_state()
        self._version += 1
        self.step += 1
        metrics = {name: value / len(parts) for name, value in sums.items()}
        staleness = (batch.policy_version - inputs.versions.to(torch.int64))[inputs.trainable.bool()]
        rewards = torch.from_numpy(batch.rewards).to(torch.float32)
        elapsed = time.perf_counter() - start
        metrics.update({
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "lr": self.config.lr,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "advantage_abs_mean": float(inputs.advantages.abs().mean()),
            "response_len_mean": float(batch.response_lens.mean()),
            "n_tokens": float(batch.n_tokens),
            "n_loss_tokens": float(inputs.mask.sum()),
            "n_masked_offpolicy_tokens": float(inputs.trainable.sum() - inputs.mask.sum()),
            "offpolicy_token_frac": float((staleness > 0).float().mean()) if staleness.numel() else 0.0,
            "max_staleness": float(staleness.max()) if staleness.numel() else 0.0,
            "optimizer_steps": float(len(parts)),
            "step_time_s": elapsed,
            "tokens_per_s": batch.n_tokens / elapsed if elapsed > 0 else 0.0,
            "version": float(self._version),
        })
        return metrics

    def token_logprobs(self, batch: TrainingBatch) -> np.ndarray:
        """pi_train of every token of ``batch`` under the current weights, as ``train_step`` computes it
        (float32 [T], 0 at each sample's first token): comparable position by position with
        ``batch.behavior_logprobs``."""
        self._require_onloaded("token_logprobs")
        _validate_batch(batch)
        tokens = torch.from_numpy(batch.tokens).to(self.device, torch.int64)
        offsets = torch.from_numpy(batch.offsets).to(torch.int64)
        return self._logprobs_no_grad(self.model, tokens, offsets).cpu().numpy()

    def _prepare(self, batch: TrainingBatch) -> _StepInputs:
        """Device tensors of the batch plus advantages and the effective loss mask."""
        algo = self.config.algorithm
        data = batch.to_torch()
        dev = self.device
        offsets = data["offsets"].to(torch.int64)
        seq_index = torch.repeat_interleave(torch.arange(batch.n_samples), offsets.diff()).to(dev)
        advantages = group_advantages(data["rewards"], data["group_index"],
                                      normalize_std=algo.advantage == "grpo", eps=algo.adv_eps).to(dev)
        versions = data["versions"].to(dev)
        # The first token of a sample has no prediction to train.
        trainable = data["loss_mask"].to(dev, torch.float32).index_fill(0, offsets[:-1].to(dev), 0.0)
        mask = offpolicy_loss_mask(trainable, versions, batch.policy_version, mode=algo.offpolicy_mask,
                                   max_staleness=algo.max_staleness)
        return _StepInputs(tokens=data["tokens"].to(dev, torch.int64), offsets=offsets, seq_index=seq_index,
                           group_index=data["group_index"], advantages=advantages,
                           token_advantages=advantages[seq_index], versions=versions, trainable=trainable,
                           mask=mask, behavior=data["behavior_logprobs"].to(dev, torch.float32))

    def _accumulate_gradients(self, inputs: _StepInputs, s0: int, s1: int, old_logprobs: torch.Tensor | None,
                              sums: dict[str, float]) -> None:
        """Forward and backward of samples [s0, s1) in micro-batches; adds their metrics to ``sums``."""
        algo = self.config.algorithm
        offsets, seq_index = inputs.offsets, inputs.seq_index
        t0, t1 = int(offsets[s0]), int(offsets[s1])
        weights = aggregation_weights(inputs.mask[t0:t1], seq_index[t0:t1] - s0, s1 - s0, algo.aggregation)
        for a, b in split_by_token_budget(offsets[s0:s1 + 1].diff().tolist(), self.config.micro_batch_tokens):
            a, b = a + s0, b + s0
            u0, u1 = int(offsets[a]), int(offsets[b])
            cu = offsets[a:b + 1] - offsets[a]
            tokens = inputs.tokens[u0:u1]
            logprobs, entropy = self._logprobs(self.model, tokens, cu, with_entropy=True)
            ref = self._logprobs_no_grad(self.ref_model, tokens, cu) if self.ref_model is not None else None
            w = weights[u0 - t0:u1 - t0]
            out = policy_loss(algo, PolicyLossInputs(
                logprobs=logprobs,
                old_logprobs=old_logprobs[u0:u1] if old_logprobs is not None else logprobs.detach(),
                behavior_logprobs=inputs.behavior[u0:u1], advantages=inputs.token_advantages[u0:u1],
                mask=inputs.mask[u0:u1], weights=w, seq_index=seq_index[u0:u1] - a, n_seqs=b - a,
                ref_logprobs=ref))
            out.loss.backward()
            _accumulate(sums, "loss", float(out.loss.detach()))
            _accumulate(sums, "entropy", float((w * entropy).sum()))
            for name, value in out.metrics.items():
                _accumulate(sums, name, float(value))

    def _logprobs(self, model: LlamaForCausalLM, tokens: torch.Tensor, cu_seqlens: torch.Tensor, *,
                  with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability of each token given the tokens before it in its sample (0 at sample starts) under
        the sampling distribution (logits / temperature, then top-k / top-p), and that distribution's entropy
        (without gradient)."""
        autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16) if self._autocast
                    else contextlib.nullcontext())
        with autocast:
            logits = model(tokens, cu_seqlens=cu_seqlens.to(tokens.device))
        logits = logits.float()
        filters = self._filters
        if filters is not None:
            # The engine's own processing picks the kept tokens; the gradient flows through the kept logits.
            with torch.no_grad():
                dropped = processed_logprobs(logits.detach(), [filters] * logits.shape[0]) == float("-inf")
            logits = logits.masked_fill(dropped, float("-inf"))
        if self.config.temperature > 0:
            logits = logits / self.config.temperature
        logp = torch.log_softmax(logits, dim=-1)
        out = torch.zeros(tokens.shape[0], dtype=torch.float32, device=tokens.device)
        picked = logp[:-1].gather(1, tokens[1:, None]).squeeze(1)
        if filters is not None:
            picked = torch.where(picked == float("-inf"), torch.full_like(picked, DROPPED_LOGPROB), picked)
        out[1:] = picked
        starts = cu_seqlens[:-1].to(tokens.device)
        out = out.index_fill(0, starts, 0.0)
        entropy = torch.zeros_like(out)
        if with_entropy:
            with torch.no_grad():
                # entr(0) = 0: dropped tokens add nothing (exp(-inf) * -inf would be nan).
                entropy[1:] = torch.special.entr(logp[:-1].exp()).sum(-1)
                entropy.index_fill_(0, starts, 0.0)
        return out, entropy

    @torch.no_grad()
    def _logprobs_no_grad(self, model: LlamaForCausalLM, tokens: torch.Tensor,
                          offsets: torch.Tensor) -> torch.Tensor:
        lengths = offsets.diff().tolist()
        pieces = []
        for a, b in split_by_token_budget(lengths, self.config.micro_batch_tokens):
            u0, u1 = int(offsets[a]), int(offsets[b])
            pieces.append(self._logprobs(model, tokens[u0:u1], offsets[a:b + 1] - offsets[a])[0])
        return torch.cat(pieces)

    # ----- weights and checkpoints ----------------------------------------------------------------------

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        self._require_onloaded("export_weights")
        tensors = [(name, p.detach().to("cpu", copy=True) if to_cpu else p.detach())
                   for name, p in self.model.named_parameters()]
        return ExportedWeights(version=self._version, tensors=tensors)

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """Writes into a temporary directory next to ``path`` and renames it into place, so ``path`` is
        either the previous checkpoint or the complete new one. ``extra`` must hold tensors, numbers,
        strings, bytes, lists, tuples and dicts."""
        self._require_onloaded("save_checkpoint")
        _check_extra(extra or {}, "extra")
        path = os.path.abspath(os.fspath(path))
        ensure_dir(os.path.dirname(path))
        with atomic_directory(path) as tmp:
            self._save_weights(tmp)
            state = {
                "format": self.checkpoint_format,
                "version": self._version,
                "step": self.step,
                "optimizer": self.optimizer.state_dict(),
                "rng": _rng_state(),
                "trainer_config": _plain(asdict(self.config)),
                "extra": extra or {},
            }
            atomic_write(os.path.join(tmp, _STATE_FILE), lambda temp: torch.save(state, temp))

    def _save_weights(self, directory: str) -> None:
        """The policy as a Hugging Face checkpoint directory, and the KL reference beside it."""
        save_pretrained(self.model, directory)
        if self.ref_model is not None:
            save_safetensors(dict(self.ref_model.named_parameters()), directory, _REFERENCE_FILE)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        self._require_onloaded("load_checkpoint")
        path = os.fspath(path)
        state_file = os.path.join(path, _STATE_FILE)
        if not os.path.isfile(state_file):
            raise PersistenceError(f"{path!r} is not a trainer checkpoint: {_STATE_FILE} is missing")
        try:
            state = torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as err:  # torch.load raises pickle / zip / runtime errors for damaged files
            raise CorruptStateError(f"{state_file}: unreadable trainer state ({err})") from None
        if not isinstance(state, dict) or state.get("format") != self.checkpoint_format:
            raise CorruptStateError(f"{state_file}: not a {self.checkpoint_format} state")
        if (self.ref_model is None) != (not os.path.isfile(os.path.join(path, _REFERENCE_FILE))):
            raise InvalidStateError(f"{path!r} was saved with kl_coef "
                                    f"{'0' if self.ref_model is not None else '> 0'}, this trainer has "
                                    f"kl_coef={self.config.algorithm.kl_coef}")
        self.model.load_weights(iter_safetensors(path))
        if self.ref_model is not None:
            self.ref_model.load_weights(iter_safetensors_file(os.path.join(path, _REFERENCE_FILE)))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.colocated:
            # load_state_dict replaced the state tensors with ordinary ones.
            self._move_optimizer_state()
        _set_rng_state(state["rng"])
        self._version = int(state["version"])
        self.step = int(state["step"])
        return dict(state["extra"])

    # ----- colocated memory -----------------------------------------------------------------------------

    def offload(self) -> None:
        """Pauses the trainer's memory tag (colocated mode); without colocation there is nothing to release."""
        if not self.config.colocated or self.offloaded:
            return
        from april_ext import memory

        memory.pause(self.config.memory_tag)
        self.offloaded = True

    def onload(self) -> None:
        """Resumes what ``offload`` released: the same addresses, weights and optimizer state restored."""
        if not self.config.colocated or not self.offloaded:
            return
        from april_ext import memory

        memory.resume(self.config.memory_tag)
        self.offloaded = False

    def _require_onloaded(self, what: str) -> None:
        if self.offloaded:
            raise InvalidStateError(f"{what} needs the trainer's memory: call onload() after offload()")

    def _colocate(self) -> None:
        from april_ext import memory

        tag = self.config.memory_tag
        memory.move_module_to_region(self.model, tag, cpu_backup=True)
        if self.ref_model is not None:
            memory.move_module_to_region(self.ref_model, tag, cpu_backup=True)
        # One flat gradient buffer per dtype; autograd accumulates into existing .grad tensors in place.
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            flat = memory.empty(sum(p.numel() for p in params), dtype, tag=tag, device=self.device,
                                cpu_backup=False)
            flat.zero_()
            offset = 0
            for p in params:
                p.grad = flat[offset:offset + p.numel()].view(p.shape)
                offset += p.numel()

    def _move_optimizer_state(self) -> None:
        from april_ext import memory

        memory.move_optimizer_to_region(self.optimizer, self.config.memory_tag, cpu_backup=True)
        self._optimizer_in_region = True


def _use_bf16_autocast(mode: str, device: torch.device) -> bool:
    """"auto": bf16 on GPUs that support it, fp32 elsewhere; "bf16" / "fp32" as asked."""
    if mode == "auto":
        return device.type == "cuda" and torch.cuda.is_bf16_supported()
    return mode == "bf16"


def _validate_batch(batch: TrainingBatch) -> None:
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


def _minibatch_bounds(group_index: torch.Tensor, minibatches: int) -> list[tuple[int, int]]:
    """Sample ranges of ``minibatches`` parts with whole groups and about equal numbers of groups."""
    starts = [0] + (torch.nonzero(group_index.diff() != 0).flatten() + 1).tolist()
    n_groups = len(starts)
    parts = min(minibatches, n_groups)
    bounds = [starts[(n_groups * k) // parts] for k in range(parts)] + [int(group_index.shape[0])]
    return [(bounds[k], bounds[k + 1]) for k in range(parts)]


_EXTRA_LEAVES = (type(None), bool, int, float, str, bytes, torch.Tensor)


def _check_extra(value: Any, where: str) -> None:
    """Rejects at save time what torch.load(weights_only=True) could not read back."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise InvalidArgumentError(f"{where} has a key {key!r} of type {type(key).__name__}; "
                                           f"keys must be str or int")
            _check_extra(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_extra(item, f"{where}[{i}]")
    elif not isinstance(value, _EXTRA_LEAVES):
        raise InvalidArgumentError(f"{where} is a {type(value).__name__}; a checkpoint's extra may hold "
                                   f"tensors, numbers, strings, bytes, None, lists, tuples and dicts")


def _accumulate(sums: dict[str, float], name: str, value: float) -> None:
    sums[name] = sums.get(name, 0.0) + value


def _plain(value: Any) -> Any:
    """Config values as types torch.load(weights_only=True) accepts."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _plain(random.getstate()),
        "numpy": {"name": np_state[0], "keys": torch.from_numpy(np_state[1].astype(np.int64)),
                  "pos": int(np_state[2]), "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), npst["pos"], npst["has_gauss"],
                         npst["cached"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
