"""Per-step overhead of the Ray path (april_ext.cluster) against the single process, on the same work.

    RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 python bench/bench_ray.py [--steps 8] [--ranks 1] [--engines 1]

The counting task in the baseline mode with one seed: both runs train on the same scheduler batches
(tests/test_ray.py shows it), so their step times differ only by the path: in one process the trainer and the
embedded engine are objects of the run; on Ray the trainer is an actor (batch through the object store, calls
with ray.get), the engine a server behind sglang-router (HTTP streams, aborts and weight pushes to every
worker). The two runs step in turn (one step of each, then the next), so both see the same machine load.
Reported per part of a step (mean over the steps after the first), plus the time to start and stop each run. The Ray run starts a local cluster of its own, as `april-ext train --ray` does.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

from april_ext.training import TrainConfig, TrainingRun

WORK = dict(counting_median=3.0, counting_sigma=0.8, counting_max_count=12, counting_symbols=2, hidden_size=32,
            num_layers=2, rollout_batch_size=4, n_samples_per_prompt=4, max_num_seqs=64, num_blocks=256,
            lr=0.003, progress=False, plots=False, partial_rollout=False, num_threads=1)
PARTS = (("step", "time/step_s"), ("rollout", "rollout/time_to_done_s"), ("train", "time/train_s"),
         ("weight sync", "time/weight_sync_s"))


async def measure(configs: dict[str, TrainConfig]) -> dict[str, dict[str, float]]:
    """Opens each run (timed), steps them in turn (one step of each, then the next: both see the same machine
    load), then closes each (timed)."""
    runs, out = {}, {}
    for name, config in configs.items():
        start = time.perf_counter()
        runs[name] = await TrainingRun(config).__aenter__()
        out[name] = {"start": time.perf_counter() - start}
    while not all(run.done for run in runs.values()):
        for run in runs.values():
            if not run.done:
                await run.step()
    for name, run in runs.items():
        start = time.perf_counter()
        await run.__aexit__(None, None, None)
        rows = run.history[1:]
        out[name].update({"stop": time.perf_counter() - start,
                          **{part: statistics.mean(r[key] for r in rows) for part, key in PARTS},
                          "reward": statistics.mean(r["rollout/reward_mean"] for r in run.history)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=1, help="trainer ranks of the Ray run")
    parser.add_argument("--engines", type=int, default=1, help="engines of the Ray run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = TrainConfig(**WORK, num_steps=args.steps, output_dir=os.path.join(tmp, "single"))
        ray = base.replace(output_dir=os.path.join(tmp, "ray"), ray=True, actor_num_gpus_per_node=args.ranks,
                           rollout_num_gpus=args.engines, ray_num_cpus_per_actor=0.25, ray_timeout_s=120.0)
        results = asyncio.run(measure({"single process": base,
                                       f"Ray ({args.ranks} rank, {args.engines} engine)": ray}))
    names = list(results)
    print(f"| {args.steps} steps (per step: mean of steps 2-{args.steps}) | " + " | ".join(names)
          + " | Ray - single | Ray / single |")
    print("|---|" + "---|" * (len(names) + 2))
    for label in ("step", "rollout", "train", "weight sync", "start", "stop", "reward"):
        a, b = (results[n][label] for n in names)
        unit = "" if label == "reward" else " s"
        ratio = f"{b / a:.2f}" if a >= 0.001 else "-"
        print(f"| {label}{' (mean)' if label == 'reward' else ''} | {a:.3f}{unit} | {b:.3f}{unit} | "
              f"{b - a:+.3f}{unit} | {ratio} |")


if __name__ == "__main__":
    main()
