"""TorchTrainer: the embedded trainer. Same model code as the embedded engine, AdamW, micro-batching by
token budget, gradient clipping, bf16 autocast on GPUs, atomic checkpoints, data parallel across the ranks
of a torchrun launch (trainer.distributed.initialize, then DistributedDataParallel).

The pieces live beside it: the config (trainer.config), the batch on the device and its splits
(trainer.batching), pi_train (trainer.logprobs), the minibatch loss and metrics (trainer.loss_step),
checkpoint files (trainer.checkpoint) and colocated memory (trainer.colocation)."""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import asdict
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from april_ext.algorithms import AlgorithmConfig
from april_ext.batch import TrainingBatch
from april_ext.errors import InvalidStateError
from april_ext.model import LlamaForCausalLM, iter_safetensors, save_pretrained
from april_ext.model.checkpoint import iter_safetensors_file, save_safetensors
from april_ext.protocol.trainer import ExportedWeights
from april_ext.trainer import checkpoint, colocation, distributed
from april_ext.trainer.batching import (
    apply_kl_shaping,
    minibatch_bounds,
    prepare_inputs,
    validate_batch,
    validate_step_batch,
)
from april_ext.trainer.config import TrainerConfig, set_scheduled_lr
from april_ext.trainer.logprobs import PolicyLogprobs
from april_ext.trainer.loss_step import LossStep, step_metrics

_FORMAT = "april_ext.torch_trainer/1"

logger = logging.getLogger(__name__)


