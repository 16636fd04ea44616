"""Long-tail strategies in the scheduler core: dispatch_order, resume_priority, length prediction, chunk_tokens."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest

from _scheduler_utils import STATE_FORMAT, as_version_3, feed, make, reward_all, token_at

from april_ext import ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.batch import FinishReason
from april_ext.scheduler import history_key

# ---------------------------------------------------------------------------------------------- dispatch order


def _queued_mix(**kw) -> Scheduler:
    """Four groups of two samples (ids 2g, 2g + 1), max_response_len 64, no prompt left to launch:
    group 0: sample 0 stopped at 10 tokens, sample 1 a partial of 2 (predicted 10 from its sibling, 8 to go);
    group 1: sample 2 stopped at 30, sample 3 a partial of 1 (predicted 30, 29 to go);
    group 2: sample 4 stopped at 20, sample 5 aborted with no token (fresh; predicted 20, 20 to go);
    group 3: no sibling finished: the mean of all final lengths, 20: sample 6 a partial of 5 (15 to go),
    sample 7 fresh (20 to go)."""
    sched = make(n_prompts=4, rollout_batch_size=2, over_sampling_batch_size=4, **kw)
    sched.begin_step(0)
    assert [r.sample_id for r in sched.dispatch()] == list(range(8))
    for sid, length, reason in [(0, 10, "stop"), (1, 2, "abort"), (2, 30, "stop"), (3, 1, "abort"),
                                (4, 20, "stop"), (5, 0, "abort"), (6, 5, "abort"), (7, 0, "abort")]:
        feed(sched, sid, length, 0)
        sched.on_finish(sid, reason)
    return sched


@pytest.mark.parametrize("order, resume_order, priority, expected", [
    ("fifo", "oldest_first", True, [1, 3, 6, 5, 7]),
    ("fifo", "newest_first", True, [6, 3, 1, 5, 7]),  # partials in resume_order, then fresh as launched
    ("oldest_first", "newest_first", True, [1, 3, 6, 5, 7]),  # by group age; resume_order only breaks ties
    ("longest_predicted_first", "oldest_first", True, [3, 6, 1, 5, 7]),  # remaining 29, 15, 8 | 20, 20
    ("shortest_first", "oldest_first", True, [1, 6, 3, 5, 7]),
    ("fifo", "newest_first", False, [1, 3, 5, 6, 7]),  # one list by group age
    ("oldest_first", "oldest_first", False, [1, 3, 5, 6, 7]),
    ("longest_predicted_first", "oldest_first", False, [3, 5, 7, 6, 1]),  # 29, 20, 20 (age), 15, 8
    ("shortest_first", "oldest_first", False, [1, 6, 5, 7, 3]),
])
def test_dispatch_order_of_partials_and_fresh_samples(order, resume_order, priority, expected):
    sched = _queued_mix(dispatch_order=order, resume_order=resume_order, resume_priority=priority)
    requests = sched.dispatch()
    assert [r.sample_id for r in requests] == expected
    predicted = {r.sample_id: r.predicted_len for r in requests}
    assert predicted == {1: 10, 3: 30, 5: 20, 6: 20, 7: 20}
    assert all(r.is_resume == (r.sample_id in (1, 3, 6)) and not r.is_continuation for r in requests)


def test_ties_among_partials_follow_resume_order():
    """Two partials with the same remaining length: resume_order decides (newest group first)."""
    sched = make(n_prompts=2, rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=1,
                 dispatch_order="longest_predicted_first", resume_order="newest_first")
    sched.begin_step(0)
    sched.dispatch()
    for sid in (0, 1):
        feed(sched, sid, 3, 0)
        sched.on_finish(sid, "abort")
    assert [r.sample_id for r in sched.dispatch()] == [1, 0]


# ---------------------------------------------------------------------------------------------- prediction


def test_prediction_falls_back_to_half_the_cap_then_siblings_and_never_below_length_plus_one():
    """Two groups of three (ids 0-2, 3-5): group 0's samples are predicted from their own finished siblings, not
    from the mean of all final lengths (which group 1's 40 raises)."""
    sched = make(n_prompts=2, rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=3)
    sched.begin_step(0)
    assert [r.predicted_len for r in sched.dispatch()] == [32] * 6  # nothing finished yet: 64 / 2
    for sid, length, reason in [(3, 40, "stop"), (0, 4, "stop"), (1, 9, "abort"), (2, 2, "abort")]:
        feed(sched, sid, length, 0)
        sched.on_finish(sid, reason)
    requests = {r.sample_id: r.predicted_len for r in sched.dispatch()}
    assert requests == {1: 10, 2: 4}  # the sibling's 4, but sample 1 already has 9 tokens
    feed(sched, 1, 3, 0)
    sched.on_finish(1, "stop")  # siblings' mean is now (4 + 12) / 2 = 8; of all, (40 + 4 + 12) / 3
    sched.on_finish(2, "abort")
    assert [r.predicted_len for r in sched.dispatch()] == [8]


def _epochs(n_epochs: int = 3) -> ListDataSource:
    """Two prompts, "a" and "b", repeated every epoch."""
    items = []
    for _ in range(n_epochs):
        items += [Prompt(id="a", token_ids=[5, 6, 7]), Prompt(id="b", token_ids=[8, 9])]
    return ListDataSource(items)


_EPOCH_CFG = SchedulerConfig(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=2,
                             max_response_len=64)


def _epoch(sched: Scheduler, version: int, lengths: dict[str, list[int]]) -> dict[str, list[int]]:
    """One step over one epoch: each group's samples finish at the given lengths; returns the predictions."""
    sched.begin_step(version)
    requests = sched.dispatch()
    predicted: dict[str, list[int]] = {}
    for r in requests:
        predicted.setdefault(r.prompt_id, []).append(r.predicted_len)
    for r in requests:
        k = r.sample_id % 2
        feed(sched, r.sample_id, lengths[r.prompt_id][k], version)
        sched.on_finish(r.sample_id, "stop")
    reward_all(sched)
    sched.take_batch()
    return predicted


def test_prediction_from_the_prompts_history_across_epochs():
    sched = Scheduler(_EPOCH_CFG, _epochs())
    assert _epoch(sched, 0, {"a": [10, 12], "b": [40, 42]}) == {"a": [32, 32], "b": [32, 32]}
    # Epoch 2: each prompt's own mean (a: 11, b: 41), not the mean of all (26).
    assert _epoch(sched, 1, {"a": [20, 22], "b": [50, 52]}) == {"a": [11, 11], "b": [41, 41]}
    assert _epoch(sched, 2, {"a": [1, 1], "b": [1, 1]}) == {"a": [16, 16], "b": [46, 46]}


def test_prediction_from_the_mean_of_all_for_a_new_prompt():
    data = ListDataSource([Prompt(id="a", token_ids=[5]), Prompt(id="b", token_ids=[6]),
                           Prompt(id="c", token_ids=[7]), Prompt(id="d", token_ids=[8])])
    sched = Scheduler(_EPOCH_CFG, data)
    _epoch(sched, 0, {"a": [10, 12], "b": [40, 42]})
    assert _epoch(sched, 1, {"c": [1, 1], "d": [1, 1]}) == {"c": [26, 26], "d": [26, 26]}


def test_history_keys_are_stable_hashes_of_the_prompt_id():
    assert history_key("a") == history_key("a") != history_key("b")
    assert history_key(("q", 1)) == history_key(("q", 1))
    assert -(2**63) <= history_key(12345) < 2**63


def test_prediction_history_survives_save_and_load_and_older_formats_load_without_it(tmp_path):
    sched = Scheduler(_EPOCH_CFG, _epochs())
    _epoch(sched, 0, {"a": [10, 12], "b": [40, 42]})
    sched.save(tmp_path / "state")
    state = sched.state_dict()
    assert struct.unpack_from("<I", state["core"], 8)[0] == STATE_FORMAT
    restored = Scheduler(_EPOCH_CFG, _epochs())
    restored.load(tmp_path / "state")
    assert restored.state_dict() == state
    assert _epoch(restored, 1, {"a": [1, 1], "b": [1, 1]}) == {"a": [11, 11], "b": [41, 41]}
    old = Scheduler(_EPOCH_CFG, _epochs())
    old.load_state_dict(dict(state, core=as_version_3(state["core"])))
    assert old.stats()["groups_launched"] == 2 and old.stats()["prediction_samples"] == 0
    assert _epoch(old, 1, {"a": [1, 1], "b": [1, 1]}) == {"a": [32, 32], "b": [32, 32]}  # no history in v3


def test_group_history_keys_survive_a_mid_step_save():
    sched = Scheduler(_EPOCH_CFG, _epochs())
    _epoch(sched, 0, {"a": [10, 12], "b": [40, 42]})
    sched.begin_step(1)
    sched.dispatch()  # groups of epoch 2 launched with their keys, then saved mid-step
    restored = Scheduler(_EPOCH_CFG, _epochs())
    restored.load_state_dict(sched.state_dict())
    requests = restored.dispatch()
    assert {r.prompt_id: r.predicted_len for r in requests} == {"a": 11, "b": 41}


def test_rank_correlation_per_step():
    data = ListDataSource([Prompt(id=p, token_ids=[i + 1]) for _ in range(2) for i, p in enumerate("abc")])
    cfg = SchedulerConfig(rollout_batch_size=3, n_samples_per_prompt=2, over_sampling_batch_size=3,
                          max_response_len=64)
    sched = Scheduler(cfg, data)
    _epoch(sched, 0, {"a": [10, 10], "b": [20, 20], "c": [30, 30]})
    stats = sched.stats()
    assert stats["prediction_samples"] == 6 and math.isnan(stats["prediction_rank_corr"])  # all predicted 32
    sched.begin_step(1)
    assert sched.stats()["prediction_samples"] == 0 and math.isnan(sched.stats()["prediction_rank_corr"])
    requests = sched.dispatch()
    finals = {"a": [5, 6], "b": [30, 31], "c": [20, 21]}
    for r in requests:
        feed(sched, r.sample_id, finals[r.prompt_id][r.sample_id % 2], 1)
        sched.on_finish(r.sample_id, "stop")
    # Predictions 10, 10, 20, 20, 30, 30 against finals 5, 6, 30, 31, 20, 21: ranks (1.5, 1.5, 3.5, 3.5, 5.5,
    # 5.5) and (1, 2, 5, 6, 3, 4); covariance 8, variances 16 and 17.5.
    stats = sched.stats()
    assert stats["prediction_samples"] == 6
    assert stats["prediction_rank_corr"] == pytest.approx(8 / math.sqrt(16 * 17.5))
    restored = Scheduler(cfg, data)
    restored.load_state_dict(sched.state_dict())
    assert restored.stats()["prediction_rank_corr"] == pytest.approx(stats["prediction_rank_corr"])


def test_rank_correlation_is_nan_below_two_samples_and_ties_share_their_rank():
    sched = make(n_prompts=2, rollout_batch_size=1, over_sampling_batch_size=1, n_samples_per_prompt=3)
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 4, 0)
    sched.on_finish(0, "stop")
    assert sched.stats()["prediction_samples"] == 1 and math.isnan(sched.stats()["prediction_rank_corr"])
    feed(sched, 1, 1, 0)
    sched.on_finish(1, "abort")
    feed(sched, 2, 3, 0)
    sched.on_finish(2, "abort")
    assert [r.predicted_len for r in sched.dispatch()] == [4, 4]  # the sibling's 4 (at least length + 1)
    feed(sched, 1, 1, 0)
    sched.on_finish(1, "stop")  # final 2
    sched.on_finish(2, "stop")  # final 3
    # Pairs (32, 4), (4, 2), (4, 3): predictions rank 3, 1.5, 1.5; finals 3, 1, 2; covariance 1.5, variances
    # 1.5 and 2.
    assert sched.stats()["prediction_samples"] == 3
    assert sched.stats()["prediction_rank_corr"] == pytest.approx(1.5 / math.sqrt(1.5 * 2))


