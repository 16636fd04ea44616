"""Evaluation on held-out prompts through the run's own engine, between training steps.

Each prompt is answered ``n_samples`` times (greedy when the sampling temperature is 0, else sampled with
a seed per sample, so an evaluation is repeatable for given weights) and scored by the run's reward
function. Metrics: ``eval/reward_mean`` over all samples, ``eval/pass@1`` (the mean share of passing
samples per prompt) and ``eval/pass@k`` for k = n_samples (the share of prompts with at least one passing
sample), where a sample passes when its reward is at least ``pass_threshold`` (1.0: an exact answer for the
counting and math rewards), and ``eval/response_len_mean``.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from april_ext.data_source import Prompt
from april_ext.errors import InvalidArgumentError
from april_ext.protocol import RolloutEngine, SamplingParams
from april_ext.rollout import RewardFn

_ids = itertools.count()


async def _answer(engine: RolloutEngine, prompt: Prompt, params: SamplingParams, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for chunk in engine.generate(list(prompt.token_ids), params, request_id):
        tokens.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            break
    return tokens


async def _score(reward_fn: RewardFn, prompt: Prompt, responses: list[np.ndarray]) -> list[float]:
    group = getattr(reward_fn, "score_group", None)
    if group is not None:
        return list(await group(prompt, responses))
    if inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(type(reward_fn).__call__):
        values = await asyncio.gather(*(reward_fn(prompt, r) for r in responses))  # type: ignore[misc]
        return [float(v) for v in values]
    return await asyncio.to_thread(lambda: [float(reward_fn(prompt, r)) for r in responses])  # type: ignore[arg-type]


async def evaluate(engine: RolloutEngine, prompts: Sequence[Prompt], reward_fn: RewardFn, sampling: SamplingParams,
                   *, n_samples: int = 1, seed: int = 0, concurrency: int = 64,
                   pass_threshold: float = 1.0) -> dict[str, float]:
    """Answers every prompt ``n_samples`` times through ``engine`` (at most ``concurrency`` requests at
    once) and returns the eval metrics (module docstring). ``sampling`` is the template of every request
    (its max_new_tokens is the response cap)."""
    if not prompts:
        raise InvalidArgumentError("evaluate needs at least one prompt")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise InvalidArgumentError(f"n_samples={n_samples!r} is not allowed: an int >= 1")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidArgumentError(f"concurrency={concurrency!r} is not allowed: an int >= 1")
    gate = asyncio.Semaphore(concurrency)
    run = next(_ids)

    async def one(i: int, j: int) -> np.ndarray:
        sample_seed = (seed * 1_000_003 + i * 7919 + j) % (2**31 - 1)
        params = sampling if sampling.greedy else replace(sampling, seed=sample_seed)
        async with gate:
            return np.asarray(await _answer(engine, prompts[i], params, f"eval{run}-{i}-{j}"), dtype=np.int32)

    responses = await asyncio.gather(*(one(i, j) for i in range(len(prompts)) for j in range(n_samples)))
    groups = [list(responses[i * n_samples:(i + 1) * n_samples]) for i in range(len(prompts))]
    rewards = np.array(await asyncio.gather(*(_score(reward_fn, p, g) for p, g in zip(prompts, groups))),
                       dtype=np.float64)
    passed = rewards >= pass_threshold
    return {
        "eval/reward_mean": float(rewards.mean()),
        "eval/pass@1": float(passed.mean()),
        f"eval/pass@{n_samples}": float(passed.any(axis=1).mean()),
        "eval/response_len_mean": float(np.mean([len(r) for r in responses])),
        "eval/prompts": float(len(prompts)),
    }


__all__ = ["evaluate"]
