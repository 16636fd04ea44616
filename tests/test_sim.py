"""Simulator tests: hand-computed clocks and metrics, resume to the same length, conservation, determinism,
and agreement with the embedded engine on the partial / surplus accounting for the same lengths."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace

import numpy as np
import pytest
from _torch_threads import one_thread  # noqa: F401 (fixture)

from april_ext.batch import FinishReason
from april_ext.data_source import ListDataSource, Prompt
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.errors import ConfigError, InvalidArgumentError, InvalidStateError, UnknownIdError
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.protocol import SamplingParams
from april_ext.rollout import RolloutEngine, RolloutLoop
from april_ext.scheduler import Scheduler, SchedulerConfig
from april_ext.sim import (
    ClusterConfig,
    CostModel,
    LogNormalLengths,
    SampleDraw,
    SimulatedEngine,
    TraceLengths,
    cluster_preset,
    length_preset,
)
from april_ext.sim.cost import GPUS
from april_ext.sim.metrics import length_bias
from april_ext.sim.runner import SimConfig, simulate
from april_ext.sim.tokens import (
    CORRECT_TOKEN,
    WRONG_TOKEN,
    answer_reward,
    prompt_key,
    score_answer,
    synthetic_prompt,
)

UNIT = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                 kv_capacity_tokens=10_000, max_num_seqs=4)


def _one(cost: CostModel = UNIT, engines: int = 1) -> ClusterConfig:
    return ClusterConfig(cost=cost, num_engines=engines)


async def _collect(engine: SimulatedEngine, ids, rid: str, max_new: int = 100) -> list[tuple[float, int, object]]:
    out = []
    async for chunk in engine.generate(ids, SamplingParams(max_new_tokens=max_new), rid):
        out.append((engine.clock(), len(chunk.token_ids), chunk.finish_reason))
    return out


# ---------------------------------------------------------------------------------------------- cost model

def test_decode_time_is_the_sum_of_its_steps_and_steps_within_inverts_it():
    cost = CostModel(decode_fixed_s=0.007, decode_per_seq_s=4e-5, decode_per_kv_token_s=6e-8,
                     prefill_per_token_s=3e-5, kv_capacity_tokens=400_000)
    rng = np.random.default_rng(0)
    for _ in range(50):
        b, kv, m = int(rng.integers(1, 200)), int(rng.integers(0, 300_000)), int(rng.integers(0, 3000))
        steps = sum(0.007 + 4e-5 * b + 6e-8 * (kv + b * k) for k in range(m))
        assert cost.decode_time(b, kv, m) == pytest.approx(steps, rel=1e-9)
        t = cost.decode_time(b, kv, m)
        assert cost.steps_within(b, kv, t) == m
        assert cost.steps_within(b, kv, t - 1e-9 * max(t, 1)) == max(m - 1, 0)


def test_presets_follow_the_datasheet_arithmetic():
    c = cluster_preset("h100-qwen3-8b").cost
    kv_bytes = 2 * 36 * 8 * 128 * 2
    assert c.decode_per_kv_token_s == pytest.approx(kv_bytes / (3.35e12 * 0.7))
    assert c.decode_fixed_s == pytest.approx(8.19e9 * 2 / (3.35e12 * 0.7) + 1e-3)
    assert c.kv_capacity_tokens == int((80 * 2**30 * 0.85 - 8.19e9 * 2 - 4 * 2**30) // kv_bytes)
    big = cluster_preset("mi300x-qwen3-4b").cost
    assert big.kv_capacity_tokens > c.kv_capacity_tokens
    with pytest.raises(ConfigError, match="cluster preset 'a100-x'"):
        cluster_preset("a100-x")
    with pytest.raises(ConfigError, match="CostModel.decode_fixed_s=0"):
        replace(UNIT, decode_fixed_s=0)


def test_the_mi300x_preset_takes_amds_published_figures_and_a_link_per_peer():
    gpu = GPUS["mi300x"]
    # AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s, 1307.4 TFLOP/s dense BF16, 7 Infinity Fabric links of
    # 128 GB/s bidirectional (one per peer), PCIe Gen5 x16; the source is recorded with the figures.
    assert (gpu.hbm_bytes, gpu.hbm_bandwidth, gpu.bf16_flops) == (192 * 2**30, 5.3e12, 1307.4e12)
    assert "AMD Instinct MI300X datasheet" in gpu.source and "1307.4" in gpu.source and "5.3 TB/s" in gpu.source
    assert all(GPUS[name].source for name in GPUS)
    # A mesh: a TP-2 engine's GPUs share one link; TP 8 uses all seven. NVLink through NVSwitch: the full bandwidth.
    assert gpu.tp_link_bandwidth(2) == 64e9 and gpu.tp_link_bandwidth(8) == 7 * 64e9
    assert GPUS["h100"].tp_link_bandwidth(2) == GPUS["h100"].tp_link_bandwidth(8) == 450e9
    tp2 = cluster_preset("mi300x-qwen3-4b", num_engines=4, tensor_parallel=2, mem_fraction_static=0.6).cost
    comm = 2 * 36 * 2560 * 2 * (1 / 2) / 64e9  # two all-reduces per layer of hidden x 2 B, over the one link
    assert tp2.prefill_per_token_s == pytest.approx(2 * 4.02e9 / (2 * 1307.4e12 * 0.4) + comm)
    assert tp2.decode_fixed_s == pytest.approx(8.04e9 / (2 * 5.3e12 * 0.6) + 1e-3 + 2 * 36 * 10e-6)
    assert tp2.kv_capacity_tokens == int((0.6 * 192 * 2**30 * 2 - 8.04e9) // (2 * 36 * 8 * 128 * 2))


# ---------------------------------------------------------------------------------------------- lengths

def test_length_draws_are_deterministic_grouped_and_drift():
    model = LogNormalLengths(median_tokens=1000, prompt_sigma=1.0, within_sigma=0.1, accuracy_mean=1.0,
                             runaway_prob=0.0, drift_per_version=0.1, seed=3)
    assert model.draw(5, 2, 0) == model.draw(5, 2, 0)
    groups = [[model.draw(k, i, 0).length for i in range(8)] for k in range(40)]
    within = np.mean([np.std(np.log(g)) for g in groups])
    between = np.std([np.mean(np.log(g)) for g in groups])
    assert within < 0.2 < between  # samples of one prompt are alike, prompts differ
    assert model.draw(5, 2, 10).length == pytest.approx(model.draw(5, 2, 0).length * math.e, rel=1e-3)


def test_incorrect_responses_are_longer_and_runaways_reach_the_cap():
    model = LogNormalLengths(median_tokens=1000, prompt_sigma=0.3, within_sigma=0.3, accuracy_mean=0.5,
                             runaway_prob=0.2, seed=1)
    draws = [model.draw(k, i, 0) for k in range(200) for i in range(8)]
    correct = np.median([d.length for d in draws if d.correct])
    wrong = [d.length for d in draws if not d.correct]
    runaway = np.mean([n >= 2**31 - 1 for n in wrong])
    assert 0.15 < runaway < 0.25
    assert np.median([n for n in wrong if n < 2**31 - 1]) / correct == pytest.approx(3.0, rel=0.2)


def test_dataset_presets_match_the_papers_length_statistics():
    # arXiv 2509.18521: batch-level std ~4,000-4,500 tokens, within-group std below 1,500 (GRPO, every group) and
    # 2,400 (DAPO, the groups its filter keeps: mixed rewards), more than half within a few thousand tokens.
    for name in ("dapo-math-17k", "deepscaler", "deepmath-103k"):
        model = length_preset(name)
        draws = [[model.draw(k, i, 0) for i in range(8)] for k in range(1500)]
        lens = np.minimum([[d.length for d in g] for g in draws], 16384)
        mixed = [row for row, g in zip(lens, draws) if 0 < sum(d.correct for d in g) < 8]
        assert 4000 <= lens.std() <= 4600, name
        assert lens.std(axis=1, ddof=1).mean() < 1500, name
        assert np.std(mixed, axis=1, ddof=1).mean() < 2400, name
        assert np.median(lens) < 3500 and np.mean(lens <= 4000) > 0.55, name
        assert 0.02 < np.mean(lens >= 16384) < 0.1, name  # a tail reaches the cap


def test_trace_replay_from_csv_and_jsonl(tmp_path):
    csv_path = tmp_path / "t.csv"
    csv_path.write_text("prompt_id,length,correct\na,10,1\na,20,0\nb,5,1\n")
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt_id": "a", "length": 10}, {"prompt_id": "a", "length": 20, "correct": False},
        {"prompt_id": "b", "length": 5}]))
    for path in (csv_path, jsonl_path):
        trace = TraceLengths.from_file(path)
        assert trace.lengths == [[10, 20], [5]]
        assert trace.draw(0, 1, 7) == SampleDraw(20, False) and trace.draw(3, 0, 0) == SampleDraw(5, True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": "a", "length": 3}\n{"prompt_id": "a", "length": "x"}\n')
    with pytest.raises(InvalidArgumentError, match="bad.jsonl:2: length='x'"):
        TraceLengths.from_file(bad)


# ---------------------------------------------------------------------------------------------- engine

def test_clock_with_fixed_lengths_is_hand_computable():
    # fixed 1 s + 0.5 s per sequence + 0.1 s per KV token per step, prefill 0.01 s per token.
    cost = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.5, decode_per_kv_token_s=0.1, prefill_per_token_s=0.01,
                     kv_capacity_tokens=1000)
    prompt = synthetic_prompt(0, 4)

    async def run():
        async with SimulatedEngine(_one(cost), TraceLengths([[2, 3]])) as engine:
            return await asyncio.gather(_collect(engine, prompt, "a"), _collect(engine, prompt, "b"))

    a, b = asyncio.run(run())
    # Prefill 8 tokens: 0.08. Steps with 2 sequences over 8 then 10 KV tokens: 2.8 + 3.0. Then one sequence
    # over 6 KV tokens: 1 + 0.5 + 0.6.
    assert a == [(pytest.approx(5.88), 2, FinishReason.STOP)]
    assert b == [(pytest.approx(7.98), 3, FinishReason.STOP)]


def test_resumed_request_continues_to_the_same_total_length_and_pays_its_prefill():
    cost = replace(UNIT, prefill_per_token_s=0.5)
    prompt = synthetic_prompt(0, 4)

    async def run():
        async with SimulatedEngine(_one(cost), TraceLengths([[10]])) as engine:
            first = asyncio.ensure_future(_collect_chunks(engine, prompt, "a", 16))
            # A 3-token request next to it ends at t = 4 (prefill of 8 tokens) + 3: then "a" is aborted.
            other = await _collect(engine, synthetic_prompt(1, 4), "b", max_new=3)
            [out] = await engine.abort(["a"])
            [chunk] = await first
            assert chunk.finish_reason == FinishReason.ABORT and chunk.token_ids == out.token_ids
            t0 = engine.clock()
            rest = await _collect_chunks(engine, list(prompt) + out.token_ids, "a2", 16 - len(out.token_ids))
            return other, out, rest, engine.clock() - t0, engine.counters()

    other, out, rest, elapsed, counters = asyncio.run(run())
    k = len(out.token_ids)
    assert other[-1][0] == 7.0 and k == 3 and out.versions == [0] * k
    assert sum(len(c.token_ids) for c in rest) == 10 - k and rest[-1].finish_reason == FinishReason.STOP
    assert elapsed == pytest.approx(0.5 * (4 + k) + (10 - k))  # re-prefill prompt + partial, then decode
    assert counters.resume_prefill_tokens == 4 + k


def test_abort_streams_and_outputs_carry_the_same_tokens_and_unknown_ids_raise():
    async def run():
        async with SimulatedEngine(_one(), TraceLengths([[50]])) as engine:
            streams = [asyncio.ensure_future(_collect(engine, synthetic_prompt(0, 4), f"r{i}")) for i in range(3)]
            await _collect(engine, synthetic_prompt(1, 4), "short", max_new=7)
            with pytest.raises(UnknownIdError):
                await engine.abort(["r0", "nope"])
            outputs = await engine.abort()
            chunks = await asyncio.gather(*streams)
            return outputs, chunks, engine.counters()

    outputs, chunks, counters = asyncio.run(run())
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    for o, c in zip(sorted(outputs, key=lambda o: o.request_id), chunks):
        assert c == [(7.0, 7, FinishReason.ABORT)] and len(o.token_ids) == 7 and len(o.logprobs) == 7
        assert all(math.isfinite(x) for x in o.logprobs)
    assert counters.decode_tokens == counters.delivered_tokens == 4 * 7


def test_weight_update_flushes_running_requests_into_version_pure_chunks():
    async def run():
        async with SimulatedEngine(_one(), TraceLengths([[6]])) as engine:
            task = asyncio.ensure_future(_collect_chunks(engine, synthetic_prompt(0, 4)))
            await _collect(engine, synthetic_prompt(1, 4), "tick", max_new=2)
            await engine.update_weights({}, 5)
            return await task

    chunks = asyncio.run(run())
    assert [(len(c.token_ids), c.weight_version, c.finish_reason) for c in chunks] == [
        (2, 0, None), (4, 5, FinishReason.STOP)]
    assert chunks[-1].token_ids[-1] in (CORRECT_TOKEN, WRONG_TOKEN)


async def _collect_chunks(engine: SimulatedEngine, ids, rid: str = "w", max_new: int = 100):
    return [c async for c in engine.generate(ids, SamplingParams(max_new_tokens=max_new), rid)]


def test_clock_waits_for_consumers_and_reactions_within_the_settle_passes():
    async def run():
        async with SimulatedEngine(_one(), TraceLengths([[10]])) as engine:
            long = engine.generate(synthetic_prompt(0, 4), SamplingParams(max_new_tokens=16), "long")
            first = asyncio.ensure_future(long.__anext__())
            await _collect(engine, synthetic_prompt(1, 4), "tick", max_new=2)
            await engine.update_weights({}, 1)  # flushes "long": a chunk of its 2 tokens so far
            chunk = await first
            for _ in range(200):  # a slow consumer holds the clock while its stream is not drained
                await asyncio.sleep(0)
            held = engine.clock()
            pending = asyncio.ensure_future(long.__anext__())
            for _ in range(10):  # a reaction within settle_passes happens at the same virtual instant
                await asyncio.sleep(0)
            [out] = await engine.abort(["long"])
            return chunk, held, out, await pending

    chunk, held, out, last = asyncio.run(run())
    assert (len(chunk.token_ids), chunk.weight_version, held) == (2, 0, 2.0)
    assert out.token_ids[:2] == chunk.token_ids and len(out.token_ids) == 2 and out.versions == [0, 0]
    assert last.finish_reason == FinishReason.ABORT and last.token_ids == []


def test_released_memory_stops_the_clock_and_kv_release_recomputes():
    async def run():
        async with SimulatedEngine(_one(), TraceLengths([[6]])) as engine:
            task = asyncio.ensure_future(_collect_chunks(engine, synthetic_prompt(0, 4)))
            await _collect(engine, synthetic_prompt(1, 4), "tick", max_new=2)
            await engine.release_memory(["kv_cache"])
            assert engine.health()["status"] == "paused"
            for _ in range(100):
                await asyncio.sleep(0)
            paused_at = engine.clock()
            await engine.resume_memory()
            chunks = await task
            with pytest.raises(InvalidArgumentError, match="unknown memory tags"):
                await engine.release_memory(["gpu"])
            return paused_at, chunks, engine.clock(), engine.counters()

    paused_at, chunks, end, counters = asyncio.run(run())
    assert paused_at == 2.0 and end == 6.0  # 4 more tokens after the resume (recompute costs 0 here)
    assert [len(c.token_ids) for c in chunks] == [2, 4] and counters.recompute_tokens == 4 + 2


def test_pause_in_place_keeps_the_kv_across_a_weight_update_and_stops_the_clock():
    # A request of 6 tokens runs 2 steps, is paused in place, the weights update (sync 3 s, outside decoding),
    # and it continues at version 1 without recompute: 4 more steps after the pause ends.
    cost = replace(UNIT, prefill_per_token_s=0.5)
    cluster = replace(_one(cost), weight_sync_s=3.0)

    async def run():
        async with SimulatedEngine(cluster, TraceLengths([[6]])) as engine:
            task = asyncio.ensure_future(_collect_chunks(engine, synthetic_prompt(0, 4)))
            await _collect(engine, synthetic_prompt(1, 4), "tick", max_new=2)  # prefill 4 s, then 2 steps
            await engine.pause_generation("in_place")
            assert engine.health()["paused"] == "in_place" and engine.health()["status"] == "paused"
            for _ in range(100):
                await asyncio.sleep(0)
            paused_at = engine.clock()
            await engine.update_weights({}, 1)
            with pytest.raises(InvalidStateError, match="already paused"):
                await engine.pause_generation()
            resumed_at = engine.clock()
            await engine.continue_generation()
            chunks = await task
            return paused_at, resumed_at, chunks, engine.clock(), engine.counters()

    paused_at, resumed_at, chunks, end, counters = asyncio.run(run())
    assert paused_at == 6.0 and resumed_at == 9.0 and end == 13.0
    assert [(len(c.token_ids), c.weight_version) for c in chunks] == [(2, 0), (4, 1)]
    assert counters.recompute_tokens == 0 and counters.kv_copy_time == 0.0


def test_pause_retract_frees_the_kv_and_recomputes_on_continue():
    cost = replace(UNIT, prefill_per_token_s=0.5)

    async def run():
        async with SimulatedEngine(_one(cost), TraceLengths([[6]])) as engine:
            task = asyncio.ensure_future(_collect_chunks(engine, synthetic_prompt(0, 4)))
            await _collect(engine, synthetic_prompt(1, 4), "tick", max_new=2)
            await engine.pause_generation("retract")
            await engine.update_weights({}, 1)
            await engine.continue_generation()
            with pytest.raises(InvalidStateError, match="not paused"):
                await engine.continue_generation()
            with pytest.raises(InvalidArgumentError, match="'in_place' or 'retract'"):
                await engine.pause_generation("abort")
            return await task, engine.clock(), engine.counters()

    chunks, end, counters = asyncio.run(run())
    # Recompute of prompt + 2 tokens (3 s), then 4 steps.
    assert [(len(c.token_ids), c.weight_version) for c in chunks] == [(2, 0), (4, 1)]
    assert end == 6.0 + 3.0 + 4.0 and counters.recompute_tokens == 4 + 2


def test_a_colocated_in_place_pause_copies_the_held_kv_to_host_and_back():
    # Two replicas; the held contexts are 4 + 2 tokens on one and 4 + 2 on the other after 2 steps (the second
    # request on each ran 2 tokens and finished). Backup 0.25 s and restore 0.5 s per KV token, in parallel.
    cost = replace(UNIT, kv_backup_per_token_s=0.25, kv_restore_per_token_s=0.5)
    cluster = replace(_one(cost, engines=2), colocated=True)

    async def run():
        async with SimulatedEngine(cluster, TraceLengths([[6]])) as engine:
            tasks = [asyncio.ensure_future(_collect_chunks(engine, synthetic_prompt(0, 4), f"long{i}"))
                     for i in range(2)]
            await asyncio.gather(*(_collect(engine, synthetic_prompt(1, 4), f"tick{i}", max_new=2) for i in range(2)))
            await engine.pause_generation("in_place")
            paused = engine.clock()
            [out] = await engine.abort(["long1"])  # aborted while paused: its KV is not restored
            await engine.continue_generation()
            chunks = await asyncio.gather(*tasks)
            return paused, out, chunks, engine.clock(), engine.counters()

    paused, out, chunks, end, counters = asyncio.run(run())
    assert len(out.token_ids) == 2
    assert paused == pytest.approx(2.0 + 6 * 0.25)  # each replica backs up its 6 KV tokens at once
    assert end == pytest.approx(paused + 6 * 0.5 + 4.0)  # one replica restores 6 tokens, then 4 steps
    assert counters.kv_copy_tokens == 12 + 6 and counters.kv_copy_time == pytest.approx(1.5 + 3.0)
    assert counters.recompute_tokens == 0


@pytest.mark.skipif(not hasattr(RolloutLoop, "abort_carried"),
                    reason="needs the rollout loop's carry step boundary (april_ext/rollout/loop.py, issue 14)")
def test_a_carry_run_keeps_the_kv_of_carried_samples_and_pays_the_colocated_copy_instead():
    config = SimConfig(cluster="h100-qwen3-4b", lengths="dapo-math-17k", mode="april-adaptive", num_engines=2,
                       tensor_parallel=2, mem_fraction_static=0.6, rollout_batch_size=4, n_samples_per_prompt=4,
                       over_sampling_batch_size=8, target_inflight_samples=32, max_response_len=8192, steps=4,
                       colocate=True)
    abort, carry = (simulate(replace(config, step_boundary=b)) for b in ("abort", "carry"))
    assert sum(s.aborted_samples for s in abort.steps) > 0 and sum(s.re_prefill_tokens for s in abort.steps) > 0
    assert all(s.aborted_samples == 0 and s.re_prefill_tokens == 0 for s in carry.steps)
    assert all(s.kv_copy_time_fraction > 0 for s in carry.steps[1:]) and carry.steps[0].kv_copy_time_fraction > 0
    assert max(s.partial_token_ratio for s in carry.steps) > 0  # carried tokens reach later batches
    assert carry.summary["re_prefill_time_fraction"] == 0 and abort.summary["kv_copy_time_fraction"] == 0
    assert carry.summary["efficiency"] == pytest.approx(carry.summary["ceiling_efficiency"])


def test_kv_capacity_preempts_and_recomputes():
    cost = replace(UNIT, kv_capacity_tokens=40, max_num_seqs=8, prefill_per_token_s=0.001)

    async def run():
        async with SimulatedEngine(_one(cost), TraceLengths([[12]])) as engine:
            outs = await asyncio.gather(*(_collect(engine, synthetic_prompt(0, 4), f"r{i}", 20) for i in range(4)))
            return outs, engine.counters()

    outs, counters = asyncio.run(run())
    assert all(o[-1][1:] == (12, FinishReason.STOP) for o in outs)
    assert counters.preemptions >= 1 and counters.recompute_tokens > 0
    assert counters.decode_tokens == 48  # recomputation re-prefills; it never decodes a token twice


def test_router_spreads_requests_and_engine_validates_input():
    async def run():
        async with SimulatedEngine(_one(engines=3), TraceLengths([[5]])) as engine:
            assert isinstance(engine, RolloutEngine)
            await asyncio.gather(*(_collect(engine, synthetic_prompt(i, 4), f"r{i}") for i in range(6)))
            loads = [r.counters.finished for r in engine.replicas]
            with pytest.raises(InvalidArgumentError, match="input_ids"):
                await _collect(engine, [], "bad")
            with pytest.raises(InvalidArgumentError, match="KV capacity"):
                await _collect(engine, [5, 6], "big", max_new=20_000)
            return loads

    assert asyncio.run(run()) == [2, 2, 2]
    with pytest.raises(ConfigError, match="settle_passes"):
        SimulatedEngine(_one(), TraceLengths([[5]]), settle_passes=0)


def test_reward_reads_the_answer_token_and_prompts_carry_their_index():
    assert answer_reward([20, CORRECT_TOKEN]) == 1.0 and answer_reward([20, WRONG_TOKEN]) == 0.0
    assert answer_reward([]) == 0.0
    assert prompt_key(np.asarray(synthetic_prompt(70_000, 9), np.int32)) == 70_000


# ---------------------------------------------------------------------------------------------- with the loop

def _tiny_run(mode: str = "april-batch", steps: int = 2, lengths=None, cluster=None, **overrides):
    lengths = lengths or TraceLengths([[2, 4], [5, 5]], correct=[[True, False], [True, False]])
    config = SimConfig(cluster=cluster or _one(), lengths=lengths, mode=mode, rollout_batch_size=1,
                       n_samples_per_prompt=2, over_sampling_batch_size=2, max_response_len=16, steps=steps,
                       prompt_len=4, dataset_size=50, **overrides)
    return simulate(config)


def test_every_metric_of_a_tiny_april_run_is_hand_computable():
    result = _tiny_run()
    assert result.bound.tokens_per_s == pytest.approx(4.0) and result.bound.mean_batch == pytest.approx(4.0)
    s0, s1 = result.steps
    # Step 0: groups 0 ([2, 4]) and 1 ([5, 5]) start together; group 0 completes at t = 4, group 1 is aborted
    # with 4 tokens per sample. Tokens: 2 + 4 + 4 + 4 over 4 s; slot-time 14 of 4 slots x 4 s.
    assert (s0.rollout_s, s0.generated_tokens, s0.trained_tokens) == (4.0, 14, 6)
    assert s0.tokens_per_s == pytest.approx(3.5) and s0.efficiency == pytest.approx(3.5 / 4)
    assert s0.bubble_fraction == pytest.approx(1 - 14 / 16)
    assert (s0.aborted_samples, s0.buffered_groups, s0.partial_token_ratio) == (2, 1, 0.0)
    # Step 1: group 1 resumes (1 token each left) next to new group 2 ([2, 4]); done at t = 1.
    assert (s1.rollout_s, s1.generated_tokens, s1.trained_tokens) == (1.0, 4, 10)
    assert s1.partial_token_ratio == pytest.approx(0.8) and s1.offpolicy_token_ratio == pytest.approx(0.8)
    assert s1.staleness_histogram == [0, 2] and s1.re_prefill_tokens == 2 * (4 + 4)
    assert s1.efficiency == pytest.approx(1.0) and s1.bubble_fraction == pytest.approx(0.0)
    natural = np.array([2, 4, 5, 5])
    assert s0.length_mean_ratio == pytest.approx(3.0 / natural.mean())
    assert s1.length_w1_rel == pytest.approx(length_bias(np.array([5, 5]), natural)["w1_rel"])


def test_the_loss_against_the_bound_splits_into_idle_underfill_and_the_named_costs():
    # APRIL, one engine of 4 slots: step 0 decodes 14 tokens in 4 s, never idle; the bound runs them at 4 a step.
    s0, s1 = _tiny_run().steps
    assert (s0.idle_time_fraction, s0.underfill_fraction) == (0.0, pytest.approx(1 - 3.5 / 4))
    assert s1.efficiency == pytest.approx(1.0) and s1.underfill_fraction == pytest.approx(0.0)
    # The baseline on two engines: group 0's samples (2 and 4 tokens) one per engine, so replica 0 idles 2 of
    # the 8 replica-seconds; 6 tokens take 1.5 replica-seconds at the maximum batch, the other 4.5 are underfill.
    base = _tiny_run(mode="baseline", steps=1, warmup_steps=0, cluster=_one(engines=2)).steps[0]
    assert base.rollout_s == 4.0 and base.efficiency == pytest.approx(1.5 / 8)
    assert (base.idle_time_fraction, base.underfill_fraction) == (pytest.approx(2 / 8), pytest.approx(4.5 / 8))
    for s in (s0, s1, base):
        assert s.efficiency + s.idle_time_fraction + s.underfill_fraction + s.kv_copy_time_fraction + (
            s.re_prefill_time_fraction + s.recompute_time_fraction + s.continuation_prefill_time_fraction) == (
            pytest.approx(1.0))


def test_scheduler_settings_per_mode():
    config = SimConfig(over_sampling_batch_size=96, max_inflight_samples=600)
    april = replace(config, mode="april-continuous").scheduler_config()
    assert (april.over_sampling_batch_size, april.refill, april.max_inflight_samples) == (96, "continuous", 600)
    base = replace(config, mode="baseline").scheduler_config()
    assert (base.over_sampling_batch_size, base.refill, base.max_inflight_samples) == (32, "batch", None)
    dapo = replace(config, mode="baseline", algorithm="dapo").scheduler_config()
    assert (dapo.over_sampling_batch_size, dapo.refill, dapo.max_staleness, dapo.staleness_policy) == (
        32, "continuous", 0, "drop")
    with pytest.raises(ConfigError, match="SimConfig.mode='fast'"):
        SimConfig(mode="fast")
    assert SimConfig(cluster="h200-qwen2.5-math-7b").cluster == "h200-qwen2.5-math-7b"  # any GPU x model pairing
    adaptive = replace(config, mode="april-adaptive").scheduler_config(engine_capacity=568)
    assert (adaptive.refill, adaptive.over_sampling) == ("continuous", "adaptive")
    assert adaptive.target_inflight_samples == 568
    own = replace(config, mode="april-adaptive", target_inflight_samples=300).scheduler_config(engine_capacity=568)
    assert own.target_inflight_samples == 300
    with pytest.raises(ConfigError, match="SimConfig.target_inflight_samples=None"):
        replace(config, mode="april-adaptive").scheduler_config()
    with pytest.raises(ConfigError, match=r"SchedulerConfig\.target_inflight_samples=4 is not allowed"):
        SimConfig(target_inflight_samples=4)


@pytest.mark.parametrize("field, value", [
    ("cluster", 42), ("cluster", None), ("cluster", "a100-qwen3-8b"), ("lengths", 123), ("lengths", __file__),
    ("seed", -1), ("seed", 1.5), ("settle_passes", 0), ("mem_fraction_static", 2.0), ("mem_fraction_static", 0),
])
def test_a_bad_value_is_a_config_error_naming_the_field_before_the_run(field, value):
    with pytest.raises(ConfigError, match=rf"SimConfig\.{field}="):
        SimConfig(**{field: value})


def test_the_baseline_is_a_named_one_ending_its_steps_as_slime_does():
    # april_ext.strategies' baselines, with the simulator's step end (abort) and no cap on samples in flight.
    config = SimConfig(mode="baseline", step_boundary="carry", max_inflight_samples=600,
                       dispatch_order="shortest_first")
    assert config.scheduler_config() == SchedulerConfig(rollout_batch_size=32, over_sampling_batch_size=32)
    assert replace(config, algorithm="dapo").scheduler_config() == SchedulerConfig(
        rollout_batch_size=32, over_sampling_batch_size=32, refill="continuous", max_staleness=0,
        staleness_policy="drop", dispatch_order="shortest_first")


def test_adaptive_mode_holds_the_engine_at_its_capacity_in_a_tiny_run():
    # One engine with B_sat = 4 slots, so the target is 4 live samples. Step 0 starts like batch refill with
    # groups 0 ([2, 4]) and 1 ([5, 5]); when sample 0 ends at t = 2, a third group is launched and one of its
    # samples (2 tokens) fills the free slot until the step ends at t = 4: 14 + 2 tokens, no idle slot.
    result = _tiny_run(mode="april-adaptive", steps=3)
    batch = _tiny_run(mode="april-batch", steps=3)
    assert result.config.scheduler_config(4).target_inflight_samples == 4
    s0, b0 = result.steps[0], batch.steps[0]
    assert (s0.rollout_s, s0.generated_tokens, b0.generated_tokens) == (4.0, 16, 14)
    assert s0.bubble_fraction == pytest.approx(0.0) and b0.bubble_fraction == pytest.approx(1 - 14 / 16)
    assert all(s.trained_tokens > 0 and len(s.response_lens) == 2 for s in result.steps)
    assert result.summary["efficiency"] == pytest.approx(result.summary["tokens_per_s"] / result.bound.tokens_per_s)


def test_baseline_waits_for_the_whole_wave():
    result = _tiny_run(mode="baseline", steps=2)
    s0, s1 = result.steps
    # N' = N = 1: group 0 ([2, 4]) alone takes 4 s, then group 1 ([5, 5]) 5 s. Nothing is aborted.
    assert (s0.rollout_s, s0.generated_tokens, s1.rollout_s, s1.generated_tokens) == (4.0, 6, 5.0, 10)
    assert s0.aborted_samples == s1.aborted_samples == 0 and s1.partial_token_ratio == 0.0


def test_dapo_baseline_keeps_slimes_n_prime_relaunches_rejected_groups_and_april_keeps_partials():
    base = _tiny_run(mode="baseline", algorithm="dapo")
    april = _tiny_run(mode="april-batch", algorithm="dapo")
    # slime's DAPO baseline keeps N' = N = 1: group 0 ([2, 4]) alone in 4 s, then group 1 ([5, 5]) in 5 s;
    # nothing is aborted or thrown away.
    assert [(s.rollout_s, s.generated_tokens, s.aborted_samples, s.discarded_tokens) for s in base.steps] == [
        (4.0, 6, 0, 0), (5.0, 10, 0, 0)]
    assert [(s.rollout_s, s.generated_tokens) for s in april.steps] == [(4.0, 14), (1.0, 4)]
    assert april.steps[1].partial_token_ratio == pytest.approx(0.8)
    # Group 1 all correct: the filter rejects it at t = 5 and the baseline launches group 2 ([3, 3]): done at 8.
    lengths = TraceLengths([[2, 4], [5, 5], [3, 3]], correct=[[True, False], [True, True], [True, False]])
    rejected = _tiny_run(mode="baseline", algorithm="dapo", lengths=lengths)
    assert [(s.rollout_s, s.generated_tokens, s.filtered_groups) for s in rejected.steps] == [
        (4.0, 6, 0), (8.0, 16, 1)]


def test_runs_are_deterministic_at_a_realistic_scale():
    config = SimConfig(cluster=cluster_preset("h100-qwen3-4b", num_engines=2), lengths="deepscaler",
                       mode="april-continuous", rollout_batch_size=4, n_samples_per_prompt=4,
                       over_sampling_batch_size=8, max_response_len=4096, steps=4)

    async def run():
        from april_ext.sim.runner import simulate_async
        return await simulate_async(config)

    a, b = asyncio.run(run()), simulate(config)
    assert [s.__dict__ for s in a.steps] == [s.__dict__ for s in b.steps]
    assert all(s.partial_token_ratio > 0 for s in a.steps[1:])
    assert sum(s.generated_tokens for s in a.steps) >= sum(s.trained_tokens for s in a.steps[1:])


def test_conservation_with_the_scheduler_buffer():
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4,
                                      max_response_len=64, refill="continuous"),
                      ListDataSource([Prompt(i, synthetic_prompt(i, 6)) for i in range(40)]))
    lengths = LogNormalLengths(median_tokens=10, prompt_sigma=0.8, within_sigma=0.5, runaway_prob=0.1, seed=4)

    async def run():
        async with SimulatedEngine(_one(replace(UNIT, max_num_seqs=6), engines=2), lengths) as engine:
            loop = RolloutLoop(engine, sched, score_answer)
            out = []
            for v in range(5):
                out.append(await loop.run_step(v))
                await engine.update_weights({}, v + 1)
            return out, engine.counters()

    results, counters = asyncio.run(run())
    generated = sum(r.metrics.generated_tokens for r in results)
    trained = sum(int(r.batch.response_lens.sum()) for r in results)
    held = sum(sched.sample(i).token_ids.size for state in ("queued", "running", "aborting", "done")
               for i in sched.sample_ids(state))  # buffered partials and surplus groups
    assert counters.delivered_tokens == counters.decode_tokens == generated
    assert generated == trained + held and held > 0


# ---------------------------------------------------------------------------------------------- vs embedded engine

class _ForcedLengths:
    """Wraps the embedded AsyncEngine so that every sample ends after the length the table gives its prompt."""

    def __init__(self, engine: AsyncEngine, table: dict[tuple[int, ...], list[int]], prompt_len: int) -> None:
        self.engine, self.table, self.prompt_len = engine, table, prompt_len
        self.seen: dict[tuple[int, ...], int] = {}
        self.targets: dict[tuple[int, ...], int] = {}

    def generate(self, input_ids, params=None, request_id=None):
        prompt = tuple(input_ids[:self.prompt_len])
        done = len(input_ids) - self.prompt_len
        key = tuple(input_ids)
        if done == 0:
            ordinal = self.seen.get(prompt, 0)
            self.seen[prompt] = ordinal + 1
            target = self.table[prompt][ordinal]
        else:
            target = self.targets.pop(key)
        self.last_target = target
        params = replace(params, max_new_tokens=target - done, ignore_eos=True)
        return self._run(input_ids, params, request_id, target)

    async def _run(self, input_ids, params, request_id, target):
        received = []
        async for chunk in self.engine.generate(input_ids, params, request_id):
            received.extend(chunk.token_ids)
            if chunk.finish_reason == FinishReason.ABORT:
                self.targets[tuple(input_ids) + tuple(received)] = target
            yield chunk

    async def abort(self, request_ids=None):
        return await self.engine.abort(request_ids)

    async def update_weights(self, weights, version):
        return await self.engine.update_weights(weights, version)

    async def release_memory(self, tags=None):
        await self.engine.release_memory(tags)

    async def resume_memory(self, tags=None):
        await self.engine.resume_memory(tags)

    def stats(self):
        return self.engine.stats()

    def health(self):
        return self.engine.health()


class _TableLengths:
    def __init__(self, table: dict[tuple[int, ...], list[int]]) -> None:
        self.by_key = {prompt_key(np.asarray(p, np.int32)): v for p, v in table.items()}

    def draw(self, key: int, ordinal: int, version: int) -> SampleDraw:
        return SampleDraw(self.by_key[key][ordinal], True)

    def natural_lengths(self, version: int, n: int = 0) -> np.ndarray:
        return np.concatenate([np.asarray(v) for v in self.by_key.values()])


def _accounting(results) -> list[tuple[int, ...]]:
    return [(r.metrics.aborted_samples, r.metrics.resumed_requests, r.metrics.batch_groups,
             r.metrics.scheduler["buffered_groups"], r.metrics.scheduler["surplus_groups"],
             r.metrics.scheduler["groups_completed"]) for r in results]


@pytest.mark.usefixtures("one_thread")
def test_simulator_and_embedded_engine_agree_on_partial_and_surplus_accounting():
    prompts = [[1 + i, 7, 9, 11] for i in range(6)]
    # Two short groups finish first in step 0; the long ones are aborted, resumed first in step 1 and finish
    # before the two new long groups, which become the partials of step 2.
    table = {tuple(p): lens for p, lens in zip(prompts, [[3, 3], [3, 4], [30, 30], [30, 31], [60, 60], [60, 60]])}
    config = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4,
                             max_response_len=80)

    async def reward(prompt, response):
        return 1.0

    async def drive(engine) -> list:
        sched = Scheduler(config, ListDataSource([Prompt(i, p) for i, p in enumerate(prompts)]))
        loop = RolloutLoop(engine, sched, reward)
        out = []
        for v in range(2):
            out.append(await loop.run_step(v))
            await engine.update_weights({}, v + 1)
        return out

    async def embedded():
        model = LlamaForCausalLM(ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1,
                                             max_position_embeddings=128, eos_token_id=None))
        model.init_weights(0)
        core = EngineCore(model, EngineConfig(num_blocks=128, block_size=8, max_num_seqs=16,
                                              memory_tag_prefix="sim-agree-"))
        async with AsyncEngine(core) as engine:
            return await drive(_ForcedLengths(engine, table, prompt_len=4))

    async def simulated():
        async with SimulatedEngine(_one(replace(UNIT, max_num_seqs=16)), _TableLengths(table)) as engine:
            return await drive(engine)

    real, sim = asyncio.run(embedded()), asyncio.run(simulated())
    assert _accounting(real) == _accounting(sim)
    assert _accounting(sim)[0][0] == 4  # the step-0 partials exist, so the comparison is not vacuous


def test_run_summary_is_a_ratio_of_sums_over_the_steady_steps():
    from april_ext.sim.runner import _summarize

    result = _tiny_run()
    bound, s0, s1 = result.bound, *result.steps  # bound 4 tok/s
    # Two steady steps: 4 tokens in 1 s (least time 1 s: efficiency 1.0, bubble 0) and 6 tokens in 3 s (least
    # time 1.5 s: efficiency 0.5, bubble 0.4). The run made 10 tokens in 4 s = 2.5 tok/s against a bound of
    # 10 / 2.5 s = 4 tok/s: efficiency 0.625, not the 0.75 mean of the step ratios; the bubble is
    # (0 x 1 + 0.4 x 3) / 4 = 0.3 of the time. Token ratios weigh by the trained tokens: partial
    # (0.8 x 10 + 0.2 x 30) / 40 = 0.35.
    a = replace(s1, rollout_s=1.0, generated_tokens=4, efficiency=1.0, bubble_fraction=0.0, trained_tokens=10,
                partial_token_ratio=0.8, re_prefill_time_fraction=0.2, least_time_s=1.0, ceiling_time_s=1.0)
    b = replace(s1, rollout_s=3.0, generated_tokens=6, efficiency=0.5, bubble_fraction=0.4, trained_tokens=30,
                partial_token_ratio=0.2, re_prefill_time_fraction=0.0, least_time_s=1.5, ceiling_time_s=2.0)
    summary = _summarize([s0, a, b], np.array([2, 4, 5, 5]), bound)
    assert summary["tokens_per_s"] == pytest.approx(2.5)
    assert summary["efficiency"] == pytest.approx(0.625) and summary["ceiling_efficiency"] == pytest.approx(0.75)
    assert summary["efficiency"] * summary["bound_tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
    # With no warm-up step the first step counts too.
    assert _summarize([a, b], np.array([2, 4, 5, 5]), bound, warmup_steps=0)["efficiency"] == pytest.approx(0.625)
    assert summary["bubble_fraction"] == pytest.approx(0.3)
    assert summary["re_prefill_time_fraction"] == pytest.approx(0.05)
    assert summary["partial_token_ratio"] == pytest.approx(0.35)
    assert summary["rollout_s"] == pytest.approx(2.0)
