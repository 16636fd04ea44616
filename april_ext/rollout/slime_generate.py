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

:class:`Sample` has slime's field names (``slime.utils.types.Sample``), with the nested ``Status`` enum. A
function that imports ``slime.utils.types.Sample`` needs slime installed; one that reaches the enum through the
sample (``sample.Status.ABORTED`` or ``type(sample).Status``) runs with ours as with slime's.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib
import inspect
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from april_ext.errors import ConfigError, InternalError, InvalidArgumentError, InvalidStateError
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.rollout.loop import GroupFilter, RewardFn, RolloutMetrics, RolloutResult, tail_latency
from april_ext.scheduler import CompletedGroup, GenerationRequest, Scheduler, SchedulerConfig

GenerateFn = Callable[..., Awaitable[Any]]
"""``async def generate(args, sample, sampling_params[, evaluation=...]) -> Sample | [Sample]``."""


@dataclass
class Sample:
    """One rollout sample with slime's field names and types (``slime.utils.types.Sample``). The fields the
    rollout reads back are tokens, response_length, loss_mask, rollout_log_probs, status and reward; the others
    are kept on the object between the calls of one sample (a resumed call gets the object its last call
    returned, when nothing of it was cut)."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Sample.Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    generate_function_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @property
    def effective_response_length(self) -> int:
        """The trained response tokens (loss mask 1), as slime counts them."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length


# ----------------------------------------------------------------------------------------------------- args


def slime_args(url: str, config: SchedulerConfig, sampling: SamplingParams | None = None, *, seed: int = 0,
               reward_key: str | None = None, **custom: Any) -> argparse.Namespace:
    """The ``args`` a generate function reads, with slime's names, from our settings: the server (``url``: the
    router, or the one server, that the function posts to), the scheduler's batch shape and response cap, and
    the sampling settings. ``partial_rollout`` is True when the scheduler over-samples (N' > N: unfinished
    samples are aborted and resumed), False for the synchronous baseline. ``custom`` adds attributes of the
    function's own (slime's ``--custom-config-path``), e.g. a tool's latency."""
    if not isinstance(config, SchedulerConfig):
        raise InvalidArgumentError(f"config is a {type(config).__name__}; a SchedulerConfig is required")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme != "http" or not parts.hostname or parts.port is None or parts.path.strip("/"):
        raise InvalidArgumentError(f"url={url!r} is not allowed: http://HOST:PORT of the router or server the "
                                   f"function posts /generate to")
    sampling = sampling or SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgumentError(f"sampling is a {type(sampling).__name__}; a SamplingParams is required")
    if reward_key is not None and not isinstance(reward_key, str):
        raise InvalidArgumentError(f"reward_key={reward_key!r} is not allowed: None or the key of a dict reward")
    for name in custom:
        if not name.isidentifier():
            raise InvalidArgumentError(f"custom arg {name!r} is not allowed: an identifier (an attribute of args)")
    return argparse.Namespace(
        sglang_router_ip=parts.hostname, sglang_router_port=parts.port,
        rollout_batch_size=config.rollout_batch_size, n_samples_per_prompt=config.n_samples_per_prompt,
        over_sampling_batch_size=config.over_sampling_batch_size,
        partial_rollout=config.over_sampling_batch_size > config.rollout_batch_size,
        mask_offpolicy_in_partial_rollout=config.mask_offpolicy,
        rollout_max_response_len=config.max_response_len, rollout_temperature=sampling.temperature,
        rollout_top_p=sampling.top_p, rollout_top_k=sampling.top_k, rollout_stop=None,
        rollout_stop_token_ids=list(sampling.stop_token_ids) or None, rollout_skip_special_tokens=False,
        rollout_seed=seed, custom_generate_function_path=None, group_rm=False, reward_key=reward_key,
        **custom)


