"""``april-ext train``: flags for every TrainConfig field, an optional TOML config, and --compare.

It sits at the top of the package: it chooses the run's factories (the cluster layer's for --ray), so the
training layer below never imports the cluster layer that builds on it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from april_ext.errors import ConfigError, InvalidStateError
from april_ext.model.checkpoint import safetensors_files
from april_ext.settings import add_flag, settings
from april_ext.trainer.distributed import launched_by_torchrun
from april_ext.trainer.megatron.checkpoint_files import Layout, check_files
from april_ext.training.checkpoint import CheckpointManager
from april_ext.training.config import PARALLEL_SETTINGS, SCHEDULER_SETTINGS, TrainConfig
from april_ext.training.ranks import check_world

if TYPE_CHECKING:
    from april_ext.training.comparison import RunComparison
    from april_ext.training.run import TrainResult

_GROUPS = {
    "data and task": ("task", "data", "tokenizer", "prompt_key", "label_key", "num_epochs", "rollout_shuffle",
                      "counting_median",
                      "counting_sigma", "counting_max_count", "counting_symbols", "lookup_max_hops", "max_turns",
                      "max_tool_calls", "tool_latency_median_s", "tool_latency_p99_s", "tool_timeout_s",
                      "max_concurrent_tool_calls", "environment_path"),
    "model and engine": ("model", "hidden_size", "num_layers", "max_num_seqs", "num_blocks", "block_size", "device",
                         "engine"),
    "SGLang engine": ("sglang_urls", "sglang_router_url", "sglang_launch", "sglang_num_servers", "sglang_module",
                      "sglang_args", "sglang_launch_timeout_s", "sglang_weight_sync_dir", "sglang_stream",
                      "sglang_worker_timeout_s", "sglang_priority", "weight_sync", "weight_sync_bucket_mb",
                      "weight_sync_timeout_s"),
    "Ray cluster": ("ray", "ray_address", "actor_num_nodes", "actor_num_gpus_per_node", "rollout_num_gpus",
                    "rollout_num_gpus_per_engine", "num_gpus_per_node", "colocate", "ray_num_cpus_per_actor",
                    "ray_routing", "ray_router_url", "ray_timeout_s", "ray_engine_max_restarts", "ray_engine_check_interval_s"),
    "rollout": ("strategy", *SCHEDULER_SETTINGS, "partial_rollout", "async_rollout", "max_head_offpolicyness",
                "temperature", "top_p", "top_k"),
    "rewards and filters": ("custom_rm_path", "custom_rm_kind", "custom_rm_text", "custom_rm_timeout_s",
                            "dynamic_sampling_filter_path", "custom_generate_function_path"),
    "evaluation": ("eval_interval", "eval_prompt_data", "n_samples_per_eval_prompt", "eval_counting_prompts",
                   "eval_temperature", "eval_top_p", "eval_top_k", "eval_max_response_len"),
    "parallel (across ranks)": (*PARALLEL_SETTINGS, "distributed_timeout_minutes"),
    "metrics": ("use_tensorboard", "use_wandb", "wandb_project", "wandb_dir", "wandb_group", "plots", "progress"),
    "optimiser and loss": ("lr", "optimizer", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad",
                           "lr_decay_style", "lr_warmup_iters", "lr_decay_iters", "min_lr", "entropy_coef",
                           "loss_aggregation", "ref_load", "rm_type"),
}

SLIME_ALIASES: dict[str, tuple[str, ...]] = {
    "max_response_len": ("--rollout-max-response-len",),
    "mask_offpolicy": ("--mask-offpolicy-in-partial-rollout",),
    "algorithm": ("--advantage-estimator",),
    "temperature": ("--rollout-temperature",),
    "top_p": ("--rollout-top-p",),
    "top_k": ("--rollout-top-k",),
    "model": ("--hf-checkpoint",),
    "data": ("--prompt-data",),
    "prompt_key": ("--input-key",),
    "num_steps": ("--num-rollout",),
    "seed": ("--rollout-seed",),
    "micro_batch_tokens": ("--max-tokens-per-gpu",),
}
"""slime's names of our settings (docs/loop.md has the table): each flag is another name of the same setting."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="train with APRIL (or the synchronous baseline): embedded engine or SGLang, torch or "
                      "Megatron trainer",
        description="Flags override the --config file, which overrides the defaults. Optional settings "
                    "accept 'none'.")
    parser.add_argument("--config", help="TOML file whose keys are the setting names below (underscores)")
    parser.add_argument("--compare", action="store_true",
                        help="run the synchronous baseline, APRIL (or --strategy) and asynchronous APRIL on the same seed, "
                             "one after the other; print each whole run's wall-clock, the time to the baseline's "
                             "reward, the reward at equal steps and at equal wall time, and the token rates")
    groups = {name: parser.add_argument_group(name) for name in (*_GROUPS, "training and outputs")}
    owner = {f: g for g, names in _GROUPS.items() for f in names}
    known = settings(TrainConfig)
    for name in (*owner, *(n for n in known if n not in owner)):
        if name == "eval_prompt_data":
            # slime's form "NAME PATH" is accepted as well as a bare path; one held-out set, so the name is unused.
            groups["evaluation"].add_argument(
                "--eval-prompt-data", nargs="+", default=argparse.SUPPRESS, metavar="[NAME] PATH",
                help=f"{known[name].doc} slime's 'NAME PATH' works too. (default: None)")
            continue
        add_flag(groups[owner.get(name, "training and outputs")], known[name], SLIME_ALIASES.get(name, ()))
    groups["parallel (across ranks)"].add_argument(
        "--nproc-per-node", type=int, default=None, metavar="N",
        help="start N ranks on this machine through torchrun (torch.distributed.run) and run across them: rank 0 "
             "trains with the engine, the others follow its trainer; under torchrun leave it out or give torchrun's")
    _add_slime_flags(parser.add_argument_group(
        "slime flags", "slime's flags whose meaning takes two of its flags; see docs/loop.md"))
    _add_megatron_and_sglang_flags(parser.add_argument_group(
        "Megatron and SGLang flags of slime's", "passed to the servers a run launches, accepted where they name "
        "what the trainers do, else refused with the reason; see docs/loop.md"))
    parser.set_defaults(func=run)
    return parser


