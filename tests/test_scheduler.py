"""One test per semantic rule of the partial-rollout scheduler (DESIGN.md, "The scheduler")."""

from __future__ import annotations

import os
import re
import threading
from dataclasses import fields

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _scheduler_utils import (
    FakeEngine,
    abort_and_take,
    check_batch_layout,
    feed,
    finish_group,
    long_tail_length,
    make,
    prompts,
    reward_all,
    run_step,
    token_at,
)
from april_ext import (
    _C,
    ConfigError,
    CorruptStateError,
    InvalidArgumentError,
    InvalidStateError,
    ListDataSource,
    PersistenceError,
    Prompt,
    Scheduler,
    SchedulerConfig,
    UnknownIdError,
)
from april_ext.settings import settings as config_settings


# ---------------------------------------------------------------------------- configuration


@pytest.mark.parametrize("field,value", [
    ("rollout_batch_size", 0), ("rollout_batch_size", 2.0), ("n_samples_per_prompt", -1),
    ("over_sampling_batch_size", 1), ("max_response_len", 0), ("refill", "greedy"), ("max_staleness", -1),
    ("staleness_policy", "forget"), ("mask_offpolicy", 1), ("resume_order", "random"), ("keep_surplus", "yes"),
    ("max_inflight_samples", 1), ("rollout_batch_size", True),
])
def test_config_rejects_bad_values_naming_field_and_value(field, value):
    base = dict(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4)
    base[field] = value
    with pytest.raises(ConfigError, match=rf"SchedulerConfig\.{field}={value!r}.*not allowed") as info:
        SchedulerConfig(**base)
    assert isinstance(info.value, ValueError)


def _core_config(**fields: object) -> _C.SchedulerConfig:
    """The core's Config with ``fields`` set, as SchedulerConfig sets it."""
    core = _C.SchedulerConfig()
    for name, value in fields.items():
        setattr(core, name, value)
    return core


_CORE_ARGS = dict(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4, max_response_len=64)


def test_the_python_fields_and_defaults_are_the_cores():
    core = _C.SchedulerConfig()
    bound = [name for name, attr in vars(_C.SchedulerConfig).items() if isinstance(attr, property)]
    assert [f.name for f in fields(SchedulerConfig)] == bound
    assert {f.name: f.default for f in fields(SchedulerConfig)} == {name: getattr(core, name) for name in bound}
    # The names a Literal field's type lists (its flag's choices) are the core's.
    choices = {name: s.choices for name, s in config_settings(SchedulerConfig).items() if s.choices}
    assert choices == _C.scheduler_config_choices()
    # What the core runs with by default: SchedulerConfig() resolves N' the way the core does.
    assert SchedulerConfig().over_sampling_batch_size == core.validated().over_sampling_batch_size == 64


@pytest.mark.parametrize("field,changes", [
    ("rollout_batch_size", dict(rollout_batch_size=0)), ("rollout_batch_size", dict(rollout_batch_size=2**63)),
    ("n_samples_per_prompt", dict(n_samples_per_prompt="8")),
    ("over_sampling_batch_size", dict(over_sampling_batch_size=1)), ("max_response_len", dict(max_response_len=2**31)),
    ("refill", dict(refill="greedy")), ("refill", dict(refill=1)), ("max_staleness", dict(max_staleness=-1)),
    ("mask_offpolicy", dict(mask_offpolicy=1)), ("max_inflight_samples", dict(max_inflight_samples=1)),
    ("target_inflight_samples", dict(over_sampling="adaptive")),
    ("target_inflight_samples", dict(target_inflight_samples=4)), ("chunk_tokens", dict(chunk_tokens=0)),
    ("chunk_tokens", dict(chunk_tokens=2.5)), ("tail_batching_restart", dict(tail_batching_restart=True)),
    ("tail_extra_samples", dict(tail_extra_samples=True)), ("tail_extra_samples", dict(tail_extra_samples=1)),
    ("tail_extra_samples", dict(tail_batching=True, tail_extra_samples=-1)),
])
def test_a_bad_value_is_refused_by_the_cores_validation_with_its_message(field, changes):
    """SchedulerConfig has no rules of its own: its ConfigError is the one the core's Config raises."""
    with pytest.raises(ConfigError, match=rf"^SchedulerConfig\.{field}=") as through_python:
        SchedulerConfig(**{**_CORE_ARGS, **changes})
    with pytest.raises(ConfigError) as in_the_core:
        _core_config(**{**_CORE_ARGS, **changes}).validated()
    assert str(through_python.value) == str(in_the_core.value)


@pytest.mark.parametrize("field,allowed", [
    ("refill", "'batch', 'continuous'"), ("staleness_policy", "'keep', 'mask', 'restart', 'drop'"),
    ("resume_order", "'oldest_first', 'newest_first', 'longest_first'"), ("over_sampling", "'fixed', 'adaptive'"),
    ("step_boundary", "'abort', 'carry'"),
    ("dispatch_order", "'fifo', 'oldest_first', 'longest_predicted_first', 'shortest_first'"),
])
@pytest.mark.parametrize("bad", ["greedy", "Batch", "", None, 0])
def test_the_core_takes_enum_settings_by_name_and_rejects_other_values(field, allowed, bad):
    _C.SchedulerCore(_core_config(**_CORE_ARGS))
    message = f"SchedulerConfig.{field}={bad!r} is not allowed: one of {allowed}"
    with pytest.raises(ConfigError, match=re.escape(message)):
        _core_config(**{field: bad})
    with pytest.raises(ConfigError, match=re.escape(message)):
        SchedulerConfig(**{field: bad})


