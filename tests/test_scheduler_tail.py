"""Tail batching: short rounds send the groups still generating to a long queue, long rounds run it alone."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from _scheduler_utils import (
    FakeEngine,
    as_version_3,
    as_version_4,
    check_batch_layout,
    feed,
    finish_group,
    frame_state,
    make,
    reward_all,
    run_step,
    state_payload,
)
from april_ext import CorruptStateError, InvalidStateError, Scheduler

N_SAMPLES = 2


def tail(**kw) -> Scheduler:
    """N = 2, n = 2, N' = 4, tail batching on, overridden by ``kw``."""
    return make(tail_batching=True, **kw)


def samples_of(*gids: int) -> list[int]:
    return [gid * N_SAMPLES + i for gid in gids for i in range(N_SAMPLES)]


def abort_all(sched: Scheduler) -> None:
    """The engine answers every abort with no further token."""
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, "abort")


def take_groups(sched: Scheduler) -> list[int]:
    """Ends a done step (aborting what runs, unless it is carried) and returns the trained groups."""
    if sched.config.step_boundary == "abort":
        abort_all(sched)
    batch = sched.take_batch()
    return sorted({int(s) // N_SAMPLES for s in batch.sample_ids})


def step_zero(sched: Scheduler, started: tuple[int, ...] = (2, 3)) -> None:
    """Step 0: groups 0 and 1 finish and are trained; the groups in ``started`` (of 2, 3) generated tokens on
    every sample, the others none; every running sample is aborted."""
    sched.begin_step(0)
    assert len(sched.dispatch()) == 8
    finish_group(sched, 0, N_SAMPLES)
    finish_group(sched, 1, N_SAMPLES)
    reward_all(sched)
    for sid in samples_of(*started):
        feed(sched, sid, 2 + sid % 2, 0)
    abort_all(sched)
    assert take_groups(sched) == [0, 1]


def test_a_short_round_sends_the_started_groups_still_generating_to_the_long_queue():
    sched = tail()
    step_zero(sched, started=(2,))
    assert sched.stats()["long_queue_groups"] == 1  # group 2; group 3 produced nothing and is in flight no more
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 0  # 1 long-queue group < N
    ids = [r.sample_id for r in sched.dispatch()]
    assert not set(samples_of(2)) & set(ids), "a long-queue group ran in a short round"
    assert samples_of(3) == ids[:2]  # the group that never started is ordinary buffered work
    assert sched.stats()["groups_launched"] == 3  # N' = 4 in hand: groups 3, 4, 5, 6


def test_a_long_round_runs_only_the_long_queue_and_launches_nothing():
    sched = tail()
    step_zero(sched)
    assert sched.stats()["long_queue_groups"] == 2
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 1
    requests = sched.dispatch()
    assert sorted(r.sample_id for r in requests) == samples_of(2, 3) and all(r.is_resume for r in requests)
    finish_group(sched, 2, N_SAMPLES, version=1)
    reward_all(sched)
    assert sched.dispatch() == [] and sched.stats()["groups_launched"] == 0  # no over-sampling
    finish_group(sched, 3, N_SAMPLES, version=1)
    reward_all(sched)
    assert sched.step_done and sched.samples_to_abort() == []
    assert take_groups(sched) == [2, 3]
    assert sched.stats()["long_queue_groups"] == 0
    sched.begin_step(2)  # the long queue is empty: a short round over-samples again
    assert sched.stats()["long_round"] == 0 and len(sched.dispatch()) == 8


def test_a_long_round_batch_holds_long_queue_groups_only_and_the_surplus_waits_for_a_short_round():
    sched = tail(over_sampling_batch_size=5)
    sched.begin_step(0)
    sched.dispatch()
    for gid in (0, 1, 2):
        finish_group(sched, gid, N_SAMPLES)
        reward_all(sched)  # group 2 is accepted surplus
    for sid in samples_of(3, 4):
        feed(sched, sid, 2, 0)
    abort_all(sched)
    assert take_groups(sched) == [0, 1]
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 1 and not sched.step_done  # the accepted surplus does not count
    sched.dispatch()
    for gid in (3, 4):
        finish_group(sched, gid, N_SAMPLES, version=1)
    reward_all(sched)
    assert take_groups(sched) == [3, 4]
    assert sched.stats()["surplus_groups"] == 1
    sched.begin_step(2)
    sched.dispatch()
    finish_group(sched, 5, N_SAMPLES, version=2)
    reward_all(sched)
    assert sched.step_done
    assert take_groups(sched) == [2, 5]


def test_filter_rejections_in_a_long_round_are_replaced_one_for_one():
    sched = tail()
    step_zero(sched)
    sched.begin_step(1)
    sched.dispatch()
    finish_group(sched, 2, N_SAMPLES, version=1)
    for g in sched.pop_completed_groups():
        sched.report_rewards(g.group_id, [1.0, 1.0], accepted=False)
    requests = sched.dispatch()  # the long queue cannot fill N any more: exactly one new group
    assert sorted(r.sample_id for r in requests) == samples_of(4) and not any(r.is_resume for r in requests)
    assert sched.stats()["groups_launched"] == 1 and sched.stats()["groups_filtered"] == 1
    finish_group(sched, 4, N_SAMPLES, version=1)
    reward_all(sched)
    assert sched.dispatch() == [] and not sched.step_done
    finish_group(sched, 3, N_SAMPLES, version=1)
    reward_all(sched)
    assert take_groups(sched) == [3, 4]


def test_restart_variant_restarts_long_queue_groups_from_the_prompt_and_counts_it():
    sched = tail(tail_batching_restart=True)
    step_zero(sched)
    sched.begin_step(1)
    stats = sched.stats()
    assert stats["tail_restarted_samples"] == 4
    assert stats["tail_tokens_discarded"] == 2 + 3 + 2 + 3
    requests = sched.dispatch()
    assert sorted(r.sample_id for r in requests) == samples_of(2, 3)
    assert all(not r.is_resume and r.input_ids.size == r.prompt_len for r in requests)
    for gid in (2, 3):
        finish_group(sched, gid, N_SAMPLES, version=1)
    reward_all(sched)
    batch = sched.take_batch()
    assert np.all(batch.versions[batch.loss_mask == 1] == 1)
    assert sched.stats()["batch_offpolicy_tokens"] == 0


def test_without_restart_a_long_round_resumes_every_token():
    sched = tail()
    step_zero(sched)
    sched.begin_step(1)
    assert sched.stats()["tail_restarted_samples"] == 0 and sched.stats()["tail_tokens_discarded"] == 0
    requests = {r.sample_id: r for r in sched.dispatch()}
    assert [requests[s].input_ids.size - requests[s].prompt_len for s in samples_of(2, 3)] == [2, 3, 2, 3]


def test_carry_long_queue_groups_keep_running_and_count_only_in_a_long_round():
    sched = tail(over_sampling_batch_size=3, step_boundary="carry")
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, N_SAMPLES)
    finish_group(sched, 1, N_SAMPLES)
    reward_all(sched)
    feed(sched, 4, 1, 0)
    assert take_groups(sched) == [0, 1]
    assert sched.stats()["long_queue_groups"] == 1
    sched.begin_step(1)  # a short round: group 2 is carried, generating
    assert sched.stats()["long_round"] == 0 and sched.stats()["carried_samples"] == 2
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(3, 4, 5)
    finish_group(sched, 2, N_SAMPLES, version=1)
    reward_all(sched)  # a long-queue group accepted in a short round does not count towards it
    finish_group(sched, 3, N_SAMPLES, version=1)
    reward_all(sched)
    assert not sched.step_done
    finish_group(sched, 4, N_SAMPLES, version=1)
    reward_all(sched)
    assert take_groups(sched) == [3, 4]
    assert sched.stats()["long_queue_groups"] == 2  # group 2 (done) and group 5 (carried)
    sched.begin_step(2)
    assert sched.stats()["long_round"] == 1 and sched.dispatch() == []
    assert not sched.step_done
    finish_group(sched, 5, N_SAMPLES, version=2)
    reward_all(sched)
    assert take_groups(sched) == [2, 5]


def test_restart_variant_with_carry_aborts_the_carried_samples_and_restarts_completed_groups():
    sched = tail(over_sampling_batch_size=4, step_boundary="carry", tail_batching_restart=True)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, N_SAMPLES)
    finish_group(sched, 1, N_SAMPLES)
    reward_all(sched)
    feed(sched, 4, 2, 0)
    feed(sched, 6, 1, 0)
    take_groups(sched)
    finish_group(sched, 2, N_SAMPLES)  # completes between the steps: accepted, still in the long queue
    reward_all(sched)
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 1
    assert sched.samples_to_abort() == samples_of(3)  # carried, with tokens of version 0
    assert sched.stats()["tail_restarted_samples"] == 2  # group 2 at once
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(2)
    sched.on_finish(6, "abort")
    assert sched.dispatch() == []  # group 3 restarts when its last sample is back
    sched.on_finish(7, "abort")
    assert sched.stats()["tail_restarted_samples"] == 3  # sample 7 had nothing to discard
    assert sched.stats()["tail_tokens_discarded"] == (2 + 3) + 3 + 1
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(3)
    for gid in (2, 3):
        finish_group(sched, gid, N_SAMPLES, version=1)
    reward_all(sched)
    batch = sched.take_batch()
    assert np.all(batch.versions[batch.loss_mask == 1] == 1)


