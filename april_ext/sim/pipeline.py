"""Asynchronous modes in virtual time: the real scheduler and rollout loop over the simulated engine, step after
step, with every rollout step and every training step placed on one timeline (issue 36).

The semantics are april_ext.training.pipeline's: the batch trained at version b is generated once version b - d
is in the engine (d = AsyncMode.lag); new weights land between two rollout steps, never inside one (the engine
stalls for the update, TrainerCost.weight_update_s); the trainer, having trained a batch, waits for its weights to
land before it takes the next (RolloutPipeline.publish). Each rollout step runs under the version the engine holds
when it begins, so every token carries the version that made it and the off-policy share and version lag are
read off the real batches. ``colocated`` modes roll out and train on the same GPUs in turn (d = 0).

One extension of the real pipeline, for verl's streaming modes (``AsyncMode.streaming``): the trainer takes a batch
in PipelineConfig.stream_parts parts, in the order its groups completed, and trains a part as soon as its groups
are complete (verl's fully_async trainer: require_batches mini-batches per local step, a parameter sync every
trigger_parameter_sync_step local steps). The weights of version b + 1 are published after the last part.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np

from april_ext.algorithms.filters import reject_uniform_groups
from april_ext.batch import TrainingBatch, version_lags
from april_ext.errors import ConfigError, InternalError
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.scheduler import Scheduler
from april_ext.sim.cost import GPUS, MODELS
from april_ext.sim.engine import SimulatedEngine
from april_ext.sim.runner import SimConfig
from april_ext.sim.tokens import SyntheticPrompts, score_answer
from april_ext.sim.training import TrainerCost


@dataclass(frozen=True)
class AsyncMode:
    """How rollout and training share the GPUs and the versions."""

    name: str
    colocated: bool
    """Rollout and training take turns on all the GPUs (lag 0, no streaming); else they run on disjoint GPUs."""
    lag: int
    """d: the batch trained at version b is generated once version b - d is in the engine."""
    partial_rollout: bool
    """APRIL (over-sampling, unfinished samples resumed from their partial) or the synchronous baseline's scheduler
    (N' = N, every launched sample runs to its end within the step: no sample spans versions)."""
    step_boundary: str = "abort"
    sim_mode: str = "april-batch"
    """The simulator's APRIL mode (runner.MODES) of a partial-rollout mode."""
    strategy: str | None = None
    streaming: bool = False
    """The trainer takes the batch in parts as its groups complete (verl's streaming trainer)."""
    verl: str = ""
    """verl's mode this one stands for (VERL_FIGURES), if any."""
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lag, int) or isinstance(self.lag, bool) or self.lag < 0:
            raise ConfigError(f"AsyncMode.lag={self.lag!r} is not allowed: an int >= 0")
        if self.colocated and (self.lag != 0 or self.streaming):
            raise ConfigError(f"AsyncMode {self.name!r}: colocated=True is not allowed with lag={self.lag} or "
                              f"streaming={self.streaming}: colocated rollout and training take turns (lag 0, "
                              "no streaming)")
        if not self.partial_rollout and (self.strategy is not None or self.step_boundary != "abort"):
            raise ConfigError(f"AsyncMode {self.name!r}: partial_rollout=False is not allowed with a strategy or "
                              "step_boundary 'carry' (the baseline scheduler leaves nothing running)")


ASYNC_MODES: dict[str, AsyncMode] = {m.name: m for m in (
    AsyncMode("sync", colocated=True, lag=0, partial_rollout=False, verl="colocate sync",
              description="synchronous, colocated: all GPUs roll out (baseline scheduler), then all train"),
    AsyncMode("sync-april", colocated=True, lag=0, partial_rollout=True,
              description="synchronous APRIL, colocated"),
    AsyncMode("one-step-off", colocated=False, lag=1, partial_rollout=False, verl="one-step-off",
              description="disaggregated, d = 1, no partial rollout, whole batches (verl one_step_off_policy)"),
    AsyncMode("stream", colocated=False, lag=0, partial_rollout=False, streaming=True, verl="stream off-policy",
              description="disaggregated, d = 0, streaming trainer, no partial rollout (verl staleness 0)"),
    AsyncMode("stale", colocated=False, lag=1, partial_rollout=False, streaming=True, verl="stale, partial off",
              description="disaggregated, d = 1, streaming, no partial rollout (verl staleness 0.5, partial off)"),
    AsyncMode("stale-april", colocated=False, lag=1, partial_rollout=True, streaming=True,
              verl="stale + partial rollout",
              description="disaggregated, d = 1, streaming, APRIL abort (verl staleness 0.5, partial on)"),
    AsyncMode("stale-carry", colocated=False, lag=1, partial_rollout=True, step_boundary="carry", streaming=True,
              description="as stale-april, the running samples carried across the update with their KV"),
    AsyncMode("stale-best", colocated=False, lag=1, partial_rollout=True, sim_mode="april-adaptive",
              strategy="april_carry", streaming=True,
              description="as stale-carry with adaptive over-sampling (the best long-tail strategy, april_carry, "
                          "docs/strategies.md; carry + adaptive the most efficient engines, docs/sim.md)"),
    AsyncMode("async-april", colocated=False, lag=1, partial_rollout=True,
              description="april_ext's own asynchronous APRIL (--async-rollout, d = 1): whole batches"),
)}
"""The modes of the issue-36 table, in its order."""

