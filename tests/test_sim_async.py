"""Asynchronous modes in virtual time (april_ext.sim.pipeline, issue 36): the trainer's cost model by hand, the real
scheduler and rollout loop over the simulated engine placed on one timeline, and the validation messages."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest

from april_ext.errors import AprilError, ConfigError, InvalidStateError
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sim import SimConfig, simulate
from april_ext.sim.cost import CLUSTER_PRESETS, GPUS, MODELS, cluster_preset
from april_ext.sim.engine import SimulatedEngine
from april_ext.sim.lengths import length_preset
from april_ext.sim.pipeline import (
    ASYNC_MODES,
    PIPELINE_PRESETS,
    AsyncMode,
    PipelineConfig,
    simulate_mode,
)
from april_ext.sim.training import TrainerCost

TINY = PipelineConfig(gpus=4, rollout_gpus=2, rollout_batch_size=8, n_samples_per_prompt=4, max_response_len=4096,
                      steps=5, warmup_steps=1)


@pytest.fixture(scope="module")
def runs() -> dict[str, object]:
    """Every mode once on the tiny configuration (under a second each)."""
    return {name: simulate_mode(TINY, name) for name in ASYNC_MODES}


def test_trainer_cost_by_hand() -> None:
    h20, model = GPUS["h20"], MODELS["qwen2.5-math-7b"]
    cost = TrainerCost(h20, model, mfu=0.5, step_overhead_s=3.0)
    lens = np.array([1000, 3000])
    linear = 2 * 7.62e9 * 4000
    attention = 4 * 28 * 28 * 128 * (1000**2 + 3000**2) / 2
    assert cost.forward_flops(lens) == pytest.approx(linear + attention)
    # forward + backward (3 passes) and the old logprobs (1) on 8 GPUs at half of 148 TFLOP/s
    assert cost.train_seconds(lens, 8) == pytest.approx(3.0 + 4 * (linear + attention) / (8 * 148e12 * 0.5))
    assert replace(cost, recompute_old_logprobs=False).train_seconds(lens, 8) == pytest.approx(
        3.0 + 3 * (linear + attention) / (8 * 148e12 * 0.5))


def test_h20_and_qwen25_math_presets() -> None:
    assert "h20-qwen2.5-math-7b" in CLUSTER_PRESETS and GPUS["h20"].source
    model = MODELS["qwen2.5-math-7b"]
    assert model.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2
    cost = cluster_preset("h20-qwen2.5-math-7b").cost
    assert cost.decode_fixed_s == pytest.approx(7.62e9 * 2 / (4.0e12 * 0.7) + 1e-3)
    assert cost.decode_per_seq_s == pytest.approx(2 * 7.62e9 / (148e12 * 0.3))
    verl = PIPELINE_PRESETS["verl-7b-dapo"]
    assert (verl.gpus, verl.rollout_gpus, verl.rollout_batch_size, verl.n_samples_per_prompt,
            verl.max_response_len) == (128, 64, 512, 16, 28672)
    small = verl.scaled(8)
    assert (small.gpus, small.rollout_gpus, small.rollout_batch_size) == (16, 8, 64)


def test_validation_names_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"TrainerCost.mfu=0 is not allowed: a finite number > 0 and <= 1"):
        TrainerCost(GPUS["h100"], MODELS["qwen3-8b"], mfu=0)
    with pytest.raises(ConfigError, match=r"rollout_gpus=8 is not allowed: fewer than gpus=8"):
        PipelineConfig(gpus=8, rollout_gpus=8)
    with pytest.raises(ConfigError, match=r"rollout_gpus=3 is not allowed: a multiple of tensor_parallel=2"):
        PipelineConfig(gpus=8, rollout_gpus=3, tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"colocated=True is not allowed with lag=1"):
        AsyncMode("x", colocated=True, lag=1, partial_rollout=False)
    with pytest.raises(ConfigError, match=r"max_staleness=0 is not allowed with mode 'stale-april': at least its d"):
        simulate_mode(replace(TINY, max_staleness=0), "stale-april")
    with pytest.raises(ConfigError, match=r"mode 'nope' is not known: one of sync, sync-april"):
        simulate_mode(TINY, "nope")
    with pytest.raises(ConfigError, match=r"SimConfig.lengths='nope' is not allowed"):
        PipelineConfig(lengths="nope")
    with pytest.raises(ConfigError, match=r"factor=3 is not allowed: it must divide gpus=8"):
        PipelineConfig().scaled(3)
    assert issubclass(ConfigError, AprilError)


def test_wait_until_moves_the_clock_only_when_nothing_runs() -> None:
    async def run() -> None:
        cluster = cluster_preset("h100-qwen3-8b", num_engines=1)
        async with SimulatedEngine(cluster, length_preset("dapo-math-17k")) as engine:
            await engine.wait_until(12.5)
            assert engine.clock() == 12.5
            await engine.wait_until(3.0)  # never backwards
            assert engine.clock() == 12.5
            stream = engine.generate(list(range(64)), SamplingParams(max_new_tokens=64), "r")
            first = asyncio.ensure_future(stream.__anext__())
            await asyncio.sleep(0)
            with pytest.raises(InvalidStateError, match="requests are running"):
                await engine.wait_until(20.0)
            await engine.pause_generation("in_place")
            await engine.wait_until(20.0)  # paused: held, not lost
            assert engine.clock() == 20.0
            await engine.continue_generation()
            chunk = await first
            assert chunk.token_ids and engine.clock() > 20.0
            await stream.aclose()
    asyncio.run(run())


def test_lag_zero_colocated_is_the_synchronous_loop(runs: dict) -> None:
    """d = 0, colocated: rollout b starts when batch b - 1's weights landed, which follows its training; the
    rollout steps are the plain simulator's, step for step."""
    result = runs["sync"]
    plain = simulate(SimConfig(**{**vars(TINY.sim_config(ASYNC_MODES["sync"])), "mode": "baseline"}))
    for batch, step in zip(result.batches, plain.steps, strict=True):
        assert batch.rollout_end - batch.rollout_start == pytest.approx(step.rollout_s)
        assert batch.generated_under == batch.version
    clock = 0.0
    for b in result.batches:
        assert b.rollout_start == pytest.approx(clock)  # no weight-update time (TrainerCost's 0 s)
        assert b.train_start == pytest.approx(b.rollout_end)
        clock = b.train_end
    assert result.summary["offpolicy_token_share"] == 0.0
    assert result.summary["step_s"] == pytest.approx(result.summary["rollout_s"] + result.summary["train_s"])


