"""slime's wave-refill DAPO baseline (april_ext.sim.waves) on hand-built workloads: when waves launch, what is
accepted, what is thrown away."""

from __future__ import annotations

import asyncio

import pytest

from april_ext.algorithms.filters import reject_uniform_groups
from april_ext.errors import ConfigError
from april_ext.sim import ClusterConfig, CostModel, SimulatedEngine, TraceLengths
from april_ext.sim.runner import SimConfig, simulate
from april_ext.sim.tokens import SyntheticPrompts, as_ids, prompt_key
from april_ext.sim.waves import WaveRollout

# Every decode step costs 1 s whatever the batch (64 slots): a sample of L tokens finishes L seconds after launch.
COST = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_kv_token_s=0.0, prefill_per_token_s=0.0,
                 kv_capacity_tokens=10_000, max_num_seqs=64)
C, W = True, False
# Prompt p replays row p: (lengths, correct). N = 2, n = 2: rows 1, 2 and 3 have equal rewards (rejected).
RELAUNCH = TraceLengths([[2, 3], [1, 2], [2, 2], [3, 3], [2, 3], [9, 9]],
                        correct=[[C, W], [C, C], [W, W], [C, C], [C, W], [C, W]])
SURPLUS = TraceLengths([[1, 1], [3, 3], [3, 3], [3, 3]], correct=[[C, C], [C, W], [C, W], [C, W]])


