"""The step-boundary study of issue 14 part 1 on the main job: the synchronous baseline vs APRIL with
``step_boundary="abort"`` (the paper) vs ``"carry"`` (partials keep their KV across the update), each
over several seeds, with the main job's truncated importance sampling (tis_cap in the config).

    OMP_NUM_THREADS=1 python bench/study_step_boundary.py --seeds 0 1 2 3 4 --steps 300 --out study

Per run (reported as mean +- std over seeds per mode):
- reward at equal steps: the mean batch reward of the last quarter of the steps;
- the mean KL(behavior || trainer) on off-policy tokens: each step, before its update, the trainer's
  log-probs of the batch (``token_logprobs``) against the behavior log-probs of the tokens produced by
  older weights, by the k3 estimator (r - 1 - log r, r = pi_train / pi_behavior), averaged over the steps;
  and the same on the current-version tokens that follow such tokens in their sample (carry decodes them
  over K/V of older weights, abort re-prefilled them);
- the length bias: the Wasserstein-1 distance between the response lengths trained on in the last quarter
  and the natural lengths of the final policy (held-out prompts answered to completion, no step boundary);
- rollout throughput, off-policy token share, carried and re-prefilled tokens per step;
- the step at which the run "went long" (``long_response_step``: trained responses averaging over 40 tokens
  over 10 steps, the collapse of docs/loop.md's study), and how many runs of a mode did.
Writes ``<out>/study.json`` (every run) and prints the markdown table of docs/loop.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from april_ext.model import LlamaForCausalLM
from april_ext.persistence import atomic_write_json
from april_ext.protocol import SamplingParams, Trainer
from april_ext.tasks import CountingTask, CountingTaskConfig
from april_ext.training import TrainConfig, TrainingRun
from april_ext.training.trainers import build_trainer

MODES = {"baseline": dict(partial_rollout=False), "abort": dict(partial_rollout=True, step_boundary="abort"),
         "carry": dict(partial_rollout=True, step_boundary="carry"),
         # AReaL's decoupled PPO replaces TIS (the two do not combine).
         "carry_decoupled": dict(partial_rollout=True, step_boundary="carry", use_decoupled_loss=True, tis_cap=None)}
LONG_WINDOW, LONG_MEAN = 10, 40.0
"""A run "goes long" at the first window of LONG_WINDOW steps whose trained responses average over LONG_MEAN
tokens (the main job's cap is 65; its policies that learned the task answer in 5-15)."""


def wasserstein_1(a: np.ndarray, b: np.ndarray) -> float:
    """W1 between two empirical distributions on the line: the area between their CDFs."""
    a, b = np.sort(np.asarray(a, np.float64)), np.sort(np.asarray(b, np.float64))
    grid = np.union1d(a, b)
    cdf_a = np.searchsorted(a, grid[:-1], side="right") / len(a)
    cdf_b = np.searchsorted(b, grid[:-1], side="right") / len(b)
    return float(np.sum(np.abs(cdf_a - cdf_b) * np.diff(grid)))


def long_response_step(history: list[dict[str, Any]]) -> int | None:
    """The first step of the first LONG_WINDOW-step window whose mean trained response length exceeds LONG_MEAN;
    None if none does."""
    lens = [float(np.mean(r["rollout/response_lens"])) for r in history]
    for start in range(0, len(lens), LONG_WINDOW):
        if np.mean(lens[start:start + LONG_WINDOW]) > LONG_MEAN:
            return start + 1
    return None


def _k3(lp_train: np.ndarray, lp_behavior: np.ndarray, where: np.ndarray) -> tuple[float, int]:
    if not where.any():
        return 0.0, 0
    log_r = lp_train[where] - lp_behavior[where]
    return float(np.mean(np.exp(log_r) - 1.0 - log_r)), int(where.sum())


def off_policy_kl(trainer: Trainer, batch: Any) -> dict[str, tuple[float, int]]:
    """Mean k3 KL(behavior || trainer) and token count over the batch's response tokens from older weights
    ("stale"), and over the current-version tokens that follow stale ones in their sample ("after_stale":
    with abort they were re-prefilled, so on-policy; with carry they decoded over K/V of older weights,
    which their version does not show)."""
    lp_train = trainer.token_logprobs(batch).astype(np.float64)  # type: ignore[attr-defined]
    lp_behavior = batch.behavior_logprobs.astype(np.float64)
    trained = batch.loss_mask.astype(bool)
    stale = trained & (batch.versions < batch.policy_version)
    seen_stale = np.zeros_like(stale)
    for a, b in zip(batch.offsets[:-1], batch.offsets[1:]):
        seen_stale[a:b] = np.maximum.accumulate(stale[a:b])
    after_stale = trained & ~stale & seen_stale
    return {"stale": _k3(lp_train, lp_behavior, stale), "after_stale": _k3(lp_train, lp_behavior, after_stale)}


class _Measured:
    """The run's trainer, measuring the off-policy KL of each batch before training on it."""

    def __init__(self, inner: Trainer) -> None:
        self._inner = inner
        self.kl: list[dict[str, tuple[float, int]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def train_step(self, batch: Any) -> dict[str, float]:
        self.kl.append(off_policy_kl(self._inner, batch))
        return self._inner.train_step(batch)


async def _natural_lengths(run: TrainingRun, config: TrainConfig, n_prompts: int, n_samples: int) -> np.ndarray:
    """Response lengths of the final policy on held-out prompts, every answer run to completion."""
    task = CountingTask(CountingTaskConfig(
        n_symbols=config.counting_symbols, max_count=config.counting_max_count, median_count=config.counting_median,
        sigma=config.counting_sigma, seed=config.seed + 1))
    await run.rollout.abort_carried()
    gate = asyncio.Semaphore(config.max_num_seqs)

    async def one(i: int, j: int, prompt: Any) -> int:
        params = dataclasses.replace(run.sampling, seed=(config.seed * 1_000_003 + i * 7919 + j) % (2**31 - 1))
        async with gate:
            return sum([len(c.token_ids) async for c in run.engine.generate(
                list(prompt.token_ids), params, f"natural-{i}-{j}")])

    prompts = task.prompts(0, n_prompts)
    return np.array(await asyncio.gather(*(one(i, j, p) for i, p in enumerate(prompts) for j in range(n_samples))))


async def one_run(config: TrainConfig, natural_prompts: int, natural_samples: int) -> dict[str, Any]:
    measured: list[_Measured] = []

    @contextlib.contextmanager
    def factory(cfg: TrainConfig, model: LlamaForCausalLM, prefix: str) -> Iterator[Trainer]:
        with build_trainer(cfg, model, prefix) as trainer:
            measured.append(_Measured(trainer))
            yield measured[-1]  # type: ignore[misc]

    start = time.perf_counter()
    async with TrainingRun(config, trainer_factory=factory) as run:
        while not run.done:
            await run.step()
        history = run.history
        natural = await _natural_lengths(run, config, natural_prompts, natural_samples)
    wall = time.perf_counter() - start
    quarter = history[-max(1, len(history) // 4):]
    trained = np.concatenate([np.asarray(r["rollout/response_lens"]) for r in quarter])
    kls = [m["stale"][0] for m in measured[0].kl if m["stale"][1] > 0]
    after = [m["after_stale"][0] for m in measured[0].kl if m["after_stale"][1] > 0]
    tokens = sum(r["rollout/generated_tokens"] for r in history)
    seconds = sum(r["rollout/wall_s"] for r in history)
    return {
        "steps": len(history), "wall_s": wall,
        "reward_last_quarter": float(np.mean([r["rollout/reward_mean"] for r in quarter])),
        "offpolicy_kl": float(np.mean(kls)) if kls else 0.0,
        "after_stale_kl": float(np.mean(after)) if after else 0.0,
        "offpolicy_token_ratio": float(np.mean([r["rollout/off_policy_token_ratio"] for r in history])),
        "length_w1": wasserstein_1(trained, natural),
        "long_response_step": long_response_step(history),
        "trained_len_mean": float(trained.mean()), "natural_len_mean": float(natural.mean()),
        "rollout_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "carried_tokens_per_step": float(np.mean([r["rollout/carried_kv_tokens"] for r in history])),
        "re_prefilled_tokens_per_step": float(np.mean([r["rollout/re_prefill_tokens"] for r in history])),
    }


COLUMNS = [("reward_last_quarter", "reward (last 1/4)", 3), ("offpolicy_kl", "KL on off-policy tokens", 4),
           ("after_stale_kl", "KL on tokens after them", 4),
           ("offpolicy_token_ratio", "off-policy tokens", 3), ("length_w1", "length W1", 2),
           ("rollout_tokens_per_s", "rollout tokens/s", 0), ("carried_tokens_per_step", "carried tokens/step", 0),
           ("re_prefilled_tokens_per_step", "re-prefilled tokens/step", 0)]


def table(results: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| mode | seeds | " + " | ".join(title for _, title, _ in COLUMNS) + " | runs that went long |",
             "|---|---:|" + "---:|" * (len(COLUMNS) + 1)]
    for mode, runs in results.items():
        cells = []
        for key, _, digits in COLUMNS:
            values = np.array([r[key] for r in runs])
            cells.append(f"{values.mean():.{digits}f} ± {values.std():.{digits}f}")
        long = sum(r["long_response_step"] is not None for r in runs)
        lines.append(f"| {mode} | {len(runs)} | " + " | ".join(cells) + f" | {long} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/counting_tiny.toml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--modes", nargs="+", default=["baseline", "abort", "carry"], choices=list(MODES))
    parser.add_argument("--natural-prompts", type=int, default=64)
    parser.add_argument("--natural-samples", type=int, default=8)
    parser.add_argument("--out", default="april_runs/study_step_boundary")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "study.json")
    results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    for seed in args.seeds:
        for mode in args.modes:
            config = TrainConfig.from_toml(
                args.config, **MODES[mode], seed=seed, num_steps=args.steps, progress=False, plots=False,
                save_interval=0, output_dir=os.path.join(args.out, f"{mode}-seed{seed}"))
            run = asyncio.run(one_run(config, args.natural_prompts, args.natural_samples))
            results[mode].append({"seed": seed, **run})
            print(json.dumps({"mode": mode, "seed": seed, **run}), flush=True)
            atomic_write_json(path, {"args": vars(args), "results": results}, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
