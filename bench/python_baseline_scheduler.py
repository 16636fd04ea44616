"""The same rollout bookkeeping in plain Python (lists and dicts), as RL frameworks keep it today.

Baseline for bench_scheduler.py: per-token lists of token ids, logprobs and versions per sample, dicts by
id, numpy only when the batch is packed. Same call shapes as april_ext.Scheduler's batch calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class PySample:
    sample_id: int
    group_id: int
    state: str = "queued"
    finish: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class PyGroup:
    group_id: int
    prompt: list[int]
    samples: list[PySample]
    rewards: list[float] | None = None
    accepted: bool = False


class PythonScheduler:
    def __init__(self, rollout_batch_size: int, n_samples_per_prompt: int, over_sampling_batch_size: int,
                 max_response_len: int, prompts: list[list[int]]) -> None:
        self.n_batch = rollout_batch_size
        self.n = n_samples_per_prompt
        self.n_over = over_sampling_batch_size
        self.max_len = max_response_len
        self.prompts = prompts
        self.position = 0
        self.version = 0
        self.groups: dict[int, PyGroup] = {}
        self.samples: dict[int, PySample] = {}
        self.completed: list[int] = []
        self.accepted: list[int] = []

    def begin_step(self, version: int) -> None:
        self.version = version

    def dispatch(self) -> list[tuple[int, list[int], int, bool]]:
        active = sum(1 for g in self.groups.values() if any(s.state != "done" for s in g.samples))
        for _ in range(max(0, self.n_over - active - len(self.accepted))):
            gid = self.position
            group = PyGroup(gid, self.prompts[self.position], [PySample(gid * self.n + i, gid) for i in range(self.n)])
            self.position += 1
            self.groups[gid] = group
            for s in group.samples:
                self.samples[s.sample_id] = s
        queued = [s for s in self.samples.values() if s.state == "queued"]
        queued.sort(key=lambda s: (len(s.tokens) == 0, s.group_id))
        out = []
        for s in queued:
            s.state = "running"
            prompt = self.groups[s.group_id].prompt
            out.append((s.sample_id, prompt + s.tokens, self.max_len - len(s.tokens), bool(s.tokens)))
        return out

    def on_tokens_batch(self, sample_ids, counts, tokens, logprobs, versions) -> None:
        pos = 0
        tokens = tokens.tolist()
        logprobs = logprobs.tolist()
        for sid, count, version in zip(sample_ids.tolist(), counts.tolist(), versions.tolist()):
            s = self.samples[sid]
            if s.state not in ("running", "aborting"):
                raise RuntimeError(f"sample {sid} is not running")
            if len(s.tokens) + count > self.max_len:
                raise ValueError(f"sample {sid} over max_response_len")
            s.tokens.extend(tokens[pos:pos + count])
            s.logprobs.extend(logprobs[pos:pos + count])
            s.versions.extend([version] * count)
            pos += count

    def on_finish_batch(self, sample_ids, reasons) -> None:
        for sid, reason in zip(sample_ids.tolist(), reasons.tolist()):
            s = self.samples[sid]
            if reason == 2:
                s.state = "queued"
                continue
            s.state = "done"
            s.finish = reason
            group = self.groups[s.group_id]
            if all(x.state == "done" for x in group.samples):
                self.completed.append(group.group_id)

    def pop_completed_groups(self) -> list[int]:
        out, self.completed = self.completed, []
        return out

    def report_rewards(self, group_id: int, rewards: list[float], accepted: bool) -> None:
        group = self.groups[group_id]
        group.rewards = list(rewards)
        if accepted:
            group.accepted = True
            self.accepted.append(group_id)
        else:
            del self.groups[group_id]

    def samples_to_abort(self) -> list[int]:
        out = [s.sample_id for s in self.samples.values() if s.state == "running"]
        for sid in out:
            self.samples[sid].state = "aborting"
        return out

    def take_batch(self) -> dict[str, np.ndarray]:
        tokens, mask, logprobs, versions, offsets, rewards = [], [], [], [], [0], []
        taken, self.accepted = self.accepted[:self.n_batch], self.accepted[self.n_batch:]
        for gid in taken:
            group = self.groups.pop(gid)
            for s, r in zip(group.samples, group.rewards):
                tokens += group.prompt + s.tokens
                mask += [0] * len(group.prompt) + [1] * len(s.tokens)
                logprobs += [0.0] * len(group.prompt) + s.logprobs
                versions += [-1] * len(group.prompt) + s.versions
                offsets.append(len(tokens))
                rewards.append(r)
                del self.samples[s.sample_id]
        return {"tokens": np.array(tokens, np.int32), "loss_mask": np.array(mask, np.uint8),
                "behavior_logprobs": np.array(logprobs, np.float32), "versions": np.array(versions, np.int32),
                "offsets": np.array(offsets, np.int64), "rewards": np.array(rewards, np.float32)}
