"""Weight sync of a Ray run: time per GB and the memory it takes, by path.

    RAY_AUTH_MODE=disabled OMP_NUM_THREADS=1 python bench/bench_ray_weight_sync.py [--hidden 1024 --layers 4]
        [--ranks 1 --engines 2 --rounds 3 --bucket-mb 64] [--pipeline 2]

Two runs of the same topology on one local Ray cluster started here (trainer actors, embedded engines behind
the router),
one with weight_sync="broadcast", one with "disk", and three paths timed in turn, round after round, so that
each sees the same machine load:
- "broadcast from rank 0": the run's sync (trainer rank 0 broadcasts its export; the driver posts the HTTP side);
- "broadcast from the driver": the same run, given the export pulled through the driver (the path of Ray
  runs before rank 0 broadcast: every bucket crosses the object store to the driver, which broadcasts it);
- "disk": the other run's sync (rank 0's export pulled through the driver, written to the weight-sync
  directory, loaded by every engine).
Each sync is timed from the call until every engine loaded the weights (best and median of the rounds after
a warm-up). With --pipeline P the trainer is Megatron split into P pipeline stages (P ranks at least), and
"broadcast from rank 0" is each stage's first rank broadcasting its own layers, one weight group per stage
(docs/scaling.md); the driver's path gathers the whole model to rank 0 first. Meanwhile the resident memory (cluster.process_memory.rss_bytes, sampled every 5 ms) of the
driver and of trainer rank 0 is watched: the table shows its largest rise over the value before the sync,
over every round (the warm-up's too: a process's allocator keeps memory freed by one round for the next, so
later rounds show less than the path allocates).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time

from april_ext.cluster.process_memory import rss_bytes
from april_ext.training import TrainConfig, TrainingRun

MIB = 1 << 20


class PeakRss:
    """The largest resident memory of some processes while the block runs, sampled in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.base = {name: rss_bytes(pid) for name, pid in pids.items()}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for name, pid in self.pids.items():
                self.peak[name] = max(self.peak[name], rss_bytes(pid))
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def rise(self) -> dict[str, float]:
        return {name: (self.peak[name] - self.base[name]) / MIB for name in self.pids}


async def timed(run: TrainingRun, pulled: bool) -> tuple[float, dict[str, float]]:
    trainer, engine = run.trainer, run.engine
    pids = {"driver": os.getpid(), "rank 0": trainer.pids[0]}
    with PeakRss(pids) as memory:
        start = time.perf_counter()
        if pulled:  # the export through the driver, sent from there
            await engine.update_weights(list(trainer.export_weights()), trainer.version)
        else:  # the run's sync (RayEngine.update_from_trainer)
            await engine.update_from_trainer(trainer.version)
        seconds = time.perf_counter() - start
    return seconds, memory.rise()


async def measure(args: argparse.Namespace, tmp: str) -> dict[str, list[tuple[float, dict[str, float]]]]:
    work = dict(hidden_size=args.hidden, num_layers=args.layers, num_blocks=64, max_num_seqs=16, progress=False,
                plots=False, num_threads=1, ray=True, ray_num_cpus_per_actor=0.25,
                actor_num_gpus_per_node=max(args.ranks, args.pipeline), rollout_num_gpus=args.engines,
                weight_sync_bucket_mb=args.bucket_mb, weight_sync_timeout_s=300.0, ray_timeout_s=600.0)
    if args.pipeline > 1:
        work.update(trainer="megatron", pipeline_model_parallel_size=args.pipeline)
    runs = {sync: await TrainingRun(TrainConfig(**work, weight_sync=sync, output_dir=os.path.join(tmp, sync)))
            .__aenter__() for sync in ("broadcast", "disk")}
    paths = {"broadcast from rank 0": (runs["broadcast"], False),
             "broadcast from the driver": (runs["broadcast"], True), "disk": (runs["disk"], False)}
    out: dict[str, list[tuple[float, dict[str, float]]]] = {name: [] for name in paths}
    try:
        for _ in range(args.rounds + 1):  # the first round warms up (groups built, files created)
            for name, (run, pulled) in paths.items():
                out[name].append(await timed(run, pulled))
    finally:
        for run in runs.values():
            await run.__aexit__(None, None, None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--pipeline", type=int, default=1, help="Megatron pipeline stages (1: the torch trainer)")
    args = parser.parse_args()
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # One cluster for both runs (a run that started its own would end it on leaving).
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, logging_level="WARNING")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            results = asyncio.run(measure(args, tmp))
            model = os.path.join(tmp, "broadcast", "sglang", "initial_model")
            size = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                       if f.endswith(".safetensors"))
    finally:
        ray.shutdown()
    print(f"model: {size / MIB:.1f} MiB; {max(args.ranks, args.pipeline)} rank(s), {args.pipeline} pipeline "
          f"stage(s), {args.engines} engines, {args.bucket_mb} MiB buckets, {args.rounds} rounds after a warm-up")
    print("| path | best s | median s | s per GB (best) | driver RSS rise MiB (max) | rank 0 RSS rise MiB (max) |")
    print("|---|---|---|---|---|---|")
    for name, rows in results.items():
        times = [t for t, _ in rows[1:]]
        print(f"| {name} | {min(times):.2f} | {statistics.median(times):.2f} | {min(times) / (size / 2**30):.2f} | "
              f"{max(m['driver'] for _, m in rows):.0f} | {max(m['rank 0'] for _, m in rows):.0f} |")


if __name__ == "__main__":
    main()
