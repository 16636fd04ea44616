"""The simulator calibrated against the APRIL paper, then measured long enough, against bounds that bound.

    .venv/bin/python bench/bench_sim_report.py [--steps 12] [--seeds 3] [--jobs 2] [--json out.json]
        [--only efficiency --algorithms grpo --datasets dapo-math-17k]   # efficiency of a subset of cells
    .venv/bin/python -m pytest bench/bench_sim_report.py --benchmark-only   # seconds per simulated step

Paper-faithful settings (the APRIL scripts, RLsys-Foundation/APRIL scripts/partial_rollout/qwen): 8 GPUs as 4
SGLang engines at TP = 2 with mem_fraction_static 0.6, 32 prompts x 8 samples, N' = 64 for APRIL, a 16K cap;
slime's DAPO baseline keeps N' = N and relaunches a wave of N groups whenever those in flight plus those accepted
fall below N (SimConfig.dapo_baseline "waves"); abort latency and weight-sync time modelled (ABORT_LATENCY_S,
WEIGHT_SYNC_S: assumptions, docs/sim.md).

1. Calibration: APRIL's rollout-throughput gain over the baseline for Qwen3-4B/8B x GRPO/DAPO x three datasets over
   seeds against the paper's Table 1 (PAPER_TABLE1, 12 cells), in the paper's metric (generated tokens / wall
   time of a rollout iteration), setup (the APRIL scripts) and hardware (8 x MI300X), APRIL run by slime's own
   rollout loop with --partial-rollout (SimConfig.april_loop "slime").
2. Convergence: how many steps until the figures settle, their spread over seeds, the largest staleness.
3. Efficiency on every H100 / H200 preset against the headline bound (the best schedule of the same work on
   the same engines, without re-prefill) and the ceiling (with the re-prefill), for the baseline and the APRIL
   modes with each step boundary, colocated (carry copies its KV to host and back); targets: `abort` >= 0.85
   and `carry` >= 0.95 of the headline bound, per cell with the best APRIL mode.
4. Factors: why the simulated gains differ from Table 1. Each factor of the model (metric, hardware, APRIL's loop,
   the length distributions, the engine's step cost, the step boundary, the weight sync) and its effect on all
   12 cells: the calibration as it was, the changes made cumulatively, then one factor at a time.
5. Agentic: multi-turn trajectories with tool calls (april_ext.sim.turns presets search-agent and swe-agent) on
   the paper-faithful engines, GRPO: the baseline, every APRIL mode and every long-tail strategy (in april-batch),
   each against its never-idle bound (the same work on engines that never idle while tools run, observation
   prefill counted, no re-prefill).
"""

from __future__ import annotations

import argparse
import itertools
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace

import numpy as np

from april_ext.persistence import atomic_write_json
from april_ext.sim.cost import GPUS, MODELS, ClusterConfig, derive_cost_model
from april_ext.sim.lengths import PAPER_LENGTH_PRESETS, LogNormalLengths, length_preset
from april_ext.sim.runner import MODES, SimConfig, simulate
from april_ext.sim.turns import TURN_PRESETS
from april_ext.strategies import STRATEGIES

ABORT_LATENCY_S = 0.5
WEIGHT_SYNC_S = 4.0
TARGET_ABORT = 0.85
TARGET_CARRY = 0.95
# The APRIL paper's Table 1 (arXiv 2509.18521, section A4, Table 1 and its caption; ../shared/notes/paper-table1.md):
# rollout-throughput gain of APRIL over the non-partial baseline, per (model, algorithm, dataset); datasets in the
# caption's order. Throughput: tokens generated on the 8 GPUs / wall time of a rollout iteration (generated, not
# trained tokens); 8 GPUs, mainly AMD MI300; baseline 32 prompts x 8, APRIL over-samples 64 prompts.
PAPER_TABLE1 = {
    ("qwen3-4b", "grpo", "dapo-math-17k"): 0.244, ("qwen3-4b", "grpo", "deepscaler"): 0.318,
    ("qwen3-4b", "grpo", "deepmath-103k"): 0.377,
    ("qwen3-4b", "dapo", "dapo-math-17k"): 0.090, ("qwen3-4b", "dapo", "deepscaler"): 0.135,
    ("qwen3-4b", "dapo", "deepmath-103k"): 0.098,
    ("qwen3-8b", "grpo", "dapo-math-17k"): 0.264, ("qwen3-8b", "grpo", "deepscaler"): 0.347,
    ("qwen3-8b", "grpo", "deepmath-103k"): 0.495,
    ("qwen3-8b", "dapo", "dapo-math-17k"): 0.087, ("qwen3-8b", "dapo", "deepscaler"): 0.085,
    ("qwen3-8b", "dapo", "deepmath-103k"): 0.102,
}
PAPER_MEAN_GAIN = 0.225  # the paper's "about +22.5%" on average (the 12 cells above average +22.0%)
MATCH_POINTS = 0.05  # a cell matches when the simulated gain is within +-5 points of the paper's
CAL_GPU = "mi300x"  # "the reported results are mainly from the AMD MI300 configuration"