VERL_FIGURES: dict[str, tuple[float, str]] = {
    "colocate sync": (1.0, "the baseline of verl's fully_async_policy table"),
    "stream off-policy": (1.58, "verl fully_async_policy, 128 GPUs, 400 steps: 1d 1h 53m against 1d 16h 48m"),
    "stale + partial rollout": (2.35, "verl fully_async_policy, 128 GPUs 64:64, 400 steps: 17h 22m against "
                                      "1d 16h 48m"),
    "stale, partial off": (math.nan, "not published by verl"),
    "one-step-off": (1.23, "verl one_step_off_policy, 2x16 H20, FSDP2, 20K responses: 19h18m -> 15h34m (+23%; "
                           "+40% with Megatron at 8K); another shape than the 128-GPU preset"),
}
"""verl's published whole-run speedups over colocated synchronous training (../shared/notes/async-anchors.md)."""


@dataclass(frozen=True)
class PipelineConfig:
    """The GPUs, the model, the rollout work and the trainer of one comparison of asynchronous modes."""

    gpu: str = "h100"
    model: str = "qwen3-8b"
    gpus: int = 8
    """All GPUs: colocated modes roll out and train on all of them."""
    rollout_gpus: int = 4
    """Disaggregated modes: GPUs of the engines; the other gpus - rollout_gpus train."""
    tensor_parallel: int = 1
    """GPUs per engine."""
    colocated_mem_fraction: float | None = None
    """SGLang's mem_fraction_static of colocated engines (None: the GPU's default); disaggregated engines use the
    GPU's default."""
    trainer: TrainerCost | None = None
    """The trainer (None: TrainerCost of gpu and model with its defaults)."""
    async_trainer: TrainerCost | None = None
    """The trainer of the disaggregated modes, where it differs (None: ``trainer``)."""
    lengths: str = "dapo-math-17k"
    algorithm: str = "grpo"
    rollout_batch_size: int = 32
    n_samples_per_prompt: int = 8
    over_sampling_batch_size: int | None = None
    max_response_len: int = 16384
    max_staleness: int | None = None
    """Versions a trained token may lag the version it is trained at, counted from the trained version as in
    april_ext's asynchronous runs: the scheduler is given max_staleness - d (None: no bound)."""
    staleness_policy: str = "keep"
    """SchedulerConfig.staleness_policy past max_staleness."""
    stream_parts: int = 4
    """Streaming modes: parts per batch (verl: trigger_parameter_sync_step 4)."""
    trainer_waits: bool = True
    """Disaggregated modes: the trainer takes its next batch only once its weights have landed in the engine, at
    the engine's next rollout-step boundary (april_ext's RolloutPipeline.publish); False: once it has sent them
    (weight_update_s after its training), the engine taking them at its next boundary (verl's fully_async trainer
    goes on after its parameter sync, which interrupts the rollout instead of waiting for it)."""
    abort_latency_s: float = 0.0
    steps: int = 8
    warmup_steps: int = 2
    """Batches left out of the summaries (the pipeline fills)."""
    seed: int = 0
    settle_passes: int = 16
    name: str = "custom"

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str) or not isinstance(self.model, str) or self.gpu not in GPUS \
                or self.model not in MODELS:
            raise ConfigError(f"PipelineConfig.gpu={self.gpu!r} / model={self.model!r} is not allowed: a GPU of "
                              f"{sorted(GPUS)} and a model of {sorted(MODELS)}")
        for name in ("gpus", "rollout_gpus", "tensor_parallel", "stream_parts", "steps", "rollout_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"PipelineConfig.{name}={value!r} is not allowed: an int >= 1")
        if not self.rollout_gpus < self.gpus:
            raise ConfigError(f"PipelineConfig.rollout_gpus={self.rollout_gpus} is not allowed: fewer than "
                              f"gpus={self.gpus} (the rest train)")
        for name in ("gpus", "rollout_gpus"):
            if getattr(self, name) % self.tensor_parallel:
                raise ConfigError(f"PipelineConfig.{name}={getattr(self, name)} is not allowed: a multiple of "
                                  f"tensor_parallel={self.tensor_parallel}")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"PipelineConfig.warmup_steps={self.warmup_steps!r} is not allowed: an int in "
                              f"[0, steps = {self.steps})")
        if self.stream_parts > self.rollout_batch_size:
            raise ConfigError(f"PipelineConfig.stream_parts={self.stream_parts} is not allowed: at most "
                              f"rollout_batch_size={self.rollout_batch_size} (a part holds whole groups)")
        if not isinstance(self.trainer_waits, bool):
            raise ConfigError(f"PipelineConfig.trainer_waits={self.trainer_waits!r} is not allowed: True or False")
        for name in ("trainer", "async_trainer"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, TrainerCost):
                raise ConfigError(f"PipelineConfig.{name} is a {type(value).__name__}; None or a TrainerCost")
        stale = self.max_staleness
        if stale is not None and (not isinstance(stale, int) or isinstance(stale, bool) or stale < 0):
            raise ConfigError(f"PipelineConfig.max_staleness={stale!r} is not allowed: None or an int >= 0")
        self.sim_config(ASYNC_MODES["sync"])  # the rollout settings, validated by SimConfig

    def scaled(self, factor: int) -> PipelineConfig:
        """The same shape on 1/factor of the GPUs with 1/factor of the prompts per step: every engine and trainer
        GPU gets the work it gets at full size, so step times and their ratios carry over (but for the longest
        sample of a step, drawn from fewer)."""
        for name in ("gpus", "rollout_gpus", "rollout_batch_size"):
            if getattr(self, name) % factor:
                raise ConfigError(f"PipelineConfig.scaled: factor={factor!r} is not allowed: it must divide "
                                  f"{name}={getattr(self, name)}")
        osb = None if self.over_sampling_batch_size is None else self.over_sampling_batch_size // factor
        return replace(self, gpus=self.gpus // factor, rollout_gpus=self.rollout_gpus // factor,
                       rollout_batch_size=self.rollout_batch_size // factor, over_sampling_batch_size=osb,
                       name=f"{self.name} 1/{factor}" if factor > 1 else self.name)

    def trainer_of(self, mode: AsyncMode) -> TrainerCost:
        base = self.trainer or TrainerCost(GPUS[self.gpu], MODELS[self.model])
        return base if mode.colocated or self.async_trainer is None else self.async_trainer

    def trainer_gpus(self, mode: AsyncMode) -> int:
        return self.gpus if mode.colocated else self.gpus - self.rollout_gpus

    def sim_config(self, mode: AsyncMode) -> SimConfig:
        """The simulator's run of this mode's rollout: its engines, scheduler and weight update."""
        if self.max_staleness is not None and self.max_staleness < mode.lag:
            raise ConfigError(f"PipelineConfig.max_staleness={self.max_staleness} is not allowed with mode "
                              f"{mode.name!r}: at least its d = {mode.lag} (None: no bound)")
        engine_gpus = self.gpus if mode.colocated else self.rollout_gpus
        return SimConfig(
            cluster=f"{self.gpu}-{self.model}", lengths=self.lengths,
            mode=mode.sim_mode if mode.partial_rollout else "baseline",  # type: ignore[arg-type]
            algorithm=self.algorithm, num_engines=engine_gpus // self.tensor_parallel,
            tensor_parallel=self.tensor_parallel,
            mem_fraction_static=self.colocated_mem_fraction if mode.colocated else None,
            abort_latency_s=self.abort_latency_s, weight_sync_s=self.trainer_of(mode).weight_update_s,
            colocate=mode.colocated, steps=self.steps, warmup_steps=self.warmup_steps, seed=self.seed,
            settle_passes=self.settle_passes, strategy=mode.strategy, rollout_batch_size=self.rollout_batch_size,
            n_samples_per_prompt=self.n_samples_per_prompt, over_sampling_batch_size=self.over_sampling_batch_size,
            max_response_len=self.max_response_len,
            max_staleness=None if self.max_staleness is None else self.max_staleness - mode.lag,
            staleness_policy=self.staleness_policy,  # type: ignore[arg-type]
            step_boundary=mode.step_boundary)  # type: ignore[arg-type]