def test_a_popped_long_queue_group_restarted_before_its_reward_is_handed_out_again():
    sched = tail(over_sampling_batch_size=4, step_boundary="carry", tail_batching_restart=True)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, N_SAMPLES)
    finish_group(sched, 1, N_SAMPLES)
    reward_all(sched)
    feed(sched, 6, 1, 0)
    take_groups(sched)
    finish_group(sched, 2, N_SAMPLES)
    (popped,) = sched.pop_completed_groups()
    sched.begin_step(1)  # group 2 restarts: its pop is void
    with pytest.raises(InvalidStateError):
        sched.report_rewards(popped.group_id, [0.0, 1.0])
    sched.dispatch()
    finish_group(sched, 2, N_SAMPLES, version=1)
    assert [g.group_id for g in sched.pop_completed_groups()] == [2]


def test_continuous_refill_tops_up_only_short_rounds():
    sched = tail(refill="continuous")
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, N_SAMPLES)
    reward_all(sched)
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(4)  # topped up to N' = 4 generating
    finish_group(sched, 1, N_SAMPLES)
    reward_all(sched)
    for sid in samples_of(2, 3):
        feed(sched, sid, 2, 0)
    abort_all(sched)  # group 4 is aborted before its first token: it has not started
    assert take_groups(sched) == [0, 1]
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 1
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(2, 3)
    finish_group(sched, 2, N_SAMPLES, version=1)
    reward_all(sched)
    assert sched.dispatch() == []  # no top-up in a long round
    finish_group(sched, 3, N_SAMPLES, version=1)
    reward_all(sched)
    assert take_groups(sched) == [2, 3] and sched.stats()["groups_launched"] == 0
    sched.begin_step(2)
    ids = sorted(r.sample_id for r in sched.dispatch())
    assert ids == samples_of(4, 5, 6, 7)  # group 4 again, and three new groups: N' = 4 generating