def _add_slime_flags(group: Any) -> None:
    group.add_argument("--use-tis", action="store_true", default=argparse.SUPPRESS,
                       help="truncated importance sampling at --tis-clip: sets tis_cap")
    group.add_argument("--tis-clip", type=float, default=argparse.SUPPRESS, metavar="FLOAT",
                       help=f"with --use-tis: the cap of the importance ratio pi_train / pi_rollout (default: "
                            f"{_TIS_CLIP}, slime's)")
    group.add_argument("--tis-clip-low", type=float, default=argparse.SUPPRESS, metavar="FLOAT",
                       help="with --use-tis: the floor of the importance ratio: sets tis_floor (default: 0, none)")
    group.add_argument("--use-kl-loss", action="store_true", default=argparse.SUPPRESS,
                       help="a KL loss term (--kl-loss-type) weighted by --kl-loss-coef, which it must come with")
    group.add_argument("--num-epoch", type=int, default=argparse.SUPPRESS, metavar="INT", dest="slime_num_epoch",
                       help="slime's: sets num_epochs; without --num-rollout / --num-steps the run trains until those "
                            "passes over the prompt file are used up (num_steps none), as slime derives num_rollout "
                            "from it")
    group.add_argument("--calculate-per-token-loss", action="store_true", default=argparse.SUPPRESS,
                       help="the loss averages over all loss tokens of the batch: sets loss_aggregation 'token' "
                            "(without it, the algorithm's: gspo averages per sample first)")
    group.add_argument("--apply-chat-template", action="store_true", default=argparse.SUPPRESS,
                       help="accepted for slime's command lines: a prompt that is a chat (list of messages) always "
                            "goes through the tokenizer's chat template, a text prompt never")


