"""RolloutLoop: one asyncio loop that drives the Scheduler over any RolloutEngine, one step at a time.

Per step: dispatch (buffered partials first, then new groups), stream chunks into the scheduler (batched
per wake-up), reward each group as it completes (reward functions run as tasks, so a slow one never holds
up the loop), apply the group filter, abort everything still running once N groups are accepted, hand the
abort results (partial tokens) back to the scheduler and take the batch.

APRIL and the synchronous baseline are this same code: the baseline is a scheduler with
over_sampling_batch_size == rollout_batch_size, so nothing is left running when N groups are accepted
and nothing is aborted (see :func:`scheduler_config_for`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from april_ext.batch import FinishReason, TrainingBatch
from april_ext.data_source import Prompt
from april_ext.errors import InternalError, InvalidArgumentError
from april_ext.protocol.reward import score_group
from april_ext.protocol.rollout_engine import Clock, RolloutEngine, engine_clock
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.scheduler import (
    CompletedGroup,
    GenerationRequest,
    Scheduler,
    SchedulerConfig,
)

RewardFn = Callable[[Prompt, np.ndarray], "float | Awaitable[float]"]
"""Scores one response (token ids) of a prompt; may be a plain function (run in a worker thread) or async."""
GroupFilter = Callable[[Sequence[float]], bool]
"""Decides from a group's rewards whether it is trained on (True) or dropped (e.g. DAPO dynamic sampling)."""


