"""The APRIL training loop: scheduler + rollout engine (embedded or SGLang) + rewards + trainer (torch or
Megatron) + checkpoints.

Per step: (colocated: the trainer's memory is paused, the engine's KV cache resumed) the rollout loop
produces a batch at the trainer's policy version; (colocated: the engine's memory is released, the
trainer's resumed) the trainer updates the policy; the new weights go to the engine with version + 1.
Metrics go to ``<output_dir>/metrics.jsonl`` one line per step; checkpoints every ``save_interval``
steps and at the end; ``resume`` continues from the newest checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from april_ext.engine import AsyncEngine, EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM, load_pretrained
from april_ext.persistence import atomic_write_text
from april_ext.protocol import SamplingParams
from april_ext.rollout import RewardFn, RolloutEngine, RolloutLoop, scheduler_config_for
from april_ext.scheduler import Scheduler
from april_ext.trainer import TorchTrainer, TrainerConfig
from april_ext.training.backends import build_trainer, open_sglang_engine
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
        prompt_key=config.prompt_key, label_key=config.label_key, seed=config.seed, epochs=config.num_epochs))
    eos = tokenizer.eos_token_id
    model_dir = config.model
    return _Task(dataset, MathReward(tokenizer), () if eos is None else (int(eos),),
                 config.max_response_len or 1024, lambda: load_pretrained(model_dir, device="cpu"))


def _algorithm(config: TrainConfig) -> AlgorithmConfig:
    build = {"grpo": AlgorithmConfig.grpo, "drgrpo": AlgorithmConfig.drgrpo, "dapo": AlgorithmConfig.dapo,
             "gspo": AlgorithmConfig.gspo}[config.algorithm]
    return build(kl_coef=config.kl_coef, tis_cap=config.tis_cap)


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
    async with TrainingRun(config) as run:
        while not run.done:
            await run.step()
        return await run.finish()


async def train_side_by_side(configs: dict[str, TrainConfig]) -> dict[str, TrainResult]:
    """Several runs in one process, stepping in turn (one step of each, then the next round), so that
    they see the same machine load and their throughput ratio is fair on a busy machine."""
    async with contextlib.AsyncExitStack() as stack:
        runs = {name: await stack.enter_async_context(TrainingRun(cfg, bar_position=i))
                for i, (name, cfg) in enumerate(configs.items())}
        while not all(run.done for run in runs.values()):
            for run in runs.values():
                if not run.done:
                    await run.step()
        return {name: await run.finish() for name, run in runs.items()}


class TrainingRun:
    """One run, step by step: ``async with TrainingRun(cfg) as run: while not run.done: await run.step()``
    then ``await run.finish()`` (final checkpoint, plots, result). Entering builds the data source,
    model, trainer, engine and scheduler, and restores the newest checkpoint when ``cfg.resume``."""

    def __init__(self, config: TrainConfig, *, bar_position: int = 0) -> None:
        self.config = config
        self.bar_position = bar_position
        self.mode = "april" if config.partial_rollout else "baseline"
        self.history: list[dict[str, Any]] = []
        self.resumed_from: int | None = None
        self.last_saved: str | None = None
        self.data_exhausted = False
        self.steps_done = 0
        self.memory_tag_prefix = f"run{next(_run_ids)}-"
        self._stack = contextlib.AsyncExitStack()

    @property
    def done(self) -> bool:
        return self.data_exhausted or self.steps_done >= self.config.num_steps

    async def __aenter__(self) -> TrainingRun:
        try:
            return await self._open()
        except BaseException:
            await self._stack.aclose()
            raise

    async def _open(self) -> TrainingRun:
        config = self.config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        _seed_everything(config.seed)
        task = _build_task(config)
        self.scheduler = Scheduler(scheduler_config_for(config.scheduler_config(task.max_response_len),
                                                        config.partial_rollout), task.data)
        model = task.make_model()
        # The embedded engine gets its own copy of the initial weights (SGLang servers load theirs).
        engine_model = copy.deepcopy(model) if config.engine == "embedded" else None
        algorithm = _algorithm(config)
        prefix = self.memory_tag_prefix
        self.trainer = build_trainer(config, model, TrainerConfig(
            algorithm=algorithm, lr=config.lr, micro_batch_tokens=config.micro_batch_tokens, device=config.device,
            temperature=config.temperature, top_p=config.top_p,
            colocated=config.colocate, memory_tag=prefix + "trainer"), self._stack)
        self.checkpoints = CheckpointManager(config.checkpoint_dir, keep=config.keep_checkpoints)
        os.makedirs(config.output_dir, exist_ok=True)
        self.metrics_path = os.path.join(config.output_dir, METRICS_FILE)
        # The newest intact checkpoint: a damaged newer one is skipped with a warning.
        latest = self.checkpoints.restore_newest(self.trainer, self.scheduler) if config.resume else None
        if latest is not None:
            self.resumed_from = self.steps_done = latest.step
            self.last_saved = latest.path
            self.history = _read_metrics(self.metrics_path, latest.step)
        # A resumed run drops the metrics rows written after its checkpoint.
        atomic_write_text(self.metrics_path, "".join(json.dumps(row) + "\n" for row in self.history))
        from tqdm import tqdm

        self.bar = self._stack.enter_context(tqdm(
            total=config.num_steps, initial=self.steps_done, desc=f"train[{self.mode}]", unit="step",
            disable=not config.progress, dynamic_ncols=True, position=self.bar_position))
        self.metrics_file = self._stack.enter_context(open(self.metrics_path, "a", encoding="utf-8"))
        if config.engine == "sglang":
            self.engine = await open_sglang_engine(config, self.trainer, model, self._stack)
        else:
            assert engine_model is not None
            core = EngineCore(engine_model, EngineConfig(
                num_blocks=config.num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                device=config.device, seed=config.seed, memory_tag_prefix=prefix),
                weight_version=self.trainer.version)
            self.engine = await self._stack.enter_async_context(AsyncEngine(core))
            if latest is not None:
                await self.engine.update_weights(self.trainer.export_weights(), self.trainer.version)
        self.rollout = RolloutLoop(
            self.engine, self.scheduler, task.reward_fn,
            sampling=SamplingParams(temperature=config.temperature, top_p=config.top_p,
                                    stop_token_ids=task.stop_token_ids),
            group_filter=reject_uniform_groups if algorithm.dynamic_sampling else None,
            seed=config.seed, engine_capacity=config.max_num_seqs)
        self.memory = StepMemory(self.engine, self.trainer) if config.colocate else None
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._stack.aclose()

    async def step(self) -> dict[str, Any] | None:
        """One training step (rollout, update, weight sync, metrics row, periodic checkpoint); None when
        the data ran out before a batch could be formed."""
        config, trainer, engine = self.config, self.trainer, self.engine
        step_start = time.perf_counter()
        if self.memory is not None:
            await self.memory.to_rollout()
        result = await self.rollout.run_step(trainer.version)
        batch, rm = result.batch, result.metrics
        self.data_exhausted = bool(rm.scheduler["data_exhausted"]) and batch.n_groups < config.rollout_batch_size
        if batch.n_groups == 0:
            return None
        if self.memory is not None:
            await self.memory.to_training()
        train_start = time.perf_counter()
        # In a worker thread, so that reward tasks of surplus groups keep running meanwhile.
        tm = await asyncio.to_thread(trainer.train_step, batch)
        train_s = time.perf_counter() - train_start
        sync_start = time.perf_counter()
        if self.memory is not None:
            await self.memory.sync_weights()
        else:
            await engine.update_weights(trainer.export_weights(), trainer.version)
        self.steps_done += 1
        row = _row(self.steps_done, self.mode, rm, tm, train_s, time.perf_counter() - sync_start,
                   time.perf_counter() - step_start)
        if config.engine == "sglang":
            # The labels the servers themselves report after the sync (the trainer's version when it worked).
            row["engine/server_weight_versions"] = sorted(set((await engine.weight_versions()).values()))
        self.history.append(row)
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        self.bar.update(1)
        self.bar.set_postfix(reward=f"{rm.reward_mean:.3f}", tok_s=f"{rm.tokens_per_s:.0f}",
                             partial=f"{rm.scheduler['carried_token_ratio']:.2f}")
        if config.save_interval and self.steps_done % config.save_interval == 0 and not self.done:
            await self.save()
        return row

    async def save(self) -> str:
        """Checkpoints now (after every pending reward reached the scheduler)."""
        await self.rollout.drain_rewards()
        self.last_saved = self.checkpoints.save(self.steps_done, self.trainer, self.scheduler, {"mode": self.mode})
        return self.last_saved

    async def finish(self) -> TrainResult:
        """Final checkpoint (when this session trained), plots, and the result."""
        await self.rollout.drain_rewards()
        if self.memory is not None:
            await self.memory.finish()
        if self.history and (self.resumed_from is None or self.steps_done > self.resumed_from):
            await self.save()
        if self.config.plots and self.history:
            from april_ext.plots import plot_run

            plot_run(self.history, self.config.output_dir)
        return TrainResult(self.config, self.history, self.config.output_dir, self.last_saved, self.resumed_from,
                           self.data_exhausted, summarize(self.history), self.memory_tag_prefix)


class StepMemory:
    """Colocated mode: who holds memory when. The engine's memory is released while the trainer trains,
    the trainer's is paused while the engine generates (april_ext.memory under both)."""

    def __init__(self, engine: RolloutEngine, trainer: TorchTrainer) -> None:
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


__all__ = ["METRICS_FILE", "StepMemory", "TrainResult", "TrainingRun", "summarize", "train", "train_async",
           "train_side_by_side"]