def test_python_config_accepts_exactly_the_names_the_core_knows():
    for field, names in _C.scheduler_config_choices().items():
        for name in names:
            kw = dict(target_inflight_samples=4) if (field, name) == ("over_sampling", "adaptive") else {}
            Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, **{field: name}, **kw), prompts(4))
    assert _C.scheduler_config_choices()["resume_order"] == ("oldest_first", "newest_first", "longest_first")


@pytest.mark.parametrize("field,value,allowed", [
    ("chunk_tokens", 0, "an int >= 1, or None for no chunking"),
    ("chunk_tokens", 2.5, "an int >= 1, or None for no chunking"),
    ("resume_priority", 1, "True or False"),
    ("tail_batching", "yes", "True or False"),
    ("tail_batching_restart", True, "False unless tail_batching=True"),
])
def test_strategy_settings_are_validated(field, value, allowed):
    with pytest.raises(ConfigError, match=re.escape(f"SchedulerConfig.{field}={value!r} is not allowed: {allowed}")):
        SchedulerConfig(**{field: value})


def test_the_core_validates_the_config_it_is_given():
    with pytest.raises(ConfigError, match=r"SchedulerConfig.chunk_tokens=-1 is not allowed: an int >= 1"):
        _C.SchedulerCore(_core_config(**_CORE_ARGS, chunk_tokens=-1))
    with pytest.raises(ConfigError, match=r"SchedulerConfig.tail_batching_restart=True is not allowed: False unless "
                                          r"tail_batching=True"):
        _C.SchedulerCore(_core_config(**_CORE_ARGS, tail_batching_restart=True))


def test_sample_states_cross_by_name():
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    assert sched.sample(0).state == "running" and sched.sample_ids("running") == list(range(8))
    with pytest.raises(InvalidArgumentError, match="sample state='finished' is not allowed: one of 'queued', "
                                                   "'running', 'aborting', 'done'"):
        sched.sample_ids("finished")


def test_config_defaults_over_sampling_to_twice_the_batch():
    assert SchedulerConfig(rollout_batch_size=5).over_sampling_batch_size == 10
    with pytest.raises(Exception):
        SchedulerConfig().rollout_batch_size = 3  # frozen


# ---------------------------------------------------------------------------- the paper's configuration


def test_paper_configuration_over_several_steps_with_long_tail():
    cap = 16384
    cfg = SchedulerConfig(rollout_batch_size=32, n_samples_per_prompt=8, over_sampling_batch_size=64,
                          max_response_len=cap, refill="batch")
    sched = Scheduler(cfg, prompts(1000))
    engine = FakeEngine(sched, lambda sid: long_tail_length(sid, cap), chunk=512)
    trained: set[int] = set()
    carried = 0
    for version in range(4):
        batch = run_step(sched, engine, version)
        st = sched.stats()
        assert batch.n_groups == 32 and batch.n_samples == 256
        check_batch_layout(batch, 8)
        ids = set(batch.sample_ids.tolist())
        assert len(ids) == 256 and not (ids & trained), "a sample was trained twice"
        trained |= ids
        assert st["batch_groups"] == 32 and st["aborts"] == st["abort_requests"] > 0
        assert st["buffered_samples"] > 0 and st["buffered_tokens"] > 0
        if version > 0:
            assert st["resume_requests"] > 0 and st["re_prefill_tokens"] > 0
            carried += st["batch_carried_tokens"]
            assert st["off_policy_token_ratio"] > 0
        assert sum(st["staleness_histogram"]) == 256
        assert not engine.running
    assert carried > 0
    # Nothing lost: every sample ever dispatched is trained or still held by the scheduler.
    dispatched = {r.sample_id for r in engine.requests}
    held = set(sched.sample_ids("queued")) | set(sched.sample_ids("done"))
    assert dispatched <= trained | held
    assert not (trained & held)


# ---------------------------------------------------------------------------- dispatch and resume


def test_resumed_request_carries_prompt_plus_partial_and_remaining_budget():
    sched = make(max_response_len=20)
    sched.begin_step(0)
    reqs = sched.dispatch()
    assert len(reqs) == 8 and not any(r.is_resume for r in reqs)
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    reward_all(sched)
    feed(sched, 4, 5, 0)
    aborted = sched.samples_to_abort()
    assert sorted(aborted) == [4, 5, 6, 7]
    sched.on_finish(4, "abort", token_at(4, np.arange(5, 7)), [-0.1, -0.2], 0)
    for sid in (5, 6, 7):
        sched.on_finish(sid, "abort")
    sched.take_batch()
    sched.begin_step(1)
    reqs = {r.sample_id: r for r in sched.dispatch()}
    r = reqs[4]
    prompt = np.asarray(prompts(50)[2].token_ids)
    assert r.is_resume and r.prompt_len == prompt.size
    assert np.array_equal(r.input_ids, np.concatenate([prompt, token_at(4, np.arange(7))]))
    assert r.max_new_tokens == 20 - 7
    assert not reqs[5].is_resume and reqs[5].max_new_tokens == 20
    assert sched.stats()["re_prefill_tokens"] == prompt.size + 7


def test_buffered_work_is_dispatched_before_new_prompts():
    sched = make(over_sampling_batch_size=3, max_inflight_samples=2)
    sched.begin_step(0)
    first = sched.dispatch()
    assert [r.sample_id for r in first] == [0, 1]
    sched.on_finish(0, "abort")  # e.g. the engine preempted it
    feed(sched, 1, 2, 0)
    sched.on_finish(1, "abort")
    nxt = sched.dispatch()
    assert [r.sample_id for r in nxt] == [1, 0]  # the partial first, then the fresh one


@pytest.mark.parametrize("order,expected", [("oldest_first", [0, 2, 4]), ("newest_first", [4, 2, 0]),
                                            ("longest_first", [2, 4, 0])])
