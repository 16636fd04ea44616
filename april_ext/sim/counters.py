"""ClusterCounters: what a SimulatedEngine's replicas did, summed over them, at one virtual time (the simulator's
reports diff two snapshots)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ClusterCounters:
    """Cumulative counters summed over replicas, at virtual time ``now``."""

    now: float
    num_engines: int
    decode_steps: int
    decode_tokens: int
    decode_time: float
    slot_time: float
    prefill_time: float
    prefill_tokens: int
    resume_prefill_time: float
    resume_prefill_tokens: int
    recompute_time: float
    recompute_tokens: int
    preemptions: int
    finished: int
    aborted: int
    kv_reads: int
    new_prefill_work_s: float
    resume_prefill_work_s: float
    delivered_tokens: int
    kv_copy_time: float  # virtual seconds the clock moved on for host copies of held KV (colocated pauses)
    kv_copy_tokens: int  # KV tokens copied to host and back
    continuations: int
    continuation_prefill_time: float
    continuation_prefill_tokens: int
    prefix_hit_tokens: int
    tool_calls: int
    env_prefill_tokens: int
    env_prefill_time: float

    def minus(self, earlier: ClusterCounters) -> ClusterCounters:
        """Counters accumulated since ``earlier`` (``now`` becomes the elapsed time)."""
        a, b = asdict(self), asdict(earlier)
        out = {k: a[k] - b[k] for k in a}
        out["num_engines"] = self.num_engines
        return ClusterCounters(**out)


__all__ = ["ClusterCounters"]
