"""The long-tail strategies on the embedded engine: real training runs of the CPU main job
(configs/counting_tiny.toml: counting task, tiny Llama, embedded engine, torch trainer), fewer steps, one run
per strategy and the synchronous baseline, over several seeds.

    OMP_NUM_THREADS=1 python bench/bench_strategies_engine.py --steps 40 --seeds 0 1 --out bench_runs/strategies

Each strategy is april_ext.strategies' preset applied to the main job's settings; a setting the preset changes
is taken from the preset even where the config file sets it (the file's over_sampling_batch_size = 10 would
otherwise turn Seer's on-policy N' = N into N' = 10). For each seed the runs step in turn in one process
(training.run.train_side_by_side), so they see the same machine load. Per run:
- rollout throughput: generated tokens / rollout seconds, as a ratio to the baseline of the same seed, and
  tokens per engine iteration (generated tokens / the engine's model steps: the mean batch, which machine
  load does not move), also as a ratio;
- off-policy token share (mean over steps) and the largest staleness of a trained token;
- reward at equal steps: the mean batch reward of the last quarter of the steps;
- tail share: the share of a step's rollout time spent after 90% of its finished samples had finished;
- continuations per step, long rounds (tail batching) and the length prediction's rank correlation.
Writes <out>/runs.json and prints the markdown table of docs/strategies.md ("Embedded engine"): mean +- std
over the seeds.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import time
from typing import Any

import numpy as np

from april_ext.data_source import ListDataSource
from april_ext.persistence import atomic_write_json
from april_ext.scheduler import Scheduler, SchedulerConfig
from april_ext.strategies import STRATEGIES, apply_strategy
from april_ext.training import TrainConfig
from april_ext.training.config import SCHEDULER_SETTINGS
from april_ext.training.run import train_side_by_side

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "counting_tiny.toml")
STRATEGY_ORDER = ("april", "seer", "april_seer", "rollpacker", "rollpacker_extra", "april_tail", "sortedrl")


def _config(base: TrainConfig, name: str, seed: int, steps: int, out: str) -> TrainConfig:
    """The main job's config for one run: the baseline, or the strategy's preset over the file's settings."""
    common = {"seed": seed, "num_steps": steps, "output_dir": os.path.join(out, f"seed{seed}", name),
              "progress": False, "plots": False, "save_interval": 0, "save": None}
    if name == "baseline":
        return base.replace(partial_rollout=False, **common)
    cap = 1024  # any response cap: only which settings the preset changes matters here
    file_config = base.scheduler_config(cap)
    preset = apply_strategy(file_config, name)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in SCHEDULER_SETTINGS}
    changed = {n: defaults[n] for n in SCHEDULER_SETTINGS if getattr(preset, n) != getattr(file_config, n)}
    return base.replace(partial_rollout=True, strategy=name, **changed, **common)


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v is not None and not math.isnan(v)]
    return float(np.mean(finite)) if finite else math.nan