def test_resume_order(order, expected):
    sched = make(rollout_batch_size=1, over_sampling_batch_size=3, resume_order=order)
    sched.begin_step(0)
    sched.dispatch()
    for sid, n in ((0, 1), (2, 5), (4, 3)):
        feed(sched, sid, n, 0)
    for sid in (0, 2, 4, 1, 3, 5):
        sched.on_finish(sid, "abort")
    reqs = sched.dispatch()
    assert [r.sample_id for r in reqs[:3]] == expected
    assert all(r.is_resume for r in reqs[:3]) and not any(r.is_resume for r in reqs[3:])


def test_max_inflight_samples_caps_dispatch():
    sched = make(max_inflight_samples=3)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 3
    assert sched.dispatch() == []
    sched.on_finish(0, "stop")
    assert [r.sample_id for r in sched.dispatch()] == [3]


# ---------------------------------------------------------------------------- refill, early stop, surplus


def test_batch_refill_launches_waves_only_when_the_wave_is_exhausted():
    sched = make(rollout_batch_size=2, over_sampling_batch_size=3)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 6
    finish_group(sched, 0, 2)
    assert sched.dispatch() == []  # wave still generating
    finish_group(sched, 1, 2)
    finish_group(sched, 2, 2)
    for g in sched.pop_completed_groups():
        sched.report_rewards(g.group_id, [1.0, 1.0], accepted=False)
    assert sched.stats()["groups_filtered"] == 3
    reqs = sched.dispatch()
    assert {r.group_id for r in reqs} == {3, 4, 5}


def test_continuous_refill_tops_up_as_groups_finish():
    sched = make(refill="continuous", over_sampling_batch_size=3)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 6
    finish_group(sched, 0, 2)
    reward_all(sched)
    reqs = sched.dispatch()
    assert [r.group_id for r in reqs] == [3, 3]
    assert sched.stats()["groups_launched"] == 4


@pytest.mark.parametrize("refill", ["batch", "continuous"])
def test_n_prime_equal_to_n_is_the_baseline_in_both_refill_modes(refill):
    sched = make(refill=refill, over_sampling_batch_size=2)
    sched.begin_step(0)
    assert {r.group_id for r in sched.dispatch()} == {0, 1}
    finish_group(sched, 0, 2)
    reward_all(sched)
    assert sched.dispatch() == []  # one more group is needed, and it is already generating
    finish_group(sched, 1, 2)
    reward_all(sched, accepted=False)
    assert {r.group_id for r in sched.dispatch()} == {2}  # exactly the rejected group's replacement
    finish_group(sched, 2, 2)
    reward_all(sched)
    assert sched.step_done and sched.samples_to_abort() == []
    assert sched.stats()["groups_launched"] == 3 and sched.take_batch().n_groups == 2


def test_filter_rejected_groups_do_not_count_and_are_replaced():
    sched = make(rollout_batch_size=2, over_sampling_batch_size=2)  # the baseline shape: N' = N
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    g0, g1 = sched.pop_completed_groups()
    sched.report_rewards(g0.group_id, [1.0, 1.0], accepted=False)
    sched.report_rewards(g1.group_id, [1.0, 0.0], accepted=True)
    assert not sched.step_done
    reqs = sched.dispatch()
    assert {r.group_id for r in reqs} == {2}  # exactly the one missing group
    finish_group(sched, 2, 2)
    reward_all(sched)
    assert sched.step_done and sched.samples_to_abort() == []
    batch = sched.take_batch()
    assert batch.prompt_ids == ["p1", "p2"] and sched.stats()["groups_filtered"] == 1
    with pytest.raises(UnknownIdError):
        sched.report_rewards(g0.group_id, [1.0, 0.0])


def test_step_done_from_accepted_count_only_unrewarded_groups_stay_surplus():
    sched = make(rollout_batch_size=1, over_sampling_batch_size=3)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    g0, g1 = sched.pop_completed_groups()
    sched.report_rewards(g0.group_id, [0.0, 1.0])
    assert sched.step_done  # group 1's reward is not awaited
    assert sorted(sched.samples_to_abort()) == [4, 5]
    for sid in (4, 5):
        sched.on_finish(sid, "abort")
    assert sched.take_batch().prompt_ids == ["p0"]
    st = sched.stats()
    assert st["surplus_groups"] == 1 and st["buffered_groups"] == 1
    sched.begin_step(1)
    sched.report_rewards(g1.group_id, [0.0, 1.0])  # reward arrives in the next step
    assert sched.step_done and sched.dispatch() == []
    assert sched.take_batch().prompt_ids == ["p1"]


def test_surplus_groups_are_kept_for_the_next_step():
    sched = make(rollout_batch_size=2, over_sampling_batch_size=4)
    sched.begin_step(0)
    sched.dispatch()
    for gid in range(3):
        finish_group(sched, gid, 2)
    reward_all(sched)
    assert sched.step_done
    assert abort_and_take(sched).n_groups == 2
    assert sched.stats()["surplus_groups"] == 1
    sched.begin_step(1)
    reqs = sched.dispatch()
    # N' = 4 groups in hand: surplus group 2, buffered group 3 and two new groups.
    assert {r.group_id for r in reqs} == {3, 4, 5}
    finish_group(sched, 3, 2, version=1)
    reward_all(sched)
    assert sched.step_done
    assert abort_and_take(sched).prompt_ids == ["p2", "p3"]