def test_rank_correlation_grades_the_prediction_made_before_the_chunks():
    """A continuation's prediction is at least its length + 1: graded on it, a sample predicted short that runs
    long would look well predicted at its last chunk. Prompts a, b, c finished at 1, 2 and 3 tokens in epoch 0;
    in epoch 1 they run to 35, 6 and 3 tokens, in chunks of 4."""
    data = ListDataSource([Prompt(id=p, token_ids=[i + 1]) for _ in range(2) for i, p in enumerate("abc")])
    cfg = SchedulerConfig(rollout_batch_size=3, n_samples_per_prompt=1, over_sampling_batch_size=3,
                          max_response_len=40, chunk_tokens=4)
    sched = Scheduler(cfg, data)
    sched.begin_step(0)
    for r in sched.dispatch():
        feed(sched, r.sample_id, {"a": 1, "b": 2, "c": 3}[r.prompt_id], 0)
        sched.on_finish(r.sample_id, "stop")
    reward_all(sched)
    sched.take_batch()
    sched.begin_step(1)
    finals = {"a": 35, "b": 6, "c": 3}
    requests = sched.dispatch()
    assert {r.prompt_id: r.predicted_len for r in requests} == {"a": 1, "b": 2, "c": 3}
    last = {}
    while requests:
        for r in requests:
            last[r.prompt_id] = r.predicted_len
            left = finals[r.prompt_id] - len(sched.sample(r.sample_id).token_ids)
            count = min(left, r.max_new_tokens)
            feed(sched, r.sample_id, count, 1)
            sched.on_finish(r.sample_id, "length" if left > count else "stop")
        requests = sched.dispatch()
    assert last == {"a": 33, "b": 5, "c": 3}  # a continuation predicts at least its length + 1
    stats = sched.stats()
    assert stats["chunk_returns"] == 8 + 1
    assert stats["prediction_samples"] == 3 and stats["prediction_rank_corr"] == pytest.approx(-1.0)


