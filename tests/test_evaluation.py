"""Evaluation on held-out prompts through a rollout engine: greedy or sampled requests, pass@k, reward kinds."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest
from _loop_utils import ScriptedEngine

from april_ext import Prompt
from april_ext.errors import InvalidArgumentError
from april_ext.protocol import SamplingParams
from april_ext.training.evaluation import evaluate

PROMPTS = [Prompt(f"p{i}", [1, 5, n, 3]) for i, n in enumerate([2, 4, 6])]


class RecordingEngine(ScriptedEngine):
    def __init__(self) -> None:
        super().__init__(lambda ids: int(ids[2]))
        self.params: list[SamplingParams] = []

    def generate(self, input_ids, params=None, request_id=None):
        self.params.append(params)
        return super().generate(input_ids, params, request_id)


def _first_sample_passes():
    seen: Counter = Counter()

    def reward(prompt: Prompt, response: np.ndarray) -> float:
        seen[prompt.id] += 1
        assert len(response) == prompt.token_ids[2]  # the engine's whole answer reaches the reward
        return 1.0 if seen[prompt.id] == 1 else 0.25

    return reward


def test_sampled_evaluation_reports_reward_and_pass_at_k():
    engine = RecordingEngine()
    metrics = asyncio.run(evaluate(engine, PROMPTS, _first_sample_passes(), SamplingParams(max_new_tokens=16),
                                   n_samples=4, seed=7, concurrency=2))
    assert metrics["eval/reward_mean"] == pytest.approx((1 + 3 * 0.25) / 4)
    assert metrics["eval/pass@1"] == pytest.approx(0.25) and metrics["eval/pass@4"] == 1.0
    assert metrics["eval/response_len_mean"] == pytest.approx(4.0) and metrics["eval/prompts"] == 3
    # Sampled: one seed per sample, all different, the same on a second evaluation.
    seeds = [p.seed for p in engine.params]
    assert len(seeds) == 12 and len(set(seeds)) == 12
    again = RecordingEngine()
    asyncio.run(evaluate(again, PROMPTS, _first_sample_passes(), SamplingParams(max_new_tokens=16), n_samples=4,
                         seed=7))
    assert sorted(p.seed for p in again.params) == sorted(seeds)


def test_greedy_evaluation_sends_the_greedy_params_unchanged():
    engine = RecordingEngine()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)

    async def reward(prompt: Prompt, response: np.ndarray) -> float:
        return float(len(response) >= 4)

    metrics = asyncio.run(evaluate(engine, PROMPTS, reward, greedy))
    assert all(p is greedy for p in engine.params) and len(engine.params) == 3
    assert metrics["eval/pass@1"] == pytest.approx(2 / 3) == metrics["eval/reward_mean"]


def test_a_group_level_reward_is_called_once_per_prompt():
    calls = []

    class GroupReward:
        async def score_group(self, prompt, responses):
            calls.append(len(responses))
            return [1.0] * len(responses)

        async def __call__(self, prompt, response):
            raise AssertionError("scored per group")

    metrics = asyncio.run(evaluate(RecordingEngine(), PROMPTS, GroupReward(), SamplingParams(max_new_tokens=16),
                                   n_samples=2))
    assert calls == [2, 2, 2] and metrics["eval/pass@2"] == 1.0


@pytest.mark.parametrize("kwargs, message", [({"n_samples": 0}, "n_samples"), ({"concurrency": 0}, "concurrency")])
def test_bad_arguments(kwargs, message):
    with pytest.raises(InvalidArgumentError, match=message):
        asyncio.run(evaluate(RecordingEngine(), PROMPTS, lambda p, r: 1.0, SamplingParams(), **kwargs))
    with pytest.raises(InvalidArgumentError, match="at least one prompt"):
        asyncio.run(evaluate(RecordingEngine(), [], lambda p, r: 1.0, SamplingParams()))
