"""The synthetic counting task, the math answer verifier and reward functions."""

from __future__ import annotations

import numpy as np
import pytest

from april_ext import ConfigError
from april_ext.data_source import DataSource, Prompt
from april_ext.tasks import (
    CountingTask,
    CountingTaskConfig,
    MathReward,
    math_reward,
    parse_answer,
    score_group,
    verify_math_answer,
)


def test_counting_prompts_are_deterministic_and_well_formed():
    task = CountingTask(CountingTaskConfig(seed=3))
    a, b = task[17], CountingTask(CountingTaskConfig(seed=3))[17]
    assert a == b and isinstance(task, DataSource) and len(task) == 1_000_000
    assert a.token_ids[0] == task.bos_id and a.token_ids[-1] == task.sep_id
    assert a.token_ids[1] == a.metadata["symbol"]
    assert a.token_ids[2] == task.count_id(a.metadata["label"])
    assert all(0 <= t < task.vocab_size for t in a.token_ids)
    assert task[18] != a or task[19] != a
    with pytest.raises(IndexError):
        CountingTask(CountingTaskConfig(n_prompts=5))[5]
    assert CountingTask(CountingTaskConfig(seed=4)).prompts(0, 20) != task.prompts(0, 20)


def test_counting_lengths_are_long_tailed_and_capped():
    task = CountingTask()
    counts = np.array([p.metadata["label"] for p in task.prompts(0, 4000)])
    assert counts.min() >= 1 and counts.max() <= task.config.max_count
    median, p99 = np.median(counts), np.percentile(counts, 99)
    # Log-normal with sigma 0.8 around a median of 6: the 99th percentile is ~6x the median.
    assert 5 <= median <= 7
    assert p99 >= 4 * median
    assert (counts == task.config.max_count).sum() < 0.01 * len(counts)


def test_counting_reward_partial_credit():
    task = CountingTask()
    p = Prompt(id="p", token_ids=(1, 5, task.count_id(4), 3), metadata={"label": 4, "symbol": 5})
    eos, x, y = task.eos_id, 5, 6
    assert task.reward(p, task.target(p)) == 1.0
    # 3 of 4 right symbols, right length: (0.75 + 1) / 2.
    assert task.reward(p, [x, x, y, x, eos]) == pytest.approx(0.875)
    assert task.reward_parts(p, [x, x, y, x, eos]) == pytest.approx((0.75, 1.0))
    # Right symbols but 6 long: content 1, length 1 - 2/4.
    assert task.reward(p, [x] * 6 + [eos]) == pytest.approx(0.75)
    # No EOS: length credit 0.
    assert task.reward(p, [x] * 4) == pytest.approx(0.5)
    assert task.reward(p, [eos]) == 0.0
    assert task.reward(p, [y, y, eos]) == pytest.approx(0.25)


def test_counting_random_responses_give_varied_rewards():
    task = CountingTask()
    rng = np.random.default_rng(0)
    rewards = [task.reward(p, rng.integers(0, task.vocab_size, size=12).tolist())
               for p in task.prompts(0, 200)]
    assert len(set(rewards)) > 3 and max(rewards) > 0


def test_counting_config_validation():
    with pytest.raises(ConfigError, match="CountingTaskConfig.max_count"):
        CountingTaskConfig(max_count=0)
    with pytest.raises(ConfigError, match="CountingTaskConfig.median_count"):
        CountingTaskConfig(median_count=0.5)


def test_counting_model_config_matches_vocabulary():
    task = CountingTask()
    cfg = task.model_config()
    assert cfg.vocab_size == task.vocab_size == 64
    assert cfg.eos_token_ids == (task.eos_id,)
    assert task.model_config(num_hidden_layers=1).num_hidden_layers == 1


# The behaviour table of docs/training.md ("Math answers"), row by row.
MATH_TABLE = [
    ("so the result is \\boxed{42}.", "42", True),
    ("The final answer is 17.", "17", True),
    ("work...\nAnswer: $-3$", "-3", True),
    ("#### 1,250", "1250", True),
    ("the answer is 3", "3", True),
    ("I think it is 5 or maybe 6", "6", True),
    ("no answer here", "1", False),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac12}", "1/2", True),
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{50\\%}", "0.5", True),
    ("\\boxed{x = 7}", "7", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{\\text{(B)}}", "B", True),
    ("\\boxed{\\sqrt2}", "\\sqrt{2}", True),
    ("\\boxed{2x+2}", "2(x+1)", True),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", True),
    ("\\boxed{0.33}", "1/3", False),
    ("\\boxed{(1,2)}", "(2,1)", False),
    ("\\boxed{7}", "-7", False),
    ("first \\boxed{1} then \\boxed{\\frac{3}{4}}", "0.75", False),
    ("\\boxed{12.}", 12, False),
]


@pytest.mark.parametrize("response, label, expected", MATH_TABLE)
def test_math_verify_behaviour_table(response, label, expected):
    assert verify_math_answer(response, label) is expected


def test_parse_answer_returns_what_was_extracted():
    assert parse_answer("so \\boxed{\\frac{6}{8}}")[-1] == "\\frac{6}{8}"
    assert parse_answer("nothing to see") == []


def test_math_reward_and_group_scoring():
    assert math_reward("thus \\boxed{\\frac{6}{8}}", "0.75") == 1.0
    assert math_reward("thus \\boxed{0.7}", "0.75") == 0.0

    class SpaceTokenizer:
        words = ["<s>", "answer", "\\boxed{5}", "\\boxed{6}"]

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(self.words[i] for i in ids if not (skip_special_tokens and i == 0))

    reward = MathReward(SpaceTokenizer())
    prompt = Prompt(id="q", token_ids=(0,), metadata={"label": "5"})
    assert score_group(reward, prompt, [[0, 1, 2], [1, 3], [2]]) == [1.0, 0.0, 1.0]
