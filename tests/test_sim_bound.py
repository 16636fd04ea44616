"""The simulator's bounds: the least time of a step's work on its engines (CostModel.least_busy_time) by hand,
no mode (either step boundary) above it in any step of any preset, the ceiling with re-prefill, abort latency
and weight-sync time."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import replace

import numpy as np
import pytest

from april_ext.protocol import SamplingParams
from april_ext.sim import (
    CLUSTER_PRESETS,
    ClusterConfig,
    CostModel,
    SampleDraw,
    SimulatedEngine,
)
from april_ext.sim.lengths import PAPER_LENGTH_PRESETS
from april_ext.sim.metrics import full_occupancy_bound
from april_ext.sim.runner import MODES, SimConfig, simulate

COST = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.5, decode_per_kv_token_s=0.01, prefill_per_token_s=0.1,
                 kv_capacity_tokens=100, max_num_seqs=4)


class FixedLengths:
    """Every sample of every prompt has the same length."""

    def __init__(self, length: int) -> None:
        self.length = length

    def draw(self, prompt_key: int, ordinal: int, version: int) -> SampleDraw:
        return SampleDraw(self.length, True)

    def natural_lengths(self, version: int, n: int = 20000) -> np.ndarray:
        return np.full(8, self.length, np.int64)


def test_least_busy_time_by_hand():
    # 40 tokens reading 1,000 KV tokens: at least max(40 / 4, 1000 / 100) = 10 iterations of 1 s, plus
    # 0.5 s per token and 0.01 s per KV token read, plus 3 s of prefill.
    assert COST.least_busy_time(40, 1000, 3.0) == pytest.approx(10 + 20 + 10 + 3)
    # The KV capacity binds: 3,000 KV tokens need 30 iterations whatever the batch.
    assert COST.least_busy_time(40, 3000, 0.0) == pytest.approx(30 + 20 + 30)
    mixed = replace(COST, mixed_chunk=True, step_overhead_s=0.25)
    # Memory side: 10 x 0.75 + 10 = 17.5 against compute 20 + 3 = 23; plus 10 x 0.25 overhead.
    assert mixed.least_busy_time(40, 1000, 3.0) == pytest.approx(23 + 2.5)


def test_one_engine_run_reaches_its_bound_only_when_saturated():
    # Two samples of 4 tokens after a 4-token prompt on one engine: one batch of 2 (the engine could run 4).
    # Decode step k (0..3) reads 2 x (4 + k) KV tokens; the prompts' prefill is 2 x 4 x 0.1 s.
    config = SimConfig(cluster=ClusterConfig(COST, num_engines=1), lengths=FixedLengths(4), mode="april-batch",
                       rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=1,
                       max_response_len=16, steps=1, warmup_steps=0, prompt_len=4, dataset_size=10)
    step = simulate(config).steps[0]
    # The run: a prefill of 2 x 4 prompt tokens (0.8 s), then 4 steps of 1 + 2 x 0.5 + 0.01 x KV.
    kv_reads = 2 * (4 + 5 + 6 + 7)
    assert step.rollout_s == pytest.approx(0.8 + 4 * 2 + 0.01 * kv_reads)
    least = max(8 / 4, kv_reads / 100) * 1.0 + 0.5 * 8 + 0.01 * kv_reads + 0.8
    assert step.least_time_s == pytest.approx(least)
    assert step.efficiency == pytest.approx(least / step.rollout_s) and step.efficiency < 1
    assert step.bound_tokens_per_s == pytest.approx(8 / least)


def _small(cluster: str, lengths: str, algorithm: str) -> SimConfig:
    # Paper-faithful engines (TP = 2, SGLang's mem_fraction_static 0.6, abort latency) at a small batch; the
    # adaptive target is small too, or it would fill the engines (hundreds of samples) and take seconds.
    return SimConfig(cluster=cluster, lengths=lengths, algorithm=algorithm, num_engines=2, tensor_parallel=2,
                     mem_fraction_static=0.6, abort_latency_s=0.5, colocate=True, rollout_batch_size=4,
                     n_samples_per_prompt=4,
                     over_sampling_batch_size=8, target_inflight_samples=32, max_response_len=8192, steps=2)


@pytest.mark.parametrize("cluster,lengths", list(itertools.product(CLUSTER_PRESETS, PAPER_LENGTH_PRESETS)))
def test_no_mode_exceeds_the_bound_in_any_step_of_any_preset(cluster, lengths):
    base = _small(cluster, lengths, "grpo")
    occupancy = full_occupancy_bound(base.cluster_config(), base.length_model(), base.max_response_len,
                                     base.prompt_len, warmup_finishes=64, measure_finishes=128)
    runs = [(algorithm, mode, boundary, "replace", "scheduler") for algorithm, mode, boundary in
            itertools.product(("grpo", "dapo"), MODES, ("abort", "carry")) if mode != "baseline" or boundary == "abort"]
    runs.append(("dapo", "baseline", "abort", "waves", "scheduler"))  # slime's wave refill (april_ext.sim.waves)
    runs += [(algorithm, "april-batch", "abort", "waves", "slime") for algorithm in ("grpo", "dapo")]  # slime's APRIL
    for algorithm, mode, boundary, dapo_baseline, april_loop in runs:
        result = simulate(replace(base, algorithm=algorithm, mode=mode, step_boundary=boundary,
                                  dapo_baseline=dapo_baseline, april_loop=april_loop), occupancy)
        for s in result.steps:
            where = f"{algorithm} {mode} {boundary} {dapo_baseline} {april_loop} step {s.step}"
            assert s.generated_tokens > 0, where
            assert s.least_time_s <= s.ceiling_time_s <= s.rollout_s * (1 + 1e-9), where
            assert s.tokens_per_s <= s.bound_tokens_per_s * (1 + 1e-9), where
            assert s.ceiling_efficiency <= 1 + 1e-9 and s.efficiency <= s.ceiling_efficiency, where
        assert result.summary["efficiency"] <= result.summary["ceiling_efficiency"] <= 1 + 1e-9


def test_the_readme_command_stays_within_its_bound_in_its_first_step():
    # Before the bound was the least time of the work, adaptive over-sampling showed 1.4x the "full-occupancy
    # bound" here: step 0 runs young, short contexts at batches the steady-state engine never reaches.
    config = SimConfig(cluster="h100-qwen3-8b", num_engines=8, lengths="dapo-math-17k", mode="april-adaptive",
                       steps=1, warmup_steps=0)
    step = simulate(config).steps[0]
    assert step.generated_tokens > 1_000_000
    assert 0.5 < step.efficiency <= 1.0 and step.tokens_per_s <= step.bound_tokens_per_s


def test_abort_latency_and_weight_sync_move_the_clock():
    cost = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                     kv_capacity_tokens=1000, max_num_seqs=4)
    cluster = ClusterConfig(cost, num_engines=1, abort_latency_s=0.25, weight_sync_s=3.0)

    async def run():
        async with SimulatedEngine(cluster, FixedLengths(100)) as engine:
            stream = engine.generate([3, 16, 17, 20], SamplingParams(max_new_tokens=200), "r")
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            await engine.abort([])  # nothing ends: no latency
            t0 = engine.clock()
            outputs = await engine.abort(None)
            t1 = engine.clock()
            await first
            await engine.update_weights({}, 1)
            return t0, t1, engine.clock(), outputs

    t0, t1, t2, outputs = asyncio.run(run())
    assert t0 == 0.0 and t1 == pytest.approx(0.25) and t2 == pytest.approx(3.25)
    assert len(outputs) == 1