def paper_config(cluster: str | ClusterConfig, lengths: str | LogNormalLengths, algorithm: str, mode: str, steps: int,
                 seed: int = 0, warmup_steps: int = 2, dapo_baseline: str = "waves",
                 april_loop: str = "scheduler") -> SimConfig:
    return SimConfig(cluster=cluster, lengths=lengths, algorithm=algorithm, mode=mode, num_engines=4,
                     tensor_parallel=2, mem_fraction_static=0.6, abort_latency_s=ABORT_LATENCY_S,
                     weight_sync_s=WEIGHT_SYNC_S, rollout_batch_size=32, n_samples_per_prompt=8,
                     over_sampling_batch_size=64, max_response_len=16384, steps=steps, warmup_steps=warmup_steps,
                     seed=seed, dapo_baseline=dapo_baseline, april_loop=april_loop)


def _run(config: SimConfig) -> dict[str, object]:
    started = time.perf_counter()
    result = simulate(config)
    return {"summary": result.summary, "seconds": time.perf_counter() - started,
            "steps": [{"tokens": s.generated_tokens, "trained": s.trained_tokens, "rollout_s": s.rollout_s,
                       "least_s": s.least_time_s, "ceiling_s": s.ceiling_time_s, "efficiency": s.efficiency,
                       "stale": len(s.staleness_histogram) - 1} for s in result.steps]}


def run_all(configs: dict[tuple, SimConfig], jobs: int) -> dict[tuple, dict[str, object]]:
    with ProcessPoolExecutor(jobs) as pool:
        return dict(zip(configs, pool.map(_run, configs.values())))


CAL_MODELS = ("qwen3-4b", "qwen3-8b")
CAL_ALGORITHMS = ("grpo", "dapo")
WARMUP_STEPS = 2


@dataclass(frozen=True)
class Variant:
    """One version of the model for the calibration's cells: the hardware, APRIL's loop, the metric, and changes to
    the engine's costs, the length presets, the abort latency and the rollout window. The calibration is
    ``Variant()``; the factor table changes one thing at a time."""

    label: str = "calibration"
    gpu: str = CAL_GPU
    april_loop: str = "slime"
    metric: str = "generated"
    """"generated": tokens generated in a rollout iteration / its wall time, averaged over the iterations (the
    paper's, RLsys-Foundation/APRIL slime/backends/megatron_utils/data.py tokens_throughput); "trained": the
    trained batch's response tokens / rollout time, over all summarized steps (slime's perf/tokens_per_gpu_per_sec)."""
    cost_scale: tuple[tuple[str, float], ...] = ()  # CostModel field -> factor
    lengths_scale: tuple[tuple[str, float], ...] = ()  # LogNormalLengths field -> factor (every dataset)
    abort_latency_s: float = ABORT_LATENCY_S
    window_extra_s: float = 0.0  # seconds added to every step's rollout window (after the runs)

    def run_key(self) -> tuple:
        """What the simulated runs depend on (variants differing only in metric or window share them)."""
        return (self.gpu, self.april_loop, self.cost_scale, self.lengths_scale, self.abort_latency_s)

    def cluster(self, model: str) -> ClusterConfig:
        cost = derive_cost_model(GPUS[self.gpu], MODELS[model], tensor_parallel=2, mem_fraction_static=0.6)
        if self.cost_scale:
            cost = replace(cost, **{k: getattr(cost, k) * f for k, f in self.cost_scale})
        return ClusterConfig(cost, num_engines=4, name=f"{self.gpu}-{model}", gpus_per_engine=2,
                             abort_latency_s=self.abort_latency_s, weight_sync_s=WEIGHT_SYNC_S)

    def lengths(self, dataset: str, seed: int) -> str | LogNormalLengths:
        if not self.lengths_scale:
            return dataset
        base = length_preset(dataset, seed)
        return replace(base, **{k: getattr(base, k) * f for k, f in self.lengths_scale})


