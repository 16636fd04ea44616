"""Evaluation on held-out prompts through the run's own engine, between training steps.

Each prompt is answered ``n_samples`` times (greedy when the sampling temperature is 0, else sampled with
a seed per sample, so an evaluation is repeatable for given weights) and scored by the run's reward
function. Metrics: ``eval/reward_mean`` over all samples, ``eval/pass@1`` (the mean share of passing
samples per prompt) and ``eval/pass@k`` for k = n_samples (the share of prompts with at least one passing
sample), where a sample passes when its reward is at least ``pass_threshold`` (1.0: an exact answer for the
counting and math rewards), and ``eval/response_len_mean``.

With an ``environment`` (a multi-turn run) each sample is a whole trajectory, as in training: the model's turn
ends at a stop token, goes to ``environment.step`` (step_with_timeout), its observation is appended and the model
writes the next turn, until the environment ends it; the reward is the environment's final one (0 for a
trajectory cut by the response cap, or whose start failed). ``eval/turns_mean`` counts the model turns.
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
from april_ext.batch import FinishReason
from april_ext.protocol import Environment, RolloutEngine, SamplingParams, step_with_timeout
from april_ext.rollout import RewardFn

_ids = itertools.count()


async def _answer(engine: RolloutEngine, prompt: Prompt, params: SamplingParams, request_id: str) -> list[int]:
    tokens: list[int] = []
    async for chunk in engine.generate(list(prompt.token_ids), params, request_id):
        tokens.extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            break
    return tokens


async def _trajectory(engine: RolloutEngine, prompt: Prompt, params: SamplingParams, request_id: str,
                      environment: Environment, tool_timeout_s: float) -> tuple[list[int], float, int]:
    """One multi-turn trajectory: (its response, model and environment tokens, the final reward, its turns)."""
    try:
        state = await asyncio.wait_for(environment.start(prompt), tool_timeout_s)
    except Exception:  # noqa: BLE001 - as in training: a prompt the environment cannot start from scores 0
        return [], 0.0, 0
    cap = params.max_new_tokens
    response: list[int] = []
    turns = 0
    while len(response) < cap:
        turn: list[int] = []
        finish = None
        turn_params = replace(params, max_new_tokens=cap - len(response),
                              seed=None if params.seed is None else (params.seed + turns) % (2**31 - 1))
        async for chunk in engine.generate([*prompt.token_ids, *response], turn_params, f"{request_id}-{turns}"):
            turn.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                finish = FinishReason(chunk.finish_reason)
                break
        response += turn
        turns += 1
        if finish != FinishReason.STOP or not turn or len(response) >= cap:
            break  # cut by the response cap (a turn that fills it ends the trajectory, as the scheduler does)
        step = await step_with_timeout(environment, state, turn, tool_timeout_s)
        if step.done:
            return response, float(step.reward or 0.0), turns
        response += list(step.observation[:cap - len(response)])
    return response, 0.0, turns


async def _score(reward_fn: RewardFn, prompt: Prompt, responses: list[np.ndarray]) -> list[float]:
    group = getattr(reward_fn, "score_group", None)
    if group is not None:
        return list(await group(prompt, responses))
    if inspect.iscoroutinefunction(reward_fn) or inspect.iscoroutinefunction(type(reward_fn).__call__):
        values = await asyncio.gather(*(reward_fn(prompt, r) for r in responses))  # type: ignore[misc]
        return [float(v) for v in values]
    return await asyncio.to_thread(lambda: [float(reward_fn(prompt, r)) for r in responses])  # type: ignore[arg-type]


async def evaluate(engine: RolloutEngine, prompts: Sequence[Prompt], reward_fn: RewardFn | None,
                   sampling: SamplingParams, *, n_samples: int = 1, seed: int = 0, concurrency: int = 64,
                   pass_threshold: float = 1.0, environment: Environment | None = None,
                   tool_timeout_s: float = 30.0) -> dict[str, float]:
    """Answers every prompt ``n_samples`` times through ``engine`` (at most ``concurrency`` samples at
    once) and returns the eval metrics (module docstring). ``sampling`` is the template of every request
    (its max_new_tokens is the response cap). With ``environment`` the samples are multi-turn trajectories
    rewarded by it (reward_fn must be None); tool_timeout_s bounds each of its steps."""
    if (environment is None) == (reward_fn is None):
        raise InvalidArgumentError("evaluate scores with exactly one of reward_fn and environment (a multi-turn "
                                   "run's rewards are its environment's)")
    if not prompts:
        raise InvalidArgumentError("evaluate needs at least one prompt")
    if not isinstance(n_samples, int) or n_samples < 1:
        raise InvalidArgumentError(f"n_samples={n_samples!r} is not allowed: an int >= 1")
    if not isinstance(concurrency, int) or concurrency < 1:
        raise InvalidArgumentError(f"concurrency={concurrency!r} is not allowed: an int >= 1")
    gate = asyncio.Semaphore(concurrency)
    run = next(_ids)

    async def one(i: int, j: int) -> tuple[np.ndarray, float, int]:
        sample_seed = (seed * 1_000_003 + i * 7919 + j) % (2**31 - 1)
        params = sampling if sampling.greedy else replace(sampling, seed=sample_seed)
        async with gate:
            if environment is not None:
                ids, reward, turns = await _trajectory(engine, prompts[i], params, f"eval{run}-{i}-{j}", environment,
                                                       tool_timeout_s)
                return np.asarray(ids, dtype=np.int32), reward, turns
            return np.asarray(await _answer(engine, prompts[i], params, f"eval{run}-{i}-{j}"), dtype=np.int32), 0.0, 1

    samples = await asyncio.gather(*(one(i, j) for i in range(len(prompts)) for j in range(n_samples)))
    responses = [s[0] for s in samples]
    if environment is not None:
        rewards = np.array([s[1] for s in samples], dtype=np.float64).reshape(len(prompts), n_samples)
    else:
        assert reward_fn is not None
        groups = [list(responses[i * n_samples:(i + 1) * n_samples]) for i in range(len(prompts))]
        rewards = np.array(await asyncio.gather(*(_score(reward_fn, p, g) for p, g in zip(prompts, groups))),
                           dtype=np.float64)
    passed = rewards >= pass_threshold
    turns = {"eval/turns_mean": float(np.mean([s[2] for s in samples]))} if environment is not None else {}
    return {**turns,
        "eval/reward_mean": float(rewards.mean()),
        "eval/pass@1": float(passed.mean()),
        f"eval/pass@{n_samples}": float(passed.any(axis=1).mean()),
        "eval/response_len_mean": float(np.mean([len(r) for r in responses])),
        "eval/prompts": float(len(prompts)),
    }


__all__ = ["evaluate"]
