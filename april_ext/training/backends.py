"""The rollout engine and trainer a run uses, by TrainConfig.engine / TrainConfig.trainer.

engine="sglang": SGLang servers over HTTP (april_ext.sglang), either running ones (sglang_urls /
sglang_router_url, which serve ``model``) or servers this run launches on its initial weights. New
weights reach the servers the way real SGLang takes them: written to a weight-sync directory and loaded
with /update_weights_from_disk, labelled with the trainer's version.
trainer="megatron": april_ext.trainer.megatron.MegatronTrainer on the same initial weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
from typing import TYPE_CHECKING

from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM
from april_ext.model.checkpoint import save_safetensors
from april_ext.trainer import TorchTrainer, TrainerConfig
from april_ext.training.config import TrainConfig

if TYPE_CHECKING:
    from april_ext.sglang import SGLangEngine

SGLANG_DIR = "sglang"
"""Under output_dir: the launched servers' initial model, their logs and the default weight-sync directory."""


def build_trainer(config: TrainConfig, model: LlamaForCausalLM, trainer_config: TrainerConfig,
                  stack: contextlib.AsyncExitStack) -> TorchTrainer:
    """The torch trainer over ``model``, or a MegatronTrainer loaded with its weights (whose process group
    the stack tears down)."""
    if config.trainer == "torch":
        return TorchTrainer(model, trainer_config)
    from april_ext.trainer.megatron import MegatronTrainer, MegatronTrainerConfig, parallel

    try:
        import megatron.core  # noqa: F401 - only to say what is missing before anything is built
    except ImportError as err:
        raise ConfigError(f"TrainConfig.trainer='megatron' needs megatron-core ({err}): "
                          "pip install 'april_ext[megatron]'") from None
    trainer = MegatronTrainer(MegatronTrainerConfig(model=model.config, trainer=trainer_config, seed=config.seed),
                              model.named_parameters())
    stack.callback(parallel.shutdown)
    return trainer


def write_hf_checkpoint(trainer: TorchTrainer, model: LlamaForCausalLM, directory: str) -> str:
    """The trainer's current weights as a Hugging Face checkpoint directory (config.json +
    model.safetensors), the model a launched server starts from."""
    os.makedirs(directory, exist_ok=True)
    tensors = dict(trainer.export_weights(to_cpu=True).tensors)
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    model.config.replace(dtype=dtype).save_pretrained(directory)
    save_safetensors(tensors, directory)
    return directory


async def open_sglang_engine(config: TrainConfig, trainer: TorchTrainer, model: LlamaForCausalLM,
                             stack: contextlib.AsyncExitStack) -> SGLangEngine:
    """An entered SGLangEngine whose servers hold the trainer's current weights, labelled trainer.version.

    Launched servers load a checkpoint of those weights; running servers (which serve ``model``) get
    them pushed, which also resets a label left by an earlier run."""
    try:
        from april_ext.sglang import SGLangEngine, SGLangEngineConfig, SGLangServerArgs, launch_sglang_server
    except ImportError as err:
        raise ConfigError(f"TrainConfig.engine='sglang' needs aiohttp ({err}): pip install 'april_ext[sglang]'") \
            from None
    root = os.path.abspath(os.path.join(config.output_dir, SGLANG_DIR))
    sync_dir = config.sglang_weight_sync_dir or os.path.join(root, "weight_sync")
    urls: tuple[str, ...] = config.sglang_urls
    if config.sglang_launch:
        initial = write_hf_checkpoint(trainer, model, os.path.join(root, "initial_model"))
        args = SGLangServerArgs(model_path=initial, enable_memory_saver=config.colocate,
                                extra_args=("--weight-version", str(trainer.version),
                                            *shlex.split(config.sglang_args)))
        launched = []
        for i in range(config.sglang_num_servers):
            server = await asyncio.to_thread(
                launch_sglang_server, args, module=config.sglang_module, timeout_s=config.sglang_launch_timeout_s,
                log_path=os.path.join(root, f"server_{i}.log"))
            stack.callback(server.stop)
            launched.append(server.url)
        urls = tuple(launched)
    engine = await stack.enter_async_context(SGLangEngine(SGLangEngineConfig(
        worker_urls=urls, router_url=config.sglang_router_url, initial_weight_version=trainer.version,
        weight_sync_dir=sync_dir, stream=config.sglang_stream)))
    if not config.sglang_launch:
        await engine.update_weights(trainer.export_weights(to_cpu=True).tensors, trainer.version)
    return engine


__all__ = ["SGLANG_DIR", "build_trainer", "open_sglang_engine", "write_hf_checkpoint"]
