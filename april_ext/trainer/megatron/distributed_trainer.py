"""DistributedMegatronTrainer: the RL step on a GPTModel split by tensor, pipeline and data parallelism,
with megatron-core's own machinery.

- The model: one pipeline stage of a GPTModel (local layer spec, packed THD attention), wrapped in
  megatron-core's DistributedDataParallel (contiguous grad buffers, grads reduced across data-parallel
  ranks after the last micro-batch); bf16 parameters (Float16Module) with a GPU, fp32 on a CPU.
- The optimizer: ``get_megatron_optimizer`` (Adam with fp32 main parameters, gradient clipping by the
  global norm across all model-parallel ranks, optionally the distributed optimizer).
- The step: ``get_forward_backward_func`` (1F1B across pipeline stages; plain accumulation without
  pipelining) over micro-batches of whole samples packed into one row each (packed.pack), so the work is
  that of the real tokens. The loss is the torch trainer's (algorithms.policy_loss with aggregation
  weights over the whole minibatch), computed on the last stage from per-token log-probs of the
  vocabulary-sharded logits (vocab_parallel.token_logprobs).
- Experts (Qwen3-MoE): megatron-core MoE layers, split across expert-parallel ranks (which are
  data-parallel ranks); their micro-batches are made alike across the expert-parallel group
  (``_row_lengths``). A vocabulary that TP does not divide is padded to a multiple of TP; the padded
  logits get no probability.
- Data parallelism: every rank receives the same TrainingBatch; data-parallel rank r trains the r-th of
  dp consecutive slices of each minibatch. Each rank's loss is its slice's share of the minibatch loss
  times dp, and DDP averages over dp, so the update equals one process training the whole minibatch.

Every rank of the world constructs the trainer and calls each method in the same order (they are
collective). Weights leave in HF names through ``sharded.iter_hf_weights`` (gathered, one tensor at a
time).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from april_ext.algorithms import PolicyLossInputs, aggregation_weights, policy_loss
from april_ext.batch import TrainingBatch
from april_ext.errors import (
    AprilError,
    ConfigError,
    CorruptStateError,
    InvalidArgumentError,
    InvalidStateError,
)
from april_ext.persistence import atomic_directory
from april_ext.protocol.trainer import ExportedWeights
from april_ext.trainer import checkpoint
from april_ext.trainer.batching import (
    StepInputs,
    apply_kl_shaping,
    minibatch_bounds,
    prepare_inputs,
    split_by_token_budget,
    validate_batch,
    validate_step_batch,
)
from april_ext.trainer.config import TrainerConfig, set_scheduled_lr
from april_ext.trainer.logprobs import use_bf16_autocast
from april_ext.trainer.loss_step import step_metrics
from april_ext.trainer.megatron import checkpoint_files, compat, parallel, sharded
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.trainer import MegatronTrainerConfig

CHECKPOINT_FORMAT = "april_ext.megatron_distributed/1"
# The distributed optimizer's checkpoint format. megatron-core 0.16's default ("fully_sharded_model_space")
# builds ShardedTensors with a flattened_range, which its own dist_checkpointing refuses. "fully_reshardable"
# stores each parameter's Adam state in the model's own shape, so it loads into any tensor / pipeline /
# data-parallel layout; "mem_efficient" gathers it over gloo on data-parallel rank 0 (the other exchange
# moves CPU buffers with Tensor.cuda()). Ignored by the plain (non-distributed) optimizer.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": True}

logger = logging.getLogger(__name__)


def optimizer_config(settings: TrainerConfig, par: MegatronParallelConfig, *, bf16: bool) -> Any:
    """megatron-core's OptimizerConfig for the trainer: Adam with TrainerConfig's lr, betas, eps, weight decay
    and ``grad_clip`` (as ``clip_grad``), fp32 main parameters, the distributed optimizer when ``par`` says so,
    and with ``par.optimizer_cpu_offload`` the HybridDeviceOptimizer (``optimizer_cpu_offload``,
    ``optimizer_offload_fraction``) on the precision-aware path Megatron-LM requires for it
    (``use_precision_aware_optimizer``)."""
    from megatron.core.optimizer import OptimizerConfig

    offload = par.optimizer_cpu_offload
    if offload:
        compat.patch_te_version_check()
    return OptimizerConfig(optimizer="adam", lr=settings.lr, min_lr=settings.lr, weight_decay=settings.weight_decay,
                           adam_beta1=settings.betas[0], adam_beta2=settings.betas[1], adam_eps=settings.adam_eps,
                           clip_grad=settings.grad_clip if settings.grad_clip is not None else 0.0, bf16=bf16,
                           params_dtype=torch.bfloat16 if bf16 else torch.float32,
                           use_distributed_optimizer=par.use_distributed_optimizer, optimizer_cpu_offload=offload,
                           optimizer_offload_fraction=par.optimizer_offload_fraction if offload else 0.0,
                           use_precision_aware_optimizer=offload)


@dataclass(frozen=True)
class _MicroBatch:
    """Samples [a, b) (tokens [t0, t1)) of the batch, packed; the index-th micro-batch of its minibatch."""

    index: int
    a: int
    b: int
    t0: int
    t1: int
    packed: Any


class DistributedMegatronTrainer:
    """Trains a megatron-core GPTModel across the ranks ``config.parallel`` describes (see the module
    docstring). weights: the whole model in HF names, as named tensors or a checkpoint directory (every
    rank reads only its slice, parameter by parameter: sharded.load_hf_weights), or None for Megatron's
    seeded initialisation."""

    def __init__(self, config: MegatronTrainerConfig, weights: sharded.HFWeights | None = None,
                 *, initial_version: int = 0) -> None:
        if not isinstance(config, MegatronTrainerConfig):
            raise ConfigError(f"config must be a MegatronTrainerConfig, got {type(config).__name__}")
        settings, model_config, par = config.trainer, config.model, config.parallel
        if settings.colocated:
            raise ConfigError("TrainerConfig.colocated is not supported by the distributed Megatron trainer")
        if settings.temperature > 0 and (settings.top_k > 0 or settings.top_p < 1):
            raise ConfigError("TrainerConfig.top_k / top_p need the whole vocabulary on one rank; the distributed "
                              "Megatron trainer computes log-probs from vocabulary-sharded logits (leave them off)")
        self.config = config
        self.settings = settings
        # Every tensor-parallel rank holds an equal slice of the embedding and output rows.
        self.padded_vocab_size = sharded.padded_vocab_size(model_config.vocab_size, par.tensor_model_parallel_size)
        device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        self.bf16 = use_bf16_autocast(settings.mixed_precision, self.device)
        if self.bf16 and self.device.type != "cuda":
            raise ConfigError("TrainerConfig.mixed_precision='bf16' needs a GPU in the distributed Megatron trainer "
                              "(bf16 parameters with fp32 main parameters)")
        # Before any rank builds: megatron-core's own refusals name neither the flag nor the model's numbers.
        parallel.validate_layout(par, model_config)
        if par.optimizer_cpu_offload and self.device.type != "cuda":
            raise ConfigError(f"MegatronParallelConfig.optimizer_cpu_offload=True needs a GPU, and this trainer runs on "
                              f"{self.device.type}: megatron-core's HybridDeviceOptimizer copies between the GPU and "
                              "pinned host memory on CUDA streams (leave optimizer_cpu_offload off on a CPU)")
        if model_config.num_experts and par.pipeline_model_parallel_size > 1 and self.device.type != "cuda":
            raise ConfigError("a mixture-of-experts model with pipeline_model_parallel_size > 1 needs a GPU: "
                              "megatron-core passes packed rows of varying length between stages only with the "
                              "alltoall token dispatcher, which needs CUDA")
        parallel.initialize(par, seed=config.seed)
        from megatron.core import parallel_state as ps

        self._ps = ps
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.first_stage = ps.is_pipeline_first_stage()
        self.last_stage = ps.is_pipeline_last_stage()
        # Every MoE layer is a collective over the expert-parallel group (see _row_lengths).
        self._ep_group = (ps.get_expert_model_parallel_group()
                          if model_config.num_experts and ps.get_expert_model_parallel_world_size() > 1 else None)
        if weights is not None and not isinstance(weights, (str, os.PathLike, Mapping)):
            weights = dict(weights)  # read twice with a reference model; it holds the caller's tensors, no copy
        self.model = self._build(weights, train=True)
        self.ref_model = None
        if settings.algorithm.needs_reference:
            # slime's --ref-load: the KL reference from another checkpoint, each rank reading its slice.
            self.ref_model = self._build(settings.reference if settings.reference is not None else weights,
                                         train=False)
            if weights is None and settings.reference is None:
                # The reference starts from the policy's seeded initialisation (same layout: a local copy).
                self.ref_gpt.load_state_dict(self.gpt.state_dict())
        elif settings.reference is not None and dist.get_rank() == 0:
            logger.warning("TrainerConfig.reference=%r is not used: no KL term needs a reference policy "
                           "(kl_loss_coef=0 and no KL reward shaping)", settings.reference)
        if (note := settings.algorithm.unused_kl_coef_note()) is not None and dist.get_rank() == 0:
            logger.warning(note)
        self.optimizer = self._build_optimizer()
        self._version = int(initial_version)
        self.step = 0
        self.iterations = 0
        """Optimizer steps taken: the position in the learning-rate schedule."""
        self._sums: dict[str, float] = {}

    # ----- construction -----------------------------------------------------------------------------------

    def _build(self, weights: sharded.HFWeights | None, *, train: bool) -> Any:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.transformer.module import Float16Module

        from april_ext.trainer.megatron.model import build_gpt_model

        par = self.config.parallel
        rng = torch.get_rng_state()
        torch.manual_seed(self.config.seed)
        try:
            # bf16 parameters (and pipeline activations) with a GPU; Megatron's optimizer keeps fp32 main copies.
            gpt = build_gpt_model(self.config.model, packed=True, pre_process=self.first_stage,
                                  params_dtype=torch.bfloat16 if self.bf16 else torch.float32,
                                  post_process=self.last_stage, sequence_parallel=par.sequence_parallel,
                                  tensor_model_parallel_size=par.tensor_model_parallel_size,
                                  pipeline_model_parallel_size=par.pipeline_model_parallel_size,
                                  expert_model_parallel_size=par.expert_model_parallel_size,
                                  vocab_size=self.padded_vocab_size, bf16=self.bf16, **self._pipeline_changes())
        finally:
            torch.set_rng_state(rng)
        if weights is not None:
            sharded.load_hf_weights(gpt, weights, self.config.model)
        gpt.to(self.device)
        if train:
            self.gpt = gpt
        else:
            self.ref_gpt = gpt
        module = Float16Module(gpt.config, gpt) if self.bf16 else gpt
        if not train:
            return module.eval().requires_grad_(False)
        ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=par.use_distributed_optimizer), module)
        gpt.config.finalize_model_grads_func = finalize_model_grads
        gpt.config.no_sync_func = ddp.no_sync
        return ddp

    def _pipeline_changes(self) -> dict[str, Any]:
        # Stages exchange activations of each micro-batch's own length (packed rows differ in length);
        # megatron-core allows that only with the alltoall MoE dispatcher (checked even without experts).
        if self.config.parallel.pipeline_model_parallel_size == 1:
            return {}
        return {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"}

    def _build_optimizer(self) -> Any:
        from megatron.core.optimizer import get_megatron_optimizer

        with compat.cuda_type_names():
            return get_megatron_optimizer(optimizer_config(self.settings, self.config.parallel, bf16=self.bf16),
                                          [self.model])

    @property
    def version(self) -> int:
        return self._version

    # ----- the step ---------------------------------------------------------------------------------------

    def train_step(self, batch: TrainingBatch) -> dict[str, float]:
        validate_step_batch(batch, self._version)
        start = time.perf_counter()
        algo = self.settings.algorithm
        inputs = prepare_inputs(batch, algo, self.device)
        bounds = minibatch_bounds(inputs.group_index, self.settings.minibatches)
        mine = [self._micro_batches(inputs, *self._my_slice(s0, s1)) for s0, s1 in bounds]
        # With several optimizer steps the clip compares against the weights before the first one; the KL
        # reward shaping takes the log-probs before the update too (slime's).
        old = ([self._forward_logprobs(self.model, mbs) for mbs in mine] if len(bounds) > 1 or algo.kl_shaping
               else None)
        ref = [self._forward_logprobs(self.ref_model, mbs) for mbs in mine] if self.ref_model is not None else None
        kl = None
        if algo.kl_shaping:
            assert old is not None and ref is not None  # needs_reference holds
            # The advantages of a sample need its KL only, but the whitening spans the batch: every rank
            # assembles the whole batch's log-probs and computes the torch trainer's advantages.
            kl = apply_kl_shaping(inputs, algo, self._whole_batch(mine, old, batch.n_tokens),
                                  self._whole_batch(mine, ref, batch.n_tokens))
        self._sums = {}
        grad_norms = []
        for k, (s0, s1) in enumerate(bounds):
            offsets = inputs.offsets
            t0, t1 = int(offsets[s0]), int(offsets[s1])
            weights = aggregation_weights(inputs.mask[t0:t1], inputs.seq_index[t0:t1] - s0, s1 - s0,
                                          algo.aggregation)
            context = _StepContext(inputs=inputs, t0=t0, weights=weights,
                                   old=old[k] if old is not None else None, ref=ref[k] if ref is not None else None,
                                   n_micro=len(mine[k]))
            self._run(self.model, mine[k], partial(self._loss, context), forward_only=False)
            lr = set_scheduled_lr(self.optimizer, self.settings, self.iterations)
            with compat.cuda_type_names():
                ok, grad_norm, _ = self.optimizer.step()
            self.iterations += 1
            if not ok:
                raise InvalidStateError("megatron-core's optimizer skipped the step (non-finite gradients)")
            grad_norms.append(float(grad_norm) if grad_norm is not None else 0.0)
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        self._version += 1
        self.step += 1
        return step_metrics(batch, inputs, self._reduce_sums(), grad_norms, lr, self._version,
                            time.perf_counter() - start, kl)

    def token_logprobs(self, batch: TrainingBatch) -> np.ndarray:
        """pi_train of every token of ``batch`` under the current weights (float32 [T], 0 at each sample's
        first token), on every rank."""
        validate_batch(batch)
        inputs = prepare_inputs(batch, self.settings.algorithm, self.device)
        a, b = self._my_slice(0, batch.n_samples)
        mbs = self._micro_batches(inputs, a, b)
        pieces = self._forward_logprobs(self.model, mbs)
        report = self.last_stage and self._ps.get_tensor_model_parallel_rank() == 0
        mine = (int(inputs.offsets[a]), torch.cat(pieces).cpu().numpy()) if report and pieces else None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out = np.zeros(batch.n_tokens, dtype=np.float32)
        for item in gathered:
            if item is not None:
                out[item[0]:item[0] + len(item[1])] = item[1]
        return out

    def _whole_batch(self, mine: list[list[_MicroBatch]], pieces: list[list[torch.Tensor]],
                     n_tokens: int) -> torch.Tensor:
        """Per-token values of the whole batch [n_tokens] on every rank, from each last-stage rank's
        ``pieces`` (one per micro-batch of ``mine``)."""
        report = self.last_stage and self._ps.get_tensor_model_parallel_rank() == 0
        local = ([(mb.t0, piece.cpu()) for mbs, part in zip(mine, pieces) for mb, piece in zip(mbs, part)]
                 if report else None)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        out = torch.zeros(n_tokens, dtype=torch.float32)
        for items in gathered:
            for t0, piece in items or ():
                out[t0:t0 + piece.numel()] = piece
        return out.to(self.device)

    def _my_slice(self, s0: int, s1: int) -> tuple[int, int]:
        n = s1 - s0
        if n < self.dp_size:
            raise InvalidArgumentError(f"a minibatch of {n} samples cannot be split across {self.dp_size} "
                                       f"data-parallel ranks")
        return s0 + (n * self.dp_rank) // self.dp_size, s0 + (n * (self.dp_rank + 1)) // self.dp_size

    def _micro_batches(self, inputs: StepInputs, a: int, b: int) -> list[_MicroBatch]:
        from april_ext.trainer.megatron.packed import pack

        offsets = inputs.offsets
        multiple = self.config.parallel.tensor_model_parallel_size if self.config.parallel.sequence_parallel else 1
        splits = [(u + a, v + a) for u, v in split_by_token_budget(
            offsets[a:b + 1].diff().tolist(), self.settings.micro_batch_tokens, self.settings.micro_batch_size)]
        rows = self._row_lengths([int(offsets[v] - offsets[u]) for u, v in splits])
        out = []
        for i, row in enumerate(rows):
            # Past this rank's own micro-batches: filler rows (no samples) as long as its peers'.
            u, v = splits[i] if i < len(splits) else (b, b)
            t0, t1 = int(offsets[u]), int(offsets[v])
            out.append(_MicroBatch(index=i, a=u, b=v, t0=t0, t1=t1,
                                   packed=pack(inputs.tokens[t0:t1], offsets[u:v + 1] - offsets[u], multiple, row)))
        return out

    def _row_lengths(self, lengths: list[int]) -> list[int]:
        """The row length of each micro-batch this rank runs. Alone: its own micro-batches' token counts.
        With expert parallelism every MoE layer all-gathers equal-sized token blocks across the
        expert-parallel group, so its ranks run as many micro-batches as the one with the most, each row
        as long as the longest of that index (filler tokens form a sample of their own: they change no
        real token's output, since no expert has a capacity limit)."""
        if self._ep_group is None:
            return lengths
        count = torch.tensor([len(lengths)], device=self.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self._ep_group)
        rows = torch.zeros(int(count), dtype=torch.int64, device=self.device)
        rows[:len(lengths)] = torch.tensor(lengths, dtype=torch.int64)
        dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=self._ep_group)
        return rows.tolist()

    def _run(self, model: Any, mbs: list[_MicroBatch], loss: Callable[..., Any], *, forward_only: bool) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data: Iterator[_MicroBatch], module: Any) -> tuple[torch.Tensor, Callable[..., Any]]:
            mb = next(data)
            p = mb.packed
            output = module(p.input_ids, p.position_ids, attention_mask=None, packed_seq_params=p.params)
            return output, partial(loss, mb)

        longest = max(mb.packed.input_ids.shape[1] for mb in mbs)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(mbs), model=[model], num_microbatches=len(mbs),
            seq_length=longest, micro_batch_size=1, forward_only=forward_only, collect_non_loss_data=forward_only)

    def _token_logprobs(self, mb: _MicroBatch, output: torch.Tensor, *, with_entropy: bool,
                        entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs [n] of the micro-batch's tokens (0 at sample starts) from the last stage's
        logits [1, n + pad, V/tp]."""
        from april_ext.trainer.megatron.vocab_parallel import token_logprobs

        p = mb.packed
        tokens = p.input_ids[0, :p.n_tokens]
        picked, entropy = token_logprobs(output[0, :p.n_tokens - 1], tokens[1:], self.settings.temperature,
                                         vocab_size=self.config.model.vocab_size, with_entropy=with_entropy,
                                         entropy_grad=entropy_grad)
        starts = p.cu_seqlens[:-1].to(tokens.device)
        out = torch.cat((picked.new_zeros(1), picked)).index_fill(0, starts, 0.0)
        if entropy is not None:
            entropy = torch.cat((entropy.new_zeros(1), entropy)).index_fill(0, starts, 0.0)
        return out, entropy

    def _forward_logprobs(self, model: Any, mbs: list[_MicroBatch]) -> list[torch.Tensor]:
        """Per micro-batch log-probs without gradient (on the last stage; empty elsewhere)."""

        def collect(mb: _MicroBatch, output: torch.Tensor, non_loss_data: bool = False) -> torch.Tensor:
            if mb.a == mb.b:
                return output.new_zeros(0)
            return self._token_logprobs(mb, output, with_entropy=False)[0]

        with torch.no_grad():
            return list(self._run(model, mbs, collect, forward_only=True))

    def _loss(self, ctx: _StepContext, mb: _MicroBatch, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The micro-batch's share of the minibatch loss, scaled for the schedule and DDP (see the module
        docstring); adds the metrics to the step's sums."""
        if mb.a == mb.b:
            # A filler micro-batch (see _row_lengths): no loss, zero gradients.
            return output.sum() * 0.0, {}
        inputs = ctx.inputs
        bonus = self.settings.algorithm.entropy_coef
        logprobs, entropy = self._token_logprobs(mb, output, with_entropy=True, entropy_grad=bonus > 0)
        assert entropy is not None
        u0, u1 = mb.t0, mb.t1
        weights = ctx.weights[u0 - ctx.t0:u1 - ctx.t0]
        out = policy_loss(self.settings.algorithm, PolicyLossInputs(
            logprobs=logprobs,
            old_logprobs=ctx.old[mb.index] if ctx.old is not None else logprobs.detach(),
            behavior_logprobs=inputs.behavior[u0:u1], advantages=inputs.token_advantages[u0:u1],
            mask=inputs.mask[u0:u1], weights=weights, seq_index=inputs.seq_index[u0:u1] - mb.a, n_seqs=mb.b - mb.a,
            ref_logprobs=ctx.ref[mb.index] if ctx.ref is not None else None))
        mean_entropy = (weights * entropy).sum()
        loss = out.loss - bonus * mean_entropy if bonus > 0 else out.loss
        _add(self._sums, "loss", float(loss.detach()))
        _add(self._sums, "entropy", float(mean_entropy.detach()))
        for name, value in out.metrics.items():
            _add(self._sums, name, float(value))
        # The schedule divides by the number of micro-batches and DDP averages over the data-parallel ranks.
        return loss * (ctx.n_micro * self.dp_size), {}

    def _reduce_sums(self) -> dict[str, float]:
        """The metric sums of all data-parallel ranks, known on every rank."""
        report = self.last_stage and self._ps.get_tensor_model_parallel_rank() == 0
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._sums if report else None)
        total: dict[str, float] = {}
        for sums in gathered:
            for name, value in (sums or {}).items():
                _add(total, name, value)
        return total

    # ----- weights ----------------------------------------------------------------------------------------

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The current weights in HF names, gathered across tensor and pipeline ranks one tensor at a time,
        on every rank (collective: every rank iterates to the end)."""
        return sharded.iter_hf_weights(self.gpt, self.config.model)

    def export_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        """The current weights as a stream gathered while it is read (see ``iter_hf_weights``: every rank
        reads its export to the end, and no rank holds more than one gathered parameter at a time)."""
        tensors = ((name, t.to("cpu", copy=True) if to_cpu else t) for name, t in self.iter_hf_weights())
        return ExportedWeights(version=self._version, tensors=tensors)

    @property
    def pipeline_stage(self) -> tuple[int, int]:
        """(this rank's pipeline stage, the number of stages)."""
        from megatron.core import parallel_state

        return (parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_pipeline_model_parallel_world_size())

    def export_stage_weights(self, *, to_cpu: bool = False) -> ExportedWeights:
        """This rank's pipeline stage of the current weights, as ``export_weights`` (gathered while read) but
        a collective of the stage's ranks only, so that each stage's first rank can send its part itself."""
        tensors = ((name, t.to("cpu", copy=True) if to_cpu else t)
                   for name, t in sharded.iter_stage_hf_weights(self.gpt, self.config.model))
        return ExportedWeights(version=self._version, tensors=tensors)

    # ----- checkpoints ------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None) -> None:
        """A megatron-core distributed checkpoint (dist_checkpointing: every rank writes its shards of the
        model, the KL reference and the optimizer state), written into a temporary directory that replaces
        ``path`` once every rank is done. It loads into any tensor / pipeline / data-parallel layout that pads
        the vocabulary alike and uses the same kind of optimizer (distributed or not)."""
        from megatron.core import dist_checkpointing

        checkpoint.check_extra(extra or {}, "extra")
        state = self._sharded_state(loading=False)
        state["trainer"] = {"format": CHECKPOINT_FORMAT, "version": self._version, "step": self.step,
                            "iterations": self.iterations,
                            "padded_vocab_size": self.padded_vocab_size, "layout": self.layout.to_dict(),
                            "extra": extra or {}}
        with contextlib.ExitStack() as stack:
            temp = [stack.enter_context(atomic_directory(path)) if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(temp, src=0)
            dist_checkpointing.save(state, temp[0])
            # Rank 0 renames the directory into place only when every rank has written its shards.
            dist.barrier()

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restores what ``save_checkpoint`` wrote (at any layout); returns its ``extra``."""
        from megatron.core import dist_checkpointing

        path = os.fspath(path)
        self._check_files(path)
        common = dist_checkpointing.load_common_state_dict(path)
        trainer = common.get("trainer") if isinstance(common, dict) else None
        if not isinstance(trainer, dict) or trainer.get("format") != CHECKPOINT_FORMAT:
            raise CorruptStateError(f"{path!r} is not a {CHECKPOINT_FORMAT} checkpoint")
        if trainer.get("padded_vocab_size", self.config.model.vocab_size) != self.padded_vocab_size:
            raise InvalidStateError(f"{path!r} holds a vocabulary padded to {trainer['padded_vocab_size']} rows, "
                                    f"this layout pads it to {self.padded_vocab_size} (the vocabulary rounded up "
                                    f"to a multiple of tensor_model_parallel_size); resume at a tensor-parallel "
                                    f"size that pads it alike")
        with compat.torch_adam_state_loading(self.optimizer):
            loaded = dist_checkpointing.load(self._sharded_state(loading=True), path)
            self.gpt.load_state_dict(loaded["model"])
            if self.ref_model is not None:
                self.ref_gpt.load_state_dict({k.removeprefix("reference."): v
                                              for k, v in loaded["reference"].items()})
            self.optimizer.load_state_dict(loaded["optimizer"])
        self._version = int(trainer["version"])
        self.step = int(trainer["step"])
        # Written before the schedule existed: a step was minibatches optimizer steps.
        self.iterations = int(trainer.get("iterations", self.step * self.settings.minibatches))
        return dict(trainer["extra"])

    @property
    def layout(self) -> checkpoint_files.Layout:
        return checkpoint_files.Layout.of(self.config.parallel, self.dp_size)

    def _check_files(self, path: str) -> None:
        """Rank 0 checks that the checkpoint has every file and tells the others, so that every rank raises
        its error (PersistenceError naming the file) instead of the ranks reading a missing shard failing
        inside the load."""
        verdict: list[AprilError | None] = [None]
        if dist.get_rank() == 0:
            try:
                checkpoint_files.check_files(path, self.layout)
            except AprilError as err:
                verdict[0] = err
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise verdict[0]

    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        model = self.gpt.sharded_state_dict()
        state = {"model": model, "optimizer": self.optimizer.sharded_state_dict(
            model, is_loading=loading, metadata=_OPTIMIZER_FORMAT)}
        if self.ref_model is not None:
            state["reference"] = self.ref_gpt.sharded_state_dict(prefix="reference.")
        return state

    def offload(self) -> None:
        """Nothing to release: the distributed trainer does not run colocated (refused at construction)."""

    def onload(self) -> None:
        """Nothing to restore (see ``offload``)."""


@dataclass(frozen=True)
class _StepContext:
    """What the loss of a minibatch's micro-batches needs: the step's inputs, the minibatch's first token, its aggregation weights, the per-micro-batch old / reference log-probs, the micro-batch count."""

    inputs: StepInputs
    t0: int
    weights: torch.Tensor
    old: list[torch.Tensor] | None
    ref: list[torch.Tensor] | None
    n_micro: int


def _add(sums: dict[str, float], name: str, value: float) -> None:
    sums[name] = sums.get(name, 0.0) + value


__all__ = ["DistributedMegatronTrainer"]