def sampling_params_of(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling_params dict slime hands a generate function (a fresh copy per call): max_new_tokens is the
    whole response cap; a function that resumes subtracts what the sample already has."""
    return {"temperature": args.rollout_temperature, "top_p": args.rollout_top_p, "top_k": args.rollout_top_k,
            "max_new_tokens": args.rollout_max_response_len, "stop": args.rollout_stop,
            "stop_token_ids": args.rollout_stop_token_ids,
            "skip_special_tokens": args.rollout_skip_special_tokens, "no_stop_trim": True,
            "spaces_between_special_tokens": False}


# ------------------------------------------------------------------------------------------------- loading


def load_generate_function(path: str) -> GenerateFn:
    """The function at ``path``: slime's form ``"pkg.module.fn"``, or ``"pkg.module:fn"``. The module must be
    importable (on sys.path: slime takes no file paths either). Raises ConfigError naming the path and what was
    wrong: not importable, no such attribute, not an async function, or a signature that does not take
    (args, sample, sampling_params)."""
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"custom generate function path {path!r} is not allowed: 'pkg.module.fn' or "
                          f"'pkg.module:fn'")
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not attr.isidentifier():
        raise ConfigError(f"custom generate function path {path!r} is not allowed: 'pkg.module.fn' or "
                          f"'pkg.module:fn' (a module on sys.path and a function in it)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"custom generate function {path!r}: module {module_name!r} cannot be imported ({exc}); "
                          f"it must be on sys.path (PYTHONPATH)") from exc
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"custom generate function {path!r}: module {module_name!r} has no attribute {attr!r}")
    try:
        check_generate_function(fn)
    except InvalidArgumentError as exc:
        raise ConfigError(f"custom generate function {path!r}: {exc}") from None
    return fn


def check_generate_function(fn: Any) -> bool:
    """Checks fn against slime's contract; returns whether it takes ``evaluation=`` (slime passes it then).
    Raises InvalidArgumentError for a non-callable, a sync function, or a wrong signature."""
    if not callable(fn):
        raise InvalidArgumentError(f"{fn!r} is not callable: an async def generate(args, sample, sampling_params)")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
        raise InvalidArgumentError(f"{_name(fn)} is not an async function: slime awaits "
                                   f"generate(args, sample, sampling_params), so it must be 'async def'")
    try:
        signature = inspect.signature(fn)
        signature.bind(None, None, None)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"{_name(fn)} has signature {_signature(fn)}: it must take (args, sample, "
                                   f"sampling_params) and optionally evaluation=") from exc
    return "evaluation" in signature.parameters  # slime's test: a **kwargs function is not given it either


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _signature(fn: Any) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(unknown)"


# ------------------------------------------------------------------------------------------------- replay

_FINISH = {"COMPLETED": "stop", "TRUNCATED": "length", "ABORTED": "abort", "FAILED": "stop"}


@dataclass
class _Replay:
    """What one returned call still has to hand to the scheduler: runs of (model?, tokens, logprobs), then the
    finish ("stop", "length" or "abort") and the function's reward (None: reward_fn's)."""

    runs: deque[tuple[bool, list[int], list[float]]]
    finish: str
    reward: float | None
    sample: Any


@dataclass
class _Call:
    request: GenerationRequest
    task: asyncio.Task[Any]


class CustomGenerateRollout:
    """Drives ``scheduler`` with a slime generate function, one step at a time; call from one event loop.

    generate_fn: the function or its path (:func:`load_generate_function`). engine: the SGLang adapter
    (april_ext.sglang.SGLangEngine) of the servers the function posts to; its ``worker_urls()`` are the servers
    aborted at the step's end (every request on them: the function's requests are not the adapter's, so
    ``engine.abort(None)`` would not reach them). args: slime's args (:func:`slime_args`); by default built from
    the engine's router_url, or its one worker, and the scheduler's config and ``sampling``. reward_fn(prompt,
    response_ids) -> float scores the samples whose function set no reward (plain: run in a worker thread, or
    async); group_filter(rewards) -> bool keeps or drops a group. decode(token_ids) -> str fills
    ``sample.prompt`` and, for a resumed sample rebuilt from the scheduler, ``sample.response`` (else "").
    abort_resend_s: the servers' abort is sent again this often while calls are still out (a call may post a
    new /generate after the abort, between its turns); abort_timeout_s: the most a step waits for its calls to
    return (InvalidStateError past it).

    Refused scheduler settings (ConfigError): step_boundary="carry" (the calls own their requests; nothing can
    hold them in place), chunk_tokens (the function decides its turns' lengths) and tail_extra_samples (they
    abort single samples mid-step)."""

    def __init__(self, generate_fn: GenerateFn | str, scheduler: Scheduler, engine: Any,
                 args: argparse.Namespace | None = None, *, reward_fn: RewardFn | None = None,
                 group_filter: GroupFilter | None = None, sampling: SamplingParams | None = None,
                 decode: Callable[[list[int]], str] | None = None, abort_resend_s: float = 0.05,
                 abort_timeout_s: float = 60.0) -> None:
        if isinstance(generate_fn, str):
            generate_fn = load_generate_function(generate_fn)
        self._takes_evaluation = check_generate_function(generate_fn)
        if not isinstance(scheduler, Scheduler):
            raise InvalidArgumentError(f"scheduler is a {type(scheduler).__name__}; a Scheduler is required")
        if not callable(getattr(engine, "worker_urls", None)):
            raise InvalidArgumentError(f"engine is a {type(engine).__name__}; an SGLangEngine (with worker_urls()) "
                                       f"of the servers the function posts to is required")
        cfg = scheduler.config
        refused = [f"{name}={value!r}" for name, value, ok in (
            ("step_boundary", cfg.step_boundary, cfg.step_boundary == "abort"),
            ("chunk_tokens", cfg.chunk_tokens, cfg.chunk_tokens is None),
            ("tail_extra_samples", cfg.tail_extra_samples, cfg.tail_extra_samples == 0)) if not ok]
        if refused:
            raise ConfigError(f"a custom generate function runs with step_boundary='abort', chunk_tokens=None and "
                              f"tail_extra_samples=0; got {', '.join(refused)}")
        for name, fn in (("reward_fn", reward_fn), ("group_filter", group_filter), ("decode", decode)):
            if fn is not None and not callable(fn):
                raise InvalidArgumentError(f"{name}={fn!r} is not callable")
        for name, value in (("abort_resend_s", abort_resend_s), ("abort_timeout_s", abort_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise InvalidArgumentError(f"{name}={value!r} is not allowed: a positive finite number of seconds")
        if args is None:
            args = slime_args(_url_of(engine), cfg, sampling)
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
        self._async_reward = inspect.iscoroutinefunction(reward_fn) or \
            inspect.iscoroutinefunction(getattr(reward_fn, "__call__", None))
        self._calls: dict[int, _Call] = {}
        self._returned: list[int] = []
        self._replays: dict[int, _Replay] = {}
        self._partials: dict[int, Any] = {}  # the returned sample of an ABORTED call, replayed whole
        self._rewards: dict[int, float | None] = {}
        self._reward_tasks: set[asyncio.Task[None]] = set()
        # The verdict that would end the step waits (with any after it) until every call is back and replayed
        # whole: once the step is done the scheduler dispatches nothing, and a call's later turns need dispatches.
        self._held: list[tuple[int, list[float], bool]] | None = None
        self._accepted: set[int] = set()  # groups reported accepted, not trained or dropped: the step's end
        self._ending_at: float | None = None
        self._failures: list[BaseException] = []
        self._wake: asyncio.Event | None = None
        self._http: aiohttp.ClientSession | None = None
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
            self._raise_failures()
            self._replay_returned(policy_version)
            for group in sched.pop_completed_groups():
                self._start_reward(group)
            if sched.step_done:
                break
            if self._held is not None:
                await self._end_calls(policy_version)
                self._release_held()
                continue  # done now, unless the prediction was wrong (then the step goes on)
            if self._dispatch(policy_version):
                continue  # replayed turns queued their samples again: dispatch them before waiting
            if not self._calls and not self._reward_tasks:
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
        wall = end - start
        counts = self._counts
        metrics = RolloutMetrics(
            policy_version=policy_version, wall_s=wall, time_to_done_s=done_at - start,
            generated_tokens=int(counts["generated"]), tokens_per_s=counts["generated"] / wall if wall > 0 else 0.0,
            requests=int(counts["requests"]), resumed_requests=int(counts["resumed"]),
            aborted_samples=int(counts["aborted"]),
            mean_inflight_samples=self._inflight_area / wall if wall > 0 else 0.0,
            occupancy=self._inflight_area / wall / self.capacity if wall > 0 else 0.0,
            batch_groups=batch.n_groups,
            reward_mean=float(batch.rewards.mean()) if batch.n_samples else math.nan,
            response_lens=batch.response_lens.tolist(), engine_steps=0,
            tail_share=_tail_share(self._finished_at, start, done_at), scheduler=sched.stats(),
            env={k: float(counts[k]) for k in ("env_runs", "env_tokens", "replay_dispatches",
                                                "discarded_model_tokens", "discarded_env_tokens")})
        return RolloutResult(batch, metrics)

    @property
    def pending_rewards(self) -> int:
        return len(self._reward_tasks)

    async def drain_rewards(self) -> None:
        """Waits for every reward still being computed (groups completed after their step's batch was taken);
        raises the first failure."""
        while self._reward_tasks:
            await asyncio.wait(set(self._reward_tasks))
        self._raise_failures()

    def environment_state(self) -> None:
        """Nothing to save beside the scheduler's state: a call's partial is the scheduler's (a resumed run
        rebuilds the sample from it)."""
        return None

    async def abort_carried(self) -> None:
        """Nothing is carried between steps (step_boundary is 'abort')."""

    async def close(self) -> None:
        """Closes the abort connection (the end of a run)."""
        if self._http is not None:
            await self._http.close()
            self._http = None

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
        if self._http is None:
            self._http = aiohttp.ClientSession()
        urls = await self.engine.worker_urls()
        deadline = time.monotonic() + self.abort_timeout_s
        while self._calls:
            await asyncio.gather(*(self._post_abort(url) for url in urls))
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

    async def _post_abort(self, url: str) -> None:
        assert self._http is not None
        async with self._http.post(f"{url}/abort_request", json={"rid": "", "abort_all": True}) as resp:
            if resp.status != 200:
                raise InvalidStateError(f"{url}/abort_request answered {resp.status}: {await resp.text()}")

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
            replay = self._parse(call.request, call.task.result())
            if replay.finish == "abort":
                aborted.add(sid)
            self._advance(sid, replay, version)
        return aborted

    def _parse(self, request: GenerationRequest, result: Any) -> _Replay:
        """Checks a call's result against the tokens it was given and splits its new tokens into runs."""
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
        runs: deque[tuple[bool, list[int], list[float]]] = deque()
        for token, m, x in zip(tokens[len(given):], new_mask, new_logprobs, strict=True):
            if runs and runs[-1][0] == bool(m):
                runs[-1][1].append(token)
                runs[-1][2].append(x)
            else:
                runs.append((bool(m), [token], [x]))
        room = self.scheduler.config.max_response_len - known
        runs, cut = _cut_runs(runs, room)
        if cut:
            self._discard(cut)
            finish = "length"  # the scheduler's cap: what goes past it is not kept
        if finish != "abort":
            # A finished trajectory's tool output after its last model token trains nothing; the scheduler ends a
            # sample at a model token (or in its environment's wait), so it is not kept.
            while runs and not runs[-1][0]:
                self._discard([runs.pop()])
        if runs and not runs[0][0] and not self._ends_with_model_token(sid, known):
            raise InvalidArgumentError(f"{where}: tool tokens (loss_mask 0) must follow a model token; the "
                                       f"response {'is empty' if known == 0 else 'ends with tool tokens'} before "
                                       f"them")
        reward = None if finish == "abort" else _reward_value(result.reward, self.args, where, status)
        return _Replay(runs, finish, reward, result)

    def _ends_with_model_token(self, sample_id: int, known: int) -> bool:
        if known == 0:
            return False
        env = self.scheduler.sample(sample_id).env_mask
        return env is None or not env[-1]

    def _advance(self, sample_id: int, replay: _Replay, version: int) -> None:
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

    def _discard(self, runs: Sequence[tuple[bool, list[int], list[float]]]) -> None:
        for is_model, tokens, _ in runs:
            self._counts["discarded_model_tokens" if is_model else "discarded_env_tokens"] += len(tokens)

    def _forget_finished(self) -> None:
        """Drops the kept rewards and partials of samples the scheduler no longer holds as done or queued."""
        held = set(self.scheduler.sample_ids("done")) | set(self.scheduler.sample_ids("queued"))
        self._rewards = {s: r for s, r in self._rewards.items() if s in held}
        self._partials = {s: p for s, p in self._partials.items() if s in held}

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
        """The function's rewards, reward_fn's for the samples without one, then the filter's verdict."""
        rewards: list[float] = []
        for sid, response in zip(group.sample_ids.tolist(), group.responses, strict=True):
            value = self._rewards.pop(sid, None)
            if value is None:
                if self.reward_fn is None:
                    raise InvalidArgumentError(f"sample {sid} finished without a reward (sample.reward None) and "
                                               f"no reward_fn was given")
                value = await self.reward_fn(group.prompt, response) if self._async_reward else \
                    await asyncio.to_thread(self.reward_fn, group.prompt, response)
            rewards.append(float(value))  # type: ignore[arg-type]
        accepted = True if self.group_filter is None else bool(self.group_filter(rewards))
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

    def _raise_failures(self) -> None:
        if self._failures:
            failure = self._failures[0]
            self._failures.clear()
            raise failure