@pytest.mark.parametrize("order", [[3, 1, 0, 2], [2, 0, 3, 1], [0, 1, 2, 3]])
def test_the_batch_packs_its_groups_in_group_id_order_whatever_the_completion_order(order):
    """Which groups make the batch follows acceptance (the first N), their order in it the group ids: so groups
    completing or rewarded in another order (timing) give the same batch."""
    sched = make(rollout_batch_size=3, over_sampling_batch_size=4)
    sched.begin_step(0)
    sched.dispatch()
    for gid in order:  # completed and rewarded one at a time, in this order
        finish_group(sched, gid, 2, tokens=gid + 1)
        reward_all(sched)
    batch = abort_and_take(sched)
    accepted = sorted(order[:3])
    assert batch.prompt_ids == [f"p{g}" for g in accepted]
    assert batch.sample_ids.tolist() == [sid for g in accepted for sid in (2 * g, 2 * g + 1)]
    assert batch.group_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert batch.response_lens.tolist() == [g + 1 for g in accepted for _ in range(2)]
    # The fourth group is surplus: the next step's batch, first.
    sched.begin_step(1)
    assert sched.stats()["surplus_groups"] == 1


def test_keep_surplus_false_drops_completed_extras():
    sched = make(rollout_batch_size=1, over_sampling_batch_size=2, keep_surplus=False)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    reward_all(sched)
    sched.take_batch()
    st = sched.stats()
    assert st["surplus_dropped"] == 1 and st["surplus_groups"] == 0


@pytest.mark.parametrize("how", ["surplus", "stale"])
def test_a_group_dropped_while_its_reward_is_due_takes_that_reward_once(how):
    # Group 1 is handed out for reward, then dropped before the reward comes: as surplus at take_batch
    # (keep_surplus=False) or at the next begin_step as stale (max_staleness 0, drop). The loop's late report
    # is ignored; a second one is an unknown group again.
    settings = dict(keep_surplus=False) if how == "surplus" else dict(max_staleness=0, staleness_policy="drop")
    sched = make(rollout_batch_size=1, over_sampling_batch_size=2, **settings)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 1, 2)
    late = sched.pop_completed_groups()
    finish_group(sched, 0, 2)
    reward_all(sched)
    sched.take_batch()
    if how == "stale":
        sched.begin_step(1)
        assert sched.stats()["groups_dropped_stale"] == 1
    else:
        assert sched.stats()["surplus_dropped"] == 1
    sched.report_rewards(late[0].group_id, [1.0, 0.0])
    assert sched.stats()["groups_accepted"] == (1 if how == "surplus" else 0)  # the step's own group only
    with pytest.raises(UnknownIdError, match="group id 1 is not known"):
        sched.report_rewards(late[0].group_id, [1.0, 0.0])


def test_baseline_without_partial_rollout_aborts_nothing():
    cap = 2048
    sched = Scheduler(SchedulerConfig(rollout_batch_size=4, n_samples_per_prompt=4, over_sampling_batch_size=4,
                                      max_response_len=cap), prompts(40))
    engine = FakeEngine(sched, lambda sid: long_tail_length(sid, cap), chunk=256)
    for v in range(3):
        batch = run_step(sched, engine, v)
        assert batch.n_groups == 4
        st = sched.stats()
        assert st["abort_requests"] == 0 and st["resume_requests"] == 0 and st["buffered_groups"] == 0


def test_data_running_out_ends_the_step_with_fewer_groups():
    sched = make(n_prompts=3, rollout_batch_size=2, over_sampling_batch_size=2)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    assert len(reward_all(sched)) == 2
    sched.take_batch()
    sched.begin_step(1)
    assert {r.group_id for r in sched.dispatch()} == {2}
    assert not sched.step_done
    finish_group(sched, 2, 2, version=1)
    reward_all(sched)
    assert sched.step_done
    batch = sched.take_batch()
    st = sched.stats()
    assert batch.n_groups == 1 and st["data_exhausted"] and st["batch_groups"] == 1
    assert st["prompts_consumed"] == 3


# ---------------------------------------------------------------------------- off-policy bookkeeping


