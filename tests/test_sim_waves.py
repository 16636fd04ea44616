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


# ---------------------------------------------------------------- APRIL as slime runs it (--partial-rollout)

# N = 2, n = 2, N' = 4, no filter (GRPO). Prompt p replays row p; rows 2 and 3 are still running at t = 3.
PARTIAL = TraceLengths([[2, 2], [3, 3], [5, 9], [6, 4], [1, 1], [8, 8], [2, 2], [2, 2]])


class _Inputs(SimulatedEngine):
    """Notes (virtual time, prompt index, input length, max_new_tokens) of every request."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[tuple[float, int, int, int]] = []

    def generate(self, input_ids, params, request_id):
        ids = as_ids(input_ids)
        self.requests.append((self.clock(), prompt_key(ids), int(ids.size), params.max_new_tokens))
        return super().generate(input_ids, params, request_id)


def _april_steps(lengths: TraceLengths, steps: int):
    async def run():
        async with _Inputs(ClusterConfig(cost=COST, num_engines=1), lengths) as engine:
            waves = WaveRollout(engine, SyntheticPrompts(50, 4), rollout_batch_size=2, n_samples_per_prompt=2,
                                over_sampling_batch_size=4, max_response_len=16, group_filter=None,
                                partial_rollout=True)
            out = []
            for step in range(steps):
                out.append(await waves.run_step(step))
                await engine.update_weights({}, step + 1)
            return out, engine.requests, [g.prompt_index for g in waves.buffer]
    return asyncio.run(run())


def test_slime_april_buffers_the_unfinished_groups_and_resumes_them_first():
    (first, second), requests, buffered = _april_steps(PARTIAL, 2)
    # Step 0: prompts 0-3 at t = 0; 0 and 1 complete at t = 2 and 3 (N = 2): 2 and 3 are aborted at 3 tokens each.
    m = first.metrics
    assert (m.wall_s, m.batch_groups, m.response_lens, m.aborted_samples) == (3.0, 2, [2, 2, 3, 3], 4)
    assert m.generated_tokens == 2 + 2 + 3 + 3 + 4 * 3  # aborted tokens count: what the requests returned
    assert m.scheduler["stale_tokens_discarded"] == 0 and m.scheduler["buffered_groups"] == 2
    # Step 1 takes the buffered groups first (oldest first), then fresh prompts 4 and 5. Each resumes as
    # prompt + its 3 tokens with max_new_tokens 16 - 3; the sample of prompt 3 with 4 tokens ends at t = 4, the
    # group of prompt 4 completes at 4 (accepted first) and that of prompt 3 at 6 (second): prompts 2 and 5 go back.
    assert requests[8:] == [(3.0, 2, 7, 13), (3.0, 2, 7, 13), (3.0, 3, 7, 13), (3.0, 3, 7, 13),
                            (3.0, 4, 4, 16), (3.0, 4, 4, 16), (3.0, 5, 4, 16), (3.0, 5, 4, 16)]
    m = second.metrics
    # The batch in creation order, as slime sorts it: prompt 3's group, then prompt 4's.
    assert (m.wall_s, m.batch_groups, m.response_lens, m.resumed_requests) == (3.0, 2, [6, 4, 1, 1], 4)
    assert m.generated_tokens == (2 + 3) + (3 + 1) + 2 + (3 + 3)  # this step's tokens only
    assert m.scheduler["carried_token_ratio"] == pytest.approx(6 / 12)  # prompt 3's 2 x 3 tokens from step 0
    assert m.scheduler["staleness_histogram"] == [2, 2]
    assert m.scheduler["re_prefill_tokens"] == 4 * 7
    assert buffered == [2, 5]
    assert list(second.finish_times) == [6.0, 4.0, 4.0, 4.0]


def test_slime_april_keeps_a_buffered_groups_finished_samples():
    (_, _, third), requests, _ = _april_steps(PARTIAL, 3)
    # Prompt 2's first sample (5 tokens) finished in step 1: step 2 resumes only its second one (6 of 9 tokens).
    assert [r for r in requests[16:] if r[1] == 2] == [(6.0, 2, 10, 10)]
    # Fresh prompts 6 and 7 (2 tokens each) complete first; prompts 2 and 5 go back to the buffer again.
    m = third.metrics
    assert (m.response_lens, m.scheduler["carried_token_ratio"], m.scheduler["buffered_groups"]) == ([2] * 4, 0.0, 2)


def _grpo(april_loop: str, algorithm: str = "grpo", **settings):
    return simulate(SimConfig(cluster="h100-qwen3-4b", num_engines=2, lengths="deepscaler", mode="april-batch",
                              algorithm=algorithm, april_loop=april_loop, rollout_batch_size=4,
                              n_samples_per_prompt=4, over_sampling_batch_size=8, max_response_len=4096, steps=4,
                              **settings))


def test_slime_april_and_the_schedulers_batch_refill_run_the_same_grpo_steps():
    # Without a filter slime's loop launches one wave of N' groups (buffered first) and aborts at N complete,
    # which is the scheduler's batch refill; slime drops the groups completing beyond N at the same instant (the
    # scheduler keeps them by default, keep_surplus): without that, the two drivers give the same steps.
    slime, sched = _grpo("slime"), _grpo("scheduler", keep_surplus=False)
    assert sum(s.surplus_groups for s in slime.steps) > 0  # this workload has same-instant completions
    assert [s.generated_tokens for s in slime.steps] == [s.generated_tokens for s in sched.steps]
    assert [s.rollout_s for s in slime.steps] == pytest.approx([s.rollout_s for s in sched.steps], rel=1e-9)
    assert [s.response_lens for s in slime.steps] == [s.response_lens for s in sched.steps]
    assert slime.summary["partial_token_ratio"] > 0
    dapo = _grpo("slime", "dapo")
    assert all(0 < s.efficiency <= 1 for s in dapo.steps)


def test_the_april_loop_setting_is_checked():
    with pytest.raises(ConfigError, match=r"SimConfig.april_loop='waves' is not allowed: one of \('scheduler', "
                                          r"'slime'\)"):
        SimConfig(april_loop="waves")
    with pytest.raises(ConfigError, match="strategy='seer' is not allowed with april_loop='slime'"):
        SimConfig(mode="april-batch", april_loop="slime", strategy="seer")
    assert SimConfig(mode="april-batch", april_loop="slime").slime_april
    assert not SimConfig(mode="baseline", april_loop="slime").slime_april
    assert not SimConfig(mode="april-adaptive", april_loop="slime").slime_april  # the other modes: the scheduler
