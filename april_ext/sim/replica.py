"""One simulated engine replica: continuous batching over a virtual clock, in closed form between events.

Between two events the running set is fixed, so decode step k of B sequences holding S tokens costs
fixed + per_seq * B + per_kv * (S + B * k): the time of m steps and the steps within a time are closed
forms (CostModel.decode_time / steps_within). Events are a request finishing, the KV cache filling up
(the newest sequence is preempted and recomputed later, as SGLang retracts), and changes from outside
(admissions, aborts, weight flushes). Admission runs a prefill batch during which decoding pauses; with the
cost model's mixed_chunk, admitted requests prefill instead in chunks that ride in the decode iterations, and
while any is prefilling every iteration is an event (prefill progress is state between events).
An agentic trajectory (turns.py) leaves its replica at each tool call (reaped like a finish: it holds no decode
slot while its tool runs) and comes back for its next turn with the observation appended to its context; its
context's KV stays behind as a prefix-cache entry, so the next turn prefills only the observation unless the
entry was evicted (then the whole context is recomputed).
A replica keeps the KV of requests that ended at their token budget (a divided rollout's chunk boundary) in a
prefix cache, as SGLang's radix cache keeps a finished request's KV: a continuation (prompt + partial response)
admitted here while its entry survives needs no prefill. Entries are evictable: the cache holds at most the KV
left free by the admitted requests, least recently stored first out, and the engine empties it when the weight
version changes (a prefix computed by other weights is no cache hit).
Pure bookkeeping, no asyncio: engine.py drives it.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from april_ext.batch import FinishReason
from april_ext.sim.cost import CostModel
from april_ext.sim.turns import TrajectoryPlan


@dataclass
class SimSample:
    """A response as the engine remembers it across requests: its fixed target and its token stream id."""

    uid: int
    prompt_len: int
    target: int  # natural total response length; the request's cap may cut it
    correct: bool
    plan: TrajectoryPlan | None = None  # an agentic trajectory's turns and tool calls (None: one turn, no tools)
    tools_called: int = 0  # tool calls issued so far
    env_tokens: int = 0  # observation tokens those calls inserted into the context
    tool_ready_at: float = 0.0  # virtual time the last tool call's result arrives: no turn runs before it


@dataclass
class SimRequest:
    """One generate call. Its context is input_len + generated; it ends after new_total tokens."""

    request_id: str
    sample: SimSample
    base: int  # response tokens the sample had before this request
    input_len: int
    new_total: int
    finish: FinishReason
    is_resume: bool
    hasher: Any  # blake2b over the input ids, extended with the output on abort
    input_ids: np.ndarray
    prefix_key: bytes | None = None  # a continuation: the digest of its input ids, its prefix-cache key
    env: int = 0  # observation tokens in the context beyond the input ids (an agentic trajectory)
    turn_end: int | None = None  # generated count at which the current model turn ends with a tool call
    turn_key: bytes | None = None  # the next turn after a tool call: its context's prefix-cache key
    turn_prior: int = 0  # the next turn: its context before the observation (what the prefix cache may hold)
    tool_seq: int = -1  # while its tool runs: the engine's key of the wait
    generated: int = 0
    delivered: int = 0
    chunk_versions: list[tuple[int, int]] = field(default_factory=list)  # (version, count) per delivered chunk
    replica: int = -1
    running: bool = False
    prefilled_once: bool = False
    prefilled: int = 0  # mixed chunk: context tokens prefilled so far in the current admission
    # How this admission's prefill counts; "turn": the next turn of an agentic trajectory after its tool call.
    prefill_kind: Literal["new", "resume", "continuation", "recompute", "turn"] = "new"

    @property
    def context(self) -> int:
        return self.input_len + self.env + self.generated

    @property
    def remaining(self) -> int:
        """Tokens left before the request leaves the replica: at its end, or at its current turn's tool call."""
        return (self.new_total if self.turn_end is None else self.turn_end) - self.generated

    @property
    def at_tool_call(self) -> bool:
        return self.turn_end is not None and self.generated >= self.turn_end

    @property
    def is_continuation(self) -> bool:
        """Continues a request that ended at its token budget (not an abort): a divided rollout's next chunk."""
        return self.prefix_key is not None