@dataclass
class BatchTimes:
    """One batch on the timeline (virtual seconds) and what it trained."""

    version: int
    """The version it is trained at (it publishes version + 1)."""
    generated_under: int
    """The engine's version when its rollout step began."""
    rollout_start: float
    rollout_end: float
    train_start: float = math.nan
    train_end: float = math.nan
    train_s: float = 0.0
    """Seconds the trainer spent on it (its parts together)."""
    samples: int = 0
    trained_tokens: int = 0
    """Response tokens trained (loss-masked in)."""
    lag_histogram: dict[int, int] = field(default_factory=dict)
    multi_version_frac: float = 0.0


@dataclass
class PipelineResult:
    """The timeline of one mode, and its summary over the batches after the warm-up."""

    config: PipelineConfig
    mode: AsyncMode
    batches: list[BatchTimes]
    waits: list[tuple[float, float, str]]
    """(start, seconds, "bound" | "update"): the engine waiting for the bound, or stalled for a weight update."""
    wall_seconds: float = 0.0
    summary: dict[str, float] = field(default_factory=dict)


class _Timeline:
    """The trainer's side: trains batches in order once each is generated and the trainer is free: after the
    previous batch's weights landed in the engine (``waits``, april_ext's pipeline), or once it has sent them."""

    def __init__(self, trainer: TrainerCost, gpus: int, parts: int, waits: bool) -> None:
        self.trainer, self.gpus, self.parts, self.waits = trainer, gpus, parts, waits
        self.batches: list[BatchTimes] = []
        self.ready: list[list[tuple[float, np.ndarray]]] = []  # per batch: (part ready time, its sequence lengths)
        self.published = {0: 0.0}  # version -> when it landed in the engine
        self.next_train = 0

    def add(self, times: BatchTimes, parts: list[tuple[float, np.ndarray]]) -> None:
        self.batches.append(times)
        self.ready.append(parts)
        self.schedule()

    def _free_at(self, v: int) -> float | None:
        """When the trainer may start batch v (None: not known yet, its version has not landed)."""
        if self.waits or v == 0:
            return self.published.get(v)
        return self.batches[v - 1].train_end + self.trainer.weight_update_s

    def schedule(self) -> None:
        """Trains every batch that is generated and whose trainer is free."""
        while self.next_train < len(self.batches) and (clock := self._free_at(self.next_train)) is not None:
            b = self.batches[self.next_train]
            for ready, lens in self.ready[self.next_train]:
                start = max(clock, ready)
                if math.isnan(b.train_start):
                    b.train_start = start
                seconds = self.trainer.train_seconds(lens, self.gpus)
                b.train_s += seconds
                clock = start + seconds
            b.train_end = clock
            self.next_train += 1

    def pending(self) -> list[BatchTimes]:
        """The batches trained whose weights have not landed, oldest first."""
        newest = max(self.published)
        return self.batches[newest:self.next_train]


