"""slime's own rollout loop: waves of N' groups, relaunched while too few groups remain; without partial rollout
the unfinished and surplus groups are discarded, with it (APRIL as slime runs it) the unfinished ones are buffered.

slime's ``generate_rollout`` (rollout/sglang_rollout.py, without partial rollout) keeps a count R of the groups
launched in the step minus those the dynamic-sampling filter rejected, i.e. the groups in flight plus the groups
accepted. Whenever R < N it launches a wave of ``over_sampling_batch_size`` (N', default N) groups, again until
R >= N; it takes groups in the order they complete, drops the rejected ones (R - 1) and accepts the others until N
are accepted. Then it aborts every request still running and throws their groups away (no partial reuse; their
prompts are not returned to the data source). The scheduler's refills cannot express this (batch refill waits for
a wave to end before the next one, continuous refill launches only the groups still needed), so this driver does
it itself over the same engine.

With ``partial_rollout`` this is APRIL as the paper's runs use it (RLsys-Foundation/APRIL,
slime/rollout/sglang_example.py, ``--partial-rollout --over-sampling-batch-size N'``): each wave takes its N'
groups from the buffer first (oldest first, ``pop_first``), then fresh prompts; a buffered group keeps the samples
it completed and resumes the others as prompt + partial response with max_new_tokens reduced by what they have;
at N accepted every running request is aborted and every group still in flight goes back to the buffer with its
partial responses (groups completing beyond N in the same instant are dropped, as slime drops them). Its
generated tokens are what the requests of the step returned (``completion_tokens``), aborted ones included: the
throughput the APRIL paper reports (total completion tokens / rollout time).
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from april_ext.batch import FinishReason
from april_ext.errors import ConfigError
from april_ext.protocol.rollout_engine import RolloutEngine, engine_clock
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.rollout.step_metrics import RolloutMetrics, tail_latency
from april_ext.sim.tokens import SyntheticPrompts, answer_reward


@dataclass
class _Sample:
    tokens: list[int]
    finish: FinishReason | None = None
    finished_at: float = math.nan
    started: int = -1  # policy version of its first tokens (-1: none yet)
    before_step: int = 0  # tokens it had when the current step began

    @property
    def done(self) -> bool:
        return self.finish in (FinishReason.STOP, FinishReason.LENGTH)


@dataclass
class _Group:
    group_id: int
    prompt_index: int
    samples: list[_Sample]

    @property
    def complete(self) -> bool:
        return all(s.done for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)


@dataclass(frozen=True)
class WaveStep:
    """One step of the wave driver: the loop's metrics and the finish times of the accepted samples."""

    metrics: RolloutMetrics
    finish_times: np.ndarray