def _cut_runs(runs: deque[tuple[bool, list[int], list[float]]], room: int
              ) -> tuple[deque[tuple[bool, list[int], list[float]]], list[tuple[bool, list[int], list[float]]]]:
    """(the runs within ``room`` tokens, the tokens past it as runs)."""
    kept: deque[tuple[bool, list[int], list[float]]] = deque()
    cut: list[tuple[bool, list[int], list[float]]] = []
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


def _url_of(engine: Any) -> str:
    """The one address a generate function posts to: the adapter's router, or its only worker."""
    config = getattr(engine, "config", None)
    router = getattr(config, "router_url", None)
    workers = tuple(getattr(config, "worker_urls", ()) or ())
    if router:
        return str(router)
    if len(workers) == 1:
        return str(workers[0])
    raise ConfigError(f"a generate function posts to one address (slime's router): the engine has "
                      f"{len(workers)} worker urls and no router_url; give it a router_url, or pass "
                      f"args=slime_args(url, ...)")


def _tail_share(finished_at: list[float], start: float, done_at: float) -> float:
    """tail_latency of the samples finished by done_at (RolloutMetrics.tail_share); 0 with fewer than two."""
    times = [t for t in finished_at if t <= done_at]
    if len(times) < 2 or done_at <= start:
        return 0.0
    return tail_latency(np.asarray(times), start, done_at)


__all__ = ["CustomGenerateRollout", "GenerateFn", "Sample", "check_generate_function", "load_generate_function",
           "sampling_params_of", "slime_args"]