async def _land(engine: SimulatedEngine, timeline: _Timeline, waits: list[tuple[float, float, str]]) -> None:
    """At a rollout-step boundary: the newest weights whose training has ended land in the engine (it stalls)."""
    while done := [b for b in timeline.pending() if b.train_end <= engine.clock()]:
        start = engine.clock()
        version = done[-1].version + 1
        await engine.update_weights({}, version)
        waits.append((start, engine.clock() - start, "update"))
        for v in range(max(timeline.published) + 1, version + 1):
            timeline.published[v] = engine.clock()
        timeline.schedule()


def _lags(batch: TrainingBatch) -> tuple[dict[int, int], float]:
    """Trained tokens per lag behind the batch's policy_version, and the share of samples whose model tokens come
    from more than one version (version_lags, the asynchronous run's own measures)."""
    lags = version_lags(batch)
    return ({int(lag): tokens for lag, tokens in lags["version_lag_histogram"].items()},
            lags["multi_version_frac"])


def _parts(batch: TrainingBatch, finished: np.ndarray, end: float, parts: int) -> list[tuple[float, np.ndarray]]:
    """The batch's groups in order of completion, cut into ``parts`` parts: (time its groups are complete, its
    sequence lengths). A sample with no finish time (its end was not seen in this step) counts as done at ``end``."""
    done = np.where(np.isnan(finished), end, np.minimum(finished, end))
    groups = np.unique(batch.group_index)
    completed = np.array([done[batch.group_index == g].max() for g in groups])
    order = groups[np.argsort(completed, kind="stable")]
    lens = batch.sequence_lens
    out = []
    for chunk in np.array_split(np.arange(order.size), parts):
        members = np.isin(batch.group_index, order[chunk])
        ready = float(completed[np.isin(groups, order[: chunk[-1] + 1])].max())
        out.append((ready, lens[members]))
    return out