CALIBRATION = Variant()


def calibration_configs(steps: int, seeds: int, models: tuple[str, ...] = CAL_MODELS, first_seed: int = 0,
                        variants: tuple[Variant, ...] = (CALIBRATION,)) -> dict[tuple, SimConfig]:
    """Each cell x variant: slime's baseline (GRPO: N groups, wait for all; DAPO: slime's wave refill) and APRIL
    (N' = 64), over ``seeds`` seeds from ``first_seed``. Variants that share their runs (run_key) share configs."""
    configs = {}
    for variant in variants:
        for model, algo, lengths, seed in itertools.product(models, CAL_ALGORITHMS, PAPER_LENGTH_PRESETS,
                                                            range(first_seed, first_seed + seeds)):
            for mode in ("baseline", "april-batch"):
                key = ("cal", variant.run_key(), model, algo, lengths, mode, seed)
                if key not in configs:
                    configs[key] = paper_config(variant.cluster(model), variant.lengths(lengths, seed), algo, mode,
                                                steps, seed, april_loop=variant.april_loop)
    return configs


def throughput(run: dict, metric: str, window_extra_s: float = 0.0, warmup: int = WARMUP_STEPS) -> float:
    """A run's throughput over its steps after the warm-up: the paper's (generated tokens / iteration time, the
    mean over iterations) or slime's trained tokens / rollout time."""
    steps = run["steps"][warmup:]
    if metric == "generated":
        return float(np.mean([s["tokens"] / (s["rollout_s"] + window_extra_s) for s in steps]))
    return sum(s["trained"] for s in steps) / sum(s["rollout_s"] + window_extra_s for s in steps)


def cell_gains(out: dict[tuple, dict], variant: Variant, model: str, algo: str, lengths: str, seeds: range,
               metric: str | None = None) -> list[float]:
    metric = metric or variant.metric
    return [throughput(out[("cal", variant.run_key(), model, algo, lengths, "april-batch", s)], metric,
                       variant.window_extra_s)
            / throughput(out[("cal", variant.run_key(), model, algo, lengths, "baseline", s)], metric,
                         variant.window_extra_s) - 1 for s in seeds]


def _spread(values: list[float]) -> str:
    return f"{np.mean(values):+.1%}+-{(max(values) - min(values)) / 2:.1%}"


def calibration_cells(models: tuple[str, ...] = CAL_MODELS) -> list[tuple[str, str, str]]:
    return list(itertools.product(models, CAL_ALGORITHMS, PAPER_LENGTH_PRESETS))