class TorchTrainer:
    """Trains a LlamaForCausalLM on TrainingBatches with the configured RL objective.

    The reference policy (for the KL loss, kl_loss_coef > 0, or the KL reward shaping,
    AlgorithmConfig.kl_shaping) is a frozen copy of the model at construction.
    ``version`` starts at ``initial_version`` and grows by one per ``train_step``.

    In a process group of more than one rank (trainer.distributed.initialize under torchrun) the trainer
    is data parallel: every rank constructs it (rank 0's weights are broadcast to the others), gets the
    same TrainingBatches and calls each method in the same order; each rank trains its slice of every
    minibatch (trainer.loss_step) and the update equals one process training the whole batch. Metrics and
    exported weights are the same on every rank; rank 0 alone writes checkpoints, every rank loads them.
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
        self.dp_rank, self.dp_size = distributed.world()
        self._ddp: DistributedDataParallel | None = None
        if self.dp_size > 1 and self.config.colocated:
            # DistributedDataParallel's gradient buckets would live outside the trainer's memory tag, so a
            # colocated trainer all-reduces its own flat gradient buffers (in the tag) instead, as DDP does.
            distributed.broadcast_from_rank_0(list(self.model.parameters()))
        elif self.dp_size > 1:
            device_ids = None
            if self.device.type == "cuda":
                # "cuda" without an index is the rank's GPU (distributed.initialize sets it from LOCAL_RANK).
                device_ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            # Broadcasts rank 0's weights. Buffers (rotary tables) are computed alike on every rank, and
            # broadcasting them in each forward would pair collectives of ranks with different numbers of
            # micro-batches.
            self._ddp = DistributedDataParallel(self.model, device_ids=device_ids, broadcast_buffers=False)
        self.logprobs = PolicyLogprobs(self.config, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.lr, betas=self.config.betas,
                                           eps=self.config.adam_eps, weight_decay=self.config.weight_decay)
        self.ref_model: LlamaForCausalLM | None = None
        if self.config.algorithm.needs_reference:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            if self.config.reference is not None:
                # slime's --ref-load: the KL reference is another checkpoint (Hugging Face names for both models).
                self.ref_model.load_weights(iter_safetensors(self.config.reference))
        elif self.config.reference is not None:
            logger.warning("TrainerConfig.reference=%r is not used: no KL term needs a reference policy "
                           "(kl_loss_coef=0 and no KL reward shaping)", self.config.reference)
        if (note := self.config.algorithm.unused_kl_coef_note()) is not None:
            logger.warning(note)
        self._loss = LossStep(self._ddp or self.model, self.ref_model, self.logprobs, self.config.algorithm,
                              self.config.micro_batch_tokens, self.config.micro_batch_size, self.dp_rank,
                              self.dp_size)
        self._version = int(initial_version)
        self.step = 0
        self.iterations = 0
        """Optimizer steps taken: the position in the learning-rate schedule."""
        self.offloaded = False
        self._optimizer_in_region = False
        self._grad_buffers: list[torch.Tensor] = []
        if self.config.colocated:
            models = [self.model] if self.ref_model is None else [self.model, self.ref_model]
            self._grad_buffers = colocation.move_to_region(models, self.params, self.config.memory_tag, self.device)

    @property
    def version(self) -> int:
        return self._version

    # ----- training -------------------------------------------------------------------------------------

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        self._require_onloaded("train_step")
        validate_step_batch(batch, self._version)
        start = time.perf_counter()
        algo = self.config.algorithm
        inputs = prepare_inputs(batch, algo, self.device)
        parts = minibatch_bounds(inputs.group_index, self.config.minibatches)
        # With several optimizer steps the clip compares against the weights before the first one; the KL
        # reward shaping takes the log-probs before the update too (slime's).
        old_logprobs = (self.logprobs.no_grad(self.model, inputs.tokens, inputs.offsets)
                        if len(parts) > 1 or algo.kl_shaping else None)
        kl = None
        if algo.kl_shaping:
            assert self.ref_model is not None and old_logprobs is not None  # needs_reference holds
            kl = apply_kl_shaping(inputs, algo, old_logprobs,
                                  self.logprobs.no_grad(self.ref_model, inputs.tokens, inputs.offsets))
        sums: dict[str, float] = {}
        grad_norms = []
        clip = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        for s0, s1 in parts:
            self._loss.accumulate_gradients(inputs, s0, s1, old_logprobs, sums)
            if self.dp_size > 1 and self._ddp is None:
                distributed.average_across_ranks(self._grad_buffers)
            grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.params, clip)))
            lr = set_scheduled_lr(self.optimizer, self.config, self.iterations)
            self.optimizer.step()
            self.iterations += 1
            self.optimizer.zero_grad(set_to_none=False)
            if self.config.colocated and not self._optimizer_in_region:
                self._move_optimizer_state()
        if self.dp_size > 1:
            sums = distributed.sum_across_ranks(sums)
        self._version += 1
        self.step += 1
        return step_metrics(batch, inputs, sums, grad_norms, lr, self._version, time.perf_counter() - start, kl)

    def token_logprobs(self, batch: TrainingBatch) -> np.ndarray:
        """pi_train of every token of ``batch`` under the current weights, as ``train_step`` computes it
        (float32 [T], 0 at each sample's first token): comparable position by position with
        ``batch.behavior_logprobs``."""
        self._require_onloaded("token_logprobs")
        validate_batch(batch)
        tokens = torch.from_numpy(batch.tokens).to(self.device, torch.int64)
        offsets = torch.from_numpy(batch.offsets).to(torch.int64)
        return self.logprobs.no_grad(self.model, tokens, offsets).cpu().numpy()

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
        checkpoint.check_extra(extra or {}, "extra")
        # Weights and optimizer state are the same on every rank.
        if self.dp_rank == 0:
            self._write_checkpoint(path, extra)
        if self.dp_size > 1:
            dist.barrier()

    def _write_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None) -> None:
        checkpoint.write_checkpoint(path, self._save_weights, {
            "format": self.checkpoint_format,
            "version": self._version,
            "step": self.step,
            "iterations": self.iterations,
            "optimizer": self.optimizer.state_dict(),
            "rng": checkpoint.rng_state(),
            "trainer_config": checkpoint.plain(asdict(self.config)),
            "extra": extra or {},
        })

    def _save_weights(self, directory: str) -> None:
        """The policy as a Hugging Face checkpoint directory, and the KL reference beside it."""
        save_pretrained(self.model, directory)
        if self.ref_model is not None:
            save_safetensors(dict(self.ref_model.named_parameters()), directory, checkpoint.REFERENCE_FILE)

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        self._require_onloaded("load_checkpoint")
        path = os.fspath(path)
        state = checkpoint.read_state(path, self.checkpoint_format)
        _check_kl_settings(path, state, self.config.algorithm)
        reference = os.path.join(path, checkpoint.REFERENCE_FILE)
        if (self.ref_model is None) != (not os.path.isfile(reference)):
            algo = self.config.algorithm
            saved = ("without a KL reference policy, which this trainer needs" if self.ref_model is not None
                     else "with a KL reference policy, this trainer has none")
            raise InvalidStateError(f"{path!r} was saved {saved} (kl_loss_coef={algo.kl_loss_coef}, kl_coef="
                                    f"{algo.kl_coef} with advantage={algo.advantage!r})")
        self.model.load_weights(iter_safetensors(path))
        if self.ref_model is not None:
            self.ref_model.load_weights(iter_safetensors_file(reference))
        self.optimizer.load_state_dict(state["optimizer"])
        if self.config.colocated:
            # load_state_dict replaced the state tensors with ordinary ones.
            self._move_optimizer_state()
        checkpoint.set_rng_state(state["rng"])
        self._version = int(state["version"])
        self.step = int(state["step"])
        # Written before the schedule existed: a step was minibatches optimizer steps.
        self.iterations = int(state.get("iterations", self.step * self.config.minibatches))
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

    def _move_optimizer_state(self) -> None:
        colocation.move_optimizer_to_region(self.optimizer, self.config.memory_tag)
        self._optimizer_in_region = True


def _check_kl_settings(path: str, state: dict[str, Any], algorithm: AlgorithmConfig) -> None:
    """Refuses a checkpoint saved before AlgorithmConfig.kl_coef was renamed kl_loss_coef (its algorithm has
    kl_coef but no kl_loss_coef: kl_coef was the weight of a k3 KL loss) unless this trainer has that loss
    (kl_loss_coef, kl_loss_type k3) and no KL reward shaping (kl_coef 0), so a resumed run keeps its objective."""
    saved = state.get("trainer_config", {}).get("algorithm", {})
    if not isinstance(saved, dict) or "kl_coef" not in saved or "kl_loss_coef" in saved:
        return
    weight = float(saved["kl_coef"])
    same = algorithm.kl_loss_coef == weight and algorithm.kl_coef == 0
    if not same or (weight > 0 and algorithm.kl_loss_type != "k3"):
        wanted = f"kl_loss_coef={weight}" + (", kl_loss_type='k3'" if weight > 0 else "")
        raise InvalidStateError(
            f"{path!r} was saved when kl_coef named the weight of a k3 KL loss (kl_coef={weight}); that setting is "
            f"kl_loss_coef now and kl_coef is slime's KL reward shaping. To continue that run set {wanted} and "
            f"kl_coef=0 (this trainer has kl_loss_coef={algorithm.kl_loss_coef}, kl_loss_type="
            f"{algorithm.kl_loss_type!r}, kl_coef={algorithm.kl_coef})")


__all__ = ["TorchTrainer"]
