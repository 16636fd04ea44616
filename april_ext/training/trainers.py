"""The trainer of a run, by TrainConfig.trainer: one factory for every kind.

``build_trainer(config, initial, memory_tag_prefix)`` is a context manager yielding a
:class:`april_ext.protocol.Trainer` that starts from ``initial`` at version 0: a model built in this
process, or a Hugging Face checkpoint directory (TrainConfig.model), which the trainer reads as it needs
it. "torch" trains the model itself (TorchTrainer; from a directory it builds the whole model, as every
DDP rank holds it); "megatron" loads the weights into a megatron-core GPTModel (MegatronTrainer in a world
of one; DistributedMegatronTrainer, split as the run's parallel settings say, across the ranks of a
launch, where each rank reads only its slice of a directory, never the whole model) and tears its
process group down on exit.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from april_ext.algorithms import AlgorithmConfig
from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM, ModelConfig, load_pretrained
from april_ext.protocol.trainer import Trainer
from april_ext.trainer import TorchTrainer, TrainerConfig, distributed
from april_ext.trainer.process import ProcessTrainer
from april_ext.training.config import TrainConfig

InitialWeights = LlamaForCausalLM | str
"""What a run's trainer starts from: a model built in this process, or a Hugging Face checkpoint directory
that the trainer reads itself (so a Megatron rank reads only its slice)."""

TrainerFactory = Callable[[TrainConfig, InitialWeights, str], AbstractContextManager[Trainer]]
"""What TrainingRun calls to get its trainer: (config, initial weights, memory tag prefix) -> context."""

_ALGORITHMS: dict[str, Callable[..., AlgorithmConfig]] = {
    "grpo": AlgorithmConfig.grpo, "drgrpo": AlgorithmConfig.drgrpo, "dapo": AlgorithmConfig.dapo,
    "gspo": AlgorithmConfig.gspo, "reinforce_plus_plus": AlgorithmConfig.reinforce_plus_plus,
    "reinforce_plus_plus_baseline": AlgorithmConfig.reinforce_plus_plus_baseline}


def algorithm_config(config: TrainConfig) -> AlgorithmConfig:
    """The objective: the preset TrainConfig.algorithm names, with the run's KL settings, discount, advantage
    whitening, TIS clip, decoupled loss, entropy bonus, clip range and loss aggregation."""
    clip: dict[str, float] = {}
    if config.eps_clip is not None:
        clip = {"eps_low": config.eps_clip, "eps_high": config.eps_clip}
    if config.eps_clip_high is not None:
        clip["eps_high"] = config.eps_clip_high
    aggregation = {} if config.loss_aggregation is None else {"aggregation": config.loss_aggregation}
    return _ALGORITHMS[config.algorithm](
        kl_loss_coef=config.kl_loss_coef, kl_coef=config.kl_coef, kl_loss_type=config.kl_loss_type, gamma=config.gamma,
        normalize_advantages=config.normalize_advantages, tis_cap=config.tis_cap, tis_floor=config.tis_floor,
        use_decoupled_loss=config.decoupled_loss, behav_imp_weight_cap=config.behav_imp_weight_cap,
        entropy_coef=config.entropy_coef, **clip, **aggregation)


def initial_model_config(initial: InitialWeights) -> ModelConfig:
    """The architecture of ``initial`` (a directory's config.json; no weights are read)."""
    if isinstance(initial, LlamaForCausalLM):
        return initial.config
    return ModelConfig.from_pretrained(initial)


def trainer_config(config: TrainConfig, memory_tag_prefix: str = "") -> TrainerConfig:
    """The optimisation settings every kind of trainer shares (optimizer, schedule, KL reference); pi_train
    follows the rollouts' sampling."""
    return TrainerConfig(
        algorithm=algorithm_config(config), lr=config.lr, weight_decay=config.weight_decay,
        betas=(config.adam_beta1, config.adam_beta2), adam_eps=config.adam_eps,
        grad_clip=config.clip_grad if config.clip_grad > 0 else None, lr_decay_style=config.lr_decay_style,
        lr_warmup_iters=config.lr_warmup_iters, lr_decay_iters=config.lr_decay_end, min_lr=config.min_lr,
        reference=config.ref_load, micro_batch_tokens=config.micro_batch_tokens,
        micro_batch_size=config.micro_batch_size,
        minibatches=config.minibatches, device=config.device, temperature=config.temperature, top_k=config.top_k,
        top_p=config.top_p, colocated=config.colocate,
        memory_tag=memory_tag_prefix + "trainer")


def _new_torch_trainer(initial: InitialWeights, settings: TrainerConfig) -> TorchTrainer:
    # Every DDP rank trains the whole model.
    model = initial if isinstance(initial, LlamaForCausalLM) else load_pretrained(initial, device="cpu")
    return TorchTrainer(model, settings)


@contextlib.contextmanager
def _torch_trainer(config: TrainConfig, initial: InitialWeights, settings: TrainerConfig,
                   beside_engine: bool) -> Iterator[Trainer]:
    if beside_engine and distributed.world()[1] == 1 and config.async_rollout and config.max_head_offpolicyness > 0:
        # Overlapping the engine of this process: a process of its own, so that the two do not take turns on one
        # interpreter lock. (A rank of several, or a Ray rank actor, trains in its own process already, and a
        # child would leave its data-parallel group.)
        with ProcessTrainer(_new_torch_trainer, (initial, settings), num_threads=split_threads(config),
                            seed=config.seed) as trainer:
            yield trainer
        return
    yield _new_torch_trainer(initial, settings)


def split_threads(config: TrainConfig) -> int:
    """Intra-op threads of each side of an asynchronous run (the engine's process, the trainer's): num_threads,
    else half the cores."""
    return config.num_threads or max(1, (os.cpu_count() or 2) // 2)


@contextlib.contextmanager
def _megatron_trainer(config: TrainConfig, initial: InitialWeights, settings: TrainerConfig,
                      beside_engine: bool) -> Iterator[Trainer]:
    from april_ext.trainer.megatron import (
        DistributedMegatronTrainer,
        MegatronTrainer,
        MegatronTrainerConfig,
        parallel,
    )

    try:
        import megatron.core  # noqa: F401 - only to say what is missing before anything is built
    except ImportError as err:
        raise ConfigError(f"TrainConfig.trainer='megatron' needs megatron-core ({err}): "
                          "pip install 'april_ext[megatron]'") from None
    # A directory goes to the trainer as it is: each rank reads its own slice (sharded.load_hf_weights).
    weights = initial.named_parameters() if isinstance(initial, LlamaForCausalLM) else initial
    model_config = initial_model_config(initial)
    if distributed.world()[1] > 1:
        # Across the ranks of a launch (training.ranks): split as the run's parallel settings say.
        trainer: Trainer = DistributedMegatronTrainer(MegatronTrainerConfig(
            model=model_config, trainer=settings, seed=config.seed, parallel=config.parallel_config()), weights)
    else:
        trainer = MegatronTrainer(MegatronTrainerConfig(model=model_config, trainer=settings, seed=config.seed),
                                  weights)
    try:
        yield trainer
    finally:
        parallel.shutdown()


_KINDS: dict[str, Callable[[TrainConfig, InitialWeights, TrainerConfig, bool], AbstractContextManager[Trainer]]] = {
    "torch": _torch_trainer, "megatron": _megatron_trainer}
TRAINER_KINDS = tuple(_KINDS)


def build_trainer(config: TrainConfig, initial: InitialWeights, memory_tag_prefix: str = "", *,
                  beside_engine: bool = True) -> AbstractContextManager[Trainer]:
    """The trainer TrainConfig.trainer names, starting from ``initial``: a model's weights, or a Hugging
    Face checkpoint directory the trainer reads (a context manager: the trainer's resources, e.g.
    Megatron's process group, are released on exit). Colocated trainers keep their memory under the tag
    ``memory_tag_prefix + "trainer"``. ``beside_engine``: built in the process that runs the rollout engine (the
    run's own; False in a Ray rank actor), where an asynchronous run puts the torch trainer in a child process."""
    build = _KINDS.get(config.trainer)
    if build is None:
        raise ConfigError(f"TrainConfig.trainer={config.trainer!r} is not allowed: one of {TRAINER_KINDS}")
    return build(config, initial, trainer_config(config, memory_tag_prefix), beside_engine)


__all__ = ["TRAINER_KINDS", "InitialWeights", "TrainerFactory", "algorithm_config", "build_trainer",
           "initial_model_config", "trainer_config"]