def print_calibration(out: dict[tuple, dict], steps: int, seeds: range,
                      models: tuple[str, ...] = CAL_MODELS) -> list[dict[str, object]]:
    v = CALIBRATION
    print(f"1. Calibration against the APRIL paper's Table 1: {v.gpu}, 4 engines x TP 2, mem 0.6, 32 x 8, N' = 64, "
          f"16K cap, {steps} steps (summary over steps {WARMUP_STEPS}..), seeds {seeds.start}..{seeds.stop - 1} "
          f"(mean +- half the spread); baseline = slime without partial rollout (DAPO: its wave refill), APRIL = "
          f"slime's loop with --partial-rollout; gain of the paper's throughput (generated tokens / iteration time, "
          f"mean over iterations); 'trained': the gain in trained tokens/s")
    print(f"{'model':9} {'algo':5} {'dataset':14} {'base gen/s':>10} {'APRIL gen/s':>11} {'simulated':>12} "
          f"{'paper':>7} {'diff':>6} {'match':>5} {'trained':>12} {'eff b/a':>9} {'max eff':>7}")
    rows = []
    for model, algo, lengths in calibration_cells(models):
        runs = {mode: [out[("cal", v.run_key(), model, algo, lengths, mode, s)] for s in seeds]
                for mode in ("baseline", "april-batch")}
        gains = cell_gains(out, v, model, algo, lengths, seeds)
        trained = cell_gains(out, v, model, algo, lengths, seeds, metric="trained")
        g = float(np.mean(gains))
        paper = PAPER_TABLE1[(model, algo, lengths)]
        match = abs(g - paper) <= MATCH_POINTS
        top = max(st["efficiency"] for mode in runs for r in runs[mode] for st in r["steps"])
        eff = {mode: float(np.mean([r["summary"]["efficiency"] for r in runs[mode]])) for mode in runs}
        rate = {mode: float(np.mean([throughput(r, "generated") for r in runs[mode]])) for mode in runs}
        rows.append({"model": model, "algorithm": algo, "dataset": lengths, "gain": g, "gains": gains,
                     "trained_gains": trained, "paper": paper, "match": match, "max_step_efficiency": top,
                     "base": [r["summary"] for r in runs["baseline"]],
                     "april": [r["summary"] for r in runs["april-batch"]]})
        print(f"{model:9} {algo:5} {lengths:14} {rate['baseline']:10,.0f} {rate['april-batch']:11,.0f} "
              f"{_spread(gains):>12} {paper:+7.1%} {100 * (g - paper):+6.1f} {'yes' if match else 'no':>5} "
              f"{_spread(trained):>12} {eff['baseline']:4.2f}/{eff['april-batch']:4.2f} {top:7.3f}")
    gains = [r["gain"] for r in rows]
    papers = [r["paper"] for r in rows]
    print(f"mean gain {np.mean(gains):+.1%} (paper: {np.mean(papers):+.1%} over these cells, 'about "
          f"{PAPER_MEAN_GAIN:+.1%}'); cells within +-{100 * MATCH_POINTS:.0f} points of the paper's: "
          f"{sum(r['match'] for r in rows)} of {len(rows)}; highest step efficiency "
          f"{max(r['max_step_efficiency'] for r in rows):.3f}")
    return rows


# The factor table: the calibration as it was, the changes made (cumulative), then one factor at a time on top of
# the calibration. Engine costs and lengths are scaled uniformly over all cells (docs/sim.md gives each reason).
FACTORS: tuple[Variant, ...] = (
    Variant("before: H100, trained tokens, scheduler's APRIL", gpu="h100", april_loop="scheduler", metric="trained"),
    Variant("+ paper's metric (generated tokens / iteration)", gpu="h100", april_loop="scheduler"),
    Variant("+ paper's hardware (MI300X)", april_loop="scheduler"),
    Variant("+ slime's APRIL loop (= the calibration)"),
    Variant("lengths: median x1.6 (longer, more at the cap)", lengths_scale=(("median_tokens", 1.6),)),
    Variant("lengths: incorrect responses x1.8 longer", lengths_scale=(("incorrect_length_factor", 1.8),)),
    Variant("rejection: accuracy concentration / 3", lengths_scale=(("accuracy_concentration", 1 / 3),)),
    Variant("engine: decode per-sequence cost x4", cost_scale=(("decode_per_seq_s", 4.0),)),
    Variant("engine: decode per-KV-token cost x2", cost_scale=(("decode_per_kv_token_s", 2.0),)),
    Variant("engine: fixed step cost x0.5", cost_scale=(("decode_fixed_s", 0.5), ("step_overhead_s", 0.5))),
    Variant("engine: prefill cost x3", cost_scale=(("prefill_per_token_s", 3.0),
                                                   ("prefill_attn_per_token_pair_s", 3.0))),
    Variant("step boundary: abort latency 0.5 -> 0 s", abort_latency_s=0.0),
    Variant("weight sync (4 s) inside the window", window_extra_s=WEIGHT_SYNC_S),
    Variant("metric: total tokens / total time", metric="generated-sum"),
)


