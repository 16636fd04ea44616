"""One rank of tests/test_megatron_distributed.py, started by torchrun: for each layout named on the
command line (in one launch, since importing megatron-core costs seconds per process), builds a
DistributedMegatronTrainer from the counting-task model, computes the batch's per-token log-probs, takes
train steps (recording the whole gradients each optimizer step is fed: GradientRecorder) and exports the
weights; rank 0 writes what it saw to OUT/<layout>.pt.

Usage: torchrun --nproc-per-node N tests/megatron_dist_worker.py OUT LAYOUT [LAYOUT ...]
A layout is tp<T>pp<P>[ep<E>][sp][do][tie|moe|odd][kl][plant] (ep: expert parallel, sp: sequence
parallel, do: distributed optimizer; the model: tied embeddings, Qwen3-MoE, or a vocabulary of 21, which no
TP > 1 divides; kl: the shaped objective of trainer_config(shaped=True); plant: a defect, rank 1 feeds its
optimizer every gradient 1% off); "single" records whether the one-process
MegatronTrainer refuses the two-rank world; "resume" saves a checkpoint at TP=2 and resumes it at TP=1 (two
ranks), "resume_do" the same with the distributed optimizer (TP=2 x DP=2 -> TP=1 x DP=4, four ranks);
"odd_resume" records whether a checkpoint of the odd vocabulary saved at TP=2 is refused at TP=1; "raise":
rank 1 raises while rank 0 waits in a collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _trainer_utils import TASK, make_batch, make_model

from april_ext.algorithms import AlgorithmConfig
from april_ext.errors import InvalidStateError
from april_ext.model import LlamaForCausalLM
from april_ext.persistence import atomic_write
from april_ext.trainer import TrainerConfig
from april_ext.trainer.megatron import parallel, sharded
from april_ext.trainer.megatron.distributed_trainer import DistributedMegatronTrainer
from april_ext.trainer.megatron.parallel import MegatronParallelConfig
from april_ext.trainer.megatron.trainer import MegatronTrainer, MegatronTrainerConfig

TIMEOUT_S = 60.0
LAYOUT = re.compile(r"^tp(\d)pp(\d)(?:ep(\d))?(sp)?(do)?(tie|moe|odd)?(kl)?(plant)?$")
# Qwen3-MoE: layer 0 routes each token to 2 of 4 experts (renormalised), layer 1 is dense.
MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
       "norm_topk_prob": True, "mlp_only_layers": (1,)}
VARIANTS = {"tie": {"tie_word_embeddings": True}, "moe": MOE, "odd": {"vocab_size": 21}}


def tiny_model(seed: int, variant: str | None = None) -> LlamaForCausalLM:
    """The counting-task model of the trainer tests, or a variant of it (VARIANTS)."""
    if variant is None:
        return make_model(seed)
    model = LlamaForCausalLM(TASK.model_config(hidden_size=32, intermediate_size=64, **VARIANTS[variant]))
    model.init_weights(seed)
    return model


def layout_key(name: str) -> tuple[str | None, bool]:
    """(the model variant, whether the objective is the shaped one) a layout name asks for."""
    match = LAYOUT.match(name)
    assert match is not None, name
    return match[6], bool(match[7])


def trainer_config(shaped: bool = False) -> TrainerConfig:
    """Shared with the test's single-process reference. shaped: REINFORCE++ with the KL reward shaping
    (per-token advantages from the whole batch's log-probs), whitening and AReaL's decoupled loss."""
    algorithm = AlgorithmConfig(kl_loss_coef=0.05, kl_loss_type="k3", max_staleness=None)
    if shaped:
        algorithm = AlgorithmConfig.reinforce_plus_plus(
            kl_coef=0.2, kl_loss_coef=0.05, kl_loss_type="k3", gamma=0.9, normalize_advantages=True,
            use_decoupled_loss=True, behav_imp_weight_cap=3.0, max_staleness=None)
    return TrainerConfig(lr=1e-2, micro_batch_tokens=40, grad_clip=0.5, mixed_precision="fp32", algorithm=algorithm,
                         minibatches=2)


class GradientRecorder:
    """The whole gradients, in HF names, that each optimizer step of ``trainer`` is fed (reduced across the
    data-parallel ranks and clipped), gathered as the weights are exported, for tests/_update_bound.py.
    Collective: every rank's step gathers them, and every rank keeps them."""

    def __init__(self, trainer: DistributedMegatronTrainer) -> None:
        self.trainer = trainer
        self.gradients: list[dict[str, torch.Tensor]] = []
        # megatron-core clips every chained optimizer's gradients before the first of them steps.
        inner_optimizers(trainer)[0].register_step_pre_hook(lambda *_: self.gradients.append(self._gather()))

    def _gather(self) -> dict[str, torch.Tensor]:
        if self.trainer.config.parallel.use_distributed_optimizer:
            _all_gather_gradient_shards(self.trainer.model)
        with _gradients_in_place_of_weights(self.trainer.gpt):
            return {name: t.clone() for name, t in sharded.iter_hf_weights(self.trainer.gpt, self.trainer.config.model)}


def inner_optimizers(trainer: DistributedMegatronTrainer) -> list[torch.optim.Optimizer]:
    """The torch optimizers under megatron-core's (a chained one has one for the dense, one for the expert
    parameters)."""
    return [chained.optimizer for chained in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer])]


