"""RolloutLoop: one asyncio loop that drives the Scheduler over any RolloutEngine, one step at a time.

Per step: dispatch (buffered partials first, then new groups), stream chunks into the scheduler (batched
per wake-up), reward each group as it completes (reward functions run as tasks, so a slow one never holds
up the loop), apply the group filter, and once N groups are accepted take the batch. What happens to the
samples still running then is the scheduler's ``step_boundary``: ``abort`` (the paper) aborts them and
hands the abort results (partial tokens) back to the scheduler; ``carry`` pauses the engine in place
(``pause_generation("in_place")``): they keep their KV cache while the trainer trains and the weights
update, and the next step continues them (after aborting those the staleness bound sends back).

APRIL and the synchronous baseline are this same code: the baseline is a scheduler with
over_sampling_batch_size == rollout_batch_size, so nothing is left running when N groups are accepted
and nothing is aborted (see :func:`april_ext.strategies.scheduler_config_for`).

``deterministic=True`` over an engine that steps in lockstep (protocol.LockstepEngine: the embedded
AsyncEngine) makes a seeded run repeat exactly: the engine runs a model step only after the loop has handed
the previous step's chunks to the scheduler, rewarded the groups they completed and sent its requests and
aborts, and rewards reach the scheduler in the order the groups completed, not in the order their reward
tasks end (docs/loop.md, "Deterministic rollouts").

It is a protocol.RolloutDriver. Its parts of their own: the reward pipeline (rewards.py, shared with
CustomGenerateRollout), the step's metrics (step_metrics.py) and the multi-turn hand-over between the
scheduler and the environment (environment_turns.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from april_ext.batch import FinishReason
from april_ext.errors import InternalError, InvalidArgumentError, UnknownIdError
from april_ext.protocol.environment import Environment
from april_ext.protocol.rollout_engine import Clock, LockstepEngine, PausableEngine, RolloutEngine, engine_clock
from april_ext.protocol.rollout_result import RolloutMetrics, RolloutResult
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.rollout import environment_turns as turns
# GroupFilter, RewardFn, RolloutMetrics and tail_latency are also imported from here (their home before they had
# modules of their own): re-exported.
from april_ext.rollout.rewards import GroupFilter, RewardFn, RewardPipeline, Verdict, raise_first
from april_ext.rollout.step_metrics import step_metrics, tail_latency
from april_ext.rollout.trajectories import Trajectories
from april_ext.scheduler import (
    ENV_WAIT,
    CompletedGroup,
    GenerationRequest,
    Scheduler,
)

_E = TypeVar("_E", bound=tuple)


@dataclass
class _Stream:
    request: GenerationRequest
    request_id: str
    received: int = 0
    ended: FinishReason | None = None
    aborting: bool = False
    """We abort it: its end is reported with the abort result (which may carry tokens the stream lacks)."""
    task: asyncio.Task[None] | None = None


class RolloutLoop:
    """Drives ``scheduler`` over ``engine``. One step at a time; call from a single event loop.

    reward_fn(prompt, response_ids) -> float scores each sample; a plain function runs in a worker
    thread (one call per group), an ``async def`` function is awaited; a reward_fn with an async
    ``score_group(prompt, responses) -> list[float]`` method is called once per group instead.
    group_filter(rewards) -> bool keeps or drops a rewarded group. sampling is the template of every request (its max_new_tokens is
    replaced by the scheduler's budget and its seed by a per-sample seed derived from ``seed``, so a
    resumed sample continues the same random stream). clock: see :func:`engine_clock`.
    engine_capacity: how many requests the engine runs at once, for the occupancy metric.

    With the scheduler's step_boundary="carry", the samples running when a step's batch is taken stay in the
    engine: a ``PausableEngine`` is paused in place until the next ``run_step`` (an engine without
    pause_generation keeps generating meanwhile, as PipelineRL's engines do). Between steps the engine
    holds them; :meth:`running_engine` lets other work (evaluation) use the engine meanwhile, and
    :meth:`abort_carried` ends them (the end of a run).

    Groups whose rewards are still being computed when the step ends are not waited for: their
    rewards reach the scheduler whenever they are ready (surplus for a later step). Call
    :meth:`drain_rewards` before saving the scheduler so that none is in flight.

    deterministic: with an engine that steps in lockstep (``LockstepEngine``: the embedded AsyncEngine), the run
    repeats exactly for a seed. During a step the engine runs a model step only once the loop has taken the
    previous one's chunks, reported the rewards of every group they completed (in completion order, as they
    left pop_completed_groups) and sent its dispatches and aborts; so which requests share each engine step,
    which groups are accepted first and how many tokens each partial sample holds at the abort are a function
    of the seed. Rewards of groups the step no longer needs (it was done first) are reported, in that order,
    before the next step begins. Other engines ignore it (their steps follow their own timing).
    """

    def __init__(self, engine: RolloutEngine, scheduler: Scheduler, reward_fn: RewardFn | None, *,
                 sampling: SamplingParams | None = None, group_filter: GroupFilter | None = None,
                 seed: int = 0, clock: Clock | None = None, engine_capacity: int | None = None,
                 request_prefix: str = "april", deterministic: bool = False,
                 environment: Environment | None = None, tool_timeout_s: float = 30.0,
                 max_concurrent_tool_calls: int | None = None) -> None:
        if not isinstance(engine, RolloutEngine):
            raise InvalidArgumentError(
                f"engine is a {type(engine).__name__}; a RolloutEngine needs generate, abort, update_weights, "
                f"release_memory, resume_memory, stats and health")
        if not isinstance(scheduler, Scheduler):
            raise InvalidArgumentError(f"scheduler is a {type(scheduler).__name__}; a Scheduler is required")
        if environment is None and not callable(reward_fn):
            raise InvalidArgumentError(f"reward_fn={reward_fn!r} is not callable (only a multi-turn loop, given an "
                                       f"environment whose final rewards are the samples', goes without one)")
        if environment is not None and reward_fn is not None:
            raise InvalidArgumentError("a multi-turn loop takes its rewards from the environment (EnvStep.reward): "
                                       "pass reward_fn=None with an environment")
        if engine_capacity is not None and (not isinstance(engine_capacity, int) or engine_capacity < 1):
            raise InvalidArgumentError(f"engine_capacity={engine_capacity!r} is not allowed: None or an int >= 1")
        if not isinstance(seed, int) or seed < 0:
            raise InvalidArgumentError(f"seed={seed!r} is not allowed: an int >= 0")
        if not isinstance(deterministic, bool):
            raise InvalidArgumentError(f"deterministic={deterministic!r} is not allowed: True or False")
        self.engine = engine
        self.scheduler = scheduler
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.sampling = sampling or SamplingParams()
        self.clock = engine_clock(engine, clock)
        cfg = scheduler.config
        caps = [c for c in (cfg.max_inflight_samples, cfg.target_inflight_samples) if c is not None]
        self.capacity = engine_capacity or (
            min(caps) if caps else cfg.over_sampling_batch_size * (cfg.n_samples_per_prompt + cfg.tail_extra_samples))
        self._seed = seed
        self._prefix = request_prefix
        self._ids = itertools.count()
        # deterministic: engine steps in lockstep with the loop; rewards reported in completion order of groups.
        self.deterministic = deterministic and isinstance(engine, LockstepEngine)
        self._reward_order: deque[tuple[CompletedGroup, asyncio.Task[Verdict]]] = deque()
        self._failures: list[BaseException] = []
        self._scoring = RewardPipeline(reward_fn, group_filter, failures=self._failures, notify=self._notify,
                                       rewards_of=self._group_rewards,
                                       report=None if self.deterministic else self._report)
        self._wake: asyncio.Event | None = None
        self._streams: dict[int, _Stream] = {}
        self._stream_tasks: set[asyncio.Task[None]] = set()
        self._token_events: list[tuple[int, list[int], list[float], int]] = []
        self._finish_events: list[tuple[int, int]] = []  # FinishReason codes, or ENV_WAIT
        self._carry = cfg.step_boundary == "carry"
        self._surplus = cfg.tail_extra_samples > 0
        # begin_step may take back a completed group (tail batching's restarts, staleness restart / drop): one
        # popped for reward must have its reward in first (docs/scheduler.md, "Staleness").
        self._rewards_before_step = cfg.tail_batching_restart or (
            cfg.max_staleness is not None and cfg.staleness_policy in ("restart", "drop"))
        self._paused = False
        self._inflight = 0
        self._area = 0.0
        self._last_change = 0.0
        self._generated = 0
        self._finished_at: list[float] = []
        self._max_response_len = cfg.max_response_len
        self._env = None if environment is None else Trajectories(
            environment, tool_timeout_s=tool_timeout_s, max_concurrent_tool_calls=max_concurrent_tool_calls,
            notify=self._notify)
        self._tool_area = 0.0
        self._idle_tool_area = 0.0

    # ------------------------------------------------------------------ public

    @property
    def pending_rewards(self) -> int:
        """Groups that completed but whose rewards have not reached the scheduler yet."""
        return len(self._reward_order) if self.deterministic else self._scoring.pending

    async def run_step(self, policy_version: int) -> RolloutResult:
        """Generates until N groups are accepted (or data runs out), then aborts the rest (step_boundary
        "abort") or pauses them in place (carry), and returns the batch."""
        sched = self.scheduler
        self._wake = asyncio.Event()
        self._generated = 0
        self._area = self._tool_area = self._idle_tool_area = 0.0
        if self._env is not None:
            # The steps a loaded state had running.
            self._env.rerun_pending(lambda sid: turns.waiting_turn(self.scheduler, sid))
        # Chunks the carried samples produced before the last pause reach the scheduler with their version.
        self._flush()
        if self._rewards_before_step or self.deterministic:
            await self.drain_rewards()
        sched.begin_step(policy_version)
        engine_steps = self._engine_steps()
        start = self._last_change = self.clock()
        if self.deterministic:
            await self.engine.set_lockstep(True)  # type: ignore[attr-defined]
        try:
            return await self._run_step(policy_version, start, engine_steps)
        finally:
            if self.deterministic:
                await self.engine.set_lockstep(False)  # type: ignore[attr-defined]

    async def _run_step(self, policy_version: int, start: float, engine_steps: int) -> RolloutResult:
        sched = self.scheduler
        assert self._wake is not None
        requests = resumed = aborted = 0
        self._finished_at = []
        if self._carry:
            # Carried samples past the staleness bound come back (restart / drop); the rest continue. The engine
            # continues first: a request that reached an SGLang server after the pause waits at its gate, not
            # yet in flight, where no abort finds it until generation continues.
            await self._continue()
            stale = sched.samples_to_abort()
            aborted += len(stale)
            await self._abort(stale)
        while True:
            self._raise_failures()
            if self.deterministic and self.engine.lockstep_busy():  # type: ignore[attr-defined]
                await self._wait()  # the released engine step has not reached the streams yet
                continue
            if self.deterministic and self._env is not None and self._env.running:
                # Tool answers come on the wall clock: the engine waits for them, so they reach the scheduler
                # at the same engine step in every run (docs/agentic.md, "Deterministic rollouts").
                await self._env.wait_all()
            self._flush()
            for group in sched.pop_completed_groups():
                self._start_reward(group)
            if self.deterministic:
                self._report_in_order(until_done=True)
            if sched.step_done:
                break
            if self.deterministic and self._reward_order:
                await self._wait()  # the engine waits too: its next step follows these rewards
                continue
            if self._surplus and (cancelled := sched.samples_to_abort()):
                # Over-provisioned samples of groups whose first n finished: ended now, so their slots go to work
                # that counts. Their results may complete groups: those are handed out before anything else.
                aborted += len(await self._abort(cancelled))
                continue
            dispatched = sched.dispatch()
            started = dispatched if self._env is None else \
                await turns.start_trajectories(self._env, sched, dispatched)
            for request in started:
                requests += 1
                resumed += request.is_resume
                self._start_stream(request)
            if len(started) < len(dispatched):
                continue  # trajectories whose start failed were finished: their groups may be complete
            if not self._stream_tasks and not self._scoring.pending and not sched.step_done and not (
                    self._env is not None and self._env.busy):
                raise InternalError(f"rollout loop stalled: nothing running, no reward pending and the step "
                                    f"is not done (scheduler stats: {sched.stats()})")
            if self.deterministic and self._streams:
                # Everything for the next engine step is sent: the requests just dispatched (their streams open
                # before the engine's loop runs again) and the aborts (awaited).
                self.engine.release_step().add_done_callback(lambda _: self._notify())  # type: ignore[attr-defined]
            await self._wait()
        done_at = self.clock()
        waiting_at_boundary = self._env_pending
        if self._carry:
            if self._surplus:
                aborted += len(await self._abort(sched.samples_to_abort()))
            await self._pause()
            self._flush()
        else:
            to_abort = set(sched.samples_to_abort())
            aborted += len(to_abort & await self._abort(None))
        batch = sched.take_batch()
        end = self.clock()
        self._account(end)
        metrics = step_metrics(
            policy_version, batch, start=start, done_at=done_at, end=end, generated=self._generated,
            requests=requests, resumed=resumed, aborted=aborted, inflight_area=self._area, capacity=self.capacity,
            engine_steps=self._engine_steps() - engine_steps, finished_at=self._finished_at,
            scheduler=sched.stats(), env=self._env_metrics(waiting_at_boundary))
        return RolloutResult(batch, metrics)

    @property
    def carried(self) -> int:
        """Samples held in the engine between steps (step_boundary="carry")."""
        return len(self._streams)

    @contextlib.asynccontextmanager
    async def running_engine(self) -> AsyncIterator[None]:
        """The engine generating inside the block although samples are carried (for work between steps, such as
        evaluation): the carried samples continue meanwhile, under the weights loaded by then; the pause is
        restored on exit."""
        paused = self._paused
        await self._continue()
        try:
            yield
        finally:
            if paused:
                await self._pause()

    async def abort_carried(self) -> None:
        """Ends the carried samples (at the end of a run): aborted in the engine, their tokens handed to the
        scheduler as partials. The engine continues first, as at the start of a step (see run_step)."""
        await self._continue()
        await self._abort(None)

    async def drain_rewards(self) -> None:
        """Hands the chunks received so far to the scheduler and waits for every pending reward task (its
        rewards reach the scheduler; deterministic: in completion order of the groups); raises the first failure."""
        self._flush()
        await self._scoring.wait()
        self._raise_failures()
        self._report_in_order(until_done=False)

    # ------------------------------------------------------------------ streams

    def _seed_of(self, sample_id: int) -> int:
        return (self._seed * 1_000_003 + sample_id * 7919) % (2**31 - 1)

    def _start_stream(self, request: GenerationRequest) -> None:
        stream = _Stream(request, f"{self._prefix}-{request.sample_id}-{next(self._ids)}")
        self._streams[request.sample_id] = stream
        self._account(self.clock())
        self._inflight += 1
        task = stream.task = asyncio.create_task(self._run_stream(stream))
        self._stream_tasks.add(task)
        task.add_done_callback(self._stream_done)

    def _stream_done(self, task: asyncio.Task[None]) -> None:
        self._stream_tasks.discard(task)
        self._account(self.clock())
        self._inflight -= 1
        if not task.cancelled() and task.exception() is not None:
            self._failures.append(task.exception())  # type: ignore[arg-type]
        self._notify()

    async def _run_stream(self, stream: _Stream) -> None:
        request = stream.request
        sid = request.sample_id
        params = replace(self.sampling, max_new_tokens=request.max_new_tokens, seed=self._seed_of(sid),
                         priority=self._priority(request))
        async for chunk in self.engine.generate(request.input_ids.tolist(), params, stream.request_id):
            if chunk.token_ids:
                self._token_events.append((sid, list(chunk.token_ids), list(chunk.logprobs), chunk.weight_version))
                stream.received += len(chunk.token_ids)
                self._generated += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                stream.ended = FinishReason(chunk.finish_reason)
                total = len(request.input_ids) - request.prompt_len + stream.received
                if (stream.ended == FinishReason.STOP and self._env is None) or total >= self._max_response_len:
                    self._finished_at.append(self.clock())
                break
            self._notify()
        if stream.ended is None:
            stream.ended = FinishReason.ABORT
        # An abort we issued is reported with the abort results (they may carry tokens the stream lacks).
        if not (stream.aborting and stream.ended == FinishReason.ABORT):
            # Multi-turn: a turn that ended at a stop token goes to the environment.
            ended = ENV_WAIT if self._env is not None and stream.ended == FinishReason.STOP else int(stream.ended)
            self._finish_events.append((sid, ended))
            del self._streams[sid]
        self._notify()

    def _priority(self, request: GenerationRequest) -> int | None:
        """The request's engine priority when the scheduler dispatches by predicted length, so that an engine
        with a waiting queue keeps that order: the predicted remaining tokens (longest_predicted_first), their
        negative (shortest_first); else None (arrival order)."""
        order = self.scheduler.config.dispatch_order
        if order not in ("longest_predicted_first", "shortest_first"):
            return None
        remaining = request.predicted_len - (len(request.input_ids) - request.prompt_len)
        return remaining if order == "longest_predicted_first" else -remaining

    async def _abort(self, sample_ids: Sequence[int] | None) -> set[int]:
        """Aborts the requests of the given samples (None: every request of the loop, which owns the engine
        during a step) and hands their partial outputs to the scheduler. Returns the samples aborted."""
        streams = list(self._streams.values()) if sample_ids is None else \
            [self._streams[sid] for sid in sample_ids if sid in self._streams]
        if not streams:
            self._flush()
            return set()
        for stream in streams:
            stream.aborting = True
        if sample_ids is None:
            outputs = await self.engine.abort(None)
        else:
            outputs = []
            for stream in streams:
                # A request that finished meanwhile is unknown to the engine: its stream reports the finish.
                with contextlib.suppress(UnknownIdError):
                    outputs += await self.engine.abort([stream.request_id])
        by_request = {o.request_id: o for o in outputs}
        tasks = {stream.task for stream in streams if stream.task is not None}
        while pending := {t for t in tasks if not t.done()}:
            await asyncio.wait(pending)
        self._raise_failures()
        aborted = set()
        for stream in streams:
            sid = stream.request.sample_id
            if self._streams.get(sid) is not stream:
                continue  # it ended on its own; its stream reported the finish
            output = by_request.get(stream.request_id)
            if output is not None and len(output.token_ids) > stream.received:
                self._push_tail(sid, output.token_ids[stream.received:], output.logprobs[stream.received:],
                                output.versions[stream.received:])
            self._finish_events.append((sid, int(FinishReason.ABORT)))
            aborted.add(sid)
            del self._streams[sid]
        self._flush()
        return aborted

    async def _pause(self) -> None:
        """Holds the carried samples in the engine with their KV cache (a PausableEngine only)."""
        if self._streams and not self._paused and isinstance(self.engine, PausableEngine):
            await self.engine.pause_generation("in_place")
            self._paused = True

    async def _continue(self) -> None:
        if self._paused:
            await self.engine.continue_generation()  # type: ignore[attr-defined]
            self._paused = False

    def _push_tail(self, sid: int, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Tokens of an abort result that the stream had not delivered, one event per version run."""
        start = 0
        for i in range(1, len(tokens) + 1):
            if i == len(tokens) or versions[i] != versions[start]:
                self._token_events.append((sid, list(tokens[start:i]), list(logprobs[start:i]), int(versions[start])))
                start = i
        self._generated += len(tokens)

    def _flush(self) -> None:
        """Hands the collected chunks and finishes to the scheduler in two batched calls. Chunks of weights
        newer than the scheduler's step (carried samples continuing between steps, under weights loaded for
        the next one) wait for that step, with every later event of their samples."""
        # Only a carried sample can run ahead of the scheduler's step (within a step no chunk can).
        version = self.scheduler.policy_version if self._carry and self._token_events else None
        if version is not None and any(e[3] > version for e in self._token_events):
            held = {e[0] for e in self._token_events if e[3] > version}
            self._token_events, events = _split(self._token_events, held)
            self._finish_events, finishes = _split(self._finish_events, held)
            self._hand_over(events, finishes)
        else:
            events, self._token_events = self._token_events, []
            finishes, self._finish_events = self._finish_events, []
            self._hand_over(events, finishes)

    def _hand_over(self, events: list[tuple[int, list[int], list[float], int]],
                   finishes: list[tuple[int, int]]) -> None:
        if events:
            sids = [e[0] for e in events]
            counts = [len(e[1]) for e in events]
            total = sum(counts)
            tokens = np.fromiter(itertools.chain.from_iterable(e[1] for e in events), np.int32, total)
            logprobs = np.fromiter(itertools.chain.from_iterable(e[2] for e in events), np.float32, total)
            self.scheduler.on_tokens_batch(sids, counts, tokens, logprobs, [e[3] for e in events])
        if finishes:
            self.scheduler.on_finish_batch([e[0] for e in finishes], [e[1] for e in finishes])
        if self._env is not None:
            self._account(self.clock())  # the time before, with the turns with the environment then
            waiting = sorted(sid for sid, code in finishes if code == ENV_WAIT)
            turns.hand_turns_to_env(self._env, self.scheduler, waiting)
            turns.deliver_env_answers(self._env, self.scheduler)

    # ------------------------------------------------------------------ environment (multi-turn)

    @property
    def _env_pending(self) -> int:
        """Trajectories whose turn is with the environment."""
        return 0 if self._env is None else self._env.pending

    def _env_metrics(self, waiting_at_boundary: int) -> dict[str, float]:
        if self._env is None:
            return {}
        out = self._env.take_stats().as_metrics()
        out["waiting_at_boundary"] = float(waiting_at_boundary)
        out["engine_idle_while_tools"] = self._idle_tool_area / self._tool_area if self._tool_area > 0 else 0.0
        return out

    def environment_state(self) -> bytes | None:
        """The trajectories' state (environment states, turns with the environment, final rewards) as bytes,
        to save beside the scheduler's state (call after drain_rewards, as for the scheduler); None without an
        environment. Trajectories of samples the scheduler no longer holds are left out."""
        if self._env is None:
            return None
        self._flush()
        return turns.trajectories_state(self._env, self.scheduler)

    def load_environment_state(self, data: bytes) -> None:
        """Restores environment_state's bytes (after the scheduler's state of the same moment was loaded). The
        turns that were with the environment are handed to it again at the next run_step, from the state they
        started from. InvalidArgumentError without an environment; CorruptStateError for unreadable bytes."""
        if self._env is None:
            raise InvalidArgumentError("this rollout loop has no environment to load a trajectories' state into")
        self._env.loads(data)

    async def close(self) -> None:
        """Cancels the environment steps still running (the end of a run: a state saved before keeps their
        turns, which a resumed run hands to the environment again)."""
        if self._env is not None:
            await self._env.close()

    # ------------------------------------------------------------------ rewards

    def _start_reward(self, group: CompletedGroup) -> None:
        task = self._scoring.start(group)
        if self.deterministic:
            self._reward_order.append((group, task))

    def _report_in_order(self, *, until_done: bool) -> None:
        """deterministic: reports the rewards computed so far in the order the groups completed, up to the first
        group still being scored (until_done: and no further once the step is done; the rest are reported
        before the next step begins)."""
        order = self._reward_order
        while order and order[0][1].done() and not (until_done and self.scheduler.step_done):
            group, task = order.popleft()
            if task.cancelled() or task.exception() is not None:
                continue  # its failure is raised by _raise_failures
            self._report(group, *task.result())

    async def _group_rewards(self, group: CompletedGroup) -> list[float]:
        """A multi-turn group's rewards are its trajectories' final ones; else reward_fn's."""
        if self._env is None:
            return await self._scoring.score_group(group.prompt, group.responses)
        rewards = self._env.rewards(group.sample_ids)
        self._env.forget_group(group.group_id)
        return rewards

    def _report(self, group: CompletedGroup, values: list[float], accepted: bool) -> None:
        self.scheduler.report_rewards(group.group_id, values, accepted)

    # ------------------------------------------------------------------ helpers

    def _engine_steps(self) -> int:
        steps = getattr(self.engine.stats(), "steps", 0)
        return steps if isinstance(steps, int) else 0

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _wait(self) -> None:
        """Until the next stream event, reward or released engine step (what came before is handled: the caller did
        not await since it looked)."""
        assert self._wake is not None
        self._wake.clear()
        await self._wake.wait()

    def _account(self, now: float) -> None:
        elapsed = now - self._last_change
        self._area += self._inflight * elapsed
        if self._env is not None and self._env.pending:
            self._tool_area += elapsed
            if self._inflight == 0:
                self._idle_tool_area += elapsed
        self._last_change = now

    def _raise_failures(self) -> None:
        if self._env is not None and self._env.failures:
            self._failures += self._env.failures
            self._env.failures.clear()
        raise_first(self._failures)


def _split(events: list[_E], held: set[int]) -> tuple[list[_E], list[_E]]:
    """(events of the held samples, the others), each in order."""
    return [e for e in events if e[0] in held], [e for e in events if e[0] not in held]


__all__ = ["GroupFilter", "RewardFn", "RolloutLoop", "RolloutMetrics", "RolloutResult", "tail_latency"]