@dataclass(frozen=True)
class RolloutMetrics:
    """What one rollout step did, timed with the loop's clock (the engine's, for a simulated engine)."""

    policy_version: int
    wall_s: float
    """From begin_step to the batch in hand."""
    time_to_done_s: float
    """From begin_step until N groups were accepted (the abort is issued right then)."""
    generated_tokens: int
    """Response tokens the engine produced during the step (streamed and in abort results)."""
    tokens_per_s: float
    requests: int
    resumed_requests: int
    aborted_samples: int
    mean_inflight_samples: float
    occupancy: float
    """mean_inflight_samples / capacity (the engine's concurrency, else the scheduler's dispatch cap)."""
    batch_groups: int
    reward_mean: float
    response_lens: list[int]
    engine_steps: int
    """Model steps (iterations) the engine ran during the step, when its stats() count them (EngineStats.steps);
    else 0. generated_tokens / engine_steps is the mean batch: a throughput figure that no machine load moves."""
    scheduler: dict[str, Any] = field(default_factory=dict)
    """Scheduler.stats() after the step (partial / off-policy ratios, buffered and surplus groups, ...)."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RolloutResult:
    batch: TrainingBatch
    metrics: RolloutMetrics


@dataclass
class _Stream:
    request: GenerationRequest
    request_id: str
    received: int = 0
    ended: FinishReason | None = None


class RolloutLoop:
    """Drives ``scheduler`` over ``engine``. One step at a time; call from a single event loop.

    reward_fn(prompt, response_ids) -> float scores each sample; a plain function runs in a worker
    thread (one call per group), an ``async def`` function is awaited; a reward_fn with an async
    ``score_group(prompt, responses) -> list[float]`` method is called once per group instead.
    group_filter(rewards) -> bool keeps or drops a rewarded group. sampling is the template of every request (its max_new_tokens is
    replaced by the scheduler's budget and its seed by a per-sample seed derived from ``seed``, so a
    resumed sample continues the same random stream). clock: see :func:`engine_clock`.
    engine_capacity: how many requests the engine runs at once, for the occupancy metric.

    Groups whose rewards are still being computed when the step ends are not waited for: their
    rewards reach the scheduler whenever they are ready (surplus for a later step). Call
    :meth:`drain_rewards` before saving the scheduler so that none is in flight.
    """

    def __init__(self, engine: RolloutEngine, scheduler: Scheduler, reward_fn: RewardFn, *,
                 sampling: SamplingParams | None = None, group_filter: GroupFilter | None = None,
                 seed: int = 0, clock: Clock | None = None, engine_capacity: int | None = None,
                 request_prefix: str = "april") -> None:
        if not isinstance(engine, RolloutEngine):
            raise InvalidArgumentError(
                f"engine is a {type(engine).__name__}; a RolloutEngine needs generate, abort, update_weights, "
                f"release_memory, resume_memory, stats and health")
        if not isinstance(scheduler, Scheduler):
            raise InvalidArgumentError(f"scheduler is a {type(scheduler).__name__}; a Scheduler is required")
        if not callable(reward_fn):
            raise InvalidArgumentError(f"reward_fn={reward_fn!r} is not callable")
        if engine_capacity is not None and (not isinstance(engine_capacity, int) or engine_capacity < 1):
            raise InvalidArgumentError(f"engine_capacity={engine_capacity!r} is not allowed: None or an int >= 1")
        if not isinstance(seed, int) or seed < 0:
            raise InvalidArgumentError(f"seed={seed!r} is not allowed: an int >= 0")
        self.engine = engine
        self.scheduler = scheduler
        self.reward_fn = reward_fn
        self.group_filter = group_filter
        self.sampling = sampling or SamplingParams()
        self.clock = engine_clock(engine, clock)
        cfg = scheduler.config
        caps = [c for c in (cfg.max_inflight_samples, cfg.target_inflight_samples) if c is not None]
        self.capacity = engine_capacity or (
            min(caps) if caps else cfg.over_sampling_batch_size * cfg.n_samples_per_prompt)
        self._seed = seed
        self._prefix = request_prefix
        self._async_reward = inspect.iscoroutinefunction(reward_fn) or \
            inspect.iscoroutinefunction(getattr(reward_fn, "__call__", None))
        self._ids = itertools.count()
        self._reward_tasks: set[asyncio.Task[None]] = set()
        self._failures: list[BaseException] = []
        self._wake: asyncio.Event | None = None
        self._streams: dict[int, _Stream] = {}
        self._stream_tasks: set[asyncio.Task[None]] = set()
        self._token_events: list[tuple[int, list[int], list[float], int]] = []
        self._finish_events: list[tuple[int, FinishReason]] = []
        self._aborting = False
        self._inflight = 0
        self._area = 0.0
        self._last_change = 0.0
        self._generated = 0

    # ------------------------------------------------------------------ public

    @property
    def pending_rewards(self) -> int:
        """Reward tasks still running (groups that completed but are not rewarded yet)."""
        return len(self._reward_tasks)

    async def run_step(self, policy_version: int) -> RolloutResult:
        """Generates until N groups are accepted (or data runs out), aborts the rest, returns the batch."""
        sched = self.scheduler
        self._wake = asyncio.Event()
        self._aborting = False
        self._generated = 0
        self._area = 0.0
        sched.begin_step(policy_version)
        engine_steps = self._engine_steps()
        start = self._last_change = self.clock()
        requests = resumed = 0
        while True:
            self._raise_failures()
            self._flush()
            for group in sched.pop_completed_groups():
                self._start_reward(group)
            if sched.step_done:
                break
            for request in sched.dispatch():
                requests += 1
                resumed += request.is_resume
                self._start_stream(request)
            if not self._stream_tasks and not self._reward_tasks and not sched.step_done:
                raise InternalError(f"rollout loop stalled: nothing running, no reward pending and the step "
                                    f"is not done (scheduler stats: {sched.stats()})")
            self._wake.clear()
            await self._wake.wait()
        done_at = self.clock()
        aborted = await self._abort_running()
        batch = sched.take_batch()
        end = self.clock()
        self._account(end)
        wall = end - start
        metrics = RolloutMetrics(
            policy_version=policy_version, wall_s=wall, time_to_done_s=done_at - start,
            generated_tokens=self._generated, tokens_per_s=self._generated / wall if wall > 0 else 0.0,
            requests=requests, resumed_requests=resumed, aborted_samples=aborted,
            mean_inflight_samples=self._area / wall if wall > 0 else 0.0,
            occupancy=self._area / wall / self.capacity if wall > 0 else 0.0,
            batch_groups=batch.n_groups,
            reward_mean=float(batch.rewards.mean()) if batch.n_samples else math.nan,
            response_lens=batch.response_lens.tolist(), engine_steps=self._engine_steps() - engine_steps,
            scheduler=sched.stats())
        return RolloutResult(batch, metrics)

    async def drain_rewards(self) -> None:
        """Waits for every pending reward task (its rewards reach the scheduler); raises the first failure."""
        while self._reward_tasks:
            await asyncio.wait(set(self._reward_tasks))
        self._raise_failures()

    # ------------------------------------------------------------------ streams

    def _seed_of(self, sample_id: int) -> int:
        return (self._seed * 1_000_003 + sample_id * 7919) % (2**31 - 1)

    def _start_stream(self, request: GenerationRequest) -> None:
        stream = _Stream(request, f"{self._prefix}-{request.sample_id}-{next(self._ids)}")
        self._streams[request.sample_id] = stream
        self._account(self.clock())
        self._inflight += 1
        task = asyncio.create_task(self._run_stream(stream))
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
        params = replace(self.sampling, max_new_tokens=request.max_new_tokens, seed=self._seed_of(sid))
        async for chunk in self.engine.generate(request.input_ids.tolist(), params, stream.request_id):
            if chunk.token_ids:
                self._token_events.append((sid, list(chunk.token_ids), list(chunk.logprobs), chunk.weight_version))
                stream.received += len(chunk.token_ids)
                self._generated += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                stream.ended = FinishReason(chunk.finish_reason)
                break
            self._notify()
        if stream.ended is None:
            stream.ended = FinishReason.ABORT
        # An abort we issued is reported with the abort results (they may carry tokens the stream lacks).
        if not (self._aborting and stream.ended == FinishReason.ABORT):
            self._finish_events.append((sid, stream.ended))
            del self._streams[sid]
        self._notify()

    async def _abort_running(self) -> int:
        """Aborts every sample the scheduler no longer needs and delivers their partial outputs."""
        to_abort = set(self.scheduler.samples_to_abort())
        if not self._stream_tasks:
            self._flush()
            return 0
        self._aborting = True
        # The loop owns the engine during a step: every request still running belongs to this step.
        outputs = await self.engine.abort(None)
        by_request = {o.request_id: o for o in outputs}
        while self._stream_tasks:
            await asyncio.wait(set(self._stream_tasks))
        self._raise_failures()
        aborted = 0
        for sid, stream in list(self._streams.items()):
            output = by_request.get(stream.request_id)
            if output is not None and len(output.token_ids) > stream.received:
                self._push_tail(sid, output.token_ids[stream.received:], output.logprobs[stream.received:],
                                output.versions[stream.received:])
            self._finish_events.append((sid, FinishReason.ABORT))
            aborted += sid in to_abort
            del self._streams[sid]
        self._aborting = False
        self._flush()
        return aborted

    def _push_tail(self, sid: int, tokens: Sequence[int], logprobs: Sequence[float], versions: Sequence[int]) -> None:
        """Tokens of an abort result that the stream had not delivered, one event per version run."""
        start = 0
        for i in range(1, len(tokens) + 1):
            if i == len(tokens) or versions[i] != versions[start]:
                self._token_events.append((sid, list(tokens[start:i]), list(logprobs[start:i]), int(versions[start])))
                start = i
        self._generated += len(tokens)

    def _flush(self) -> None:
        """Hands the collected chunks and finishes to the scheduler in two batched calls."""
        if self._token_events:
            events, self._token_events = self._token_events, []
            sids = [e[0] for e in events]
            counts = [len(e[1]) for e in events]
            total = sum(counts)
            tokens = np.fromiter(itertools.chain.from_iterable(e[1] for e in events), np.int32, total)
            logprobs = np.fromiter(itertools.chain.from_iterable(e[2] for e in events), np.float32, total)
            self.scheduler.on_tokens_batch(sids, counts, tokens, logprobs, [e[3] for e in events])
        if self._finish_events:
            events, self._finish_events = self._finish_events, []
            self.scheduler.on_finish_batch([e[0] for e in events], [int(e[1]) for e in events])

    # ------------------------------------------------------------------ rewards

    def _start_reward(self, group: CompletedGroup) -> None:
        task = asyncio.create_task(self._reward(group))
        self._reward_tasks.add(task)
        task.add_done_callback(self._reward_done)

    def _reward_done(self, task: asyncio.Task[None]) -> None:
        self._reward_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._failures.append(task.exception())  # type: ignore[arg-type]
        self._notify()

    async def _reward(self, group: CompletedGroup) -> None:
        score_whole_group = getattr(self.reward_fn, "score_group", None)
        if score_whole_group is not None:  # a group-level reward (training.hooks) schedules its own calls
            rewards = await score_whole_group(group.prompt, group.responses)
        elif self._async_reward:
            rewards = list(await asyncio.gather(*(self.reward_fn(group.prompt, r) for r in group.responses)))
        else:
            rewards = await asyncio.to_thread(score_group, self.reward_fn, group.prompt, group.responses)
        values = [float(r) for r in rewards]  # type: ignore[arg-type]
        accepted = True if self.group_filter is None else bool(self.group_filter(values))
        self.scheduler.report_rewards(group.group_id, values, accepted)

    # ------------------------------------------------------------------ helpers

    def _engine_steps(self) -> int:
        steps = getattr(self.engine.stats(), "steps", 0)
        return steps if isinstance(steps, int) else 0

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _account(self, now: float) -> None:
        self._area += self._inflight * (now - self._last_change)
        self._last_change = now

    def _raise_failures(self) -> None:
        if self._failures:
            failure = self._failures[0]
            self._failures.clear()
            raise failure


def scheduler_config_for(config: SchedulerConfig, partial_rollout: bool) -> SchedulerConfig:
    """The scheduler settings of a run: APRIL as configured, or the synchronous baseline (N' = N with
    batch refill: every launched group runs to completion, nothing is aborted or carried over)."""
    if not isinstance(partial_rollout, bool):
        raise InvalidArgumentError(f"partial_rollout={partial_rollout!r} is not allowed: True or False")
    if partial_rollout:
        return config
    # Batch refill: a wave of N groups, no top-ups, so nothing is still running when N are accepted.
    return replace(config, over_sampling_batch_size=config.rollout_batch_size, refill="batch", over_sampling="fixed",
                   target_inflight_samples=None)


__all__ = ["GroupFilter", "RewardFn", "RolloutLoop", "RolloutMetrics", "RolloutResult", "scheduler_config_for"]
