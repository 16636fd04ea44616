"""The minimal rollout bookkeeping in plain Python: a dict of lists, as RL frameworks keep it today.

Baseline for bench_scheduler.py. Per sample id one entry of three lists (token ids, logprobs, one version
per token) that events append to; a state per sample; no validation at all, so it is the least work any
Python bookkeeping can do. numpy only when the batch is packed. Same call shapes as april_ext.Scheduler's
batch calls.
"""

from __future__ import annotations

import numpy as np


class PythonScheduler:
    def __init__(self, rollout_batch_size: int, n_samples_per_prompt: int, over_sampling_batch_size: int,
                 max_response_len: int, prompts: list[list[int]]) -> None:
        self.n_batch = rollout_batch_size
        self.n = n_samples_per_prompt
        self.n_over = over_sampling_batch_size
        self.max_len = max_response_len
        self.prompts = prompts
        self.position = 0
        self.samples: dict[int, tuple[list[int], list[float], list[int]]] = {}  # tokens, logprobs, versions
        self.state: dict[int, int] = {}  # sample id -> QUEUED, RUNNING, ABORTING or DONE
        self.done: dict[int, int] = {}  # live group id -> samples done
        self.rewards: dict[int, list[float]] = {}
        self.completed: list[int] = []
        self.accepted: list[int] = []

    QUEUED, RUNNING, ABORTING, DONE = range(4)

    def begin_step(self, version: int) -> None:
        self.version = version

    def dispatch(self) -> list[tuple[int, list[int], int, bool]]:
        for _ in range(max(0, self.n_over - len(self.done) - len(self.accepted))):
            gid = self.position
            self.position += 1
            self.done[gid] = 0
            for sid in range(gid * self.n, (gid + 1) * self.n):
                self.samples[sid] = ([], [], [])
                self.state[sid] = self.QUEUED
        out = []
        for sid, state in self.state.items():
            if state == self.QUEUED:
                self.state[sid] = self.RUNNING
                tokens = self.samples[sid][0]
                out.append((sid, self.prompts[sid // self.n] + tokens, self.max_len - len(tokens), bool(tokens)))
        return out

    def on_tokens_batch(self, sample_ids, counts, tokens, logprobs, versions) -> None:
        samples = self.samples
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        pos = 0
        for sid, count, version in zip(sample_ids.tolist(), counts.tolist(), versions.tolist()):
            end = pos + count
            toks, lps, vers = samples[sid]
            toks += tokens[pos:end]
            lps += logprobs[pos:end]
            vers += [version] * count
            pos = end

    def on_finish_batch(self, sample_ids, reasons) -> None:
        state, done, n = self.state, self.done, self.n
        for sid, reason in zip(sample_ids.tolist(), reasons.tolist()):
            if reason == 2:
                state[sid] = self.QUEUED
                continue
            state[sid] = self.DONE
            gid = sid // n
            done[gid] += 1
            if done[gid] == n:
                del done[gid]
                self.completed.append(gid)

    def pop_completed_groups(self) -> list[int]:
        out, self.completed = self.completed, []
        return out

    def report_rewards(self, group_id: int, rewards: list[float], accepted: bool) -> None:
        self.rewards[group_id] = list(rewards)
        if accepted:
            self.accepted.append(group_id)

    def samples_to_abort(self) -> list[int]:
        out = [sid for sid, state in self.state.items() if state == self.RUNNING]
        for sid in out:
            self.state[sid] = self.ABORTING
        return out

    def take_batch(self) -> dict[str, np.ndarray]:
        tokens, mask, logprobs, versions, offsets, rewards = [], [], [], [], [0], []
        taken, self.accepted = self.accepted[:self.n_batch], self.accepted[self.n_batch:]
        for gid in taken:
            prompt = self.prompts[gid]
            for sid, reward in zip(range(gid * self.n, (gid + 1) * self.n), self.rewards.pop(gid)):
                toks, lps, vers = self.samples.pop(sid)
                del self.state[sid]
                tokens += prompt + toks
                mask += [0] * len(prompt) + [1] * len(toks)
                logprobs += [0.0] * len(prompt) + lps
                versions += [-1] * len(prompt) + vers
                offsets.append(len(tokens))
                rewards.append(reward)
        return {"tokens": np.array(tokens, np.int32), "loss_mask": np.array(mask, np.uint8),
                "behavior_logprobs": np.array(logprobs, np.float32), "versions": np.array(versions, np.int32),
                "offsets": np.array(offsets, np.int64), "rewards": np.array(rewards, np.float32)}
