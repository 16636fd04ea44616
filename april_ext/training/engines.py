"""The rollout engine of a run, by TrainConfig.engine: one factory for every kind.

``build_engine(config, trainer, model_config, memory_tag_prefix)`` is an async context manager yielding a
started :class:`april_ext.protocol.RolloutEngine` that holds the trainer's current weights (after a
resume, the checkpoint's), labelled ``trainer.version``:

- "embedded": an in-process AsyncEngine over its own copy of the model (``model_config`` with the
  trainer's weights); its memory tags are ``memory_tag_prefix + "weights"`` / ``"kv_cache"``.
- "sglang": SGLang servers over HTTP (april_ext.sglang), either running ones (sglang_urls /
  sglang_router_url, which serve ``model``; they get the trainer's weights pushed, which also resets a
  label left by an earlier run) or servers launched on a checkpoint of those weights and stopped on exit.
  New weights reach them as TrainConfig.weight_sync says: by default the way every SGLang release takes
  them, written to a weight-sync directory and loaded with /update_weights_from_disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.errors import ConfigError
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.model.checkpoint import save_safetensors_sharded
from april_ext.protocol.rollout_engine import RolloutEngine
from april_ext.protocol.trainer import Trainer
from april_ext.training.config import TrainConfig
from april_ext.weights import sync_weights

if TYPE_CHECKING:
    from april_ext.sglang import SGLangEngineConfig

SGLANG_DIR = "sglang"
"""Under output_dir: the launched servers' initial model, their logs and the default weight-sync directory."""

EngineFactory = Callable[[TrainConfig, Trainer, ModelConfig, str], AbstractAsyncContextManager[RolloutEngine]]
"""What TrainingRun calls to get its engine: (config, trainer, model config, memory tag prefix) -> context."""


@runtime_checkable
class ServerWeightVersions(Protocol):
    """An engine in front of servers that label their weights themselves (SGLangEngine)."""

    async def weight_versions(self) -> dict[str, str]: ...


@runtime_checkable
class ServerPool(Protocol):
    """An engine whose servers fail over (SGLangEngine): which are live, removed, rejoined."""

    def pool_health(self) -> dict[str, Any]: ...


async def engine_metrics(engine: RolloutEngine) -> dict[str, Any]:
    """What the engine reports about itself after a step's weight sync, for the metrics row: servers'
    own weight labels (the trainer's version when the sync worked), and the servers live, removed now,
    and removed / rejoined since the start (failover), when it has servers."""
    row: dict[str, Any] = {}
    if isinstance(engine, ServerPool):
        pool = engine.pool_health()
        row.update({"engine/workers_live": len(pool["live"]), "engine/workers_removed": len(pool["removed"]),
                    "engine/worker_removals": pool["removals"], "engine/worker_rejoins": pool["rejoins"]})
    if isinstance(engine, ServerWeightVersions):
        row["engine/server_weight_versions"] = sorted(set((await engine.weight_versions()).values()))
    return row


def _engine_model(trainer: Trainer, model_config: ModelConfig) -> LlamaForCausalLM:
    """The run's architecture holding the trainer's current weights (copied in as the export streams)."""
    # Its random initialisation is overwritten: keep it off the run's seeded global RNG stream.
    with torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(model_config)
    model.load_weights(trainer.export_weights(), atomic=False)
    return model


@contextlib.asynccontextmanager
async def _embedded_engine(config: TrainConfig, trainer: Trainer, model_config: ModelConfig,
                           memory_tag_prefix: str) -> AsyncIterator[RolloutEngine]:
    core = EngineCore(_engine_model(trainer, model_config), EngineConfig(
        num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        device=config.device, seed=config.seed, memory_tag_prefix=memory_tag_prefix,
        # Colocated carry: the carried samples' K/V survive the trainer's turn on the device in a host copy.
        kv_cache_cpu_backup=config.colocate and config.scheduler_config().step_boundary == "carry"),
        weight_version=trainer.version)
    async with AsyncEngine(core) as engine:
        yield engine


def write_hf_checkpoint(trainer: Trainer, model_config: ModelConfig, directory: str, *, shard_bytes: int) -> str:
    """The trainer's current weights as a Hugging Face checkpoint directory (config.json + safetensors
    shards of at most ``shard_bytes`` with their index), the model a launched server starts from. The
    export streams into the shards: one shard's tensors are held at a time."""
    dtypes: list[torch.dtype] = []

    def noting_dtype() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in trainer.export_weights(to_cpu=True):
            if not dtypes:
                dtypes.append(tensor.dtype)
            yield name, tensor

    save_safetensors_sharded(noting_dtype(), directory, shard_bytes)
    model_config.replace(dtype=str(dtypes[0]).removeprefix("torch.")).save_pretrained(directory)
    return directory


