"""The metrics of a run: one row per step (as written to metrics.jsonl), the rows a resumed run keeps,
and the summary of a whole run."""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from april_ext.rollout import RolloutMetrics

VARIANT = "variant"
"""The key of a metrics row, a checkpoint's run.json and the resolved config naming what the run is: "april"
(partial_rollout) or "baseline". The README keeps "mode" for the simulator's runs."""
_OLD_VARIANT = "mode"
"""VARIANT's name in what runs wrote before: read_metrics and CheckpointManager.load take it."""


def variant_of(partial_rollout: bool, async_rollout: bool = False) -> str:
    """april or baseline; april_async or baseline_async for an asynchronous run."""
    return ("april" if partial_rollout else "baseline") + ("_async" if async_rollout else "")


def with_variant(record: dict[str, Any]) -> dict[str, Any]:
    """A metrics row or a checkpoint's run state with the variant under VARIANT, where an older run wrote it
    under "mode" (same order of keys)."""
    if _OLD_VARIANT not in record or VARIANT in record:
        return record
    return {VARIANT if key == _OLD_VARIANT else key: value for key, value in record.items()}


def read_metrics(path: str, up_to_step: int) -> list[dict[str, Any]]:
    """Rows of an earlier run's metrics.jsonl up to a step (the rows a resumed run keeps), the variant under
    VARIANT even in rows written under "mode"."""
    rows = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:  # a line cut short by a kill
                        continue
                    if row.get("step", math.inf) <= up_to_step:
                        rows.append(with_variant(row))
    return rows


def summarize(history: list[dict[str, Any]]) -> dict[str, float]:
    """Rollout throughput over the whole run (generated tokens / rollout seconds) and reward trend."""
    if not history:
        return {}
    tokens = sum(r["rollout/generated_tokens"] for r in history)
    seconds = sum(r["rollout/wall_s"] for r in history)
    rewards = [r["rollout/reward_mean"] for r in history]
    k = max(1, len(rewards) // 4)
    return {
        "steps": float(len(history)),
        "rollout_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "rollout_s_per_step": seconds / len(history),
        "reward_first": float(np.mean(rewards[:k])),
        "reward_last": float(np.mean(rewards[-k:])),
        "partial_token_ratio": float(np.mean([r["rollout/carried_token_ratio"] for r in history])),
        "off_policy_token_ratio": float(np.mean([r["rollout/off_policy_token_ratio"] for r in history])),
        "occupancy": float(np.mean([r["rollout/occupancy"] for r in history])),
        # Rows of runs older than the carry step boundary lack carried_kv_tokens: they carried nothing.
        "carried_tokens_per_step": float(np.mean([r.get("rollout/carried_kv_tokens", 0) for r in history])),
        "re_prefilled_tokens_per_step": float(np.mean([r["rollout/re_prefill_tokens"] for r in history])),
        # Rows of runs older than the long-tail strategies lack tail_share.
        "tail_share": float(np.mean([r.get("rollout/tail_share", 0.0) for r in history])),
        **_env_summary(history),
    }


def _env_summary(history: list[dict[str, Any]]) -> dict[str, float]:
    """Multi-turn runs: tool calls per step and the engine's idle share while turns were with the environment."""
    if "env/tool_calls" not in history[0]:
        return {}
    return {"tool_calls_per_step": float(np.mean([r["env/tool_calls"] for r in history])),
            "engine_idle_while_tools": float(np.mean([r["env/engine_idle_while_tools"] for r in history])),
            "waiting_at_boundary": float(np.mean([r["env/waiting_at_boundary"] for r in history]))}


def step_row(step: int, variant: str, rm: RolloutMetrics, tm: dict[str, float], train_s: float, sync_s: float,
             step_s: float) -> dict[str, Any]:
    """One metrics.jsonl row: rollout metrics and the main scheduler statistics under rollout/, the trainer's
    metrics under train/, durations under time/."""
    row: dict[str, Any] = {"step": step, VARIANT: variant, "policy_version": rm.policy_version}
    for key, value in rm.as_dict().items():
        if key not in ("scheduler", "env"):
            row[f"rollout/{key}"] = value
    # Multi-turn runs: what the environment did (NaN, a percentile of no wait, is null as below).
    for key, value in rm.env.items():
        row[f"env/{key}"] = None if math.isnan(value) else value
    sched = rm.scheduler
    for key in ("off_policy_token_ratio", "carried_token_ratio", "batch_max_staleness", "buffered_groups",
                "surplus_groups", "aborts", "resume_requests", "re_prefill_tokens", "groups_filtered",
                "batch_response_tokens", "prompts_consumed", "carried_samples", "carried_kv_tokens",
                "chunk_returns", "continuation_requests", "continuation_tokens", "long_round", "long_queue_groups"):
        row[f"rollout/{key}"] = sched[key]
    # NaN (fewer than two samples) is null: a row read back from metrics.jsonl equals the one written.
    corr = sched["prediction_rank_corr"]
    row["rollout/prediction_rank_corr"] = None if math.isnan(corr) else corr
    row["rollout/staleness_histogram"] = sched["staleness_histogram"]
    for key, value in tm.items():
        row[f"train/{key}"] = value
    row["time/train_s"] = train_s
    row["time/weight_sync_s"] = sync_s
    row["time/step_s"] = step_s
    return row


__all__ = ["VARIANT", "read_metrics", "step_row", "summarize", "variant_of", "with_variant"]