# ---------------------------------------------------------------------------------------------- chunks


def _chunked(**kw) -> Scheduler:
    base = dict(n_prompts=4, rollout_batch_size=1, over_sampling_batch_size=1, n_samples_per_prompt=1,
                max_response_len=10, chunk_tokens=4)
    base.update(kw)
    return make(**base)


def test_chunk_budgets_continuations_and_the_final_chunk_at_the_cap():
    sched = _chunked()
    sched.begin_step(0)
    (first,) = sched.dispatch()
    assert first.max_new_tokens == 4 and not first.is_resume and not first.is_continuation
    feed(sched, 0, 4, 0)
    sched.on_finish(0, "length")  # exactly the chunk: a chunk boundary, not a finish
    assert sched.sample(0).state == "queued"
    stats = sched.stats()
    assert (stats["chunk_returns"], stats["finished_samples"], stats["aborts"]) == (1, 0, 0)
    assert stats["buffered_samples"] == 1 and sched.pop_completed_groups() == []
    (second,) = sched.dispatch()
    assert second.is_resume and second.is_continuation and second.max_new_tokens == 4
    assert np.array_equal(second.input_ids[second.prompt_len:], token_at(0, np.arange(4)))
    feed(sched, 0, 4, 0)
    sched.on_finish(0, "length")
    (third,) = sched.dispatch()
    assert third.is_continuation and third.max_new_tokens == 2  # what the cap leaves
    feed(sched, 0, 2, 0)
    sched.on_finish(0, "length")  # at the cap: a length finish
    assert sched.sample(0).state == "done"
    (group,) = sched.pop_completed_groups()
    assert group.finish_reasons == [FinishReason.LENGTH] and group.responses[0].size == 10
    stats = sched.stats()
    assert stats["chunk_returns"] == 2 and stats["finished_samples"] == 1
    assert stats["continuation_requests"] == 2 and stats["continuation_tokens"] == (4 + 4) + (4 + 8)
    assert stats["resume_requests"] == 0 and stats["re_prefill_tokens"] == 0
    assert stats["resumed_generated_tokens"] == 0 and sched.sample(0).resumes == 0
    assert stats["new_requests"] == 1 and stats["generated_tokens"] == 10


