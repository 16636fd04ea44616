"""The APRIL training loop: scheduler + embedded engine + rewards + torch trainer + checkpoints.

Per step: (colocated: the trainer's memory is paused, the engine's KV cache resumed) the rollout loop
produces a batch at the trainer's policy version; (colocated: the engine's memory is released, the
trainer's resumed) the trainer updates the policy; the new weights go to the engine with version + 1.
Metrics go to ``<output_dir>/metrics.jsonl`` one line per step; checkpoints every ``save_interval``
steps and at the end; ``resume`` continues from the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from april_ext.algorithms import AlgorithmConfig, reject_uniform_groups
from april_ext.data_source import DataSource
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore, SamplingParams
from april_ext.model import LlamaForCausalLM, load_pretrained
from april_ext.rollout import GroupFilter, RewardFn, RolloutLoop, scheduler_config_for
from april_ext.scheduler import Scheduler, SchedulerConfig
from april_ext.trainer import TorchTrainer, TrainerConfig
from april_ext.training.checkpoint import CheckpointManager
from april_ext.training.config import TrainConfig

METRICS_FILE = "metrics.jsonl"
_run_ids = itertools.count()


@dataclass
class TrainResult:
    """What a run did: one metrics dict per step (as in metrics.jsonl) and where its outputs are."""

    config: TrainConfig
    history: list[dict[str, Any]]
    output_dir: str
    checkpoint: str | None
    resumed_from: int | None = None
    data_exhausted: bool = False
    summary: dict[str, float] = field(default_factory=dict)
    memory_tag_prefix: str = ""
    """Prefix of this run's april_ext.memory tags (engine "weights" / "kv_cache", colocated "trainer")."""


@dataclass
class _Task:
    data: DataSource
    reward_fn: RewardFn
    stop_token_ids: tuple[int, ...]
    max_response_len: int
    make_model: Callable[[], LlamaForCausalLM]


def _build_task(config: TrainConfig) -> _Task:
    if config.task == "counting":
        from april_ext.tasks import CountingTask, CountingTaskConfig

        task = CountingTask(CountingTaskConfig(
            n_symbols=config.counting_symbols, max_count=config.counting_max_count,
            median_count=config.counting_median, sigma=config.counting_sigma, seed=config.seed))
        longest = task.max_response_len()
        max_len = config.max_response_len or longest

        def make_model() -> LlamaForCausalLM:
            if config.model is not None:
                return load_pretrained(config.model, device="cpu")
            model = LlamaForCausalLM(task.model_config(
                hidden_size=config.hidden_size, intermediate_size=3 * config.hidden_size,
                num_hidden_layers=config.num_layers, max_position_embeddings=8 + max_len + 8))
            model.init_weights(config.seed)
            return model

        return _Task(task, task.reward, (task.eos_id,), max_len, make_model)
    from april_ext.data import DatasetConfig, PromptDataset, load_tokenizer
    from april_ext.tasks import MathReward

    assert config.data is not None and config.tokenizer is not None and config.model is not None
    tokenizer = load_tokenizer(config.tokenizer)
    dataset = PromptDataset.from_file(config.data, tokenizer, DatasetConfig(
        prompt_key=config.prompt_key, label_key=config.label_key, seed=config.seed, num_epochs=config.num_epochs))
    eos = tokenizer.eos_token_id
    model_dir = config.model
    return _Task(dataset, MathReward(tokenizer), () if eos is None else (int(eos),),
                 config.max_response_len or 1024, lambda: load_pretrained(model_dir, device="cpu"))


def _algorithm(config: TrainConfig) -> AlgorithmConfig:
    build = {"grpo": AlgorithmConfig.grpo, "drgrpo": AlgorithmConfig.drgrpo, "dapo": AlgorithmConfig.dapo,
             "gspo": AlgorithmConfig.gspo}[config.algorithm]
    return build(kl_coef=config.kl_coef)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _read_metrics(path: str, up_to_step: int) -> list[dict[str, Any]]:
    """Rows of an earlier run's metrics.jsonl up to a step (the rows a resumed run keeps)."""
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
                        rows.append(row)
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
    }


def train(config: TrainConfig) -> TrainResult:
    """Runs (or resumes) a training run to ``num_steps`` steps or until the data runs out."""
    return asyncio.run(train_async(config))


