"""The rules a TrainConfig is checked against when it is built, and the vocabulary they check against (the allowed
tasks, algorithms, engines and trainers; which fields are SchedulerConfig's and MegatronParallelConfig's). Every
rule raises a ConfigError naming the fields (TrainConfig.NAME, the command line's --NAME) and what is allowed;
training/config.py holds the fields and calls these."""

from __future__ import annotations

import math
import re
import shlex
import typing
from dataclasses import fields
from typing import Any, Literal

from april_ext.algorithms import KL_SHAPED_ADVANTAGES
from april_ext.errors import ConfigError
from april_ext.rollout.slime_generate import refused_settings
from april_ext.scheduler import SchedulerConfig
from april_ext.settings import MAX_GROUP_TIMEOUT_S, settings
from april_ext.trainer.megatron.parallel import MegatronParallelConfig

TASKS = ("counting", "lookup")
ALGORITHMS = ("grpo", "drgrpo", "dapo", "gspo", *KL_SHAPED_ADVANTAGES)
IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*(:[A-Za-z_]\w*|\.[A-Za-z_]\w*)")
RewardKind = Literal["auto", "sample", "batch", "group"]
KlType = Literal["k1", "k2", "k3", "low_var_kl"]
WeightSync = Literal["disk", "tensor", "broadcast"]
RayRouting = Literal["router", "least_loaded"]
EngineKind = Literal["embedded", "sglang"]
TrainerKind = Literal["torch", "megatron"]
OptimizerKind = Literal["adam"]
LrDecayStyle = Literal["constant", "linear", "cosine"]
LossAggregation = Literal["token", "sequence"]
RmType = Literal["math", "deepscaler", "dapo"]
ENGINES: tuple[str, ...] = typing.get_args(EngineKind)
TRAINERS: tuple[str, ...] = typing.get_args(TrainerKind)


SCHEDULER_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(SchedulerConfig))
"""The TrainConfig fields that are SchedulerConfig's."""
PARALLEL_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(MegatronParallelConfig) if f.name != "timeout_s")
"""The TrainConfig fields that are MegatronParallelConfig's (its timeout_s is distributed_timeout_minutes)."""


TrainConfig = Any
"""A training.config.TrainConfig, which imports this module (so this one cannot import it, even for types)."""


def bad(name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"TrainConfig.{name}={value!r} is not allowed: {allowed}")


def check_type(config: TrainConfig, name: str, value: Any) -> None:
    setting = settings(type(config))[name]
    base, optional = setting.kind, setting.optional
    if value is None:
        if not optional:
            bad(name, value, f"a {base.__name__}")
        return
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is tuple:
        ok = isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    elif base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    else:
        ok = isinstance(value, base)
    if not ok:
        kind = "a list of strings" if base is tuple else f"a {base.__name__}"
        bad(name, value, kind + (" or None" if optional else ""))


def check_lookup(config: TrainConfig) -> None:
    names = {"max_hops": "lookup_max_hops", "max_turns": "max_turns", "max_tool_calls": "max_tool_calls",
             "latency_median_s / latency_p99_s": "tool_latency_median_s / tool_latency_p99_s",
             "seed": "seed"}
    try:
        config.lookup_task_config()
    except ConfigError as err:
        message = str(err)
        for theirs, ours in names.items():
            message = message.replace(f"LookupTaskConfig.{theirs}", f"TrainConfig.{ours}")
        raise ConfigError(message) from None
    _check_tool_limits(config)
    if config.custom_rm_path is not None:
        bad("custom_rm_path", config.custom_rm_path, "None with task='lookup' (the environment gives each "
            "trajectory its final reward)")
    if config.eval_interval:
        bad("eval_interval", config.eval_interval, "0 with task='lookup' (evaluation runs single-turn "
            "generations; a multi-turn evaluation is not built yet)")


def _check_tool_limits(config: TrainConfig) -> None:
    if not math.isfinite(config.tool_timeout_s) or config.tool_timeout_s <= 0:
        bad("tool_timeout_s", config.tool_timeout_s, "a finite number > 0")
    if config.max_concurrent_tool_calls is not None and config.max_concurrent_tool_calls < 1:
        bad("max_concurrent_tool_calls", config.max_concurrent_tool_calls, "None or an int >= 1")


def check_environment(config: TrainConfig) -> None:
    """A run over environment_path: its prompts are data's, its rewards the environment's."""
    path = config.environment_path
    if config.data is None:
        bad("environment_path", path, "None unless data is given (the environment's prompts come from the data "
            f"file; task={config.task!r} has its own)")
    _check_tool_limits(config)
    for name, why in (("custom_rm_path", "the environment gives each trajectory its final reward"),
                      ("custom_generate_function_path", "a custom generate function runs its own tools")):
        if getattr(config, name) is not None:
            bad(name, getattr(config, name), f"None with environment_path ({why})")