def test_adaptive_target_counts_only_the_short_rounds_live_samples():
    sched = tail(rollout_batch_size=3, over_sampling_batch_size=3, over_sampling="adaptive",
                 target_inflight_samples=8)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 8  # four groups
    for gid in (0, 1, 2):
        finish_group(sched, gid, N_SAMPLES)
    reward_all(sched)
    feed(sched, 6, 2, 0)
    assert take_groups(sched) == [0, 1, 2]
    sched.begin_step(1)  # group 3 waits in the long queue (1 < N) with two queued samples
    assert sched.stats()["long_round"] == 0
    ids = sorted(r.sample_id for r in sched.dispatch())
    assert ids == samples_of(4, 5, 6, 7)  # the whole target of new work, none of the long queue's


def test_data_exhaustion_drains_the_long_queue():
    sched = tail(n_prompts=4, rollout_batch_size=3)
    sched.begin_step(0)
    sched.dispatch()  # all four prompts: the data is used up
    for gid in (0, 1, 2):
        finish_group(sched, gid, N_SAMPLES)
    reward_all(sched)
    feed(sched, 6, 2, 0)
    abort_all(sched)
    assert take_groups(sched) == [0, 1, 2]
    sched.begin_step(1)  # 1 long-queue group < N, but nothing new can come
    assert sched.stats()["long_round"] == 1
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(3)
    finish_group(sched, 3, N_SAMPLES, version=1)
    reward_all(sched)
    assert sched.step_done and take_groups(sched) == [3]


