"""Multi-turn samples (issue 25): environment tokens in a response, the waiting_env state, persistence."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from _scheduler_utils import (
    STATE_FORMAT,
    as_version_6,
    feed,
    finish_group,
    frame_state,
    make,
    reward_all,
    state_payload,
    token_at,
)
from april_ext import CorruptStateError, InvalidArgumentError, InvalidStateError

DATA = Path(__file__).parent / "data"
OBS = [900, 901]  # an observation: the environment's tokens


def turn(sched, sid, count=3, version=0):
    """The sample generates ``count`` tokens and its turn ends at a stop token: it waits for its environment."""
    feed(sched, sid, count, version)
    sched.on_env_wait(sid)


def started(**kw):
    sched = make(**kw)
    sched.begin_step(0)
    sched.dispatch()
    return sched


# ---------------------------------------------------------------------------------------------- transitions

def test_a_turn_handed_to_the_environment_waits_and_is_not_dispatched():
    sched = started()
    turn(sched, 0)
    assert sched.sample(0).state == "waiting_env"
    assert sched.sample_ids("waiting_env") == [0]
    assert 0 not in sched.sample_ids("running") + sched.sample_ids("queued") + sched.sample_ids("done")
    stats = sched.stats()
    assert stats["waiting_env_samples"] == 1 and stats["env_waits"] == 1
    assert stats["buffered_samples"] == 0  # not a partial for a resume
    assert all(r.sample_id != 0 for r in sched.dispatch())
    sched.on_finish(1, "stop")
    assert sched.pop_completed_groups() == []  # the group is not complete while a sample waits


def test_env_tokens_queue_the_sample_with_its_whole_response():
    sched = started()
    turn(sched, 0, 3)
    sched.on_env_tokens(0, OBS)
    assert sched.sample(0).state == "queued"
    assert sched.stats()["env_tokens"] == 2 and sched.stats()["generated_tokens"] == 3
    (req,) = [r for r in sched.dispatch() if r.sample_id == 0]
    response = np.concatenate([token_at(0, np.arange(3)), OBS])
    assert np.array_equal(req.input_ids[req.prompt_len:], response)
    assert req.is_resume and req.max_new_tokens == 64 - 5  # env tokens count toward max_response_len
    view = sched.sample(0)
    assert view.env_mask.tolist() == [0, 0, 0, 1, 1]
    assert view.versions.tolist() == [0, 0, 0, -1, -1]
    assert view.logprobs.tolist()[3:] == [0.0, 0.0]


def test_the_environment_ends_a_waiting_trajectory_with_a_finish():
    sched = started()
    turn(sched, 0)
    sched.on_finish(0, "stop")  # no tokens: the environment's answer
    assert sched.sample(0).state == "done"
    sched.on_finish(1, "stop")
    (group,) = sched.pop_completed_groups()
    assert group.sample_ids.tolist() == [0, 1]
    assert sched.stats()["waiting_env_samples"] == 0


def test_the_batch_masks_env_tokens_and_gives_them_no_version_or_logprob():
    sched = make(n_samples_per_prompt=1, rollout_batch_size=1, over_sampling_batch_size=1)
    sched.begin_step(0)
    sched.dispatch()
    turn(sched, 0, 2)
    sched.on_env_tokens(0, OBS)
    sched.dispatch()
    feed(sched, 0, 3, 0)
    sched.on_finish(0, "stop")
    reward_all(sched)
    batch = sched.take_batch()
    p = int(batch.prompt_lens[0])
    assert batch.loss_mask[p:].tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert batch.versions[p:].tolist() == [0, 0, -1, -1, 0, 0, 0]
    assert batch.behavior_logprobs[p:].tolist() == [-0.5, -0.5, 0.0, 0.0, -0.5, -0.5, -0.5]
    assert batch.tokens[p + 2:p + 4].tolist() == OBS
    stats = sched.stats()
    assert stats["batch_response_tokens"] == 7 and stats["batch_env_tokens"] == 2


def test_invalid_transitions_raise_invalid_state_and_change_nothing():
    sched = started()
    feed(sched, 0, 2, 0)
    before = sched.state_dict()
    with pytest.raises(InvalidStateError, match="not waiting for its environment \\(state running\\)"):
        sched.on_env_tokens(0, OBS)
    with pytest.raises(InvalidStateError, match="its response is empty"):
        sched.on_env_wait(1)
    assert sched.state_dict() == before
    sched.on_env_wait(0)
    before = sched.state_dict()
    for call in (lambda: sched.on_tokens(0, [1], [0.0], 0), lambda: sched.on_finish(0, "abort"),
                 lambda: sched.on_env_wait(0), lambda: sched.on_finish(0, "stop", [1], [0.0], 0)):
        with pytest.raises(InvalidStateError, match="waiting for its environment \\(state waiting_env\\)"):
            call()
    with pytest.raises(InvalidArgumentError, match="gets no tokens"):
        sched.on_env_tokens(0, [])
    with pytest.raises(InvalidArgumentError, match="over max_response_len=64"):
        sched.on_env_tokens(0, [1] * 63)
    with pytest.raises(InvalidArgumentError, match="token id -1"):
        sched.on_env_tokens(0, [5, -1])
    with pytest.raises(InvalidStateError, match="twice in one call"):
        sched.on_env_tokens_batch([0, 0], [1, 1], [5, 6])
    with pytest.raises(InvalidStateError, match="not waiting"):
        sched.on_env_tokens_batch(np.array([0, 1]), np.array([1, 1]), np.array([5, 6], np.int32))
    assert sched.state_dict() == before  # a rejected batch applies none of its observations
    sched.on_env_tokens(0, OBS)
    with pytest.raises(InvalidStateError, match="not waiting .*state queued"):
        sched.on_env_tokens(0, OBS)
    (req,) = [r for r in sched.dispatch() if r.sample_id == 0]
    with pytest.raises(InvalidStateError, match="ends with environment tokens"):
        sched.on_env_wait(req.sample_id)  # no model token since the observation


def test_a_batch_of_observations_is_applied_as_a_whole():
    sched = started()
    turn(sched, 0, 1)
    turn(sched, 1, 2)
    sched.on_env_tokens_batch(np.array([1, 0]), np.array([1, 2]), np.array([7, 8, 9], np.int32))
    assert sched.sample(0).token_ids[1:].tolist() == [8, 9]
    assert sched.sample(1).token_ids[2:].tolist() == [7]
    turn(sched, 2, 1)
    with pytest.raises(InvalidArgumentError, match="add up to"):
        sched.on_env_tokens_batch([2], [1], [1, 2])


def test_a_turn_or_an_observation_at_the_cap_finishes_with_length():
    sched = started(max_response_len=6)
    turn(sched, 0, 4)
    sched.on_env_tokens(0, OBS)  # 6 tokens: no room for a model turn
    view = sched.sample(0)
    assert view.state == "done" and sched.stats()["finished_samples"] == 1
    feed(sched, 1, 6, 0)
    sched.on_env_wait(1)  # a turn at the cap: no observation fits
    assert sched.sample(1).state == "done"
    (group,) = sched.pop_completed_groups()
    assert [int(r) for r in group.finish_reasons] == [1, 1]


# ---------------------------------------------------------------------------------------------- step boundary

def test_an_abort_at_the_step_boundary_leaves_a_waiting_sample_waiting():
    sched = started()
    turn(sched, 2)  # group 1 waits on a tool
    finish_group(sched, 0, 2)
    finish_group(sched, 3, 2)
    reward_all(sched)
    assert sched.step_done
    to_abort = sched.samples_to_abort()
    assert 2 not in to_abort and 3 in to_abort
    for sid in to_abort:
        sched.on_finish(sid, "abort")
    batch = sched.take_batch()
    assert batch.n_groups == 2 and 2 not in batch.sample_ids.tolist()
    assert sched.sample(2).state == "waiting_env"
    sched.on_env_tokens(2, OBS)  # the tool answers between steps
    sched.begin_step(1)
    first = sched.dispatch()[0]
    assert first.sample_id == 2 and first.is_resume  # resumed first, as a buffered partial
    assert first.input_ids[first.prompt_len:].tolist()[-2:] == OBS


def test_staleness_and_the_off_policy_share_count_model_tokens_only():
    sched = make(n_samples_per_prompt=1, rollout_batch_size=1, over_sampling_batch_size=2)
    sched.begin_step(0)
    sched.dispatch()
    turn(sched, 0, 2)  # version 0 model tokens
    feed(sched, 1, 2, 0)
    sched.on_finish(1, "stop")
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    sched.on_env_tokens(0, [5] * 6)  # many env tokens at version 1: still neither on- nor off-policy
    sched.dispatch()
    feed(sched, 0, 2, 1)
    sched.on_finish(0, "stop")
    reward_all(sched)
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, "abort")
    sched.take_batch()
    stats = sched.stats()
    assert stats["batch_response_tokens"] == 10 and stats["batch_env_tokens"] == 6
    assert stats["batch_offpolicy_tokens"] == 2 and stats["off_policy_token_ratio"] == 0.5
    assert stats["batch_carried_tokens"] == 2 and stats["carried_token_ratio"] == 0.5
    assert stats["staleness_histogram"] == [0, 1]


def test_the_restart_policy_restarts_a_stale_waiting_trajectory_env_runs_and_all():
    sched = make(max_staleness=0, staleness_policy="restart")
    sched.begin_step(0)
    sched.dispatch()
    turn(sched, 0, 2)
    sched.on_env_tokens(0, OBS)
    sched.dispatch()
    turn(sched, 0, 1)
    finish_group(sched, 1, 2)
    finish_group(sched, 2, 2)
    reward_all(sched)
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, "abort")
    sched.take_batch()
    sched.begin_step(1)
    view = sched.sample(0)
    assert view.state == "queued" and view.token_ids.size == 0 and view.env_mask.size == 0
    assert sched.stats()["waiting_env_samples"] == 0 and sched.stats()["stale_tokens_discarded"] >= 5


def test_a_waiting_surplus_sample_is_cancelled_when_its_group_completes():
    sched = make(tail_batching=True, tail_extra_samples=1)
    sched.begin_step(0)
    sched.dispatch()
    turn(sched, 2)  # slot 2 of group 0 waits
    for sid in (0, 1):
        feed(sched, sid, 2, 0)
        sched.on_finish(sid, "stop")
    assert sched.sample(2).state == "cancelled"
    assert sched.stats()["waiting_env_samples"] == 0
    with pytest.raises(InvalidStateError, match="state cancelled"):
        sched.on_env_tokens(2, OBS)


def test_waiting_samples_ended_together_past_their_groups_n_are_cancelled_not_counted():
    # The environment ends two waiting trajectories of one group in one call: the first completes the group
    # (its n done), which cancels the other although it passed the call's checks while waiting.
    sched = make(rollout_batch_size=1, over_sampling_batch_size=1, tail_batching=True, tail_extra_samples=1)
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 2, 0)
    sched.on_finish(0, "stop")
    for sid in (1, 2):
        turn(sched, sid)
    sched.on_finish_batch([1, 2], [0, 0])
    (group,) = sched.pop_completed_groups()
    assert group.sample_ids.tolist() == [0, 1] and sched.sample(2).state == "cancelled"
    stats = sched.stats()
    assert stats["waiting_env_samples"] == 0 and stats["finished_samples"] == 2
    sched.report_rewards(group.group_id, [1.0, 0.0])
    assert sched.step_done and sched.samples_to_abort() == []
    assert sched.take_batch().n_samples == 2  # no sample counted as running (it was counted -1 before)


def test_buffered_memory_counts_waiting_samples():
    sched = started()
    turn(sched, 0, 4)
    memory = sched.buffered_memory()
    assert memory["samples"] == 1 and memory["tokens"] == 4


# ---------------------------------------------------------------------------------------------- persistence

def _views(sched, ids):
    return {sid: (v.state, v.token_ids.tolist(), v.logprobs.tolist(), v.versions.tolist(), v.env_mask.tolist())
            for sid in ids for v in [sched.sample(sid)]}


def test_save_and_load_keep_env_runs_and_the_waiting_state(tmp_path):
    sched = started()
    turn(sched, 0, 2)
    sched.on_env_tokens(0, OBS)
    sched.dispatch()
    turn(sched, 0, 1)  # waiting again, with one env run
    turn(sched, 1, 3)
    sched.on_env_tokens(1, [42])  # queued, with an env run
    feed(sched, 2, 2, 0)  # running: comes back queued
    state = sched.state_dict()
    assert struct.unpack_from("<I", state["core"], 8)[0] == STATE_FORMAT == 7
    sched.save(tmp_path / "s.bin")
    restored = make()
    restored.load(tmp_path / "s.bin")
    ids = range(8)
    before, after = _views(sched, ids), _views(restored, ids)
    assert after[0] == before[0] and after[0][0] == "waiting_env"
    assert after[1] == before[1] and after[1][4] == [0, 0, 0, 1]
    assert after[2][0] == "queued" and after[2][1:] == before[2][1:]
    assert restored.stats()["waiting_env_samples"] == 1
    assert restored.state_dict()["core"] == make_copy(restored).state_dict()["core"]
    restored.on_env_tokens(0, [7])  # the loop re-runs the pending tool call and answers
    assert restored.sample(0).env_mask.tolist() == [0, 0, 1, 1, 0, 1]


def make_copy(sched):
    again = make()
    again.load_state_dict(sched.state_dict())
    return again


def _env_run_at(payload: bytes, start: int, length: int) -> int:
    needle = struct.pack("<Qii", 1, start, length)
    assert payload.count(needle) == 1
    return payload.index(needle)


@pytest.mark.parametrize("start,length,message", [
    (0, 2, "env runs are out of order or range"),  # before the first model token
    (3, 9, "env runs are out of order or range"),  # past the response
    (2, 1, "logprob other than 0.0"),  # over a model token
])
def test_a_corrupt_env_run_raises_corrupt_state(start, length, message):
    sched = started()
    turn(sched, 0, 3)
    sched.on_env_tokens(0, OBS)
    payload = bytearray(state_payload(sched.state_dict()["core"]))
    at = _env_run_at(bytes(payload), 3, 2)
    payload[at:at + 16] = struct.pack("<Qii", 1, start, length)
    with pytest.raises(CorruptStateError, match=message):
        make().load_state_dict({"format": "april_ext.scheduler", "core": frame_state(bytes(payload))})


def test_a_waiting_sample_in_an_older_format_is_corrupt():
    sched = started()
    turn(sched, 0, 3)
    with pytest.raises(AssertionError, match="waits for its environment"):
        as_version_6(sched.state_dict()["core"])  # the test helper refuses: version 6 had no such state
    core = bytearray(sched.state_dict()["core"])
    core[8] = 6  # relabelled: the reader then refuses the state byte (5) before anything else
    payload = state_payload(bytes(core))
    with pytest.raises(CorruptStateError):
        make().load_state_dict({"format": "april_ext.scheduler", "core": frame_state(payload, version=6)})


def test_a_version_6_file_written_before_env_tokens_loads_identically(tmp_path):
    """tests/data/scheduler_state_v6.bin was saved by the build before this format (commit 6233cdc); the JSON
    beside it holds what that build read back from it."""
    path = DATA / "scheduler_state_v6.bin"
    assert struct.unpack_from("<I", path.read_bytes(), 8)[0] == 6
    expected = json.loads((DATA / "scheduler_state_v6.json").read_text())
    sched = make()
    sched.load(path)
    for sid, exp in expected["samples"].items():
        view = sched.sample(int(sid))
        assert view.state == exp["state"]
        assert view.token_ids.tolist() == exp["tokens"]
        assert view.logprobs.tolist() == exp["logprobs"]
        assert view.versions.tolist() == exp["versions"]
        assert view.resumes == exp["resumes"]
        assert not view.env_mask.any()
    stats = sched.stats()
    for key, value in expected["stats"].items():
        assert stats[key] == value or (value != value and stats[key] != stats[key]), key  # NaN: no pairs
    assert stats["env_tokens"] == stats["waiting_env_samples"] == 0
    # Saved again in the current format; the same state written the old way is the old file's bytes.
    core = sched.state_dict()["core"]
    assert struct.unpack_from("<I", core, 8)[0] == STATE_FORMAT
    assert as_version_6(core) == path.read_bytes()
    assert sched.step_open  # saved mid-step, and it goes on: buffered partials resume
    assert sorted(r.sample_id for r in sched.dispatch() if r.is_resume) == [3, 4, 5, 6, 7]
