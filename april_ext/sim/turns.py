"""Agentic turn models: how many turns a tool-using trajectory takes, how long each model turn is, how long each
tool call runs and how many observation (env) tokens it inserts.

A trajectory is model turn 1, tool call 1, model turn 2, ..., model turn T: T model turns and T - 1 tool calls.
Its draws are keyed by (prompt key, sample ordinal, policy version) and deterministic for a seed, as response
lengths are (lengths.py), so the simulated engine fixes a trajectory's plan when it first sees the sample and a
resumed request continues the same plan. A TurnModel is also a LengthModel: a sample's length is its model tokens
(what the policy generates and the trainer trains), so everything that reads lengths (the steady-state rate, the
natural length distribution, the length bias) sees the model tokens only.

Presets (TURN_PRESETS) are shaped after published figures where there are any; docs/sim.md ("Agentic rollouts")
names the source of each figure and which ones are assumptions.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from april_ext.errors import ConfigError
from april_ext.sim.lengths import SampleDraw, _check
from april_ext.tasks.lookup import LognormalLatency


@dataclass(frozen=True)
class TrajectoryPlan:
    """One trajectory's turns: model tokens per turn, and per tool call its latency and observation tokens."""

    turn_tokens: tuple[int, ...]
    tool_latency_s: tuple[float, ...]  # len(turn_tokens) - 1 tool calls
    observation_tokens: tuple[int, ...]
    correct: bool

    @property
    def turns(self) -> int:
        return len(self.turn_tokens)

    @property
    def model_tokens(self) -> int:
        return sum(self.turn_tokens)

    def tool_call_at(self, call: int) -> int:
        """Model tokens generated when tool call ``call`` (0-based) is issued: the end of model turn ``call``."""
        return sum(self.turn_tokens[:call + 1])