def test_a_drain_round_takes_long_queue_groups_first_then_the_rest():
    sched = tail(n_prompts=5, over_sampling_batch_size=5)
    sched.begin_step(0)
    sched.dispatch()  # all five prompts
    for gid in (0, 1, 2):
        finish_group(sched, gid, N_SAMPLES)
        reward_all(sched)  # group 2: accepted surplus
    feed(sched, 6, 2, 0)  # group 3 started; group 4 did not
    assert take_groups(sched) == [0, 1]
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 1
    assert sorted(r.sample_id for r in sched.dispatch()) == samples_of(3, 4)  # a drain round runs what is left
    finish_group(sched, 3, N_SAMPLES, version=1)
    reward_all(sched)
    abort_all(sched)
    batch = sched.take_batch()
    assert [int(s) // N_SAMPLES for s in batch.sample_ids[::N_SAMPLES]] == [3, 2]  # long first, then by acceptance
    sched.begin_step(2)
    assert sched.stats()["long_round"] == 0
    sched.dispatch()
    finish_group(sched, 4, N_SAMPLES, version=2)
    reward_all(sched)
    assert sched.step_done and take_groups(sched) == [4]


@pytest.mark.parametrize("restart", [False, True])
def test_every_prompt_is_trained_once_and_every_batch_is_full_until_the_data_runs_out(restart):
    n_prompts = 60
    sched = tail(n_prompts=n_prompts, rollout_batch_size=4, over_sampling_batch_size=8, max_response_len=48,
                 tail_batching_restart=restart)
    engine = FakeEngine(sched, lambda sid: 3 + (sid * 7919) % 41, chunk=3)
    trained: list[int] = []
    long_rounds = 0
    for version in range(200):
        if sched.stats()["data_exhausted"] and sched.stats()["buffered_groups"] + sched.stats()["surplus_groups"] == 0:
            break
        batch = run_step(sched, engine, version)
        check_batch_layout(batch, N_SAMPLES)
        stats = sched.stats()
        long_rounds += stats["long_round"]
        if restart and stats["long_round"] and not stats["data_exhausted"]:
            assert stats["batch_offpolicy_tokens"] == 0, "a restarted long round trained older tokens"
        if not stats["data_exhausted"]:
            assert batch.n_groups == 4
        trained += [int(s) // N_SAMPLES for s in batch.sample_ids[::N_SAMPLES]]
    else:
        raise AssertionError("the data never drained")
    assert sorted(trained) == list(range(n_prompts))
    assert long_rounds >= 2


def test_the_long_queue_survives_save_and_load():
    sched = tail()
    step_zero(sched)
    restored = tail()
    restored.load_state_dict(sched.state_dict())
    assert restored.stats()["long_queue_groups"] == 2
    restored.begin_step(1)
    assert restored.stats()["long_round"] == 1
    assert sorted(r.sample_id for r in restored.dispatch()) == samples_of(2, 3)
    mid = tail_copy(restored)  # mid long round: the round stays long, the requests come back buffered
    assert mid.stats()["long_round"] == 1 and mid.state_dict() == restored.state_dict()
    assert sorted(r.sample_id for r in mid.dispatch()) == samples_of(2, 3)
    finish_group(mid, 2, N_SAMPLES, version=1)
    reward_all(mid)
    assert mid.dispatch() == [] and mid.stats()["groups_launched"] == 0


def tail_copy(sched: Scheduler) -> Scheduler:
    again = Scheduler(sched.config, sched.data)
    again.load_state_dict(sched.state_dict())
    return again


def test_a_restart_waiting_for_aborts_survives_save_and_load():
    sched = tail(tail_batching_restart=True)
    sched.begin_step(0)
    sched.dispatch()
    finish_group(sched, 0, N_SAMPLES)
    finish_group(sched, 1, N_SAMPLES)
    reward_all(sched)
    for sid in samples_of(2, 3):
        feed(sched, sid, 2, 0)
    to_abort = sched.samples_to_abort()
    for sid in to_abort[:-1]:
        sched.on_finish(sid, "abort")
    take_groups(sched)  # the last abort is still on its way back
    sched.begin_step(1)
    assert sched.stats()["tail_restarted_samples"] == 2  # group 2; group 3 waits for sample 7
    restored = tail_copy(sched)  # nothing is in flight after a load: group 3 restarts there
    assert restored.stats()["tail_restarted_samples"] == 4
    requests = restored.dispatch()
    assert sorted(r.sample_id for r in requests) == samples_of(2, 3) and not any(r.is_resume for r in requests)


@pytest.mark.parametrize("older", [as_version_3, as_version_4])
def test_version_3_and_4_states_load_with_no_long_queue(older):
    sched = tail()
    step_zero(sched)
    plain = make()
    plain.begin_step(0)
    plain.dispatch()
    finish_group(plain, 0, N_SAMPLES)
    sched.load_state_dict(dict(plain.state_dict(), core=older(plain.state_dict()["core"])))
    assert sched.stats()["long_queue_groups"] == 0 and sched.stats()["long_round"] == 0
    assert sched.sample_ids("queued") == samples_of(1, 2, 3)
    if older is as_version_4:  # everything else of a version 4 state is kept
        assert sched.state_dict() == plain.state_dict()


@pytest.mark.parametrize("where", ["round", "long", "restart"])
def test_corrupt_tail_fields_raise_corrupt_state(where):
    sched = tail()
    step_zero(sched)
    payload = bytearray(state_payload(sched.state_dict()["core"]))
    # The end of the payload: round (u8), long-queue ids (u64 count + 2 x i64), pending restarts (u64 count).
    end = len(payload)
    if where == "round":
        payload[end - 8 - 24 - 1] = 3
    elif where == "long":
        payload[end - 8 - 8:end - 8] = struct.pack("<q", 99)
    else:
        payload[end - 8:] = struct.pack("<Q", 1) + payload[end - 16:end - 8]
    target = tail()
    before = target.state_dict()
    with pytest.raises(CorruptStateError):
        target.load_state_dict({"format": "april_ext.scheduler", "core": frame_state(bytes(payload))})
    assert target.state_dict() == before


def test_tail_batching_off_keeps_every_group_in_one_pool():
    sched = make()
    step_zero(sched)
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 0 and sched.stats()["long_queue_groups"] == 0
    assert len(sched.dispatch()) == 8  # the partials resume beside two new groups