def _all_gather_gradient_shards(ddp: Any) -> None:
    """Each gradient bucket whole on every data-parallel rank: the distributed optimizer's reduce-scatter
    leaves a rank its own shard only reduced (and clipped, through the optimizer's view of it)."""
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer

    for group in ddp.bucket_groups + ddp.expert_parallel_bucket_groups:
        for bucket in group.buckets:
            mine = shard_buffer(bucket.grad_data, group.intra_distributed_optimizer_instance_size)[
                group.intra_distributed_optimizer_instance_rank].clone()
            dist.all_gather_into_tensor(bucket.grad_data, mine, group=group.intra_distributed_optimizer_instance_group)


@contextlib.contextmanager
def _gradients_in_place_of_weights(gpt: torch.nn.Module) -> Iterator[None]:
    """Every parameter holds its gradient meanwhile, so the export's gather (the tensor-, expert- and
    pipeline-parallel layout, the vocabulary padding, the HF names) gathers the gradients."""
    params = list(gpt.parameters())
    weights = [p.data for p in params]
    try:
        for p in params:
            p.data = p.main_grad
        yield
    finally:
        for p, weight in zip(params, weights):
            p.data = weight


def plant_gradient_defect(trainer: DistributedMegatronTrainer) -> None:
    """Rank 1 feeds its optimizer every gradient 1% off (its tensor-parallel shards, or its distributed
    optimizer shard): the comparison must fail. Registered before the recorder, so recorded."""
    def scale(optimizer: torch.optim.Optimizer, *_: object) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(1.01)

    if dist.get_rank() == 1:
        inner_optimizers(trainer)[0].register_step_pre_hook(scale)


def run_layout(out: str, name: str) -> None:
    match = LAYOUT.match(name)
    if match is None:
        raise SystemExit(f"unknown layout {name!r}")
    par = MegatronParallelConfig(tensor_model_parallel_size=int(match[1]), pipeline_model_parallel_size=int(match[2]),
                                 expert_model_parallel_size=int(match[3] or 1), sequence_parallel=bool(match[4]),
                                 use_distributed_optimizer=bool(match[5]), timeout_s=TIMEOUT_S)
    model = tiny_model(3, match[6])
    settings = trainer_config(shaped=bool(match[7]))
    trainer = DistributedMegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=settings, parallel=par),
                                         model.named_parameters())
    if match[8]:
        plant_gradient_defect(trainer)
    record = GradientRecorder(trainer)
    batches = [make_batch(model, step, seed=step) for step in range(2)]
    loaded = dict(model.named_parameters())
    exported = list(trainer.iter_hf_weights())
    # HF -> sharded -> gathered HF only slices and concatenates: bit-exact.
    round_trip = (sorted(n for n, _ in exported) == sorted(loaded)
                  and all(torch.equal(t, loaded[n]) for n, t in exported))
    # Each stage's export, by the stage's ranks alone: one part per stage (the same on each of its ranks), the
    # parts together the whole export.
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (trainer.pipeline_stage[0], dict(trainer.export_stage_weights(to_cpu=True))))
    by_stage = dict(parts)
    whole = dict(exported)
    staged = (all(part.keys() == by_stage[s].keys() and all(torch.equal(t, by_stage[s][n]) for n, t in part.items())
                  for s, part in parts)
              and len(by_stage) == trainer.pipeline_stage[1]
              and sum(len(p) for p in by_stage.values()) == len(whole)
              and all(torch.equal(t, whole[n]) for p in by_stage.values() for n, t in p.items()))
    result = {"round_trip": round_trip, "staged": staged, "logprobs": trainer.token_logprobs(batches[0]),
              "metrics": [trainer.train_step(b) for b in batches],
              "weights": dict(trainer.export_weights(to_cpu=True).tensors), "gradients": record.gradients}
    if dist.get_rank() == 0:
        atomic_write(os.path.join(out, f"{name}.pt"), lambda path: torch.save(result, path))
    parallel.shutdown()


