"""Adaptive over-sampling: the scheduler keeps a target of samples live and retunes its group ceiling."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from _scheduler_utils import (
    STATE_FORMAT,
    FakeEngine,
    as_version_3,
    check_batch_layout,
    frame_state,
    long_tail_length,
    prompts,
    run_step,
    state_payload,
    token_at,
)
from april_ext import ConfigError, CorruptStateError, Scheduler, SchedulerConfig


def make(n_prompts: int = 200, **kw) -> Scheduler:
    base = dict(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=2, max_response_len=64,
                over_sampling="adaptive", target_inflight_samples=8)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base), prompts(n_prompts))


def finish(sched: Scheduler, sid: int, tokens: int = 3, version: int = 0) -> None:
    sched.on_finish(sid, "stop", token_at(sid, np.arange(tokens)), -0.5 * np.ones(tokens), version)


@pytest.mark.parametrize("kw,field", [
    (dict(over_sampling="auto"), "over_sampling"),
    (dict(over_sampling="adaptive"), "target_inflight_samples"),
    (dict(over_sampling="adaptive", target_inflight_samples=1), "target_inflight_samples"),
    (dict(over_sampling="adaptive", target_inflight_samples=4.0), "target_inflight_samples"),
    (dict(target_inflight_samples=16), "target_inflight_samples"),
])
def test_config_rejects_bad_adaptive_settings(kw, field):
    with pytest.raises(ConfigError, match=rf"SchedulerConfig\.{field}=.*not allowed"):
        SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, **kw)


def test_first_step_launches_enough_groups_for_the_target_and_dispatches_at_most_it():
    # T = 7 live samples of n = 2: ceil(7 / 2) = 4 groups (the floor N'_0), 7 of their 8 samples dispatched.
    sched = make(target_inflight_samples=7, refill="continuous")
    sched.begin_step(0)
    reqs = sched.dispatch()
    assert len(reqs) == 7
    assert sched.stats()["groups_launched"] == 4 and sched.stats()["over_sampling_groups"] == 4
    assert sched.dispatch() == []  # 8 live: no deficit, and the dispatch cap is full
    finish(sched, 0)
    assert [r.sample_id for r in sched.dispatch()] == [7]  # the queued sample fills the free slot first
    finish(sched, 2)  # live 6 < 7, but 4 groups are active: the ceiling (4) allows no new one
    assert sched.dispatch() == [] and sched.stats()["groups_launched"] == 4
    finish(sched, 1)  # group 0 completes: 3 active groups, deficit 2 -> one new group
    reqs = sched.dispatch()
    assert {r.group_id for r in reqs} == {4} and len(reqs) == 2


def test_group_ceiling_is_retuned_from_the_live_share_observed_at_the_step_end():
    sched = make(rollout_batch_size=1, target_inflight_samples=8)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 8  # groups 0..3
    for sid in (0, 1, 2, 4, 6):  # group 0 complete; groups 1, 2, 3 keep one live sample each
        finish(sched, sid)
    for g in sched.pop_completed_groups():
        sched.report_rewards(g.group_id, [0.0, 1.0])
    assert sched.step_done
    engine_ids = sched.samples_to_abort()
    assert sorted(engine_ids) == [3, 5, 7]
    for sid in engine_ids:
        sched.on_finish(sid, "abort", token_at(sid, np.arange(2)), -0.5 * np.ones(2), 0)
    sched.take_batch()
    # Observed live share 3 / (2 x 3) = 0.5; running mean 0.5 x 1 + 0.5 x 0.5 = 0.75; ceil(8 / (2 x 0.75)) = 6.
    sched.begin_step(1)
    assert sched.stats()["over_sampling_groups"] == 6
    reqs = sched.dispatch()
    assert [r.sample_id for r in reqs[:3]] == [3, 5, 7] and all(r.is_resume for r in reqs[:3])
    # 3 live partials + ceil((8 - 3) / 2) = 3 new groups (6 samples) -> 9 live, 8 dispatched.
    assert sched.stats()["groups_launched"] == 3 and len(reqs) == 8


def test_ceiling_rises_as_groups_thin_out_but_stays_within_floor_and_target():
    # n = 4, T = 4: the floor is max(N' = 2, ceil(4 / 4) = 1) = 2 groups, the ceiling T = 4 groups.
    sched = make(rollout_batch_size=1, n_samples_per_prompt=4, target_inflight_samples=4, refill="continuous")
    seen = []
    for step in range(8):
        sched.begin_step(step)
        seen.append(sched.stats()["over_sampling_groups"])
        # Every sample but the last of each group finishes: groups thin out to one live sample each.
        for _ in range(50):
            reqs = sched.dispatch()
            assert len(sched.sample_ids("running")) <= 4
            done = [r.sample_id for r in reqs if r.sample_id % 4 != 3]
            for sid in done:
                finish(sched, sid, version=step)
            if not done:
                break
        finish(sched, sched.sample_ids("running")[0], version=step)
        for g in sched.pop_completed_groups():
            sched.report_rewards(g.group_id, [0.0, 1.0, 0.0, 1.0])
        for sid in sched.samples_to_abort():
            sched.on_finish(sid, "abort")
        sched.take_batch()
    assert all(2 <= g <= 4 for g in seen)
    assert seen[0] == 2 and max(seen) > 2, seen


def test_adaptive_run_keeps_the_engine_at_the_target_and_every_batch_exact():
    n, big_n, target, cap = 4, 4, 40, 512
    sched = Scheduler(SchedulerConfig(rollout_batch_size=big_n, n_samples_per_prompt=n, max_response_len=cap,
                                      refill="continuous", over_sampling="adaptive",
                                      target_inflight_samples=target), prompts(2000))
    engine = FakeEngine(sched, lambda sid: long_tail_length(sid, cap, seed=3), chunk=32)
    trained, peak, full_ticks, ticks = set(), 0, 0, 0
    for version in range(5):
        sched.begin_step(version)
        engine.version = version
        while not sched.step_done:
            engine.submit(sched.dispatch())
            peak = max(peak, len(engine.running))
            ticks += 1
            full_ticks += len(engine.running) == target
            engine.tick()
            for g in sched.pop_completed_groups():
                sched.report_rewards(g.group_id, [float(i % 2) for i in range(n)])
        engine.abort(sched.samples_to_abort())
        batch = sched.take_batch()
        check_batch_layout(batch, n)
        assert batch.n_groups == big_n
        groups = set((batch.sample_ids // n).tolist())
        assert not groups & trained
        trained |= groups
    assert peak == target  # never more than the target in flight
    assert full_ticks / ticks > 0.75  # and mostly exactly the target


def test_adaptive_state_survives_save_and_load(tmp_path):
    sched = make(rollout_batch_size=1, target_inflight_samples=8)
    engine = FakeEngine(sched, lambda sid: 5 + sid % 7, chunk=2)
    run_step(sched, engine, 0)
    run_step(sched, engine, 1)
    sched.save(tmp_path / "s.bin")
    restored = make(rollout_batch_size=1, target_inflight_samples=8)
    restored.load(tmp_path / "s.bin")
    sched.begin_step(2)
    restored.begin_step(2)
    assert restored.stats()["over_sampling_groups"] == sched.stats()["over_sampling_groups"]
    assert [r.sample_id for r in restored.dispatch()] == [r.sample_id for r in sched.dispatch()]


_COUNTERS_AT = 8 + 8 + 8 + 8 + 1 + 1 + 8 + 8  # n, max_len, next group id, prompts, flags, version, step


def _as_version_2(core: bytes) -> bytes:
    """Rewrite a state as version 2 wrote it: 33 counters (no carried_samples, carried_kv_tokens)."""
    payload = state_payload(as_version_3(core))
    (count,) = struct.unpack_from("<Q", payload, _COUNTERS_AT)
    assert count == 35
    last = _COUNTERS_AT + 8 + 33 * 8  # carried_samples, carried_kv_tokens: the counters version 3 added
    payload = payload[:_COUNTERS_AT] + struct.pack("<Q", 33) + payload[_COUNTERS_AT + 8:last] + payload[last + 16:]
    return frame_state(payload, version=2)


def _as_version_1(core: bytes) -> bytes:
    """Rewrite a state as version 1 wrote it: 32 counters, no adaptive fields at the end."""
    payload = state_payload(as_version_3(core))
    last = _COUNTERS_AT + 8 + 32 * 8  # over_sampling_groups, the counter version 2 added
    payload = (payload[:_COUNTERS_AT] + struct.pack("<Q", 32) + payload[_COUNTERS_AT + 8:last] + payload[last + 24:-16])
    return frame_state(payload, version=1)


def test_version_1_state_files_still_load_into_fixed_and_adaptive_schedulers():
    fixed = Scheduler(SchedulerConfig(rollout_batch_size=1, n_samples_per_prompt=2, over_sampling_batch_size=3,
                                      max_response_len=64), prompts(50))
    engine = FakeEngine(fixed, lambda sid: 4 + sid % 5, chunk=2)
    run_step(fixed, engine, 0)
    fixed.begin_step(1)
    fixed.dispatch()
    state = fixed.state_dict()
    assert struct.unpack_from("<I", state["core"], 8)[0] == STATE_FORMAT
    old = dict(state, core=_as_version_1(state["core"]))
    again = Scheduler(fixed.config, prompts(50))
    again.load_state_dict(old)
    assert again.sample_ids("queued") == fixed.sample_ids("queued") + fixed.sample_ids("running")
    assert again.stats()["groups_launched"] == fixed.stats()["groups_launched"]
    assert again.stats()["over_sampling_groups"] == 0  # not in a version 1 file
    adaptive = make(n_prompts=50, rollout_batch_size=1, target_inflight_samples=6, refill="continuous")
    adaptive.load_state_dict(old)  # the group ceiling is derived on load
    assert len(adaptive.dispatch()) == 6
    bad = bytearray(old["core"])
    bad[8] = STATE_FORMAT + 1
    with pytest.raises(CorruptStateError, match=f"format version {STATE_FORMAT + 1}"):
        again.load_state_dict(dict(old, core=bytes(bad)))


def test_adaptive_floor_is_the_configured_over_sampling_batch_size():
    sched = make(rollout_batch_size=2, over_sampling_batch_size=6, target_inflight_samples=4)
    sched.begin_step(0)
    assert sched.stats()["over_sampling_groups"] == 6  # max(N' = 6, ceil(4 / 2) = 2)
    assert len(sched.dispatch()) == 4  # the live target still bounds launches: 2 groups
    assert sched.stats()["groups_launched"] == 2


def test_version_2_state_files_load_with_the_carried_counters_at_zero():
    sched = make(rollout_batch_size=1, target_inflight_samples=8, step_boundary="carry")
    engine = FakeEngine(sched, lambda sid: 5 + sid % 7, chunk=2)
    run_step(sched, engine, 0)
    sched.begin_step(1)
    sched.dispatch()
    state = sched.state_dict()
    old = dict(state, core=_as_version_2(state["core"]))
    again = make(rollout_batch_size=1, target_inflight_samples=8)
    again.load_state_dict(old)
    assert again.sample_ids("queued") == sorted(sched.sample_ids("queued") + sched.sample_ids("running"))
    assert again.stats()["over_sampling_groups"] == sched.stats()["over_sampling_groups"]
    assert again.stats()["carried_samples"] == 0 and again.stats()["groups_launched"] == 2
    assert again.state_dict()["core"][8] == STATE_FORMAT  # saved again in the current format
