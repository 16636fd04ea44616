"""Asynchronous APRIL on one GPU, beside synchronous APRIL: the step bench/gpu_check.sh runs when a device is lent.

    python bench/gpu_async_check.py OUT.json [--device cuda] [--steps 20]

The main job's config (configs/counting_tiny.toml) with the embedded engine and the torch trainer on the device:
synchronous APRIL, then asynchronous APRIL (d = 1: the trainer in a spawned process of its own, on the same
device), one after the other in this process, each timed from building its model to its last step. Writes, per run:
the wall-clock, the first-to-last-step seconds, the mean version lag, the trainer's and the engine's idle seconds,
the weight-update seconds and the last-quarter reward; then the async / sync wall-clock ratio. What it checks
that a CPU cannot: the spawned trainer initialises the device, trains on it and hands its export back (as host
copies) while the engine generates on the same device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

from april_ext.persistence import atomic_write_json
from april_ext.training import TrainConfig, train

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "counting_tiny.toml")


def _run(config: TrainConfig) -> dict[str, Any]:
    start = time.perf_counter()
    result = train(config)
    wall = time.perf_counter() - start
    rows = result.history
    tail = rows[-max(1, len(rows) // 4):]
    return {"wall_clock_s": wall, "steps": len(rows), "steps_s": rows[-1]["time/elapsed_s"],
            "reward_last_quarter": statistics.mean(r["rollout/reward_mean"] for r in tail),
            **{name: sum(r.get(f"async/{name}", 0.0) for r in rows)
               for name in ("trainer_idle_s", "engine_idle_s", "weight_update_s")},
            "mean_version_lag": statistics.mean(r.get("async/version_lag_mean", 0.0) for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    report: dict[str, Any] = {"device": args.device, "steps": args.steps, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, asynchronous in (("april", False), ("april_async", True)):
            config = TrainConfig.from_toml(CONFIG, device=args.device, num_steps=args.steps, async_rollout=asynchronous,
                                           output_dir=os.path.join(tmp, name), save_interval=0, progress=False,
                                           plots=False)
            try:
                report["runs"][name] = _run(config)
            except Exception as err:  # the other run's figures are still wanted
                report["runs"][name] = {"error": f"{type(err).__name__}: {err}"}
            atomic_write_json(args.out, report, indent=2)
            print(name, report["runs"][name], flush=True)
    runs = report["runs"]
    if all("wall_clock_s" in runs[n] for n in ("april", "april_async")):
        report["async_over_sync_wall_clock"] = runs["april_async"]["wall_clock_s"] / runs["april"]["wall_clock_s"]
    atomic_write_json(args.out, report, indent=2)
    if any("error" in run for run in runs.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