# slime's flags that ask for what the trainers always do: accepted, with why (shown in --help).
_ALWAYS = {
    "--use-dynamic-batch-size": "micro-batches are always packed up to the token budget --max-tokens-per-gpu "
                                "(--micro-batch-tokens)",
    "--skip-eval-before-train": "evaluation never runs before the first training step (only every "
                                "--eval-interval steps)",
    "--balance-data": "the update is the same however the samples are split across data-parallel ranks (slime "
                      "balances their tokens for speed; here each rank takes consecutive samples)",
    "--accumulate-allreduce-grads-in-fp32": "gradients are fp32 (fp32 parameters; Megatron's DDP reduces them in "
                                            "fp32)",
}
# SGLang server flags of slime's (--sglang-X) passed to the servers a run launches as --X.
_SGLANG_PASS = {"--sglang-mem-fraction-static": float, "--sglang-cuda-graph-max-bs": int}
# Megatron flags no trainer here has: refused by name with the reason.
_REFUSED = {
    "--recompute-granularity": "activation recomputation is not supported (the trainers keep activations; a smaller "
                               "--max-tokens-per-gpu saves memory)",
    "--recompute-method": "activation recomputation is not supported",
    "--recompute-num-layers": "activation recomputation is not supported",
    "--attention-backend": "the Megatron model is built with megatron-core's local layer spec (its own attention, "
                           "no Transformer Engine), whose attention backend is fixed",
}


def _add_megatron_and_sglang_flags(group: Any) -> None:
    for flag, why in _ALWAYS.items():
        group.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=f"accepted: {why}")
    for flag in ("--attention-dropout", "--hidden-dropout"):
        group.add_argument(flag, type=float, default=argparse.SUPPRESS, metavar="0.0",
                           help="0 only: the models train without dropout, as slime's scripts set it")
    group.add_argument("--attention-softmax-in-fp32", action="store_true", default=argparse.SUPPRESS,
                       help="accepted with --trainer megatron, whose model takes the attention softmax in fp32")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=argparse.SUPPRESS, metavar="INT",
                       help="the experts' tensor parallel size: --tensor-model-parallel-size's (or any, for a model "
                            "without experts)")
    for flag, kind in _SGLANG_PASS.items():
        group.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper(),
                           help=f"passed to the servers the run launches as --{flag.removeprefix('--sglang-')}")
    for flag, why in _REFUSED.items():
        group.add_argument(flag, nargs="?", default=argparse.SUPPRESS, help=f"refused: {why}")