@pytest.mark.parametrize("count, reason", [(2, "stop"), (4, "stop"), (3, "length")])
def test_a_stop_or_a_length_finish_short_of_the_chunk_is_a_finish(count, reason):
    sched = _chunked()
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, count, 0)
    sched.on_finish(0, reason)
    assert sched.sample(0).state == "done"
    assert sched.stats()["chunk_returns"] == 0 and sched.stats()["finished_samples"] == 1


def test_without_chunks_a_request_gets_the_whole_budget():
    sched = _chunked(chunk_tokens=None)
    sched.begin_step(0)
    assert [r.max_new_tokens for r in sched.dispatch()] == [10]


def test_a_chunk_back_after_the_step_is_done_is_a_buffered_partial():
    sched = _chunked(n_prompts=2, over_sampling_batch_size=2)
    sched.begin_step(0)
    assert len(sched.dispatch()) == 2
    feed(sched, 1, 2, 0)
    sched.on_finish(1, "stop")
    reward_all(sched)
    assert sched.step_done
    assert sched.samples_to_abort() == [0]
    feed(sched, 0, 4, 0)
    sched.on_finish(0, "length")  # the chunk ended before the abort took effect
    assert sched.sample(0).state == "queued" and sched.stats()["chunk_returns"] == 1
    sched.take_batch()
    sched.begin_step(0)  # same version: still no continuation, the engine was told to abort it
    (r,) = sched.dispatch()
    assert r.sample_id == 0 and r.is_resume and not r.is_continuation and r.max_new_tokens == 4
    assert sched.stats()["resume_requests"] == 1 and sched.stats()["re_prefill_tokens"] == 4 + 4
    assert sched.stats()["continuation_requests"] == 0