def build(par: MegatronParallelConfig, seed: int) -> DistributedMegatronTrainer:
    model = make_model(seed)
    return DistributedMegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=trainer_config(), parallel=par),
                                      model.named_parameters())


def save_and_resume(out: str, name: str, saved: MegatronParallelConfig, resumed: MegatronParallelConfig) -> None:
    """Saves at layout ``saved`` after one step, takes two more; a trainer at layout ``resumed`` built from
    other weights loads the checkpoint and takes the same two steps. Rank 0 writes OUT/<name>.pt: each run's
    last two steps and weights, and the gradients of its three steps (the resumed one's first step is the
    saving trainer's)."""
    model = make_model(3)
    batches = [make_batch(model, step, seed=step) for step in range(3)]
    path = os.path.join(out, f"{name}_checkpoint")
    first = build(saved, 3)
    first_record = GradientRecorder(first)
    first.train_step(batches[0])
    before = list(first_record.gradients)
    first.save_checkpoint(path, extra={"data_position": 12})
    expected = {"metrics": [first.train_step(b) for b in batches[1:]],
                "weights": dict(first.export_weights(to_cpu=True).tensors), "gradients": first_record.gradients}
    parallel.shutdown()
    second = build(resumed, 1)
    second_record = GradientRecorder(second)
    extra = second.load_checkpoint(path)
    got = {"extra": extra, "version": second.version, "metrics": [second.train_step(b) for b in batches[1:]],
           "weights": dict(second.export_weights(to_cpu=True).tensors),
           "gradients": before + second_record.gradients}
    parallel.shutdown()
    if dist.get_rank() == 0:
        atomic_write(os.path.join(out, f"{name}.pt"), lambda p: torch.save({"expected": expected, "got": got}, p))


def refuse_other_vocab_padding(out: str) -> None:
    """A checkpoint of the 21-token vocabulary padded to 22 rows at TP=2 does not load at TP=1 (21 rows)."""
    model = tiny_model(3, "odd")
    config = MegatronTrainerConfig(model=model.config, trainer=trainer_config(),
                                   parallel=MegatronParallelConfig(tensor_model_parallel_size=2, timeout_s=TIMEOUT_S))
    path = os.path.join(out, "odd_checkpoint")
    DistributedMegatronTrainer(config, model.named_parameters()).save_checkpoint(path)
    parallel.shutdown()
    other = DistributedMegatronTrainer(dataclasses.replace(config, parallel=MegatronParallelConfig(timeout_s=TIMEOUT_S)),
                                       model.named_parameters())
    try:
        other.load_checkpoint(path)
        outcome = "loaded"
    except InvalidStateError as err:
        outcome = str(err)
    parallel.shutdown()
    if dist.get_rank() == 0:
        atomic_write(os.path.join(out, "odd_resume.pt"), lambda p: torch.save(outcome, p))


def refuse_single_process_trainer(out: str) -> None:
    model = make_model(0)
    try:
        MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=trainer_config()), model.named_parameters())
        outcome = "constructed"
    except InvalidStateError as err:
        outcome = str(err)
    parallel.shutdown()
    if dist.get_rank() == 0:
        atomic_write(os.path.join(out, "single.pt"), lambda p: torch.save(outcome, p))


def main() -> None:
    out, layouts = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    # The process group outlives each layout's model-parallel state (parallel.shutdown leaves it alone).
    dist.init_process_group("gloo", timeout=timedelta(seconds=TIMEOUT_S))
    for name in layouts:
        if name == "raise":
            if dist.get_rank() == 1:
                raise InvalidStateError("rank 1 failed on purpose")
            dist.all_reduce(torch.ones(1))
            continue
        if name == "single":
            refuse_single_process_trainer(out)
            continue
        if name == "odd_resume":
            refuse_other_vocab_padding(out)
            continue
        if name == "resume":
            # TP=2 -> TP=1 x DP=2 on two ranks.
            save_and_resume(out, name, MegatronParallelConfig(tensor_model_parallel_size=2, timeout_s=TIMEOUT_S),
                            MegatronParallelConfig(timeout_s=TIMEOUT_S))
            continue
        if name == "resume_do":
            # The distributed optimizer, TP=2 x DP=2 -> TP=1 x DP=4 on four ranks.
            save_and_resume(out, name, MegatronParallelConfig(tensor_model_parallel_size=2, timeout_s=TIMEOUT_S,
                                                              use_distributed_optimizer=True),
                            MegatronParallelConfig(timeout_s=TIMEOUT_S, use_distributed_optimizer=True))
            continue
        run_layout(out, name)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
