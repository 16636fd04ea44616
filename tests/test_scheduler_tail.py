"""Tail batching: short rounds send the groups still generating to a long queue, long rounds run it alone."""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from _scheduler_utils import (
    STATE_FORMAT,
    FakeEngine,
    as_version_3,
    as_version_4,
    as_version_5,
    check_batch_layout,
    feed,
    finish_group,
    frame_state,
    make,
    reward_all,
    run_step,
    state_payload,
)
from april_ext import (
    ConfigError,
    CorruptStateError,
    InvalidArgumentError,
    InvalidStateError,
    Scheduler,
    SchedulerConfig,
    _C,
)

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
    # Long-queue group 3 is chosen first, then surplus 2 by acceptance; packed in group id order.
    assert [int(s) // N_SAMPLES for s in batch.sample_ids[::N_SAMPLES]] == [2, 3]
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


# ------------------------------------------------------------------ over-provisioned samples (tail_extra_samples)

WIDTH = N_SAMPLES + 1  # slots per group with tail_extra_samples=1: sample id = group id x 3 + slot


def extra(**kw) -> Scheduler:
    """N = 2, n = 2, m = 1, N' = 4, tail batching on, overridden by ``kw``."""
    return tail(tail_extra_samples=1, **kw)


def slots_of(*gids: int) -> list[int]:
    return [gid * WIDTH + i for gid in gids for i in range(WIDTH)]


def finish(sched: Scheduler, sid: int, tokens: int, version: int = 0) -> None:
    feed(sched, sid, tokens, version)
    sched.on_finish(sid, "stop")


def test_a_group_completes_with_its_first_n_finishes_and_the_running_surplus_is_aborted_and_dropped():
    sched = extra()
    sched.begin_step(0)
    assert sorted(r.sample_id for r in sched.dispatch()) == slots_of(0, 1, 2, 3)  # n + m samples per group
    feed(sched, 1, 4, 0)
    finish(sched, 2, 3)
    finish(sched, 0, 5)  # two of group 0 done: sample 1 is surplus
    assert sched.sample(1).state == "aborting" and sched.stats()["surplus_samples_cancelled"] == 1
    assert sched.pop_completed_groups() == []  # completes once the surplus abort is back
    assert sched.samples_to_abort() == [1] and sched.samples_to_abort() == []
    feed(sched, 1, 2, 0)  # tokens still on their way are accepted
    sched.on_finish(1, "abort")
    assert sched.sample(1).state == "cancelled" and sched.sample(1).token_ids.size == 0
    assert sched.stats()["surplus_tokens_discarded"] == 6
    (group,) = sched.pop_completed_groups()
    assert group.group_id == 0 and group.sample_ids.tolist() == [0, 2] and [len(r) for r in group.responses] == [5, 3]
    sched.report_rewards(0, [1.0, 0.0], True)
    for sid, tokens in ((3, 2), (4, 2)):
        finish(sched, sid, tokens)
    feed(sched, 5, 1, 0)
    sched.on_finish(5, "stop")  # a surplus sample that finished before its abort: dropped just the same
    assert sched.sample_ids("cancelled") == [1, 5]
    reward_all(sched)
    assert sched.stats()["surplus_tokens_discarded"] == 7 and sched.stats()["surplus_samples_cancelled"] == 2
    abort_all(sched)
    batch = sched.take_batch()
    assert batch.sample_ids.tolist() == [0, 2, 3, 4] and batch.rewards.tolist()[:2] == [1.0, 0.0]
    assert batch.response_lens.tolist() == [5, 3, 2, 2] and batch.group_index.tolist() == [0, 0, 1, 1]
    assert sched.stats()["batch_samples"] == 4


def test_a_queued_surplus_sample_is_cancelled_at_once():
    sched = extra(max_inflight_samples=2)
    sched.begin_step(0)
    assert [r.sample_id for r in sched.dispatch()] == [0, 1]
    finish(sched, 0, 2)
    finish(sched, 1, 2)
    assert sched.sample(2).state == "cancelled" and sched.samples_to_abort() == []
    assert [g.sample_ids.tolist() for g in sched.pop_completed_groups()] == [[0, 1]]
    assert sched.stats()["surplus_samples_cancelled"] == 1 and sched.stats()["surplus_tokens_discarded"] == 0
    assert 2 not in [r.sample_id for r in sched.dispatch()]


def test_a_group_moving_to_the_long_queue_keeps_its_done_and_longest_samples_and_a_long_round_runs_n():
    sched = extra()
    sched.begin_step(0)
    sched.dispatch()
    for sid, tokens in ((0, 2), (1, 2), (3, 2), (4, 2)):
        finish(sched, sid, tokens)
    for sid in sched.samples_to_abort():  # the surplus samples 2 and 5
        sched.on_finish(sid, "abort")
    reward_all(sched)
    finish(sched, 6, 4)  # group 2: one done, partials of 5 and 2 tokens
    feed(sched, 7, 5, 0)
    feed(sched, 8, 2, 0)
    for sid, tokens in ((9, 1), (10, 2), (11, 3)):  # group 3: three partials
        feed(sched, sid, tokens, 0)
    assert take_groups_wide(sched) == [0, 1]
    assert sched.stats()["long_queue_groups"] == 2
    assert sched.sample_ids("cancelled") == [8, 9]  # group 2 keeps 6 (done) and 7; group 3 keeps 11 and 10
    assert sched.stats()["surplus_samples_cancelled"] == 4 and sched.stats()["surplus_tokens_discarded"] == 3
    sched.begin_step(1)
    assert sched.stats()["long_round"] == 1
    requests = sched.dispatch()
    assert sorted(r.sample_id for r in requests) == [7, 10, 11] and all(r.is_resume for r in requests)
    for sid in (7, 10, 11):
        finish(sched, sid, 1, version=1)
    groups = sched.pop_completed_groups()
    assert [g.sample_ids.tolist() for g in groups] == [[6, 7], [10, 11]]
    sched.report_rewards(2, [0.0, 1.0], False)  # rejected: a replacement runs n samples only
    sched.report_rewards(3, [0.0, 1.0], True)
    assert [r.sample_id for r in sched.dispatch()] == [12, 13] and sched.sample(14).state == "cancelled"
    assert sched.stats()["groups_launched"] == 1
    assert sched.stats()["surplus_samples_cancelled"] == 0  # born unused, not cancelled
    finish(sched, 12, 2, version=1)
    finish(sched, 13, 2, version=1)
    reward_all(sched)
    batch = sched.take_batch()
    assert batch.sample_ids.tolist() == [10, 11, 12, 13] and batch.response_lens.tolist() == [3, 4, 2, 2]


def take_groups_wide(sched: Scheduler) -> list[int]:
    """take_groups for groups of WIDTH slots."""
    abort_all(sched)
    return sorted({int(s) // WIDTH for s in sched.take_batch().sample_ids})


@pytest.mark.parametrize("restart", [False, True])
def test_restart_variant_keeps_the_trimmed_slots_cancelled(restart):
    sched = extra(tail_batching_restart=restart)
    sched.begin_step(0)
    sched.dispatch()
    for sid in (0, 1, 3, 4):
        finish(sched, sid, 2)
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, "abort")
    reward_all(sched)
    for sid in slots_of(2, 3):
        feed(sched, sid, 1 + sid % 3, 0)
    assert take_groups_wide(sched) == [0, 1]
    sched.begin_step(1)
    requests = sched.dispatch()
    assert len(requests) == 2 * N_SAMPLES and all(r.is_resume != restart for r in requests)
    assert sched.stats()["tail_restarted_samples"] == (4 if restart else 0)


def test_surplus_cancellation_survives_save_and_load_at_format_6():
    sched = extra()
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 1, 3, 0)
    finish(sched, 0, 2)
    finish(sched, 2, 2)  # sample 1 cancelled, its abort not back
    feed(sched, 4, 3, 0)
    state = sched.state_dict()
    assert struct.unpack_from("<I", state["core"], 8)[0] == STATE_FORMAT  # 6 or later
    assert struct.unpack_from("<q", state_payload(state["core"]), 16)[0] == 1  # tail_extra_samples in the header
    restored = tail_copy(sched)
    assert restored.sample(1).state == "cancelled"  # in flight at the save: dropped with its tokens
    assert [g.sample_ids.tolist() for g in restored.pop_completed_groups()] == [[0, 2]]  # complete on load
    assert restored.sample(4).state == "queued" and restored.sample(4).token_ids.size == 3
    assert restored.state_dict() == tail_copy(restored).state_dict()
    assert sorted(r.sample_id for r in restored.dispatch()) == [3, 4, 5] + slots_of(2, 3)  # mid-step
    with pytest.raises(InvalidArgumentError, match="tail_extra_samples=1; this scheduler has 2, 64, 2"):
        tail(tail_extra_samples=2).load_state_dict(state)
    with pytest.raises(InvalidArgumentError, match="tail_extra_samples=1; this scheduler has 2, 64, 0"):
        tail().load_state_dict(state)


def test_a_version_5_state_loads_without_extra_samples_only():
    plain = tail()
    step_zero(plain)
    old = dict(plain.state_dict(), core=as_version_5(plain.state_dict()["core"]))
    again = tail()
    again.load_state_dict(old)
    assert again.state_dict() == plain.state_dict()
    with pytest.raises(InvalidArgumentError, match="tail_extra_samples=0; this scheduler has 2, 64, 1"):
        extra().load_state_dict(old)


@pytest.mark.parametrize("field,message", [("state", "state does not match its samples"),
                                           ("tokens", "a cancelled sample has tokens")])
def test_a_corrupt_cancelled_slot_raises_corrupt_state(field, message):
    sched = extra(max_inflight_samples=2)
    sched.begin_step(0)
    sched.dispatch()
    finish(sched, 0, 2)
    finish(sched, 1, 2)  # slot 2 cancelled
    core = sched.state_dict()["core"]
    payload = bytearray(state_payload(core))
    if field == "state":  # the group claims a third sample done: more than n
        at = payload.index(bytes([4, 0]) + struct.pack("<q", -1))
        payload[at] = 3
    else:  # a cancelled sample with one token (and its logprob and version segment)
        at = payload.index(bytes([4, 0]) + struct.pack("<q", -1)) + 2 + 3 * 8
        assert payload[at:at + 24] == bytes(24)
        payload[at:at + 24] = struct.pack("<QiQfQii", 1, 5, 1, -0.5, 1, 0, 0)
    target = extra()
    with pytest.raises(CorruptStateError, match=message):
        target.load_state_dict({"format": "april_ext.scheduler", "core": frame_state(bytes(payload))})


def test_extra_samples_are_validated():
    for value, allowed in ((-1, "an int >= 0"), (1.0, "an int >= 0"), (True, "an int >= 0"),
                           (1, "0 unless tail_batching=True")):
        with pytest.raises(ConfigError, match=re.escape(f"SchedulerConfig.tail_extra_samples={value!r} is not "
                                                        f"allowed: {allowed}")):
            SchedulerConfig(tail_extra_samples=value)
    core = _C.SchedulerConfig()
    core.tail_extra_samples = 1
    with pytest.raises(ConfigError, match="SchedulerConfig.tail_extra_samples=1 is not allowed: 0 unless "
                                          "tail_batching=True"):
        _C.SchedulerCore(core)


@pytest.mark.parametrize("boundary", ["abort", "carry"])
@pytest.mark.parametrize("m", [1, 2])
def test_with_extra_samples_every_prompt_is_trained_once_with_n_samples(boundary, m):
    n_prompts = 40
    sched = tail(n_prompts=n_prompts, rollout_batch_size=4, over_sampling_batch_size=8, max_response_len=48,
                 tail_extra_samples=m, step_boundary=boundary)
    engine = FakeEngine(sched, lambda sid: 3 + (sid * 7919) % 41, chunk=3)
    trained: list[int] = []
    cancelled = 0
    for version in range(200):
        if sched.stats()["data_exhausted"] and sched.stats()["buffered_groups"] + sched.stats()["surplus_groups"] == 0:
            break
        batch = run_step(sched, engine, version)
        check_batch_layout(batch, N_SAMPLES)
        assert batch.n_samples == N_SAMPLES * batch.n_groups
        if not sched.stats()["data_exhausted"]:
            assert batch.n_groups == 4
        cancelled += sched.stats()["surplus_samples_cancelled"]
        trained += [int(s) // (N_SAMPLES + m) for s in batch.sample_ids[::N_SAMPLES]]
    else:
        raise AssertionError("the data never drained")
    assert sorted(trained) == list(range(n_prompts))
    assert cancelled == m * n_prompts  # every group gives up its m extra slots, once
