"""Run the real scheduler through the real rollout loop over the simulated engine, step after step."""

from __future__ import annotations

import asyncio
import math
import os
import time
from dataclasses import dataclass, field, fields, replace
from typing import Literal

import numpy as np

from april_ext.algorithms.filters import reject_uniform_groups
from april_ext.errors import ConfigError
from april_ext.protocol.sampling_params import SamplingParams
from april_ext.rollout import RolloutLoop
from april_ext.scheduler import Scheduler, SchedulerConfig
from april_ext.settings import adopt
from april_ext.sim.cost import CLUSTER_PRESETS, GPUS, MODELS, ClusterConfig, cluster_preset, is_cluster_name
from april_ext.sim.engine import SimulatedEngine
from april_ext.sim.lengths import (
    LENGTH_PRESETS,
    LengthModel,
    TraceLengths,
    length_preset,
)
from april_ext.sim.metrics import (
    OccupancyBound,
    StepReport,
    full_occupancy_bound,
    length_bias,
    step_report,
)
from april_ext.sim.tokens import SyntheticPrompts, score_answer
from april_ext.sim.turns import TURN_PRESETS, TurnModel, turn_preset
from april_ext.sim.waves import WaveRollout
from april_ext.strategies import STRATEGIES, configure, scheduler_config_for

Mode = Literal["baseline", "april-batch", "april-continuous", "april-adaptive"]
MODES: tuple[str, ...] = ("baseline", "april-batch", "april-continuous", "april-adaptive")
ALGORITHMS = ("grpo", "dapo")
DAPO_BASELINES = ("replace", "waves")
APRIL_LOOPS = ("scheduler", "slime")
MODE_SETTINGS = ("refill", "over_sampling")
"""The SchedulerConfig fields each mode sets (see SimConfig.scheduler_config); SimConfig has all the others."""


@dataclass(frozen=True)
@adopt(SchedulerConfig, exclude=MODE_SETTINGS, docs={
    "max_inflight_samples": "APRIL modes: cap on samples dispatched to the engines at once; None: no cap. With a "
                            "large N' it holds the engines at a target load.",
    "target_inflight_samples": "april-adaptive: samples the scheduler keeps live; None: the engines' capacity "
                               "(replicas x B_sat of the steady-state rate)."})
