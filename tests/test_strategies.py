"""Named strategies (april_ext.strategies): each is a valid SchedulerConfig that keeps the base's batch shape."""

import pytest

from april_ext.errors import ConfigError
from april_ext.scheduler import SchedulerConfig
from april_ext.strategies import STRATEGIES, apply_strategy

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