def sglang_dir(config: TrainConfig) -> str:
    """``<output_dir>/sglang``, absolute (SGLANG_DIR)."""
    return os.path.abspath(os.path.join(config.output_dir, SGLANG_DIR))


def sglang_engine_config(config: TrainConfig, version: int, *, worker_urls: tuple[str, ...] = (),
                         router_url: str | None = None, api_key: str | None = None) -> SGLangEngineConfig:
    """The run's SGLang client of ``worker_urls`` (each request to the least loaded) or ``router_url``, labelled
    ``version`` at start: the one place TrainConfig's fields become SGLangEngineConfig's (weight_sync, its
    bucket, timeout and directory: sglang_weight_sync_dir, by default ``<output_dir>/sglang/weight_sync``;
    sglang_stream, sglang_worker_timeout_s, sglang_priority); ``api_key``: the servers' key (a Ray run's)."""
    from april_ext.sglang import SGLangEngineConfig

    return SGLangEngineConfig(
        worker_urls=worker_urls, router_url=router_url, initial_weight_version=version,
        weight_sync=config.weight_sync, weight_bucket_mb=config.weight_sync_bucket_mb,
        weight_sync_timeout_s=config.weight_sync_timeout_s,
        weight_sync_dir=config.sglang_weight_sync_dir or os.path.join(sglang_dir(config), "weight_sync"),
        stream=config.sglang_stream, worker_timeout_s=config.sglang_worker_timeout_s, priority=config.sglang_priority,
        api_key=api_key)


async def _launch_servers(config: TrainConfig, trainer: Trainer, model_config: ModelConfig, root: str,
                          stack: contextlib.AsyncExitStack) -> tuple[str, ...]:
    """Starts sglang_num_servers servers on a checkpoint of the trainer's weights, labelled with its
    version; the stack stops them. Returns their urls."""
    from april_ext.sglang import SGLangServerArgs, launch_sglang_server

    initial = write_hf_checkpoint(trainer, model_config, os.path.join(root, "initial_model"),
                                  shard_bytes=int(config.weight_sync_bucket_mb * 2**20))
    args = SGLangServerArgs(model_path=initial, enable_memory_saver=config.colocate,
                            extra_args=("--weight-version", str(trainer.version), *shlex.split(config.sglang_args)))
    urls = []
    for i in range(config.sglang_num_servers):
        server = await asyncio.to_thread(
            launch_sglang_server, args, module=config.sglang_module, timeout_s=config.sglang_launch_timeout_s,
            log_path=os.path.join(root, f"server_{i}.log"))
        stack.callback(server.stop)
        urls.append(server.url)
    return tuple(urls)


@contextlib.asynccontextmanager
async def _sglang_engine(config: TrainConfig, trainer: Trainer, model_config: ModelConfig,
                         memory_tag_prefix: str) -> AsyncIterator[RolloutEngine]:
    try:
        from april_ext.sglang import SGLangEngine
    except ImportError as err:
        raise ConfigError(f"TrainConfig.engine='sglang' needs aiohttp ({err}): pip install 'april_ext[sglang]'") \
            from None
    async with contextlib.AsyncExitStack() as stack:
        urls = (await _launch_servers(config, trainer, model_config, sglang_dir(config), stack)
                if config.sglang_launch else config.sglang_urls)
        engine = await stack.enter_async_context(SGLangEngine(sglang_engine_config(
            config, trainer.version, worker_urls=urls, router_url=config.sglang_router_url)))
        if not config.sglang_launch:
            await sync_weights(trainer, engine)
        yield engine


_KINDS: dict[str, Callable[[TrainConfig, Trainer, ModelConfig, str], AbstractAsyncContextManager[RolloutEngine]]] = {
    "embedded": _embedded_engine, "sglang": _sglang_engine}
ENGINE_KINDS = tuple(_KINDS)


def build_engine(config: TrainConfig, trainer: Trainer, model_config: ModelConfig,
                 memory_tag_prefix: str = "") -> AbstractAsyncContextManager[RolloutEngine]:
    """The engine TrainConfig.engine names, started on the trainer's current weights and version (an
    async context manager: the engine, and servers it launched, stop on exit)."""
    build = _KINDS.get(config.engine)
    if build is None:
        raise ConfigError(f"TrainConfig.engine={config.engine!r} is not allowed: one of {ENGINE_KINDS}")
    return build(config, trainer, model_config, memory_tag_prefix)


__all__ = ["ENGINE_KINDS", "SGLANG_DIR", "EngineFactory", "ServerWeightVersions", "build_engine", "engine_metrics",
           "sglang_dir", "sglang_engine_config", "write_hf_checkpoint"]
