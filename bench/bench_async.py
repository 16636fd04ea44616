"""Asynchronous APRIL against synchronous APRIL and the synchronous baseline, timed as a user waits for them:
each run is one ``april-ext train`` command line in a fresh process, alone on the machine, timed from its start to
its exit (imports, model and engine build, every step, the trainer process's start in an asynchronous run).

    python bench/bench_async.py --config configs/counting_tiny.toml --seeds 0 1 2 3 4 --out bench_runs/async
    python bench/bench_async.py --config configs/lookup_tiny.toml --seeds 0 1 2 --steps 100 \
        --variants baseline april april_async --out bench_runs/async_lookup
    RAY_AUTH_MODE=disabled python bench/bench_async.py --seeds 0 1 2 --steps 40 --variants baseline april april_async \
        --extra "--ray --actor-num-gpus-per-node 2 --rollout-num-gpus 2 --ray-num-cpus-per-actor 0.5" --out bench_runs/async_ray

Runs per seed (their order turns with the seed, so no variant always runs first on a cold cache):
- ``baseline``: synchronous, no partial rollout;
- ``april``: synchronous APRIL (the config's settings);
- ``april_async``: asynchronous APRIL, ``--max-head-offpolicyness`` (d) 1;
- ``april_async_d0``: asynchronous APRIL with d = 0 (no overlap: the cost of the machinery alone).
A synchronous run uses the config's num_threads; an asynchronous one gives each of its two processes (engine,
trainer) that many threads (training.trainers.split_threads): on the main job, one core each of this 2-core
machine. Per run: wall-clock, steps_s (first step to last), reward at equal steps (last quarter), the time to
the baseline's last-quarter reward and the reward at equal wall time (training.comparison), the rollout token
rate and tokens per engine step. Writes <out>/runs.json and prints the table of docs/async.md with the targets
of issue 33 as met or missed:
- median over seeds of april_async's wall-clock / baseline's <= 0.70;
- mean last-quarter reward of april_async >= the baseline's mean minus its standard deviation over seeds;
- median of april_async_d0's wall-clock / april's within 3% (|ratio - 1| <= 0.03);
and issue 36's, on the CPU Ray topology (``--extra "--ray ..."``: every run gets those flags, a local Ray cluster
of its own included in its wall-clock): april_async's wall-clock below april's on the median over seeds, over the
same steps and with the same number of groups trained.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

import numpy as np

from april_ext.persistence import atomic_write_json
from april_ext.training.comparison import compare_runs
from april_ext.training.metrics import read_metrics, summarize

VARIANTS: dict[str, list[str]] = {
    "baseline": ["--no-partial-rollout", "--no-async-rollout"],
    "april": ["--partial-rollout", "--no-async-rollout"],
    "april_async": ["--partial-rollout", "--async-rollout", "--max-head-offpolicyness", "1"],
    "april_async_d0": ["--partial-rollout", "--async-rollout", "--max-head-offpolicyness", "0"],
}


def _run(config: str, name: str, seed: int, steps: int | None, out: str, timeout_s: float,
         extra: list[str]) -> dict[str, Any]:
    """One run's command line, timed; its history read back from its metrics.jsonl."""
    output_dir = os.path.join(out, f"seed{seed}", name)
    argv = [sys.executable, "-m", "april_ext.cli", "train", "--config", config, "--seed", str(seed),
            "--output-dir", output_dir, "--save-interval", "0", "--no-progress", "--no-plots",
            *VARIANTS[name], *(["--num-steps", str(steps)] if steps is not None else []), *extra]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} seed {seed} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    history = read_metrics(os.path.join(output_dir, "metrics.jsonl"), sys.maxsize)
    steps_done = sum(row.get("rollout/engine_steps", 0) for row in history)
    tokens = sum(row["rollout/generated_tokens"] for row in history)
    return {"wall_clock_s": wall, "history": history, "summary": summarize(history),
            "groups": sum(len(row["rollout/response_lens"]) for row in history),
            "tokens_per_engine_step": tokens / steps_done if steps_done else float("nan")}


def _seed(config: str, seed: int, steps: int | None, out: str, timeout_s: float,
          names: list[str], extra: list[str]) -> dict[str, Any]:
    order = names[seed % len(names):] + names[:seed % len(names)]
    runs = {name: _run(config, name, seed, steps, out, timeout_s, extra) for name in order}
    print(f"seed {seed}: " + ", ".join(f"{n} {runs[n]['wall_clock_s']:.1f} s" for n in names), flush=True)
    # The baseline first: compare_runs measures every run against its first.
    comparison = compare_runs({n: runs[n]["history"] for n in names}, {n: runs[n]["wall_clock_s"] for n in names})
    return {name: {**dataclasses.asdict(comparison[name]),
                   "rollout_tokens_per_s": runs[name]["summary"]["rollout_tokens_per_s"],
                   "tokens_per_engine_step": runs[name]["tokens_per_engine_step"],
                   "samples_trained": runs[name]["groups"],
                   "off_policy_token_ratio": runs[name]["summary"]["off_policy_token_ratio"],
                   "mean_version_lag": float(np.mean([r.get("async/version_lag_mean", 0.0) for r in runs[name]["history"]])),
                   "trainer_idle_s": float(sum(r.get("async/trainer_idle_s", 0.0) for r in runs[name]["history"])),
                   "engine_idle_s": float(sum(r.get("async/engine_idle_s", 0.0) for r in runs[name]["history"])),
                   "weight_update_s": float(sum(r["time/weight_sync_s"] for r in runs[name]["history"])),
                   "steps": len(runs[name]["history"])}
            for name in names}