def print_factors(out: dict[tuple, dict], steps: int, seeds: range, models: tuple[str, ...] = CAL_MODELS,
                  variants: tuple[Variant, ...] = FACTORS) -> list[dict[str, object]]:
    cells = calibration_cells(models)
    print(f"\n4. Factors: the simulated gain of every Table 1 cell under each version of the model ({steps} steps, "
          f"seeds {seeds.start}..{seeds.stop - 1}); rows 2-4 are the changes made, cumulative; the rest change one "
          f"factor of the calibration (row 4)")
    short = {"dapo-math-17k": "dapo", "deepscaler": "dscl", "deepmath-103k": "dmth"}
    heads = [f"{m[-2:]} {a[0]} {short.get(d, d[:4])}" for m, a, d in cells]
    print(f"{'variant':50} " + " ".join(f"{h:>11}" for h in heads) + f" {'mean':>6} {'in+-5':>5}")
    print(f"{'paper (Table 1)':50} " + " ".join(f"{PAPER_TABLE1[c]:+11.1%}" for c in cells)
          + f" {np.mean([PAPER_TABLE1[c] for c in cells]):+6.1%}")
    rows = []
    for v in variants:
        metric = "generated" if v.metric == "generated-sum" else v.metric
        gains = []
        for model, algo, lengths in cells:
            if v.metric == "generated-sum":
                g = [out[("cal", v.run_key(), model, algo, lengths, "april-batch", s)]["summary"]["tokens_per_s"]
                     / out[("cal", v.run_key(), model, algo, lengths, "baseline", s)]["summary"]["tokens_per_s"] - 1
                     for s in seeds]
            else:
                g = cell_gains(out, v, model, algo, lengths, seeds, metric)
            gains.append(float(np.mean(g)))
        within = sum(abs(g - PAPER_TABLE1[c]) <= MATCH_POINTS for g, c in zip(gains, cells))
        rows.append({"variant": v.label, "gains": dict(zip(["/".join(c) for c in cells], gains)), "within": within})
        print(f"{v.label:50} " + " ".join(f"{g:+11.1%}" for g in gains) + f" {np.mean(gains):+6.1%} {within:5d}")
    return rows


def convergence_configs(steps: int, seeds: int) -> dict[tuple, SimConfig]:
    return {("conv", mode, seed): paper_config("h100-qwen3-8b", "dapo-math-17k", "grpo", mode, steps, seed)
            for mode in ("baseline", "april-batch") for seed in range(seeds)}


def print_convergence(out: dict[tuple, dict], steps: int, seeds: int, warmup: int = 2) -> dict[str, object]:
    print(f"\n2. Convergence: h100-qwen3-8b, dapo-math-17k, GRPO, {seeds} seeds x {steps} steps; cumulative figures "
          f"over steps {warmup}..k (mean and spread max - min over seeds)")
    checkpoints = [k for k in (4, 6, 8, 10, 12, 16, 24, 32, 48) if warmup < k <= steps]
    print(f"{'figure':28} " + " ".join(f"{'k=' + str(k):>15}" for k in checkpoints))
    table = {}

    def cumulative(mode: str, k: int, key: str) -> list[float]:
        values = []
        for seed in range(seeds):
            st = out[("conv", mode, seed)]["steps"][warmup:k]
            tokens = sum(s["tokens"] for s in st)
            seconds = sum(s["rollout_s"] for s in st)
            values.append({"tok/s": tokens / seconds, "eff": sum(s["least_s"] for s in st) / seconds,
                           "ceil": sum(s["ceiling_s"] for s in st) / seconds}[key])
        return values

    for mode, key in (("baseline", "tok/s"), ("april-batch", "tok/s"), ("baseline", "eff"), ("april-batch", "eff"),
                      ("april-batch", "ceil")):
        cells = []
        for k in checkpoints:
            v = cumulative(mode, k, key)
            cells.append(f"{np.mean(v):,.0f}+-{(max(v) - min(v)) / 2:,.0f}" if key == "tok/s"
                         else f"{np.mean(v):.3f}+-{(max(v) - min(v)) / 2:.3f}")
            table[f"{mode} {key} k={k}"] = v
        print(f"{mode + ' ' + key:28} " + " ".join(f"{c:>15}" for c in cells))
    cells = []
    for k in checkpoints:
        g = [a / b - 1 for a, b in zip(cumulative("april-batch", k, "tok/s"), cumulative("baseline", k, "tok/s"))]
        cells.append(f"{np.mean(g):+.1%}+-{(max(g) - min(g)) / 2:.1%}")
        table[f"gain k={k}"] = g
    print(f"{'april-batch gain':28} " + " ".join(f"{c:>15}" for c in cells))
    for mode in ("april-batch",):
        stale = [max(s["stale"] for s in out[("conv", mode, seed)]["steps"]) for seed in range(seeds)]
        first = [next(i for i, s in enumerate(out[("conv", mode, seed)]["steps"]) if s["stale"] == most)
                 for seed, most in enumerate(stale)]
        print(f"{mode}: largest staleness over {steps} steps per seed {stale} (first reached at step {first})")
        table[f"{mode} max staleness"] = stale
    return table