@dataclass(frozen=True)
class TurnModel:
    """Lognormal turn counts, model-turn lengths, tool latencies and observation sizes.

    Turns: round(median_turns * exp(turn_sigma * z)) clipped to [1, max_turns]. A model turn: turn_tokens_median *
    exp(turn_tokens_sigma * z) tokens, at least min_turn_tokens. A tool call: latency LognormalLatency(tool_median_s,
    tool_p99_s) (sigma = ln(p99 / median) / z_0.99), then observation_median * exp(observation_sigma * z) env tokens,
    at most max_observation_tokens (agents truncate tool output). A prompt's accuracy is Beta(accuracy_mean * c,
    (1 - accuracy_mean) * c) with c = accuracy_concentration; each trajectory is correct with that probability.
    Independent standard normals z per draw.
    """

    median_turns: float
    turn_sigma: float
    max_turns: int
    turn_tokens_median: float
    turn_tokens_sigma: float
    tool_median_s: float
    tool_p99_s: float
    observation_median: float
    observation_sigma: float
    max_observation_tokens: int
    accuracy_mean: float = 0.5
    accuracy_concentration: float = 2.0
    min_turn_tokens: int = 8
    seed: int = 0
    name: str = "turns"
    description: str = ""

    def __post_init__(self) -> None:
        owner = "TurnModel"
        _check(owner, "median_turns", self.median_turns, 1)
        _check(owner, "turn_sigma", self.turn_sigma, 0, 5)
        _check(owner, "turn_tokens_median", self.turn_tokens_median, 1)
        _check(owner, "turn_tokens_sigma", self.turn_tokens_sigma, 0, 5)
        _check(owner, "observation_median", self.observation_median, 0)
        _check(owner, "observation_sigma", self.observation_sigma, 0, 5)
        _check(owner, "accuracy_mean", self.accuracy_mean, 0, 1)
        _check(owner, "accuracy_concentration", self.accuracy_concentration, 0, low_open=True)
        for name, low in (("max_turns", 1), ("max_observation_tokens", 0), ("min_turn_tokens", 1), ("seed", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"TurnModel.{name}={value!r} is not allowed: an int >= {low}")
        if self.max_turns < self.median_turns:
            raise ConfigError(f"TurnModel.max_turns={self.max_turns} is not allowed: an int >= median_turns "
                              f"({self.median_turns})")
        LognormalLatency(self.tool_median_s, self.tool_p99_s)  # raises ConfigError naming a bad latency

    @property
    def latency(self) -> LognormalLatency:
        return LognormalLatency(self.tool_median_s, self.tool_p99_s)

    def _accuracy(self, prompt_key: int) -> float:
        if self.accuracy_mean in (0.0, 1.0):
            return self.accuracy_mean
        rng = np.random.default_rng([self.seed, 11, prompt_key])
        c = self.accuracy_concentration
        return float(rng.beta(self.accuracy_mean * c, (1 - self.accuracy_mean) * c))

    def plan(self, prompt_key: int, ordinal: int, version: int) -> TrajectoryPlan:
        """The trajectory of sample ``ordinal`` of prompt ``prompt_key`` (the version does not change it: no drift)."""
        return _plan(self, prompt_key, ordinal)

    def draw(self, prompt_key: int, ordinal: int, version: int) -> SampleDraw:
        plan = self.plan(prompt_key, ordinal, version)
        return SampleDraw(length=plan.model_tokens, correct=plan.correct)

    def natural_lengths(self, version: int, n: int = 20000) -> np.ndarray:
        return _natural_lengths(self, n).copy()


@functools.lru_cache(maxsize=1 << 16)
def _plan(model: TurnModel, prompt_key: int, ordinal: int) -> TrajectoryPlan:
    rng = np.random.default_rng([model.seed, 12, prompt_key, ordinal])
    turns = int(min(model.max_turns, max(1, round(model.median_turns * math.exp(model.turn_sigma
                                                                                  * rng.standard_normal())))))
    lengths = model.turn_tokens_median * np.exp(model.turn_tokens_sigma * rng.standard_normal(turns))
    latency = model.latency.sample(rng, turns - 1)
    observations = model.observation_median * np.exp(model.observation_sigma * rng.standard_normal(turns - 1))
    correct = bool(rng.random() < model._accuracy(prompt_key))
    return TrajectoryPlan(
        turn_tokens=tuple(max(model.min_turn_tokens, int(round(x))) for x in lengths),
        tool_latency_s=tuple(float(x) for x in latency),
        observation_tokens=tuple(min(model.max_observation_tokens, int(round(x))) for x in observations),
        correct=correct)


@functools.lru_cache(maxsize=16)
def _natural_lengths(model: TurnModel, n: int) -> np.ndarray:
    """Model tokens of fresh trajectories, drawn once per (model, n): every run of a comparison asks."""
    keys = range(1 << 40, (1 << 40) + max(1, n // 8))  # fresh prompts, apart from data-source indices
    return np.array([_plan(model, k, i).model_tokens for k in keys for i in range(8)], np.int64)


# Sources and assumptions: docs/sim.md, "Agentic rollouts". In short: search-agent takes Search-R1's turn budget
# (arXiv 2503.09516: at most 4 turns, i.e. up to 3 searches, top-3 passages per search) and the search counts that
# a re-run of its GRPO training reports (~1-2 searches); swe-agent takes "dozens of steps" with long contexts
# (Nebius, arXiv 2508.03501) and a 50-turn cap. Every latency, token count and accuracy here is an assumption.
TURN_PRESETS: dict[str, TurnModel] = {
    "search-agent": TurnModel(
        median_turns=2.5, turn_sigma=0.35, max_turns=4, turn_tokens_median=250, turn_tokens_sigma=0.6,
        tool_median_s=0.3, tool_p99_s=1.5, observation_median=450, observation_sigma=0.2,
        max_observation_tokens=1024, accuracy_mean=0.45, accuracy_concentration=1.5, name="search-agent",
        description="Search-R1-style QA agent: 1-4 turns (up to 3 searches), retrieval of ~hundreds of ms, "
                    "top-3 passages (~450 tokens) per search"),
    "swe-agent": TurnModel(
        median_turns=20, turn_sigma=0.6, max_turns=50, turn_tokens_median=300, turn_tokens_sigma=0.7,
        tool_median_s=2.0, tool_p99_s=30.0, observation_median=500, observation_sigma=1.0,
        max_observation_tokens=4096, accuracy_mean=0.3, accuracy_concentration=1.5, name="swe-agent",
        description="SWE-style coding agent: tens of turns (cap 50), sandboxed commands of seconds with a long tail "
                    "(p99 30 s), tool output up to 4K tokens"),
}


def turn_preset(name: str, seed: int = 0) -> TurnModel:
    if name not in TURN_PRESETS:
        raise ConfigError(f"agentic preset {name!r} is not known: one of {sorted(TURN_PRESETS)}")
    return replace(TURN_PRESETS[name], seed=seed)


__all__ = ["TURN_PRESETS", "TrajectoryPlan", "TurnModel", "turn_preset"]