def _table(per_seed: dict[int, dict[str, Any]]) -> list[str]:
    """Markdown: one row per figure, one column per variant, median [min, max] over the seeds."""
    names = list(next(iter(per_seed.values())))

    def cell(name: str, key: str, fmt: str) -> str:
        values = [per_seed[s][name][key] for s in per_seed]
        if all(v is not None and np.isnan(v) for v in values):
            return "n/a"  # SGLang servers report no engine steps: there is no per-step figure to show
        if any(v is None for v in values):
            reached = [v for v in values if v is not None]
            return f"{len(reached)}/{len(values)} seeds" + (f", median {np.median(reached):{fmt}}" if reached else "")
        return f"{np.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"

    rows = (("whole-run wall-clock (s)", "wall_clock_s", ".1f"), ("wall-clock / baseline", "wall_clock_ratio", ".2f"),
            ("first to last step (s)", "steps_s", ".1f"),
            ("to the baseline's reward (s)", "time_to_reference_reward_s", ".1f"),
            ("reward, equal steps", "reward_at_equal_steps", ".3f"),
            ("reward, equal wall time", "reward_at_equal_time", ".3f"),
            ("rollout tokens/s", "rollout_tokens_per_s", ".0f"), ("tokens / engine step", "tokens_per_engine_step", ".1f"),
            ("off-policy tokens", "off_policy_token_ratio", ".3f"), ("mean version lag", "mean_version_lag", ".2f"),
            ("trainer idle (s)", "trainer_idle_s", ".1f"), ("engine idle (s)", "engine_idle_s", ".1f"),
            ("samples trained", "samples_trained", ".0f"))
    lines = ["| median [min, max] over seeds | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cell(n, key, fmt) for n in names) + " |" for label, key, fmt in rows]
    return lines


def _targets(per_seed: dict[int, dict[str, Any]]) -> list[str]:
    seeds = list(per_seed)
    ratio = float(np.median([per_seed[s]["april_async"]["wall_clock_ratio"] for s in seeds]))
    base = [per_seed[s]["baseline"]["reward_at_equal_steps"] for s in seeds]
    ours = float(np.mean([per_seed[s]["april_async"]["reward_at_equal_steps"] for s in seeds]))
    floor = float(np.mean(base) - np.std(base))

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = [f"- async APRIL wall-clock / baseline, median: {ratio:.3f} (target <= 0.70): {verdict(ratio <= 0.70)}",
             f"- async APRIL mean last-quarter reward {ours:.3f} vs baseline mean - std {floor:.3f}: "
             f"{verdict(ours >= floor)}"]
    if "april_async_d0" in per_seed[seeds[0]]:
        d0 = float(np.median([per_seed[s]["april_async_d0"]["wall_clock_s"] / per_seed[s]["april"]["wall_clock_s"]
                              for s in seeds]))
        lines.append(f"- d = 0 wall-clock / synchronous APRIL, median: {d0:.3f} (target within 3%): "
                     f"{verdict(abs(d0 - 1) <= 0.03)}")
    if "april" in per_seed[seeds[0]]:
        vs_april = float(np.median([per_seed[s]["april_async"]["wall_clock_s"] / per_seed[s]["april"]["wall_clock_s"]
                                    for s in seeds]))
        same = all(per_seed[s]["april_async"]["samples_trained"] == per_seed[s]["april"]["samples_trained"]
                   for s in seeds)
        lines.append(f"- async APRIL wall-clock / synchronous APRIL, median: {vs_april:.3f} (target < 1, the same "
                     f"samples trained: {'yes' if same else 'NO'}): {verdict(vs_april < 1 and same)}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "..", "configs",
                                                         "counting_tiny.toml"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=None, help="num_steps (default: the config's)")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="one run's limit")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="runs per seed (baseline and april_async always run)")
    parser.add_argument("--extra", default="", help="flags added to every run's command line (e.g. \"--ray ...\")")
    parser.add_argument("--out", default="bench_runs/async")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [n for n in VARIANTS if n in {"baseline", "april_async", *args.variants}]
    extra = shlex.split(args.extra)
    per_seed = {seed: _seed(args.config, seed, args.steps, args.out, args.timeout_s, names, extra)
                for seed in args.seeds}
    atomic_write_json(os.path.join(args.out, "runs.json"), {"config": args.config, "steps": args.steps,
                                                            "extra": extra, "per_seed": per_seed})
    print("\n".join(_table(per_seed) + [""] + _targets(per_seed)))
    print(f"runs: {json.dumps(os.path.join(args.out, 'runs.json'))}")


if __name__ == "__main__":
    main()