def check_custom_generate(config: TrainConfig) -> None:
    path = config.custom_generate_function_path
    if config.engine != "sglang":
        bad("custom_generate_function_path", path, "None with engine='embedded' (the function posts to SGLang "
            "servers' /generate itself: engine='sglang')")
    if config.ray:
        bad("custom_generate_function_path", path, "None with ray (the function's servers are the driver's "
            "SGLang engine's)")
    if config.eval_interval:
        bad("eval_interval", config.eval_interval, "0 with custom_generate_function_path (evaluation runs the "
            "engine's own generations)")
    refused = refused_settings(config.scheduler_config())
    if refused is not None:
        raise ConfigError(f"TrainConfig.custom_generate_function_path={path!r}: {refused}")


def check_ray(config: TrainConfig) -> None:
    for name in ("actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus_per_engine", "num_gpus_per_node"):
        if getattr(config, name) < 1:
            bad(name, getattr(config, name), "an int >= 1")
    if config.rollout_num_gpus is not None and config.rollout_num_gpus < 1:
        bad("rollout_num_gpus", config.rollout_num_gpus, "None or an int >= 1")
    if config.ray_engine_max_restarts < 0:
        bad("ray_engine_max_restarts", config.ray_engine_max_restarts, "an int >= 0")
    for name in ("ray_num_cpus_per_actor", "ray_timeout_s", "ray_engine_check_interval_s"):
        if not math.isfinite(getattr(config, name)) or getattr(config, name) <= 0:
            bad(name, getattr(config, name), "a finite number > 0")
    if config.ray_timeout_s > MAX_GROUP_TIMEOUT_S:
        bad("ray_timeout_s", config.ray_timeout_s, f"at most {MAX_GROUP_TIMEOUT_S:g} (the trainers' process group)")
    if config.ray_routing not in typing.get_args(RayRouting):
        bad("ray_routing", config.ray_routing, f"one of {typing.get_args(RayRouting)}")
    if config.ray_router_url is not None and not config.ray_router_url.startswith(("http://", "https://")):
        bad("ray_router_url", config.ray_router_url, "None or an http:// or https:// url")
    if config.ray_router_url is not None and config.ray_routing != "router":
        bad("ray_router_url", config.ray_router_url, f"None with ray_routing={config.ray_routing!r} (requests go "
            "straight to the engines; a router is used with ray_routing='router' only)")
    if config.ray and config.engine == "sglang" and not config.sglang_launch:
        bad("engine", config.engine, "with ray, 'embedded' or 'sglang' with sglang_launch=true (each engine actor "
            "launches its server; servers given by url are not Ray's to place)")


def check_parallel(config: TrainConfig) -> None:
    # torch.distributed keeps a timeout in int64 milliseconds: at most 1e7 minutes (19 years) is far inside it.
    if not 0 < config.distributed_timeout_minutes <= 1e7:
        bad("distributed_timeout_minutes", config.distributed_timeout_minutes, "a number in (0, 1e7]")
    split = config.parallel_config()
    if config.trainer == "torch":
        # TorchTrainer is data parallel only (DDP): every rank holds the whole model.
        for name in PARALLEL_SETTINGS:
            if getattr(split, name) != getattr(MegatronParallelConfig, name):
                bad(name, getattr(config, name), f"{getattr(MegatronParallelConfig, name)!r} with trainer='torch' "
                    "(the torch trainer is data parallel only; trainer='megatron' splits the model)")