@dataclass
class ReplicaCounters:
    """Cumulative accounting of one replica (virtual seconds and tokens)."""

    decode_steps: int = 0
    decode_tokens: int = 0
    decode_time: float = 0.0
    slot_time: float = 0.0  # integral of the running batch size over decode time
    prefill_time: float = 0.0
    prefill_tokens: int = 0
    resume_prefill_time: float = 0.0  # first prefill of resumed requests (prompt + partial)
    resume_prefill_tokens: int = 0
    recompute_time: float = 0.0  # prefill again after a preemption or a weight/KV flush
    recompute_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0
    kv_reads: int = 0  # KV tokens read by decode: a step of B sequences over S cached tokens reads S
    new_prefill_work_s: float = 0.0  # prefill compute done for new requests' prompts (no batch overhead)
    resume_prefill_work_s: float = 0.0  # prefill compute done for resumed requests' prompt + partial (first time)
    continuations: int = 0  # continuation requests admitted (first admission)
    continuation_prefill_time: float = 0.0  # prefill of continuations whose prefix was not cached here
    continuation_prefill_tokens: int = 0
    prefix_hit_tokens: int = 0  # context tokens of continuations admitted on their cached prefix (no prefill)
    tool_calls: int = 0  # agentic turns that ended with a tool call (the request left to wait on it)
    env_prefill_tokens: int = 0  # observation tokens prefilled for the turn after a tool call
    env_prefill_time: float = 0.0  # their prefill on top of the cached context (a lost prefix counts as recompute)