def _dest(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_")


def _apply_megatron_and_sglang_flags(given: dict[str, Any], config: TrainConfig) -> TrainConfig:
    """What slime's Megatron and SGLang flags mean for ``config``: the SGLang ones joined to its sglang_args; the
    refused ones, a dropout other than 0, fp32 softmax with the torch trainer and an expert tensor parallel size
    the experts are not split by raise ConfigError naming the flag."""
    for flag, why in _REFUSED.items():
        if _dest(flag) in given:
            raise ConfigError(f"{flag} is not supported: {why}")
    for flag in ("--attention-dropout", "--hidden-dropout"):
        if given.get(_dest(flag), 0.0) != 0.0:
            raise ConfigError(f"{flag} {given[_dest(flag)]} is not allowed: 0.0 (the models here train without "
                              "dropout)")
    if given.get("attention_softmax_in_fp32") and config.trainer != "megatron":
        raise ConfigError("--attention-softmax-in-fp32 needs --trainer megatron (its model takes the attention "
                          "softmax in fp32); the torch trainer's attention is torch's scaled_dot_product_attention")
    if "expert_tensor_parallel_size" in given:
        _check_expert_tensor_parallel(given["expert_tensor_parallel_size"], config)
    passed = [f"--{flag.removeprefix('--sglang-')} {given[_dest(flag)]}" for flag in _SGLANG_PASS if _dest(flag) in given]
    if not passed:
        return config
    if not (config.sglang_launch or config.ray):
        raise ConfigError(f"{', '.join(f for f in _SGLANG_PASS if _dest(f) in given)}: these configure the SGLang "
                          "servers a run launches (--sglang-launch or --ray); servers started elsewhere take their "
                          "own flags")
    return config.replace(sglang_args=" ".join(filter(None, (config.sglang_args, *passed))))


def _check_expert_tensor_parallel(size: int, config: TrainConfig) -> None:
    """slime's --expert-tensor-parallel-size: the experts here are split like the dense layers, so it must be
    tensor_model_parallel_size's, unless the model has no experts."""
    from april_ext.training.run import run_model_config

    if size != config.tensor_model_parallel_size and run_model_config(config).num_experts:
        raise ConfigError(f"--expert-tensor-parallel-size {size} is not allowed: the experts are split like the "
                          f"dense layers, so {config.tensor_model_parallel_size} (--tensor-model-parallel-size)")


_TIS_CLIP = 2.0


def _slime_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The settings slime's paired flags stand for (--use-tis with --tis-clip); --kl-loss-coef (kl_loss_coef)
    only with --use-kl-loss, as in slime."""
    given = vars(args)
    out: dict[str, Any] = {}
    if given.get("use_tis"):
        out["tis_cap"] = given.get("tis_clip", _TIS_CLIP)
        if "tis_clip_low" in given:
            out["tis_floor"] = given["tis_clip_low"]
    for flag, dest in (("--tis-clip", "tis_clip"), ("--tis-clip-low", "tis_clip_low")):
        if dest in given and not given.get("use_tis"):
            raise ConfigError(f"{flag} is given without --use-tis; it only has a meaning with --use-tis")
    if "kl_loss_coef" in given and not given.get("use_kl_loss"):
        raise ConfigError("--kl-loss-coef is given without --use-kl-loss; it only has a meaning with "
                          "--use-kl-loss")
    if given.get("use_kl_loss") and "kl_loss_coef" not in given:
        raise ConfigError("--use-kl-loss needs --kl-loss-coef (slime's default 0 would turn the loss off)")
    if given.get("calculate_per_token_loss"):
        if given.get("loss_aggregation", "token") != "token":
            raise ConfigError("--calculate-per-token-loss and --loss-aggregation sequence contradict each other")
        out["loss_aggregation"] = "token"
    if "slime_num_epoch" in given:
        if "num_epochs" in given:
            raise ConfigError("--num-epochs and --num-epoch both set num_epochs; give one of them")
        out["num_epochs"] = given["slime_num_epoch"]
        if "num_steps" not in given:
            out["num_steps"] = None
    for ours, theirs in (("tis_cap", "--use-tis"), ("tis_floor", "--tis-clip-low")):
        if ours in out and ours in given:
            raise ConfigError(f"--{ours.replace('_', '-')} and {theirs} both set {ours}; give one of them")
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
    overrides.update(_slime_overrides(args))
    if "eval_prompt_data" in overrides:
        values = overrides["eval_prompt_data"]
        if len(values) > 2:
            raise ConfigError(f"--eval-prompt-data {' '.join(values)}: one held-out set, PATH or NAME PATH, is "
                              "supported")
        overrides["eval_prompt_data"] = None if values[-1].lower() == "none" else values[-1]
    if "data" in overrides and "task" not in overrides:
        overrides["task"] = None
    if args.config:
        config = TrainConfig.from_toml(args.config, **overrides)
    else:
        config = TrainConfig.from_dict(overrides, where="command line")
    return _apply_megatron_and_sglang_flags(vars(args), config)


def run(args: argparse.Namespace) -> int:
    from april_ext.training.run import train

    config = config_from_args(args)
    world = _world_size(args)
    if args.compare and world > 1:
        raise ConfigError("--compare runs in one process; leave out --nproc-per-node and torchrun")
    if args.compare and config.engine == "sglang" and not config.sglang_launch:
        raise ConfigError("--compare with engine='sglang' needs sglang_launch=true: the runs cannot share "
                          f"servers (each aborts every request at the end of its steps); got engine='sglang' with "
                          f"sglang_urls={list(config.sglang_urls)} sglang_router_url={config.sglang_router_url!r}")
    check_before_start(config, world)
    if world > 1 and not launched_by_torchrun():
        return _launch(args.nproc_per_node, args.argv)
    if not args.compare:
        result = train(config, **_factories(config))
        if result is None:  # a rank that followed rank 0's trainer: rank 0 reports
            return 0
        _print_summary({"run": result.summary})
        print(f"metrics: {os.path.join(result.output_dir, 'metrics.jsonl')}  checkpoint: {result.checkpoint}")
        return _report_end(result)
    return _compare(config)


def _compare(config: TrainConfig) -> int:
    """The synchronous baseline, APRIL (or --strategy) and asynchronous APRIL on the same seed, one after the
    other so that each has the machine to itself, with the figures a user waits for (training.comparison)."""
    from april_ext.plots import plot_compare
    from april_ext.training.comparison import compare_runs
    from april_ext.training.run import train

    label = config.strategy or "april"
    title = "APRIL" if label == "april" else f"strategy {label}"
    variants = {"baseline": {"partial_rollout": False, "async_rollout": False},
                label: {"partial_rollout": True, "async_rollout": False},
                f"{label}_async": {"partial_rollout": True, "async_rollout": True}}
    configs = {}
    for name, changes in variants.items():
        try:
            configs[name] = config.replace(
                **changes, output_dir=os.path.join(config.output_dir, name),
                save=None if config.save is None else os.path.join(config.save, name),
                sglang_weight_sync_dir=None if config.sglang_weight_sync_dir is None
                else os.path.join(config.sglang_weight_sync_dir, name))
        except ConfigError as err:
            if not changes["async_rollout"]:
                raise
            print(f"asynchronous {title} left out of the comparison: {err}")
    results, wall_clock = {}, {}
    for name, variant in configs.items():
        start = time.perf_counter()
        result = train(variant, **_factories(variant))
        assert result is not None  # one process: no follower ranks
        results[name], wall_clock[name] = result, time.perf_counter() - start
    _print_summary({name: {**r.summary, **_engine_figures(r.history, config.max_num_seqs)}
                    for name, r in results.items()})
    comparison = compare_runs({name: r.history for name, r in results.items()}, wall_clock)
    _print_comparison(comparison)
    base, ours = results["baseline"].summary, results[label].summary
    if base.get("rollout_tokens_per_s"):
        gain = ours["rollout_tokens_per_s"] / base["rollout_tokens_per_s"] - 1
        print(f"{title} rollout throughput vs baseline: {gain:+.1%} (a token rate: it rises with longer responses; "
              "the wall-clock above is what the run took)")
    figures = {name: _engine_figures(r.history, config.max_num_seqs) for name, r in results.items()}
    if figures["baseline"] and figures[label]:
        gain = figures[label]["tokens_per_engine_step"] / figures["baseline"]["tokens_per_engine_step"] - 1
        print(f"{title} tokens per engine step vs baseline: {gain:+.1%} (independent of machine load)")
    path = os.path.join(config.output_dir, "compare.json")
    with open(path, "w") as f:
        # The token rates beside the figures a user waits for, never instead of them.
        json.dump({name: {**dataclasses.asdict(c),
                          "rollout_tokens_per_s": results[name].summary.get("rollout_tokens_per_s"),
                          **_engine_figures(results[name].history, config.max_num_seqs)}
                   for name, c in comparison.items()}, f, indent=1)
    print(f"comparison: {path}")
    if config.plots:
        path = plot_compare({n: r.history for n, r in results.items()}, os.path.join(config.output_dir, "compare.png"))
        print(f"plot: {path}")
    return 0


def _print_comparison(comparison: dict[str, RunComparison]) -> None:
    names = list(comparison)
    width = max(14, *(len(n) + 2 for n in names))
    reference = names[0]

    def seconds(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f}"

    rows = (("wall-clock (s)", lambda c: f"{c.wall_clock_s:.1f}"),
            (f"vs {reference}", lambda c: f"{c.wall_clock_ratio:.2f}x"),
            (f"to {reference}'s reward (s)", lambda c: seconds(c.time_to_reference_reward_s)),
            ("reward, equal steps", lambda c: f"{c.reward_at_equal_steps:.3f}"),
            ("reward, equal time", lambda c: f"{c.reward_at_equal_time:.3f}"))
    print(f"{'':22s}" + "".join(f"{n:>{width}s}" for n in names))
    for label, cell in rows:
        print(f"{label:22s}" + "".join(f"{cell(comparison[n]):>{width}s}" for n in names))


def _report_end(result: TrainResult) -> int:
    """The exit code of a run: 1, with the reason on stderr, when a bound the user set (the prompt file's passes)
    ended it before num_steps; a resumed run that had nothing left to train says so."""
    if (reason := result.stopped_early) is not None:
        print(f"april-ext train: stopped early: {reason}", file=sys.stderr)
        return 1
    if result.resumed_from is not None and result.steps_done == result.resumed_from:
        bound = (f"the end of its num_epochs={result.config.num_epochs} passes over the prompt file"
                 if result.data_exhausted else f"num_steps={result.config.num_steps}")
        print(f"april-ext train: nothing to train: the checkpoint of step {result.resumed_from} already reached "
              f"{bound}", file=sys.stderr)
    return 0


def _factories(config: TrainConfig) -> dict[str, Any]:
    """The trainer and engine factories of the run: trainer ranks and engines as Ray actors with --ray
    (docs/scaling.md), else the training layer's defaults."""
    if not config.ray:
        return {}
    from april_ext.cluster import RayTopologyRun

    return RayTopologyRun(config).factories()


def _world_size(args: argparse.Namespace) -> int:
    """The run's ranks: --nproc-per-node's (1, or none: this process alone), or torchrun's world."""
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} is not allowed: an int >= 1")
    if not launched_by_torchrun():
        return args.nproc_per_node or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if args.nproc_per_node not in (None, local):
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} under torchrun, which started {local} "
                          f"ranks on this machine; leave the flag out under torchrun")
    return int(os.environ["WORLD_SIZE"])