async def train_async(config: TrainConfig) -> TrainResult:
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    _seed_everything(config.seed)
    task = _build_task(config)
    mode = "april" if config.partial_rollout else "baseline"
    sched_config = scheduler_config_for(SchedulerConfig(
        rollout_batch_size=config.rollout_batch_size, n_samples_per_prompt=config.n_samples_per_prompt,
        over_sampling_batch_size=config.over_sampling_batch_size, max_response_len=task.max_response_len,
        refill=config.refill, max_staleness=config.max_staleness, staleness_policy=config.staleness_policy,
        mask_offpolicy=config.mask_offpolicy), config.partial_rollout)
    scheduler = Scheduler(sched_config, task.data)
    prefix = f"run{next(_run_ids)}-"
    model = task.make_model()
    engine_model = copy.deepcopy(model)
    algorithm = _algorithm(config)
    trainer = TorchTrainer(model, TrainerConfig(
        algorithm=algorithm, lr=config.lr, micro_batch_tokens=config.micro_batch_tokens, device=config.device,
        colocated=config.colocate, memory_tag=prefix + "trainer"))
    core = EngineCore(engine_model, EngineConfig(
        num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
        device=config.device, seed=config.seed, memory_tag_prefix=prefix), weight_version=trainer.version)
    checkpoints = CheckpointManager(config.checkpoint_dir, keep=config.keep_checkpoints)
    os.makedirs(config.output_dir, exist_ok=True)
    metrics_path = os.path.join(config.output_dir, METRICS_FILE)
    history: list[dict[str, Any]] = []
    resumed_from = None
    latest = checkpoints.latest() if config.resume else None
    if latest is not None:
        checkpoints.load(latest, trainer, scheduler)
        resumed_from = latest.step
        history = _read_metrics(metrics_path, latest.step)
    with open(metrics_path + ".tmp", "w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in history)
    os.replace(metrics_path + ".tmp", metrics_path)
    group_filter: GroupFilter | None = reject_uniform_groups if algorithm.dynamic_sampling else None
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p,
                              stop_token_ids=task.stop_token_ids)
    start_step = resumed_from or 0
    last_saved: str | None = latest.path if latest is not None else None
    data_exhausted = False
    from tqdm import tqdm

    bar = tqdm(total=config.num_steps, initial=start_step, desc=f"train[{mode}]", unit="step",
               disable=not config.progress, dynamic_ncols=True)
    async with AsyncEngine(core) as engine:
        if resumed_from is not None:
            await engine.update_weights(trainer.export_weights(), trainer.version)
        rollout = RolloutLoop(engine, scheduler, task.reward_fn, sampling=sampling, group_filter=group_filter,
                              seed=config.seed, engine_capacity=config.max_num_seqs)
        colocated = StepMemory(engine, trainer) if config.colocate else None
        with open(metrics_path, "a", encoding="utf-8") as metrics_file:
            step = start_step
            while step < config.num_steps:
                step_start = time.perf_counter()
                if colocated is not None:
                    await colocated.to_rollout()
                result = await rollout.run_step(trainer.version)
                batch, rm = result.batch, result.metrics
                data_exhausted = bool(rm.scheduler["data_exhausted"]) and batch.n_groups < config.rollout_batch_size
                if batch.n_groups == 0:
                    break
                if colocated is not None:
                    await colocated.to_training()
                train_start = time.perf_counter()
                tm = await asyncio.to_thread(trainer.train_step, batch)
                train_s = time.perf_counter() - train_start
                sync_start = time.perf_counter()
                if colocated is not None:
                    await colocated.sync_weights()
                else:
                    await engine.update_weights(trainer.export_weights(), trainer.version)
                step += 1
                row = _row(step, mode, rm, tm, train_s, time.perf_counter() - sync_start,
                           time.perf_counter() - step_start)
                history.append(row)
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
                bar.update(1)
                bar.set_postfix(reward=f"{rm.reward_mean:.3f}", tok_s=f"{rm.tokens_per_s:.0f}",
                                partial=f"{rm.scheduler['carried_token_ratio']:.2f}")
                if data_exhausted:
                    break
                if config.save_interval and step % config.save_interval == 0 and step < config.num_steps:
                    await rollout.drain_rewards()
                    last_saved = checkpoints.save(step, trainer, scheduler, {"mode": mode})
        await rollout.drain_rewards()
        if colocated is not None:
            await colocated.finish()
        if history and (resumed_from is None or step > resumed_from):
            last_saved = checkpoints.save(step, trainer, scheduler, {"mode": mode})
    bar.close()
    if config.plots and history:
        from april_ext.plots import plot_run

        plot_run(history, config.output_dir)
    return TrainResult(config, history, config.output_dir, last_saved, resumed_from, data_exhausted,
                       summarize(history), prefix)


class StepMemory:
    """Colocated mode: who holds memory when. The engine's memory is released while the trainer trains,
    the trainer's is paused while the engine generates (april_ext.memory under both)."""

    def __init__(self, engine: AsyncEngine, trainer: TorchTrainer) -> None:
        self.engine = engine
        self.trainer = trainer

    async def to_rollout(self) -> None:
        self.trainer.offload()
        await self.engine.resume_memory(None)

    async def to_training(self) -> None:
        await self.engine.release_memory(None)
        self.trainer.onload()

    async def sync_weights(self) -> None:
        """New weights into the engine (its weights resumed for the copy, the KV cache still released)."""
        await self.engine.resume_memory(["weights"])
        await self.engine.update_weights(self.trainer.export_weights(), self.trainer.version)

    async def finish(self) -> None:
        """Both sides resident again (for the final checkpoint and a clean shutdown)."""
        self.trainer.onload()
        await self.engine.resume_memory(None)


def _row(step: int, mode: str, rm: Any, tm: dict[str, float], train_s: float, sync_s: float,
         step_s: float) -> dict[str, Any]:
    row: dict[str, Any] = {"step": step, "mode": mode, "policy_version": rm.policy_version}
    for key, value in rm.as_dict().items():
        if key != "scheduler":
            row[f"rollout/{key}"] = value
    sched = rm.scheduler
    for key in ("off_policy_token_ratio", "carried_token_ratio", "batch_max_staleness", "buffered_groups",
                "surplus_groups", "aborts", "resume_requests", "re_prefill_tokens", "groups_filtered",
                "batch_response_tokens", "prompts_consumed"):
        row[f"rollout/{key}"] = sched[key]
    row["rollout/staleness_histogram"] = sched["staleness_histogram"]
    for key, value in tm.items():
        row[f"train/{key}"] = value
    row["time/train_s"] = train_s
    row["time/weight_sync_s"] = sync_s
    row["time/step_s"] = step_s
    return row


__all__ = ["METRICS_FILE", "StepMemory", "TrainResult", "summarize", "train", "train_async"]
