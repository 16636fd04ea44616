"""Named strategies (april_ext.strategies): each is a valid SchedulerConfig that keeps the base's batch shape; the
named baselines made of any of them."""

import pytest

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.scheduler import SchedulerConfig
from april_ext.strategies import BASELINES, STRATEGIES, apply_strategy, scheduler_config_for

BASE = SchedulerConfig(rollout_batch_size=4, n_samples_per_prompt=3, over_sampling_batch_size=8, max_response_len=96)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_keeps_the_batch_shape(name):
    config = apply_strategy(BASE, name)
    assert (config.rollout_batch_size, config.n_samples_per_prompt, config.max_response_len) == (4, 3, 96)


def test_strategies_set_what_their_names_say():
    assert apply_strategy(BASE, "april") == BASE
    assert apply_strategy(BASE, "april_carry").step_boundary == "carry"
    seer = apply_strategy(BASE, "seer")
    assert (seer.over_sampling_batch_size, seer.dispatch_order, seer.chunk_tokens) == (4, "longest_predicted_first", 12)
    assert apply_strategy(BASE, "april_seer").over_sampling_batch_size == 8
    rollpacker = apply_strategy(BASE, "rollpacker")
    assert rollpacker.tail_batching and rollpacker.tail_batching_restart and rollpacker.tail_extra_samples == 0
    # RollPacker's response over-provisioning: n / 4 more samples, rounded up (1 for n = 3, 2 for n = 8).
    extra = apply_strategy(BASE, "rollpacker_extra")
    assert extra.tail_batching and extra.tail_batching_restart and extra.tail_extra_samples == 1
    assert apply_strategy(SchedulerConfig(n_samples_per_prompt=8), "rollpacker_extra").tail_extra_samples == 2
    tail = apply_strategy(BASE, "april_tail")
    assert tail.tail_batching and not tail.tail_batching_restart and tail.tail_extra_samples == 0
    assert apply_strategy(BASE, "sortedrl").dispatch_order == "shortest_first"


def test_an_unknown_strategy_names_the_known_ones():
    with pytest.raises(ConfigError, match="strategy='fastest' is not allowed: one of 'april', 'april_carry'"):
        apply_strategy(BASE, "fastest")


# Every setting the synchronous baseline pins set otherwise, and some it keeps.
WILD = SchedulerConfig(rollout_batch_size=4, n_samples_per_prompt=4, max_response_len=64, over_sampling_batch_size=12,
                       refill="continuous", over_sampling="adaptive", target_inflight_samples=32, resume_priority=False,
                       dispatch_order="shortest_first", chunk_tokens=5, step_boundary="carry", max_inflight_samples=40,
                       max_staleness=3, staleness_policy="drop", mask_offpolicy=True, keep_surplus=False)


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_synchronous_baseline_of_every_strategy(name):
    # The values the hand-written baseline gave before its field list was derived from STRATEGIES.
    carry = "carry" if name == "april_carry" else "abort"
    assert scheduler_config_for(apply_strategy(BASE, name), False) == SchedulerConfig(
        rollout_batch_size=4, n_samples_per_prompt=3, over_sampling_batch_size=4, max_response_len=96,
        step_boundary=carry)
    assert scheduler_config_for(apply_strategy(WILD, name), False, "synchronous") == SchedulerConfig(
        rollout_batch_size=4, n_samples_per_prompt=4, over_sampling_batch_size=4, max_response_len=64,
        max_staleness=3, staleness_policy="drop", mask_offpolicy=True, keep_surplus=False, max_inflight_samples=40,
        step_boundary="carry")


DAPO_KEEPS = {
    "april": {},
    "april_carry": {"step_boundary": "carry"},
    "seer": {"dispatch_order": "longest_predicted_first", "chunk_tokens": 12},
    "april_seer": {"dispatch_order": "longest_predicted_first", "chunk_tokens": 12},
    "rollpacker": {"tail_batching": True, "tail_batching_restart": True},
    "rollpacker_extra": {"tail_batching": True, "tail_batching_restart": True, "tail_extra_samples": 1},
    "april_tail": {"tail_batching": True},
    "sortedrl": {"dispatch_order": "shortest_first"},
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_the_dapo_baseline_of_every_strategy(name):
    assert set(DAPO_KEEPS) == set(STRATEGIES)
    assert scheduler_config_for(apply_strategy(BASE, name), False, "synchronous_dapo") == SchedulerConfig(
        rollout_batch_size=4, n_samples_per_prompt=3, over_sampling_batch_size=4, max_response_len=96,
        refill="continuous", max_staleness=0, staleness_policy="drop", **DAPO_KEEPS[name])


def test_partial_rollout_keeps_the_config_and_a_baseline_is_named():
    assert scheduler_config_for(WILD, True, "synchronous_dapo") is WILD
    assert list(BASELINES) == ["synchronous", "synchronous_dapo"]
    with pytest.raises(ConfigError, match="baseline='dapo' is not allowed: one of 'synchronous', 'synchronous_dapo'"):
        scheduler_config_for(BASE, False, "dapo")
    with pytest.raises(InvalidArgumentError, match="partial_rollout"):
        scheduler_config_for(BASE, None)  # type: ignore[arg-type]