class _Recording(SimulatedEngine):
    """Notes (virtual time, prompt index) of every request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.launches: list[tuple[float, int]] = []

    def generate(self, input_ids, params, request_id):
        self.launches.append((self.clock(), prompt_key(as_ids(input_ids))))
        return super().generate(input_ids, params, request_id)


def _steps(lengths: TraceLengths, steps: int = 1):
    async def run():
        async with _Recording(ClusterConfig(cost=COST, num_engines=1), lengths) as engine:
            waves = WaveRollout(engine, SyntheticPrompts(50, 4), rollout_batch_size=2, n_samples_per_prompt=2,
                                over_sampling_batch_size=2, max_response_len=16, group_filter=reject_uniform_groups)
            out = []
            for step in range(steps):
                out.append(await waves.run_step(step))
                await engine.update_weights({}, step + 1)
            return out, engine.launches
    return asyncio.run(run())


def _groups(launches: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """(time, prompt) of each group launch (its n = 2 requests go out together)."""
    assert launches[0::2] == launches[1::2]
    return launches[0::2]


def test_a_wave_is_launched_exactly_when_in_flight_plus_accepted_fall_below_n():
    (step,), launches = _steps(RELAUNCH)
    # t = 0: wave of prompts 0, 1 (R = 2). t = 2: prompt 1 rejected, R = 1 < 2: a wave of 2 (R = 3). t = 3:
    # prompt 0 accepted (R stays 3). t = 4: prompt 2 rejected (R = 2: no wave). t = 5: prompt 3 rejected (R = 1):
    # a wave of prompts 4, 5. t = 8: prompt 4 accepted, the second of N = 2: prompt 5 is aborted at 3 tokens.
    assert _groups(launches) == [(0.0, 0), (0.0, 1), (2.0, 2), (2.0, 3), (5.0, 4), (5.0, 5)]
    m = step.metrics
    assert (m.wall_s, m.time_to_done_s, m.batch_groups, m.response_lens) == (8.0, 8.0, 2, [2, 3, 2, 3])
    assert (m.scheduler["waves"], m.scheduler["groups_launched"], m.scheduler["groups_filtered"]) == (3, 6, 3)
    # Tokens: 5 + 3 + 4 + 6 + 5 accepted or rejected, plus 2 x 3 of prompt 5 aborted and discarded.
    assert (m.generated_tokens, m.aborted_samples, m.scheduler["stale_tokens_discarded"]) == (29, 2, 6)
    assert m.scheduler["groups_discarded"] == 1 and m.scheduler["batch_response_tokens"] == 10
    assert list(step.finish_times) == [2.0, 3.0, 7.0, 8.0]


def test_groups_completed_beyond_n_are_discarded_and_counted():
    (step,), launches = _steps(SURPLUS)
    # t = 1: prompt 0 rejected, a wave of prompts 2, 3. t = 3: prompt 1 accepted. t = 4: prompts 2 and 3 complete
    # together: 2 (launched first) is the N-th, 3 is surplus, thrown away; nothing is left to abort.
    assert _groups(launches) == [(0.0, 0), (0.0, 1), (1.0, 2), (1.0, 3)]
    m = step.metrics
    assert (m.wall_s, m.batch_groups, m.aborted_samples, m.generated_tokens) == (4.0, 2, 0, 20)
    assert (m.scheduler["surplus_groups"], m.scheduler["groups_discarded"], m.scheduler["stale_tokens_discarded"]) == (
        1, 1, 6)


def test_every_step_trains_exactly_n_groups_and_starts_from_fresh_prompts():
    steps, launches = _steps(RELAUNCH, steps=3)
    assert [s.metrics.batch_groups for s in steps] == [2, 2, 2]
    assert [len(s.metrics.response_lens) for s in steps] == [4, 4, 4]
    # No partial is reused: every request of a step is a new prompt (slime does not return aborted prompts).
    prompts = [p for _, p in _groups(launches)]
    assert prompts == list(range(len(prompts)))
    assert all(s.metrics.scheduler["carried_token_ratio"] == 0.0 for s in steps)


def _run(dapo_baseline: str, lengths: TraceLengths = RELAUNCH):
    return simulate(SimConfig(cluster=ClusterConfig(cost=COST, num_engines=1), lengths=lengths, mode="baseline",
                              algorithm="dapo", dapo_baseline=dapo_baseline, rollout_batch_size=2,
                              n_samples_per_prompt=2, max_response_len=16, steps=2, prompt_len=4, dataset_size=50))


def test_simulate_runs_the_wave_baseline_and_the_replacing_one_is_slower_here():
    waves, replacing = _run("waves"), _run("replace")
    s = waves.steps[0]
    assert (s.rollout_s, s.generated_tokens, s.trained_tokens, s.discarded_tokens, s.filtered_groups) == (
        8.0, 29, 10, 6, 3)
    assert s.tokens_per_s == pytest.approx(29 / 8) and s.aborted_samples == 2
    assert waves.steps[1].discarded_tokens == 6  # step 1 replays the same rows (prompts 6-11)
    assert waves.summary["useful_tokens_per_s"] == pytest.approx((29 - 6) / 8)
    # Replacing one group per rejection: prompt 2 at t = 2, prompt 3 at 4, prompt 4 at 7, accepted at 10.
    r = replacing.steps[0]
    assert (r.rollout_s, r.generated_tokens, r.discarded_tokens, r.aborted_samples) == (10.0, 23, 0, 0)
    assert s.efficiency <= 1.0 and s.least_time_s <= s.rollout_s


def test_the_dapo_baseline_setting_is_checked():
    with pytest.raises(ConfigError, match=r"SimConfig.dapo_baseline='slime' is not allowed: one of \('replace', "
                                          r"'waves'\)"):
        SimConfig(dapo_baseline="slime")
    assert SimConfig(mode="baseline", algorithm="dapo", dapo_baseline="waves").waves_baseline
    assert not SimConfig(mode="baseline", algorithm="grpo", dapo_baseline="waves").waves_baseline
    assert not SimConfig(mode="april-batch", algorithm="dapo", dapo_baseline="waves").waves_baseline


def test_simulate_command_selects_the_wave_baseline(capsys):
    from april_ext.cli import main

    args = ["simulate", "--cluster", "h100-qwen3-4b", "--num-engines", "2", "--lengths", "deepscaler",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--max-response-len", "2048", "--steps", "2",
            "--algorithm", "dapo", "--modes", "baseline", "--dapo-baseline", "waves"]
    assert main(args) == 0
    assert "baseline" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*args[:-1], "slime"])