def check_before_start(config: TrainConfig, world_size: int) -> None:
    """Refuses, before any rank starts or builds a model, a run that would fail on every rank: a parallel
    layout that does not fit the model or the trainer's world (ConfigError naming the flag), a model
    directory or resume checkpoint lacking a file (PersistenceError naming it). ``world_size``: the ranks of
    this launch (--nproc-per-node / torchrun); a Ray run's trainer ranks are its actors instead."""
    from april_ext.training.run import run_model_config

    world_size = _trainer_world(config, world_size)
    model = run_model_config(config) if config.trainer == "megatron" else None
    dp = check_world(config, world_size, model)
    for directory in (config.model, config.ref_load):
        if directory is not None:
            safetensors_files(directory)
    if config.resume_dir is not None:
        CheckpointManager(config.resume_dir, keep=config.keep_checkpoints).check_resumable(
            _trainer_files_check(config, world_size, dp))


def _trainer_world(config: TrainConfig, launched: int) -> int:
    """The trainer's ranks: the launch's, or with --ray the topology's (actor_num_nodes x
    actor_num_gpus_per_node), whose driver runs as one process."""
    if not config.ray:
        return launched
    if launched > 1:
        raise ConfigError(f"--ray starts the trainer's ranks as Ray actors (--actor-num-nodes {config.actor_num_nodes}"
                          f" x --actor-num-gpus-per-node {config.actor_num_gpus_per_node}); this launch has "
                          f"{launched} ranks: leave out --nproc-per-node and torchrun")
    # The cluster layer owns the count (its Topology places the trainer's actors); plain arithmetic, no Ray.
    from april_ext.cluster.topology import Topology

    return Topology.from_config(config).trainer_ranks


