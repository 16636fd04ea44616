"""Response-length models: how long each simulated response is, and whether it is correct.

A draw is keyed by (prompt key, sample ordinal, policy version) and is deterministic for a seed, so the
simulated engine fixes a sample's target length when it first sees the sample and a resumed request
continues to the same total length. Presets mimic the length profiles reported for math RL datasets;
real traces replay from CSV / JSONL.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from april_ext.errors import ConfigError, InvalidArgumentError


@dataclass(frozen=True)
class SampleDraw:
    """One response's natural length (tokens, before any cap) and whether its answer is correct."""

    length: int
    correct: bool


@runtime_checkable
class LengthModel(Protocol):
    """Draws response lengths; deterministic in (prompt_key, ordinal, version)."""

    def draw(self, prompt_key: int, ordinal: int, version: int) -> SampleDraw: ...

    def natural_lengths(self, version: int, n: int = 20000) -> np.ndarray:
        """Natural lengths (before any cap) of ``n`` fresh samples: the distribution training should see."""
        ...


def _check(owner: str, name: str, value: float, low: float, high: float = math.inf,
           low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or value > high or (low_open and value == low):
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ConfigError(f"{owner}.{name}={value!r} is not allowed: a number in {bound}")


@dataclass(frozen=True)
class LogNormalLengths:
    """Per-prompt log-normal lengths with a correct / incorrect mixture, runaway responses and drift.

    A prompt p has a median length m_p = median_tokens * exp(prompt_sigma * z_p) and an accuracy
    a_p ~ Beta(accuracy_mean * accuracy_concentration, (1 - accuracy_mean) * accuracy_concentration).
    Each of its samples is correct with probability a_p; its length is log-normal around m_p (correct) or
    incorrect_length_factor * m_p (incorrect) with log-sd within_sigma, so the samples of one group are
    similar. An incorrect sample runs away (never stops: a point mass at the cap) with probability
    runaway_prob. Lengths scale by exp(drift_per_version * version): responses grow over training.
    """

    median_tokens: float = 3000.0
    prompt_sigma: float = 0.5
    within_sigma: float = 0.3
    accuracy_mean: float = 0.5
    accuracy_concentration: float = 2.0
    incorrect_length_factor: float = 3.0
    runaway_prob: float = 0.05
    drift_per_version: float = 0.0
    min_tokens: int = 16
    seed: int = 0
    name: str = "lognormal"
    description: str = ""

    def __post_init__(self) -> None:
        owner = "LogNormalLengths"
        _check(owner, "median_tokens", self.median_tokens, 1)
        _check(owner, "prompt_sigma", self.prompt_sigma, 0, 5)
        _check(owner, "within_sigma", self.within_sigma, 0, 5)
        _check(owner, "accuracy_mean", self.accuracy_mean, 0, 1)
        _check(owner, "accuracy_concentration", self.accuracy_concentration, 0, low_open=True)
        _check(owner, "incorrect_length_factor", self.incorrect_length_factor, 0, low_open=True)
        _check(owner, "runaway_prob", self.runaway_prob, 0, 1)
        _check(owner, "drift_per_version", self.drift_per_version, -1, 1)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise ConfigError(f"LogNormalLengths.min_tokens={self.min_tokens!r} is not allowed: an int >= 1")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"LogNormalLengths.seed={self.seed!r} is not allowed: an int >= 0")

    def _prompt(self, prompt_key: int) -> tuple[float, float]:
        rng = np.random.default_rng([self.seed, 1, prompt_key])
        median = self.median_tokens * math.exp(self.prompt_sigma * rng.standard_normal())
        if self.accuracy_mean in (0.0, 1.0):
            return median, self.accuracy_mean
        a = self.accuracy_mean * self.accuracy_concentration
        b = (1 - self.accuracy_mean) * self.accuracy_concentration
        return median, float(rng.beta(a, b))

    def draw(self, prompt_key: int, ordinal: int, version: int) -> SampleDraw:
        return self._draw(self._prompt(prompt_key), prompt_key, ordinal, version)

    def _draw(self, prompt: tuple[float, float], prompt_key: int, ordinal: int, version: int) -> SampleDraw:
        """draw() given the prompt's (median, accuracy), so samples of one prompt share that draw."""
        median, accuracy = prompt
        rng = np.random.default_rng([self.seed, 2, prompt_key, ordinal])
        u_correct, u_runaway, z = rng.random(), rng.random(), rng.standard_normal()
        correct = bool(u_correct < accuracy)
        if not correct and u_runaway < self.runaway_prob:
            return SampleDraw(length=2**31 - 1, correct=False)
        center = median if correct else median * self.incorrect_length_factor
        length = center * math.exp(self.within_sigma * z + self.drift_per_version * version)
        return SampleDraw(length=max(self.min_tokens, int(round(length))), correct=correct)

    def natural_lengths(self, version: int, n: int = 20000) -> np.ndarray:
        return _natural_lengths(self, version, n).copy()