def _partial_over_versions(sched: Scheduler, versions: list[int]) -> None:
    """Sample 0 gets 2 tokens per version and is aborted at every step's end; other groups finish."""
    for v in versions:
        sched.begin_step(v)
        sched.dispatch()
        feed(sched, 0, 2, v)
        for gid in sorted({sid // 2 for sid in sched.sample_ids("running")} - {0}):
            finish_group(sched, gid, 2, version=v)
        reward_all(sched)
        assert sched.step_done
        abort_and_take(sched)


def test_versions_per_token_right_across_several_resumes():
    sched = make(rollout_batch_size=2, over_sampling_batch_size=3)
    _partial_over_versions(sched, [0, 1, 3, 4])
    view = sched.sample(0)
    assert view.state == "queued"
    assert view.versions.tolist() == [0, 0, 1, 1, 3, 3, 4, 4] and view.resumes == 3
    assert np.array_equal(view.token_ids, token_at(0, np.arange(8)))
    sched.begin_step(5)
    reqs = {r.sample_id: r for r in sched.dispatch()}
    assert reqs[0].is_resume and reqs[0].input_ids.size == 4 + 8
    with pytest.raises(InvalidArgumentError, match="version 4"):
        feed(sched, 0, 1, 4)  # below its dispatch version
    feed(sched, 0, 1, 5)
    sched.on_finish(0, "stop")
    sched.on_finish(1, "stop")
    reward_all(sched)


def _stale_setup(**kw) -> Scheduler:
    """Sample 0 holds 2 tokens of version 0 and sample 1 two of version 2; both buffered before step 3."""
    sched = make(rollout_batch_size=1, over_sampling_batch_size=2, **kw)
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 2, 0)
    finish_group(sched, 1, 2)
    reward_all(sched)
    abort_and_take(sched)
    sched.begin_step(2)
    reqs = sched.dispatch()
    assert {r.sample_id for r in reqs} >= {0, 1}
    feed(sched, 1, 2, 2)
    finish_group(sched, 2, 2, version=2)
    reward_all(sched)
    abort_and_take(sched)
    return sched


def _finish_group0(sched: Scheduler, version: int):
    reqs = {r.sample_id: r for r in sched.dispatch()}
    for sid in (0, 1):
        if sid in reqs:
            feed(sched, sid, 1, version)
            sched.on_finish(sid, "stop")
    for gid in {r.group_id for r in reqs.values()} - {0}:
        finish_group(sched, gid, 2, version=version)
    reward_all(sched)
    return abort_and_take(sched)


def test_staleness_keep_trains_stale_tokens():
    sched = _stale_setup(max_staleness=2, staleness_policy="keep")
    sched.begin_step(3)
    batch = _finish_group0(sched, 3)
    i = batch.sample_ids.tolist().index(0)
    lo, hi, p = batch.offsets[i], batch.offsets[i + 1], batch.prompt_lens[i]
    assert batch.versions[lo + p:hi].tolist() == [0, 0, 3] and batch.loss_mask[lo + p:hi].tolist() == [1, 1, 1]
    assert sched.stats()["staleness_histogram"][3] == 1


def test_staleness_mask_drops_stale_tokens_from_the_loss():
    sched = _stale_setup(max_staleness=2, staleness_policy="mask")
    sched.begin_step(3)
    batch = _finish_group0(sched, 3)
    ids = batch.sample_ids.tolist()
    for sid, mask in ((0, [0, 0, 1]), (1, [1, 1, 1])):
        i = ids.index(sid)
        lo, hi, p = batch.offsets[i], batch.offsets[i + 1], batch.prompt_lens[i]
        assert batch.loss_mask[lo + p:hi].tolist() == mask
    assert sched.stats()["batch_masked_tokens"] == 2


def test_staleness_restart_restarts_the_sample_from_its_prompt():
    sched = _stale_setup(max_staleness=2, staleness_policy="restart")
    sched.begin_step(3)
    assert sched.stats()["samples_restarted_stale"] == 1 and sched.stats()["stale_tokens_discarded"] == 2
    reqs = {r.sample_id: r for r in sched.dispatch()}
    assert not reqs[0].is_resume and reqs[0].input_ids.size == 4  # the prompt only
    assert reqs[1].is_resume
    sched.on_tokens(0, token_at(0, np.arange(1)), [-0.1], 3)
    sched.on_finish(0, "stop")
    feed(sched, 1, 1, 3)
    sched.on_finish(1, "stop")
    reward_all(sched)
    batch = abort_and_take(sched)
    i = batch.sample_ids.tolist().index(0)
    lo, hi, p = batch.offsets[i], batch.offsets[i + 1], batch.prompt_lens[i]
    assert batch.versions[lo + p:hi].tolist() == [3]
    assert batch.versions[batch.versions >= 0].min() >= 3 - 2


def test_staleness_drop_drops_the_group():
    sched = _stale_setup(max_staleness=2, staleness_policy="drop")
    sched.begin_step(3)
    st = sched.stats()
    assert st["groups_dropped_stale"] == 1 and st["stale_tokens_discarded"] == 4
    with pytest.raises(UnknownIdError):
        sched.sample(0)
    assert 0 not in {r.group_id for r in sched.dispatch()}


def test_staleness_waits_for_in_flight_aborts_before_applying():
    sched = make(rollout_batch_size=1, over_sampling_batch_size=2, max_staleness=0, staleness_policy="restart")
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    reward_all(sched)
    sched.samples_to_abort()
    sched.take_batch()  # samples 2, 3 still aborting in the engine
    sched.begin_step(1)
    assert {r.sample_id for r in sched.dispatch()}.isdisjoint({2, 3})
    sched.on_finish(2, "abort", token_at(2, np.arange(2)), [-0.1, -0.1], 0)  # late tokens of version 0
    sched.on_finish(3, "abort")
    assert sched.stats()["samples_restarted_stale"] == 1
    assert sched.sample(2).token_ids.size == 0


def test_mask_offpolicy_trains_only_current_version_tokens():
    sched = make(rollout_batch_size=1, over_sampling_batch_size=2, mask_offpolicy=True)
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 2, 3, 0)
    finish_group(sched, 0, 2)
    reward_all(sched)
    abort_and_take(sched)
    sched.begin_step(1)
    sched.dispatch()
    feed(sched, 2, 2, 1)
    sched.on_finish(2, "stop")
    feed(sched, 3, 1, 1)
    sched.on_finish(3, "stop")
    reward_all(sched)
    batch = abort_and_take(sched)
    i = batch.sample_ids.tolist().index(2)
    lo, hi, p = batch.offsets[i], batch.offsets[i + 1], batch.prompt_lens[i]
    assert batch.loss_mask[lo + p:hi].tolist() == [0, 0, 0, 1, 1]
    st = sched.stats()
    assert st["batch_offpolicy_tokens"] == 3 and st["off_policy_token_ratio"] == pytest.approx(3 / 6)
    assert st["batch_carried_tokens"] == 3 and st["resumed_generated_tokens"] == 2


# ---------------------------------------------------------------------------- persistence


def _mid_abort_scheduler() -> tuple[Scheduler, FakeEngine]:
    cap = 512
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
                                      max_response_len=cap), prompts(30))
    engine = FakeEngine(sched, lambda sid: 4 + (sid * 37) % 200, chunk=8)
    run_step(sched, engine, 0)
    sched.begin_step(1)
    engine.version = 1
    while not sched.step_done:
        engine.submit(sched.dispatch())
        engine.tick()
        for g in sched.pop_completed_groups():
            sched.report_rewards(g.group_id, [0.0, 1.0, 0.0, 1.0])
    return sched, engine