BOUNDARY_MODES = (("april-batch", "abort"), ("april-adaptive", "abort"), ("april-batch", "carry"),
                  ("april-adaptive", "carry"))


def efficiency_cells(algorithms: tuple[str, ...], datasets: tuple[str, ...],
                     gpus: tuple[str, ...] = ("h100", "h200")) -> list[tuple[str, str, str, str]]:
    return list(itertools.product(gpus, ("qwen3-4b", "qwen3-8b"), algorithms, datasets))


def efficiency_configs(steps: int, cells: list[tuple[str, str, str, str]]) -> dict[tuple, SimConfig]:
    """Each (GPU, model, algorithm, dataset) cell: the baseline and each APRIL mode with each step boundary,
    colocated as the APRIL scripts run (carry copies its KV to host and back; abort has none to keep)."""
    configs = {}
    for gpu, model, algo, lengths in cells:
        for mode, boundary in (("baseline", "abort"), *BOUNDARY_MODES):
            config = paper_config(f"{gpu}-{model}", lengths, algo, mode, steps)
            configs[("eff", gpu, model, algo, lengths, mode, boundary)] = replace(
                config, step_boundary=boundary, colocate=True)
    return configs


def _efficiency_run(out: dict[tuple, dict], gpu: str, model: str, algo: str, lengths: str, mode: str,
                    boundary: str) -> dict[str, float]:
    return out[("eff", gpu, model, algo, lengths, mode, boundary)]["summary"]