def test_a_queued_continuation_is_a_resume_at_the_next_version_and_after_a_load():
    sched = _chunked(n_prompts=2, over_sampling_batch_size=2, step_boundary="carry")
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 4, 0)
    sched.on_finish(0, "length")  # queued as a continuation at version 0
    feed(sched, 1, 2, 0)
    sched.on_finish(1, "stop")
    reward_all(sched)
    restored = _chunked(n_prompts=2, over_sampling_batch_size=2, step_boundary="carry")
    restored.load_state_dict(sched.state_dict())
    sched.take_batch()
    sched.begin_step(1)
    (r,) = sched.dispatch()
    assert r.is_resume and not r.is_continuation  # weights changed: the KV of version 0 is not served
    restored.take_batch()
    restored.begin_step(0)
    (r,) = restored.dispatch()
    assert r.is_resume and not r.is_continuation  # the engine's KV did not survive the restart


def test_chunks_in_carry_mode_continue_across_the_step():
    """A carried sample ends its chunk after the version bump: it continues at the new version."""
    sched = _chunked(n_prompts=2, over_sampling_batch_size=2, step_boundary="carry")
    sched.begin_step(0)
    sched.dispatch()
    feed(sched, 0, 2, 0)
    feed(sched, 1, 1, 0)
    sched.on_finish(1, "stop")
    reward_all(sched)
    assert sched.samples_to_abort() == []
    sched.take_batch()
    sched.begin_step(1)
    assert sched.stats()["carried_samples"] == 1
    feed(sched, 0, 2, 1)
    sched.on_finish(0, "length")
    (r,) = sched.dispatch()
    assert r.sample_id == 0 and r.is_continuation and r.max_new_tokens == 4
    assert sched.stats()["chunk_returns"] == 1 and sched.stats()["continuation_requests"] == 1