def _presets() -> dict[str, PipelineConfig]:
    h100, h20 = GPUS["h100"], GPUS["h20"]
    verl_trainer = TrainerCost(h20, MODELS["qwen2.5-math-7b"], weight_update_s=0.12)
    return {
        # The APRIL paper's setting (docs/sim.md): 8 H100s, Qwen3-8B, 32 prompts x 8, N' 64, a 16K cap; colocated as
        # 4 engines of TP 2 at mem 0.6 with 0.5 s aborts and 4 s weight updates (the APRIL scripts); disaggregated
        # 4:4 (2 engines of TP 2). The trainer recomputes the old logprobs (slime's Megatron trainer does).
        "paper-8gpu": PipelineConfig(
            gpu="h100", model="qwen3-8b", gpus=8, rollout_gpus=4, tensor_parallel=2, colocated_mem_fraction=0.6,
            trainer=TrainerCost(h100, MODELS["qwen3-8b"], weight_update_s=4.0), abort_latency_s=0.5,
            rollout_batch_size=32, n_samples_per_prompt=8, max_response_len=16384, name="paper-8gpu"),
        # verl's fully_async_policy setting (../shared/notes/async-anchors.md): 128 H20s, Qwen2.5-Math-7B, 512
        # prompts x 16, responses up to 28K (28 x 1024) tokens, colocated sync on 128, async 64:64. Lengths: the
        # dapo-math-17k preset's shape (calibrated to the APRIL paper's 16K statistics) with the 28K cap. Weight
        # update 0.12 s: verl's measured 7B sync before its checkpoint engine. The asynchronous trainer uses the
        # engine's logprobs (verl's fully_async rows have no old_log_prob phase).
        "verl-7b-dapo": PipelineConfig(
            gpu="h20", model="qwen2.5-math-7b", gpus=128, rollout_gpus=64, tensor_parallel=1,
            trainer=verl_trainer, async_trainer=replace(verl_trainer, recompute_old_logprobs=False),
            rollout_batch_size=512, n_samples_per_prompt=16, max_response_len=28 * 1024, name="verl-7b-dapo"),
    }


PIPELINE_PRESETS: dict[str, PipelineConfig] = _presets()
"""The issue-36 presets: the APRIL paper's 8 GPUs and verl's 128 (docs/sim.md, "Asynchronous modes at scale")."""


