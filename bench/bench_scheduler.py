"""Scheduler microbenchmarks, each measured interleaved with the minimal pure-Python bookkeeping
(python_baseline_scheduler.py: a dict of lists, no validation) in the same process.

Run: python -m pytest bench/bench_scheduler.py -s -q
Each round times the two implementations call by call in alternation (april, python, april, ...), so
both see the same machine load; a round's figure is the median call. Printed at the end (and in
extra_info with --benchmark-json=out.json): the median over rounds of the absolute cost (ns per event,
per call, ms per step boundary), of the per-round ratio python / april, and their spread (min-max over
rounds). The pytest-benchmark table times whole rounds (both implementations).
"""

from __future__ import annotations

import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from python_baseline_scheduler import PythonScheduler  # noqa: E402

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig  # noqa: E402

GROUPS, N = 64, 8  # 512 samples in flight (N' = 64 groups x 8)
PREFILL = 2048  # tokens each sample already has: long responses
PROMPT = list(range(100, 164))
ROUNDS = 7
IMPLS = ("april", "python")
RESULTS: dict[str, str] = {}

# A case of one implementation: setup() -> state (not timed), then op(state) (timed).
Case = tuple[Callable[[], Any], Callable[[Any], None]]


def _interleaved(benchmark, cases: dict[str, Case], per_round: int, rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Per implementation, the median op time (ns) of each round; ops of the implementations alternate."""
    medians: dict[str, list[float]] = {name: [] for name in cases}

    def one_round() -> None:
        times: dict[str, list[int]] = {name: [] for name in cases}
        for _ in range(per_round):
            for name, (setup, op) in cases.items():
                state = setup()
                start = time.perf_counter_ns()
                op(state)
                times[name].append(time.perf_counter_ns() - start)
        for name, values in times.items():
            medians[name].append(statistics.median(values))

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    return medians


def _report(benchmark, key: str, medians: dict[str, list[float]], unit: str, scale: float) -> None:
    """Absolute figures (median and min-max over rounds, in ``unit`` = ns / scale) and the python / april ratio."""
    if benchmark.disabled:  # --benchmark-disable: one plain round, no timings to report
        return
    parts = []
    for name, values in medians.items():
        med = statistics.median(values) / scale
        parts.append(f"{name} {med:.2f} {unit} ({min(values) / scale:.2f}-{max(values) / scale:.2f})")
        benchmark.extra_info[f"{name}_{unit}"] = med
    ratios = [p / a for a, p in zip(medians["april"], medians["python"])]
    benchmark.extra_info["ratio_median"] = statistics.median(ratios)
    benchmark.extra_info["ratio_min"], benchmark.extra_info["ratio_max"] = min(ratios), max(ratios)
    parts.append(f"ratio {statistics.median(ratios):.1f}x ({min(ratios):.1f}-{max(ratios):.1f})")
    RESULTS[key] = ", ".join(parts)


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


@pytest.mark.parametrize("chunk", [1, 16])
def test_token_events(benchmark, chunk):
    """on_tokens_batch with one chunk for each of 512 running samples (chunk=1: one decode step)."""
    per_round = 64 if chunk == 1 else 16
    max_len = PREFILL + (ROUNDS * per_round + 1) * chunk
    args = _events(chunk)
    cases = {}
    for impl in IMPLS:
        sched = _scheduler(impl, max_len)
        _prefill(sched)
        cases[impl] = (lambda: None, lambda _, call=sched.on_tokens_batch: call(*args))
    benchmark.group = f"token events, chunk={chunk}: rounds of {per_round} calls per implementation"
    medians = _interleaved(benchmark, cases, per_round)
    events = GROUPS * N
    _report(benchmark, f"on_tokens_batch, 512 events x {chunk} token(s), per event", medians, "ns",
            float(events * chunk if chunk > 1 else events))
    _report(benchmark, f"on_tokens_batch, 512 events x {chunk} token(s), per call", medians, "us", 1e3)


def _running(impl: str):
    """512 samples dispatched, each with 64 tokens streamed."""
    sched = _scheduler(impl, PREFILL)
    sched.on_tokens_batch(*_events(64, seed=2))
    return sched


def test_finish_events(benchmark):
    """on_finish_batch: 512 running samples finish with stop in one call (64 groups complete)."""
    ids = np.arange(GROUPS * N, dtype=np.int64)
    reasons = np.zeros(ids.size, np.uint8)
    cases = {impl: (lambda impl=impl: _running(impl), lambda sched: sched.on_finish_batch(ids, reasons))
             for impl in IMPLS}
    benchmark.group = "finish events: 512 stop finishes in one call"
    medians = _interleaved(benchmark, cases, per_round=3)
    _report(benchmark, "on_finish_batch, 512 finishes, per event", medians, "ns", float(ids.size))


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


def test_step_boundary(benchmark):
    """Abort 256 running samples (kept as partials), take the 32 x 8 batch, begin the next step, dispatch resumes."""
    cases = {impl: (lambda impl=impl: _step_ready(impl)[0][0], _step_boundary) for impl in IMPLS}
    benchmark.group = "step boundary: abort + take_batch + dispatch, N=32x8, N'=64"
    medians = _interleaved(benchmark, cases, per_round=1, rounds=5)
    _report(benchmark, "step boundary (abort 256 + take_batch + begin_step + dispatch)", medians, "ms", 1e6)


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
        benchmark(lambda: sum(len(tokens) for tokens, _, _ in sched.samples.values()))
        per_token = traced / tokens  # Python objects: list slots, int and float objects
    benchmark.group = "buffered memory accounting"
    benchmark.extra_info["bytes_per_buffered_token"] = per_token
    RESULTS[f"bytes per buffered token, {impl}"] = f"{per_token:.1f}"


def teardown_module(module) -> None:
    if RESULTS:
        print(f"\nscheduler benchmark figures (median over rounds, min-max in parentheses):")
        for key, value in RESULTS.items():
            print(f"  {key}: {value}")
