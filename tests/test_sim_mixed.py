"""Mixed chunked prefill in the simulator's cost model: roofline decode steps against a step-by-step sum, a
one-engine clock and its accounting computed by hand, chunk progress across events, aborts mid-prefill,
preemption, and the bound measured on the same engine model."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace

import numpy as np
import pytest

from april_ext.batch import FinishReason
from april_ext.errors import ConfigError
from april_ext.protocol import SamplingParams
from april_ext.sim import (
    ClusterConfig,
    CostModel,
    SimulatedEngine,
    TraceLengths,
    cluster_preset,
    length_preset,
)
from april_ext.sim.metrics import full_occupancy_bound
from april_ext.sim.replica import Replica, SimRequest, SimSample
from april_ext.sim.runner import SimConfig, simulate
from april_ext.sim.tokens import synthetic_prompt

# Weights read 0.5 s + 0.5 s overhead; 0.5 s compute per decoding sequence; 0.1 s per KV token read;
# prefill 0.25 s per token; 6 prefill tokens per mixed iteration.
MIXED = CostModel(decode_fixed_s=1.0, step_overhead_s=0.5, decode_per_seq_s=0.5, decode_per_kv_token_s=0.1,
                  prefill_per_token_s=0.25, kv_capacity_tokens=1000, mixed_chunk=True, chunked_prefill_size=6)


def _step(cost: CostModel, b: int, kv: int) -> float:
    """One decode-only roofline step, written out."""
    memory = cost.decode_fixed_s - cost.step_overhead_s + cost.decode_per_kv_token_s * kv
    return max(memory, cost.decode_per_seq_s * b) + cost.step_overhead_s


def _request(rid: str, context: int, new_total: int, is_resume: bool = False) -> SimRequest:
    sample = SimSample(uid=hash(rid) & 0xFFFF, prompt_len=context, target=new_total, correct=True)
    return SimRequest(request_id=rid, sample=sample, base=0, input_len=context, new_total=new_total,
                      finish=FinishReason.STOP, is_resume=is_resume, hasher=hashlib.blake2b(),
                      input_ids=np.zeros(context, np.int32))


def test_mixed_decode_time_is_the_sum_of_roofline_steps_and_steps_within_inverts_it():
    rng = np.random.default_rng(1)
    for per_seq in (4e-5, 6e-4):  # memory-bound throughout, and compute-bound until the KV grows
        cost = CostModel(decode_fixed_s=0.008, step_overhead_s=0.001, decode_per_seq_s=per_seq,
                         decode_per_kv_token_s=6e-8, prefill_per_token_s=3e-5, kv_capacity_tokens=400_000,
                         mixed_chunk=True)
        for _ in range(40):
            b, kv, m = int(rng.integers(1, 200)), int(rng.integers(0, 300_000)), int(rng.integers(0, 3000))
            steps = sum(_step(cost, b, kv + b * k) for k in range(m))
            assert cost.decode_time(b, kv, m) == pytest.approx(steps, rel=1e-9)
            t = cost.decode_time(b, kv, m)
            assert cost.steps_within(b, kv, t) == m
            assert cost.steps_within(b, kv, t - 1e-9 * max(t, 1)) == max(m - 1, 0)
    # Compute-bound at the start: 200 x 6e-4 = 0.12 s beats 0.007 + 6e-8 x 1000 (the first steps cost 0.121).
    assert cost.decode_time(200, 1000, 3) == pytest.approx(3 * 0.121)


def test_mixed_iteration_is_a_roofline_and_the_non_mixed_model_is_unchanged():
    # 2 decoding sequences over 10 KV tokens plus 4 prefill tokens reading a 3-token prefix.
    assert MIXED.iteration_time(2, 10, 4 * 0.25, 3) == pytest.approx(max(0.5 + 0.1 * 13, 1.0 + 1.0) + 0.5)
    assert MIXED.iteration_time(2, 30) == pytest.approx(0.5 + 3.0 + 0.5)  # memory-bound: the compute hides
    plain = replace(MIXED, mixed_chunk=False)
    assert plain.decode_time(2, 10, 3) == pytest.approx(3 * (1.0 + 1.0 + 1.0) + 0.1 * 2 * 3)
    preset = cluster_preset("h100-qwen3-8b").cost
    assert not preset.mixed_chunk and preset.chunked_prefill_size == 8192
    assert preset.weights_read_s == pytest.approx(8.19e9 * 2 / (3.35e12 * 0.7))
    assert cluster_preset("h100-qwen3-8b", mixed_chunk=True, chunked_prefill_size=4096).cost == replace(
        preset, mixed_chunk=True, chunked_prefill_size=4096)
    with pytest.raises(ConfigError, match="CostModel.step_overhead_s=2.0"):
        replace(MIXED, step_overhead_s=2.0)
    with pytest.raises(ConfigError, match="CostModel.chunked_prefill_size=0"):
        replace(MIXED, chunked_prefill_size=0)
    with pytest.raises(ConfigError, match="SimConfig.chunked_prefill_size=0"):
        SimConfig(mixed_chunk=True, chunked_prefill_size=0)


def test_mixed_clock_with_fixed_lengths_is_hand_computable():
    prompt = synthetic_prompt(0, 4)

    async def collect(engine, rid):
        out = []
        async for chunk in engine.generate(prompt, SamplingParams(max_new_tokens=100), rid):
            out.append((engine.clock(), len(chunk.token_ids), chunk.finish_reason))
        return out

    async def run():
        async with SimulatedEngine(ClusterConfig(cost=MIXED, num_engines=1), TraceLengths([[3, 3]])) as engine:
            a, b = await asyncio.gather(collect(engine, "a"), collect(engine, "b"))
            return a, b, engine.counters()

    a, b, c = asyncio.run(run())
    # Iteration 1, prefill only: a's 4 tokens and 2 of b's, 6 x 0.25 = 1.5 compute -> 1.5 + 0.5 = 2.0.
    # Iteration 2: a decodes (4 KV) with b's last 2 tokens (2 prefix tokens read): memory 0.5 + 0.1 x 6 = 1.1
    # beats compute 0.5 + 0.5 = 1.0, so b's prefill hides: 1.6, t = 3.6. Decode alone would take 1.4.
    # Then both decode over 9 and 11 KV tokens (memory 1.4, 1.6 -> 1.9, 2.1): a ends at 7.6 with 3 tokens.
    # b alone over 6 KV tokens: 1.1 + 0.5, ends at 9.2.
    assert a == [(pytest.approx(7.6), 3, FinishReason.STOP)]
    assert b == [(pytest.approx(9.2), 3, FinishReason.STOP)]
    assert c.prefill_tokens == 8 and c.decode_tokens == 6 and c.decode_steps == 4
    assert c.prefill_time == pytest.approx(2.0 + (1.6 - 1.4))  # what the chunks added to the iterations
    assert c.decode_time == pytest.approx(1.4 + 1.9 + 2.1 + 1.6)
    assert c.slot_time == pytest.approx(1.4 + 2 * 1.9 + 2 * 2.1 + 1.6)


def test_mixed_prefill_shares_are_charged_by_kind_and_progress_survives_events():
    rep = Replica(0, replace(MIXED, chunked_prefill_size=4))
    decoding = _request("d", 2, 50)
    rep.enqueue(decoding)
    rep.admit()
    rep.run_event()  # prefill d (2 tokens): max(0.5, 0.5) + 0.5
    assert rep.seg_t0 == pytest.approx(1.0) and rep.running == [decoding]
    resumed, fresh = _request("r", 6, 5, is_resume=True), _request("f", 2, 5)
    rep.enqueue(resumed)
    rep.enqueue(fresh)
    rep.admit()
    assert list(rep.prefilling) == [resumed, fresh] and rep.pending_kv == 8 and rep.kv == 2
    # Iteration: d decodes over 2 KV tokens, r prefills 4 of 6 tokens: compute 0.5 + 1.0 beats memory 0.7.
    t = rep.next_event()
    assert t == pytest.approx(1.0 + 2.0)
    rep.run_event()
    assert resumed.prefilled == 4 and decoding.generated == 1 and list(rep.prefilling) == [resumed, fresh]
    # Next: d over 3 KV tokens; r's last 2 (4 prefix tokens read) and f's 2: compute 0.5 + 1.0 = 1.5,
    # memory 0.5 + 0.1 x 7 = 1.2 -> 2.0; decode alone max(0.8, 0.5) + 0.5 = 1.3; 0.7 added, split 1:1.
    assert rep.next_event() == pytest.approx(3.0 + 2.0)
    rep.run_event()
    assert not rep.prefilling and rep.running == [decoding, resumed, fresh] and rep.kv == 4 + 6 + 2
    c = rep.counters
    assert c.resume_prefill_tokens == 6 and c.resume_prefill_time == pytest.approx((2.0 - 1.2) + 0.35)
    assert c.prefill_time == pytest.approx(1.0 + 0.8 + 0.7) and c.recompute_tokens == 0


def test_abort_and_flush_mid_prefill_release_the_reservation_and_preemption_takes_prefilling_first():
    rep = Replica(0, replace(MIXED, chunked_prefill_size=4, kv_capacity_tokens=40))
    a, b = _request("a", 6, 30), _request("b", 6, 30)
    rep.enqueue(a)
    rep.enqueue(b)
    rep.admit()
    rep.run_event()
    assert a.prefilled == 4 and rep.pending_kv == 12
    rep.sync(rep.seg_t0 + 0.1, finish_step=False)  # an abort arrives mid-iteration: the partial one is cut
    assert a.prefilled == 4
    rep.remove(b)
    assert rep.pending_kv == 6 and list(rep.prefilling) == [a] and not b.running
    rep.flush()
    assert rep.pending_kv == 0 and not rep.prefilling and list(rep.waiting) == [a]
    rep.admit()  # re-admitted after the flush: prefilled again from the start, counted as recomputation
    assert a.prefill_kind == "recompute" and a.prefilled == 0
    # Overflow: a decoding sequence grows while a newer one waits in prefill; the prefilling one yields.
    rep = Replica(0, replace(MIXED, kv_capacity_tokens=20, chunked_prefill_size=4))
    old, new = _request("o", 10, 30), _request("n", 9, 30)
    rep.enqueue(old)
    rep.admit()
    while rep.prefilling:  # 10 tokens in chunks of 4, 4, 2
        rep.run_event()
    rep.enqueue(new)
    rep.admit()
    assert rep.kv + rep.pending_kv == 19
    rep.run_event()  # old grows to 11: 11 + 9 reserved + 1 > 20; 20 is over the 19 admission limit
    assert rep.counters.preemptions == 1 and list(rep.waiting) == [new] and rep.running == [old]
    assert rep.pending_kv == 0 and rep.kv == 11 and not new.running


def test_the_bound_and_the_run_use_the_same_mixed_engine_model():
    config = SimConfig(cluster="h100-qwen3-4b", lengths="deepscaler", mode="april-continuous", num_engines=2,
                       rollout_batch_size=4, n_samples_per_prompt=4, over_sampling_batch_size=8,
                       max_response_len=2048, steps=2, mixed_chunk=True, chunked_prefill_size=2048)
    cluster = config.cluster_config()
    assert cluster.cost.mixed_chunk and cluster.cost.chunked_prefill_size == 2048
    result = simulate(config)
    lengths = length_preset("deepscaler", seed=0)
    expected = full_occupancy_bound(cluster, lengths, 2048, 256, (config.steps - 1) // 2)
    assert result.bound == expected
    plain = full_occupancy_bound(replace(config, mixed_chunk=False).cluster_config(), lengths, 2048, 256, 0)
    assert plain != expected  # the engine model changed the bound
    # A given ClusterConfig is switched to mixed chunk too, so the run and its bound cannot disagree.
    given = SimConfig(cluster=ClusterConfig(cost=replace(MIXED, mixed_chunk=False)), mixed_chunk=True)
    assert given.cluster_config().cost.mixed_chunk
    assert result.summary["tokens_per_s"] > 0 and all(s.generated_tokens > 0 for s in result.steps)