def test_save_and_load_mid_abort_loses_nothing(tmp_path):
    sched, engine = _mid_abort_scheduler()
    to_abort = sched.samples_to_abort()
    assert to_abort
    engine.abort(to_abort[: len(to_abort) // 2])  # half the abort results are in, half are not
    before = {sid: sched.sample(sid) for sid in sched.sample_ids("queued") + sched.sample_ids("aborting")
              + sched.sample_ids("done")}
    path = tmp_path / "sched.state"
    sched.save(path)
    assert os.listdir(tmp_path) == ["sched.state"]  # no temporary file left behind
    restored = Scheduler(sched.config, sched.data)
    restored.load(path)
    for sid, view in before.items():
        got = restored.sample(sid)
        assert np.array_equal(got.token_ids, view.token_ids) and np.array_equal(got.versions, view.versions)
        assert np.array_equal(got.logprobs, view.logprobs)
        assert got.state == ("queued" if view.state == "aborting" else view.state)
    assert restored.step_open and restored.step_done and restored.policy_version == 1
    assert restored.samples_to_abort() == []  # the engine's requests are gone: nothing is running
    a, b = sched, restored
    for sid in to_abort[len(to_abort) // 2:]:
        engine.running.pop(sid, None)
        a.on_finish(sid, "abort")
    ba, bb = a.take_batch(), b.take_batch()
    for name in ("tokens", "offsets", "loss_mask", "behavior_logprobs", "versions", "rewards", "sample_ids"):
        assert np.array_equal(getattr(ba, name), getattr(bb, name)), name
    assert restored.stats()["prompts_consumed"] == sched.stats()["prompts_consumed"]
    assert sorted(a.sample_ids("queued")) == sorted(b.sample_ids("queued"))


def test_save_mid_step_then_resume_the_run(tmp_path):
    cap = 512
    cfg = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=4, over_sampling_batch_size=4,
                          max_response_len=cap)
    sched = Scheduler(cfg, prompts(40))
    engine = FakeEngine(sched, lambda sid: long_tail_length(sid, cap, seed=5) // 4 + 1, chunk=16)
    run_step(sched, engine, 0)
    sched.begin_step(1)
    engine.submit(sched.dispatch())
    engine.tick()
    running = sched.sample_ids("running")
    state = sched.state_dict()
    restored = Scheduler(cfg, prompts(40))
    restored.load_state_dict(state)
    assert sorted(restored.sample_ids("queued")) == sorted(set(running) | set(sched.sample_ids("queued")))
    engine2 = FakeEngine(restored, engine.target_len, chunk=16)
    engine2.version = 1
    while not restored.step_done:
        engine2.submit(restored.dispatch())
        engine2.tick()
        for g in restored.pop_completed_groups():
            restored.report_rewards(g.group_id, [0.0, 1.0, 0.0, 1.0])
    engine2.abort(restored.samples_to_abort())
    batch = restored.take_batch()
    check_batch_layout(batch, 4)
    assert batch.n_groups == 2


def test_popped_unrewarded_groups_are_handed_out_again_after_load():
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    assert [g.group_id for g in sched.pop_completed_groups()] == [0]
    other = make()
    other.load_state_dict(sched.state_dict())
    assert [g.group_id for g in other.pop_completed_groups()] == [0]


@pytest.mark.parametrize("damage", ["truncate", "flip", "magic", "empty", "version"])
def test_corrupt_state_file_raises_and_leaves_state_untouched(tmp_path, damage):
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 3, 0)
    path = tmp_path / "s.state"
    sched.save(path)
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 5]
    elif damage == "flip":
        data[len(data) // 2] ^= 0x40
    elif damage == "magic":
        data[0:8] = b"NOTMAGIC"
    elif damage == "empty":
        data = bytearray()
    else:
        data[8] = 99
    path.write_bytes(bytes(data))
    target = make()
    target.begin_step(4)
    target.dispatch()
    before = target.state_dict()
    with pytest.raises(CorruptStateError):
        target.load(path)
    assert target.state_dict() == before
    assert target.step_open and len(target.sample_ids("running")) == 8


def test_load_rejects_state_of_another_shape_and_missing_files(tmp_path):
    sched = make()
    with pytest.raises(InvalidArgumentError, match="n_samples_per_prompt=2"):
        make(n_samples_per_prompt=3).load_state_dict(sched.state_dict())
    with pytest.raises(PersistenceError):
        sched.load(tmp_path / "missing")
    with pytest.raises(CorruptStateError, match="not a scheduler state_dict"):
        sched.load_state_dict({"core": "nope"})


# ---------------------------------------------------------------------------- bad input


def test_bad_input_raises_clear_errors_and_state_stays_valid():
    sched = make(max_response_len=8)
    with pytest.raises(InvalidStateError, match="begin_step"):
        sched.dispatch()
    sched.begin_step(2)
    with pytest.raises(InvalidStateError, match="still open"):
        sched.begin_step(3)
    sched.dispatch()
    with pytest.raises(UnknownIdError, match="sample id 999"):
        sched.on_tokens(999, [1], [0.0], 2)
    with pytest.raises(InvalidArgumentError, match="logprobs has 1 entries but tokens has 2"):
        sched.on_tokens(0, [1, 2], [0.0], 2)
    with pytest.raises(InvalidArgumentError, match="over max_response_len=8"):
        sched.on_tokens(0, list(range(9)), [0.0] * 9, 2)
    with pytest.raises(InvalidArgumentError, match="version 3"):
        sched.on_tokens(0, [1], [0.0], 3)  # newer than the step's policy
    with pytest.raises(InvalidArgumentError, match="version 1"):
        sched.on_tokens(0, [1], [0.0], 1)  # older than its dispatch version
    # A bad event in a batch leaves the good ones before it unapplied.
    with pytest.raises(UnknownIdError):
        sched.on_tokens_batch([1, 999], [1, 1], [5, 6], [0.0, 0.0], [2, 2])
    assert sched.sample(1).token_ids.size == 0
    with pytest.raises(InvalidArgumentError, match="add up"):
        sched.on_tokens_batch([1], [2], [5], [0.0], [2])
    with pytest.raises(InvalidArgumentError, match="reason"):
        sched.on_finish(0, "done")
    feed(sched, 0, 2, 2)
    sched.on_finish(0, "stop")
    with pytest.raises(InvalidStateError, match="already finished"):
        sched.on_finish(0, "stop")
    with pytest.raises(InvalidStateError, match="already finished"):
        sched.on_tokens(0, [1], [0.0], 2)
    with pytest.raises(InvalidStateError, match="twice in one call"):
        sched.on_finish_batch([1, 1], [0, 0])
    with pytest.raises(InvalidStateError, match="not complete"):
        sched.report_rewards(0, [1.0, 0.0])
    with pytest.raises(UnknownIdError):
        sched.report_rewards(77, [1.0, 0.0])
    with pytest.raises(InvalidStateError, match="not done"):
        sched.take_batch()
    sched.on_finish(1, "stop")
    (g,) = sched.pop_completed_groups()
    with pytest.raises(InvalidArgumentError, match="got 3 rewards"):
        sched.report_rewards(g.group_id, [1.0, 0.0, 1.0])
    with pytest.raises(InvalidArgumentError, match="finite"):
        sched.report_rewards(g.group_id, [1.0, float("nan")])
    sched.report_rewards(g.group_id, [1.0, 0.0])
    with pytest.raises(InvalidStateError, match="already rewarded"):
        sched.report_rewards(g.group_id, [1.0, 0.0])
    finish_group(sched, 1, 2, tokens=1, version=2)
    reward_all(sched)
    assert sched.step_done
    with pytest.raises(InvalidStateError, match="still running"):
        sched.take_batch()
    aborted = sched.samples_to_abort()
    for sid in aborted:
        sched.on_finish(sid, "abort")
    with pytest.raises(InvalidStateError, match="not running"):
        sched.on_finish(aborted[0], "abort")
    batch = sched.take_batch()
    assert batch.n_groups == 2 and batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(InvalidArgumentError, match="policy_version=1"):
        sched.begin_step(1)


def test_bad_prompts_and_data_sources_are_rejected():
    with pytest.raises(InvalidArgumentError, match="Prompt is required"):
        ListDataSource(["not a prompt"])
    with pytest.raises(InvalidArgumentError, match="__len__"):
        Scheduler(SchedulerConfig(), 42)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=1),
                      ListDataSource([Prompt(id="empty", token_ids=[])]))
    sched.begin_step(0)
    with pytest.raises(InvalidArgumentError, match="'empty'"):
        sched.dispatch()