def check_sglang(config: TrainConfig) -> None:
    for url in (*config.sglang_urls, *([config.sglang_router_url] if config.sglang_router_url else [])):
        if not url.startswith(("http://", "https://")):
            bad("sglang_urls" if url in config.sglang_urls else "sglang_router_url", url,
                "http:// or https:// urls")
    sources = [name for name, on in (("sglang_urls", bool(config.sglang_urls)),
                                     ("sglang_router_url", config.sglang_router_url is not None),
                                     ("sglang_launch", config.sglang_launch)) if on]
    if config.engine == "embedded" and sources:
        bad(sources[0], getattr(config, sources[0]), "unset unless engine='sglang'")
    if config.engine == "sglang" and len(sources) != 1:
        bad("engine", config.engine, "exactly one of sglang_urls, sglang_router_url or sglang_launch=true "
            f"with engine='sglang' (set: {sources or 'none'})")
    if config.engine == "sglang" and not config.sglang_launch and config.model is None:
        bad("model", None, "the checkpoint directory the SGLang servers serve (the trainer starts from the "
            "same weights); or sglang_launch=true, which starts servers on the run's initial weights")
    if config.weight_sync not in typing.get_args(WeightSync):
        bad("weight_sync", config.weight_sync, f"one of {typing.get_args(WeightSync)}")
    if config.weight_sync != "disk" and config.engine != "sglang" and not config.ray:
        bad("weight_sync", config.weight_sync, "'disk' (the default) unless engine='sglang' or ray")
    for name in ("weight_sync_bucket_mb", "weight_sync_timeout_s"):
        if not math.isfinite(getattr(config, name)) or getattr(config, name) <= 0:
            bad(name, getattr(config, name), "a finite number > 0")
    if config.weight_sync_timeout_s > MAX_GROUP_TIMEOUT_S:
        bad("weight_sync_timeout_s", config.weight_sync_timeout_s,
            f"at most {MAX_GROUP_TIMEOUT_S:g} (the weight-sync group)")
    if config.sglang_num_servers < 1:
        bad("sglang_num_servers", config.sglang_num_servers, "an int >= 1")
    if not math.isfinite(config.sglang_launch_timeout_s) or config.sglang_launch_timeout_s <= 0:
        bad("sglang_launch_timeout_s", config.sglang_launch_timeout_s, "a finite number > 0")
    timeout = config.sglang_worker_timeout_s
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not math.isfinite(timeout) or timeout <= 0):
        bad("sglang_worker_timeout_s", timeout, "None (no failover) or a finite number of seconds > 0")
    if not config.sglang_module:
        bad("sglang_module", config.sglang_module, "a module name such as 'sglang.launch_server'")
    try:
        args = shlex.split(config.sglang_args)
    except ValueError as err:
        bad("sglang_args", config.sglang_args, f"shell-quoted flags ({err})")
    owned = sorted({"--model-path", "--model", "--host", "--port"} & {a.split("=")[0] for a in args})
    if owned:
        bad("sglang_args", config.sglang_args, f"flags other than {owned} (the run sets them)")


def check_colocated_carry(config: TrainConfig, scheduler: SchedulerConfig) -> None:
    """The step boundary as run (``scheduler``: a strategy such as april_carry may set it; the baseline keeps it)
    against colocation over SGLang."""
    if scheduler.step_boundary == "carry" and config.colocate and config.engine == "sglang":
        # An explicit --step-boundary abort is the default, which a strategy's carry overrides.
        source, fix = (("--step-boundary carry", "--step-boundary abort") if config.step_boundary == "carry"
                       else (f"--strategy {config.strategy}", "a --strategy that does not carry"))
        raise ConfigError(f"TrainConfig.step_boundary='carry' with colocate needs the embedded engine: an SGLang "
                          f"server releases its KV cache only when idle ({source}, --colocate, --engine sglang): "
                          f"use {fix}, leave out --colocate, or --engine embedded")

def check_async(config: TrainConfig, scheduler: SchedulerConfig) -> None:
    """An asynchronous run's bound and what cannot overlap or cannot be trained under it."""
    d = config.max_head_offpolicyness
    if isinstance(d, int) and d < 0:
        bad("max_head_offpolicyness", d, "an int >= 0 (--max-head-offpolicyness: versions the rollout may run ahead "
            "of the trainer; 0 overlaps nothing)")
    if not config.async_rollout:
        return
    refusals = (
        (config.colocate, "--colocate: a colocated pair takes turns on one accelerator (each side releases its memory "
                          "for the other), so rollout and training cannot overlap; leave out --colocate, or run "
                          "without --async-rollout"),
        (config.custom_generate_function_path is not None,
         "--custom-generate-function-path: a generate function's tokens are labelled with its step's version, not "
         "with the weights the server had, which an asynchronous run needs to know"),
        (scheduler.max_staleness is not None and scheduler.max_staleness < d,
         f"--max-staleness {scheduler.max_staleness}: below --max-head-offpolicyness {d}, a batch generated {d} "
         f"versions before it is trained would be past it"),
    )
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"TrainConfig.async_rollout=True (--async-rollout) is not allowed with {why}")


__all__ = ["ALGORITHMS", "check_async", "ENGINES", "IMPORT_PATH", "PARALLEL_SETTINGS", "SCHEDULER_SETTINGS", "TASKS", "TRAINERS",
           "EngineKind", "KlType", "RayRouting", "RewardKind", "TrainerKind", "WeightSync", "bad",
           "check_colocated_carry", "check_custom_generate", "check_environment", "check_lookup", "check_parallel",
           "check_ray", "check_sglang", "check_type"]