class Replica:
    """Running and waiting requests of one engine and its position on the virtual clock."""

    def __init__(self, index: int, cost: CostModel) -> None:
        self.index = index
        self.cost = cost
        self.running: list[SimRequest] = []  # decoding, in admission order: the newest is preempted first
        self.prefilling: deque[SimRequest] = deque()  # mixed chunk: admitted, prefill in progress, FIFO
        self.pending_kv = 0  # KV reserved by the prefilling requests (their whole contexts)
        self.waiting: deque[SimRequest] = deque()
        self.seg_t0 = 0.0  # decode of the current segment starts here (after any prefill)
        self.kv = 0  # KV tokens of the running requests at seg_t0
        self.counters = ReplicaCounters()
        self.dirty = False  # waiting requests may be admissible
        self.prefix_cache: OrderedDict[bytes, int] = OrderedDict()  # prefix key -> KV tokens, oldest first
        self._cached_tokens = 0
        self._next: tuple[float, int] | None = None  # (time, steps) of the next own event

    @property
    def load(self) -> int:
        return len(self.running) + len(self.prefilling) + len(self.waiting)

    @property
    def kv_load(self) -> int:
        """KV tokens in use or claimed here: admitted contexts (as of the last sync) and the waiting ones."""
        return self.kv + self.pending_kv + sum(r.context for r in self.waiting)

    @property
    def admitted(self) -> list[SimRequest]:
        """Requests holding KV here: decoding, then prefilling (mixed chunk)."""
        return self.running + list(self.prefilling)

    # ------------------------------------------------------------------ moving along the clock

    def _apply_steps(self, m: int) -> None:
        b = len(self.running)
        if m <= 0 or b == 0:
            return
        dt = self.cost.decode_time(b, self.kv, m)
        c = self.counters
        c.kv_reads += m * self.kv + b * m * (m - 1) // 2
        c.decode_steps += m
        c.decode_tokens += b * m
        c.decode_time += dt
        c.slot_time += b * dt
        for r in self.running:
            r.generated += m
        self.kv += b * m
        self.seg_t0 += dt

    def _plan_iteration(self) -> tuple[float, list[tuple[SimRequest, int, float]], float]:
        """Mixed chunk: (iteration time, prefill pieces (request, tokens, compute s), decode-only time) of the next
        iteration: prefilling requests in FIFO order within chunked_prefill_size tokens."""
        cost = self.cost
        budget = cost.chunked_prefill_size
        pieces = []
        reads = 0
        for r in self.prefilling:
            if budget == 0:
                break
            n = min(r.context - r.prefilled, budget)
            pieces.append((r, n, cost.prefill_time(r.prefilled, r.prefilled + n)))
            reads += r.prefilled
            budget -= n
        b = len(self.running)
        dt = cost.iteration_time(b, self.kv, sum(p[2] for p in pieces), reads)
        return dt, pieces, cost.iteration_time(b, self.kv) if b else 0.0

    def _apply_iteration(self) -> None:
        """Mixed chunk: one iteration. The decode batch is charged what it costs alone; the prefill pieces share
        the rest (the time the chunk adds), in proportion to their compute."""
        dt, pieces, alone = self._plan_iteration()
        b = len(self.running)
        c = self.counters
        if b:
            c.kv_reads += self.kv
            c.decode_steps += 1
            c.decode_tokens += b
            c.decode_time += alone
            c.slot_time += b * alone
            for r in self.running:
                r.generated += 1
            self.kv += b
        added = dt - alone
        compute = sum(p[2] for p in pieces)
        c.prefill_time += added
        for r, n, t in pieces:
            self._charge_prefill(r, added * t / compute if compute > 0 else added / len(pieces), n)
            self._charge_work(r, t)
            r.prefilled += n
        while self.prefilling and self.prefilling[0].prefilled >= self.prefilling[0].context:
            r = self.prefilling.popleft()
            self.pending_kv -= r.context
            self.kv += r.context
            self.running.append(r)
        self.seg_t0 += dt

    def sync(self, now: float, finish_step: bool) -> None:
        """Bring the running requests to ``now``. ``finish_step``: the step in progress completes (its tokens
        count) and the segment restarts at its end; otherwise it is cut and the segment restarts at now."""
        if self.prefilling:
            # The next event is one iteration away, so now is at most its end.
            if now > self.seg_t0 and (finish_step or self.seg_t0 + self._plan_iteration()[0] <= now):
                self._apply_iteration()
        elif self.running and now > self.seg_t0:
            m = self.cost.steps_within(len(self.running), self.kv, now - self.seg_t0)
            self._apply_steps(m)
            if finish_step and self.seg_t0 < now and self.running:
                self._apply_steps(1)
        self.seg_t0 = max(self.seg_t0, now)
        self._next = None

    def next_event(self) -> float:
        """Time of this replica's next own event (a finish or a full KV cache); inf when it has none."""
        if self._next is None:
            if self.prefilling:
                self._next = (self.seg_t0 + self._plan_iteration()[0], 1)
                return self._next[0]
            if not self.running:
                return math.inf
            b = len(self.running)
            m = min(r.remaining for r in self.running)
            m = min(m, max(1, (self.cost.kv_capacity_tokens - self.kv) // b))
            self._next = (self.seg_t0 + self.cost.decode_time(b, self.kv, m), m)
        return self._next[0]

    def run_event(self) -> list[SimRequest]:
        """Advance to the next own event; returns the requests that finished there (caller delivers them)."""
        self.next_event()
        assert self._next is not None
        _, m = self._next
        if self.prefilling:
            self._apply_iteration()
        else:
            self._apply_steps(m)
        self._next = None
        done = self.reap()
        self._preempt_overflow()
        self.admit()
        return done

    def reap(self) -> list[SimRequest]:
        """Take out the running requests that generated all their tokens."""
        done = [r for r in self.running if r.remaining <= 0]
        if done:
            self.running = [r for r in self.running if r.remaining > 0]
            for r in done:
                r.running = False
                self.kv -= r.context
            calls = sum(r.at_tool_call for r in done)
            self.counters.tool_calls += calls
            self.counters.finished += len(done) - calls
            self._next = None
        return done

    # ------------------------------------------------------------------ membership

    def _preempt_overflow(self) -> None:
        # The next step appends one token per sequence: keep that within the KV capacity. Prefilling requests
        # are the newest admitted, so they go first.
        while (len(self.running) + len(self.prefilling) > 1
               and self.kv + self.pending_kv + len(self.running) > self.cost.kv_capacity_tokens):
            if self.prefilling:
                victim = self.prefilling.pop()
                self.pending_kv -= victim.context
            else:
                victim = self.running.pop()
                self.kv -= victim.context
            victim.running = False
            self.waiting.appendleft(victim)
            self.counters.preemptions += 1
        self._next = None

    def enqueue(self, request: SimRequest) -> None:
        request.replica = self.index
        self.waiting.append(request)
        self.dirty = True

    def admit(self) -> None:
        """Admit waiting requests that fit (running slots, KV below the headroom) and run their prefill batch."""
        self.dirty = False
        self._evict()
        cost = self.cost
        limit = cost.kv_capacity_tokens * (1 - cost.admission_headroom)
        batch: list[SimRequest] = []
        while self.waiting and len(self.running) + len(self.prefilling) < cost.max_num_seqs:
            r = self.waiting[0]
            alone = not self.running and not self.prefilling
            if not alone and self.kv + self.pending_kv + r.context > limit:
                break
            self.waiting.popleft()
            r.running = True
            first = not r.prefilled_once
            r.prefill_kind = ("recompute" if not first else "turn" if r.turn_key is not None
                              else "continuation" if r.is_continuation else "resume" if r.is_resume else "new")
            r.prefilled_once = True
            if first and r.is_continuation:
                self.counters.continuations += 1
                if self._take_prefix(r):
                    self.counters.prefix_hit_tokens += r.context
                    self.running.append(r)
                    self.kv += r.context
                    continue
            cached = (self._pop_prefix(r.turn_key) or 0) if r.prefill_kind == "turn" else 0
            batch.append((r, cached))
            if cost.mixed_chunk:
                r.prefilled = 0
                self.prefilling.append(r)
                self.pending_kv += r.context
            else:
                self.running.append(r)
                self.kv += r.context
        if not batch or cost.mixed_chunk:
            self._next = None
            self._evict()
            return
        total = cost.prefill_fixed_s
        for r, cached in batch:
            t = cost.prefill_time(cached, r.context)
            total += t
            if r.prefill_kind == "turn":
                self._charge_turn(r, t, cached)
            else:
                self._charge_prefill(r, t, r.context)
                self._charge_work(r, t)
        self.counters.prefill_time += total
        self.seg_t0 += total
        self._next = None
        self._evict()

    # ------------------------------------------------------------------ prefix cache

    def cache_prefix(self, key: bytes, tokens: int) -> None:
        """Keep the KV of a request that ended at its budget (``tokens`` of context) for its continuation."""
        old = self.prefix_cache.pop(key, None)
        if old is not None:
            self._cached_tokens -= old
        self.prefix_cache[key] = tokens
        self._cached_tokens += tokens
        self._evict()

    def clear_prefix_cache(self) -> None:
        self.prefix_cache.clear()
        self._cached_tokens = 0

    def _evict(self) -> None:
        """Cached prefixes live in the KV the admitted requests leave free: the oldest go first."""
        free = max(0, self.cost.kv_capacity_tokens - self.kv - self.pending_kv)
        while self._cached_tokens > free:
            self._cached_tokens -= self.prefix_cache.popitem(last=False)[1]

    def _take_prefix(self, request: SimRequest) -> bool:
        """A continuation's cached prefix becomes its KV (admission has checked that the context fits)."""
        assert request.prefix_key is not None
        return self._pop_prefix(request.prefix_key) is not None

    def _pop_prefix(self, key: bytes | None) -> int | None:
        """Take the entry of ``key`` out of the cache (it becomes a request's KV); its tokens, None on a miss."""
        tokens = self.prefix_cache.pop(key, None) if key is not None else None
        if tokens is not None:
            self._cached_tokens -= tokens
        return tokens

    def _charge_turn(self, request: SimRequest, seconds: float, cached: int) -> None:
        """Count the prefill of a turn after a tool call. The observation on top of its context is work any schedule
        does (in the bounds); the context itself is recomputed when its cached prefix was lost."""
        c = self.counters
        env = self.cost.prefill_time(request.turn_prior, request.context)
        c.prefill_tokens += request.context - cached
        c.env_prefill_tokens += request.context - request.turn_prior
        c.env_prefill_time += env
        c.new_prefill_work_s += env
        if cached < request.turn_prior:
            c.recompute_time += seconds - env
            c.recompute_tokens += request.turn_prior - cached

    def _charge_prefill(self, request: SimRequest, seconds: float, tokens: int) -> None:
        """Count prefill work of ``request`` under the kind its admission set (the caller adds prefill_time)."""
        c = self.counters
        c.prefill_tokens += tokens
        if request.prefill_kind == "recompute":
            c.recompute_time += seconds
            c.recompute_tokens += tokens
        elif request.prefill_kind == "resume":
            c.resume_prefill_time += seconds
            c.resume_prefill_tokens += tokens
        elif request.prefill_kind == "continuation":
            c.continuation_prefill_time += seconds
            c.continuation_prefill_tokens += tokens

    def _charge_work(self, request: SimRequest, seconds: float) -> None:
        """Count prefill compute done for a new or resumed request (the work the bounds charge). A continuation's
        prefill is in neither bound: placed where its prefix is cached, it needs none."""
        if request.prefill_kind == "new":
            self.counters.new_prefill_work_s += seconds
        elif request.prefill_kind == "resume":
            self.counters.resume_prefill_work_s += seconds

    def remove(self, request: SimRequest) -> None:
        """Take a request out (abort); the caller has synced the replica to now."""
        if request.running and request in self.prefilling:
            self.prefilling.remove(request)
            self.pending_kv -= request.context
            request.running = False
        elif request.running:
            self.running.remove(request)
            self.kv -= request.context
            request.running = False
        else:
            self.waiting.remove(request)
        self.counters.aborted += 1
        self._next = None
        self.dirty = True

    def resume_at(self, t: float) -> None:
        """Decoding (paused since the last sync) starts again at ``t``."""
        self.seg_t0 = max(self.seg_t0, t)
        self._next = None
        self.dirty = True

    def idle_until(self, t: float) -> None:
        """An idle replica (nothing admitted) starts its next work no earlier than ``t``."""
        if not self.running and not self.prefilling:
            self.seg_t0 = max(self.seg_t0, t)
            self._next = None

    def flush(self) -> None:
        """Drop the KV cache (weight update, KV release): running requests wait to be recomputed, in order."""
        admitted = self.admitted
        self.waiting.extendleft(reversed(admitted))
        for r in admitted:
            r.running = False
        self.running = []
        self.prefilling.clear()
        self.kv = 0
        self.pending_kv = 0
        self._next = None
        self.dirty = True


__all__ = ["Replica", "ReplicaCounters", "SimRequest", "SimSample"]