class _Flaky:
    """A data source whose prompt 2 is broken until ``fixed`` is set."""

    def __init__(self, n: int) -> None:
        self.good = prompts(n)
        self.fixed = False

    def __len__(self) -> int:
        return len(self.good)

    def __getitem__(self, index: int) -> Prompt:
        if index == 2 and not self.fixed:
            return Prompt(id="broken", token_ids=[])
        return self.good[index]


def test_dispatch_with_an_invalid_prompt_launches_nothing_and_changes_nothing():
    data = _Flaky(20)
    sched = Scheduler(SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4,
                                      max_response_len=64), data)
    sched.begin_step(0)
    before = sched.state_dict()
    with pytest.raises(InvalidArgumentError, match="'broken'"):
        sched.dispatch()
    assert sched.state_dict() == before
    assert sched.stats()["groups_launched"] == 0 and sched.sample_ids("running") == []
    data.fixed = True
    assert {r.group_id for r in sched.dispatch()} == {0, 1, 2, 3}


@pytest.mark.parametrize("call", [
    lambda s: s.on_tokens_batch([0, 1], [1], [5], [0.0], [0, 0]),
    lambda s: s.on_tokens_batch([0, 1], [1, 0], [5], [0.0], [0]),
    lambda s: s.on_finish_batch([0, 1], [0]),
    lambda s: s.on_finish_batch([0], [0], [1, 0], [5], [0.0], [0]),
])
def test_event_arrays_of_different_lengths_raise_invalid_argument(call):
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    before = sched.state_dict()
    with pytest.raises(InvalidArgumentError, match="same length|entries"):
        call(sched)
    assert sched.state_dict() == before


@pytest.mark.parametrize("tokens,offsets,match", [
    ([5, 6, 7], [0, 9, 3], "stay within the 3 tokens"), ([5, 6, 7], [0, 3, 3], "prompt 1 has no tokens"),
    ([5, 6, 7], [1, 3], "from 0 to the 3 tokens"), ([5, -6, 7], [0, 1, 3], "token id -6 of prompt 1"),
])
def test_the_core_checks_packed_prompts_before_adding_any(tokens, offsets, match):
    core = _C.SchedulerCore(_core_config(**_CORE_ARGS))
    core.begin_step(0)
    with pytest.raises(InvalidArgumentError, match=match):
        core.add_groups(0, np.array(tokens, np.int32), np.array(offsets, np.int64))
    assert core.prompts_consumed() == 0 and core.dispatch()["sample_ids"].size == 0


