"""slime's synchronous DAPO rollout: waves of N' groups, relaunched while too few groups remain; surplus discarded.

slime's ``generate_rollout`` (rollout/sglang_rollout.py, without partial rollout) keeps a count R of the groups
launched in the step minus those the dynamic-sampling filter rejected, i.e. the groups in flight plus the groups
accepted. Whenever R < N it launches a wave of ``over_sampling_batch_size`` (N', default N) groups, again until
R >= N; it takes groups in the order they complete, drops the rejected ones (R - 1) and accepts the others until N
are accepted. Then it aborts every request still running and throws their groups away (no partial reuse; their
prompts are not returned to the data source). The scheduler's refills cannot express this (batch refill waits for
a wave to end before the next one, continuous refill launches only the groups still needed), so this driver does
it itself over the same engine.
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
from april_ext.rollout.loop import RolloutMetrics, tail_latency
from april_ext.sim.tokens import SyntheticPrompts, answer_reward


@dataclass
class _Sample:
    tokens: list[int]
    finish: FinishReason | None = None
    finished_at: float = math.nan


@dataclass
class _Group:
    group_id: int
    prompt_index: int
    samples: list[_Sample]

    @property
    def complete(self) -> bool:
        return all(s.finish in (FinishReason.STOP, FinishReason.LENGTH) for s in self.samples)

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)


@dataclass(frozen=True)
class WaveStep:
    """One step of the wave driver: the loop's metrics and the finish times of the accepted samples."""

    metrics: RolloutMetrics
    finish_times: np.ndarray


class WaveRollout:
    """slime's DAPO baseline over ``engine``: N groups of n samples accepted per step by ``group_filter``
    (rewards in, keep or drop out), waves of ``over_sampling_batch_size`` groups launched while the groups in
    flight plus those accepted are fewer than N; at N accepted the rest is aborted and discarded."""

    def __init__(self, engine: RolloutEngine, prompts: SyntheticPrompts, *, rollout_batch_size: int,
                 n_samples_per_prompt: int, over_sampling_batch_size: int, max_response_len: int,
                 group_filter: Callable[[Sequence[float]], bool] | None) -> None:
        if over_sampling_batch_size < rollout_batch_size:
            raise ConfigError(f"over_sampling_batch_size={over_sampling_batch_size} is not allowed: an int >= "
                              f"rollout_batch_size = {rollout_batch_size}")
        self.engine = engine
        self.clock = engine_clock(engine, None)
        self.prompts = prompts
        self.n_groups = rollout_batch_size
        self.n = n_samples_per_prompt
        self.wave = over_sampling_batch_size
        self.max_response_len = max_response_len
        self.group_filter = group_filter
        self._next_prompt = 0
        self._group_ids = itertools.count()
        self._request_ids = itertools.count()

    async def run_step(self, policy_version: int) -> WaveStep:
        """One step: waves until N groups are accepted, then abort and discard what is still running."""
        engine = self.engine
        start = self.clock()
        accepted: list[_Group] = []
        rejected: list[_Group] = []
        surplus: list[_Group] = []
        tasks: dict[asyncio.Task[_Group], int] = {}
        remaining = waves = launched = requests = 0
        while len(accepted) < self.n_groups:
            while remaining < self.n_groups:
                for _ in range(self.wave):
                    group = self._new_group()
                    tasks[asyncio.create_task(self._generate(group))] = group.group_id
                remaining += self.wave
                launched += self.wave
                requests += self.wave * self.n
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
        generated = sum(g.tokens for g in (*accepted, *rejected, *surplus, *unfinished))
        discarded = sum(g.tokens for g in (*surplus, *unfinished))
        batch = [s for g in accepted for s in g.samples]
        lens = [len(s.tokens) for s in batch]
        rewards = [answer_reward(s.tokens) for s in batch]
        finished = np.array([s.finished_at for s in batch], np.float64)
        wall = end - start
        stats = {
            "batch_response_tokens": sum(lens), "stale_tokens_discarded": discarded, "tail_tokens_discarded": 0,
            "surplus_tokens_discarded": 0,
            "carried_token_ratio": 0.0, "off_policy_token_ratio": 0.0, "staleness_histogram": [len(batch)],
            "re_prefill_tokens": 0, "surplus_groups": len(surplus), "buffered_groups": 0,
            "groups_filtered": len(rejected), "groups_launched": launched, "groups_discarded": len(surplus) + len(unfinished),
            "waves": waves, "chunk_returns": 0, "continuation_tokens": 0, "prediction_rank_corr": math.nan,
            "prediction_samples": 0, "long_round": False, "long_queue_groups": 0}
        metrics = RolloutMetrics(
            policy_version=policy_version, wall_s=wall, time_to_done_s=done_at - start, generated_tokens=generated,
            tokens_per_s=generated / wall if wall > 0 else 0.0, requests=requests, resumed_requests=0,
            aborted_samples=aborted, mean_inflight_samples=math.nan, occupancy=math.nan,
            batch_groups=len(accepted), reward_mean=float(np.mean(rewards)) if rewards else math.nan,
            response_lens=lens, engine_steps=0, tail_share=tail_latency(finished, start, done_at)
            if finished.size > 1 and done_at > start else 0.0, scheduler=stats)
        return WaveStep(metrics, finished)

    def _new_group(self) -> _Group:
        index = self._next_prompt
        self._next_prompt += 1
        return _Group(next(self._group_ids), index, [_Sample([]) for _ in range(self.n)])

    @staticmethod
    def _rewards(group: _Group) -> list[float]:
        return [answer_reward(s.tokens) for s in group.samples]

    async def _generate(self, group: _Group) -> _Group:
        prompt = self.prompts[group.prompt_index].token_ids
        await asyncio.gather(*(self._sample(prompt, s) for s in group.samples))
        return group

    async def _sample(self, prompt: list[int], sample: _Sample) -> None:
        params = SamplingParams(max_new_tokens=self.max_response_len)
        async for chunk in self.engine.generate(prompt, params, f"wave-{next(self._request_ids)}"):
            sample.tokens.extend(chunk.token_ids)
            if chunk.finish_reason is not None:
                sample.finish = FinishReason(chunk.finish_reason)
                if sample.finish != FinishReason.ABORT:
                    sample.finished_at = self.clock()
                break


__all__ = ["WaveRollout", "WaveStep"]
