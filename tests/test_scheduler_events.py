"""The event hot path: arrays the core reads in place and those it gets converted, and the O(1) sample index
as groups come and go."""

from __future__ import annotations

import numpy as np
import pytest
from _scheduler_utils import abort_and_take, feed, finish_group, make, reward_all

from april_ext import InvalidArgumentError, InvalidStateError, UnknownIdError


def _running(**kw):
    sched = make(**kw)
    sched.begin_step(0)
    sched.dispatch()
    return sched


def _responses(sched, ids):
    return [(sched.sample(i).token_ids.tolist(), sched.sample(i).logprobs.tolist(), sched.sample(i).versions.tolist())
            for i in ids]


@pytest.mark.parametrize("layout", ["lists", "int32 ids", "long long", "strided", "big-endian", "unaligned"])
def test_event_arrays_of_any_layout_give_what_exact_arrays_give(layout):
    ids, counts = np.array([0, 3, 1], np.int64), np.array([2, 1, 3], np.int64)
    tokens, logprobs = np.arange(6, dtype=np.int32) + 10, np.linspace(-1, 0, 6).astype(np.float32)
    versions = np.zeros(3, np.int64)
    exact = _running()
    exact.on_tokens_batch(ids, counts, tokens, logprobs, versions)
    other = _running()
    if layout == "lists":
        args = (ids.tolist(), counts.tolist(), tokens.tolist(), logprobs.tolist(), versions.tolist())
    elif layout == "int32 ids":
        args = (ids.astype(np.int32), counts.astype(np.int32), tokens.astype(np.int64), logprobs, versions)
    elif layout == "long long":  # equal to int64 for numpy, another type number
        args = (ids.astype(np.longlong), counts.astype(np.longlong), tokens, logprobs, versions.astype(np.longlong))
        assert args[0].dtype.num != ids.dtype.num
    elif layout == "strided":
        args = tuple(np.repeat(a, 2)[::2] for a in (ids, counts, tokens, logprobs, versions))
        assert not args[0].flags.c_contiguous
    elif layout == "big-endian":
        args = (ids.astype(">i8"), counts.astype(">i8"), tokens.astype(">i4"), logprobs.astype(">f4"),
                versions.astype(">i8"))
    else:
        raw = np.zeros(ids.nbytes + 1, np.uint8)
        unaligned = raw[1:].view(np.int64)
        unaligned[:] = ids
        assert not unaligned.flags.aligned
        args = (unaligned, counts, tokens, logprobs, versions)
    other.on_tokens_batch(*args)
    assert _responses(other, range(4)) == _responses(exact, range(4))
    finished = np.array([0, 3], np.int64)
    exact.on_finish_batch(finished, np.zeros(2, np.uint8))
    other.on_finish_batch(finished.tolist() if layout == "lists" else args[0][[0, 1]], [0, 0])
    assert exact.sample_ids("done") == other.sample_ids("done") == [0, 3]


def test_two_dimensional_event_arrays_are_rejected():
    sched = _running()
    with pytest.raises(InvalidArgumentError, match="1-D"):
        sched.on_tokens_batch(np.zeros((1, 1), np.int64), np.ones(1, np.int64), np.zeros(1, np.int32),
                              np.zeros(1, np.float32), np.zeros(1, np.int64))
    assert sched.stats()["generated_tokens"] == 0


def test_sample_ids_of_trained_groups_and_out_of_window_ids_are_unknown():
    """The index covers live samples only: ids of groups taken into a batch, never launched, or negative."""
    sched = _running()  # N = 2, n = 2, N' = 4: groups 0-3, samples 0-7
    for gid in (0, 1):
        finish_group(sched, gid, 2)
    reward_all(sched)
    abort_and_take(sched)
    for sid in (0, 3, 8, 1000, -1, -(2**63)):
        with pytest.raises(UnknownIdError, match=f"sample id {sid} is not known"):
            sched.on_tokens_batch(np.array([sid], np.int64), np.ones(1, np.int64), np.zeros(1, np.int32),
                                  np.zeros(1, np.float32), np.zeros(1, np.int64))
    sched.begin_step(1)
    resumed = {r.sample_id for r in sched.dispatch()}
    assert resumed == set(range(4, 12))  # the partials of groups 2-3 and the new groups 4-5
    for sid in sorted(resumed):
        sched.on_tokens(sid, [5], [-0.1], 1)
    assert sched.stats()["generated_tokens"] == 8


