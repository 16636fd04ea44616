"""step_boundary="carry": running samples stay running across take_batch and begin_step, with their tokens,
per-token versions and behavior logprobs; the staleness policy applies to them at the next version bump."""

from __future__ import annotations

import numpy as np
import pytest

from _scheduler_utils import (
    FakeEngine,
    check_batch_layout,
    feed,
    finish_group,
    generate_until_done,
    make,
    reward_all,
    token_at,
)
from april_ext import ConfigError, InvalidStateError, Scheduler, SchedulerConfig


def carry(**kw) -> Scheduler:
    return make(step_boundary="carry", **kw)


def _done_step(sched: Scheduler, version: int = 0) -> None:
    """Step ``version``: 8 samples dispatched (4 groups of 2), groups 0 and 1 accepted, groups 2 and 3 still
    running with tokens of ``version``."""
    sched.begin_step(version)
    assert len(sched.dispatch()) == 8
    finish_group(sched, 0, 2, version=version)
    finish_group(sched, 1, 2, version=version)
    for sid in range(4, 8):
        feed(sched, sid, 2, version)
    reward_all(sched)
    assert sched.step_done


def test_step_boundary_is_validated_and_defaults_to_abort():
    assert SchedulerConfig().step_boundary == "abort"
    with pytest.raises(ConfigError, match=r"SchedulerConfig.step_boundary='keep' is not allowed: one of 'abort', "
                                          r"'carry'"):
        SchedulerConfig(step_boundary="keep")


def test_abort_mode_still_aborts_at_the_boundary():
    sched = make()
    _done_step(sched)
    with pytest.raises(InvalidStateError, match="still running.*step_boundary='carry'"):
        sched.take_batch()
    assert sched.samples_to_abort() == [4, 5, 6, 7]


def test_carried_samples_keep_running_across_the_boundary_with_their_tokens_and_versions():
    sched = carry()
    _done_step(sched)
    assert sched.samples_to_abort() == []
    batch = sched.take_batch()
    assert batch.n_groups == 2 and sorted(batch.sample_ids.tolist()) == [0, 1, 2, 3]
    assert sched.sample_ids("running") == [4, 5, 6, 7] and not sched.step_open
    feed(sched, 4, 1, 0)  # a token the engine produced before it paused, delivered late
    sched.begin_step(1)
    assert sched.sample_ids("running") == [4, 5, 6, 7] and sched.samples_to_abort() == []
    stats = sched.stats()
    assert stats["carried_samples"] == 4
    assert stats["carried_kv_tokens"] == 4 * 4 + 3 + 2 * 3  # prompt of 4 tokens each, responses of 3, 2, 2, 2
    feed(sched, 4, 2, 1)
    view = sched.sample(4)
    assert np.array_equal(view.token_ids, token_at(4, np.arange(5)))
    assert view.versions.tolist() == [0, 0, 0, 1, 1] and view.resumes == 0
    # Nothing carried is re-dispatched (no re-prefill): only new groups go out.
    requests = sched.dispatch()
    assert requests and not any(r.is_resume for r in requests)
    assert not {4, 5, 6, 7} & {r.sample_id for r in requests}
    assert sched.stats()["re_prefill_tokens"] == 0


def test_carried_samples_finish_into_the_next_batch_with_their_versions():
    sched = carry(rollout_batch_size=1, over_sampling_batch_size=2)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2, version=0)
    feed(sched, 2, 2, 0)
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    feed(sched, 2, 1, 1)
    sched.on_finish(2, "stop")
    feed(sched, 3, 3, 1)
    sched.on_finish(3, "stop")
    reward_all(sched)
    batch = sched.take_batch()
    assert batch.sample_ids.tolist() == [2, 3]
    lo, p = batch.offsets[0], batch.prompt_lens[0]
    assert batch.versions[lo + p:batch.offsets[1]].tolist() == [0, 0, 1]
    assert sched.stats()["batch_offpolicy_tokens"] == 2 and sched.stats()["batch_carried_tokens"] == 2


def test_finishes_and_rewards_of_carried_samples_may_arrive_between_steps():
    sched = carry()
    _done_step(sched)
    sched.take_batch()
    finish_group(sched, 2, 2, version=0)
    assert reward_all(sched) == [2]
    sched.begin_step(1)
    assert sched.stats()["carried_samples"] == 2  # group 3
    assert sched.sample(4).state == "done"


def test_restart_policy_aborts_carried_samples_past_the_bound_and_restarts_them():
    sched = carry(max_staleness=0, staleness_policy="restart")
    _done_step(sched)
    sched.take_batch()
    sched.begin_step(1)
    # Every carried sample has tokens of version 0: one version past max_staleness=0.
    assert sched.samples_to_abort() == [4, 5, 6, 7]
    assert sched.samples_to_abort() == []  # each listed once
    assert sched.sample_ids("aborting") == [4, 5, 6, 7] and sched.stats()["carried_samples"] == 0
    sched.on_finish(4, "abort", token_at(4, np.arange(2, 3)), [-0.1], 0)
    sched.on_finish(5, "stop")  # finished before the abort took effect: still stale, restarted too
    view = sched.sample(4)
    assert view.state == "queued" and view.token_ids.size == 0
    assert sched.sample(5).state == "queued" and sched.sample(5).token_ids.size == 0
    assert sched.stats()["samples_restarted_stale"] == 2
    requests = {r.sample_id: r for r in sched.dispatch()}
    assert not requests[4].is_resume and requests[4].input_ids.size == requests[4].prompt_len


