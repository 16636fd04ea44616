"""``april-ext simulate``: APRIL vs the synchronous baseline on a simulated cluster, in seconds on a laptop."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields, replace
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from april_ext.errors import ConfigError
from april_ext.persistence import ensure_dir
from april_ext.scheduler import SchedulerConfig
from april_ext.settings import add_flag, settings
from april_ext.sim.cost import CLUSTER_PRESETS
from april_ext.sim.lengths import LENGTH_PRESETS
from april_ext.sim.report import describe, write_json, write_plots
from april_ext.sim.runner import (
    ALGORITHMS,
    APRIL_LOOPS,
    DAPO_BASELINES,
    MODE_SETTINGS,
    MODES,
    SimConfig,
    SimResult,
    compare,
    compare_strategies,
)
from april_ext.sim.turns import TURN_PRESETS
from april_ext.strategies import STRATEGIES

SCHEDULER_FLAGS = tuple(f.name for f in fields(SchedulerConfig) if f.name not in MODE_SETTINGS)
"""SimConfig's scheduler settings, each a flag (over_sampling_batch_size takes a list of N' to compare)."""


def _subset(flag: str, allowed: Iterable[str]) -> Callable[[str], tuple[str, ...]]:
    """The argparse type of a flag taking a comma-separated subset of ``allowed``."""
    allowed = tuple(allowed)

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if not names or any(n not in allowed for n in names):
            raise argparse.ArgumentTypeError(f"{flag} {text!r}: a comma-separated subset of {', '.join(allowed)}")
        return names

    return parse


_modes = _subset("--modes", MODES)
_strategies = _subset("--strategies", STRATEGIES)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: one int or a comma-separated list of ints")
    return values


def run_all(config: SimConfig, modes: tuple[str, ...], over_sampling: tuple[int, ...]) -> dict[str, SimResult]:
    """Every mode at every N'. With several N', entries are labelled "<mode> N'=<n>"; the first N' keeps the
    plain "baseline" label (the gains refer to it), and the GRPO baseline (N' = N) runs once."""
    if len(over_sampling) == 1:
        return compare(replace(config, over_sampling_batch_size=over_sampling[0]), modes)
    results: dict[str, SimResult] = {}
    for i, n in enumerate(over_sampling):
        wanted = tuple(m for m in modes if m != "baseline" or i == 0 or config.algorithm == "dapo")
        for mode, result in compare(replace(config, over_sampling_batch_size=n), wanted).items():
            results["baseline" if mode == "baseline" and i == 0 else f"{mode} N'={n}"] = result
    return results


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="simulate rollout steps on a virtual cluster: APRIL vs the synchronous baseline",
        description="Drives the real scheduler and rollout loop over a simulated engine with a virtual clock. "
                    "Prints a table (throughput, gain over the baseline, efficiency against the best schedule "
                    "of the same work without and with re-prefill, bubbles, partial / off-policy ratios, staleness, re-prefill, length bias) and writes "
                    "PNG plots and a JSON report to --output-dir.")
    parser.add_argument("--cluster", default="h100-qwen3-8b", help=f"one of {', '.join(CLUSTER_PRESETS)}")
    parser.add_argument("--num-engines", type=int, default=8, help="engine replicas")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="GPUs per engine (the APRIL scripts: 2)")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="SGLang's share of GPU memory for weights + KV (the APRIL scripts: 0.6); "
                             "default: 85%% of HBM minus a 4 GiB workspace")
    parser.add_argument("--abort-latency", type=float, default=0.0, help="seconds an abort call takes")
    parser.add_argument("--weight-sync", type=float, default=0.0,
                        help="seconds a weight update takes (outside the rollout window)")
    parser.add_argument("--colocate", action="store_true",
                        help="engines share their GPUs with the trainer: with --step-boundary carry the carried KV "
                             "is copied to host memory and back at every step boundary")
    parser.add_argument("--lengths", default="dapo-math-17k",
                        help=f"length preset ({', '.join(LENGTH_PRESETS)}), agentic preset ({', '.join(TURN_PRESETS)}: "
                             "multi-turn trajectories with tool calls, docs/sim.md 'Agentic rollouts') or a .csv / "
                             ".jsonl trace path")
    parser.add_argument("--modes", type=_modes, default=None,
                        help=f"comma-separated: {','.join(MODES)} "
                             "(default: all; with --strategies baseline,april-batch)")
    parser.add_argument("--strategy", choices=tuple(STRATEGIES), default=None,
                        help="a long-tail strategy (docs/strategies.md) run by the APRIL modes; it sets the scheduler "
                             "settings not given as flags (a flag given its default value is taken as not given)")
    parser.add_argument("--strategies", type=_strategies, default=None, metavar="NAME[,NAME...]",
                        help=f"compare strategies ({', '.join(STRATEGIES)}) in one table, each in the APRIL mode(s) "
                             "of --modes, next to the synchronous baseline")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="grpo",
                        help="dapo drops groups whose rewards are all equal (dynamic sampling)")
    parser.add_argument("--dapo-baseline", choices=DAPO_BASELINES, default="replace",
                        help="the DAPO baseline: replace each rejected group (the scheduler with N' = N), or waves "
                             "(slime's rollout: a wave of N groups whenever in flight + accepted < N, the rest "
                             "aborted and discarded at N accepted)")
    parser.add_argument("--april-loop", choices=APRIL_LOOPS, default="scheduler",
                        help="april-batch: the scheduler's batch refill, or slime (slime's own rollout with "
                             "--partial-rollout, as the APRIL paper runs it: a wave of N' groups, buffered ones "
                             "first, whenever in flight + accepted < N; abort at N accepted, keep the partials)")
    parser.add_argument("--mixed-chunk", action="store_true",
                        help="engines run mixed chunked prefill (SGLang --enable-mixed-chunk): prefill chunks ride "
                             "in the decode batch's forward pass; the bound uses the same engine model")
    parser.add_argument("--chunked-prefill-size", type=int, default=8192,
                        help="prefill tokens per mixed iteration at most (with --mixed-chunk)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup-steps", type=int, default=1, help="steps left out of the summaries")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="where report.json and the PNG plots go (none: no files)")
    scheduler = parser.add_argument_group(
        "scheduler", "SchedulerConfig's settings; each mode sets " + " and ".join(MODE_SETTINGS) + " itself. The "
        "GRPO baseline runs N' = N without max_inflight_samples; the DAPO baseline uses max_staleness 0 with the "
        "drop policy.")
    known = settings(SimConfig)
    for name in SCHEDULER_FLAGS:
        if name == "over_sampling_batch_size":
            oversampling = known[name]
            scheduler.add_argument(oversampling.flag, type=_ints, default=argparse.SUPPRESS, metavar="N'[,N'...]",
                                   help=f"{oversampling.doc} A comma-separated list compares several.")
        else:
            add_flag(scheduler, known[name])
    parser.set_defaults(func=run)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The SimConfig of parsed ``simulate`` arguments (the first N' of a list); scheduler flags not given
    keep SimConfig's defaults."""
    return SimConfig(**settings_from_args(args), strategy=args.strategy)


def settings_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """SimConfig's keyword arguments of parsed ``simulate`` arguments but the mode and the strategy."""
    scheduler = {name: getattr(args, name) for name in SCHEDULER_FLAGS if hasattr(args, name)}
    if "over_sampling_batch_size" in scheduler:
        scheduler["over_sampling_batch_size"] = scheduler["over_sampling_batch_size"][0]
    return dict(
        cluster=args.cluster, lengths=args.lengths, algorithm=args.algorithm, num_engines=args.num_engines,
        tensor_parallel=args.tensor_parallel, mem_fraction_static=args.mem_fraction_static,
        abort_latency_s=args.abort_latency, weight_sync_s=args.weight_sync, colocate=args.colocate,
        dapo_baseline=args.dapo_baseline, april_loop=args.april_loop, mixed_chunk=args.mixed_chunk,
        chunked_prefill_size=args.chunked_prefill_size, steps=args.steps, warmup_steps=args.warmup_steps,
        prompt_len=args.prompt_len, seed=args.seed, **scheduler)


def run(args: argparse.Namespace) -> int:
    over_sampling = getattr(args, "over_sampling_batch_size", None)
    if args.output_dir:
        ensure_dir(args.output_dir)  # before the run: a bad directory fails in a second, not after minutes
    if args.strategies is not None:
        if args.strategy is not None or (over_sampling is not None and len(over_sampling) > 1):
            raise ConfigError("--strategies is not allowed with --strategy or a list of N': one run per strategy")
        config = config_from_args(args)
        results = compare_strategies(args.strategies, args.modes or ("baseline", "april-batch"),
                                     **settings_from_args(args))
    else:
        config = config_from_args(args)
        results = run_all(config, args.modes or MODES, over_sampling or (config.over_sampling_batch_size,))
    print(describe(results))
    if args.output_dir:
        write_json(results, os.path.join(args.output_dir, "report.json"))
        natural = np.minimum(config.length_model().natural_lengths(config.bound_version), config.max_response_len)
        for path in write_plots(results, args.output_dir, natural):
            print(f"wrote {path}")
    return 0


__all__ = ["SCHEDULER_FLAGS", "add_parser", "config_from_args", "run", "settings_from_args"]
