"""The multi-turn lookup task on the embedded engine: real training runs of configs/lookup_tiny.toml (a tool call
with a lognormal latency per lookup, the environment's final reward, tiny Llama, torch trainer), APRIL, APRIL
with continuous refill, APRIL with the carry step boundary and a long-tail strategy against the synchronous
baseline, over several seeds.

    OMP_NUM_THREADS=1 python bench/bench_agentic.py --steps 300 --seeds 0 1 2 --out bench_runs/agentic
    python bench/bench_agentic.py --combine DIR...   # one table from seeds run in processes of their own

For each seed the runs step in turn in one process (training.run.train_side_by_side), so they see the same
machine load; tool latencies are real sleeps, so a run does not repeat exactly (docs/agentic.md). Per run:
- rollout throughput: generated tokens / rollout seconds, and its ratio to the baseline of the same seed;
- engine idle while tools run: the share of the time some turn was with the environment during which the engine
  had no request (env/engine_idle_while_tools, mean over steps);
- trajectories still with their tool when the step's batch was taken (env/waiting_at_boundary, mean);
- off-policy token share (mean over steps);
- reward at equal steps: the mean batch reward of the last quarter of the steps;
- reward at equal wall time: the mean batch reward of the steps that ended in the last quarter of the shortest
  run's total time (step time: rollout, training and weight sync).
Writes <out>/runs.json and prints the markdown table of docs/agentic.md ("Measured"): mean +- std over seeds.
Seeds run apart (one process each) are put in one table by ``--combine DIR...``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

import numpy as np

from april_ext.persistence import atomic_write_json, read_json
from april_ext.training import TrainConfig
from april_ext.training.run import train_side_by_side

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "lookup_tiny.toml")
RUNS: dict[str, dict[str, Any]] = {
    "baseline": {"partial_rollout": False},
    "april": {"partial_rollout": True},
    "april_continuous": {"partial_rollout": True, "refill": "continuous"},
    "april_carry": {"partial_rollout": True, "strategy": "april_carry"},
    "rollpacker_extra": {"partial_rollout": True, "strategy": "rollpacker_extra"},
}


def _figures(history: list[dict[str, Any]], until_s: float) -> dict[str, float]:
    rewards = [r["rollout/reward_mean"] for r in history]
    quarter = max(1, len(rewards) // 4)
    ends = np.cumsum([r["time/step_s"] for r in history])
    late = [r for r, end in zip(rewards, ends, strict=True) if 0.75 * until_s < end <= until_s]
    tokens = sum(r["rollout/generated_tokens"] for r in history)
    return {
        "rollout_tok_s": tokens / sum(r["rollout/wall_s"] for r in history),
        "engine_idle_while_tools": float(np.mean([r["env/engine_idle_while_tools"] for r in history])),
        "waiting_at_boundary": float(np.mean([r["env/waiting_at_boundary"] for r in history])),
        "off_policy": float(np.mean([r["rollout/off_policy_token_ratio"] for r in history])),
        "reward_equal_steps": float(np.mean(rewards[-quarter:])),
        "reward_equal_time": float(np.mean(late)) if late else float("nan"),
        "wall_s": float(ends[-1]),
    }


def run_seed(base: TrainConfig, seed: int, steps: int, out: str) -> dict[str, dict[str, float]]:
    configs = {name: base.replace(seed=seed, num_steps=steps, output_dir=os.path.join(out, f"seed{seed}", name),
                                  progress=False, plots=False, save_interval=0, save=None, **changes)
               for name, changes in RUNS.items()}
    results = asyncio.run(train_side_by_side(configs))
    shortest = min(float(np.sum([r["time/step_s"] for r in res.history])) for res in results.values())
    figures = {name: _figures(res.history, shortest) for name, res in results.items()}
    for name in figures:
        figures[name]["throughput_vs_baseline"] = figures[name]["rollout_tok_s"] / figures["baseline"]["rollout_tok_s"]
    return figures


def _cell(values: list[float], fmt: str) -> str:
    mean, std = float(np.nanmean(values)), float(np.nanstd(values))
    return f"{fmt.format(mean)} +- {fmt.format(std)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", default="bench_runs/agentic")
    parser.add_argument("--combine", nargs="+", metavar="DIR",
                        help="print one table from the runs.json of earlier --out directories (seeds run apart)")
    args = parser.parse_args()
    if args.combine:
        runs = {}
        for directory in args.combine:
            runs.update({int(s): r for s, r in read_json(os.path.join(directory, "runs.json")).items()})
        args.seeds = sorted(runs)
    else:
        base = TrainConfig.from_toml(CONFIG)
        runs = {seed: run_seed(base, seed, args.steps, args.out) for seed in args.seeds}
        atomic_write_json(os.path.join(args.out, "runs.json"), {str(s): r for s, r in runs.items()}, indent=2)
    columns = (("rollout tok/s", "rollout_tok_s", "{:.0f}"), ("vs baseline", "throughput_vs_baseline", "{:.2f}x"),
               ("engine idle while tools", "engine_idle_while_tools", "{:.1%}"),
               ("waiting at boundary", "waiting_at_boundary", "{:.1f}"), ("off-policy", "off_policy", "{:.1%}"),
               ("reward, equal steps", "reward_equal_steps", "{:.3f}"),
               ("reward, equal time", "reward_equal_time", "{:.3f}"), ("wall s", "wall_s", "{:.0f}"))
    print(f"{len(args.seeds)} seeds ({', '.join(map(str, args.seeds))}); mean +- std")
    print("| run | " + " | ".join(c[0] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in RUNS:
        cells = [_cell([runs[s][name][key] for s in args.seeds], fmt) for _, key, fmt in columns]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