def test_a_carried_sample_without_tokens_is_judged_by_its_dispatch_version():
    """Its tokens can still come with its (stale) dispatch version, so it cannot stay running."""
    sched = carry(max_staleness=0, staleness_policy="restart")
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    assert sched.samples_to_abort() == [4, 5, 6, 7]


def test_restart_within_the_bound_keeps_carried_samples():
    sched = carry(max_staleness=1, staleness_policy="restart")
    _done_step(sched)
    sched.take_batch()
    sched.begin_step(1)
    assert sched.samples_to_abort() == [] and sched.stats()["carried_samples"] == 4


def test_drop_policy_aborts_the_stale_groups_running_samples_and_drops_it_when_they_are_back():
    sched = carry(max_staleness=0, staleness_policy="drop")
    _done_step(sched)
    sched.take_batch()
    sched.begin_step(1)
    assert sched.samples_to_abort() == [4, 5, 6, 7]
    sched.on_finish(4, "abort")
    sched.on_finish(5, "stop")
    assert sched.stats()["groups_dropped_stale"] == 1
    assert sched.sample_ids("aborting") == [6, 7]
    assert all(r.sample_id >= 8 for r in sched.dispatch())  # group 3 waits for its aborts
    sched.on_finish_batch([6, 7], [2, 2])
    assert sched.stats()["groups_dropped_stale"] == 2


def test_mask_policy_masks_carried_tokens_past_the_bound():
    sched = carry(max_staleness=0, staleness_policy="mask", rollout_batch_size=1, over_sampling_batch_size=2)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, 2)
    feed(sched, 2, 2, 0)
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    assert sched.samples_to_abort() == []
    feed(sched, 2, 1, 1)
    sched.on_finish(2, "stop")
    feed(sched, 3, 1, 1)
    sched.on_finish(3, "stop")
    reward_all(sched)
    batch = sched.take_batch()
    lo, p = batch.offsets[0], batch.prompt_lens[0]
    assert batch.loss_mask[lo + p:batch.offsets[1]].tolist() == [0, 0, 1]


@pytest.mark.parametrize("when", ["mid_step", "between_steps"])
@pytest.mark.parametrize("via", ["file", "state_dict"])
def test_carried_samples_are_saved_as_partials_and_resumed_with_all_their_tokens(tmp_path, when, via):
    sched = carry()
    _done_step(sched)
    if when == "between_steps":
        sched.take_batch()
    restored = carry()
    if via == "file":
        sched.save(tmp_path / "s.state")
        restored.load(tmp_path / "s.state")
    else:
        restored.load_state_dict(sched.state_dict())
    assert restored.sample_ids("running") == [] and restored.sample_ids("queued") == [4, 5, 6, 7]
    for sid in range(4, 8):
        view = restored.sample(sid)
        assert np.array_equal(view.token_ids, token_at(sid, np.arange(2))) and view.versions.tolist() == [0, 0]
    if when == "mid_step":
        restored.take_batch()
    restored.begin_step(1)
    requests = {r.sample_id: r for r in restored.dispatch()}
    for sid in range(4, 8):  # one re-prefill of prompt + partial, the KV was not saved
        r = requests[sid]
        assert r.is_resume and np.array_equal(r.input_ids[r.prompt_len:], token_at(sid, np.arange(2)))
    assert restored.stats()["re_prefill_tokens"] == 4 * (4 + 2)


def _carry_step(sched: Scheduler, engine: FakeEngine, version: int, max_ticks: int = 10_000):
    """The carry loop: begin_step, abort what the staleness policy returns, generate, take the batch without
    aborting anything."""
    sched.begin_step(version)
    engine.version = version
    engine.abort(sched.samples_to_abort())
    generate_until_done(sched, engine, max_ticks=max_ticks)
    assert sched.samples_to_abort() == []
    return sched.take_batch()


@pytest.mark.parametrize("policy,max_staleness", [("keep", None), ("restart", 1), ("drop", 1), ("mask", 0)])
def test_carry_steps_train_whole_groups_of_exactly_what_the_engine_produced(policy, max_staleness):
    sched = carry(n_prompts=400, rollout_batch_size=4, n_samples_per_prompt=4, over_sampling_batch_size=8,
                  max_response_len=40, staleness_policy=policy, max_staleness=max_staleness)
    engine = FakeEngine(sched, lambda sid: 3 + (sid * 37) % 38, chunk=3)
    carried = 0
    for version in range(8):
        batch = _carry_step(sched, engine, version)
        carried += sched.stats()["carried_samples"]
        assert batch.n_groups == 4
        check_batch_layout(batch, 4)
        if policy in ("restart", "drop"):
            responses = batch.versions[batch.versions >= 0]
            assert responses.min(initial=version) >= version - max_staleness
        # The engine holds exactly the samples the scheduler has in flight.
        assert sorted(engine.running) == sorted(sched.sample_ids("running") + sched.sample_ids("aborting"))
    assert carried > 0


def test_a_stale_carried_sample_saved_before_its_abort_returned_is_restarted_on_load():
    sched = carry(max_staleness=0, staleness_policy="restart")
    _done_step(sched)
    sched.take_batch()
    sched.begin_step(1)
    assert sched.samples_to_abort() == [4, 5, 6, 7]
    restored = carry(max_staleness=0, staleness_policy="restart")
    restored.load_state_dict(sched.state_dict())
    for sid in range(4, 8):
        assert restored.sample(sid).state == "queued" and restored.sample(sid).token_ids.size == 0
    assert not any(r.is_resume for r in restored.dispatch())
