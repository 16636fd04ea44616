"""A deterministic fake rollout engine and a step driver for the scheduler tests and benchmarks.

Token t of sample s is always ``token_at(s, t)`` with logprob ``logprob_at(t)``, so any resumed request
and any trained response can be checked against what the engine must have produced.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

import numpy as np

from april_ext import CompletedGroup, GenerationRequest, ListDataSource, Prompt, Scheduler, SchedulerConfig
from april_ext.batch import TrainingBatch


def token_at(sample_id: int, positions: np.ndarray) -> np.ndarray:
    return ((sample_id * 131 + positions * 7) % 32000).astype(np.int32)


def logprob_at(positions: np.ndarray) -> np.ndarray:
    return (-((positions % 13) + 1) / 10.0).astype(np.float32)


def prompts(n: int, length: int = 4) -> ListDataSource:
    return ListDataSource([Prompt(id=f"p{i}", token_ids=[1000 + i] * (length - 1) + [7], metadata={"i": i})
                           for i in range(n)])


def make(n_prompts: int = 50, **kw) -> Scheduler:
    """The small shape of the unit tests (N = 2, n = 2, N' = 4, cap 64), overridden by ``kw``."""
    base = dict(rollout_batch_size=2, n_samples_per_prompt=2, over_sampling_batch_size=4, max_response_len=64)
    base.update(kw)
    return Scheduler(SchedulerConfig(**base), prompts(n_prompts))


def feed(sched: Scheduler, sid: int, count: int, version: int, start: int | None = None) -> None:
    start = len(sched.sample(sid).token_ids) if start is None else start
    pos = np.arange(start, start + count)
    sched.on_tokens(sid, token_at(sid, pos), -0.5 * np.ones(count), version)


def finish_group(sched: Scheduler, gid: int, n: int, tokens: int = 3, version: int = 0) -> None:
    for sid in range(gid * n, gid * n + n):
        feed(sched, sid, tokens, version)
        sched.on_finish(sid, "stop")


def reward_all(sched: Scheduler, accepted: bool = True) -> list[int]:
    groups = sched.pop_completed_groups()
    for g in groups:
        sched.report_rewards(g.group_id, [float(i) for i in range(len(g.sample_ids))], accepted)
    return [g.group_id for g in groups]


def abort_and_take(sched: Scheduler) -> TrainingBatch:
    """Ends a done step: every running sample answers its abort, then the batch is taken."""
    for sid in sched.samples_to_abort():
        sched.on_finish(sid, "abort")
    return sched.take_batch()


def _fnv1a(data: bytes) -> int:
    h = 1469598103934665603
    for b in data:
        h = ((h ^ b) * 1099511628211) % 2**64
    return h


def state_payload(core: bytes) -> bytes:
    """The payload of a framed scheduler state (docs/scheduler.md, Persistence)."""
    return core[20:-8]


STATE_FORMAT = 7  # the format version the core writes
_COUNTERS_AT = 8 + 8 + 8 + 8 + 1 + 1 + 8 + 8  # (version 5) n, max_len, next group id, prompts, flags, version, step
_V3_COUNTERS = 35
_V4_COUNTERS = 39  # chunk_returns, continuation_requests, continuation_tokens, prediction_samples
_TAIL_COUNTERS = 4  # long_round, long_queue_groups, tail_restarted_samples, tail_tokens_discarded
_SURPLUS_COUNTERS = 2  # surplus_samples_cancelled, surplus_tokens_discarded
_NO_TAIL = bytes(1 + 8 + 8)  # short round, empty long queue, no pending restart
_ENV_COUNTERS = 4  # env_waits, env_tokens, batch_env_tokens, waiting_env_samples (version 7)
_V6_COUNTERS_AT = _COUNTERS_AT + 8  # version 6 added tail_extra_samples to the header


def frame_state(payload: bytes, version: int = STATE_FORMAT) -> bytes:
    """Frames a payload as the core writes it: magic, format version, length, payload, FNV-1a checksum."""
    return b"APRILSCH" + struct.pack("<IQ", version, len(payload)) + payload + struct.pack("<Q", _fnv1a(payload))


def as_version_6(core: bytes) -> bytes:
    """Rewrite a state without multi-turn samples (no env runs, none waiting) as version 6 wrote it: no env
    counters, no env-run array after each sample's segments."""
    payload = state_payload(core)
    assert struct.unpack_from("<I", core, 8)[0] == 7
    n, extra = struct.unpack_from("<q", payload, 0)[0], struct.unpack_from("<q", payload, 16)[0]
    (count,) = struct.unpack_from("<Q", payload, _V6_COUNTERS_AT)
    last = _V6_COUNTERS_AT + 8 + (count - _ENV_COUNTERS) * 8
    out = bytearray(payload[:_V6_COUNTERS_AT] + struct.pack("<Q", count - _ENV_COUNTERS)
                    + payload[_V6_COUNTERS_AT + 8:last])
    pos = last + 8 * _ENV_COUNTERS

    def vec(pos: int, item: int) -> int:
        return pos + 8 + struct.unpack_from("<Q", payload, pos)[0] * item

    start = pos
    pos = vec(pos, 8)  # staleness histogram
    pos += 8  # group count
    (groups,) = struct.unpack_from("<Q", payload, pos - 8)
    for _ in range(groups):
        pos = vec(vec(pos + 18, 4), 4)  # id, prompt index, state, flag; prompt, rewards
        for _ in range(n + extra):
            assert payload[pos] != 5, "a sample waits for its environment: not a version 6 state"
            pos = vec(vec(vec(pos + 26, 4), 4), 8)  # state, finish, 3 ints; tokens, logprobs, segments
            assert struct.unpack_from("<Q", payload, pos)[0] == 0, "a sample has env runs"
            out += payload[start:pos]
            pos += 8  # the empty env-run array
            start = pos
    out += payload[start:]
    return frame_state(bytes(out), version=6)


def as_version_5(core: bytes) -> bytes:
    """Rewrite a state of a scheduler without extra samples (tail_extra_samples=0) as version 5 wrote it: no
    tail_extra_samples in the header, no surplus counters."""
    payload = state_payload(as_version_6(core))
    assert struct.unpack_from("<q", payload, 16)[0] == 0
    payload = payload[:16] + payload[24:]
    (count,) = struct.unpack_from("<Q", payload, _COUNTERS_AT)
    assert count == _V4_COUNTERS + _TAIL_COUNTERS + _SURPLUS_COUNTERS
    last = _COUNTERS_AT + 8 + (_V4_COUNTERS + _TAIL_COUNTERS) * 8
    payload = (payload[:_COUNTERS_AT] + struct.pack("<Q", count - _SURPLUS_COUNTERS)
               + payload[_COUNTERS_AT + 8:last] + payload[last + 8 * _SURPLUS_COUNTERS:])
    return frame_state(payload, version=5)


def as_version_4(core: bytes) -> bytes:
    """Rewrite a state of a scheduler without tail batching as version 4 wrote it: no tail counters, no tail
    section at the end."""
    payload = state_payload(as_version_5(core))
    (count,) = struct.unpack_from("<Q", payload, _COUNTERS_AT)
    assert count == _V4_COUNTERS + _TAIL_COUNTERS and payload.endswith(_NO_TAIL)
    last = _COUNTERS_AT + 8 + _V4_COUNTERS * 8
    payload = (payload[:_COUNTERS_AT] + struct.pack("<Q", _V4_COUNTERS) + payload[_COUNTERS_AT + 8:last]
               + payload[last + 8 * _TAIL_COUNTERS:-len(_NO_TAIL)])
    return frame_state(payload, version=4)


def as_version_3(core: bytes) -> bytes:
    """Rewrite a state as version 3 wrote it: 35 counters (none of chunk_returns .. prediction_samples, nor the
    tail counters) and nothing after the adaptive fields (no length prediction, no tail section)."""
    payload = state_payload(as_version_5(core))
    n = struct.unpack_from("<q", payload, 0)[0]
    (count,) = struct.unpack_from("<Q", payload, _COUNTERS_AT)
    assert count == _V4_COUNTERS + _TAIL_COUNTERS
    pos = _COUNTERS_AT + 8 + count * 8

    def skip_vec(pos: int, item: int) -> int:
        return pos + 8 + struct.unpack_from("<Q", payload, pos)[0] * item

    pos = skip_vec(pos, 8)  # staleness histogram
    (groups,) = struct.unpack_from("<Q", payload, pos)
    pos += 8
    for _ in range(groups):
        pos = skip_vec(skip_vec(pos + 18, 4), 4)  # id, prompt index, state, flag; prompt, rewards
        for _ in range(n):
            pos = skip_vec(skip_vec(skip_vec(pos + 26, 4), 4), 8)  # state, finish, 3 ints; tokens, logprobs, segments
    pos = skip_vec(skip_vec(pos, 8), 8) + 16  # completed, accepted queues; adaptive state
    last = _COUNTERS_AT + 8 + _V3_COUNTERS * 8
    payload = (payload[:_COUNTERS_AT] + struct.pack("<Q", _V3_COUNTERS) + payload[_COUNTERS_AT + 8:last]
               + payload[last + 8 * (count - _V3_COUNTERS):pos])
    return frame_state(payload, version=3)


def long_tail_length(sample_id: int, cap: int, seed: int = 0) -> int:
    """Most responses finish within a few thousand tokens; a tail reaches the cap (paper, figure 1)."""
    rng = np.random.default_rng(sample_id * 7919 + seed)
    return int(min(cap, max(1, rng.lognormal(mean=7.6, sigma=1.0))))


@dataclass
class _Run:
    generated: int  # response tokens the sample has in total
    budget_end: int  # response length at which the request hits max_new_tokens
    prompt_len: int


class FakeEngine:
    """Streams deterministic tokens for dispatched requests; finishes at a per-sample target length."""

    def __init__(self, sched: Scheduler, target_len: Callable[[int], int], chunk: int = 256,
                 abort_extra: int = 3) -> None:
        self.sched = sched
        self.target_len = target_len
        self.chunk = chunk
        self.abort_extra = abort_extra
        self.version = 0
        self.running: dict[int, _Run] = {}
        self.requests: list[GenerationRequest] = []

    def submit(self, requests: list[GenerationRequest]) -> None:
        for r in requests:
            assert r.sample_id not in self.running, f"sample {r.sample_id} dispatched twice"
            done = r.input_ids.size - r.prompt_len
            expected = token_at(r.sample_id, np.arange(done))
            assert np.array_equal(r.input_ids[r.prompt_len:], expected), "resume lost or reordered tokens"
            assert r.is_resume == (done > 0)
            assert r.max_new_tokens == self.sched.config.max_response_len - done
            self.running[r.sample_id] = _Run(done, done + r.max_new_tokens, r.prompt_len)
            self.requests.append(r)

    def tick(self) -> None:
        """One chunk for every running sample, then the finishes."""
        ids, counts, toks, lps, finished, reasons = [], [], [], [], [], []
        for sid, run in self.running.items():
            target = self.target_len(sid)
            end = min(run.generated + self.chunk, target, run.budget_end)
            pos = np.arange(run.generated, end)
            ids.append(sid)
            counts.append(pos.size)
            toks.append(token_at(sid, pos))
            lps.append(logprob_at(pos))
            run.generated = end
            if end >= target or end >= run.budget_end:
                finished.append(sid)
                reasons.append(0 if end >= target else 1)
        if ids:
            self.sched.on_tokens_batch(ids, counts, np.concatenate(toks), np.concatenate(lps),
                                       np.full(len(ids), self.version))
        for sid in finished:
            del self.running[sid]
        if finished:
            self.sched.on_finish_batch(finished, reasons)

    def abort(self, sample_ids: list[int]) -> None:
        """Abort: each sample returns a few last tokens generated before the abort took effect."""
        ids, counts, toks, lps = [], [], [], []
        for sid in sample_ids:
            run = self.running.pop(sid)
            end = min(run.generated + self.abort_extra, self.target_len(sid), run.budget_end - 1)
            end = max(end, run.generated)
            pos = np.arange(run.generated, end)
            ids.append(sid)
            counts.append(pos.size)
            toks.append(token_at(sid, pos))
            lps.append(logprob_at(pos))
        if ids:
            self.sched.on_finish_batch(ids, np.full(len(ids), 2), counts, np.concatenate(toks), np.concatenate(lps),
                                       np.full(len(ids), self.version))


def varied_rewards(group: CompletedGroup) -> tuple[list[float], bool]:
    rewards = [float(len(r) % 2) for r in group.responses]
    rewards[0] = 1.0 - rewards[-1] if len(rewards) > 1 else rewards[0]
    return rewards, True


def run_step(sched: Scheduler, engine: FakeEngine, version: int,
             reward: Callable[[CompletedGroup], tuple[list[float], bool]] = varied_rewards, max_ticks: int = 10_000):
    """The APRIL step loop: dispatch, stream, reward, stop at N accepted, abort the rest, take the batch."""
    sched.begin_step(version)
    engine.version = version
    generate_until_done(sched, engine, reward, max_ticks)
    engine.abort(sched.samples_to_abort())
    return sched.take_batch()


def generate_until_done(sched: Scheduler, engine: FakeEngine,
                        reward: Callable[[CompletedGroup], tuple[list[float], bool]] = varied_rewards,
                        max_ticks: int = 10_000) -> None:
    """Dispatch, stream and reward until the step is done (AssertionError after max_ticks). With
    tail_extra_samples, the cancelled surplus samples are aborted as soon as they are listed."""
    for _ in range(max_ticks):
        if sched.step_done:
            return
        if sched.config.tail_extra_samples:
            engine.abort(sched.samples_to_abort())
        engine.submit(sched.dispatch())
        engine.tick()
        for g in sched.pop_completed_groups():
            rewards, accepted = reward(g)
            sched.report_rewards(g.group_id, rewards, accepted)
    raise AssertionError("step did not finish")


def check_batch_layout(batch, n_samples: int) -> None:
    """Every response in the batch is exactly what the fake engine produced, with consistent arrays."""
    assert batch.offsets[0] == 0 and batch.offsets[-1] == batch.n_tokens
    for i in range(batch.n_samples):
        lo, hi = batch.offsets[i], batch.offsets[i + 1]
        p = batch.prompt_lens[i]
        sid = int(batch.sample_ids[i])
        resp = np.arange(hi - lo - p)
        assert np.array_equal(batch.tokens[lo + p:hi], token_at(sid, resp))
        assert np.array_equal(batch.behavior_logprobs[lo + p:hi], logprob_at(resp))
        assert np.all(batch.versions[lo:lo + p] == -1) and np.all(batch.loss_mask[lo:lo + p] == 0)
        v = batch.versions[lo + p:hi]
        assert np.all(np.diff(v) >= 0) and np.all(v >= 0) and np.all(v <= batch.policy_version)
        assert batch.group_index[i] == i // n_samples