@functools.lru_cache(maxsize=64)
def _natural_lengths(model: LogNormalLengths, version: int, n: int) -> np.ndarray:
    """LogNormalLengths.natural_lengths, drawn once per (model, version, n): every run of a comparison asks."""
    per_prompt = 8
    # Prompt keys far above any data-source index: a population of fresh prompts.
    keys = range(1 << 40, (1 << 40) + max(1, n // per_prompt))
    return np.array([model._draw(prompt, k, i, version).length
                     for k in keys for prompt in (model._prompt(k),) for i in range(per_prompt)], np.int64)


# Calibrated to the length statistics the APRIL paper (arXiv 2509.18521) reports for Qwen3-4B/8B reasoning RL
# with a 16K cap: a batch-level standard deviation of ~4,000-4,500 tokens, a within-group standard deviation
# below 1,500 (GRPO) and 2,400 (DAPO) tokens, more than half of the responses within a few thousand tokens and a
# tail at the cap. Most of the spread is between prompts (prompt_sigma ~1); incorrect responses run 1.4-1.6x
# longer; 1-2% of incorrect ones run away to the cap. docs/sim.md lists the resulting statistics.
LENGTH_PRESETS: dict[str, LogNormalLengths] = {
    "dapo-math-17k": LogNormalLengths(
        median_tokens=2600, prompt_sigma=1.0, within_sigma=0.25, accuracy_mean=0.45, accuracy_concentration=1.5,
        incorrect_length_factor=1.4, runaway_prob=0.01, drift_per_version=0.004, name="dapo-math-17k",
        description="AIME-style competition problems with integer answers; ~45% accuracy, many hard prompts"),
    "deepscaler": LogNormalLengths(
        median_tokens=2200, prompt_sigma=1.05, within_sigma=0.25, accuracy_mean=0.6, accuracy_concentration=2.0,
        incorrect_length_factor=1.4, runaway_prob=0.01, drift_per_version=0.004, name="deepscaler",
        description="AIME/AMC/Omni-MATH/STILL mix; easier (~60% accuracy), shorter responses"),
    "deepmath-103k": LogNormalLengths(
        median_tokens=2400, prompt_sigma=1.05, within_sigma=0.25, accuracy_mean=0.45, accuracy_concentration=1.5,
        incorrect_length_factor=1.5, runaway_prob=0.015, drift_per_version=0.004, name="deepmath-103k",
        description="difficulty 5-9 problems with verifiable answers; hardest, widest spread (~45% accuracy)"),
    # Shaped like the long-CoT workloads of Seer (arXiv 2511.14617), not calibrated to them: generations of tens
    # of thousands of tokens under a 64K cap, 8-16 samples per prompt whose lengths are strongly correlated
    # (docs/sim.md, "Length models", lists what is assumed and the resulting statistics).
    "seer-long-cot": LogNormalLengths(
        median_tokens=14000, prompt_sigma=0.7, within_sigma=0.2, accuracy_mean=0.5, accuracy_concentration=2.0,
        incorrect_length_factor=1.5, runaway_prob=0.02, drift_per_version=0.0, name="seer-long-cot",
        description="long chain-of-thought RL (Seer-shaped): ~20K-token mean under a 64K cap, strong within-group "
                    "length correlation"),
}
PAPER_LENGTH_PRESETS = ("dapo-math-17k", "deepscaler", "deepmath-103k")
"""The presets calibrated to the APRIL paper's datasets (16K cap)."""


def length_preset(name: str, seed: int = 0) -> LogNormalLengths:
    if name not in LENGTH_PRESETS:
        raise ConfigError(f"length preset {name!r} is not known: one of {sorted(LENGTH_PRESETS)}")
    preset = LENGTH_PRESETS[name]
    return LogNormalLengths(**{**preset.__dict__, "seed": seed})


class TraceLengths:
    """Replays recorded lengths: prompt p (prompt_key mod the number of prompts) draws sample ``ordinal`` (mod
    its samples). Lengths do not drift: a trace is one policy's behavior."""

    def __init__(self, lengths: Sequence[Sequence[int]], correct: Sequence[Sequence[bool]] | None = None,
                 name: str = "trace") -> None:
        if not lengths:
            raise InvalidArgumentError("a length trace needs at least one prompt with one sample")
        self.lengths = [[int(x) for x in row] for row in lengths]
        for p, row in enumerate(self.lengths):
            if not row or min(row) < 1:
                raise InvalidArgumentError(
                    f"trace prompt {p}: lengths must be a non-empty list of ints >= 1, got {row}")
        if correct is None:
            self.correct = [[True] * len(row) for row in self.lengths]
        else:
            if len(correct) != len(lengths) or any(len(c) != len(r) for c, r in zip(correct, lengths)):
                raise InvalidArgumentError("trace correctness must have one entry per length")
            self.correct = [[bool(x) for x in row] for row in correct]
        self.name = name

    def draw(self, prompt_key: int, ordinal: int, version: int) -> SampleDraw:
        p = prompt_key % len(self.lengths)
        i = ordinal % len(self.lengths[p])
        return SampleDraw(self.lengths[p][i], self.correct[p][i])

    def natural_lengths(self, version: int, n: int = 20000) -> np.ndarray:
        return np.array([x for row in self.lengths for x in row], np.int64)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> TraceLengths:
        """One row per response: CSV with columns ``prompt_id,length[,correct]`` or JSONL objects with keys
        ``prompt_id``, ``length`` and optionally ``correct``. Prompts keep their order of first appearance."""
        path = os.fspath(path)
        rows: list[tuple[str, object, object, int]] = []
        try:
            if path.endswith((".jsonl", ".json")):
                with open(path, encoding="utf-8") as f:
                    for line_no, line in enumerate(f, 1):
                        if not line.strip():
                            continue
                        try:
                            obj = json.loads(line)
                        except json.JSONDecodeError as exc:
                            raise InvalidArgumentError(f"{path}:{line_no}: not valid JSON ({exc.msg})") from None
                        if not isinstance(obj, dict):
                            raise InvalidArgumentError(f"{path}:{line_no}: a JSON object is required")
                        rows.append((str(obj.get("prompt_id")), obj.get("length"), obj.get("correct", True),
                                     line_no))
            elif path.endswith(".csv"):
                with open(path, encoding="utf-8", newline="") as f:
                    reader = csv.DictReader(f)
                    if reader.fieldnames is None or not {"prompt_id", "length"} <= set(reader.fieldnames):
                        raise InvalidArgumentError(f"{path}: the CSV header needs columns prompt_id and length")
                    for line_no, rec in enumerate(reader, 2):
                        rows.append((rec["prompt_id"], rec["length"], rec.get("correct") or "1", line_no))
            else:
                raise InvalidArgumentError(f"trace path {path!r}: a .csv or .jsonl file is required")
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        groups: OrderedDict[str, tuple[list[int], list[bool]]] = OrderedDict()
        for prompt_id, length, correct, line_no in rows:
            try:
                value = int(length)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                raise InvalidArgumentError(f"{path}:{line_no}: length={length!r} is not an int") from None
            if value < 1:
                raise InvalidArgumentError(f"{path}:{line_no}: length={value} is not allowed: an int >= 1")
            ok = correct if isinstance(correct, bool) else str(correct).strip().lower() in ("1", "true", "yes")
            entry = groups.setdefault(prompt_id, ([], []))
            entry[0].append(value)
            entry[1].append(ok)
        if not groups:
            raise InvalidArgumentError(f"{path}: no length rows")
        return cls([g[0] for g in groups.values()], [g[1] for g in groups.values()],
                   name=os.path.basename(path))


__all__ = ["LENGTH_PRESETS", "PAPER_LENGTH_PRESETS", "LengthModel", "LogNormalLengths", "SampleDraw", "TraceLengths",
           "length_preset"]
