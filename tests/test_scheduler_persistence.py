"""Scheduler persistence: what a load restores, concurrent writers, and malformed states."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import threading
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _scheduler_utils import feed, finish_group, frame_state, make, reward_all, state_payload, token_at
from april_ext import CorruptStateError, InvalidArgumentError, Scheduler
from april_ext.batch import FinishReason

# ---------------------------------------------------------------------------- samples at the length cap


@pytest.mark.parametrize("via", ["file", "state_dict"])
def test_a_sample_saved_at_the_length_cap_comes_back_as_a_length_finish(tmp_path, via):
    sched = make(max_response_len=4)
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 4, 0)  # group 0: sample 0 reached the cap, its finish is not in yet
    feed(sched, 1, 2, 0)
    sched.on_finish(1, "stop")
    feed(sched, 2, 4, 0)  # group 1: sample 2 reached the cap, sample 3 is still generating
    feed(sched, 3, 1, 0)
    restored = make(max_response_len=4)
    if via == "file":
        sched.save(tmp_path / "s.state")
        restored.load(tmp_path / "s.state")
    else:
        restored.load_state_dict(sched.state_dict())
    assert restored.sample(0).state == "done" and restored.sample(2).state == "done"
    requests = restored.dispatch()
    assert not {0, 2} & {r.sample_id for r in requests}
    assert all(r.max_new_tokens > 0 for r in requests)
    resumed = next(r for r in requests if r.sample_id == 3)
    assert resumed.is_resume and resumed.max_new_tokens == 3
    (group,) = restored.pop_completed_groups()
    assert group.group_id == 0 and group.finish_reasons == [FinishReason.LENGTH, FinishReason.STOP]
    assert np.array_equal(group.responses[0], token_at(0, np.arange(4)))
    restored.on_finish(3, "stop")
    (group,) = restored.pop_completed_groups()
    assert group.group_id == 1 and group.finish_reasons == [FinishReason.LENGTH, FinishReason.STOP]


# ---------------------------------------------------------------------------- concurrent writers


def _busy_scheduler() -> Scheduler:
    sched = make()
    sched.begin_step(0)
    sched.dispatch()
    for sid in range(8):
        feed(sched, sid, 5 + sid, 0)
    return sched


def test_concurrent_saves_to_one_path_always_leave_a_complete_state(tmp_path):
    sched = _busy_scheduler()
    path = tmp_path / "s.state"
    sched.save(path)
    expected = sched.state_dict()
    errors: list[BaseException] = []

    def save_many() -> None:
        try:
            for _ in range(40):
                sched.save(path)
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)

    def load_many() -> None:
        reader = make()
        try:
            for _ in range(40):
                reader.load(path)
                assert reader.state_dict() == expected
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=save_many) for _ in range(4)] + [threading.Thread(target=load_many)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert os.listdir(tmp_path) == ["s.state"]  # no temporary file left behind
    restored = make()
    restored.load(path)
    assert restored.state_dict() == expected


_SAVER = """
import sys
sys.path[:0] = sys.argv[3].split(":")
from test_scheduler_persistence import _busy_scheduler
sched = _busy_scheduler()
for _ in range(int(sys.argv[2])):
    sched.save(sys.argv[1])
"""


def test_concurrent_saves_from_several_processes_leave_a_complete_state(tmp_path):
    path = tmp_path / "s.state"
    search = ":".join([str(Path(__file__).parent), *sys.path])
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_SAVER), str(path), "30", search],
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    assert os.listdir(tmp_path) == ["s.state"]
    restored = make()
    restored.load(path)
    assert restored.state_dict() == _busy_scheduler().state_dict()


# ---------------------------------------------------------------------------- malformed states


def _target() -> Scheduler:
    target = make()
    target.begin_step(3)
    target.dispatch()
    feed(target, 0, 2, 3)
    return target


@pytest.mark.parametrize("state", [
    None, [], "core", {}, {"format": "april_ext.scheduler"}, {"core": b"APRILSCH"},
    {"format": "other", "core": b""}, {"format": 3, "core": b""}, {"format": "april_ext.scheduler", "core": "nope"},
    {"format": "april_ext.scheduler", "core": None}, {"format": "april_ext.scheduler", "core": b""},
    {"format": "april_ext.scheduler", "core": b"APRILSCH" + bytes(40)},
])
def test_load_state_dict_of_a_malformed_dict_raises_corrupt_state_and_changes_nothing(state):
    target = _target()
    before = target.state_dict()
    with pytest.raises(CorruptStateError):
        target.load_state_dict(state)
    assert target.state_dict() == before
    assert len(target.dispatch()) == 0 and len(target.sample_ids("running")) == 8


@lru_cache(maxsize=1)
def _rich_state() -> bytes:
    """A state with every kind of record: accepted, completed and active groups, partials of two versions."""
    sched = make(n_prompts=20, rollout_batch_size=2, over_sampling_batch_size=5)
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 4, 3, 0)
    sched.on_finish(4, "abort")
    finish_group(sched, 0, 2)
    finish_group(sched, 1, 2)
    reward_all(sched)
    finish_group(sched, 3, 2)
    sched.pop_completed_groups()  # group 3: popped, not rewarded
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, "abort")
    sched.take_batch()
    sched.begin_step(1)
    sched.report_rewards(3, [0.0, 1.0])  # accepted
    sched.dispatch()
    feed(sched, 4, 2, 1)
    finish_group(sched, 6, 2, version=1)  # completed, waiting in the queue
    return sched.state_dict()["core"]


_SHAPE_FIELDS = 24  # n_samples_per_prompt, max_response_len and tail_extra_samples lead the payload


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_load_of_random_malformations_raises_corrupt_state_or_loads_a_consistent_state(data):
    payload = bytearray(state_payload(_rich_state()))
    kind = data.draw(st.sampled_from(["byte", "word", "cut", "grow"]))
    at = data.draw(st.integers(0, len(payload) - 1))
    if kind == "byte":
        payload[at] ^= data.draw(st.integers(1, 255))
    elif kind == "word":
        value = data.draw(st.one_of(st.sampled_from([-1, 2**31, 2**62, -(2**63), 2**63 - 1]),
                                    st.integers(-(2**63), 2**63 - 1)))
        payload[at:at + 8] = struct.pack("<q", value)
    elif kind == "cut":
        del payload[at:]
    else:
        payload[at:at] = data.draw(st.binary(min_size=1, max_size=16))
    target = _target()
    before = target.state_dict()
    state = {"format": "april_ext.scheduler", "core": frame_state(bytes(payload))}
    try:
        target.load_state_dict(state)
    except CorruptStateError:
        assert target.state_dict() == before
        return
    except InvalidArgumentError as e:  # documented: a state of another shape
        assert at < _SHAPE_FIELDS and "was saved with" in str(e)
        assert target.state_dict() == before
        return
    # Whatever loaded is a state this scheduler can hold: it saves and loads back unchanged.
    again = make()
    again.load_state_dict(target.state_dict())
    assert again.state_dict() == target.state_dict()
    target.stats()
    target.buffered_memory()
