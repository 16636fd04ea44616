"""slime's ``--custom-generate-function-path``: a slime generate function, unchanged, under APRIL's scheduler.

slime's contract (its docs and ``slime/rollout/sglang_rollout.py``): ``async def generate(args, sample,
sampling_params) -> Sample | list[Sample]``, given ``evaluation=`` as a keyword only when its signature names it.
The function posts to ``http://{args.sglang_router_ip}:{args.sglang_router_port}/generate`` itself, runs its
tools and fills ``sample.tokens`` (prompt + response), ``response_length``, ``loss_mask`` (1 model, 0 tool per
response token), ``rollout_log_probs`` (0.0 on tool tokens), ``status`` and maybe ``reward``. At a partial-rollout
abort the servers are aborted and every call returns what it has with status ABORTED; the next call gets that
sample and continues from it.

:class:`CustomGenerateRollout` runs one step at a time as ``RolloutLoop.run_step`` does: each request the
scheduler dispatches becomes one call of the function (an asyncio task), and what a call returns is replayed
into the scheduler token by token (model runs with their logprobs and the step's version, tool runs as env
tokens). The scheduler takes one model turn per dispatch, so a call that returns several turns is replayed
over as many dispatches of its sample. A done step dispatches nothing, so the step is ended before the scheduler
knows it is done: the group verdict that makes N accepted groups is held back, the servers are aborted, every
call returns and is replayed whole, and only then the verdict is reported and the batch taken. Where the step
ends without that verdict (the data ran out, a staleness drop, a tail-batching round), the turns of a call after
its first replayed tool output are not kept (``RolloutMetrics.env`` ``discarded_*_tokens``): its partial ends
with that tool output and the next call continues from there. docs/training.md, "slime's
--custom-generate-function-path", has the whole contract.

It is a protocol.RolloutDriver. slime's side of the contract (Sample, args, loading the function) is in
slime_function.py, the reading of what a call returned in slime_replay.py, the reward pipeline it shares with the
RolloutLoop in rewards.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import logging
import math
import pickle
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.errors import ConfigError, CorruptStateError, InternalError, InvalidArgumentError, InvalidStateError
from april_ext.protocol.rollout_engine import AbortAllEngine
from april_ext.protocol.rollout_result import RolloutResult
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.rollout.rewards import GroupFilter, RewardFn, RewardPipeline, raise_first
from april_ext.rollout.slime_function import (
    GenerateFn,
    Sample,
    check_generate_function,
    load_generate_function,
    sampling_params_of,
    slime_args,
    url_of,
)
from april_ext.rollout.slime_replay import Replay, Run, parse_call
from april_ext.rollout.step_metrics import step_metrics
from april_ext.scheduler import CompletedGroup, GenerationRequest, Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)
_STATE_FORMAT = "april_ext.custom_generate/1"


def refused_settings(config: SchedulerConfig) -> str | None:
    """Why a custom generate function cannot run under ``config``, or None when it can. Each refused setting needs
    the rollout to stop or hold one request of the function's in the engine, and the function owns its requests:
    the engine can only abort all of them at once (abort_all), after which every call returns (ABORTED)."""
    reasons = {
        "step_boundary": (config.step_boundary == "abort", "'abort': 'carry' keeps a step's running requests paused "
                          "in the engine, but a call's requests are the function's, which must return at the step's "
                          "end to be replayed"),
        "chunk_tokens": (config.chunk_tokens is None, "None: a divided rollout ends a request after chunk_tokens "
                         "tokens, but the function sets each /generate's max_new_tokens itself"),
        "tail_extra_samples": (config.tail_extra_samples == 0, "0: the surplus samples of a group are aborted one by "
                               "one mid-step, but the function's requests can only be aborted all at once"),
    }
    refused = [f"{name}={getattr(config, name)!r} (allowed: {why})" for name, (ok, why) in reasons.items() if not ok]
    return None if not refused else "a custom generate function cannot run with " + "; ".join(refused)


@dataclass
class _Call:
    request: GenerationRequest
    task: asyncio.Task[Any]


class CustomGenerateRollout:
    """Drives ``scheduler`` with a slime generate function, one step at a time; call from one event loop.

    generate_fn: the function or its path (:func:`load_generate_function`). engine: the engine of the servers the
    function posts to, one that can abort every request on them (protocol.AbortAllEngine: the SGLang adapter
    april_ext.sglang.SGLangEngine, or a Ray run's RayEngine); ``engine.abort_all()`` ends the step (the function's
    requests are not the engine's, so ``engine.abort(None)`` would not reach them). args: slime's args
    (:func:`slime_args`); by default built from the engine's router_url, or its one worker, and the scheduler's
    config and ``sampling``. reward_fn(prompt,
    response_ids) -> float scores the samples whose function set no reward (plain: run in a worker thread, or
    async); group_filter(rewards) -> bool keeps or drops a group. decode(token_ids) -> str fills
    ``sample.prompt`` and, for a resumed sample rebuilt from the scheduler, ``sample.response`` (else "").
    abort_resend_s: the servers' abort is sent again this often while calls are still out (a call may post a
    new /generate after the abort, between its turns); abort_timeout_s: the most a step waits for its calls to
    return (InvalidStateError past it).

    Refused scheduler settings (ConfigError, :func:`refused_settings` says why): step_boundary="carry",
    chunk_tokens and tail_extra_samples.

    Checkpoints: ``environment_state()`` holds what the scheduler's state does not (the function's rewards of
    samples whose group is not complete, the accepted groups not trained, the ABORTED calls' sample objects);
    a resumed run loads it after the scheduler's."""

    def __init__(self, generate_fn: GenerateFn | str, scheduler: Scheduler, engine: AbortAllEngine,
                 args: argparse.Namespace | None = None, *, reward_fn: RewardFn | None = None,
                 group_filter: GroupFilter | None = None, sampling: SamplingParams | None = None,
                 decode: Callable[[list[int]], str] | None = None, abort_resend_s: float = 0.05,
                 abort_timeout_s: float = 60.0) -> None:
        if isinstance(generate_fn, str):
            generate_fn = load_generate_function(generate_fn)
        self._takes_evaluation = check_generate_function(generate_fn)
        if not isinstance(scheduler, Scheduler):
            raise InvalidArgumentError(f"scheduler is a {type(scheduler).__name__}; a Scheduler is required")
        if not isinstance(engine, AbortAllEngine):
            raise InvalidArgumentError(f"engine is a {type(engine).__name__}; an engine that aborts every request on "
                                       f"the servers the function posts to (protocol.AbortAllEngine: abort_all()), "
                                       f"such as an SGLangEngine, is required")
        cfg = scheduler.config
        refused = refused_settings(cfg)
        if refused is not None:
            raise ConfigError(refused)
        for name, fn in (("reward_fn", reward_fn), ("group_filter", group_filter), ("decode", decode)):
            if fn is not None and not callable(fn):
                raise InvalidArgumentError(f"{name}={fn!r} is not callable")
        for name, value in (("abort_resend_s", abort_resend_s), ("abort_timeout_s", abort_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise InvalidArgumentError(f"{name}={value!r} is not allowed: a positive finite number of seconds")
        if args is None:
            args = slime_args(url_of(engine), cfg, sampling)
        elif not isinstance(args, argparse.Namespace):
            raise InvalidArgumentError(f"args is a {type(args).__name__}; an argparse.Namespace (slime_args) is "
                                       f"required")
        self.generate_fn = generate_fn
        self.scheduler = scheduler
        self.engine = engine
        self.args = args
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.decode = decode
        self.abort_resend_s = float(abort_resend_s)
        self.abort_timeout_s = float(abort_timeout_s)
        self.capacity = cfg.max_inflight_samples or cfg.over_sampling_batch_size * cfg.n_samples_per_prompt
        self._calls: dict[int, _Call] = {}
        self._returned: list[int] = []
        self._replays: dict[int, Replay] = {}
        self._partials: dict[int, Any] = {}  # the returned sample of an ABORTED call, replayed whole
        self._rewards: dict[int, float | None] = {}  # the function's, by sample (None: reward_fn's)
        # The verdict that would end the step waits (with any after it) until every call is back and replayed
        # whole: once the step is done the scheduler dispatches nothing, and a call's later turns need dispatches.
        self._held: list[tuple[int, list[float], bool]] | None = None
        self._accepted: set[int] = set()  # groups reported accepted, not trained or dropped: the step's end
        self._ending_at: float | None = None
        self._failures: list[BaseException] = []
        self._scoring = RewardPipeline(reward_fn, group_filter, failures=self._failures, notify=self._notify,
                                       rewards_of=self._group_rewards, report=self._verdict)
        self._wake: asyncio.Event | None = None
        self._counts: dict[str, float] = {}
        self._inflight_area = 0.0
        self._last_change = 0.0
        self._finished_at: list[float] = []

    # ------------------------------------------------------------------ public

    async def run_step(self, policy_version: int) -> RolloutResult:
        """Calls the function for every dispatched request until N groups are accepted (or the data ran out),
        then aborts the servers, replays what every call returned and takes the batch."""
        sched = self.scheduler
        self._wake = asyncio.Event()
        self._counts = dict.fromkeys(("requests", "resumed", "aborted", "generated", "env_runs", "env_tokens",
                                      "replay_dispatches", "discarded_model_tokens", "discarded_env_tokens"), 0)
        self._inflight_area, self._finished_at = 0.0, []
        sched.begin_step(policy_version)
        self._prune_accepted(())  # begin_step may drop stale groups
        start = self._last_change = time.monotonic()
        self._ending_at = None
        while True:
            raise_first(self._failures)
            self._replay_returned(policy_version)
            for group in sched.pop_completed_groups():
                self._scoring.start(group)
            if sched.step_done:
                break
            if self._held is not None:
                await self._end_calls(policy_version)
                self._release_held()
                continue  # done now, unless the prediction was wrong (then the step goes on)
            if self._dispatch(policy_version):
                continue  # replayed turns queued their samples again: dispatch them before waiting
            if not self._calls and not self._scoring.pending:
                raise InternalError(f"custom generate rollout stalled: no call out, no reward pending and the step "
                                    f"is not done (scheduler stats: {sched.stats()})")
            self._wake.clear()
            await self._wake.wait()
        done_at = min(time.monotonic(), self._ending_at or math.inf)
        to_abort = set(sched.samples_to_abort())
        await self._abort_calls()
        aborted = self._replay_returned(policy_version)
        self._counts["aborted"] += len(to_abort & aborted)
        self._cut_replays()
        batch = sched.take_batch()
        self._prune_accepted(batch.sample_ids.tolist())
        self._forget_finished()
        end = time.monotonic()
        self._account(end)
        counts = self._counts
        metrics = step_metrics(
            policy_version, batch, start=start, done_at=done_at, end=end, generated=int(counts["generated"]),
            requests=int(counts["requests"]), resumed=int(counts["resumed"]), aborted=int(counts["aborted"]),
            inflight_area=self._inflight_area, capacity=self.capacity, engine_steps=0, finished_at=self._finished_at,
            scheduler=sched.stats(), env={k: float(counts[k]) for k in (
                "env_runs", "env_tokens", "replay_dispatches", "discarded_model_tokens", "discarded_env_tokens")})
        return RolloutResult(batch, metrics)

    @property
    def pending_rewards(self) -> int:
        return self._scoring.pending

    async def drain_rewards(self) -> None:
        """Waits for every reward still being computed (groups completed after their step's batch was taken);
        raises the first failure."""
        await self._scoring.wait()
        raise_first(self._failures)

    @property
    def carried(self) -> int:
        """Nothing is carried between steps (step_boundary is 'abort'): 0."""
        return 0

    async def abort_carried(self) -> None:
        """Nothing is carried between steps (step_boundary is 'abort')."""

    @contextlib.asynccontextmanager
    async def running_engine(self) -> AsyncIterator[None]:
        """The engine is free between steps (nothing is carried): other work (evaluation) uses it as it is."""
        yield

    def environment_state(self) -> bytes:
        """What a checkpoint needs beside the scheduler's state, as bytes: the rewards the function gave to
        finished samples whose group is not complete yet (the scheduler holds their tokens, not these), the groups
        reported accepted and not trained (the prediction of the verdict that ends a step), and the sample objects
        of ABORTED calls (so that a resumed call gets the object with the function's own fields; one that does not
        pickle is left out, with a warning, and its call gets a sample rebuilt from the scheduler's partial). Call
        between steps, after drain_rewards (as for the scheduler's save): InvalidStateError while calls are out."""
        if self._calls or self._replays or self._held is not None:
            raise InvalidStateError(f"environment_state is saved between steps: {len(self._calls)} calls are still "
                                    f"out (call it after run_step and drain_rewards)")
        self._forget_finished()
        partials = {}
        for sid, sample in self._partials.items():
            try:
                partials[sid] = pickle.dumps(sample)
            except Exception as err:  # noqa: BLE001 - any field of the function's own may refuse to pickle
                logger.warning("custom generate sample %d does not pickle (%s: %s): a resumed run rebuilds it from "
                               "the scheduler's partial", sid, type(err).__name__, err)
        return pickle.dumps({"format": _STATE_FORMAT, "rewards": dict(self._rewards), "accepted": sorted(self._accepted),
                             "partials": partials})

    def load_environment_state(self, data: bytes) -> None:
        """Restores environment_state's bytes, after the scheduler's state of the same moment was loaded; what
        belongs to samples the scheduler no longer holds is dropped. CorruptStateError for bytes that are not such
        a state."""
        try:
            loaded = pickle.loads(data)  # noqa: S301 - the run's own checkpoint, checked by its manifest
            if not isinstance(loaded, dict) or loaded.get("format") != _STATE_FORMAT:
                raise ValueError(f"not a {_STATE_FORMAT} state")
            rewards = {int(s): None if r is None else float(r) for s, r in loaded["rewards"].items()}
            accepted = {int(g) for g in loaded["accepted"]}
            partials = {int(s): pickle.loads(p) for s, p in loaded["partials"].items()}  # noqa: S301 - as above
        except Exception as err:  # noqa: BLE001 - any failure to read is a corrupt file
            raise CorruptStateError(f"the custom generate rollout's state cannot be read: {err}") from None
        self._rewards, self._accepted, self._partials = rewards, accepted, partials
        self._forget_finished()
        self._prune_accepted(())

    async def close(self) -> None:
        """Nothing to end: the calls of a step end with it (the servers' aborts go through the engine)."""

    # ------------------------------------------------------------------ calls

    def _dispatch(self, version: int, other: Callable[[GenerationRequest], None] | None = None) -> bool:
        """Continues the replay of each dispatched request's sample with turns still to replay; ``other`` takes
        the other requests (by default: a call each). Returns whether a replay advanced."""
        advanced = False
        for request in self.scheduler.dispatch():
            replay = self._replays.pop(request.sample_id, None)
            if replay is not None and request.is_resume:
                self._counts["replay_dispatches"] += 1
                self._advance(request.sample_id, replay, version)
                advanced = True
                continue
            if replay is not None:  # the scheduler restarted the sample from its prompt: the turns are gone
                self._discard(replay.runs)
            (other or self._start_call)(request)
        return advanced

    def _start_call(self, request: GenerationRequest) -> None:
        sample = self._sample_for(request)
        params = sampling_params_of(self.args)
        coro = self.generate_fn(self.args, sample, params, evaluation=False) if self._takes_evaluation else \
            self.generate_fn(self.args, sample, params)
        self._account(time.monotonic())
        task = asyncio.create_task(coro)
        sid = request.sample_id
        self._calls[sid] = _Call(request, task)
        self._counts["requests"] += 1
        self._counts["resumed"] += request.is_resume
        task.add_done_callback(lambda _: self._call_done(sid))

    def _call_done(self, sample_id: int) -> None:
        self._account(time.monotonic())
        self._returned.append(sample_id)
        self._notify()

    def _sample_for(self, request: GenerationRequest) -> Any:
        """The sample a call gets: the one its last call returned when the scheduler's partial is exactly it,
        else one built from the prompt and the scheduler's partial (tokens, loss mask, logprobs)."""
        sid = request.sample_id
        ids = request.input_ids.tolist()
        kept = self._partials.pop(sid, None)
        if kept is not None and request.is_resume and list(kept.tokens) == ids:
            return kept
        prompt = self.scheduler.data[request.prompt_index]
        metadata = copy.deepcopy(dict(prompt.metadata))
        sample = Sample(group_index=request.group_id, index=sid, tokens=ids, label=metadata.get("label"),
                        metadata=metadata,
                        prompt=self.decode(list(prompt.token_ids)) if self.decode is not None else "")
        if request.is_resume:
            view = self.scheduler.sample(sid)
            env = view.env_mask if view.env_mask is not None else np.zeros(view.token_ids.size, np.uint8)
            response = view.token_ids.tolist()
            sample.response_length = len(response)
            sample.loss_mask = (1 - env.astype(np.int64)).tolist()
            sample.rollout_log_probs = view.logprobs.astype(np.float64).tolist()
            sample.response = self.decode(response) if self.decode is not None else ""
            sample.status = Sample.Status.ABORTED
        return sample

    async def _abort_calls(self) -> None:
        """Aborts every request on the servers, again every abort_resend_s, until every call has returned."""
        if not self._calls:
            return
        deadline = time.monotonic() + self.abort_timeout_s
        while self._calls:
            await self.engine.abort_all()
            pending = {c.task for c in self._calls.values() if not c.task.done()}
            if not pending:
                break
            if time.monotonic() > deadline:
                raise InvalidStateError(f"{len(pending)} custom generate calls did not return within "
                                        f"abort_timeout_s={self.abort_timeout_s} of the servers' abort (a function "
                                        f"must return its sample with status ABORTED when /generate answers "
                                        f"finish_reason 'abort')")
            await asyncio.wait(pending, timeout=self.abort_resend_s)

    async def _end_calls(self, version: int) -> None:
        """The step's end while it is not done yet in the scheduler: aborts every call and replays what they
        return whole, dispatching their samples' later turns; a request that is not such a replay is ended at
        once with no tokens (an abort: it stays queued), since nothing is generated while the step ends."""
        await self._abort_calls()
        self._counts["aborted"] += len(self._replay_returned(version))
        while self._replays:
            if not self._dispatch(version, lambda request: self.scheduler.on_finish(request.sample_id, "abort")):
                break  # the turns still to replay are cut when the step ends

    # ------------------------------------------------------------------ replay

    def _replay_returned(self, version: int) -> set[int]:
        """Replays every call that returned since the last look; returns the samples whose call came back
        ABORTED."""
        aborted = set()
        returned, self._returned = self._returned, []
        for sid in returned:
            call = self._calls.pop(sid)
            if call.task.cancelled():
                raise InternalError(f"the generate call of sample {sid} was cancelled")
            if call.task.exception() is not None:
                raise call.task.exception()  # type: ignore[misc]
            replay, discarded = parse_call(call.request, call.task.result(), self.scheduler, self.args)
            self._discard(discarded)
            if replay.finish == "abort":
                aborted.add(sid)
            self._advance(sid, replay, version)
        return aborted

    def _advance(self, sample_id: int, replay: Replay, version: int) -> None:
        """Hands the replay's runs to the scheduler until its sample is queued again for another dispatch (a
        tool run ended the turn) or the replay is done (then the finish)."""
        sched = self.scheduler
        while replay.runs:
            is_model, tokens, logprobs = replay.runs[0]
            if is_model:
                sched.on_tokens(sample_id, tokens, logprobs, version)
                self._counts["generated"] += len(tokens)
                replay.runs.popleft()
                continue
            sched.on_env_wait(sample_id)
            sched.on_env_tokens(sample_id, tokens)
            replay.runs.popleft()
            self._counts["env_runs"] += 1
            self._counts["env_tokens"] += len(tokens)
            if sched.sample(sample_id).state == "done":  # the observation reached max_response_len
                self._finished(sample_id, replay.reward)
                return
            if replay.runs:
                self._replays[sample_id] = replay  # the next turn needs a dispatch of its own
                return
        if replay.finish == "abort":
            if sched.sample(sample_id).state != "queued":  # a tool run just queued it: that is the partial
                sched.on_finish(sample_id, "abort")
            if sched.sample(sample_id).state == "done":  # an abort at max_response_len counts as length
                self._finished(sample_id, None)
            else:
                self._partials[sample_id] = replay.sample  # replayed whole: the next call gets this object
            return
        sched.on_finish(sample_id, replay.finish)
        self._finished(sample_id, replay.reward)

    def _finished(self, sample_id: int, reward: float | None) -> None:
        self._rewards[sample_id] = reward
        self._finished_at.append(time.monotonic())

    def _cut_replays(self) -> None:
        """After the step's end nothing is dispatched: the turns still to replay are not kept (the samples stay
        queued with what was replayed, ending with a tool output, and the next call continues from there)."""
        for replay in self._replays.values():
            self._discard(replay.runs)
        self._replays.clear()

    def _discard(self, runs: Sequence[Run]) -> None:
        for is_model, tokens, _ in runs:
            self._counts["discarded_model_tokens" if is_model else "discarded_env_tokens"] += len(tokens)

    def _forget_finished(self) -> None:
        """Drops the kept rewards and partials of samples the scheduler no longer holds as done or queued."""
        held = set(self.scheduler.sample_ids("done")) | set(self.scheduler.sample_ids("queued"))
        self._rewards = {s: r for s, r in self._rewards.items() if s in held}
        self._partials = {s: p for s, p in self._partials.items() if s in held}

    # ------------------------------------------------------------------ rewards

    async def _group_rewards(self, group: CompletedGroup) -> list[float]:
        """The function's rewards, reward_fn's for the samples without one."""
        rewards: list[float] = []
        for sid, response in zip(group.sample_ids.tolist(), group.responses, strict=True):
            value = self._rewards.pop(sid, None)
            if value is None:
                if self.reward_fn is None:
                    raise InvalidArgumentError(f"sample {sid} finished without a reward (sample.reward None) and "
                                               f"no reward_fn was given")
                value = await self._scoring.score_sample(group.prompt, response)
            rewards.append(float(value))  # type: ignore[arg-type]
        return rewards

    def _verdict(self, group: CompletedGroup, rewards: list[float], accepted: bool) -> None:
        """Reports the filter's verdict, or holds it back (with any after it) when it would end the step."""
        if self._held is None and accepted and (self._calls or self._replays) and \
                len(self._accepted) + 1 >= self.scheduler.config.rollout_batch_size:
            self._held = []  # this verdict ends the step (as far as we can tell): the calls come back first
            self._ending_at = time.monotonic()
        if self._held is not None:
            self._held.append((group.group_id, rewards, accepted))
            self._notify()
        else:
            self._report(group.group_id, rewards, accepted)

    def _report(self, group_id: int, rewards: list[float], accepted: bool) -> None:
        self.scheduler.report_rewards(group_id, rewards, accepted)
        if accepted:
            self._accepted.add(group_id)

    def _prune_accepted(self, trained: Sequence[int]) -> None:
        """Keeps the accepted groups that are neither in the batch just taken nor dropped by the scheduler (a
        group accepted and not trained has all its samples done)."""
        n = self.scheduler.config.n_samples_per_prompt
        done = {sid // n for sid in self.scheduler.sample_ids("done")}
        self._accepted = (self._accepted - {sid // n for sid in trained}) & done

    def _release_held(self) -> None:
        held, self._held = self._held or [], None
        for verdict in held:
            self._report(*verdict)

    # ------------------------------------------------------------------ helpers

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _account(self, now: float) -> None:
        self._inflight_area += len(self._calls) * (now - self._last_change)
        self._last_change = now


__all__ = ["CustomGenerateRollout", "GenerateFn", "Sample", "check_generate_function", "load_generate_function",
           "refused_settings", "sampling_params_of", "slime_args"]
