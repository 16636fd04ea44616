"""Scheduler microbenchmarks, each against the pure-Python baseline (python_baseline_scheduler.py).

Run: .venv/bin/python -m pytest bench/bench_scheduler.py --benchmark-columns=mean,stddev,rounds
The per-token-event cost (from the median round) and the bytes per buffered token are in extra_info
(--benchmark-json=out.json) and printed at the end of the run.
"""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from python_baseline_scheduler import PythonScheduler  # noqa: E402

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig  # noqa: E402

GROUPS, N = 64, 8  # 512 samples in flight (N' = 64 groups x 8)
PREFILL = 2048  # tokens each sample already has: long responses
PROMPT = list(range(100, 164))
RESULTS: dict[str, float] = {}


def _scheduler(impl: str, max_len: int) -> Scheduler | PythonScheduler:
    """The ``impl`` ("april" or "python") scheduler with its first GROUPS x N samples dispatched."""
    if impl == "april":
        cfg = SchedulerConfig(rollout_batch_size=32, n_samples_per_prompt=N, over_sampling_batch_size=GROUPS,
                              max_response_len=max_len)
        sched = Scheduler(cfg, ListDataSource([Prompt(id=i, token_ids=PROMPT) for i in range(1000)]))
    else:
        sched = PythonScheduler(32, N, GROUPS, max_len, [PROMPT] * 1000)
    sched.begin_step(0)
    assert len(sched.dispatch()) == GROUPS * N
    return sched


def _events(chunk: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = GROUPS * N
    return (np.arange(n, dtype=np.int64), np.full(n, chunk, np.int64),
            rng.integers(0, 150_000, n * chunk, dtype=np.int32), rng.standard_normal(n * chunk).astype(np.float32),
            np.zeros(n, np.int64))


def _prefill(sched) -> None:
    sched.on_tokens_batch(*_events(PREFILL, seed=1))


@pytest.mark.parametrize("impl", ["april", "python"])
@pytest.mark.parametrize("chunk", [1, 16])
def test_token_events(benchmark, impl, chunk):
    """on_tokens_batch with one chunk for each of 512 running samples (chunk=1: one decode step)."""
    rounds = 256 // chunk * 4
    max_len = PREFILL + (rounds + 1) * chunk + 1  # + the warm-up round
    sched = _scheduler(impl, max_len)
    _prefill(sched)
    args = _events(chunk)
    benchmark.group = f"token events, chunk={chunk}"
    benchmark.pedantic(sched.on_tokens_batch, args=args, rounds=rounds, iterations=1, warmup_rounds=1)
    if benchmark.disabled:  # --benchmark-disable: one plain call, no timings to report
        return
    ns = benchmark.stats.stats.median / (GROUPS * N * chunk) * 1e9
    benchmark.extra_info["ns_per_token_event"] = ns
    RESULTS[f"token event ns, chunk={chunk}, {impl}"] = ns


def _step_ready(impl: str):
    """A step at N = 32 x 8 with N' = 64: 32 groups finished and accepted, 32 still generating."""
    cap = 4096
    sched = _scheduler(impl, cap)
    rng = np.random.default_rng(7)
    n = GROUPS * N
    lens = np.minimum(cap - 1, rng.lognormal(6.5, 1.0, n).astype(np.int64) + 1)
    sched.on_tokens_batch(np.arange(n, dtype=np.int64), lens, rng.integers(0, 150_000, lens.sum(), dtype=np.int32),
                          rng.standard_normal(lens.sum()).astype(np.float32), np.zeros(n, np.int64))
    done = np.arange(32 * N, dtype=np.int64)
    sched.on_finish_batch(done, np.zeros(done.size, np.uint8))
    for g in sched.pop_completed_groups():
        gid = g.group_id if impl == "april" else g
        sched.report_rewards(gid, [float(i % 2) for i in range(N)], True)
    return (sched,), {}


def _step_boundary(sched) -> None:
    aborted = np.asarray(sched.samples_to_abort(), np.int64)
    sched.on_finish_batch(aborted, np.full(aborted.size, 2, np.uint8))
    sched.take_batch()
    sched.begin_step(1)
    sched.dispatch()


@pytest.mark.parametrize("impl", ["april", "python"])
def test_step_boundary(benchmark, impl):
    """Abort 256 running samples (kept as partials), take the 32 x 8 batch, begin the next step, dispatch resumes."""
    benchmark.group = "step boundary: abort + take_batch + dispatch, N=32x8, N'=64"
    benchmark.pedantic(_step_boundary, setup=lambda: _step_ready(impl), rounds=5, iterations=1)
    if benchmark.disabled:
        return
    RESULTS[f"step boundary ms, {impl}"] = benchmark.stats.stats.median * 1e3


@pytest.mark.parametrize("impl", ["april", "python"])
def test_buffered_memory(benchmark, impl):
    """Bytes per buffered token (tokens + logprobs + versions) of 512 aborted partial responses."""
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    sched = _scheduler(impl, PREFILL + 1)
    _prefill(sched)
    ids = np.arange(GROUPS * N, dtype=np.int64)
    sched.on_finish_batch(ids, np.full(ids.size, 2, np.uint8))
    traced = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    tokens = GROUPS * N * PREFILL
    if impl == "april":
        usage = benchmark(sched.buffered_memory)
        assert usage["tokens"] == tokens
        per_token = usage["bytes_per_token"]
        assert per_token <= 12
    else:
        benchmark(lambda: sum(len(s.tokens) for s in sched.samples.values()))
        per_token = traced / tokens  # Python objects: list slots, int and float objects
    benchmark.group = "buffered memory accounting"
    benchmark.extra_info["bytes_per_buffered_token"] = per_token
    RESULTS[f"bytes per buffered token, {impl}"] = per_token


def teardown_module(module) -> None:
    if RESULTS:
        print("\nscheduler benchmark figures:")
        for key, value in RESULTS.items():
            print(f"  {key}: {value:.2f}")
        for chunk in (1, 16):
            a, p = RESULTS.get(f"token event ns, chunk={chunk}, april"), RESULTS.get(f"token event ns, chunk={chunk}, python")
            if a and p:
                print(f"  token events chunk={chunk}: april is {p / a:.1f}x the Python baseline")
        a, p = RESULTS.get("step boundary ms, april"), RESULTS.get("step boundary ms, python")
        if a and p:
            print(f"  step boundary: april is {p / a:.1f}x the Python baseline")