def _figures(history: list[dict[str, Any]]) -> dict[str, float]:
    tokens = sum(r["rollout/generated_tokens"] for r in history)
    seconds = sum(r["rollout/wall_s"] for r in history)
    engine_steps = sum(r["rollout/engine_steps"] for r in history)
    rewards = [r["rollout/reward_mean"] for r in history]
    quarter = max(1, len(rewards) // 4)
    return {
        "steps": len(history),
        "tokens_per_s": tokens / seconds,
        "tokens_per_engine_step": tokens / engine_steps if engine_steps else math.nan,
        "off_policy_share": float(np.mean([r["rollout/off_policy_token_ratio"] for r in history])),
        "max_staleness": max(r["rollout/batch_max_staleness"] for r in history),
        "reward_last_quarter": float(np.mean(rewards[-quarter:])),
        "tail_share": float(np.mean([r["rollout/tail_share"] for r in history])),
        "continuations_per_step": float(np.mean([r["rollout/continuation_requests"] for r in history])),
        "prediction_rank_corr": _nanmean([r["rollout/prediction_rank_corr"] for r in history]),
        "long_rounds": sum(r["rollout/long_round"] for r in history),
    }


def _available(names: list[str]) -> tuple[list[str], list[str]]:
    """(strategies whose settings the scheduler acts on, those it does not yet: tail batching before its core,
    which reports long_round among its stats)."""
    acts_on_tail = "long_round" in Scheduler(SchedulerConfig(), ListDataSource([])).stats()
    usable = [n for n in names if acts_on_tail or not apply_strategy(SchedulerConfig(), n).tail_batching]
    return usable, [n for n in names if n not in usable]


def _table(runs: dict[int, dict[str, dict[str, float]]], names: list[str]) -> str:
    def cell(values: list[float], fmt: str) -> str:
        values = [v for v in values if not math.isnan(v)]
        if not values:
            return "-"
        if len(values) == 1:
            return fmt.format(values[0])
        return f"{fmt.format(float(np.mean(values)))} ± {fmt.format(float(np.std(values)))}"

    header = ("| strategy | tokens/s vs baseline | tokens / engine step vs baseline | off-policy tokens | max staleness "
              "| reward (last 1/4) | tail share | continuations / step | long rounds | prediction rank corr |")
    rows = [header, "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ["baseline", *names]:
        per_seed = [seed_runs[name] for seed_runs in runs.values()]
        base = [seed_runs["baseline"] for seed_runs in runs.values()]
        speed = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(per_seed, base)]
        batch = [r["tokens_per_engine_step"] / b["tokens_per_engine_step"] for r, b in zip(per_seed, base)]
        rows.append(" | ".join([
            f"| `{name}`", cell(speed, "{:.2f}x"), cell(batch, "{:.2f}x"),
            cell([r["off_policy_share"] for r in per_seed], "{:.1%}"),
            cell([float(r["max_staleness"]) for r in per_seed], "{:.0f}"),
            cell([r["reward_last_quarter"] for r in per_seed], "{:.3f}"),
            cell([r["tail_share"] for r in per_seed], "{:.1%}"),
            cell([r["continuations_per_step"] for r in per_seed], "{:.0f}"),
            cell([float(r["long_rounds"]) for r in per_seed], "{:.0f}"),
            cell([r["prediction_rank_corr"] for r in per_seed], "{:.2f}")]) + " |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=CONFIG, help="the main job's TOML (default: configs/counting_tiny.toml)")
    parser.add_argument("--strategies", default=",".join(STRATEGY_ORDER),
                        help=f"comma-separated names of {sorted(STRATEGIES)} (the baseline always runs)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="bench_runs/strategies_engine")
    args = parser.parse_args()
    names = [n for n in args.strategies.split(",") if n]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}: choose from {sorted(STRATEGIES)}")
    names, skipped = _available(names)
    if skipped:
        print(f"skipped (the scheduler does not act on their settings yet): {', '.join(skipped)}")
    base = TrainConfig.from_toml(args.config)
    runs: dict[int, dict[str, dict[str, float]]] = {}
    start = time.perf_counter()
    for seed in args.seeds:
        configs = {name: _config(base, name, seed, args.steps, args.out) for name in ["baseline", *names]}
        results = asyncio.run(train_side_by_side(configs))
        runs[seed] = {name: _figures(result.history) for name, result in results.items()}
        print(f"seed {seed} done after {time.perf_counter() - start:.0f} s", flush=True)
    atomic_write_json(os.path.join(args.out, "runs.json"),
                      {"config": os.path.abspath(args.config), "steps": args.steps, "seeds": args.seeds,
                       "strategies": names, "skipped": skipped, "runs": {str(s): r for s, r in runs.items()}},
                      indent=2)
    print(f"\n{args.steps} steps, seeds {' '.join(map(str, args.seeds))}; mean ± std over seeds\n")
    print(_table(runs, names))


if __name__ == "__main__":
    main()