def _trainer_files_check(config: TrainConfig, world_size: int, dp: int) -> Callable[[str], None]:
    """What a checkpoint's trainer directory must hold: across ranks, a Megatron trainer's distributed
    checkpoint every file (its load would fail on the ranks reading a missing shard); the other trainers'
    files are covered by the checkpoint's manifest."""
    if config.trainer != "megatron" or world_size == 1:
        return lambda directory: None
    requested = Layout.of(config.parallel_config(), dp)
    return lambda directory: check_files(directory, requested)


def _launch(nproc: int, argv: list[str]) -> int:
    """The same command line in ``nproc`` ranks started by torchrun (its standalone rendezvous on this
    machine); each rank's errors are printed by that rank."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    try:
        torchrun(parse_args(["--standalone", f"--nproc-per-node={nproc}", "-m", "april_ext.cli", *argv]))
    except ChildFailedError as err:
        # The first to fail is the cause; torchrun then stopped the others.
        rank, failure = err.get_first_failure()
        raise InvalidStateError(f"the run failed on rank {rank} (exit code {failure.exitcode}; its error is printed "
                                f"above) and torchrun stopped the other ranks") from None
    return 0


def _engine_figures(history: list[dict[str, Any]], slots: int) -> dict[str, float]:
    """Machine-independent throughput: tokens per engine iteration (the mean batch) and the bubble, the
    share of the engine's slots (max_num_seqs per iteration) that produced no token."""
    steps = sum(row.get("rollout/engine_steps", 0) for row in history)
    if not steps:
        return {}
    per_step = sum(row["rollout/generated_tokens"] for row in history) / steps
    return {"tokens_per_engine_step": per_step, "bubble": 1 - per_step / slots}