class SimConfig:
    """One simulated run. ``cluster`` is a preset name (see CLUSTER_PRESETS) or a ClusterConfig; ``lengths``
    a length preset name (see LENGTH_PRESETS), an agentic preset name (see turns.TURN_PRESETS: multi-turn
    trajectories with tool calls), a .csv / .jsonl trace path, or a LengthModel (a TurnModel for agentic runs).
    The scheduler's settings are SchedulerConfig's fields (adopted after the fields written here), except
    MODE_SETTINGS."""

    cluster: str | ClusterConfig = "h100-qwen3-8b"
    lengths: str | LengthModel = "dapo-math-17k"
    mode: Mode = "april-batch"
    algorithm: str = "grpo"
    """"grpo": every complete group is trained; "dapo": dynamic sampling drops groups with equal rewards (and its
    baseline over-samples N' groups, discarding unfinished ones: see scheduler_config)."""
    dapo_baseline: str = "replace"
    """The DAPO baseline's refill (mode "baseline" with algorithm "dapo"): "replace" launches a group for each one
    the filter rejects (the scheduler with N' = N and continuous refill); "waves" is slime's own rollout: a wave
    of N groups (slime's default N' = N, as the baseline scripts leave it) whenever the groups in flight plus
    those accepted are fewer than N, the rest aborted and discarded at N accepted (april_ext.sim.waves)."""
    april_loop: str = "scheduler"
    """Mode "april-batch": "scheduler" runs the scheduler's batch refill through the rollout loop; "slime" runs
    slime's own rollout with --partial-rollout, as the APRIL paper's runs do (april_ext.sim.waves): a wave of N'
    groups from the buffer first whenever the groups in flight plus those accepted are fewer than N, abort at N
    accepted, every unfinished group back to the buffer, groups completing beyond N at that instant dropped. The
    other modes run the scheduler whatever this says. Under GRPO the two agree (but for those dropped groups, which
    the scheduler keeps with keep_surplus); under DAPO the scheduler's next wave waits for the current one to end."""
    num_engines: int = 8
    mixed_chunk: bool = False
    """Engines run mixed chunked prefill (prefill chunks inside decode iterations; CostModel.mixed_chunk). Applies
    to a preset and, when True, to a given ClusterConfig's cost model too."""
    chunked_prefill_size: int = 8192
    """Prefill tokens per mixed iteration at most (with mixed_chunk)."""
    tensor_parallel: int = 1
    """GPUs per engine (a preset's engines are tensor-parallel over this many GPUs)."""
    mem_fraction_static: float | None = None
    """SGLang's share of each GPU's memory for weights + KV pool (a preset); None: the GPU's default."""
    abort_latency_s: float = 0.0
    """Virtual seconds an abort call takes (a preset; a given ClusterConfig carries its own)."""
    weight_sync_s: float = 0.0
    """Virtual seconds a weight update takes, outside the rollout window (a preset; a ClusterConfig has its own)."""
    colocate: bool = False
    """Engines share their GPUs with the trainer (a preset; a ClusterConfig has its own): with step_boundary "carry"
    the carried KV is copied to host memory and back at every step boundary (ClusterConfig.colocated)."""
    steps: int = 6
    warmup_steps: int = 1
    """Steps left out of the run summaries (the buffer and the running mix start empty)."""
    prompt_len: int = 256
    dataset_size: int = 100_000
    seed: int = 0
    settle_passes: int = 16
    strategy: str | None = None
    """A long-tail strategy of april_ext.strategies.STRATEGIES, run by the APRIL modes (the baseline stays the
    synchronous reference): it sets the scheduler settings still at SchedulerConfig's defaults (N': None); a
    setting given another value wins. N' resolves at construction, so give the strategy to the constructor
    (``replace(config, strategy=...)`` keeps the N' already resolved)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"SimConfig.mode={self.mode!r} is not allowed: one of {MODES}")
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"SimConfig.algorithm={self.algorithm!r} is not allowed: one of {ALGORITHMS}")
        if self.dapo_baseline not in DAPO_BASELINES:
            raise ConfigError(f"SimConfig.dapo_baseline={self.dapo_baseline!r} is not allowed: one of "
                              f"{DAPO_BASELINES}")
        if self.april_loop not in APRIL_LOOPS:
            raise ConfigError(f"SimConfig.april_loop={self.april_loop!r} is not allowed: one of {APRIL_LOOPS}")
        if self.april_loop == "slime" and self.mode == "april-batch" and self.strategy is not None:
            raise ConfigError(f"SimConfig.strategy={self.strategy!r} is not allowed with april_loop='slime' (slime's "
                              "loop runs no scheduler): None, or april_loop='scheduler'")
        if self.strategy is not None and (not isinstance(self.strategy, str) or self.strategy not in STRATEGIES):
            raise ConfigError(f"SimConfig.strategy={self.strategy!r} is not allowed: None or one of "
                              f"{', '.join(STRATEGIES)}")
        if self.strategy is not None and self.mode == "baseline":
            raise ConfigError(f"SimConfig.strategy={self.strategy!r} is not allowed with mode 'baseline' (the "
                              "synchronous reference): None, or an APRIL mode")
        for name in ("mixed_chunk", "colocate"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"SimConfig.{name}={getattr(self, name)!r} is not allowed: True or False")
        self._check_cluster_and_lengths()
        for name in ("steps", "num_engines", "prompt_len", "dataset_size", "chunked_prefill_size", "tensor_parallel",
                     "settle_passes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"SimConfig.{name}={value!r} is not allowed: an int >= 1")
        if not isinstance(self.warmup_steps, int) or not 0 <= self.warmup_steps < self.steps:
            raise ConfigError(f"SimConfig.warmup_steps={self.warmup_steps!r} is not allowed: an int in "
                              f"[0, steps = {self.steps})")
        if self.prompt_len > 1 << 20:  # a synthetic prompt is a list of this many tokens
            raise ConfigError(f"SimConfig.prompt_len={self.prompt_len!r} is not allowed: an int in [1, 2**20]")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ConfigError(f"SimConfig.seed={self.seed!r} is not allowed: an int >= 0")
        fraction = self.mem_fraction_static
        if fraction is not None and (not isinstance(fraction, (int, float)) or isinstance(fraction, bool)
                                     or not 0 < fraction <= 1):
            raise ConfigError(f"SimConfig.mem_fraction_static={fraction!r} is not allowed: None or a number in (0, 1]")
        for name in ("abort_latency_s", "weight_sync_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < math.inf:
                raise ConfigError(f"SimConfig.{name}={value!r} is not allowed: a finite number >= 0")
        shared = self._shared_scheduler_config()
        if self.target_inflight_samples is not None:  # checked as april-adaptive uses it (other modes do not)
            replace(shared, over_sampling="adaptive", target_inflight_samples=self.target_inflight_samples)
        # None: SchedulerConfig's N' (2N) or the strategy's, so that reports show the value run.
        object.__setattr__(self, "over_sampling_batch_size", shared.over_sampling_batch_size)
        if self.agentic and self.mixed_chunk:
            raise ConfigError(f"SimConfig.mixed_chunk=True is not allowed with the agentic lengths {self.lengths!r}: "
                              "turns are modelled with separate prefill only (mixed_chunk=False)")

    def _check_cluster_and_lengths(self) -> None:
        """cluster: a ClusterConfig or a <gpu>-<model> name; lengths: a LengthModel, a preset or a trace file."""
        cluster = self.cluster
        if not isinstance(cluster, ClusterConfig) and not is_cluster_name(cluster):
            raise ConfigError(f"SimConfig.cluster={cluster!r} is not allowed: a ClusterConfig, a preset "
                              f"({', '.join(CLUSTER_PRESETS)}) or <gpu>-<model> with a GPU of {sorted(GPUS)} "
                              f"and a model of {sorted(MODELS)}")
        lengths = self.lengths
        if isinstance(lengths, str):
            is_trace = os.path.isfile(lengths) and lengths.endswith((".csv", ".jsonl", ".json"))
            if lengths not in LENGTH_PRESETS and lengths not in TURN_PRESETS and not is_trace:
                raise ConfigError(f"SimConfig.lengths={lengths!r} is not allowed: a length preset "
                                  f"({', '.join(sorted(LENGTH_PRESETS))}), an agentic preset "
                                  f"({', '.join(sorted(TURN_PRESETS))}) or the path of a .csv / .jsonl length trace")
        elif not callable(getattr(lengths, "draw", None)):
            raise ConfigError(f"SimConfig.lengths={lengths!r} is not allowed: a preset name, a trace path or a "
                              "LengthModel (an object with draw(prompt_key, ordinal, version))")

    def _shared_scheduler_config(self) -> SchedulerConfig:
        """Every mode's scheduler settings but the mode's own, validated by SchedulerConfig; with the strategy in
        an APRIL mode."""
        given = {f.name: getattr(self, f.name) for f in fields(SchedulerConfig)
                 if f.name not in (*MODE_SETTINGS, "target_inflight_samples")}
        return configure(given, None if self.mode == "baseline" else self.strategy)

    def scheduler_config(self, engine_capacity: int | None = None) -> SchedulerConfig:
        """APRIL as configured; the baseline is what slime does without partial rollout (april_ext.strategies'
        baseline "synchronous" for GRPO, "synchronous_dapo" for DAPO's dynamic sampling), ending its steps as slime
        does (step_boundary "abort") with no cap on samples in flight; the APRIL modes use step_boundary as configured.
        april-adaptive is continuous refill with adaptive over-sampling, its target target_inflight_samples
        or else ``engine_capacity`` (samples the engines run at once)."""
        adaptive = self.mode == "april-adaptive"
        target = self.target_inflight_samples or engine_capacity
        if adaptive and target is None:
            raise ConfigError("SimConfig.target_inflight_samples=None is not allowed for mode 'april-adaptive' "
                              "unless the engine capacity is given: an int >= n_samples_per_prompt")
        shared = self._shared_scheduler_config()
        if self.mode == "baseline":
            base = replace(shared, max_inflight_samples=None, step_boundary="abort")
            return scheduler_config_for(base, False, "synchronous_dapo" if self.algorithm == "dapo" else "synchronous")
        return replace(shared, refill="continuous" if self.mode in ("april-continuous", "april-adaptive") else "batch",
                       over_sampling="adaptive" if adaptive else "fixed",
                       target_inflight_samples=target if adaptive else None)

    def cluster_config(self) -> ClusterConfig:
        if isinstance(self.cluster, ClusterConfig):
            if not self.mixed_chunk:
                return self.cluster
            cost = replace(self.cluster.cost, mixed_chunk=True, chunked_prefill_size=self.chunked_prefill_size)
            return replace(self.cluster, cost=cost)
        return cluster_preset(self.cluster, num_engines=self.num_engines, mixed_chunk=self.mixed_chunk,
                              chunked_prefill_size=self.chunked_prefill_size, tensor_parallel=self.tensor_parallel,
                              mem_fraction_static=self.mem_fraction_static, abort_latency_s=self.abort_latency_s,
                              weight_sync_s=self.weight_sync_s, colocated=self.colocate)

    @property
    def agentic(self) -> bool:
        """The samples are multi-turn trajectories with tool calls (an agentic preset or a TurnModel)."""
        return isinstance(self.lengths, TurnModel) or (isinstance(self.lengths, str) and self.lengths in TURN_PRESETS)

    @property
    def waves_baseline(self) -> bool:
        """The run is slime's wave-refill DAPO baseline (driven by april_ext.sim.waves, not the scheduler)."""
        return self.mode == "baseline" and self.algorithm == "dapo" and self.dapo_baseline == "waves"

    @property
    def slime_april(self) -> bool:
        """The run is APRIL as slime runs it (waves with partial rollout, april_ext.sim.waves), not the scheduler."""
        return self.mode == "april-batch" and self.april_loop == "slime"

    @property
    def bound_version(self) -> int:
        """Weight version of the run's middle step: the bound and the natural lengths are taken there."""
        return (self.steps - 1) // 2

    def occupancy_bound(self) -> OccupancyBound:
        """The steady-state rate of this cluster and length model (see full_occupancy_bound): B_sat and a reference."""
        return full_occupancy_bound(self.cluster_config(), self.length_model(), self.max_response_len,
                                    self.prompt_len, self.bound_version)

    def length_model(self) -> LengthModel:
        if not isinstance(self.lengths, str):
            return self.lengths
        if self.lengths in LENGTH_PRESETS:
            return length_preset(self.lengths, seed=self.seed)
        if self.lengths in TURN_PRESETS:
            return turn_preset(self.lengths, seed=self.seed)
        return TraceLengths.from_file(self.lengths)


@dataclass
class SimResult:
    """Per-step reports of one run, the bound they are measured against, and run-level summaries."""

    config: SimConfig
    bound: OccupancyBound
    steps: list[StepReport]
    natural_mean: float
    scheduler: SchedulerConfig
    """The scheduler settings run (the mode's and the strategy's applied); slime's loops (the waves DAPO baseline,
    april_loop "slime") run no scheduler: those of the replacing baseline, or of april-batch."""
    wall_seconds: float = 0.0
    summary: dict[str, float] = field(default_factory=dict)


def _weighted(values: list[float], weights: list[float]) -> float:
    total = float(sum(weights))
    return float(np.dot(values, weights) / total) if total > 0 else 0.0


def _summarize(steps: list[StepReport], natural: np.ndarray, bound: OccupancyBound,
               warmup_steps: int = 1) -> dict[str, float]:
    """Run-level figures over the steps after the warm-up (the first steps, whose buffer starts empty).

    Every figure is a ratio of sums over those steps, as the throughput is: efficiency is the least time of
    their work over their rollout time (so the run's throughput over the run's bound), time fractions are
    weighted by step duration, token ratios by trained tokens. (A plain mean of per-step ratios would let a
    short step count as much as a long one.) The largest staleness is over all steps.
    """
    steady = steps[warmup_steps:] if len(steps) > warmup_steps else steps
    seconds = sum(s.rollout_s for s in steady)
    tokens = sum(s.generated_tokens for s in steady)
    discarded = sum(s.discarded_tokens for s in steady)
    least = sum(s.least_time_s for s in steady)
    ceiling = sum(s.ceiling_time_s for s in steady)
    trained = np.concatenate([np.asarray(s.response_lens, np.int64) for s in steps])
    bias = length_bias(trained, natural)
    durations = [s.rollout_s for s in steady]
    batch_tokens = [float(s.trained_tokens) for s in steady]
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    timed = [s for s in steady if not math.isnan(s.tail_latency)]  # a step with no time (batch in the buffer)
    predicted = [s for s in steady if not math.isnan(s.prediction_rank_corr)]  # NaN below 2 samples
    hits = sum(s.prefix_hit_tokens for s in steady)
    misses = sum(s.continuation_prefill_tokens for s in steady)
    return {
        "tokens_per_s": tokens_per_s,
        "useful_tokens_per_s": (tokens - discarded) / seconds if seconds > 0 else 0.0,
        "trained_tokens_per_s": sum(batch_tokens) / seconds if seconds > 0 else 0.0,
        "efficiency": least / seconds if seconds > 0 else 0.0,
        "ceiling_efficiency": ceiling / seconds if seconds > 0 else 0.0,
        "bound_tokens_per_s": tokens / least if least > 0 else 0.0,
        "ceiling_tokens_per_s": tokens / ceiling if ceiling > 0 else 0.0,
        "steady_state_efficiency": tokens_per_s / bound.tokens_per_s if bound.tokens_per_s > 0 else 0.0,
        "bubble_fraction": _weighted([s.bubble_fraction for s in steady], durations),
        "partial_token_ratio": _weighted([s.partial_token_ratio for s in steady], batch_tokens),
        "offpolicy_token_ratio": _weighted([s.offpolicy_token_ratio for s in steady], batch_tokens),
        "re_prefill_time_fraction": _weighted([s.re_prefill_time_fraction for s in steady], durations),
        "kv_copy_time_fraction": _weighted([s.kv_copy_time_fraction for s in steady], durations),
        "recompute_time_fraction": _weighted([s.recompute_time_fraction for s in steady], durations),
        "idle_time_fraction": _weighted([s.idle_time_fraction for s in steady], durations),
        "underfill_fraction": _weighted([s.underfill_fraction for s in steady], durations),
        "tail_latency": _weighted([s.tail_latency for s in timed], [s.rollout_s for s in timed]) if timed else math.nan,
        "continuations_per_step": float(np.mean([s.continuations for s in steady])),
        "prefix_hit_token_ratio": hits / (hits + misses) if hits + misses > 0 else 0.0,
        "continuation_prefill_time_fraction": _weighted([s.continuation_prefill_time_fraction for s in steady],
                                                        durations),
        "chunk_returns_per_step": float(np.mean([s.chunk_returns for s in steady])),
        "long_round_share": float(np.mean([s.long_round for s in steady])),
        "tool_calls_per_step": float(np.mean([s.tool_calls for s in steady])),
        "env_prefill_time_fraction": _weighted([s.env_prefill_time_fraction for s in steady], durations),
        "prediction_rank_corr": _weighted([s.prediction_rank_corr for s in predicted],
                                          [float(s.prediction_samples) for s in predicted]) if predicted else math.nan,
        "max_staleness": float(max((len(s.staleness_histogram) - 1 for s in steps), default=0)),
        "rollout_s": seconds / len(steady),
        "length_mean_ratio": bias["mean_ratio"],
        "length_w1_rel": bias["w1_rel"],
        "first_step_length_w1_rel": steps[0].length_w1_rel,
        "last_step_length_w1_rel": steps[-1].length_w1_rel,
    }


async def simulate_async(config: SimConfig, bound: OccupancyBound | None = None) -> SimResult:
    """Runs ``config.steps`` rollout steps; weights are "updated" to version + 1 after each (training is
    instantaneous in virtual time: only rollout is measured)."""
    started = time.perf_counter()
    cluster = config.cluster_config()
    lengths = config.length_model()
    if bound is None:
        bound = full_occupancy_bound(cluster, lengths, config.max_response_len, config.prompt_len,
                                     config.bound_version)
    natural = np.minimum(lengths.natural_lengths(config.bound_version), config.max_response_len)
    capacity = cluster.num_engines * max(1, round(bound.mean_batch))
    scheduler_config = config.scheduler_config(capacity)
    scheduler = Scheduler(scheduler_config, SyntheticPrompts(config.dataset_size, config.prompt_len))
    reports = []
    if config.waves_baseline or config.slime_april:
        dapo = config.algorithm == "dapo"
        async with SimulatedEngine(cluster, lengths, settle_passes=config.settle_passes) as engine:
            waves = WaveRollout(engine, SyntheticPrompts(config.dataset_size, config.prompt_len),
                                rollout_batch_size=config.rollout_batch_size,
                                n_samples_per_prompt=config.n_samples_per_prompt,
                                over_sampling_batch_size=(config.over_sampling_batch_size if config.slime_april
                                                          else config.rollout_batch_size),
                                max_response_len=config.max_response_len,
                                group_filter=reject_uniform_groups if dapo else None,
                                partial_rollout=config.slime_april)
            for step in range(config.steps):
                before = engine.counters()
                wave_step = await waves.run_step(step)
                after = engine.counters()
                reports.append(step_report(step, wave_step.metrics, after.minus(before), bound, natural, cluster.cost,
                                           wave_step.finish_times, after.now))
                await engine.update_weights({}, step + 1)
        return _result(config, bound, reports, natural, scheduler_config, started)
    async with SimulatedEngine(cluster, lengths, settle_passes=config.settle_passes) as engine:
        loop = RolloutLoop(engine, scheduler, score_answer, sampling=SamplingParams(),
                           group_filter=reject_uniform_groups if config.algorithm == "dapo" else None,
                           seed=config.seed, engine_capacity=capacity)
        for step in range(config.steps):
            before = engine.counters()
            result = await loop.run_step(step)
            after = engine.counters()
            batch = result.batch
            finished = np.array([engine.finish_time(batch.tokens[batch.offsets[i]:batch.offsets[i + 1]])
                                 for i in range(batch.n_samples)], np.float64)
            reports.append(step_report(step, result.metrics, after.minus(before), bound, natural, cluster.cost,
                                       finished, after.now))
            await engine.update_weights({}, step + 1)
        await loop.drain_rewards()
    return _result(config, bound, reports, natural, scheduler_config, started)


def _result(config: SimConfig, bound: OccupancyBound, reports: list[StepReport], natural: np.ndarray,
            scheduler: SchedulerConfig, started: float) -> SimResult:
    out = SimResult(config, bound, reports, float(natural.mean()), scheduler)
    out.summary = _summarize(reports, natural, bound, config.warmup_steps)
    out.wall_seconds = time.perf_counter() - started
    return out


def simulate(config: SimConfig, bound: OccupancyBound | None = None) -> SimResult:
    """Synchronous wrapper of simulate_async (runs its own event loop)."""
    return asyncio.run(simulate_async(config, bound))


def compare(config: SimConfig, modes: tuple[str, ...] = MODES) -> dict[str, SimResult]:
    """The same configuration in several modes, measured against one shared bound (the baseline without the
    strategy)."""
    bound = config.occupancy_bound()
    return {mode: simulate(replace(config, mode=mode, strategy=None if mode == "baseline" else config.strategy),
                           bound) for mode in modes}  # type: ignore[arg-type]


def compare_strategies(strategies: tuple[str, ...], modes: tuple[str, ...] = ("baseline", "april-batch"),
                       **settings: object) -> dict[str, SimResult]:
    """The synchronous baseline (when in ``modes``) and every strategy in every APRIL mode of ``modes``, each a
    SimConfig of ``settings`` (no mode, no strategy), against one bound. Entries are labelled "baseline" and by
    the strategy, or "<mode> <strategy>" with several APRIL modes."""
    for name in ("mode", "strategy"):
        if name in settings:
            raise ConfigError(f"compare_strategies: {name} is given by the modes and strategies, not a setting")
    april = [m for m in modes if m != "baseline"]
    if not april:
        raise ConfigError(f"compare_strategies: modes={modes!r} is not allowed: at least one APRIL mode, which the "
                          "strategies run in")
    bound = SimConfig(**settings).occupancy_bound()  # type: ignore[arg-type]
    results = {}
    if "baseline" in modes:
        results["baseline"] = simulate(SimConfig(**settings, mode="baseline"), bound)  # type: ignore[arg-type]
    for mode in april:
        for name in strategies:
            label = name if len(april) == 1 else f"{mode} {name}"
            results[label] = simulate(SimConfig(**settings, mode=mode, strategy=name), bound)  # type: ignore[arg-type]
    return results


def gain(results: dict[str, SimResult], mode: str, baseline: str = "baseline", metric: str = "tokens_per_s") -> float:
    """Relative gain of ``mode`` over ``baseline`` in a summary metric (0.25 = +25%)."""
    base = results[baseline].summary[metric]
    return results[mode].summary[metric] / base - 1 if base > 0 else math.nan


__all__ = ["ALGORITHMS", "APRIL_LOOPS", "DAPO_BASELINES", "MODES", "MODE_SETTINGS", "SimConfig", "SimResult", "compare", "compare_strategies", "gain",
           "simulate", "simulate_async"]
