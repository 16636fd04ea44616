"""Agentic rollouts in the simulator: the turn model's draws, tool waits on the engine (no decode slot, the clock by
hand), an abort during a tool call, APRIL against the synchronous baseline, and the validation messages."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest

from april_ext.batch import FinishReason
from april_ext.cli import main
from april_ext.errors import AprilError, ConfigError
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sim import SimConfig, SimulatedEngine, cluster_preset, simulate
from april_ext.sim.tokens import CORRECT_TOKEN, synthetic_prompt
from april_ext.sim.turns import TURN_PRESETS, TurnModel, turn_preset


def _phi(x: float) -> float:
    return 0.5 * (1 + math.erf(x / math.sqrt(2)))


def _close(observed: float, expected: float, n: int) -> None:
    """A frequency from n independent draws within 4 standard errors of its expected probability."""
    assert abs(observed - expected) <= 4 * math.sqrt(expected * (1 - expected) / n) + 1e-12, (observed, expected)


@pytest.mark.parametrize("name", sorted(TURN_PRESETS))
def test_turn_draws_match_the_preset(name):
    model = turn_preset(name, seed=3)
    plans = [model.plan(key, i, 0) for key in range(500) for i in range(8)]
    n = len(plans)
    turns = np.array([p.turns for p in plans])
    # round(median * exp(sigma z)) clipped to [1, max_turns]: P(turns <= k) = Phi(ln((k + 0.5) / median) / sigma).
    for k in range(1, model.max_turns):
        _close(float(np.mean(turns <= k)), _phi(math.log((k + 0.5) / model.median_turns) / model.turn_sigma), n)
    assert turns.min() >= 1 and turns.max() <= model.max_turns
    latency = np.concatenate([p.tool_latency_s for p in plans])
    tokens = np.concatenate([p.turn_tokens for p in plans])
    observations = np.concatenate([p.observation_tokens for p in plans])
    assert latency.size == observations.size == turns.sum() - n and tokens.size == turns.sum()
    _close(float(np.mean(latency <= model.tool_median_s)), 0.5, latency.size)
    _close(float(np.mean(latency > model.tool_p99_s)), 0.01, latency.size)
    _close(float(np.mean(tokens <= model.turn_tokens_median)), 0.5, tokens.size)
    _close(float(np.mean(observations < model.observation_median)), 0.5, observations.size)
    assert observations.max() <= model.max_observation_tokens
    # A prompt's trajectories share its accuracy: the standard error is over prompts.
    per_prompt = np.array([p.correct for p in plans], float).reshape(500, 8).mean(axis=1)
    assert abs(per_prompt.mean() - model.accuracy_mean) <= 4 * per_prompt.std() / math.sqrt(500)
    # Deterministic in the seed; a sample's length is its model tokens.
    assert model.plan(7, 2, 0) == turn_preset(name, seed=3).plan(7, 2, 5)
    assert model.plan(7, 2, 0) != turn_preset(name, seed=4).plan(7, 2, 0)
    assert model.draw(7, 2, 0).length == model.plan(7, 2, 0).model_tokens


def _fixed(**overrides: object) -> TurnModel:
    """3 turns of 100 tokens, tool calls of exactly 5 s inserting 50 env tokens, always correct."""
    settings = dict(median_turns=3, turn_sigma=0.0, max_turns=3, turn_tokens_median=100, turn_tokens_sigma=0.0,
                    tool_median_s=5.0, tool_p99_s=5.0, observation_median=50, observation_sigma=0.0,
                    max_observation_tokens=1000, accuracy_mean=1.0, name="fixed")
    return TurnModel(**{**settings, **overrides})  # type: ignore[arg-type]


PROMPT_LEN = 64


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


def test_a_trajectory_holds_no_decode_slot_while_its_tool_runs():
    cluster = cluster_preset("h100-qwen3-8b", num_engines=1)
    cost = cluster.cost

    async def run():
        async with SimulatedEngine(cluster, _fixed()) as engine:
            prompt = synthetic_prompt(0, PROMPT_LEN)
            chunks = []
            async for chunk in engine.generate(prompt, SamplingParams(max_new_tokens=1000), "a"):
                chunks.append(chunk)
                if chunk.finish_reason is None:  # a tool call: the consumer holds the clock here
                    replica = engine.replicas[0]
                    assert engine.tool_waiting() == ["a"]
                    assert not replica.running and not replica.waiting and not replica.prefilling
                    assert engine.stats().running == 0 and replica.kv == 0
            return chunks, engine.clock(), engine.counters()

    chunks, clock, c = asyncio.run(run())
    assert [len(ch.token_ids) for ch in chunks] == [100, 100, 100]  # model tokens only: no env token delivered
    assert chunks[-1].finish_reason == FinishReason.STOP and chunks[-1].token_ids[-1] == CORRECT_TOKEN
    assert c.tool_calls == 2 and c.finished == 1 and c.decode_steps == 300
    assert c.env_prefill_tokens == 100 and c.recompute_tokens == 0  # each observation on its cached context
    # The clock by hand: prompt prefill, turn, tool, observation prefill, turn, tool, observation prefill, turn.
    expected = cost.prefill_fixed_s + cost.prefill_time(0, PROMPT_LEN)
    context = PROMPT_LEN
    for turn in range(3):
        expected += cost.decode_time(1, context, 100)
        context += 100
        if turn < 2:
            expected += 5.0 + cost.prefill_fixed_s + cost.prefill_time(context, context + 50)
            context += 50
    assert clock == pytest.approx(expected, rel=1e-9)
    assert c.decode_time == pytest.approx(sum(cost.decode_time(1, PROMPT_LEN + 150 * t, 100) for t in range(3)))


def test_abort_mid_tool_keeps_the_trajectory_waiting_and_it_completes_with_every_turn():
    cluster = cluster_preset("h100-qwen3-8b", num_engines=1)

    async def run():
        async with SimulatedEngine(cluster, _fixed()) as engine:
            prompt = synthetic_prompt(0, PROMPT_LEN)
            stream = engine.generate(prompt, SamplingParams(max_new_tokens=1000), "a")
            first = await stream.__anext__()
            called_at = engine.clock()
            (out,) = await engine.abort(["a"])
            rest = await _collect(stream)
            assert rest[-1].finish_reason == FinishReason.ABORT and not rest[-1].token_ids
            assert out.token_ids == first.token_ids and len(out.token_ids) == 100
            await engine.update_weights({}, 1)  # the step boundary: the tool keeps running
            resumed = engine.generate(prompt + out.token_ids, SamplingParams(max_new_tokens=900), "b")
            task = asyncio.ensure_future(_collect(resumed))
            await asyncio.sleep(0)
            while not engine.tool_waiting():
                await asyncio.sleep(0)
            assert engine.tool_waiting() == ["b"] and engine.clock() == called_at  # still waiting on the tool
            chunks = await task
            return called_at, chunks, engine, engine.counters()

    called_at, chunks, engine, c = asyncio.run(run())
    tokens = [t for ch in chunks for t in ch.token_ids]
    assert len(tokens) == 200 and chunks[-1].finish_reason == FinishReason.STOP and tokens[-1] == CORRECT_TOKEN
    assert c.tool_calls == 2 and c.finished == 1  # the second tool call ran after the resume
    # The resume prefilled prompt + partial + the first observation once, after the tool's 5 s.
    assert c.resume_prefill_tokens == PROMPT_LEN + 100 + 50
    cost = cluster.cost
    resume_starts = called_at + 5.0
    assert engine.clock() > resume_starts + 5.0 + cost.decode_time(1, PROMPT_LEN + 150, 200)


@pytest.mark.parametrize("name", sorted(TURN_PRESETS))
def test_april_gains_over_the_synchronous_baseline_with_tool_latency(name):
    small = dict(cluster="h100-qwen3-8b", num_engines=2, lengths=name, rollout_batch_size=8, n_samples_per_prompt=4,
                 over_sampling_batch_size=16, steps=3, seed=1)
    baseline = simulate(SimConfig(**small, mode="baseline"))  # type: ignore[arg-type]
    april = simulate(SimConfig(**small, mode="april-batch"))  # type: ignore[arg-type]
    for result in (baseline, april):
        assert result.summary["tool_calls_per_step"] > 0 and result.summary["env_prefill_time_fraction"] > 0
        assert all(0 < s.efficiency <= 1 and s.ceiling_efficiency <= 1 for s in result.steps)
    assert april.summary["partial_token_ratio"] > 0 and baseline.summary["partial_token_ratio"] == 0
    assert april.summary["tokens_per_s"] > 1.2 * baseline.summary["tokens_per_s"]
    assert april.summary["efficiency"] > baseline.summary["efficiency"]


def test_simulate_prints_the_agentic_table(capsys):
    args = ["simulate", "--num-engines", "2", "--lengths", "search-agent", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "4", "--over-sampling-batch-size", "8", "--steps", "2",
            "--modes", "baseline,april-batch"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "agentic search-agent" in out and "never idle while tools run" in out
    assert "tools/step" in out and "envpre" in out and "april-batch" in out
    assert main([*args, "--mixed-chunk"]) == 2
    err = capsys.readouterr().err
    assert "SimConfig.mixed_chunk=True is not allowed with the agentic lengths 'search-agent'" in err


def test_bad_agentic_settings_name_what_is_wrong_and_what_is_allowed():
    with pytest.raises(ConfigError, match=r"TurnModel.median_turns=0 is not allowed: a number in \[1, inf\]"):
        _fixed(median_turns=0)
    with pytest.raises(ConfigError, match=r"TurnModel.max_turns=2 is not allowed: an int >= median_turns"):
        _fixed(max_turns=2)
    with pytest.raises(ConfigError, match=r"TurnModel.max_observation_tokens=-1 is not allowed: an int >= 0"):
        _fixed(max_observation_tokens=-1)
    with pytest.raises(ConfigError, match=r"LognormalLatency.p99_s must be >= median_s"):
        _fixed(tool_p99_s=1.0)
    with pytest.raises(ConfigError, match=r"agentic preset 'nope' is not known: one of \['search-agent', 'swe-"):
        turn_preset("nope")
    with pytest.raises(ConfigError, match=r"SimConfig.lengths='nope' is not allowed: .*search-agent, swe-agent"):
        SimConfig(lengths="nope")
    with pytest.raises(ConfigError, match=r"SimConfig.mixed_chunk=True is not allowed with the agentic lengths"):
        SimConfig(lengths="swe-agent", mixed_chunk=True)
    with pytest.raises(ConfigError, match=r"agentic turns are modelled with separate prefill only"):
        SimulatedEngine(cluster_preset("h100-qwen3-8b", mixed_chunk=True), _fixed())
    assert issubclass(ConfigError, AprilError)
