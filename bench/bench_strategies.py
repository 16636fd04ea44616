"""The long-tail strategy table from the calibrated simulator (docs/strategies.md, issue 16).

    python bench/bench_strategies.py [--seeds 5] [--jobs 2] [--markdown out.md] [--json out.json]
        [--presets seer-h200-qwen3-8b] [--rows baseline,april,seer] [--base earlier.json]

``--base``: the runs of an earlier --json output are kept for the rows not run now (same presets and seeds), so a
table can be extended row by row (runs are deterministic: the baseline recomputed is the same); ``--tables-only``
prints the tables of --base. --json is rewritten after every finished preset x seed.

Every preset runs every row on the same seeds; a row is a strategy (april_ext.strategies) in an APRIL mode, or
the synchronous baseline that each row's rollout throughput is measured against (same seed, same bound). Per row:
rollout throughput vs the baseline (all tokens generated, and the useful ones: less those thrown away by the DAPO
baseline's drops and tail batching's restarts), efficiency vs the bound (the least time of the row's own work on
the same engines, docs/sim.md), off-policy token share, largest staleness, trained-vs-natural length distance (W1
over the natural mean), tail latency (the last 10% of each step's batch samples as a share of its rollout time),
prediction rank correlation (scheduler) and continuations per step (divided rollout): mean and spread (standard
deviation) over the seeds.

Presets, at half the scale of the setups they follow (half the engines and half the prompts: the same load per
engine; the full table then fits in 25 minutes of the shared 2-core build machine): the APRIL paper's engines
(bench_sim_report: SGLang engines x TP 2, mem 0.6, 8 samples per prompt, N' = 2N, a 16K cap, dapo-math-17k
lengths; here 2 engines and 16 prompts instead of 4 and 32) for Qwen3-4B / 8B x GRPO / DAPO on H100 and H200 (GSPO
rolls out as GRPO does: every complete group is trained; only its loss differs, which the simulator does not run),
and a Seer-shaped one: 4 H200 engines of Qwen3-8B, 8 prompts x 16 samples, a 64K cap, the seer-long-cot lengths
(docs/sim.md). 4 steps, the first left out of the summaries.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from bench_sim_report import ABORT_LATENCY_S, WEIGHT_SYNC_S

from april_ext.persistence import atomic_write_json
from april_ext.sim.runner import SimConfig, simulate

PAPER_STEPS, PAPER_WARMUP = 4, 1
SEER_STEPS, SEER_WARMUP = 4, 1


def _paper(gpu: str, model: str, algorithm: str) -> dict[str, object]:
    return dict(cluster=f"{gpu}-{model}", lengths="dapo-math-17k", algorithm=algorithm, num_engines=2,
                tensor_parallel=2, mem_fraction_static=0.6, abort_latency_s=ABORT_LATENCY_S,
                weight_sync_s=WEIGHT_SYNC_S, rollout_batch_size=16, n_samples_per_prompt=8,
                over_sampling_batch_size=None, max_response_len=16384, steps=PAPER_STEPS, warmup_steps=PAPER_WARMUP)


PRESETS: dict[str, dict[str, object]] = {
    f"{gpu}-{model}-{'grpo/gspo' if algorithm == 'grpo' else algorithm}": _paper(gpu, model, algorithm)
    for gpu, model, algorithm in itertools.product(("h100", "h200"), ("qwen3-4b", "qwen3-8b"), ("grpo", "dapo"))
}
PRESETS["seer-h200-qwen3-8b"] = dict(
    cluster="h200-qwen3-8b", lengths="seer-long-cot", algorithm="grpo", num_engines=4, abort_latency_s=ABORT_LATENCY_S,
    weight_sync_s=WEIGHT_SYNC_S, rollout_batch_size=8, n_samples_per_prompt=16, over_sampling_batch_size=None,
    max_response_len=65536, steps=SEER_STEPS, warmup_steps=SEER_WARMUP)

# Row label -> (mode, strategy). APRIL's N' is the preset's (2N); the on-policy strategies set N' = N themselves.
# Seer runs with continuous refill: with N' = N and DAPO's filter, batch refill would wait for a whole wave before
# replacing a rejected group, which slime's baseline does not (with GRPO the two are the same).
ROWS: dict[str, tuple[str, str | None]] = {
    "baseline": ("baseline", None),
    "april": ("april-batch", "april"),
    "april_carry": ("april-batch", "april_carry"),
    "april_seer": ("april-batch", "april_seer"),
    "april_tail": ("april-batch", "april_tail"),
    "sortedrl": ("april-batch", "sortedrl"),
    "seer": ("april-continuous", "seer"),
    "rollpacker": ("april-batch", "rollpacker"),
    "rollpacker_extra": ("april-batch", "rollpacker_extra"),
}

METRICS = (
    # (key, summary key, format)
    ("gain", None, "{:+.1%}"),
    ("useful gain", None, "{:+.1%}"),
    ("eff", "efficiency", "{:.2f}"),
    ("offpol", "offpolicy_token_ratio", "{:.2f}"),
    ("stale max", "max_staleness", "{:.0f}"),
    ("W1", "length_w1_rel", "{:.3f}"),
    ("tail", "tail_latency", "{:.2f}"),
    ("rank corr", "prediction_rank_corr", "{:.2f}"),
    ("cont/step", "continuations_per_step", "{:.0f}"),
)


def _run(job: tuple[str, int, tuple[str, ...]]) -> dict[str, object]:
    """Every row of one preset and seed, against one bound."""
    preset, seed, rows = job
    settings = dict(PRESETS[preset], seed=seed)
    started = time.perf_counter()
    bound = SimConfig(**settings).occupancy_bound()  # type: ignore[arg-type]
    out: dict[str, dict[str, float]] = {}
    for row in rows:
        mode, strategy = ROWS[row]
        config = SimConfig(**settings, mode=mode, strategy=strategy)  # type: ignore[arg-type]
        summary = simulate(config, bound).summary
        out[row] = {name: float(summary.get(key, math.nan)) for name, key, _ in METRICS if key is not None}
        out[row]["tokens_per_s"] = summary["tokens_per_s"]
        out[row]["useful_tokens_per_s"] = summary["useful_tokens_per_s"]
    for row in rows:
        out[row]["gain"] = out[row]["tokens_per_s"] / out["baseline"]["tokens_per_s"] - 1
        out[row]["useful gain"] = out[row]["useful_tokens_per_s"] / out["baseline"]["useful_tokens_per_s"] - 1
    return {"preset": preset, "seed": seed, "rows": out, "seconds": time.perf_counter() - started}


def _cell(values: list[float], fmt: str) -> str:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return "-"
    mean, spread = float(np.mean(finite)), float(np.std(finite))
    return f"{fmt.format(mean)} ± {fmt.format(spread).lstrip('+')}" if len(finite) > 1 else fmt.format(mean)


def tables(results: list[dict[str, object]], rows: tuple[str, ...]) -> tuple[str, dict[str, object]]:
    """Markdown (a table per preset, mean ± std over seeds) and the JSON summary with the best row per preset."""
    lines: list[str] = []
    summary: dict[str, object] = {}
    for preset in dict.fromkeys(r["preset"] for r in results):  # type: ignore[misc]
        runs = [r for r in results if r["preset"] == preset]
        seeds = sorted(r["seed"] for r in runs)  # type: ignore[type-var]
        lines += [f"### {preset} ({len(seeds)} seeds)", "",
                  "| row | " + " | ".join(name for name, _, _ in METRICS) + " |",
                  "|---|" + "---|" * len(METRICS)]
        per_row: dict[str, dict[str, list[float]]] = {}
        for row in rows:
            values = {name: [r["rows"][row][name] for r in runs] for name, _, _ in METRICS}  # type: ignore[index]
            per_row[row] = values
            lines.append(f"| {row} | " + " | ".join(_cell(values[name], fmt) for name, _, fmt in METRICS) + " |")
        gains = {row: float(np.nanmean(v["useful gain"])) for row, v in per_row.items()}
        best = max(gains, key=gains.__getitem__)
        on_policy = {row: g for row, g in gains.items() if row in ("seer", "rollpacker", "rollpacker_extra")}
        best_on_policy = max(on_policy, key=on_policy.__getitem__) if on_policy else None
        lines += ["", f"best useful throughput: {best} ({gains[best]:+.1%})"
                  + (f"; best on-policy: {best_on_policy} ({gains[best_on_policy]:+.1%})" if best_on_policy else ""),
                  ""]
        summary[preset] = {"seeds": seeds, "rows": per_row, "best": best, "best_on_policy": best_on_policy}
    return "\n".join(lines), summary


def _write(path: str, results: list[dict[str, object]], rows: tuple[str, ...], wall: float) -> None:
    atomic_write_json(path, {"runs": results, "summary": tables(results, rows)[1] if results else {},
                             "wall_seconds": wall}, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--presets", type=lambda t: tuple(t.split(",")), default=tuple(PRESETS))
    parser.add_argument("--rows", type=lambda t: tuple(t.split(",")), default=tuple(ROWS))
    parser.add_argument("--markdown", default=None, help="write the tables here")
    parser.add_argument("--json", default=None,
                        help="write every figure (per seed and summarized) here, after every finished preset x seed")
    parser.add_argument("--base", default=None, help="an earlier --json output whose other rows are kept")
    parser.add_argument("--tables-only", action="store_true", help="run nothing: the tables of --base")
    args = parser.parse_args()
    unknown = [p for p in args.presets if p not in PRESETS] + [r for r in args.rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown presets or rows {unknown}: presets {list(PRESETS)}, rows {list(ROWS)}")
    rows = ("baseline", *(r for r in args.rows if r != "baseline"))
    earlier: dict[tuple[str, int], dict[str, object]] = {}
    if args.base:
        with open(args.base, encoding="utf-8") as f:
            earlier = {(r["preset"], r["seed"]): r for r in json.load(f)["runs"]}
    # The Seer preset's runs take the longest: first, so the pool ends evenly.
    jobs = [] if args.tables_only else sorted(
        ((p, s, rows) for p in args.presets for s in range(args.seeds)), key=lambda j: not j[0].startswith("seer"))
    started = time.perf_counter()
    results: list[dict[str, object]] = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for result in pool.map(_run, jobs):
            old = earlier.pop((result["preset"], result["seed"]), None)  # type: ignore[arg-type]
            if old is not None:
                result["rows"] = {**old["rows"], **result["rows"]}  # type: ignore[dict-item]
                result["seconds"] += old["seconds"]  # type: ignore[operator]
            results.append(result)
            print(f"{result['preset']} seed {result['seed']}: {result['seconds']:.0f} s", flush=True)
            if args.json:
                _write(args.json, results, rows, time.perf_counter() - started)
    if args.tables_only:
        results = list(earlier.values())
    rows = tuple(row for row in ROWS if results and all(row in r["rows"] for r in results))  # type: ignore[operator]
    markdown = tables(results, rows)[0]
    wall = time.perf_counter() - started
    print(markdown)
    print(f"{len(jobs)} jobs ({len(rows)} rows) in {wall:.0f} s with {args.jobs} processes")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(markdown + "\n")
    if args.json and not args.tables_only:
        _write(args.json, results, rows, wall)


if __name__ == "__main__":
    main()