def print_efficiency(out: dict[tuple, dict], steps: int,
                     cells: list[tuple[str, str, str, str]]) -> list[dict[str, object]]:
    print(f"\n3. Efficiency of the abort and carry step boundaries, paper-faithful colocated engines, {steps} steps "
          f"(summary over steps 2..): eff = against the headline bound (best schedule of the same work, no "
          f"re-prefill), ceil = against the ceiling (with the re-prefill)")
    print(f"{'preset':16} {'algo':5} {'dataset':14} {'base':>5} {'abort batch':>11} {'abort adapt':>11} "
          f"{'carry batch':>11} {'carry adapt':>11} {'kvcopy':>6} {'abort':>6} {'carry':>6}")
    rows = []
    for gpu, model, algo, lengths in cells:
        row: dict[str, object] = {"preset": f"{gpu}-{model}", "algorithm": algo, "dataset": lengths,
                                  "baseline": _efficiency_run(out, gpu, model, algo, lengths, "baseline", "abort")}
        for mode, boundary in BOUNDARY_MODES:
            row[f"{boundary} {mode}"] = _efficiency_run(out, gpu, model, algo, lengths, mode, boundary)
        runs = [row[f"{b} {m}"] for m, b in BOUNDARY_MODES]  # type: ignore[index]
        row["abort best"] = max(runs[0]["efficiency"], runs[1]["efficiency"])
        row["carry best"] = max(runs[2]["efficiency"], runs[3]["efficiency"])
        rows.append(row)
        print(f"{gpu + '-' + model:16} {algo:5} {lengths:14} {row['baseline']['efficiency']:5.2f} "  # type: ignore[index]
              + " ".join(f"{c['efficiency']:5.2f}/{c['ceiling_efficiency']:<5.2f}" for c in runs)
              + f" {runs[3]['kv_copy_time_fraction']:6.3f}"
              f" {'met' if row['abort best'] >= TARGET_ABORT else 'MISSED':>6}"
              f" {'met' if row['carry best'] >= TARGET_CARRY else 'MISSED':>6}")
    for gpu in sorted({gpu for gpu, *_ in cells}):
        mine = [r for r in rows if str(r["preset"]).startswith(gpu)]
        for name in ("baseline", *(f"{b} {m}" for m, b in BOUNDARY_MODES)):
            eff = [r[name]["efficiency"] for r in mine]  # type: ignore[index]
            ceil = [r[name]["ceiling_efficiency"] for r in mine]  # type: ignore[index]
            rep = [r[name]["re_prefill_time_fraction"] for r in mine]  # type: ignore[index]
            copy = [r[name]["kv_copy_time_fraction"] for r in mine]  # type: ignore[index]
            idle = [r[name]["idle_time_fraction"] for r in mine]  # type: ignore[index]
            under = [r[name]["underfill_fraction"] for r in mine]  # type: ignore[index]
            print(f"{gpu} {name}: efficiency {min(eff):.2f}-{max(eff):.2f} (mean {np.mean(eff):.2f}), ceiling "
                  f"{min(ceil):.2f}-{max(ceil):.2f}, re-prefill {min(rep):.3f}-{max(rep):.3f}, "
                  f"KV copy {min(copy):.3f}-{max(copy):.3f}, idle {min(idle):.3f}-{max(idle):.3f}, underfill "
                  f"{min(under):.3f}-{max(under):.3f} of rollout time")
    for boundary, target in (("abort", TARGET_ABORT), ("carry", TARGET_CARRY)):
        missed = [f"{r['preset']} {r['algorithm']} {r['dataset']}" for r in rows if r[f"{boundary} best"] < target]
        print(f"target {boundary} >= {target} of the headline bound on every preset (best APRIL mode per cell): "
              + ("met on all" if not missed else f"MISSED on {len(missed)} of {len(rows)}"))
    return rows


AGENTIC_CLUSTER = "h100-qwen3-8b"


def agentic_runs() -> tuple[str, ...]:
    """The rows of the agentic table: every mode, then every strategy (run in april-batch)."""
    return (*MODES, *(f"strategy {name}" for name in STRATEGIES))


def agentic_configs(steps: int, presets: tuple[str, ...] = tuple(TURN_PRESETS)) -> dict[tuple, SimConfig]:
    """Each agentic preset in every mode and with every strategy on the paper-faithful engines (GRPO; each strategy
    sets its own step boundary and scheduler settings, N' = 64 stays as given)."""
    configs = {}
    for preset in presets:
        for label in agentic_runs():
            if label.startswith("strategy "):
                config = replace(paper_config(AGENTIC_CLUSTER, preset, "grpo", "april-batch", steps),
                                 strategy=label.split(" ", 1)[1])
            else:
                config = paper_config(AGENTIC_CLUSTER, preset, "grpo", label, steps)
            configs[("agentic", preset, label)] = config
    return configs