async def simulate_mode_async(config: PipelineConfig, mode: AsyncMode) -> PipelineResult:
    """Runs ``config.steps`` batches of ``mode`` on the timeline (see the module's docstring)."""
    started = time.perf_counter()
    sim = config.sim_config(mode)
    cluster, lengths = sim.cluster_config(), sim.length_model()
    capacity = (cluster.num_engines * max(1, round(sim.occupancy_bound().mean_batch)) if mode.sim_mode ==
                "april-adaptive" and mode.partial_rollout else cluster.num_engines * cluster.cost.max_num_seqs)
    scheduler = Scheduler(sim.scheduler_config(capacity), SyntheticPrompts(sim.dataset_size, sim.prompt_len))
    timeline = _Timeline(config.trainer_of(mode), config.trainer_gpus(mode),
                         config.stream_parts if mode.streaming else 1, mode.colocated or config.trainer_waits)
    waits: list[tuple[float, float, str]] = []
    async with SimulatedEngine(cluster, lengths, settle_passes=sim.settle_passes) as engine:
        loop = RolloutLoop(engine, scheduler, score_answer, sampling=SamplingParams(),
                           group_filter=reject_uniform_groups if sim.algorithm == "dapo" else None,
                           seed=sim.seed, engine_capacity=capacity)
        for b in range(config.steps):
            await _land(engine, timeline, waits)
            while engine.weight_version < b - mode.lag:  # the bound: wait for version b - d
                pending = timeline.pending()
                if not pending:
                    raise InternalError(f"batch {b} waits for version {b - mode.lag}, which nothing trains")
                start = engine.clock()
                await engine.wait_until(pending[b - mode.lag - 1 - pending[0].version].train_end)
                waits.append((start, engine.clock() - start, "bound"))
                await _land(engine, timeline, waits)
            under, start = engine.weight_version, engine.clock()
            result = await loop.run_step(under)
            end = engine.clock()
            batch = replace(result.batch, policy_version=b)
            finished = np.array([engine.finish_time(batch.tokens[batch.offsets[i]:batch.offsets[i + 1]])
                                 for i in range(batch.n_samples)], np.float64)
            histogram, multi = _lags(batch)
            times = BatchTimes(version=b, generated_under=under, rollout_start=start, rollout_end=end,
                               samples=batch.n_samples, trained_tokens=int(batch.loss_mask.sum()),
                               lag_histogram=histogram, multi_version_frac=multi)
            timeline.add(times, _parts(batch, finished, end, timeline.parts))
        if mode.step_boundary == "carry":
            await loop.abort_carried()
        await loop.drain_rewards()
        while pending := timeline.pending():  # the rest of the training, the engine idle (as a last step's)
            start = engine.clock()
            await engine.wait_until(pending[-1].train_end)
            waits.append((start, engine.clock() - start, "bound"))
            await _land(engine, timeline, waits)
    if timeline.next_train != config.steps:
        raise InternalError(f"{timeline.next_train} of {config.steps} batches trained")
    out = PipelineResult(config, mode, timeline.batches, waits)
    out.summary = _summarize(timeline.batches, waits, config.warmup_steps)
    out.wall_seconds = time.perf_counter() - started
    return out


def _summarize(batches: list[BatchTimes], waits: list[tuple[float, float, str]], warmup: int) -> dict[str, float]:
    """Per-step figures over the batches after the warm-up: the window runs from the end of the last warm-up
    batch's training (0 without warm-up) to the end of the last batch's."""
    steady = batches[warmup:]
    t0 = batches[warmup - 1].train_end if warmup else 0.0
    t1 = batches[-1].train_end
    n = len(steady)
    window = t1 - t0

    def waited(kind: str) -> float:
        return sum(s for t, s, k in waits if k == kind and t0 <= t < t1) / n

    hist: dict[int, int] = {}
    for b in steady:
        for lag, count in b.lag_histogram.items():
            hist[lag] = hist.get(lag, 0) + count
    tokens = sum(hist.values())
    train_s = sum(b.train_s for b in steady)
    return {
        "step_s": window / n,
        "samples_per_s": sum(b.samples for b in steady) / window if window > 0 else 0.0,
        "tokens_per_s": sum(b.trained_tokens for b in steady) / window if window > 0 else 0.0,
        "offpolicy_token_share": sum(c for lag, c in hist.items() if lag > 0) / tokens if tokens else 0.0,
        "version_lag_mean": sum(lag * c for lag, c in hist.items()) / tokens if tokens else 0.0,
        "version_lag_max": float(max(hist, default=0)),
        "multi_version_frac": float(np.mean([b.multi_version_frac for b in steady])),
        "rollout_s": float(np.mean([b.rollout_end - b.rollout_start for b in steady])),
        "train_s": train_s / n,
        "trainer_idle_s": (window - train_s) / n,
        "engine_idle_s": waited("bound"),
        "weight_update_s": waited("update"),
    }


def simulate_mode(config: PipelineConfig, mode: str | AsyncMode) -> PipelineResult:
    """Synchronous wrapper of simulate_mode_async; ``mode`` a name of ASYNC_MODES or an AsyncMode."""
    if isinstance(mode, str):
        if mode not in ASYNC_MODES:
            raise ConfigError(f"asynchronous mode {mode!r} is not known: one of {', '.join(ASYNC_MODES)}")
        mode = ASYNC_MODES[mode]
    return asyncio.run(simulate_mode_async(config, mode))


__all__ = ["ASYNC_MODES", "AsyncMode", "BatchTimes", "PIPELINE_PRESETS", "PipelineConfig", "PipelineResult",
           "VERL_FIGURES",
           "simulate_mode", "simulate_mode_async"]
