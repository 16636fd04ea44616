"""``april-ext simulate``: APRIL vs the synchronous baseline on a simulated cluster, in seconds on a laptop."""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from april_ext.sim.cost import CLUSTER_PRESETS
from april_ext.sim.lengths import LENGTH_PRESETS
from april_ext.sim.report import describe, write_json, write_plots
from april_ext.sim.runner import ALGORITHMS, MODES, SimConfig, compare


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"--modes {text!r}: a comma-separated subset of {', '.join(MODES)}")
    return modes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "simulate", help="simulate rollout steps on a virtual cluster: APRIL vs the synchronous baseline",
        description="Drives the real scheduler and rollout loop over a simulated engine with a virtual clock. "
                    "Prints a table (throughput, gain over the baseline, efficiency against the full-occupancy "
                    "bound, bubbles, partial / off-policy ratios, staleness, re-prefill, length bias) and writes "
                    "PNG plots and a JSON report to --output-dir.")
    parser.add_argument("--cluster", default="h100-qwen3-8b", help=f"one of {', '.join(CLUSTER_PRESETS)}")
    parser.add_argument("--num-engines", type=int, default=8, help="engine replicas (one per GPU)")
    parser.add_argument("--lengths", default="dapo-math-17k",
                        help=f"length preset ({', '.join(LENGTH_PRESETS)}) or a .csv / .jsonl trace path")
    parser.add_argument("--modes", type=_modes, default=MODES, help=f"comma-separated: {','.join(MODES)}")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="grpo",
                        help="dapo drops groups whose rewards are all equal (dynamic sampling)")
    parser.add_argument("--rollout-batch-size", type=int, default=32)
    parser.add_argument("--n-samples-per-prompt", type=int, default=8)
    parser.add_argument("--over-sampling-batch-size", type=int, default=64)
    parser.add_argument("--max-response-len", type=int, default=16384)
    parser.add_argument("--max-inflight-samples", type=int, default=None,
                        help="APRIL modes: scheduler cap on samples in flight (e.g. engines x B_sat with a large N')")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=None, help="where report.json and the PNG plots go (none: no files)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    config = SimConfig(
        cluster=args.cluster, lengths=args.lengths, algorithm=args.algorithm,
        rollout_batch_size=args.rollout_batch_size, n_samples_per_prompt=args.n_samples_per_prompt,
        over_sampling_batch_size=args.over_sampling_batch_size, max_response_len=args.max_response_len,
        max_inflight_samples=args.max_inflight_samples,
        num_engines=args.num_engines, steps=args.steps, prompt_len=args.prompt_len, seed=args.seed)
    results = compare(config, args.modes)
    print(describe(results))
    if args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        write_json(results, os.path.join(args.output_dir, "report.json"))
        natural = np.minimum(config.length_model().natural_lengths((config.steps - 1) // 2), config.max_response_len)
        for path in write_plots(results, args.output_dir, natural):
            print(f"wrote {path}")
    return 0


__all__ = ["add_parser", "run"]
