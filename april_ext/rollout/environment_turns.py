"""The multi-turn hand-over between the scheduler and a rollout's trajectories (RolloutLoop with an environment;
docs/agentic.md): trajectories started as their samples are dispatched, turns that ended at a stop token handed
to the environment, its answers handed back to the scheduler (an observation queues its sample again, an end
finishes it), and the trajectories' state as saved beside the scheduler's.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import numpy as np

from april_ext.batch import FinishReason
from april_ext.errors import UnknownIdError
from april_ext.rollout.trajectories import Trajectories, turn_of
from april_ext.scheduler import GenerationRequest, Scheduler

HELD_STATES = ("queued", "running", "aborting", "done", "waiting_env")
"""The scheduler states of a sample whose trajectory is kept."""


async def start_trajectories(env: Trajectories, scheduler: Scheduler,
                             requests: list[GenerationRequest]) -> list[GenerationRequest]:
    """env.start for each fresh trajectory dispatched (a first dispatch, or a restart), before its stream opens; a
    resumed one keeps its state (one without, from a checkpoint written before it had one, starts from the
    prompt). Returns the requests to generate: a sample whose start failed is finished at once with "stop" and
    what it has (reward 0, finish reason "start_error")."""
    data = scheduler.data
    fresh = [r for r in requests if not r.is_resume or not env.knows(r.sample_id)]
    if not fresh:
        return requests
    started = await asyncio.gather(*(env.start(r.sample_id, r.group_id, data[r.prompt_index]) for r in fresh))
    failed = {r.sample_id for r, ok in zip(fresh, started, strict=True) if not ok}
    if failed:
        scheduler.on_finish_batch(sorted(failed), [int(FinishReason.STOP)] * len(failed))
    return [r for r in requests if r.sample_id not in failed]


def hand_turns_to_env(env: Trajectories, scheduler: Scheduler, sample_ids: list[int]) -> None:
    """Turns that ended at a stop token: each waiting sample's turn goes to the environment; a sample the turn
    filled to max_response_len was finished with "length" by the scheduler (reward 0); a cancelled one (its group
    completed by another sample of the same hand-over) is left alone."""
    for sid in sample_ids:
        view = scheduler.sample(sid)
        if view.state == "waiting_env":
            env.hand_over(sid, turn_of(view.token_ids, view.env_mask))
        elif view.state == "done":
            env.cut(sid)


def deliver_env_answers(env: Trajectories, scheduler: Scheduler) -> None:
    """The environment's answers that arrived, to the scheduler in sample-id order: an observation queues its
    sample for dispatch (prompt + response with it), an end finishes it. An answer for a sample the scheduler no
    longer waits on (cancelled, restarted or dropped meanwhile) is dropped."""
    max_response_len = scheduler.config.max_response_len
    observed: list[tuple[int, Any, tuple[int, ...]]] = []
    ended: list[tuple[int, Any]] = []
    for sid, answer in env.answers():
        try:
            view = scheduler.sample(sid)
        except UnknownIdError:
            view = None
        if view is None or view.state != "waiting_env":
            env.dropped(sid)
        elif answer.done:
            ended.append((sid, answer))
        else:
            # An observation past max_response_len is cut at it: the scheduler ends the sample with "length".
            room = max_response_len - int(view.token_ids.size)
            observed.append((sid, answer, answer.observation[:room]))
    if observed:
        counts = [len(tokens) for _, _, tokens in observed]
        tokens = np.fromiter(itertools.chain.from_iterable(t for _, _, t in observed), np.int32, sum(counts))
        scheduler.on_env_tokens_batch([sid for sid, _, _ in observed], counts, tokens)
        for sid, answer, kept in observed:
            env.delivered(sid, answer)
            if len(kept) < len(answer.observation) or scheduler.sample(sid).state == "done":
                env.observation_cut(sid)
        # An observation that filled its sample to the cap may have completed a group, cancelling a sample of it
        # whose end is below (tail_extra_samples): that end is dropped.
        still = []
        for sid, answer in ended:
            if scheduler.sample(sid).state == "waiting_env":
                still.append((sid, answer))
            else:
                env.dropped(sid)
        ended = still
    if ended:
        scheduler.on_finish_batch([sid for sid, _ in ended], [int(FinishReason.STOP)] * len(ended))
        for sid, answer in ended:
            env.delivered(sid, answer)


def waiting_turn(scheduler: Scheduler, sample_id: int) -> np.ndarray | None:
    """The turn of a sample the scheduler has waiting on its environment; None when it does not."""
    try:
        view = scheduler.sample(sample_id)
    except UnknownIdError:
        return None
    return turn_of(view.token_ids, view.env_mask) if view.state == "waiting_env" else None


def trajectories_state(env: Trajectories, scheduler: Scheduler) -> bytes:
    """The trajectories' state as bytes, those of samples the scheduler no longer holds left out."""
    env.keep_only({sid for state in HELD_STATES for sid in scheduler.sample_ids(state)})
    return env.dumps()


__all__ = ["deliver_env_answers", "hand_turns_to_env", "start_trajectories", "trajectories_state", "waiting_turn"]
