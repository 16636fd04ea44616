"""Asynchronous modes side by side on the simulator (issue 36): one table per preset, printed by one command.

    python bench/bench_sim_async.py [--presets paper-8gpu,verl-7b-dapo] [--scale 8] [--steps 8] [--warmup 2]
        [--no-sweep] [--no-agentic] [--modes sync,stale-april] [--cpu-topology RUNS_JSON]

Each preset runs every mode of april_ext.sim.pipeline.ASYNC_MODES on the same work (the same seed, prompts and
length model) through the real scheduler and rollout loop over the simulated engine, each rollout and training
step placed on one virtual timeline. Per mode: the steady step time (after the warm-up batches) and the whole
run's time against the colocated synchronous baseline (its inverse is the throughput ratio: every mode trains the
same number of samples per step), trained samples and tokens per second, the trained tokens' off-policy share and
version lag, and the trainer idle, engine idle and weight-update seconds per step. Then the partial-rollout delta
inside async (stale-april against stale), verl's published ratio beside the simulator's for each verl mode, the
targets, a sweep of the trainer:rollout split (verl preset) and the agentic presets (paper preset's GPUs).

verl-7b-dapo runs at 1/--scale of its 128 GPUs and 512 prompts (PipelineConfig.scaled: the same work per GPU).

``--cpu-topology``: the rows measured on the CPU Ray topology beside them, from the runs.json of
``bench/bench_async.py --extra "--ray ..."`` (docs/async.md, "At scale"): the same figures, medians over its seeds,
each run's whole wall-clock against its synchronous baseline's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace

from april_ext.sim.pipeline import ASYNC_MODES, PIPELINE_PRESETS, VERL_FIGURES, PipelineConfig, PipelineResult, \
    simulate_mode

TARGET_ASYNC = 2.35
"""verl's best (staleness 0.5 with partial rollout, 128 GPUs): the issue's target for asynchronous APRIL."""
TOLERANCE = 0.2
"""The simulator's ratio for each verl mode within +-20% of verl's figure."""


def _row(name: str, r: PipelineResult, base: PipelineResult) -> str:
    s, mode = r.summary, r.mode
    split = f"{r.config.gpus}" if mode.colocated else f"{r.config.rollout_gpus}:{r.config.trainer_gpus(mode)}"
    ratio = base.summary["step_s"] / s["step_s"]
    return (f"{name:<14} {split:>6} {s['step_s']:8.1f} {ratio:6.2f}x {s['samples_per_s']:8.2f} {s['tokens_per_s']:9,.0f} "
            f"{s['rollout_s']:8.1f} {s['train_s']:7.1f} {s['offpolicy_token_share']:6.2f} {s['version_lag_mean']:5.2f}"
            f"/{s['version_lag_max']:<2.0f} {s['multi_version_frac']:5.2f} {s['trainer_idle_s']:8.1f} "
            f"{s['engine_idle_s']:8.1f} {s['weight_update_s']:7.2f}")


HEADER = (f"{'mode':<14} {'GPUs':>6} {'step s':>8} {'vs sync':>7} {'sample/s':>8} {'tok/s':>9} {'rollout':>8} "
          f"{'train':>7} {'offpol':>6} {'lag mean/max':>8} {'multi':>5} {'tr idle':>8} {'eng idle':>8} {'update':>7}")


def run_table(config: PipelineConfig, modes: list[str]) -> dict[str, PipelineResult]:
    results: dict[str, PipelineResult] = {}
    for name in modes:
        results[name] = simulate_mode(config, name)
    base = results["sync"]
    print(HEADER)
    for name, r in results.items():
        print(_row(name, r, base), flush=True)
    return results


def describe(config: PipelineConfig) -> str:
    t = config.trainer_of(ASYNC_MODES["sync"])
    a = config.trainer_of(ASYNC_MODES["stale"])
    return (f"{config.name}: {config.gpus} x {t.gpu.name}, {t.model.name}, engines TP {config.tensor_parallel}; "
            f"{config.rollout_batch_size} prompts x {config.n_samples_per_prompt}, cap {config.max_response_len}, "
            f"{config.lengths}, {config.algorithm}; {config.steps} batches, the first {config.warmup_steps} left "
            f"out; trainer MFU {t.mfu}, {t.step_overhead_s} s per step, weight update {t.weight_update_s} s, old "
            f"logprobs recomputed: sync {t.recompute_old_logprobs}, async {a.recompute_old_logprobs}; streaming "
            f"parts {config.stream_parts}; trainer waits for its weights to land: {config.trainer_waits}")


def verl_comparison(results: dict[str, PipelineResult], at_verl_shape: bool) -> list[str]:
    """verl's ratio beside the simulator's for each verl mode; the lines of the targets."""
    base = results["sync"].summary["step_s"]
    lines = []
    for name, r in results.items():
        if not r.mode.verl or r.mode.verl not in VERL_FIGURES:
            continue
        figure, source = VERL_FIGURES[r.mode.verl]
        ratio = base / r.summary["step_s"]
        if math.isnan(figure):
            lines.append(f"  {name:<13} verl '{r.mode.verl}': simulator {ratio:.2f}x, verl: {source}")
            continue
        within = abs(ratio / figure - 1) <= TOLERANCE
        shape = "" if at_verl_shape or name == "sync" else " (verl's figure is of its 128-GPU shape)"
        lines.append(f"  {name:<13} verl '{r.mode.verl}': simulator {ratio:.2f}x, verl {figure:.2f}x "
                     f"({ratio / figure - 1:+.0%}): {'within' if within else 'OUTSIDE'} +-20%{shape} [{source}]")
    return lines


CPU_NAMES = {"baseline": "sync", "april": "sync-april", "april_async": "async-april"}
"""bench_async's runs under the simulator's mode names (the CPU topology has no colocated form: every run keeps
the trainer ranks and the servers apart, and the synchronous ones take turns)."""


def cpu_topology_table(path: str) -> list[str]:
    """The CPU Ray topology's rows (medians over seeds), in the simulator's columns where they exist."""
    with open(path, encoding="utf-8") as handle:
        measured = json.load(handle)
    per_seed = measured["per_seed"]
    names = list(next(iter(per_seed.values())))

    def median(name: str, key: str, per_step: bool = False) -> float:
        return statistics.median(run[name][key] / (run[name]["steps"] if per_step else 1) for run in per_seed.values())

    lines = [f"CPU Ray topology, measured ({' '.join(measured.get('extra', []))}; {len(per_seed)} seeds, "
             f"{measured.get('steps')} steps; medians; seconds per step but the wall-clock, the run's whole):",
             f"{'mode':<14} {'wall s':>8} {'vs sync':>7} {'sample/s':>8} {'offpol':>6} {'lag mean':>8} "
             f"{'tr idle':>8} {'eng idle':>8} {'update':>7}"]
    for name in names:
        samples_per_s = statistics.median(run[name]["samples_trained"] / run[name]["wall_clock_s"]
                                          for run in per_seed.values())
        lines.append(f"{CPU_NAMES.get(name, name):<14} {median(name, 'wall_clock_s'):8.1f} "
                     f"{1 / median(name, 'wall_clock_ratio'):6.2f}x {samples_per_s:8.1f} "
                     f"{median(name, 'off_policy_token_ratio'):6.2f} {median(name, 'mean_version_lag'):8.2f} "
                     f"{median(name, 'trainer_idle_s', True):8.3f} {median(name, 'engine_idle_s', True):8.3f} "
                     f"{median(name, 'weight_update_s', True):7.3f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="paper-8gpu,verl-7b-dapo")
    parser.add_argument("--modes", default=",".join(ASYNC_MODES))
    parser.add_argument("--scale", type=int, default=8, help="verl-7b-dapo on 1/scale of its GPUs and prompts")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-agentic", action="store_true")
    parser.add_argument("--cpu-topology", default=None, metavar="RUNS_JSON",
                        help="bench_async.py's runs.json of the CPU Ray topology, printed beside the simulator's")
    args = parser.parse_args()
    started = time.perf_counter()
    modes = args.modes.split(",")
    if "sync" not in modes:
        modes.insert(0, "sync")
    for preset in filter(None, args.presets.split(",")):
        config = replace(PIPELINE_PRESETS[preset], steps=args.steps, warmup_steps=args.warmup)
        verl = preset == "verl-7b-dapo"
        if verl and args.scale > 1:
            config = config.scaled(args.scale)
        print(f"\n== {describe(config)}")
        results = run_table(config, modes)
        if "stale" in results and "stale-april" in results:
            off, on = results["stale"].summary, results["stale-april"].summary
            print(f"partial-rollout delta inside async (stale-april against stale, both d = 1, streaming): "
                  f"{off['step_s'] / on['step_s']:.2f}x the throughput ({off['step_s']:.1f} -> {on['step_s']:.1f} s "
                  f"a step), off-policy share {off['offpolicy_token_share']:.2f} -> {on['offpolicy_token_share']:.2f}, "
                  f"lag {off['version_lag_mean']:.2f} -> {on['version_lag_mean']:.2f}")
        print("verl's published ratios beside the simulator's:")
        for line in verl_comparison(results, verl):
            print(line)
        if verl and "stale-april" in results:
            best = max((n for n in results if ASYNC_MODES[n].partial_rollout and not ASYNC_MODES[n].colocated),
                       key=lambda n: results[n].summary["samples_per_s"])
            base = results["sync"].summary["step_s"]
            for name in dict.fromkeys(("stale-april", best)):
                r = results[name].summary
                ratio = base / r["step_s"]
                print(f"target: asynchronous APRIL ({name}) >= {TARGET_ASYNC}x the colocated synchronous baseline: "
                      f"{'met' if ratio >= TARGET_ASYNC else 'MISSED'}, {ratio:.2f}x at an off-policy token share of "
                      f"{r['offpolicy_token_share']:.2f} (mean lag {r['version_lag_mean']:.2f} versions)")
            loose = replace(config, trainer_waits=False)
            print("sensitivity, the trainer not waiting for its weights to land (verl's trainer goes on after a sync):")
            for name in dict.fromkeys(("stale-april", best)):
                r = simulate_mode(loose, name)
                print(_row(name, r, results["sync"]))
            if not args.no_sweep:
                print(f"split sweep (rollout:trainer GPUs of {config.gpus}), {best}:")
                sweep = {}
                for rollout in range(2, config.gpus, 2):
                    r = simulate_mode(replace(config, rollout_gpus=rollout), best)
                    sweep[rollout] = r
                    print(_row(best, r, results["sync"]), flush=True)
                top = max(sweep, key=lambda k: sweep[k].summary["samples_per_s"])
                print(f"best split: {top}:{config.gpus - top} ({base / sweep[top].summary['step_s']:.2f}x the "
                      f"baseline)")
        if not verl and not args.no_agentic:
            for lengths in ("search-agent", "swe-agent"):
                print(f"agentic {lengths} on {config.name}'s GPUs:")
                run_table(replace(config, lengths=lengths), [m for m in modes if m != "stale-best"])
    if args.cpu_topology is not None:
        print("\n" + "\n".join(cpu_topology_table(args.cpu_topology)))
    print(f"\n({time.perf_counter() - started:.0f} s of wall time)")


if __name__ == "__main__":
    main()
