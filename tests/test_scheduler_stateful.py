"""Random interleavings of every scheduler call, with the DESIGN.md invariants checked after each one.

Multi-turn samples are drawn too: a turn handed to the environment (on_env_wait), its observation
(on_env_tokens) or the environment's finish. The environment inserts token_at(sid, t) at position t as the
engine would, so token checks stay positional; env positions have logprob 0.0, version -1 and loss mask 0.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from _scheduler_utils import logprob_at, prompts, token_at
from april_ext import (
    AprilError,
    InvalidArgumentError,
    InvalidStateError,
    Scheduler,
    SchedulerConfig,
    UnknownIdError,
)

MAX_LEN = 6
STATES = ("queued", "running", "aborting", "done", "cancelled", "waiting_env")
TAILS = ("off", "on", "restart")  # tail_batching off, on, on with tail_batching_restart
DISPATCH_ORDERS = ["fifo", "oldest_first", "longest_predicted_first", "shortest_first"]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 3), big_n=st.integers(1, 2), extra=st.integers(0, 2),
                refill=st.sampled_from(["batch", "continuous"]),
                policy=st.sampled_from(["keep", "mask", "restart", "drop"]),
                max_staleness=st.sampled_from([None, 0, 1, 2]), mask_offpolicy=st.booleans(),
                order=st.sampled_from(["oldest_first", "newest_first", "longest_first"]),
                keep_surplus=st.booleans(), cap=st.sampled_from([None, 3, 5]), n_prompts=st.integers(2, 12),
                live_target=st.sampled_from([None, 0, 1, 4]), boundary=st.sampled_from(["abort", "carry"]),
                dispatch_order=st.sampled_from(DISPATCH_ORDERS), resume_priority=st.booleans(),
                chunk=st.sampled_from([None, 1, 2, 4]), tail=st.sampled_from(TAILS), surplus=st.integers(0, 2))
    def setup(self, n, big_n, extra, refill, policy, max_staleness, mask_offpolicy, order, keep_surplus, cap,
              n_prompts, live_target, boundary, dispatch_order, resume_priority, chunk, tail, surplus):
        self.cfg = SchedulerConfig(
            rollout_batch_size=big_n, n_samples_per_prompt=n, over_sampling_batch_size=big_n + extra,
            max_response_len=MAX_LEN, refill=refill, max_staleness=max_staleness, staleness_policy=policy,
            mask_offpolicy=mask_offpolicy, resume_order=order, keep_surplus=keep_surplus,
            max_inflight_samples=None if cap is None else max(cap, n),
            over_sampling="fixed" if live_target is None else "adaptive",
            target_inflight_samples=None if live_target is None else n + live_target, step_boundary=boundary,
            dispatch_order=dispatch_order, resume_priority=resume_priority, chunk_tokens=chunk,
            tail_batching=tail != "off", tail_batching_restart=tail == "restart",
            tail_extra_samples=surplus if tail != "off" else 0)
        self.width = n + self.cfg.tail_extra_samples  # sample id = group id x width + slot
        self.data = prompts(n_prompts)
        self.sched = Scheduler(self.cfg, self.data)
        self.version = -1
        self.engine: dict[int, int] = {}  # sample id -> dispatch version, for requests the engine holds
        self.budget_end: dict[int, int] = {}  # sample id -> response length at which its request's budget ends
        self.to_abort: set[int] = set()
        self.fed: dict[int, int] = {}  # response tokens the engine produced per sample
        self.last_version: dict[int, int] = {}
        self.pending: list[int] = []  # popped groups awaiting reward
        self.alive: set[int] = set()
        self.gone: set[int] = set()  # trained or filtered
        self.trained_groups: set[int] = set()
        self.cancelled: set[int] = set()  # samples seen cancelled (final: never dispatched again)
        self.env_pos: dict[int, set[int]] = {}  # response positions the environment inserted, per sample
        self.waited: set[int] = set()  # samples handed to the environment and not answered yet
        event(f"over_sampling={self.cfg.over_sampling}")
        event(f"step_boundary={boundary}")
        event(f"chunk_tokens={chunk}")
        event(f"tail_batching={tail}")
        event(f"tail_extra_samples={self.cfg.tail_extra_samples}")

    @property
    def carry(self) -> bool:
        return self.cfg.step_boundary == "carry"

    @property
    def enforced(self) -> bool:
        return self.cfg.max_staleness is not None and self.cfg.staleness_policy in ("restart", "drop")

    @property
    def restarts(self) -> bool:
        """Whether the scheduler may discard tokens: the staleness restart or tail batching's restart."""
        return (self.enforced and self.cfg.staleness_policy == "restart") or self.cfg.tail_batching_restart

    @property
    def takes_back(self) -> bool:
        """Whether a popped group may be taken back before its reward (restarted or dropped)."""
        return self.enforced or self.cfg.tail_batching_restart

    # ------------------------------------------------------------------ rules

    @rule(bump=st.integers(0, 2))
    def begin_step(self, bump):
        if not (not self.sched.step_open):
            return
        self.version = max(self.version, 0) + bump
        self.sched.begin_step(self.version)
        # What still runs after begin_step was carried (abort: nothing runs between steps).
        carried = len(self.sched.sample_ids("running"))
        assert self.sched.stats()["carried_samples"] == carried
        if self.carry:
            event("samples carried" if carried else "nothing carried")
        else:
            assert carried == 0

    @rule()
    def dispatch(self):
        if not (self.sched.step_open):
            return
        for r in self.sched.dispatch():
            assert r.sample_id not in self.engine, "dispatched twice"
            assert r.sample_id not in self.cancelled, "a cancelled sample was dispatched"
            done = r.input_ids.size - r.prompt_len
            self._reconcile(r.sample_id, done)
            assert np.array_equal(r.input_ids[:r.prompt_len], np.asarray(self.data[r.prompt_index].token_ids))
            assert np.array_equal(r.input_ids[r.prompt_len:], token_at(r.sample_id, np.arange(done)))
            chunk = self.cfg.chunk_tokens
            assert r.max_new_tokens == (MAX_LEN - done if chunk is None else min(MAX_LEN - done, chunk))
            assert r.is_resume == (done > 0) and (r.is_resume or not r.is_continuation)
            assert done < r.predicted_len <= MAX_LEN
            self.engine[r.sample_id] = self.version
            self.budget_end[r.sample_id] = done + r.max_new_tokens

    def _chunk(self, sid: int, count: int, use_current: bool):
        start = self.fed.get(sid, 0)
        count = min(count, self.budget_end[sid] - start)
        floor = max(self.engine[sid], self.last_version.get(sid, -1))
        version = self.version if use_current else floor
        return np.arange(start, start + count), version

    def _fed(self, sid: int, pos: np.ndarray, version: int) -> None:
        if pos.size:
            self.fed[sid] = int(pos[-1]) + 1
            self.last_version[sid] = version

    def _env_mask(self, sid: int, k: int) -> np.ndarray:
        mask = np.zeros(k, bool)
        mask[[t for t in self.env_pos.get(sid, ()) if t < k]] = True
        return mask

    def _logprobs(self, sid: int, k: int) -> np.ndarray:
        """The behavior logprobs the scheduler must hold: the engine's, 0.0 on env tokens."""
        return np.where(self._env_mask(sid, k), np.float32(0.0), logprob_at(np.arange(k))).astype(np.float32)

    @rule(data=st.data(), count=st.integers(0, 2), use_current=st.booleans())
    def env_wait(self, data, count, use_current):
        """The engine's request ends at a stop token and the trajectory goes on: the sample waits for its env."""
        if not self.engine:
            return
        sid = data.draw(st.sampled_from(sorted(self.engine)))
        pos, version = self._chunk(sid, count, use_current)
        fed = self.fed.get(sid, 0)
        ends_in_env = fed > 0 and (fed - 1) in self.env_pos.get(sid, ())
        before = self.sched.state_dict()
        try:
            self.sched.on_env_wait(sid, token_at(sid, pos), logprob_at(pos), version)
        except InvalidStateError:
            assert pos.size == 0 and (fed == 0 or ends_in_env), "a turn with a model token was refused"
            assert self.sched.state_dict() == before, "a rejected env_wait changed the state"
            event("env_wait refused")
            return
        assert pos.size > 0 or (fed > 0 and not ends_in_env), "a turn without a model token waits"
        self._fed(sid, pos, version)
        del self.engine[sid]
        self.to_abort.discard(sid)
        try:
            view = self.sched.sample(sid)
        except UnknownIdError:  # its return let a pending staleness drop take the group
            assert self.enforced and self.cfg.staleness_policy == "drop"
            return
        if view.state == "waiting_env":
            assert self.fed[sid] < MAX_LEN
            self.waited.add(sid)
            event("sample waits for its environment")
        elif view.state == "done":  # a turn at the cap: no observation fits
            assert self.fed[sid] == MAX_LEN
        elif view.state == "queued":  # stale on its return: restarted at once
            assert self.restarts and view.token_ids.size == 0
        else:
            assert view.state == "cancelled", f"a turn handed to the environment left the sample {view.state}"

    @rule(data=st.data(), count=st.integers(1, 3))
    def env_tokens(self, data, count):
        waiting = self.sched.sample_ids("waiting_env")
        if not waiting:
            return
        sid = data.draw(st.sampled_from(waiting))
        start = self.fed.get(sid, 0)
        pos = np.arange(start, min(start + count, MAX_LEN))
        assert pos.size > 0, "a sample waits at the length cap"
        self.sched.on_env_tokens_batch([sid], [pos.size], token_at(sid, pos))
        self.fed[sid] = int(pos[-1]) + 1
        self.env_pos.setdefault(sid, set()).update(pos.tolist())
        self.waited.discard(sid)
        state = self.sched.sample(sid).state
        assert state == ("done" if self.fed[sid] == MAX_LEN else "queued")
        event("env tokens")

    @rule(data=st.data(), reason=st.sampled_from(["stop", "length"]))
    def env_finish(self, data, reason):
        waiting = self.sched.sample_ids("waiting_env")
        if not waiting:
            return
        sid = data.draw(st.sampled_from(waiting))
        self.sched.on_finish(sid, reason)
        self.waited.discard(sid)
        assert self.sched.sample(sid).state == "done"
        event("environment ended the trajectory")

    @rule(data=st.data(), count=st.integers(0, 3), use_current=st.booleans())
    def tokens(self, data, count, use_current):
        if not (self.engine):
            return
        sid = data.draw(st.sampled_from(sorted(self.engine)))
        pos, version = self._chunk(sid, count, use_current)
        self.sched.on_tokens_batch([sid], [pos.size], token_at(sid, pos), logprob_at(pos), [version])
        self._fed(sid, pos, version)

    @rule(data=st.data(), reason=st.sampled_from(["stop", "length", "abort"]), count=st.integers(0, 2),
          use_current=st.booleans())
    def finish(self, data, reason, count, use_current):
        if not (self.engine):
            return
        sid = data.draw(st.sampled_from(sorted(self.engine)))
        pos, version = self._chunk(sid, count, use_current)
        self.sched.on_finish(sid, reason, token_at(sid, pos), logprob_at(pos), version)
        self._fed(sid, pos, version)
        del self.engine[sid]
        self.to_abort.discard(sid)
        self._check_chunk_boundary(sid, reason)

    @rule(data=st.data())
    def finish_chunk(self, data):
        """A request generates its whole budget and ends with a length finish: a chunk boundary below the cap."""
        if not (self.engine):
            return
        sid = data.draw(st.sampled_from(sorted(self.engine)))
        pos, version = self._chunk(sid, MAX_LEN, True)
        self.sched.on_finish(sid, "length", token_at(sid, pos), logprob_at(pos), version)
        self._fed(sid, pos, version)
        del self.engine[sid]
        self.to_abort.discard(sid)
        self._check_chunk_boundary(sid, "length")

    def _check_chunk_boundary(self, sid: int, reason: str) -> None:
        """A length finish after exactly a chunk's budget, below the cap, queues the sample again (unless a
        staleness drop took its group)."""
        if reason != "length" or self.cfg.chunk_tokens is None:
            return
        if not self.fed.get(sid, 0) == self.budget_end[sid] < MAX_LEN:
            return
        event("chunk boundary")
        try:
            state = self.sched.sample(sid).state
            assert state == "queued" or (state == "cancelled" and self.cfg.tail_extra_samples), \
                "a chunk boundary finished the sample"
        except UnknownIdError:
            assert self.enforced and self.cfg.staleness_policy == "drop"

    @rule(count=st.integers(0, 2), stop=st.booleans())
    def finish_all(self, count, stop):
        """The engine's whole batch finishes at once (drives steps to completion)."""
        if not (self.engine):
            return
        ids, counts, toks, lps, vers = [], [], [], [], []
        for sid in sorted(self.engine):
            pos, version = self._chunk(sid, count, True)
            ids.append(sid)
            counts.append(pos.size)
            toks.append(token_at(sid, pos))
            lps.append(logprob_at(pos))
            vers.append(version)
            self._fed(sid, pos, version)
        reasons = [0 if stop else (1 if sid % 2 else 2) for sid in ids]
        self.sched.on_finish_batch(ids, reasons, counts, np.concatenate(toks), np.concatenate(lps), vers)
        self.engine.clear()
        self.to_abort.clear()

    @rule()
    def accept_all(self):
        if not (self.pending):
            return
        for gid in list(self.pending):
            self.pending.remove(gid)
            n = self.cfg.n_samples_per_prompt
            try:
                self.sched.report_rewards(gid, [float(i % 2) for i in range(n)], True)
            except (UnknownIdError, InvalidStateError):
                assert self.takes_back, "only a restart or a staleness drop may take a popped group back"

    @rule()
    def request_aborts(self):
        if not (self.sched.step_open):
            return
        ids = self.sched.samples_to_abort()
        surplus = self.cfg.tail_extra_samples > 0  # cancelled surplus samples are aborted at any time
        if ids and not self.carry:
            assert self.sched.step_done or surplus
        if ids and self.carry:  # only stale carried samples, long-queue samples restarting, or surplus ones
            assert self.takes_back or surplus
            event("carried samples aborted")
        for sid in ids:
            assert sid in self.engine and sid not in self.to_abort
            assert self.sched.sample(sid).state == "aborting"
        self.to_abort.update(ids)

    @rule(data=st.data(), count=st.integers(0, 2))
    def abort_result(self, data, count):
        if not (self.to_abort):
            return
        sid = data.draw(st.sampled_from(sorted(self.to_abort)))
        pos, version = self._chunk(sid, count, False)
        self.sched.on_finish_batch([sid], [2], [pos.size], token_at(sid, pos), logprob_at(pos), [version])
        self._fed(sid, pos, version)
        del self.engine[sid]
        self.to_abort.discard(sid)
        if sid in self.sched.sample_ids("cancelled"):
            event("surplus abort result dropped")

    @rule()
    def pop_completed(self):
        for g in self.sched.pop_completed_groups():
            assert g.group_id not in self.trained_groups
            sids = g.sample_ids.tolist()
            assert len(sids) == self.cfg.n_samples_per_prompt and sids == sorted(set(sids))
            assert all(sid // self.width == g.group_id for sid in sids), "a group handed out with another's sample"
            for sid, resp in zip(g.sample_ids, g.responses):
                assert np.array_equal(resp, token_at(int(sid), np.arange(self.fed.get(int(sid), 0))))
            if g.group_id in self.pending:  # restarted while it waited for its reward, completed again
                assert self.takes_back, "a group is handed out twice"
                event("restarted group completed again")
                continue
            self.pending.append(g.group_id)

    @rule(data=st.data(), equal=st.booleans(), accepted=st.booleans())
    def report_rewards(self, data, equal, accepted):
        if not (self.pending):
            return
        gid = data.draw(st.sampled_from(self.pending))
        self.pending.remove(gid)
        n = self.cfg.n_samples_per_prompt
        rewards = [1.0] * n if equal else [float(i % 2) for i in range(n)]
        try:
            self.sched.report_rewards(gid, rewards, accepted and not equal)
        except (UnknownIdError, InvalidStateError):
            assert self.takes_back, "only a restart or a staleness drop may take a popped group back"
            return
        if not (accepted and not equal):
            self.gone.update(range(gid * self.width, (gid + 1) * self.width))

    @rule()
    def take_batch(self):
        if not (self.sched.step_open):
            return
        if not self.sched.step_done or (self.sched.sample_ids("running") and not self.carry):
            try:
                self.sched.take_batch()
            except InvalidStateError:
                return
            raise AssertionError("take_batch succeeded before the step was done and aborted")
        self._take_and_check()

    @rule(data=st.data())
    def finish_group(self, data):
        """Every sample of one group the engine holds finishes (the others keep running)."""
        if not self.engine:
            return
        gid = data.draw(st.sampled_from(sorted({sid // self.width for sid in self.engine})))
        for sid in sorted(s for s in self.engine if s // self.width == gid):
            pos, version = self._chunk(sid, 1, True)
            self.sched.on_finish(sid, "stop", token_at(sid, pos), logprob_at(pos), version)
            self._fed(sid, pos, version)
            del self.engine[sid]
            self.to_abort.discard(sid)

    @rule(data=st.data(), stop=st.booleans(), turns=st.integers(1, 3), whole=st.booleans())
    def progress(self, data, stop, turns, whole):
        """Turns of the step loop: dispatch, the engine finishes everything (or one group), rewards accept all."""
        if not self.sched.step_open:
            self.begin_step(1)
        for _ in range(turns):
            if self.sched.step_done:
                return
            self.dispatch()
            if self.engine and whole:
                self.finish_all(1, stop)
            elif self.engine:
                self.finish_group(data)
            self.pop_completed()
            self.accept_all()

    @rule(data=st.data(), turns=st.integers(1, 3), answer=st.booleans())
    def env_turns(self, data, turns, answer):
        """Multi-turn steps: dispatch, the engine's requests end their turns and wait for the environment, which
        answers each (an observation, or the end of the trajectory), then rewards accept all."""
        if not self.sched.step_open:
            self.begin_step(1)
        for _ in range(turns):
            self.dispatch()
            for _ in range(len(self.engine)):
                self.env_wait(data, 1, True)
            for _ in range(len(self.sched.sample_ids("waiting_env"))):
                if answer:
                    self.env_tokens(data, 1)
                else:
                    self.env_finish(data, "stop")
            self.pop_completed()
            self.accept_all()

    @rule(count=st.integers(0, 2), bump=st.sampled_from([None, 1, 2]))
    def end_step(self, count, bump):
        """Once done: abort what runs (with partial output; nothing in carry mode), then take and check the
        batch, and begin the next step ``bump`` versions on."""
        if not (self.sched.step_open and self.sched.step_done):
            return
        self.request_aborts()
        self._abort_all(count)
        self._take_and_check()
        if bump is not None:
            self.begin_step(bump)

    def _abort_all(self, count: int) -> None:
        for sid in sorted(self.to_abort):
            pos, version = self._chunk(sid, count, False)
            self.sched.on_finish(sid, "abort", token_at(sid, pos), logprob_at(pos), version)
            self._fed(sid, pos, version)
            del self.engine[sid]
        self.to_abort.clear()

    def _take_and_check(self) -> None:
        stats_before = self.sched.stats()
        done_before = set(self.sched.sample_ids("done"))
        batch = self.sched.take_batch()
        if not self.cfg.keep_surplus:  # completed extras are dropped with the batch, also popped unrewarded ones
            dropped = done_before - set(batch.sample_ids.tolist()) - set(self.sched.sample_ids("done"))
            dropped_groups = {sid // self.width for sid in dropped}
            self.gone |= {gid * self.width + i for gid in dropped_groups for i in range(self.width)}
            self.pending = [gid for gid in self.pending if gid not in dropped_groups]
        event(f"batch of {batch.n_groups} groups")
        n, big_n = self.cfg.n_samples_per_prompt, self.cfg.rollout_batch_size
        if batch.n_groups != big_n:
            assert batch.n_groups < big_n and stats_before["data_exhausted"]
        assert batch.n_samples == batch.n_groups * n
        v = batch.policy_version
        for j in range(batch.n_groups):
            sids = batch.sample_ids[j * n:(j + 1) * n].tolist()
            gid = sids[0] // self.width
            assert sids == sorted(set(sids)) and all(sid // self.width == gid for sid in sids), \
                "a group is trained without n samples of its own"
            assert gid not in self.trained_groups, "a group is trained twice"
            self.trained_groups.add(gid)
            self.gone.update(range(gid * self.width, (gid + 1) * self.width))  # its cancelled slots go with it
        for i in range(batch.n_samples):
            sid = int(batch.sample_ids[i])
            lo, hi, p = batch.offsets[i], batch.offsets[i + 1], batch.prompt_lens[i]
            resp = np.arange(hi - lo - p)
            assert resp.size == self.fed.get(sid, 0)
            assert np.array_equal(batch.tokens[lo + p:hi], token_at(sid, resp))
            assert np.array_equal(batch.behavior_logprobs[lo + p:hi], self._logprobs(sid, resp.size))
            env = self._env_mask(sid, resp.size)
            vers, mask = batch.versions[lo + p:hi], batch.loss_mask[lo + p:hi]
            assert np.all(vers[env] == -1) and np.all(mask[env] == 0), "an env token is trained or has a version"
            model = vers[~env]
            assert np.all(np.diff(model) >= 0) and np.all(model <= v)
            s = self.cfg.max_staleness
            if s is not None and self.cfg.staleness_policy in ("restart", "drop"):
                assert np.all(model >= v - s), "a sample staler than max_staleness was trained"
            expect = np.ones_like(mask)
            expect[env] = 0
            if s is not None and self.cfg.staleness_policy == "mask":
                expect[~env & (vers < v - s)] = 0
            if self.cfg.mask_offpolicy:
                expect[~env & (vers != v)] = 0
            assert np.array_equal(mask, expect)
            self.gone.add(sid)

    @rule()
    def save_and_load(self):
        restored = Scheduler(self.cfg, self.data)
        restored.load_state_dict(self.sched.state_dict())
        self.sched = restored
        event("save and load")
        # A restart loses the engine's requests; their samples come back buffered.
        self.engine.clear()
        self.to_abort.clear()
        self.pending.clear()  # (waiting samples stay waiting: checked by the invariants)

    @rule(data=st.data(), kind=st.integers(0, 9))
    def bad_input(self, data, kind):
        before = self.sched.state_dict()
        idle = sorted(set(self.sched.sample_ids("queued")) | set(self.sched.sample_ids("done"))
                      | set(self.sched.sample_ids("cancelled")))
        waiting = self.sched.sample_ids("waiting_env")
        not_waiting = sorted(set(idle) | set(self.engine))
        try:
            if kind == 0:
                self.sched.on_tokens(10**9, [1], [0.0], max(self.version, 0))
            elif kind == 1 and idle:
                self.sched.on_tokens(data.draw(st.sampled_from(idle)), [1], [0.0], max(self.version, 0))
            elif kind == 2 and self.engine:
                self.sched.on_tokens(data.draw(st.sampled_from(sorted(self.engine))), [1, 2], [0.0], self.version)
            elif kind == 3 and idle:
                self.sched.on_finish(data.draw(st.sampled_from(idle)), "stop")
            elif kind == 4 and self.pending:
                self.sched.report_rewards(self.pending[0], [0.0] * (self.cfg.n_samples_per_prompt + 1))
            elif kind == 5 and self.sched.step_open and not self.sched.step_done:
                self.sched.take_batch()
            elif kind == 6 and not_waiting:  # an observation for a sample that does not wait for one
                self.sched.on_env_tokens(data.draw(st.sampled_from(not_waiting)), [1])
            elif kind == 7 and waiting:  # model tokens, an abort or a second env_wait while it waits
                sid = data.draw(st.sampled_from(waiting))
                how = data.draw(st.integers(0, 3))
                if how == 0:
                    self.sched.on_tokens(sid, [1], [0.0], max(self.version, 0))
                elif how == 1:
                    self.sched.on_finish(sid, "abort")
                elif how == 2:
                    self.sched.on_env_wait(sid)
                else:
                    self.sched.on_finish(sid, "stop", [1], [0.0], max(self.version, 0))
            elif kind == 8 and waiting:  # an empty observation, or one past the cap
                sid = data.draw(st.sampled_from(waiting))
                room = MAX_LEN - self.sched.sample(sid).token_ids.size
                self.sched.on_env_tokens(sid, [1] * (0 if data.draw(st.booleans()) else room + 1))
            elif kind == 9 and len(waiting) >= 1:  # a batch with one bad observation changes nothing
                sid = data.draw(st.sampled_from(waiting))
                self.sched.on_env_tokens_batch([sid, sid], [1, 1], [1, 2])
            else:
                return
        except (UnknownIdError, InvalidStateError, InvalidArgumentError):
            assert self.sched.state_dict() == before, "a rejected call changed the state"
            return
        except AprilError as e:
            raise AssertionError(f"unexpected error class {type(e).__name__}") from e
        raise AssertionError("bad input was accepted")

    # ------------------------------------------------------------------ invariants

    def _reconcile(self, sid: int, length: int) -> None:
        """The scheduler holds ``length`` response tokens of ``sid``: all the engine sent, or none after a restart."""
        if length < self.fed.get(sid, 0):
            assert length == 0 and self.restarts, "tokens lost"
            self.fed[sid] = 0
            self.last_version.pop(sid, None)
            self.env_pos.pop(sid, None)
            self.waited.discard(sid)  # a restart takes a waiting trajectory back to its prompt
            event("sample restarted")
        assert length == self.fed.get(sid, 0)

    @invariant()
    def samples_consistent(self):
        if not hasattr(self, "sched"):
            return
        present: dict[int, str] = {}
        for state in STATES:
            for sid in self.sched.sample_ids(state):
                assert sid not in present, "a sample is in two states"
                present[sid] = state
        for sid, state in present.items():
            view = self.sched.sample(sid)
            k = view.token_ids.size
            if state == "cancelled":  # its tokens are discarded, for good
                assert k == 0 and sid not in self.engine
                self.cancelled.add(sid)
                self.gone.add(sid)  # not lost when its group goes
                self.fed[sid] = 0
                self.last_version.pop(sid, None)
                self.env_pos.pop(sid, None)
                self.waited.discard(sid)
                continue
            assert sid not in self.cancelled, "a cancelled sample came back"
            assert k == view.logprobs.size == view.versions.size <= MAX_LEN
            self._reconcile(sid, k)
            assert np.array_equal(view.token_ids, token_at(sid, np.arange(k)))
            env = self._env_mask(sid, k)
            assert np.array_equal(view.logprobs, self._logprobs(sid, k))
            assert np.array_equal(view.env_mask.astype(bool), env), "an env run was lost or moved"
            assert np.all(view.versions[env] == -1)
            assert np.all(np.diff(view.versions[~env]) >= 0), "model versions decrease across env runs"
            assert k == 0 or not env[0], "a response starts with env tokens"
            assert (state in ("running", "aborting")) == (sid in self.engine)
            if state == "waiting_env":
                assert sid in self.waited, "a sample waits that was not handed to its environment"
                assert 0 < k < MAX_LEN and not env[-1]
            else:
                assert sid not in self.waited, f"a waiting sample became {state} without an env answer"
        assert set(self.engine) <= set(present)
        for limit in (self.cfg.max_inflight_samples, self.cfg.target_inflight_samples):
            if limit is not None:
                assert len(self.engine) <= limit, "more samples in flight than the cap or the adaptive target"
        missing = self.alive - set(present) - self.gone
        if missing:
            assert self.enforced and self.cfg.staleness_policy == "drop", f"samples lost: {sorted(missing)}"
            self.gone |= missing
            event("group dropped for staleness")
        self.alive |= set(present)

    @invariant()
    def counts_consistent(self):
        """The counters agree with the samples: in flight = what the engine holds, buffered = partials held
        for a resume, every group either buffered or surplus."""
        if not hasattr(self, "sched"):
            return
        stats = self.sched.stats()
        aborting = self.sched.sample_ids("aborting")
        partials = [sid for sid in self.sched.sample_ids("queued") if self.sched.sample(sid).token_ids.size]
        assert len(self.sched.sample_ids("running")) + len(aborting) == len(self.engine)
        assert stats["buffered_samples"] == len(aborting) + len(partials)
        assert stats["waiting_env_samples"] == len(self.sched.sample_ids("waiting_env"))
        assert stats["buffered_tokens"] == sum(self.sched.sample(sid).token_ids.size for sid in aborting + partials)
        groups: dict[int, list[str]] = {}
        for state in STATES:
            for sid in self.sched.sample_ids(state):
                groups.setdefault(sid // self.width, []).append(state)
        assert stats["buffered_groups"] + stats["surplus_groups"] == len(groups)
        n = self.cfg.n_samples_per_prompt
        for states in groups.values():  # a group keeps n samples at least, and n done at most
            assert len(states) == self.width
            assert states.count("done") <= n <= len(states) - states.count("cancelled")

    @invariant()
    def running_samples_within_the_staleness_bound(self):
        """Under restart / drop, a running sample (carried ones too) never holds or gets a token past the bound."""
        if not hasattr(self, "sched") or not self.enforced:
            return
        for sid in self.sched.sample_ids("running"):
            versions = self.sched.sample(sid).versions
            oldest = int(versions[0]) if versions.size else self.engine[sid]
            assert self.version - oldest <= self.cfg.max_staleness, "a stale sample keeps running"

    @invariant()
    def long_rounds_do_not_over_sample(self):
        """A long round launches only replacements of long-queue groups the filter rejected (or staleness
        dropped); tail_batching_restart leaves no older token in a long round's running or queued work."""
        if not hasattr(self, "sched"):
            return
        stats = self.sched.stats()
        if not self.cfg.tail_batching:
            assert stats["long_round"] == 0 and stats["long_queue_groups"] == 0
            return
        if stats["long_round"]:
            event("long round")
            assert stats["groups_launched"] <= stats["groups_filtered"] + stats["groups_dropped_stale"]
            if self.cfg.tail_batching_restart:
                for sid in self.sched.sample_ids("running"):
                    view = self.sched.sample(sid)
                    model = view.versions[view.env_mask == 0]
                    assert np.all(model == self.version), "an older token runs on"


SchedulerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
TestScheduler = SchedulerMachine.TestCase


class CarryMachine(SchedulerMachine):
    """The same rules in carry mode, with shapes that leave samples running at the step boundary: over-sampling,
    enough prompts, a live target above one group."""

    @initialize(n=st.integers(1, 3), big_n=st.integers(1, 2), extra=st.integers(1, 2),
                refill=st.sampled_from(["batch", "continuous"]),
                policy=st.sampled_from(["keep", "mask", "restart", "drop"]),
                max_staleness=st.sampled_from([None, 0, 1]), mask_offpolicy=st.booleans(),
                order=st.sampled_from(["oldest_first", "newest_first", "longest_first"]),
                keep_surplus=st.booleans(), cap=st.sampled_from([None, 5]), n_prompts=st.integers(12, 40),
                live_target=st.sampled_from([None, 4]), dispatch_order=st.sampled_from(DISPATCH_ORDERS),
                resume_priority=st.booleans(), chunk=st.sampled_from([None, 2]), tail=st.sampled_from(TAILS),
                surplus=st.integers(0, 2))
    def setup(self, **kw):
        super().setup(boundary="carry", **kw)

    @rule(data=st.data(), bump=st.integers(1, 2))
    def carry_step(self, data, bump):
        """A whole step that ends with samples running: groups finish one at a time until N are accepted,
        the batch is taken and the next step begins with what still runs."""
        if not self.sched.step_open:
            self.begin_step(bump)
        for _ in range(8):
            if self.sched.step_done:
                break
            self.dispatch()
            if self.engine:
                self.tokens(data, 1, True)
                self.finish_group(data)
            self.pop_completed()
            self.accept_all()
        self.end_step(0, bump)


CarryMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestCarry = CarryMachine.TestCase


class TailMachine(CarryMachine):
    """The same rules with tail batching on (partials kept, or restarted), either boundary, and shapes whose steps
    end with groups still generating, so that the long queue fills and long rounds run."""

    @initialize(n=st.integers(1, 3), big_n=st.integers(1, 2), extra=st.integers(1, 3),
                refill=st.sampled_from(["batch", "continuous"]),
                policy=st.sampled_from(["keep", "mask", "restart", "drop"]),
                max_staleness=st.sampled_from([None, 0, 1]), mask_offpolicy=st.booleans(),
                order=st.sampled_from(["oldest_first", "newest_first", "longest_first"]),
                keep_surplus=st.booleans(), cap=st.sampled_from([None, 5]), n_prompts=st.integers(8, 30),
                live_target=st.sampled_from([None, 4]), boundary=st.sampled_from(["abort", "carry"]),
                dispatch_order=st.sampled_from(DISPATCH_ORDERS), resume_priority=st.booleans(),
                chunk=st.sampled_from([None, 2]), tail=st.sampled_from(TAILS[1:]), surplus=st.integers(0, 2))
    def setup(self, **kw):
        SchedulerMachine.setup(self, **kw)


TailMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=60, deadline=None,
                                         suppress_health_check=[HealthCheck.too_slow])
TestTail = TailMachine.TestCase