class WaveRollout:
    """slime's rollout over ``engine``: N groups of n samples accepted per step by ``group_filter`` (rewards in,
    keep or drop out; None keeps every group), waves of ``over_sampling_batch_size`` groups launched while the groups
    in flight plus those accepted are fewer than N; at N accepted the rest is aborted and discarded, or with
    ``partial_rollout`` buffered and resumed first in the next steps (APRIL as slime runs it)."""

    def __init__(self, engine: RolloutEngine, prompts: SyntheticPrompts, *, rollout_batch_size: int,
                 n_samples_per_prompt: int, over_sampling_batch_size: int, max_response_len: int,
                 group_filter: Callable[[Sequence[float]], bool] | None, partial_rollout: bool = False) -> None:
        if over_sampling_batch_size < rollout_batch_size:
            raise ConfigError(f"over_sampling_batch_size={over_sampling_batch_size} is not allowed: an int >= "
                              f"rollout_batch_size = {rollout_batch_size}")
        if not isinstance(partial_rollout, bool):
            raise ConfigError(f"partial_rollout={partial_rollout!r} is not allowed: True or False")
        self.engine = engine
        self.clock = engine_clock(engine, None)
        self.prompts = prompts
        self.n_groups = rollout_batch_size
        self.n = n_samples_per_prompt
        self.wave = over_sampling_batch_size
        self.max_response_len = max_response_len
        self.group_filter = group_filter
        self.partial_rollout = partial_rollout
        self.buffer: list[_Group] = []  # partial groups carried to the next step (partial_rollout), oldest first
        self._step_tokens = 0  # tokens the requests of the current step returned
        self._resumed_requests = 0
        self._re_prefill_tokens = 0
        self._version = 0
        self._next_prompt = 0
        self._group_ids = itertools.count()
        self._request_ids = itertools.count()

    async def run_step(self, policy_version: int) -> WaveStep:
        """One step: waves until N groups are accepted, then abort what is still running; discard it, or buffer
        it with ``partial_rollout``."""
        engine = self.engine
        start = self.clock()
        self._version = policy_version
        self._step_tokens = self._resumed_requests = self._re_prefill_tokens = 0
        for group in self.buffer:
            for s in group.samples:
                s.before_step = len(s.tokens)
        accepted: list[_Group] = []
        rejected: list[_Group] = []
        surplus: list[_Group] = []
        tasks: dict[asyncio.Task[_Group], int] = {}
        remaining = waves = launched = requests = 0
        while len(accepted) < self.n_groups:
            while remaining < self.n_groups:
                for group in self._take_groups(self.wave):
                    tasks[asyncio.create_task(self._generate(group))] = group.group_id
                    requests += sum(not s.done for s in group.samples)
                remaining += self.wave
                launched += self.wave
                waves += 1
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=tasks.__getitem__):  # same-instant completions in launch order
                del tasks[task]
                group = task.result()
                if self.group_filter is not None and not self.group_filter(self._rewards(group)):
                    rejected.append(group)
                    remaining -= 1
                elif len(accepted) < self.n_groups:
                    accepted.append(group)
                else:
                    surplus.append(group)
        done_at = self.clock()
        unfinished: list[_Group] = []
        aborted = 0
        if tasks:
            outputs = await engine.abort(None)
            aborted = len(outputs)
            unfinished = list(await asyncio.gather(*tasks))
        end = self.clock()
        if self.partial_rollout:
            self.buffer.extend(unfinished)  # in launch order: the oldest groups are resumed first
        kept = () if self.partial_rollout else unfinished
        discarded = sum(g.tokens for g in (*surplus, *kept))
        accepted.sort(key=lambda g: g.group_id)  # slime sorts the batch by sample index: creation order
        batch = [s for g in accepted for s in g.samples]
        lens = [len(s.tokens) for s in batch]
        total = sum(lens)
        carried = sum(s.before_step for s in batch)
        stale = [policy_version - (s.started if s.started >= 0 else policy_version) for s in batch]
        histogram = np.bincount(np.asarray(stale, np.int64), minlength=1).tolist() if batch else [0]
        rewards = [answer_reward(s.tokens) for s in batch]
        finished = np.array([s.finished_at if s.finished_at >= start else start for s in batch], np.float64)
        for s in batch:
            s.before_step = 0
        wall = end - start
        generated = self._step_tokens
        stats = {
            "batch_response_tokens": total, "stale_tokens_discarded": discarded, "tail_tokens_discarded": 0,
            "surplus_tokens_discarded": 0,
            "carried_token_ratio": carried / total if total else 0.0,
            "off_policy_token_ratio": carried / total if total else 0.0, "staleness_histogram": histogram,
            "re_prefill_tokens": self._re_prefill_tokens, "surplus_groups": len(surplus),
            "buffered_groups": len(self.buffer), "groups_filtered": len(rejected), "groups_launched": launched,
            "groups_discarded": len(surplus) + len(kept),
            "waves": waves, "chunk_returns": 0, "continuation_tokens": 0, "prediction_rank_corr": math.nan,
            "prediction_samples": 0, "long_round": False, "long_queue_groups": 0}
        metrics = RolloutMetrics(
            policy_version=policy_version, wall_s=wall, time_to_done_s=done_at - start, generated_tokens=generated,
            tokens_per_s=generated / wall if wall > 0 else 0.0, requests=requests,
            resumed_requests=self._resumed_requests, aborted_samples=aborted, mean_inflight_samples=math.nan,
            occupancy=math.nan, batch_groups=len(accepted),
            reward_mean=float(np.mean(rewards)) if rewards else math.nan, response_lens=lens, engine_steps=0,
            tail_share=tail_latency(finished, start, done_at) if finished.size > 1 and done_at > start else 0.0,
            scheduler=stats)
        return WaveStep(metrics, finished)

    def _take_groups(self, count: int) -> list[_Group]:
        """``count`` groups: buffered ones first (oldest first, as slime's pop_first), then fresh prompts."""
        taken = self.buffer[:count]
        del self.buffer[:count]
        return taken + [self._new_group() for _ in range(count - len(taken))]

    def _new_group(self) -> _Group:
        index = self._next_prompt
        self._next_prompt += 1
        return _Group(next(self._group_ids), index, [_Sample([]) for _ in range(self.n)])

    @staticmethod
    def _rewards(group: _Group) -> list[float]:
        return [answer_reward(s.tokens) for s in group.samples]

    async def _generate(self, group: _Group) -> _Group:
        prompt = self.prompts[group.prompt_index].token_ids
        await asyncio.gather(*(self._sample(prompt, s) for s in group.samples if not s.done))
        return group

    async def _sample(self, prompt: list[int], sample: _Sample) -> None:
        budget = self.max_response_len - len(sample.tokens)
        if budget <= 0:  # resumed at the cap: nothing left to generate (slime marks it truncated)
            sample.finish = FinishReason.LENGTH
            return
        if sample.tokens:
            self._resumed_requests += 1
            self._re_prefill_tokens += len(prompt) + len(sample.tokens)
        params = SamplingParams(max_new_tokens=budget)
        async for chunk in self.engine.generate(prompt + sample.tokens, params, f"wave-{next(self._request_ids)}"):
            if chunk.token_ids and sample.started < 0:
                sample.started = self._version
            sample.tokens.extend(chunk.token_ids)
            self._step_tokens += len(chunk.token_ids)
            if chunk.finish_reason is not None:
                sample.finish = FinishReason(chunk.finish_reason)
                if sample.finish != FinishReason.ABORT:
                    sample.finished_at = self.clock()
                break


__all__ = ["WaveRollout", "WaveStep"]
