"""The APRIL training loop: scheduler + rollout engine + rewards + trainer + checkpoints.

The run is written against the Trainer and RolloutEngine protocols (april_ext.protocol): one factory
builds its trainer (training.trainers.build_trainer: torch or Megatron) and one its engine
(training.engines.build_engine: embedded or SGLang, started on the trainer's weights), and every pair
steps the same way. Per step: (colocated: the trainer's memory is paused, the engine's KV cache resumed)
the rollout loop produces a batch at the trainer's policy version; (colocated: the engine's memory is
released, the trainer's resumed) the trainer updates the policy; the new weights go to the engine with
version + 1 (april_ext.weights.sync_weights). With ``step_boundary="carry"`` the samples still running when
the batch is taken stay paused in place in the engine through training and the weight update (keeping
their KV cache: colocated, the embedded engine's KV cache is released with a host copy and restored
bit-exactly) and continue in the next step. Metrics go to ``<output_dir>/metrics.jsonl`` one line per
step; checkpoints every ``save_interval`` steps and at the end; ``resume`` continues from the newest
checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from april_ext.algorithms import reject_uniform_groups
from april_ext.batch import version_lags
from april_ext.data_source import DataSource, Prompt
from april_ext.errors import ConfigError, InvalidArgumentError, InvalidStateError
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.persistence import atomic_write_json, atomic_write_text, ensure_dir
from april_ext.protocol import (Environment, PrefixIsolatingEngine, RolloutDriver, RolloutEngine, SamplingParams,
                                Trainer)
from april_ext.rollout import GroupFilter, RewardFn, RolloutLoop, scheduler_config_for
from april_ext.scheduler import Scheduler
from april_ext.trainer.distributed import launched_by_torchrun
from april_ext.training import ranks
from april_ext.training.checkpoint import CheckpointManager
from april_ext.training.config import TrainConfig
from april_ext.training.engines import EngineFactory, build_engine, engine_metrics
from april_ext.training.evaluation import evaluate
from april_ext.training.handoff import StepMemory
from april_ext.weights import sync_weights
from april_ext.training.hooks import ImportedFilter, ImportedReward, load_environment
from april_ext.training.metrics import VARIANT, read_metrics, step_row, summarize, variant_of
from april_ext.training.pipeline import RolloutPipeline
from april_ext.training.sinks import TENSORBOARD_DIR, MetricsSink, TensorBoardSink, WandbSink
from april_ext.training.trainers import (
    InitialWeights,
    TrainerFactory,
    algorithm_config,
    build_trainer,
    initial_model_config,
    split_threads,
)

if TYPE_CHECKING:
    from april_ext.tasks import CountingTask, LookupTask

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
WANDB_RUN_ID = "wandb_run_id"
"""The run-state key (a checkpoint's run.json) of the W&B run a resumed run continues."""
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
    steps_done: int = 0
    """The run's last step (a resumed run counts its earlier steps)."""

    @property
    def stopped_early(self) -> str | None:
        """Why the run ended before num_steps, when a bound the user set ended it (the passes over the prompt
        file were used up); None when it ran its num_steps (or had none)."""
        config = self.config
        if not self.data_exhausted or config.num_steps is None or self.steps_done >= config.num_steps:
            return None
        trained = self.steps_done - (self.resumed_from or 0)
        where = (f"the checkpoint of step {self.resumed_from} had used them up; this run trained no step"
                 if trained == 0 and self.resumed_from is not None else f"after step {self.steps_done}")
        return (f"the prompt data ran out before num_steps={config.num_steps}: num_epochs={config.num_epochs} "
                f"passes over {config.data} ({where}); give more epochs, or none to cycle the file until num_steps")


@dataclass
class _Task:
    data: DataSource
    reward_fn: RewardFn | None
    """None for a multi-turn task: its environment gives the rewards."""
    stop_token_ids: tuple[int, ...]
    max_response_len: int
    initial_weights: Callable[[], InitialWeights]
    """What the trainer starts from: TrainConfig.model's directory (read by the trainer itself, so no rank
    of a Megatron run builds the whole model), else the counting task's seeded tiny model."""
    eval_prompts: Callable[[], list[Prompt]]
    """The held-out prompts of evaluation (read when the run evaluates)."""
    decode: Callable[[Sequence[int]], str] | None = None
    """Token ids to text (data runs: the tokenizer's, without special tokens)."""
    environment: Environment | None = None
    """A multi-turn task's environment (its tool), which the rollout loop drives."""


def run_model_config(config: TrainConfig) -> ModelConfig:
    """The architecture the run trains, known without building it: the model directory's config.json, else
    the counting task's tiny model."""
    if config.model is not None:
        return ModelConfig.from_pretrained(config.model)
    if config.task == "lookup":
        return _tiny_model_config(config, _lookup_task(config))
    return _tiny_model_config(config, _counting_task(config, config.seed))


def _counting_task(config: TrainConfig, seed: int) -> CountingTask:
    from april_ext.tasks import CountingTask, CountingTaskConfig

    return CountingTask(CountingTaskConfig(
        n_symbols=config.counting_symbols, max_count=config.counting_max_count,
        median_count=config.counting_median, sigma=config.counting_sigma, seed=seed))


def _lookup_task(config: TrainConfig) -> LookupTask:
    from april_ext.tasks import LookupTask

    return LookupTask(config.lookup_task_config())


def _tiny_model_config(config: TrainConfig, task: CountingTask | LookupTask) -> ModelConfig:
    """The built-in task's tiny model at the run's hidden size and depth, with room for its prompts and cap."""
    max_len = config.max_response_len or task.max_response_len()
    return task.model_config(hidden_size=config.hidden_size, intermediate_size=3 * config.hidden_size,
                             num_hidden_layers=config.num_layers, max_position_embeddings=8 + max_len + 8)


def _tiny_initial_weights(config: TrainConfig, task: CountingTask | LookupTask) -> Callable[[], InitialWeights]:
    def initial_weights() -> InitialWeights:
        if config.model is not None:
            return config.model
        model = LlamaForCausalLM(_tiny_model_config(config, task))
        model.init_weights(config.seed)
        return model

    return initial_weights


def _build_task(config: TrainConfig) -> _Task:
    if config.task == "counting":
        task = _counting_task(config, config.seed)
        return _Task(task, task.reward, (task.eos_id,), config.max_response_len or task.max_response_len(),
                     _tiny_initial_weights(config, task),
                     lambda: _counting_task(config, config.seed + 1).prompts(0, config.eval_counting_prompts))
    if config.task == "lookup":
        from april_ext.tasks import LookupEnvironment

        lookup = _lookup_task(config)
        return _Task(lookup, None, lookup.stop_token_ids, config.max_response_len or lookup.max_response_len(),
                     _tiny_initial_weights(config, lookup), lambda: [], environment=LookupEnvironment(lookup))
    from april_ext.data import DatasetConfig, PromptDataset, load_tokenizer
    from april_ext.tasks import MathReward

    assert config.data is not None and config.tokenizer_dir is not None and config.model is not None
    tokenizer = load_tokenizer(config.tokenizer_dir)
    dataset = PromptDataset.from_file(config.data, tokenizer, DatasetConfig(
        prompt_key=config.prompt_key, label_key=config.label_key, seed=config.seed, epochs=config.num_epochs,
        shuffle=config.rollout_shuffle))
    eos = tokenizer.eos_token_id
    model_dir = config.model

    def eval_prompts() -> list[Prompt]:
        assert config.eval_prompt_data is not None
        held_out = PromptDataset.from_file(config.eval_prompt_data, tokenizer, DatasetConfig(
            prompt_key=config.prompt_key, label_key=config.label_key, shuffle=False))
        return [held_out[i] for i in range(len(held_out))]

    environment, stops = _user_environment(config, tokenizer)
    return _Task(dataset, MathReward(tokenizer, config.rm_type or "math") if environment is None else None,
                 (*(() if eos is None else (int(eos),)), *stops), config.max_response_len or 1024, lambda: model_dir,
                 eval_prompts, lambda ids: tokenizer.decode(list(ids), skip_special_tokens=True), environment)


def _user_environment(config: TrainConfig, tokenizer: Any) -> tuple[Environment | None, tuple[int, ...]]:
    """environment_path's Environment and the tokens that end its turns besides EOS (training.hooks); (None, ())
    without one."""
    if config.environment_path is None:
        return None, ()
    return load_environment(config.environment_path, tokenizer)


def _reward_fn(config: TrainConfig, task: _Task) -> RewardFn | None:
    """The task's reward function, or custom_rm_path's (given text when custom_rm_text); None for a multi-turn
    task (its environment rewards)."""
    if config.custom_rm_path is None:
        return task.reward_fn
    return ImportedReward.from_path(config.custom_rm_path, config.custom_rm_kind, config.custom_rm_timeout_s,
                                    task.decode if config.custom_rm_text else None)


def _group_filter(config: TrainConfig) -> GroupFilter | None:
    """dynamic_sampling_filter_path's filter, else the algorithm's (DAPO: reject uniform groups)."""
    if config.dynamic_sampling_filter_path is not None:
        return ImportedFilter.from_path(config.dynamic_sampling_filter_path)
    return reject_uniform_groups if algorithm_config(config).dynamic_sampling else None


def _build_scheduler(config: TrainConfig, task: _Task) -> Scheduler:
    scheduler = scheduler_config_for(config.scheduler_config(task.max_response_len), config.partial_rollout)
    if config.async_rollout and scheduler.max_staleness is not None:
        # The scheduler counts versions from the one a batch is generated under, d before the one it is trained at.
        scheduler = dataclasses.replace(scheduler,
                                        max_staleness=scheduler.max_staleness - config.max_head_offpolicyness)
    return Scheduler(scheduler, task.data)


_T = TypeVar("_T")


def _conforming(built: Any, protocol: type[_T], what: str) -> _T:
    """What a factory built, checked against the protocol the run is written for."""
    if not isinstance(built, protocol):
        missing = [name for name in dir(protocol) if not name.startswith("_") and not hasattr(built, name)]
        raise InvalidArgumentError(f"the {what} factory built a {type(built).__name__}, which lacks the "
                                   f"{protocol.__name__} members {missing}")
    return built


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def train(config: TrainConfig, *, trainer_factory: TrainerFactory = build_trainer,
          engine_factory: EngineFactory = build_engine) -> TrainResult | None:
    """Runs (or resumes) a training run to ``num_steps`` steps or until the data runs out. Under torchrun
    every rank calls it: rank 0 runs the training and returns its result, the others follow its trainer
    (training.ranks) and return None. The factories as in TrainingRun."""
    if launched_by_torchrun():
        return ranks.run_on_ranks(
            config, lambda factory: asyncio.run(train_async(config, factory, engine_factory)),
            lambda: _build_task(config).initial_weights())
    ranks.check_world(config, 1)
    return asyncio.run(train_async(config, trainer_factory, engine_factory))


async def train_async(config: TrainConfig, trainer_factory: TrainerFactory = build_trainer,
                      engine_factory: EngineFactory = build_engine) -> TrainResult:
    async with TrainingRun(config, trainer_factory=trainer_factory, engine_factory=engine_factory) as run:
        while not run.done:
            await run.step()
        return await run.finish()


FactoriesFor = Callable[[TrainConfig], dict[str, Any]]
"""A run's config -> TrainingRun's factory keywords (``trainer_factory``, ``engine_factory``)."""


async def train_side_by_side(configs: dict[str, TrainConfig],
                             factories_for: FactoriesFor = lambda _: {}) -> dict[str, TrainResult]:
    """Several runs in one process, stepping in turn (one step of each, then the next round), so that
    they see the same machine load and their throughput ratio is fair on a busy machine."""
    async with contextlib.AsyncExitStack() as stack:
        runs = {name: await stack.enter_async_context(TrainingRun(cfg, bar_position=i, **factories_for(cfg)))
                for i, (name, cfg) in enumerate(configs.items())}
        while not all(run.done for run in runs.values()):
            for run in runs.values():
                if not run.done:
                    await run.step()
        return {name: await run.finish() for name, run in runs.items()}


class TrainingRun:
    """One run, step by step: ``async with TrainingRun(cfg) as run: while not run.done: await run.step()``
    then ``await run.finish()`` (final checkpoint, plots, result). Entering builds the data source,
    scheduler, model and trainer, restores the newest checkpoint when ``cfg.resume``, then starts the
    engine on the trainer's weights.

    ``trainer_factory`` / ``engine_factory`` build the trainer and the engine (by default from
    ``cfg.trainer`` / ``cfg.engine``); the run takes any objects satisfying the Trainer and
    RolloutEngine protocols. A run on Ray (``cfg.ray``) takes the cluster layer's, which sits above this
    one: ``TrainingRun(cfg, **april_ext.cluster.RayTopologyRun(cfg).factories())`` (what ``april-ext
    train --ray`` passes)."""

    def __init__(self, config: TrainConfig, *, bar_position: int = 0, trainer_factory: TrainerFactory = build_trainer,
                 engine_factory: EngineFactory = build_engine) -> None:
        self.config = config
        self.bar_position = bar_position
        self.variant = variant_of(config.partial_rollout, config.async_rollout)
        self.history: list[dict[str, Any]] = []
        self.resumed_from: int | None = None
        self.last_saved: str | None = None
        self.data_exhausted = False
        self.steps_done = 0
        self.memory_tag_prefix = f"run{next(_run_ids)}-"
        if config.ray and (trainer_factory is build_trainer or engine_factory is build_engine):
            raise ConfigError("TrainConfig.ray runs the trainer ranks and engines as Ray actors, which the "
                              "cluster layer builds: pass april_ext.cluster.RayTopologyRun(config).factories() "
                              "to TrainingRun / train(), or run `april-ext train --ray`")
        self._trainer_factory = trainer_factory
        self._engine_factory = engine_factory
        self._stack = contextlib.AsyncExitStack()
        self._environment_state: bytes | None = None
        self._pipeline: RolloutPipeline | None = None
        self._evaluation: asyncio.Task[dict[str, float]] | None = None
        self._started: float | None = None
        self._elapsed_before = 0.0
        self._wandb_run_id: str | None = None
        """The W&B run a resumed run continues (from its checkpoint's run state), then this run's."""

    @property
    def done(self) -> bool:
        limit = self.config.num_steps
        return self.data_exhausted or (limit is not None and self.steps_done >= limit)

    async def __aenter__(self) -> TrainingRun:
        try:
            return await self._open()
        except BaseException as err:
            # The error goes to every exit: a trainer across ranks tells the other ranks why the run stopped.
            await self._stack.__aexit__(type(err), err, err.__traceback__)
            raise

    async def _open(self) -> TrainingRun:
        config = self.config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        elif config.async_rollout:
            # The engine's process and the trainer's each get half the cores (docs/async.md, "Cores").
            torch.set_num_threads(split_threads(config))
        _seed_everything(config.seed)
        task = _build_task(config)
        # Imported before anything is started, so that a bad import path fails at once.
        reward_fn, group_filter = _reward_fn(config, task), _group_filter(config)
        self.eval_prompts = task.eval_prompts() if config.eval_interval else []
        self.scheduler = _build_scheduler(config, task)
        initial = task.initial_weights()
        self.trainer: Trainer = _conforming(
            self._stack.enter_context(self._trainer_factory(config, initial, self.memory_tag_prefix)), Trainer,
            "trainer")
        self.checkpoints = CheckpointManager(config.checkpoint_dir, keep=config.keep_checkpoints)
        ensure_dir(config.output_dir)
        self.metrics_path = os.path.join(config.output_dir, METRICS_FILE)
        if config.resume_dir is not None:
            self._resume(config.resume_dir)
        self._open_outputs()
        # After the resume: the engine starts on the trainer's current weights and version.
        self.engine: RolloutEngine = _conforming(await self._stack.enter_async_context(
            self._engine_factory(config, self.trainer, initial_model_config(initial), self.memory_tag_prefix)),
            RolloutEngine, "engine")
        self.sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                                       stop_token_ids=task.stop_token_ids, max_new_tokens=task.max_response_len)
        self.reward_fn = reward_fn
        self.environment = task.environment
        # slime's --eval-* overrides; each unset one follows the rollouts'.
        overrides = {"temperature": config.eval_temperature, "top_p": config.eval_top_p, "top_k": config.eval_top_k,
                     "max_new_tokens": config.eval_max_response_len}
        self.eval_sampling = dataclasses.replace(
            self.sampling, **{name: value for name, value in overrides.items() if value is not None})
        if config.custom_generate_function_path is not None:
            self.rollout: RolloutDriver = self._custom_generate_rollout(reward_fn, group_filter, task)
        else:
            self.rollout = RolloutLoop(
                self.engine, self.scheduler, reward_fn, sampling=self.sampling,
                group_filter=group_filter,
                seed=config.seed, engine_capacity=config.max_num_seqs, deterministic=config.deterministic_rollout,
                environment=task.environment, tool_timeout_s=config.tool_timeout_s,
                max_concurrent_tool_calls=config.max_concurrent_tool_calls)
        if self._environment_state is not None:
            self.rollout.load_environment_state(self._environment_state)
        self._stack.push_async_callback(self.rollout.close)
        self.memory = StepMemory(self.engine, self.trainer) if config.colocate else None
        if config.async_rollout:
            self._pipeline = self._open_pipeline()
        return self

    def _open_pipeline(self) -> RolloutPipeline:
        """The rollout of the run's remaining batches, ahead of the trainer by at most max_head_offpolicyness
        versions; a batch whose step follows a checkpoint waits for it (a batch taken from the scheduler and not
        yet trained would be missing from the checkpoint's state)."""
        config, first, steps = self.config, self.trainer.version, self.steps_done

        def after_checkpoint(version: int) -> bool:
            before = steps + version - first  # steps done when the batch of ``version`` is trained
            return (config.save_interval > 0 and 0 < before and (config.num_steps is None or before < config.num_steps)
                    and before % config.save_interval == 0)

        last = None if config.num_steps is None else first + config.num_steps - steps - 1
        # Looked up at each step, not bound here: the driver's run_step may be wrapped after the run opens.
        pipeline = RolloutPipeline(lambda version: self.rollout.run_step(version), config.max_head_offpolicyness,
                                   first, last, after_checkpoint)
        # First on the way out: a failing run stops generating before the engine and the rollout close.
        self._stack.push_async_callback(pipeline.cancel)
        return pipeline

    def _custom_generate_rollout(self, reward_fn: RewardFn | None, group_filter: GroupFilter | None,
                                 task: _Task) -> RolloutDriver:
        """slime's custom generate function driving the scheduler (april_ext.rollout.slime_generate)."""
        from april_ext.rollout.slime_generate import CustomGenerateRollout

        assert self.config.custom_generate_function_path is not None
        return CustomGenerateRollout(self.config.custom_generate_function_path, self.scheduler, self.engine,
                                     reward_fn=reward_fn, group_filter=group_filter, sampling=self.sampling,
                                     decode=task.decode)

    def _resume(self, directory: str) -> None:
        """Restores the trainer and the scheduler from the newest checkpoint in ``directory``, if there is
        one, and keeps the metrics rows up to its step."""
        source = CheckpointManager(directory, keep=self.config.keep_checkpoints)
        # The newest intact checkpoint: a damaged newer one is skipped with a warning.
        latest = source.restore_newest(self.trainer, self.scheduler)
        if latest is not None:
            # Loaded into the rollout driver once it exists (it is built after the engine, below).
            self._environment_state = source.read_environment(latest)
            self._wandb_run_id = source.run_state(latest).get(WANDB_RUN_ID)
            self.resumed_from = self.steps_done = latest.step
            self.last_saved = latest.path
            self.history = read_metrics(self.metrics_path, latest.step)
            if self.history:
                self._elapsed_before = float(self.history[-1].get("time/elapsed_s", 0.0))

    def _open_outputs(self) -> None:
        """metrics.jsonl (rewritten with the rows kept: a resumed run drops those written after its
        checkpoint, a fresh run starts it empty) and the progress bar."""
        atomic_write_text(self.metrics_path, "".join(json.dumps(row) + "\n" for row in self.history))
        atomic_write_json(os.path.join(self.config.output_dir, CONFIG_FILE), self.resolved_config, indent=2)
        self.sinks = self._open_sinks()
        from tqdm import tqdm

        config = self.config
        self.bar = self._stack.enter_context(tqdm(
            total=config.num_steps, initial=self.steps_done, desc=f"train[{self.variant}]", unit="step",
            disable=not config.progress, dynamic_ncols=True, position=self.bar_position))
        self.metrics_file = self._stack.enter_context(open(self.metrics_path, "a", encoding="utf-8"))

    @property
    def resolved_config(self) -> dict[str, Any]:
        """Every setting of the run as it runs (the defaults filled in), logged at the start; "scheduler": the
        scheduler's settings as it runs them (the strategy applied, the baseline's N' = N)."""
        return {**dataclasses.asdict(self.config), "checkpoint_dir": self.config.checkpoint_dir,
                VARIANT: self.variant, "scheduler": dataclasses.asdict(self.scheduler.config)}

    def _open_sinks(self) -> list[MetricsSink]:
        """The TensorBoard / W&B sinks the config asks for, closed with the run."""
        config, sinks = self.config, []
        if config.use_tensorboard:
            sinks.append(TensorBoardSink(os.path.join(config.output_dir, TENSORBOARD_DIR), self.resolved_config,
                                         self.resumed_from))
        if config.use_wandb:
            wandb = WandbSink(config.wandb_project, config.wandb_dir or config.output_dir,
                              os.path.basename(os.path.abspath(config.output_dir)), self.resolved_config,
                              group=config.wandb_group, run_id=self._wandb_run_id)
            self._wandb_run_id = wandb.run_id
            sinks.append(wandb)
        for sink in sinks:
            self._stack.callback(sink.close)
        return sinks

    def _log(self, row: dict[str, Any]) -> None:
        self.metrics_file.write(json.dumps(row) + "\n")
        self.metrics_file.flush()
        for sink in self.sinks:
            sink.log(row["step"], row)

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        traceback: TracebackType | None) -> None:
        await self._stack.__aexit__(exc_type, exc, traceback)

    async def step(self) -> dict[str, Any] | None:
        """One training step (rollout, update, weight sync, metrics row, periodic checkpoint); None when
        the data ran out before a batch could be formed. In an asynchronous run the rollout of the next batches
        runs meanwhile (training.pipeline)."""
        if self._started is None:
            self._started = time.perf_counter()
        if self._pipeline is not None:
            return await self._async_step(self._pipeline)
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
            await sync_weights(trainer, engine)
        self.steps_done += 1
        row = step_row(self.steps_done, self.variant, rm, tm, train_s, time.perf_counter() - sync_start,
                   time.perf_counter() - step_start)
        row.update(await engine_metrics(engine))
        if config.eval_interval and self.steps_done % config.eval_interval == 0:
            row.update(await self.evaluate())
        self._end_step(row, rm)
        if config.save_interval and self.steps_done % config.save_interval == 0 and not self.done:
            await self.save()
        return row

    async def _async_step(self, pipeline: RolloutPipeline) -> dict[str, Any] | None:
        """Trains the next batch the pipeline generated (waiting for it if need be), publishes the new weights
        to the engines between two rollout steps, and lets the batches that wait on this step go on."""
        config, trainer, engine = self.config, self.trainer, self.engine
        step_start = time.perf_counter()
        result, trainer_idle = await pipeline.next_batch()
        # Generated under an older version (rm.policy_version), trained at the trainer's: each token keeps its own.
        batch, rm = dataclasses.replace(result.batch, policy_version=trainer.version), result.metrics
        self.data_exhausted = bool(rm.scheduler["data_exhausted"]) and batch.n_groups < config.rollout_batch_size
        if batch.n_groups == 0:
            return None
        train_start = time.perf_counter()
        tm = await asyncio.to_thread(trainer.train_step, batch)
        train_s = time.perf_counter() - train_start
        sync_s = await pipeline.publish(trainer.version, lambda: sync_weights(trainer, engine))
        self.steps_done += 1
        row = step_row(self.steps_done, self.variant, rm, tm, train_s, sync_s, time.perf_counter() - step_start)
        row.update({f"async/{key}": value for key, value in version_lags(batch).items()})
        row.update({"async/trainer_idle_s": trainer_idle, "async/engine_idle_s": pipeline.take_engine_idle(),
                    "async/weight_update_s": sync_s, "async/ready_batches": pipeline.ready})
        row.update(await engine_metrics(engine))
        if self._evaluation is not None and (self._evaluation.done() or self.done):
            row.update(await self._evaluation)  # started at an earlier step, pinned to that step's version
            self._evaluation = None
        if config.eval_interval and self.steps_done % config.eval_interval == 0:
            # Between two rollout steps, under the weights just published; the trainer goes on meanwhile.
            self._evaluation = asyncio.create_task(pipeline.with_engine(self.evaluate))
            if self.done:
                row.update(await self._evaluation)
                self._evaluation = None
        self._end_step(row, rm)
        if config.save_interval and self.steps_done % config.save_interval == 0 and not self.done:
            await self.save()
        await pipeline.release(trainer.version)
        return row

    def _end_step(self, row: dict[str, Any], rm: Any) -> None:
        """Logs the step's row (with the run's wall-clock so far) and moves the progress bar."""
        assert self._started is not None
        row["time/elapsed_s"] = self._elapsed_before + time.perf_counter() - self._started
        self.history.append(row)
        self._log(row)
        self.bar.update(1)
        live, removed = row.get("engine/workers_live"), row.get("engine/workers_removed")
        workers = {} if live is None else {"workers": f"{live}/{live + removed}"}
        self.bar.set_postfix(reward=f"{rm.reward_mean:.3f}", tok_s=f"{rm.tokens_per_s:.0f}",
                             partial=f"{rm.scheduler['carried_token_ratio']:.2f}", **workers)

    async def evaluate(self) -> dict[str, float]:
        """Eval metrics of the current weights on the held-out prompts (training.evaluation), through the
        run's engine while it has nothing else to do (between steps)."""
        start = time.perf_counter()
        version = self.trainer.version
        if self.memory is not None:
            await self.memory.to_rollout()
        # Carried samples (step_boundary="carry") continue meanwhile, under the weights just loaded. Evaluation
        # publishes nothing to the prefix cache where the engine allows it: the rollouts after it stay as they
        # would be without it, to the last bit (docs/loop.md, Evaluation).
        isolated = (self.engine.unpublished_requests() if isinstance(self.engine, PrefixIsolatingEngine)
                    else contextlib.nullcontext())
        async with self.rollout.running_engine():
            with isolated:
                metrics = await evaluate(self.engine, self.eval_prompts, self.reward_fn, self.eval_sampling,
                                         n_samples=self.config.n_samples_per_eval_prompt, seed=self.config.seed,
                                         concurrency=self.config.max_num_seqs, environment=self.environment,
                                         tool_timeout_s=self.config.tool_timeout_s)
        if self.memory is not None:
            await self.memory.to_training()
        return {**metrics, "eval/policy_version": version, "time/eval_s": time.perf_counter() - start}

    async def save(self) -> str:
        """Checkpoints now (after every pending reward reached the scheduler). Carried samples are saved as
        partials with every token received (their KV cache is not saved: a resumed run re-prefills them). An
        asynchronous run saves at the steps its pipeline waits on (save_interval, the end): a batch generated
        ahead is no longer in the scheduler's state."""
        if self._pipeline is not None:
            await self._pipeline.settle()
            if self._pipeline.ready:
                raise InvalidStateError(
                    f"{self._pipeline.ready} batch(es) were generated ahead and not trained: an asynchronous run "
                    f"checkpoints at the steps its pipeline waits on (every save_interval steps and at the end)")
        await self.rollout.drain_rewards()
        run_state: dict[str, Any] = {VARIANT: self.variant}
        if self._wandb_run_id is not None:
            run_state[WANDB_RUN_ID] = self._wandb_run_id
        self.last_saved = self.checkpoints.save(self.steps_done, self.trainer, self.scheduler, run_state,
                                                environment=self.rollout.environment_state())
        return self.last_saved

    async def finish(self) -> TrainResult:
        """Final checkpoint (when this session trained), plots, and the result. Carried samples are saved as
        partials, then aborted in the engine."""
        if self._pipeline is not None:
            await self._pipeline.stop()
            if self._evaluation is not None:
                await self._evaluation
                self._evaluation = None
        await self.rollout.drain_rewards()
        if self.memory is not None:
            await self.memory.finish()
        if self.history and (self.resumed_from is None or self.steps_done > self.resumed_from):
            await self.save()
        await self.rollout.abort_carried()
        if self.config.plots and self.history:
            from april_ext.plots import plot_run

            plot_run(self.history, self.config.output_dir)
        return TrainResult(self.config, self.history, self.config.output_dir, self.last_saved, self.resumed_from,
                           self.data_exhausted, summarize(self.history), self.memory_tag_prefix, self.steps_done)


__all__ = ["CONFIG_FILE", "METRICS_FILE", "StepMemory", "TrainResult", "TrainingRun", "summarize", "train",
           "train_async", "train_side_by_side"]