@pytest.mark.parametrize("name", list(ASYNC_MODES))
def test_timeline_is_consistent(runs: dict, name: str) -> None:
    result = runs[name]
    mode = ASYNC_MODES[name]
    s = result.summary
    for key in ("trainer_idle_s", "engine_idle_s", "weight_update_s", "train_s"):
        assert s[key] >= 0, key
    assert all(seconds >= 0 for _, seconds, _ in result.waits)
    previous_end = 0.0
    for b in result.batches:
        assert b.train_start >= previous_end - 1e-9  # one training step at a time
        assert b.train_end >= b.train_start + b.train_s - 1e-9
        assert b.train_end >= b.rollout_end  # its last part is complete at the rollout's end at the latest
        assert b.generated_under >= b.version - mode.lag  # the bound
        if not mode.streaming:
            assert b.train_start >= b.rollout_end - 1e-9
        previous_end = b.train_end
    if mode.colocated:  # the GPUs take turns: no rollout step overlaps a training step
        spans = sorted([(b.rollout_start, b.rollout_end) for b in result.batches]
                       + [(b.train_start, b.train_end) for b in result.batches])
        assert all(a[1] <= c[0] + 1e-9 for a, c in zip(spans, spans[1:]))
    # trained tokens lag their version by at least nothing and, without partial rollout, by d exactly
    if not mode.partial_rollout:
        assert s["multi_version_frac"] == 0.0
        assert s["version_lag_mean"] == pytest.approx(mode.lag) and s["version_lag_max"] == mode.lag


def test_staleness_bound_holds_on_trained_tokens() -> None:
    config = replace(TINY, max_staleness=2, staleness_policy="restart")
    for name in ("stale-april", "stale-carry", "stale-best"):
        result = simulate_mode(config, name)
        assert max(max(b.lag_histogram) for b in result.batches) <= 2
    assert simulate_mode(TINY, "stale-best").summary["version_lag_max"] > 2  # without the bound it is exceeded


def test_partial_rollout_and_overlap_buy_time(runs: dict) -> None:
    step = {name: r.summary["step_s"] for name, r in runs.items()}
    assert step["sync-april"] < step["sync"]  # APRIL's gain, synchronous
    assert step["stale-april"] < step["stale"]  # partial rollout's gain inside async
    assert runs["stale-april"].summary["multi_version_frac"] > 0  # resumed partials span versions


def test_trainer_that_does_not_wait_for_the_landing() -> None:
    config = replace(TINY, trainer=TrainerCost(GPUS["h100"], MODELS["qwen3-8b"], weight_update_s=1.5),
                     trainer_waits=False)
    result = simulate_mode(config, "one-step-off")
    for previous, b in zip(result.batches, result.batches[1:]):
        assert b.train_start == pytest.approx(max(previous.train_end + 1.5, b.rollout_end))
    waits = [s for _, s, kind in result.waits if kind == "update"]
    assert waits and all(math.isclose(s, 1.5) for s in waits)


def test_lags_are_the_training_runs_measure() -> None:
    """The simulator counts lags as april_ext.batch.version_lags does (the asynchronous run's metrics)."""
    from april_ext.batch import TrainingBatch, version_lags
    from april_ext.sim.pipeline import _lags

    batch = TrainingBatch(
        tokens=np.zeros(6, np.int32), offsets=np.array([0, 4, 6]), prompt_lens=np.array([1, 1], np.int32),
        loss_mask=np.array([0, 1, 1, 1, 0, 0], np.uint8), behavior_logprobs=np.zeros(6, np.float32),
        versions=np.array([-1, 1, 1, 2, -1, 2], np.int32), rewards=np.zeros(2, np.float32),
        group_index=np.zeros(2, np.int32), sample_ids=np.array([0, 1]), finish_reasons=np.zeros(2, np.uint8),
        policy_version=3)
    histogram, multi = _lags(batch)
    reference = version_lags(batch)
    assert {str(k): v for k, v in histogram.items()} == reference["version_lag_histogram"]
    assert multi == reference["multi_version_frac"]
