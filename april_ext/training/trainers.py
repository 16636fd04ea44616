"""The trainer of a run, by TrainConfig.trainer: one factory for every kind.

``build_trainer(config, model, memory_tag_prefix)`` is a context manager yielding a
:class:`april_ext.protocol.Trainer` that starts from ``model``'s weights at version 0:
"torch" trains ``model`` itself (TorchTrainer); "megatron" loads its weights into a megatron-core
GPTModel (MegatronTrainer) and tears its process group down on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

from april_ext.algorithms import AlgorithmConfig
from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM
from april_ext.protocol.trainer import Trainer
from april_ext.trainer import TorchTrainer, TrainerConfig
from april_ext.training.config import TrainConfig

TrainerFactory = Callable[[TrainConfig, LlamaForCausalLM, str], AbstractContextManager[Trainer]]
"""What TrainingRun calls to get its trainer: (config, initial model, memory tag prefix) -> context."""

_ALGORITHMS: dict[str, Callable[..., AlgorithmConfig]] = {
    "grpo": AlgorithmConfig.grpo, "drgrpo": AlgorithmConfig.drgrpo, "dapo": AlgorithmConfig.dapo,
    "gspo": AlgorithmConfig.gspo}


def algorithm_config(config: TrainConfig) -> AlgorithmConfig:
    """The objective: the preset TrainConfig.algorithm names, with the run's kl_coef, TIS clip and clip range."""
    clip: dict[str, float] = {}
    if config.eps_clip is not None:
        clip = {"eps_low": config.eps_clip, "eps_high": config.eps_clip}
    if config.eps_clip_high is not None:
        clip["eps_high"] = config.eps_clip_high
    return _ALGORITHMS[config.algorithm](kl_coef=config.kl_coef, tis_cap=config.tis_cap, tis_floor=config.tis_floor,
                                         **clip)


def trainer_config(config: TrainConfig, memory_tag_prefix: str = "") -> TrainerConfig:
    """The optimisation settings every kind of trainer shares; pi_train follows the rollouts' sampling."""
    return TrainerConfig(
        algorithm=algorithm_config(config), lr=config.lr, micro_batch_tokens=config.micro_batch_tokens,
        micro_batch_size=config.micro_batch_size,
        minibatches=config.minibatches, device=config.device, temperature=config.temperature, top_k=config.top_k,
        top_p=config.top_p, colocated=config.colocate,
        memory_tag=memory_tag_prefix + "trainer")


@contextlib.contextmanager
def _torch_trainer(config: TrainConfig, model: LlamaForCausalLM, settings: TrainerConfig) -> Iterator[Trainer]:
    yield TorchTrainer(model, settings)


@contextlib.contextmanager
def _megatron_trainer(config: TrainConfig, model: LlamaForCausalLM, settings: TrainerConfig) -> Iterator[Trainer]:
    from april_ext.trainer.megatron import MegatronTrainer, MegatronTrainerConfig, parallel

    try:
        import megatron.core  # noqa: F401 - only to say what is missing before anything is built
    except ImportError as err:
        raise ConfigError(f"TrainConfig.trainer='megatron' needs megatron-core ({err}): "
                          "pip install 'april_ext[megatron]'") from None
    trainer = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=settings, seed=config.seed),
                              model.named_parameters())
    try:
        yield trainer
    finally:
        parallel.shutdown()


_KINDS: dict[str, Callable[[TrainConfig, LlamaForCausalLM, TrainerConfig], AbstractContextManager[Trainer]]] = {
    "torch": _torch_trainer, "megatron": _megatron_trainer}
TRAINER_KINDS = tuple(_KINDS)


def build_trainer(config: TrainConfig, model: LlamaForCausalLM,
                  memory_tag_prefix: str = "") -> AbstractContextManager[Trainer]:
    """The trainer TrainConfig.trainer names, starting from ``model``'s weights (a context manager: the
    trainer's resources, e.g. Megatron's process group, are released on exit). Colocated trainers keep
    their memory under the tag ``memory_tag_prefix + "trainer"``."""
    build = _KINDS.get(config.trainer)
    if build is None:
        raise ConfigError(f"TrainConfig.trainer={config.trainer!r} is not allowed: one of {TRAINER_KINDS}")
    return build(config, model, trainer_config(config, memory_tag_prefix))


__all__ = ["TRAINER_KINDS", "TrainerFactory", "algorithm_config", "build_trainer", "trainer_config"]