def _print_summary(summaries: dict[str, dict[str, float]]) -> None:
    rows = (("steps", "steps", "{:.0f}"), ("rollout tokens/s", "rollout_tokens_per_s", "{:.1f}"),
            ("rollout s/step", "rollout_s_per_step", "{:.2f}"), ("reward (first 1/4)", "reward_first", "{:.3f}"),
            ("reward (last 1/4)", "reward_last", "{:.3f}"), ("tokens from partials", "partial_token_ratio", "{:.1%}"),
            ("off-policy tokens", "off_policy_token_ratio", "{:.1%}"), ("engine occupancy", "occupancy", "{:.1%}"),
            ("carried tokens/step", "carried_tokens_per_step", "{:.0f}"),
            ("re-prefilled tok/step", "re_prefilled_tokens_per_step", "{:.0f}"),
            ("tail (last 10%)", "tail_share", "{:.1%}"),
            ("tokens / engine step", "tokens_per_engine_step", "{:.1f}"), ("engine bubble", "bubble", "{:.1%}"),
            # Multi-turn tasks (an environment): their rows show only there.
            ("tool calls/step", "tool_calls_per_step", "{:.1f}"),
            ("engine idle (tools)", "engine_idle_while_tools", "{:.1%}"),
            ("waiting on tools", "waiting_at_boundary", "{:.1f}"))
    names = list(summaries)
    env_keys = ("tool_calls_per_step", "engine_idle_while_tools", "waiting_at_boundary")
    rows = tuple(row for row in rows if row[1] not in env_keys or any(row[1] in summaries[n] for n in names))
    width = max(14, *(len(n) + 2 for n in names))  # a long strategy name still leaves a gap
    print(f"{'':22s}" + "".join(f"{n:>{width}s}" for n in names))
    for label, key, fmt in rows:
        cells = "".join(f"{fmt.format(summaries[n][key]) if key in summaries[n] else '-':>{width}s}" for n in names)
        print(f"{label:22s}{cells}")


__all__ = ["add_parser", "check_before_start", "config_from_args", "run"]