def _names(*parts: object) -> str:
    """A pattern for a message that names each part and the allowed token id range, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(str(p))})" for p in (*parts, "[0, 2**31 - 1]"))


@pytest.mark.parametrize("bad", [2**31, 2**32 + 5, -1, -(2**31)])
@pytest.mark.parametrize("call", ["on_tokens", "on_tokens_batch", "on_finish", "on_finish_batch"])
def test_token_ids_outside_0_to_int32_max_are_rejected_naming_value_and_range(call, bad):
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    before = sched.state_dict()
    tokens = [3, bad]
    with pytest.raises(InvalidArgumentError, match=_names(bad)):
        if call == "on_tokens":
            sched.on_tokens(0, tokens, [0.0, 0.0], 0)
        elif call == "on_tokens_batch":
            sched.on_tokens_batch([0, 1], [1, 1], tokens, [0.0, 0.0], [0, 0])
        elif call == "on_finish":
            sched.on_finish(0, "stop", tokens, [0.0, 0.0], 0)
        else:
            sched.on_finish_batch([0], [0], [2], tokens, [0.0, 0.0], [0])
    assert sched.state_dict() == before


def test_negative_token_ids_in_an_int32_array_are_rejected():
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    with pytest.raises(InvalidArgumentError, match=r"token id -7 of sample 1.*\[0, 2\*\*31 - 1\]"):
        sched.on_tokens_batch([0, 1], [1, 1], np.array([4, -7], np.int32), [0.0, 0.0], [0, 0])
    assert sched.sample(0).token_ids.size == 0


@pytest.mark.parametrize("bad", [2**31, -1])
def test_prompt_token_ids_outside_0_to_int32_max_are_rejected(bad):
    sched = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=1, over_sampling_batch_size=1),
                      ListDataSource([Prompt(id="wide", token_ids=[5, bad])]))
    sched.begin_step(0)
    with pytest.raises(InvalidArgumentError, match=_names(bad, "'wide'")):
        sched.dispatch()
    assert sched.stats()["groups_launched"] == 0


_ID_CALLS = {
    "on_tokens": lambda s, i: s.on_tokens(i, [5], [0.0], 0),
    "on_tokens_batch": lambda s, i: s.on_tokens_batch([0, i], [1, 1], [5, 6], [0.0, 0.0], [0, 0]),
    "on_finish": lambda s, i: s.on_finish(i, "stop"),
    "on_finish_batch": lambda s, i: s.on_finish_batch([0, i], [0, 0]),
    "report_rewards": lambda s, i: s.report_rewards(i, [1.0, 0.0]),
    "sample": lambda s, i: s.sample(i),
}


def _unknown(kind: str, value: int) -> str:
    return rf"{kind} id {value} is not known: {kind} ids are in \[0, 2\*\*63 - 1\]"


@pytest.mark.parametrize("call", sorted(_ID_CALLS))
@given(bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63)))
@settings(max_examples=20, deadline=None)
def test_an_id_outside_0_to_int64_max_is_unknown_naming_it_and_the_range(call, bad):
    """Negative ids reach the core, which refuses them; ids int64 cannot hold are refused before a conversion could
    overflow or wrap them."""
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    before = sched.state_dict()
    with pytest.raises(UnknownIdError, match=_unknown("group" if call == "report_rewards" else "sample", bad)):
        _ID_CALLS[call](sched, bad)
    assert sched.state_dict() == before


@pytest.mark.parametrize("bad", [2**63, 2**64 - 1])
def test_an_unsigned_id_array_is_checked_before_it_is_narrowed(bad):
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    ids = np.array([0, bad], np.uint64)
    with pytest.raises(UnknownIdError, match=_unknown("sample", bad)):
        sched.on_tokens_batch(ids, [1, 1], [5, 6], [0.0, 0.0], [0, 0])
    with pytest.raises(UnknownIdError, match=_unknown("sample", bad)):
        sched.on_finish_batch(ids, [0, 0])
    assert sched.sample(0).token_ids.size == 0 and sched.sample(0).state == "running"
    sched.on_tokens_batch(np.array([0, 1], np.uint64), [1, 1], [5, 6], [0.0, 0.0], [0, 0])  # ids that fit pass
    assert sched.sample(1).token_ids.tolist() == [6]


@pytest.mark.parametrize("bad", ["0", 1.0, None, True])
def test_an_id_that_is_not_an_int_is_an_invalid_argument(bad):
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    with pytest.raises(InvalidArgumentError, match=re.escape(f"sample id={bad!r} is not allowed: an int")):
        sched.sample(bad)
    with pytest.raises(InvalidArgumentError, match=re.escape(f"group id={bad!r} is not allowed: an int")):
        sched.report_rewards(bad, [1.0, 0.0])


def test_abort_at_the_length_cap_counts_as_finished():
    sched = make(max_response_len=4)
    sched.begin_step(0)
    sched.dispatch()
    sched.on_finish(0, "abort", token_at(0, np.arange(4)), [0.0] * 4, 0)
    assert sched.sample(0).state == "done"


# ---------------------------------------------------------------------------- batch and threads


def test_batch_converts_to_torch_without_copies():
    torch = pytest.importorskip("torch")
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    reward_all(sched)
    batch = abort_and_take(sched)
    tensors = batch.to_torch()
    assert tensors["tokens"].data_ptr() == batch.tokens.ctypes.data
    assert tensors["versions"].dtype == torch.int32 and tensors["offsets"].dtype == torch.int64


def test_concurrent_token_streams_from_many_threads():
    sched = Scheduler(SchedulerConfig(rollout_batch_size=8, n_samples_per_prompt=4, over_sampling_batch_size=8,
                                      max_response_len=4000), prompts(20))
    sched.begin_step(0)
    ids = [r.sample_id for r in sched.dispatch()]

    def stream(my_ids):
        for chunk in range(100):
            pos = np.arange(chunk * 10, chunk * 10 + 10)
            for sid in my_ids:
                sched.on_tokens(sid, token_at(sid, pos), np.zeros(10), 0)

    threads = [threading.Thread(target=stream, args=(ids[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for sid in ids:
        assert np.array_equal(sched.sample(sid).token_ids, token_at(sid, np.arange(1000)))
