"""What a slime generate call returned, read for replay into the scheduler: its result checked against the tokens
it was given (slime's Sample contract) and its new tokens split into runs of model tokens (with their logprobs)
and tool tokens, then its finish and reward (CustomGenerateRollout hands them to the scheduler, slime_generate.py).
"""

from __future__ import annotations

import argparse
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.errors import InvalidArgumentError
from april_ext.scheduler import GenerationRequest, Scheduler

Run = tuple[bool, list[int], list[float]]
"""(model tokens?, tokens, their logprobs: 0.0 on tool tokens)."""

_FINISH = {"COMPLETED": "stop", "TRUNCATED": "length", "ABORTED": "abort", "FAILED": "stop"}


@dataclass
class Replay:
    """What one returned call still has to hand to the scheduler: runs of (model?, tokens, logprobs), then the
    finish ("stop", "length" or "abort") and the function's reward (None: reward_fn's)."""

    runs: deque[Run]
    finish: str
    reward: float | None
    sample: Any


def parse_call(request: GenerationRequest, result: Any, scheduler: Scheduler, args: argparse.Namespace
               ) -> tuple[Replay, list[Run]]:
    """Checks a call's result against the tokens it was given and splits its new tokens into runs; returns the
    replay and the runs that are not kept (past the scheduler's response cap, or a finished trajectory's tool
    output after its last model token). Raises InvalidArgumentError for a result that breaks the contract."""
    sid = request.sample_id
    where = f"the generate function's result for sample {sid}"
    if isinstance(result, list):
        if len(result) != 1:
            raise InvalidArgumentError(
                f"{where} is a list of {len(result)} samples: several trainable pieces per rollout are not "
                f"supported (return one Sample, or a one-element list)")
        result = result[0]
    missing = [a for a in ("tokens", "response_length", "loss_mask", "rollout_log_probs", "status", "reward")
               if not hasattr(result, a)]
    if missing:
        raise InvalidArgumentError(f"{where} is a {type(result).__name__} without {', '.join(missing)}: a "
                                   f"Sample is required")
    given = request.input_ids.tolist()
    tokens = [int(t) for t in result.tokens]
    if tokens[:len(given)] != given:
        raise InvalidArgumentError(f"{where} changed the tokens it was given (prompt + partial response, "
                                   f"{len(given)} tokens): a call may only append to sample.tokens")
    prompt_len, known = request.prompt_len, len(given) - request.prompt_len
    length = len(tokens) - prompt_len
    if result.response_length != length:
        raise InvalidArgumentError(f"{where}: response_length={result.response_length!r} but tokens hold "
                                   f"{length} response tokens after the {prompt_len}-token prompt")
    mask = [1] * length if result.loss_mask is None else [int(m) for m in result.loss_mask]
    if result.rollout_log_probs is None:
        raise InvalidArgumentError(f"{where} has no rollout_log_probs: post /generate with return_logprob "
                                   f"and keep meta_info['output_token_logprobs'] (0.0 on tool tokens)")
    logprobs = [float(x) for x in result.rollout_log_probs]
    if len(mask) != length or len(logprobs) != length:
        raise InvalidArgumentError(f"{where}: loss_mask has {len(mask)} and rollout_log_probs {len(logprobs)} "
                                   f"entries for {length} response tokens: one each per response token")
    new_mask, new_logprobs = mask[known:], logprobs[known:]
    if any(m not in (0, 1) for m in new_mask):
        raise InvalidArgumentError(f"{where}: loss_mask entries must be 1 (model) or 0 (tool)")
    if any(m and not math.isfinite(x) for m, x in zip(new_mask, new_logprobs, strict=True)):
        raise InvalidArgumentError(f"{where}: a model token (loss_mask 1) has a non-finite logprob")
    status = getattr(result.status, "name", result.status)
    if status not in _FINISH:
        raise InvalidArgumentError(f"{where} has status {result.status!r}: a call returns COMPLETED, "
                                   f"TRUNCATED, ABORTED or FAILED")
    finish = _FINISH[status]
    runs: deque[Run] = deque()
    for token, m, x in zip(tokens[len(given):], new_mask, new_logprobs, strict=True):
        if runs and runs[-1][0] == bool(m):
            runs[-1][1].append(token)
            runs[-1][2].append(x)
        else:
            runs.append((bool(m), [token], [x]))
    room = scheduler.config.max_response_len - known
    runs, discarded = _cut_runs(runs, room)
    if discarded:
        finish = "length"  # the scheduler's cap: what goes past it is not kept
    if finish != "abort":
        # A finished trajectory's tool output after its last model token trains nothing; the scheduler ends a
        # sample at a model token (or in its environment's wait), so it is not kept.
        while runs and not runs[-1][0]:
            discarded.append(runs.pop())
    if runs and not runs[0][0] and not _ends_with_model_token(scheduler, sid, known):
        raise InvalidArgumentError(f"{where}: tool tokens (loss_mask 0) must follow a model token; the "
                                   f"response {'is empty' if known == 0 else 'ends with tool tokens'} before "
                                   f"them")
    reward = None if finish == "abort" else _reward_value(result.reward, args, where, status)
    return Replay(runs, finish, reward, result), discarded


def _ends_with_model_token(scheduler: Scheduler, sample_id: int, known: int) -> bool:
    if known == 0:
        return False
    env = scheduler.sample(sample_id).env_mask
    return env is None or not env[-1]


def _cut_runs(runs: deque[Run], room: int) -> tuple[deque[Run], list[Run]]:
    """(the runs within ``room`` tokens, the tokens past it as runs)."""
    kept: deque[Run] = deque()
    cut: list[Run] = []
    for is_model, tokens, logprobs in runs:
        fits = max(0, min(len(tokens), room))
        if fits:
            kept.append((is_model, tokens[:fits], logprobs[:fits]))
        if fits < len(tokens):
            cut.append((is_model, tokens[fits:], logprobs[fits:]))
        room -= fits
    return kept, cut


def _reward_value(reward: Any, args: argparse.Namespace, where: str, status: str) -> float | None:
    """The function's reward as a float: a number, or a dict read at args.reward_key; None: reward_fn's (a
    FAILED sample without one gets 0.0)."""
    if reward is None:
        return 0.0 if status == "FAILED" else None
    if isinstance(reward, dict):
        key = getattr(args, "reward_key", None)
        if key is None or key not in reward:
            raise InvalidArgumentError(f"{where} has a dict reward {sorted(reward)!r}: set args.reward_key "
                                       f"(slime_args(reward_key=...)) to one of its keys")
        reward = reward[key]
    if isinstance(reward, bool) or not isinstance(reward, (int, float, np.floating, np.integer)) \
            or not math.isfinite(float(reward)):
        raise InvalidArgumentError(f"{where} has reward {reward!r}: a finite number (or None for reward_fn's)")
    return float(reward)


__all__ = ["Replay", "Run", "parse_call"]
