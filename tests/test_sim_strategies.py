"""Simulator side of the long-tail strategies: divided rollout in the simulated engine (continuations routed by KV
load, a prefix cache keyed by weight version), the tail latency, the Seer-shaped length preset and the strategy
setting of SimConfig and `april-ext simulate`."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import numpy as np
import pytest

from april_ext.batch import FinishReason
from april_ext.cli import main
from april_ext.errors import ConfigError
from april_ext.protocol import SamplingParams
from april_ext.sim import (
    ClusterConfig,
    CostModel,
    SimulatedEngine,
    TraceLengths,
    length_preset,
)
from april_ext.sim.metrics import tail_latency
from april_ext.sim.replica import Replica
from april_ext.sim.runner import SimConfig, compare_strategies
from april_ext.sim.tokens import synthetic_prompt
from april_ext.strategies import STRATEGIES

# 1 s per decode step, 0.5 s per prefilled token, nothing else.
COST = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, prefill_per_token_s=0.5,
                 kv_capacity_tokens=10_000, max_num_seqs=4)


async def _tokens(engine: SimulatedEngine, ids, rid: str, max_new: int) -> tuple[list[int], FinishReason]:
    out: list[int] = []
    async for chunk in engine.generate(ids, SamplingParams(max_new_tokens=max_new), rid):
        out += chunk.token_ids
        if chunk.finish_reason is not None:
            return out, FinishReason(chunk.finish_reason)
    raise AssertionError("stream ended without a finish reason")


# ---------------------------------------------------------------------------------------------- tail latency

def test_tail_latency_is_the_share_of_the_step_after_ninety_percent_finished():
    times = np.arange(10.0)  # 9 of 10 samples have finished at t = 8: the last 10% take 2 of 10 s
    assert tail_latency(times, 0.0, 10.0) == pytest.approx(0.2)
    # Samples finished before the step began count at its start; unknown times are left out.
    assert tail_latency(np.array([-5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, 7.0]), 0.0, 10.0) == 1.0
    assert tail_latency(np.array([1.0, math.nan, 3.0, 5.0]), 0.0, 10.0) == pytest.approx(0.5)
    assert math.isnan(tail_latency(np.array([]), 0.0, 10.0))


def test_a_run_reports_the_tail_latency_of_its_steps():
    from april_ext.sim.runner import simulate

    # One group of 10 samples of 1..9 and 20 tokens decoding together at 1 s per step: the 9th finishes at t = 9,
    # the step ends at t = 20, so the last 10% of the samples take 11 of its 20 s.
    lengths = TraceLengths([[*range(1, 10), 20]])
    config = SimConfig(cluster=ClusterConfig(cost=replace(COST, prefill_per_token_s=0.0, max_num_seqs=16),
                                             num_engines=1),
                       lengths=lengths, mode="baseline", rollout_batch_size=1, n_samples_per_prompt=10,
                       max_response_len=32, steps=2, prompt_len=4, dataset_size=50)
    result = simulate(config)
    assert [(s.rollout_s, s.tail_latency) for s in result.steps] == [(20.0, pytest.approx(0.55))] * 2
    assert result.summary["tail_latency"] == pytest.approx(0.55)


# ---------------------------------------------------------------------------------------------- divided rollout

def test_a_continuation_on_the_replica_holding_its_prefix_pays_no_prefill():
    prompt = synthetic_prompt(0, 4)

    async def run():
        async with SimulatedEngine(ClusterConfig(cost=COST, num_engines=2), TraceLengths([[10]])) as engine:
            first, reason = await _tokens(engine, prompt, "a", 4)  # prefill 2 s, 4 steps: a chunk boundary at t = 6
            assert (reason, len(first), engine.clock()) == (FinishReason.LENGTH, 4, 6.0)
            assert engine.finish_time(list(prompt) + first) == 6.0  # taken out of the record
            rest, reason = await _tokens(engine, list(prompt) + first, "a2", 6)
            return first, rest, reason, engine.clock(), engine.counters()

    first, rest, reason, now, counters = asyncio.run(run())
    assert reason == FinishReason.STOP and len(first) + len(rest) == 10  # the same sample, to its length
    assert now == 12.0  # 6 decode steps, no prefill
    assert (counters.continuations, counters.prefix_hit_tokens, counters.continuation_prefill_tokens) == (1, 8, 0)
    assert counters.resume_prefill_tokens == 0 and counters.prefill_tokens == 4


def test_a_continuation_goes_to_the_replica_with_the_least_kv_and_pays_the_prefill_there():
    # "a" (10 tokens, cut at 4) runs on replica 0, "b" (50 tokens) on replica 1. When "a" returns, "c" with a
    # 40-token prompt takes replica 0 (fewest requests); the continuation of "a" then goes to replica 1, whose KV
    # is smaller, away from its cached prefix: it pays the prefill of prompt + partial (8 tokens, 4 s).
    prompt = synthetic_prompt(0, 4)

    async def run():
        async with SimulatedEngine(ClusterConfig(cost=COST, num_engines=2),
                                   TraceLengths([[10], [50], [50]])) as engine:
            long = asyncio.ensure_future(_tokens(engine, synthetic_prompt(1, 4), "b", 100))
            first, _ = await _tokens(engine, prompt, "a", 4)
            _, cont = await asyncio.gather(_tokens(engine, synthetic_prompt(2, 40), "c", 100),
                                           _tokens(engine, list(prompt) + first, "a2", 6))
            await long
            return first, cont, engine

    first, (rest, reason), engine = asyncio.run(run())
    assert reason == FinishReason.STOP and len(first) + len(rest) == 10
    c = engine.counters()
    assert (c.continuations, c.prefix_hit_tokens, c.continuation_prefill_tokens) == (1, 0, 8)
    assert [r.counters.continuations for r in engine.replicas] == [0, 1]
    assert c.resume_prefill_tokens == 0  # a continuation is not counted as an abort's resume


def test_a_weight_update_empties_the_prefix_cache():
    prompt = synthetic_prompt(0, 4)

    async def run():
        async with SimulatedEngine(ClusterConfig(cost=COST, num_engines=1), TraceLengths([[10]])) as engine:
            first, _ = await _tokens(engine, prompt, "a", 4)
            await engine.update_weights({}, 1)
            t0 = engine.clock()
            await _tokens(engine, list(prompt) + first, "a2", 6)
            return engine.clock() - t0, engine.counters()

    elapsed, counters = asyncio.run(run())
    assert elapsed == pytest.approx(0.5 * 8 + 6)  # the prefix of version 0 is no hit under version 1
    # Continued under other weights it is a resume, as the scheduler counts it (re-prefill, in the ceiling bound).
    assert (counters.continuations, counters.prefix_hit_tokens, counters.continuation_prefill_tokens) == (0, 0, 0)
    assert counters.resume_prefill_tokens == 8


def test_a_divided_rollout_run_continues_each_chunk_on_its_cached_prefix():
    from april_ext.sim.runner import simulate

    # One engine, no prefill cost, one group of 10 and 3 tokens in 4-token chunks: the long sample comes back at 4
    # and 8 tokens and continues twice on its cached prefix (contexts 4 + 4 and 4 + 8), ending at t = 10 as one
    # request would.
    config = SimConfig(cluster=ClusterConfig(cost=replace(COST, prefill_per_token_s=0.0), num_engines=1),
                       lengths=TraceLengths([[10, 3]]), rollout_batch_size=1, n_samples_per_prompt=2,
                       over_sampling_batch_size=1, chunk_tokens=4, max_response_len=16, steps=1, warmup_steps=0,
                       prompt_len=4, dataset_size=10)
    [step] = simulate(config).steps
    assert (step.rollout_s, sorted(step.response_lens)) == (10.0, [3, 10])
    assert (step.chunk_returns, step.continuations, step.continuation_tokens) == (2, 2, 8 + 12)
    assert (step.prefix_hit_tokens, step.continuation_prefill_tokens, step.re_prefill_tokens) == (20, 0, 0)
    # Predictions at each sample's start (its chunks keep it): no history, both the cap / 2 = 8; the long one's
    # last chunk (its sibling's 3, raised to its length + 1 = 9) is not graded. One prediction for both: no rank.
    assert step.prediction_samples == 2 and math.isnan(step.prediction_rank_corr)


@pytest.mark.parametrize("restart", [False, True])
def test_tail_batching_runs_are_reported_round_by_round(restart):
    from april_ext.sim.runner import simulate

    # Groups alternate [2, 2] and [10, 10]; N = 1, N' = 2. Short round 0 takes the short group at t = 2 and sends
    # the long one (2 tokens each) to the long queue; round 1 is a long round of that group alone: 8 tokens each
    # left with partials kept (april_tail), all 10 again from the prompt (tail_batching_restart: rollpacker's
    # schedule without its extra samples).
    config = SimConfig(cluster=ClusterConfig(cost=replace(COST, prefill_per_token_s=0.0), num_engines=1),
                       lengths=TraceLengths([[2, 2], [10, 10]]), rollout_batch_size=1, n_samples_per_prompt=2,
                       over_sampling_batch_size=2, max_response_len=16, steps=3, warmup_steps=0, prompt_len=4,
                       dataset_size=10, tail_batching=True, tail_batching_restart=restart)
    result = simulate(config)
    s0, s1, _ = result.steps
    assert [(s.long_round, s.long_queue_groups) for s in result.steps] == [(False, 1), (True, 0), (False, 1)]
    assert (s0.rollout_s, s0.response_lens) == (2.0, [2, 2])
    assert (s1.rollout_s, s1.response_lens) == ((10.0, [10, 10]) if restart else (8.0, [10, 10]))
    assert s1.offpolicy_token_ratio == (0.0 if restart else pytest.approx(0.2))
    assert s1.discarded_tokens == (2 * 2 if restart else 0)  # the restart throws the short round's tokens away
    assert result.summary["long_round_share"] == pytest.approx(1 / 3)


def test_rollpacker_over_provisions_samples_keeps_n_and_counts_the_discarded_ones():
    from april_ext.sim.runner import simulate

    # The trace above with rollpacker_extra (n = 2: one extra sample per group in short rounds).
    config = SimConfig(cluster=ClusterConfig(cost=replace(COST, prefill_per_token_s=0.0), num_engines=1),
                       lengths=TraceLengths([[2, 2], [10, 10]]), rollout_batch_size=1, n_samples_per_prompt=2,
                       over_sampling_batch_size=2, max_response_len=16, steps=3, warmup_steps=0, prompt_len=4,
                       dataset_size=10, strategy="rollpacker_extra")
    assert config.scheduler_config().tail_extra_samples == 1
    result = simulate(config)
    assert [s.response_lens for s in result.steps] == [[2, 2], [10, 10], [2, 2]]
    assert [s.long_round for s in result.steps] == [False, True, False]
    assert result.steps[0].discarded_tokens > 0  # the short round's extra samples (no restart happened yet)


def test_the_prefix_cache_lives_in_free_kv_and_evicts_the_oldest():
    replica = Replica(0, replace(COST, kv_capacity_tokens=100))
    replica.cache_prefix(b"a", 60)
    replica.cache_prefix(b"b", 30)
    assert list(replica.prefix_cache) == [b"a", b"b"]
    replica.cache_prefix(b"c", 30)  # 120 tokens do not fit in 100
    assert list(replica.prefix_cache) == [b"b", b"c"]
    replica.kv = 50  # admitted requests take KV: the cache shrinks to what they leave
    replica.admit()
    assert list(replica.prefix_cache) == [b"c"]


# ---------------------------------------------------------------------------------------------- Seer-shaped lengths

def test_the_seer_preset_has_long_generations_and_correlated_siblings():
    model = length_preset("seer-long-cot")
    lens = np.minimum([[model.draw(k, i, 0).length for i in range(16)] for k in range(800)], 65536)
    assert 15_000 < lens.mean() < 30_000  # tens of thousands of tokens
    within, batch = lens.std(axis=1, ddof=1).mean(), lens.std()
    assert within < 0.5 * batch  # siblings are alike: a prediction from them can work
    siblings = (lens.sum(axis=1, keepdims=True) - lens) / 15
    ranks = [np.argsort(np.argsort(x.ravel())) for x in (siblings, lens)]
    assert np.corrcoef(*ranks)[0, 1] > 0.8
    assert 0.01 < np.mean(lens >= 65536) < 0.1  # a tail at the cap


# ---------------------------------------------------------------------------------------------- strategy setting

def test_a_strategy_sets_the_settings_left_at_their_defaults():
    seer = SimConfig(strategy="seer", max_response_len=8000)
    config = seer.scheduler_config()
    assert (config.over_sampling_batch_size, config.dispatch_order, config.chunk_tokens) == (
        32, "longest_predicted_first", 1000)
    assert seer.over_sampling_batch_size == 32  # N' resolves with the strategy's
    given = SimConfig(strategy="seer", chunk_tokens=700, over_sampling_batch_size=48).scheduler_config()
    assert (given.chunk_tokens, given.over_sampling_batch_size, given.dispatch_order) == (
        700, 48, "longest_predicted_first")
    assert SimConfig(strategy="april_carry").scheduler_config().step_boundary == "carry"
    assert SimConfig(strategy="rollpacker", mode="april-continuous").scheduler_config().tail_batching
    # A setting given may rely on the strategy's (tail_extra_samples on tail_batching).
    assert SimConfig(strategy="rollpacker", tail_extra_samples=1).scheduler_config().tail_extra_samples == 1
    plain = SimConfig().scheduler_config()
    assert (plain.dispatch_order, plain.chunk_tokens, plain.tail_batching) == ("fifo", None, False)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_makes_a_valid_run_config(name):
    for mode in ("april-batch", "april-continuous", "april-adaptive"):
        SimConfig(strategy=name, mode=mode).scheduler_config(engine_capacity=64)


def test_the_strategy_is_checked_and_the_baseline_stays_the_reference():
    with pytest.raises(ConfigError, match="SimConfig.strategy='fastest' is not allowed: None or one of april"):
        SimConfig(strategy="fastest")
    with pytest.raises(ConfigError, match="with mode 'baseline'"):
        SimConfig(strategy="seer", mode="baseline")
    with pytest.raises(ConfigError, match="at least one APRIL mode"):
        compare_strategies(("seer",), ("baseline",))


SMALL = ["simulate", "--cluster", "h100-qwen3-4b", "--num-engines", "2", "--lengths", "deepscaler",
         "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--max-response-len", "4096", "--steps", "2",
         "--warmup-steps", "0"]


def test_simulate_compares_strategies_in_one_table(capsys):
    assert main([*SMALL, "--strategies", "april,seer,sortedrl"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[4:]]
    assert rows == ["baseline", "april", "seer", "sortedrl"]
    assert "tail" in out and "cont/step" in out
    with pytest.raises(SystemExit):
        main([*SMALL, "--strategies", "april,nope"])
    assert "a comma-separated subset of april" in capsys.readouterr().err


def test_simulate_runs_one_strategy_and_flags_win(capsys):
    from april_ext.cli import build_parser
    from april_ext.cli.simulate import config_from_args

    args = build_parser().parse_args([*SMALL, "--strategy", "seer", "--chunk-tokens", "300"])
    config = config_from_args(args).scheduler_config()
    assert (config.dispatch_order, config.chunk_tokens, config.over_sampling_batch_size) == (
        "longest_predicted_first", 300, 4)
    assert main([*SMALL, "--strategy", "sortedrl", "--modes", "baseline,april-batch"]) == 0
    assert "april-batch" in capsys.readouterr().out