def print_agentic(out: dict[tuple, dict], steps: int,
                  presets: tuple[str, ...] = tuple(TURN_PRESETS)) -> list[dict[str, object]]:
    print(f"\n5. Agentic rollouts: {AGENTIC_CLUSTER}, 4 engines x TP 2, mem 0.6, GRPO, 32 x 8, N' = 64, 16K cap on "
          f"model tokens, {steps} steps (summary over steps {WARMUP_STEPS}..); strategies run in april-batch; useful = "
          f"tok/s less thrown-away tokens; eff = against the never-idle bound (the "
          f"step's decode, prompt and observation prefill on engines that never idle while tools run), ceil = with "
          f"the re-prefill")
    print(f"{'preset':13} {'mode':25} {'tok/s':>7} {'gain':>7} {'useful':>7} {'bound':>7} {'eff':>5} {'ceil':>5} {'idle':>5} "
          f"{'reprefill':>9} {'recompute':>9} {'envpre':>6} {'tools/step':>10} {'step s':>7}")
    rows = []
    for preset in presets:
        base = out[("agentic", preset, "baseline")]["summary"]["tokens_per_s"]
        for mode in agentic_runs():
            s = out[("agentic", preset, mode)]["summary"]
            rows.append({"preset": preset, "mode": mode, "summary": s})
            print(f"{preset:13} {mode:25} {s['tokens_per_s']:7,.0f} {s['tokens_per_s'] / base - 1:+7.1%} "
                  f"{s['useful_tokens_per_s']:7,.0f} "
                  f"{s['bound_tokens_per_s']:7,.0f} {s['efficiency']:5.2f} {s['ceiling_efficiency']:5.2f} "
                  f"{s['idle_time_fraction']:5.2f} {s['re_prefill_time_fraction']:9.3f} "
                  f"{s['recompute_time_fraction']:9.3f} {s['env_prefill_time_fraction']:6.3f} "
                  f"{s['tool_calls_per_step']:10,.0f} {s['rollout_s']:7.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per calibration / efficiency run")
    parser.add_argument("--convergence-steps", type=int, default=16)
    parser.add_argument("--seeds", type=int, default=3, help="seeds per calibration cell and convergence run")
    parser.add_argument("--first-seed", type=int, default=0, help="calibration: the first seed")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (processes)")
    parser.add_argument("--only", choices=("calibration", "convergence", "efficiency", "factors", "agentic"),
                        default=None)
    parser.add_argument("--json", default=None, help="also write the figures as JSON here")
    parser.add_argument("--models", type=lambda t: tuple(t.split(",")), default=CAL_MODELS,
                        help="calibration section: comma-separated models")
    parser.add_argument("--gpus", type=lambda t: tuple(t.split(",")), default=("h100", "h200"),
                        help="efficiency section: comma-separated GPUs")
    parser.add_argument("--algorithms", type=lambda t: tuple(t.split(",")), default=("grpo", "dapo"),
                        help="efficiency section: comma-separated algorithms")
    parser.add_argument("--datasets", type=lambda t: tuple(t.split(",")), default=PAPER_LENGTH_PRESETS,
                        help="efficiency section: comma-separated length presets")
    args = parser.parse_args()
    started = time.perf_counter()
    out: dict[str, object] = {}
    runs: dict[tuple, dict] = {}
    if args.only in (None, "calibration"):
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        runs.update(run_all(calibration_configs(args.steps, args.seeds, args.models, args.first_seed), args.jobs))
        out["calibration"] = print_calibration(runs, args.steps, seeds, args.models)
        out["calibration_runs"] = [[[str(k) for k in key], run["summary"]] for key, run in runs.items()
                                   if key[0] == "cal"]
    if args.only in (None, "convergence"):
        conv = run_all(convergence_configs(args.convergence_steps, args.seeds), args.jobs)
        out["convergence"] = print_convergence(conv, args.convergence_steps, args.seeds)
    if args.only in (None, "efficiency"):
        cells = efficiency_cells(args.algorithms, args.datasets, args.gpus)
        runs.update(run_all(efficiency_configs(args.steps, cells), args.jobs))
        out["efficiency"] = print_efficiency(runs, args.steps, cells)
    if args.only in (None, "factors"):
        seeds = range(args.first_seed, args.first_seed + args.seeds)
        configs = calibration_configs(args.steps, args.seeds, args.models, args.first_seed, FACTORS)
        runs.update(run_all({k: c for k, c in configs.items() if k not in runs}, args.jobs))
        out["factors"] = print_factors(runs, args.steps, seeds, args.models)
    if args.only in (None, "agentic"):
        runs.update(run_all(agentic_configs(args.steps), args.jobs))
        out["agentic"] = print_agentic(runs, args.steps)
    print(f"\n({time.perf_counter() - started:.0f} s of wall time)")
    if args.json:
        atomic_write_json(args.json, out, indent=1)


def test_bench_paper_step(benchmark):
    """Wall seconds to simulate one APRIL step of the paper configuration (512 samples up to 16K tokens)."""
    config = paper_config("h100-qwen3-8b", "dapo-math-17k", "grpo", "april-batch", steps=1, warmup_steps=0)
    result = benchmark.pedantic(simulate, args=(config,), rounds=2, iterations=1)
    assert result.steps[0].generated_tokens > 1_000_000


if __name__ == "__main__":
    main()
