"""Simulation metrics: the bounds, per-step figures and the length bias.

Definitions (docs/sim.md has the reasoning):
- throughput: response tokens generated in the step / rollout time (virtual seconds, begin_step to batch).
  Useful throughput leaves out tokens thrown away: by a discarding baseline (DAPO over-sampling without recycling)
  and by tail batching's restart from the prompt (RollPacker).
- headline bound (per step and per run): the best any schedule could do on the same engines and work. The work
  is what the engines decoded (tokens and the KV tokens their steps read) plus the prompt prefill of the new
  samples; CostModel.least_busy_time is the least engine time for it, spread evenly over the engines (never
  idle, every iteration at the engine's real maximum batch under max_num_seqs and the KV capacity, no abort, no
  re-prefill). efficiency = throughput / bound = least time / rollout time <= 1.
- ceiling: the same plus the re-prefill of resumed requests (prompt + partial once each), which abort-and-resume
  cannot avoid; efficiency against it separates scheduling losses from the recompute cost.
- steady-state rate (OccupancyBound): tokens/s of the same cluster fed an endless queue of fresh samples; it
  gives B_sat, the mean decode batch of a never-idle engine (bubble fraction, adaptive target), and a reference.
- bubble fraction: idle slot-time. A replica has B_sat slots; busy slot-time is the decode batch integrated
  over time plus B_sat for every prefill second. bubble = 1 - busy / (B_sat x replicas x rollout time), clipped
  to [0, 1].
- length bias: the trained response lengths against the natural ones (the model's lengths cut at the cap):
  mean ratio and the Wasserstein-1 distance relative to the natural mean.
- tail latency: the time from when 90% of the step's batch samples had finished (a sample finished before the
  step began counts at its start) to the step's end, as a share of the step's rollout time: the last 10%.
- continuations (divided rollout): requests continuing a sample past a chunk boundary; those placed on a replica
  without their cached prefix pay its prefill (continuation_prefill_time_fraction), the others hit the cache.
- agentic trajectories (turns.py): tool calls per step and the replica time prefilling observations (part of the
  bounds' work: the bounds assume the engines never idle while tools run, other work filling the wait).
- prediction rank correlation (scheduler): Spearman's between each finished sample's predicted final length at
  its last dispatch and its final length, per step; the run's is the mean weighted by the samples.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from april_ext.batch import FinishReason
from april_ext.rollout.step_metrics import tail_latency
from april_ext.sim.cost import ClusterConfig, CostModel
from april_ext.sim.counters import ClusterCounters
from april_ext.sim.lengths import LengthModel
from april_ext.sim.replica import Replica, SimRequest, SimSample


@dataclass(frozen=True)
class OccupancyBound:
    """What a never-idle cluster produces in steady state under a length model (the steady-state rate)."""

    tokens_per_s: float
    mean_batch: float  # B_sat: mean decode batch per replica
    measured_s: float
    finished: int


def full_occupancy_bound(cluster: ClusterConfig, lengths: LengthModel, max_response_len: int, prompt_len: int,
                         version: int = 0, warmup_finishes: int | None = None,
                         measure_finishes: int | None = None) -> OccupancyBound:
    """Runs one replica with an endless queue of fresh samples; the cluster bound is replicas x its rate.

    Warm-up (default 3 x the replica's concurrency finishes) lets the running mix reach its steady state,
    in which long responses are over-represented exactly as in a busy engine; the rate is then measured over
    the next measure_finishes (default 10 x concurrency) finishes.
    """
    replica = Replica(0, cluster.cost)
    uids = itertools.count()
    keys = itertools.count(1 << 41)  # a prompt population apart from data-source indices
    n_per_prompt = 8
    pending: list[SimSample] = []

    def top_up() -> None:
        while len(replica.waiting) < cluster.cost.max_num_seqs:
            if not pending:
                key = next(keys)
                for i in range(n_per_prompt):
                    d = lengths.draw(key, i, version)
                    pending.append(SimSample(next(uids), prompt_len, int(d.length), bool(d.correct)))
            s = pending.pop()
            new_total = min(s.target, max_response_len)
            replica.enqueue(SimRequest(
                request_id=str(s.uid), sample=s, base=0, input_len=prompt_len, new_total=new_total,
                finish=FinishReason.STOP if s.target <= max_response_len else FinishReason.LENGTH,
                is_resume=False, hasher=hashlib.blake2b(), input_ids=np.empty(0, np.int32)))

    top_up()
    replica.admit()
    concurrency = max(1, min(cluster.cost.max_num_seqs,
                             cluster.cost.kv_capacity_tokens // max(1, prompt_len + max_response_len // 4)))
    warm = warmup_finishes if warmup_finishes is not None else 3 * concurrency
    measure = measure_finishes if measure_finishes is not None else 10 * concurrency
    finished = finished_at_start = 0
    start = None
    while True:
        t = replica.next_event()
        done = replica.run_event()
        finished += len(done)
        top_up()
        if replica.dirty:
            replica.admit()
        if start is None and finished >= warm:
            start = (t, replica.counters.decode_tokens, replica.counters.slot_time, replica.counters.decode_time)
            finished_at_start = finished
        elif start is not None and finished - finished_at_start >= measure:
            c = replica.counters
            elapsed = t - start[0]
            decode = c.decode_time - start[3]
            return OccupancyBound(
                tokens_per_s=cluster.num_engines * (c.decode_tokens - start[1]) / elapsed,
                mean_batch=(c.slot_time - start[2]) / decode if decode > 0 else 0.0,
                measured_s=elapsed, finished=finished - finished_at_start)


def least_times(cost: CostModel, counters: ClusterCounters) -> tuple[float, float]:
    """(headline, ceiling): the least rollout time of the counted work on the cluster, without and with the
    resumed requests' re-prefill (see the module docstring)."""
    engines = counters.num_engines
    headline = cost.least_busy_time(counters.decode_tokens, counters.kv_reads, counters.new_prefill_work_s)
    ceiling = cost.least_busy_time(counters.decode_tokens, counters.kv_reads,
                                   counters.new_prefill_work_s + counters.resume_prefill_work_s)
    return headline / engines, ceiling / engines


def length_bias(trained: np.ndarray, natural: np.ndarray) -> dict[str, float]:
    """Mean ratio and relative Wasserstein-1 distance of trained vs natural response lengths."""
    if trained.size == 0 or natural.size == 0:
        return {"mean_ratio": float("nan"), "w1_rel": float("nan")}
    q = np.linspace(0.0, 1.0, 1001)
    w1 = float(np.mean(np.abs(np.quantile(trained, q) - np.quantile(natural, q))))
    mean = float(natural.mean())
    return {"mean_ratio": float(trained.mean()) / mean, "w1_rel": w1 / mean}


@dataclass(frozen=True)
class StepReport:
    """One simulated rollout step."""

    step: int
    rollout_s: float
    time_to_done_s: float
    generated_tokens: int
    trained_tokens: int
    discarded_tokens: int  # thrown away: stale groups dropped (a discarding baseline), tail-batching restarts and
    # cancelled extra samples
    tokens_per_s: float
    efficiency: float  # against the headline bound: least_time_s / rollout_s
    ceiling_efficiency: float  # against the ceiling: ceiling_time_s / rollout_s
    bound_tokens_per_s: float  # headline bound of this step's work
    ceiling_tokens_per_s: float
    least_time_s: float  # least rollout time of the step's work, without re-prefill
    ceiling_time_s: float  # the same with the resumed requests' re-prefill
    bubble_fraction: float
    partial_token_ratio: float  # batch tokens carried over from earlier steps (resumed partials)
    offpolicy_token_ratio: float
    staleness_histogram: list[int]
    re_prefill_tokens: int
    re_prefill_time_fraction: float  # replica time spent re-prefilling resumed requests / (replicas x rollout)
    recompute_time_fraction: float  # replica time re-prefilling after preemptions / (replicas x rollout)
    kv_copy_time_fraction: float  # rollout time the engines stood still copying carried KV to host and back
    idle_time_fraction: float  # replica time with nothing to run (outside the KV copies) / (replicas x rollout)
    underfill_fraction: float  # the rest of the loss: iterations below the maximum batch, prefill batch overheads
    preemptions: int
    aborted_samples: int
    surplus_groups: int
    buffered_groups: int
    filtered_groups: int
    reward_mean: float
    response_mean: float
    length_mean_ratio: float
    length_w1_rel: float
    tail_latency: float  # share of the rollout time after 90% of the batch samples had finished
    continuations: int  # continuation requests the engines admitted (divided rollout)
    prefix_hit_tokens: int  # their context tokens found in the replica's prefix cache (no prefill)
    continuation_prefill_tokens: int  # their context tokens prefilled (placed away from their cached prefix)
    continuation_prefill_time_fraction: float  # replica time prefilling continuations away from their prefix
    chunk_returns: int  # samples the scheduler got back at a chunk boundary (divided rollout)
    continuation_tokens: int  # prompt + partial tokens the continuations sent
    prediction_rank_corr: float  # Spearman: prediction at each sample's last dispatch vs its final length
    prediction_samples: int  # the samples that correlation is over
    long_round: bool  # tail batching: the step ran long-queue groups only
    long_queue_groups: int  # tail batching: groups waiting in the long queue after the step
    tool_calls: int = 0  # agentic: turns that ended with a tool call in the step
    env_prefill_time_fraction: float = 0.0  # agentic: replica time prefilling observations / (replicas x rollout)
    response_lens: list[int] = field(default_factory=list, repr=False)


def step_report(step: int, metrics: Any, counters: ClusterCounters, bound: OccupancyBound,
                natural: np.ndarray, cost: CostModel, finish_times: np.ndarray, end: float) -> StepReport:
    """Combine the loop's RolloutMetrics, the engine's counters over the step, the bounds of its work (engines of
    ``cost``), the steady-state rate (B_sat for the bubble) and the finish times of the batch samples on the
    engine's clock, on which the step ended at ``end``."""
    sched = metrics.scheduler
    wall = metrics.wall_s
    least, ceiling = least_times(cost, counters)
    lens = np.asarray(metrics.response_lens, np.int64)
    slots = bound.mean_batch * counters.num_engines * wall
    busy = counters.slot_time + bound.mean_batch * counters.prefill_time
    bias = length_bias(lens, natural)
    replica_time = counters.num_engines * wall
    copy = counters.kv_copy_time / wall if wall > 0 else 0.0
    shares = _loss_shares(counters, replica_time, least / wall if wall > 0 else 0.0, copy)
    return StepReport(
        step=step, rollout_s=wall, time_to_done_s=metrics.time_to_done_s, generated_tokens=metrics.generated_tokens,
        trained_tokens=int(sched["batch_response_tokens"]),
        discarded_tokens=int(sched["stale_tokens_discarded"]) + int(sched["tail_tokens_discarded"])
        + int(sched["surplus_tokens_discarded"]),
        tokens_per_s=metrics.tokens_per_s,
        efficiency=least / wall if wall > 0 else 0.0, ceiling_efficiency=ceiling / wall if wall > 0 else 0.0,
        bound_tokens_per_s=metrics.generated_tokens / least if least > 0 else 0.0,
        ceiling_tokens_per_s=metrics.generated_tokens / ceiling if ceiling > 0 else 0.0,
        least_time_s=least, ceiling_time_s=ceiling,
        bubble_fraction=min(1.0, max(0.0, 1.0 - busy / slots)) if slots > 0 else 0.0,
        partial_token_ratio=float(sched["carried_token_ratio"]),
        offpolicy_token_ratio=float(sched["off_policy_token_ratio"]),
        staleness_histogram=list(sched["staleness_histogram"]), re_prefill_tokens=int(sched["re_prefill_tokens"]),
        re_prefill_time_fraction=counters.resume_prefill_time / replica_time if replica_time > 0 else 0.0,
        recompute_time_fraction=counters.recompute_time / replica_time if replica_time > 0 else 0.0,
        kv_copy_time_fraction=copy, idle_time_fraction=shares[0], underfill_fraction=shares[1],
        preemptions=counters.preemptions, aborted_samples=metrics.aborted_samples,
        surplus_groups=int(sched["surplus_groups"]), buffered_groups=int(sched["buffered_groups"]),
        filtered_groups=int(sched["groups_filtered"]), reward_mean=metrics.reward_mean,
        response_mean=float(lens.mean()) if lens.size else 0.0, length_mean_ratio=bias["mean_ratio"],
        length_w1_rel=bias["w1_rel"], tail_latency=tail_latency(finish_times, end - wall, end),
        continuations=counters.continuations, prefix_hit_tokens=counters.prefix_hit_tokens,
        continuation_prefill_tokens=counters.continuation_prefill_tokens,
        chunk_returns=int(sched["chunk_returns"]), continuation_tokens=int(sched["continuation_tokens"]),
        prediction_rank_corr=float(sched["prediction_rank_corr"]),
        prediction_samples=int(sched["prediction_samples"]),
        long_round=bool(sched["long_round"]), long_queue_groups=int(sched["long_queue_groups"]),
        continuation_prefill_time_fraction=(counters.continuation_prefill_time / replica_time
                                            if replica_time > 0 else 0.0),
        tool_calls=counters.tool_calls,
        env_prefill_time_fraction=counters.env_prefill_time / replica_time if replica_time > 0 else 0.0,
        response_lens=lens.tolist())


def _loss_shares(counters: ClusterCounters, replica_time: float, efficiency: float,
                 copy: float) -> tuple[float, float]:
    """(idle, underfill) shares of the replicas' time. Replica time splits into decode, prefill (new prompts,
    re-prefill, recompute, continuations), KV copies and idle; the bound's least time is the new work at the maximum
    batch, so 1 - efficiency = idle + copy + re-prefill + recompute + continuation prefill + underfill, underfill
    being decode and new-prompt prefill beyond their least time (iterations below the maximum batch, the fixed
    cost of prefill batches, steps cut by aborts and pauses)."""
    if replica_time <= 0:
        return 0.0, 0.0
    c = counters
    idle = (replica_time - c.decode_time - c.prefill_time - c.num_engines * c.kv_copy_time) / replica_time
    extra = (c.resume_prefill_time + c.recompute_time + c.continuation_prefill_time) / replica_time
    return idle, 1.0 - efficiency - idle - copy - extra


__all__ = ["OccupancyBound", "StepReport", "full_occupancy_bound", "least_times", "length_bias", "step_report",
           "tail_latency"]