def test_sample_index_follows_groups_over_many_steps_and_a_reload():
    """Groups leave out of launch order (rejected groups, surplus); the index must follow every one."""
    sched = _running(n_prompts=400)
    for step in range(12):
        if step:
            sched.begin_step(step)
            sched.dispatch()
        running = sched.sample_ids("running")
        for sid in running:
            sched.on_tokens(sid, [sid % 50], [-0.5], step)
        groups = sorted({sid // 2 for sid in running})
        for gid in groups[::-1][:3]:  # newest first: groups complete out of launch order
            for sid in (2 * gid, 2 * gid + 1):
                if sid in running:
                    sched.on_finish(sid, "stop")
        for group in sched.pop_completed_groups():
            sched.report_rewards(group.group_id, [0.0, 1.0], accepted=group.group_id % 3 != 0)
        if step == 6:
            state = sched.state_dict()
            sched = make(n_prompts=400)
            sched.load_state_dict(state)
            sched.dispatch()
        if sched.step_done:
            abort_and_take(sched)
        else:
            for sid in sched.samples_to_abort():
                sched.on_finish(sid, "abort")
    for sid in sched.sample_ids("queued") + sched.sample_ids("done"):
        assert sched.sample(sid).token_ids.size >= 0  # every live id resolves


def _carried():
    """Step 1 of a carry run: samples 4-7 running since step 0, with version-0 tokens (4: 3, 5-7: 2), 7 done."""
    sched = _running(step_boundary="carry", max_response_len=16)
    for sid in range(4, 8):
        feed(sched, sid, 3 if sid == 4 else 2, 0)
    sched.on_finish(7, "stop")
    for gid in (0, 1):
        finish_group(sched, gid, 2)
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    return sched


# Good events first: new version-1 segments on samples 4 and 6, sample 4 twice, sample 5 staying on version 0.
_GOOD = ([4, 5, 4, 6], [2, 1, 3, 1], [1, 0, 1, 1])
_BAD = {
    "unknown id": (999, 1, 1, 5),
    "sample done": (7, 1, 1, 5),
    "version below the call's earlier tokens": (4, 1, 0, 5),
    "over max_response_len": (6, 14, 1, 5),
    "negative token id": (5, 1, 0, -3),
}


@pytest.mark.parametrize("bad", [*_BAD, "counts short of the tokens"])
def test_a_rejected_token_batch_changes_nothing_after_applying_its_earlier_events(bad):
    """on_tokens applies each event as it checks it: a rejection undoes the events before it, segments too."""
    ids, counts, versions = (list(a) for a in _GOOD)
    tokens = list(range(100, 100 + sum(counts)))
    if bad in _BAD:
        sid, count, version, token = _BAD[bad]
        ids, counts, versions, tokens = ids + [sid], counts + [count], versions + [version], tokens + [token] * count
    else:
        tokens.append(7)  # one token no event counts: detected after every event was applied
    sched = _carried()
    before = (sched.state_dict(), str(sched.stats()), _responses(sched, range(4, 8)))  # str: a nan equals itself
    with pytest.raises((InvalidArgumentError, InvalidStateError, UnknownIdError)):
        sched.on_tokens_batch(np.array(ids, np.int64), np.array(counts, np.int64), np.array(tokens, np.int32),
                              np.zeros(len(tokens), np.float32), np.array(versions, np.int64))
    assert (sched.state_dict(), str(sched.stats()), _responses(sched, range(4, 8))) == before
    # What the rejected call left behind takes the good events as a scheduler that never saw it does.
    fresh = _carried()
    for s in (sched, fresh):
        s.on_tokens_batch(*_GOOD[:2], list(range(100, 107)), [-0.5] * 7, _GOOD[2])
    assert _responses(sched, range(4, 8)) == _responses(fresh, range(4, 8))
    assert sched.sample(4).versions.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert sched.state_dict() == fresh.state_dict()
