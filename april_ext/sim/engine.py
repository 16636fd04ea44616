"""SimulatedEngine: the RolloutEngine API (as april_ext.engine.AsyncEngine) over replicas on a virtual clock.

Virtual time advances only when the rollout loop has consumed everything delivered so far: every open
stream is drained and its consumer waits for more, no call arrived while the engine let the event loop
run ``settle_passes`` more rounds, and no memory tag is released. Then the engine jumps to the earliest
event of any replica (finish, KV full), so a step of 512 responses x 16K tokens takes a few thousand
events, not millions of token steps. A request receives its tokens in few chunks: at finish, at abort,
and when a weight update flushes it (chunks never mix versions).

A sample's length is drawn once, when the engine first sees it; a resumed request (prompt + partial response,
exactly as aborted) continues it to the same target (samples.py).

``pause_generation("in_place")`` holds the running requests with their KV (also across update_weights, after
which they continue under the new version) until ``continue_generation``; the clock stands still meanwhile. On
a colocated cluster the held KV is copied to host memory at the pause and back before decoding continues, and
the clock moves on by the copy (every replica copies its own KV; the slowest sets the time).
``pause_generation("retract")`` frees the KV instead: the requests are recomputed when they continue.

A request that ends at its token budget below the sample's natural length (finish reason "length") may be
continued (a divided rollout's chunk boundary): a request whose ids are exactly its prompt + response so far
continues the same sample. Under the weight version it ended at, it is a continuation; later, a resume (as the
scheduler counts it: its prefix is no cache hit under other weights). A continuation goes to the replica with the
fewest KV tokens in use or waiting, and is prefilled there unless that replica still caches its prefix
(replica.py); landing elsewhere it pays the prefill of prompt + partial response (the price of balancing the load
by moving it).

With a TurnModel (turns.py) as the length model, each sample is a multi-turn trajectory. At the end of a model
turn the request leaves its replica (no decode slot, no KV held but an evictable prefix-cache entry of its
context) and waits on its tool call for the call's latency on the virtual clock; the engine delivers the turn's
tokens at once. Then the observation tokens join its context (env tokens: prefilled, never delivered, so never
generated or trained) and the next turn queues on the same replica, prefilling only the observation when the
context is still cached. An abort during a tool call ends the request but not the tool: the resumed request waits
for what is left of the latency, then prefills prompt + partial response + every observation so far.
The engine remembers when each request finished, keyed by its full ids (``finish_time``), for the
tail latency. Its counters (counters.py) sum its replicas'.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections import deque
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from april_ext.batch import FinishReason
from april_ext.errors import ConfigError, InvalidArgumentError, InvalidStateError
from april_ext.protocol.engine_base import RequestStream, check_weight_version, generate_args, stream_until_finish
from april_ext.protocol.loop_task import LoopTaskEngine
from april_ext.protocol.memory_tags import memory_tags
from april_ext.protocol.outputs import EngineStats, GenerationChunk, GenerationOutput
from april_ext.protocol.request_ids import RequestIds, abort_ids
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.sim.cost import ClusterConfig
from april_ext.sim.counters import ClusterCounters
from april_ext.sim.lengths import LengthModel
from april_ext.sim.replica import Replica, ReplicaCounters, SimRequest, SimSample
from april_ext.sim.samples import SampleBook
from april_ext.sim.tokens import as_ids, response_logprobs, response_tokens
from april_ext.sim.turns import TurnModel

# The memory tags whose release the simulation models (protocol.memory_tags has the full list).
_SIMULATED_TAGS = ("weights", "kv_cache")


class _Stream:
    __slots__ = ("request", "items", "waiter")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.items: deque[GenerationChunk] = deque()
        self.waiter: asyncio.Future[None] | None = None


class SimulatedEngine(LoopTaskEngine):
    """A cluster of simulated engine replicas behind a router, with the AsyncEngine API and a virtual clock.

    Use ``async with SimulatedEngine(cluster, lengths) as engine:``; ``engine.clock()`` is the virtual time.
    """

    _task_name = "april_ext-sim-engine"

    def __init__(self, cluster: ClusterConfig, lengths: LengthModel, weight_version: int = 0,
                 settle_passes: int = 16) -> None:
        super().__init__()
        if not isinstance(cluster, ClusterConfig):
            raise ConfigError(f"cluster is a {type(cluster).__name__}; a ClusterConfig is required")
        if not isinstance(lengths, LengthModel):
            raise ConfigError(f"lengths is a {type(lengths).__name__}; a LengthModel (draw, natural_lengths) "
                              "is required")
        if not isinstance(settle_passes, int) or settle_passes < 1:
            raise ConfigError(f"settle_passes={settle_passes!r} is not allowed: an int >= 1")
        if isinstance(lengths, TurnModel) and cluster.cost.mixed_chunk:
            raise ConfigError(f"lengths is the agentic model {lengths.name!r} and the cluster runs mixed chunked "
                              "prefill: agentic turns are modelled with separate prefill only (mixed_chunk=False)")
        self.cluster = cluster
        self.lengths = lengths
        self.settle_passes = settle_passes
        self.replicas = [Replica(i, cluster.cost) for i in range(cluster.num_engines)]
        self.weight_version = weight_version
        self.now = 0.0
        self.paused_tags: set[str] = set()
        self._requests: dict[str, SimRequest] = {}
        self._streams: dict[str, _Stream] = {}
        self._waiting = 0  # open streams whose consumer waits for a chunk
        self._activity = 0  # bumped by every call and every consumer wait
        self._samples = SampleBook(lengths)
        self._ids = RequestIds("sim")
        self._rr = itertools.cycle(range(cluster.num_engines))
        self._delivered_tokens = 0
        self._paused: str | None = None  # pause_generation's mode while paused
        self._kv_copy_time = 0.0
        self._kv_copy_tokens = 0
        self._tools: list[tuple[float, int]] = []  # (result time, wait key) of tool calls, earliest first
        self._on_tool: dict[int, SimRequest] = {}  # wait key -> the request waiting on its tool call
        self._tool_keys = itertools.count()

    def clock(self) -> float:
        """Virtual seconds since the engine was created."""
        return self.now

    # ------------------------------------------------------------------ RolloutEngine API

    def generate(self, input_ids: Sequence[int] | np.ndarray, params: SamplingParams | None = None,
                 request_id: str | None = None) -> AsyncIterator[GenerationChunk]:
        """Streams the request's chunks until one carries a finish reason; leaving early aborts it."""
        return stream_until_finish(lambda: self._open(input_ids, params, request_id))

    async def _open(self, input_ids: Sequence[int] | np.ndarray, params: SamplingParams | None,
                    request_id: str | None) -> RequestStream:
        ids, params = generate_args(input_ids, params)
        self._require_running()
        rid = self._ids.claim(request_id, self._requests)
        request = self._new_request(rid, ids, params)
        stream = _Stream(request)
        self._requests[rid] = request
        self._streams[rid] = stream
        if request.sample.tool_ready_at > self.now:  # resumed while its tool still runs (aborted mid-call)
            self._wait_tool(request)
        else:
            self._route(request)
        self._notify()

        async def receive() -> GenerationChunk:
            while not stream.items:
                stream.waiter = asyncio.get_running_loop().create_future()
                self._waiting += 1
                self._notify()
                try:
                    await stream.waiter
                finally:
                    if stream.waiter is not None:  # cancelled while waiting: nobody woke it
                        stream.waiter = None
                        self._waiting -= 1
            item = stream.items.popleft()
            if item.finish_reason is not None:
                # Closed before the consumer sees the chunk, so the clock never waits on this stream.
                self._close_stream(rid)
            return item

        def abort() -> None:
            if rid in self._requests and not self._closing:
                self._abort_now([rid])

        return RequestStream(receive, abort, lambda: self._close_stream(rid))

    async def abort(self, request_ids: str | Iterable[str] | None = None) -> list[GenerationOutput]:
        """Ends the requests (all when None) at the current virtual time and returns their partial outputs;
        their streams end with an ABORT chunk carrying the tokens not yet delivered. Unknown ids raise
        UnknownIdError and nothing is aborted. The clock moves on by the cluster's abort latency when requests
        end (replicas with requests left keep decoding through it)."""
        ids = abort_ids(request_ids, self._requests)
        self._notify()
        outputs = self._abort_now(ids)
        if ids:
            self._stall(self.cluster.abort_latency_s)
        return outputs

    async def update_weights(self, weights: Any, version: int) -> list[str]:
        """Sets the weight version (the weights themselves are not simulated). Running requests deliver their
        tokens so far under the old version; paused in place they keep their KV and continue under the new
        version, otherwise they are recomputed (the cache is flushed, as SGLang's update does by default). The
        clock moves on by the cluster's weight-sync time."""
        check_weight_version(version)
        if "weights" in self.paused_tags:
            raise InvalidStateError("update_weights: the 'weights' tag is released; resume_memory first")
        if self._paused == "in_place":
            self._deliver_held()
        else:
            self._flush_all()
        if version != self.weight_version:
            for replica in self.replicas:
                replica.clear_prefix_cache()
        self.weight_version = version
        self._stall(self.cluster.weight_sync_s)
        self._notify()
        return list(weights) if isinstance(weights, dict) else []

    async def wait_until(self, t: float) -> None:
        """Nothing generates until virtual time ``t`` (an asynchronous run's rollout held back by its bound on how
        far it may run ahead of the trainer): the clock jumps there, every replica idle. Refused while requests
        run unpaused or wait on tools, whose progress over the jump would be lost; paused requests stay held."""
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
            raise InvalidArgumentError(f"wait_until: t={t!r} is not allowed: a finite number of virtual seconds")
        busy = self._on_tool or any(r.running or r.prefilling or r.waiting for r in self.replicas)
        if busy and self._paused is None:
            raise InvalidStateError("wait_until: requests are running; abort them or pause_generation first")
        self._notify()
        self._stall(t - self.now)

    async def pause_generation(self, mode: str = "in_place") -> None:
        """Holds every request (new ones wait) until continue_generation; the clock stands still meanwhile.
        "in_place": they keep their KV (backed up to host memory on a colocated cluster, the clock moving on by
        the copy); "retract": their KV is freed and they are recomputed when generation continues."""
        if mode not in ("in_place", "retract"):
            raise InvalidArgumentError(f"pause_generation: mode={mode!r} is not allowed: 'in_place' or 'retract'")
        if self._paused is not None:
            raise InvalidStateError(f"pause_generation: already paused ({self._paused!r}); continue_generation first")
        self._notify()
        for replica in self.replicas:
            replica.sync(self.now, finish_step=False)
        self._paused = mode
        if mode == "retract":
            self._flush_all()
        elif self.cluster.colocated:
            self._copy_kv(self.cluster.cost.kv_backup_per_token_s)

    async def continue_generation(self) -> None:
        """Ends a pause: held requests continue from now (a colocated in-place pause first restores their KV)."""
        if self._paused is None:
            raise InvalidStateError("continue_generation: generation is not paused")
        if self._paused == "in_place" and self.cluster.colocated:
            self._copy_kv(self.cluster.cost.kv_restore_per_token_s)  # what is still held (aborts freed theirs)
        self._paused = None
        for replica in self.replicas:
            replica.resume_at(self.now)
        self._notify()

    async def release_memory(self, tags: str | Iterable[str] | None = None) -> None:
        """Marks tags released; while any is, the clock stands still. Releasing kv_cache flushes running work.
        "cuda_graph" holds nothing here (no graphs are simulated): releasing it changes nothing."""
        names = self._tags(tags)
        if "kv_cache" in names and "kv_cache" not in self.paused_tags:
            self._flush_all()
            for replica in self.replicas:
                replica.clear_prefix_cache()
        self.paused_tags.update(names)
        self._notify()

    async def resume_memory(self, tags: str | Iterable[str] | None = None) -> None:
        self.paused_tags.difference_update(self._tags(tags))
        self._notify()

    def stats(self) -> EngineStats:
        c = self.counters()
        cap = self.cluster.cost.kv_capacity_tokens * len(self.replicas)
        used = sum(r.kv + r.pending_kv for r in self.replicas)
        return EngineStats(
            running=sum(len(r.running) + len(r.prefilling) for r in self.replicas),
            waiting=sum(len(r.waiting) for r in self.replicas),
            free_blocks=(cap - used) // 16, total_blocks=cap // 16, weight_version=self.weight_version,
            steps=c.decode_steps, prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
            generated_tokens=c.decode_tokens, preemptions=c.preemptions, prefix_cache_hit_tokens=c.prefix_hit_tokens,
            tokens_per_s=c.decode_tokens / c.now if c.now > 0 else 0.0, paused_tags=tuple(sorted(self.paused_tags)))

    def capacity(self) -> dict[str, Any]:
        """The /server_info fields of the simulated cluster (see ServableEngine): summed over replicas;
        a request's context is one replica's KV capacity."""
        cost = self.cluster.cost
        return {"page_size": 16, "max_total_num_tokens": cost.kv_capacity_tokens * len(self.replicas),
                "max_running_requests": cost.max_num_seqs * len(self.replicas),
                "context_length": cost.kv_capacity_tokens, "device": "simulated"}

    def health(self) -> dict[str, Any]:
        return {"status": self._status(self._held()), "weight_version": self.weight_version,
                "paused_tags": sorted(self.paused_tags), "paused": self._paused,
                "error": None if self.last_error is None else repr(self.last_error), "virtual_time": self.now}

    def counters(self) -> ClusterCounters:
        """Cumulative counters over all replicas (diff two snapshots with ClusterCounters.minus)."""
        total = ReplicaCounters()
        for rep in self.replicas:
            for key, value in asdict(rep.counters).items():
                setattr(total, key, getattr(total, key) + value)
        return ClusterCounters(now=self.now, num_engines=len(self.replicas),
                               delivered_tokens=self._delivered_tokens, kv_copy_time=self._kv_copy_time,
                               kv_copy_tokens=self._kv_copy_tokens, **asdict(total))

    def tool_waiting(self) -> list[str]:
        """Ids of the requests waiting on a tool call: on no replica, so they hold no decode slot and no KV (their
        context may survive as an evictable prefix-cache entry)."""
        return [r.request_id for r in self._on_tool.values()]

    def finish_time(self, ids: Sequence[int] | np.ndarray) -> float:
        """Virtual time at which the request whose prompt + response are ``ids`` finished (stop or length), taken
        out of the record; NaN when no request ended so (unknown, aborted, or continued past a chunk boundary)."""
        return self._samples.finish_time(ids)

    # ------------------------------------------------------------------ requests

    @staticmethod
    def _tags(tags: str | Iterable[str] | None) -> set[str]:
        return {t for t in memory_tags(tags) if t in _SIMULATED_TAGS}

    def _new_request(self, rid: str, input_ids: list[int] | np.ndarray, params: SamplingParams) -> SimRequest:
        ids = as_ids(input_ids)
        capacity = self.cluster.cost.kv_capacity_tokens
        if ids.size + params.max_new_tokens > capacity:
            raise InvalidArgumentError(f"request {rid!r}: {ids.size} input ids + max_new_tokens "
                                       f"{params.max_new_tokens} exceed the KV capacity of {capacity} tokens")
        opened = self._samples.open(ids, self.weight_version)
        sample = opened.sample
        base = int(ids.size) - sample.prompt_len
        left = max(sample.target - base, 1)
        if params.ignore_eos or left > params.max_new_tokens:
            new_total, finish = params.max_new_tokens, FinishReason.LENGTH
        else:
            new_total, finish = left, FinishReason.STOP
        return SimRequest(request_id=rid, sample=sample, base=base, input_len=int(ids.size), new_total=new_total,
                          finish=finish, is_resume=opened.is_resume, hasher=opened.hasher, input_ids=ids,
                          prefix_key=opened.prefix_key, env=sample.env_tokens,
                          turn_end=_turn_end(sample, base, new_total))

    def _route(self, request: SimRequest) -> None:
        if request.is_continuation:
            replica = min(self.replicas, key=lambda r: (r.kv_load, r.index))
        elif self.cluster.router == "round_robin":
            replica = self.replicas[next(self._rr)]
        else:
            replica = min(self.replicas, key=lambda r: (r.load, r.index))
        replica.enqueue(request)

    def _chunk(self, request: SimRequest, reason: FinishReason | None) -> GenerationChunk:
        """A chunk with the request's undelivered tokens, produced by the current weight version."""
        s = request.sample
        start, end = request.base + request.delivered, request.base + request.generated
        stop_at = request.base + request.new_total if request.finish == FinishReason.STOP else None
        tokens = response_tokens(s.uid, start, end, stop_at, s.correct).tolist()
        logprobs = response_logprobs(s.uid, start, end).tolist()
        if end > start:
            request.chunk_versions.append((self.weight_version, end - start))
        request.delivered = request.generated
        self._delivered_tokens += end - start
        matched = tokens[-1] if reason == FinishReason.STOP and tokens else None
        return GenerationChunk(request.request_id, tokens, logprobs, self.weight_version, reason, matched)

    def _deliver(self, request: SimRequest, chunk: GenerationChunk) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:
            return
        stream.items.append(chunk)
        if stream.waiter is not None:
            if not stream.waiter.done():
                stream.waiter.set_result(None)
            stream.waiter = None
            self._waiting -= 1

    def _close_stream(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        if stream.waiter is not None:
            stream.waiter = None
            self._waiting -= 1
        self._notify()

    def _finish(self, request: SimRequest) -> None:
        if request.at_tool_call:
            self._call_tool(request)
            return
        del self._requests[request.request_id]
        self._deliver(request, self._chunk(request, request.finish))
        s = request.sample
        stop_at = request.base + request.new_total if request.finish == FinishReason.STOP else None
        hasher = request.hasher.copy()
        hasher.update(response_tokens(s.uid, request.base, request.base + request.generated, stop_at,
                                      s.correct).tobytes())
        digest = hasher.digest()
        at_budget = request.finish == FinishReason.LENGTH
        self._samples.finished(digest, s, self.now, self.weight_version if at_budget else None)
        if at_budget:
            # The sample may go on from here (a chunk boundary): its ids are known and its KV stays cached.
            self.replicas[request.replica].cache_prefix(digest, request.context)

    def _call_tool(self, request: SimRequest) -> None:
        """The turn ended with a tool call: the request leaves its replica (reaped) and waits for the result; its
        context stays cached there for the next turn, which gets the observation and the next turn's end."""
        s = request.sample
        assert s.plan is not None
        self._deliver(request, self._chunk(request, None))
        call = s.tools_called
        key = f"{request.request_id}#{call}".encode()
        self.replicas[request.replica].cache_prefix(key, request.context)
        # Tool output is truncated to what the KV cache can still hold next to the rest of the request.
        room = self.cluster.cost.kv_capacity_tokens - request.context - (request.new_total - request.generated)
        observation = max(0, min(s.plan.observation_tokens[call], room))
        s.tools_called += 1
        s.env_tokens += observation
        s.tool_ready_at = self.now + s.plan.tool_latency_s[call]
        request.turn_prior = request.context
        request.env += observation
        request.turn_key = key
        request.turn_end = _turn_end(s, request.base, request.new_total)
        request.prefilled_once = False
        self._wait_tool(request)

    def _wait_tool(self, request: SimRequest) -> None:
        request.tool_seq = next(self._tool_keys)
        self._on_tool[request.tool_seq] = request
        heapq.heappush(self._tools, (request.sample.tool_ready_at, request.tool_seq))

    def _release_tools(self) -> None:
        """Requests whose tool result has arrived queue for their next turn: a turn on the replica caching its
        context, a resumed request wherever the router sends it. Aborted waits are dropped from the heap."""
        while self._tools and (self._tools[0][1] not in self._on_tool or self._tools[0][0] <= self.now):
            request = self._on_tool.pop(heapq.heappop(self._tools)[1], None)
            if request is None:
                continue
            request.tool_seq = -1
            if request.turn_key is not None:
                self.replicas[request.replica].enqueue(request)
            else:
                self._route(request)

    def _abort_now(self, ids: list[str]) -> list[GenerationOutput]:
        synced: set[int] = set()
        outputs = []
        for rid in ids:
            request = self._requests.pop(rid)
            if self._on_tool.pop(request.tool_seq, None) is None:  # waiting on its tool: on no replica
                replica = self.replicas[request.replica]
                if replica.index not in synced and self._paused is None:  # paused: synced at the pause
                    replica.sync(self.now, finish_step=False)
                    synced.add(replica.index)
                replica.remove(request)
            self._deliver(request, self._chunk(request, FinishReason.ABORT))
            s = request.sample
            out_tokens = response_tokens(s.uid, request.base, request.base + request.generated, None, s.correct)
            request.hasher.update(out_tokens.tobytes())
            self._samples.aborted(request.hasher.digest(), s)
            versions = [v for v, n in request.chunk_versions for _ in range(n)]
            outputs.append(GenerationOutput(
                request_id=rid, prompt_ids=request.input_ids.tolist(), token_ids=out_tokens.tolist(),
                logprobs=response_logprobs(s.uid, request.base, request.base + request.generated).tolist(),
                versions=versions, finish_reason=FinishReason.ABORT))
        return outputs

    def _stall(self, seconds: float) -> None:
        """Moves the clock on by ``seconds`` during which idle replicas stay idle (no admission)."""
        if seconds > 0:
            self.now += seconds
            for replica in self.replicas:
                replica.idle_until(self.now)

    def _flush_all(self) -> None:
        for replica in self.replicas:
            if self._paused is None:  # paused: synced at the pause, no time has passed for the replicas since
                replica.sync(self.now, finish_step=False)
            for request in replica.admitted:
                if request.generated > request.delivered:
                    self._deliver(request, self._chunk(request, None))
            replica.flush()

    def _deliver_held(self) -> None:
        """Paused in place: the tokens generated so far go out under the current version (the KV stays)."""
        for replica in self.replicas:
            for request in replica.admitted:
                if request.generated > request.delivered:
                    self._deliver(request, self._chunk(request, None))

    def _copy_kv(self, seconds_per_token: float) -> None:
        """Copies each replica's KV over its host link, all at once: the clock moves on by the slowest copy."""
        held = [replica.kv + replica.pending_kv for replica in self.replicas]
        longest = max(held) * seconds_per_token
        self._kv_copy_tokens += sum(held)
        self._kv_copy_time += longest
        self.now += longest

    # ------------------------------------------------------------------ the clock

    def _notify(self) -> None:
        self._activity += 1
        super()._notify()

    def _quiescent(self) -> bool:
        return self._waiting == len(self._streams)

    async def _settle(self) -> None:
        """Returns once every consumer waits and the event loop ran settle_passes rounds with no call."""
        assert self._wake is not None
        while True:
            while not self._closing and not (self._quiescent() and not self._held()):
                self._wake.clear()
                await self._wake.wait()
            if self._closing:
                return
            mark = self._activity
            for _ in range(self.settle_passes):
                await asyncio.sleep(0)
            if mark == self._activity and self._quiescent() and not self._held():
                return

    def _held(self) -> bool:
        """The clock stands still: a memory tag is released or generation is paused."""
        return bool(self.paused_tags) or self._paused is not None

    def _step(self) -> bool:
        """Admit queued work, then jump to the earliest replica event or tool result and deliver what finished."""
        self._release_tools()
        for replica in self.replicas:
            if replica.dirty:
                replica.sync(self.now, finish_step=True)
                for request in replica.reap():
                    self._finish(request)
                replica.admit()
        t = min(r.next_event() for r in self.replicas)
        self._release_tools()  # drops aborted waits from the top of the heap: its first entry is a live one
        if self._tools and self._tools[0][0] < t:
            self.now = max(self.now, self._tools[0][0])  # the next step releases it
            return True
        if math.isinf(t):
            return False
        self.now = max(self.now, t)
        for replica in self.replicas:
            if replica.next_event() == t:
                for request in replica.run_event():
                    self._finish(request)
        return True

    async def _loop(self) -> None:
        assert self._wake is not None
        try:
            while True:
                await self._settle()
                if self._closing:
                    return
                if not self._step():
                    self._wake.clear()
                    if self._closing:
                        return
                    await self._wake.wait()
        except Exception as exc:  # the clock failed: fail every stream instead of hanging the loop
            self.last_error = exc
            for stream in list(self._streams.values()):
                if stream.waiter is not None and not stream.waiter.done():
                    stream.waiter.set_exception(exc)
            raise


def _turn_end(sample: SimSample, base: int, new_total: int) -> int | None:
    """Where a request of ``sample`` starting at response token ``base`` ends its turn with the next tool call
    (counted in its generated tokens); None when it runs to its end (the last turn, or the cap comes first)."""
    plan = sample.plan
    if plan is None or sample.tools_called >= plan.turns - 1:
        return None
    end = plan.tool_call_at(sample.tools_called) - base
    return end if end < new_total else None


__all__ = ["ClusterCounters", "SimulatedEngine"]
