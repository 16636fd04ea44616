"""TrainingBatch: the packed output of one rollout step (N groups x n samples), as the trainer reads it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np


class FinishReason(enum.IntEnum):
    """Why a sample stopped generating. ABORT never reaches a batch: aborted samples are resumed."""

    STOP = 0
    LENGTH = 1
    ABORT = 2


@dataclass
class TrainingBatch:
    """Flat arrays with offsets. Sample ``i`` owns ``tokens[offsets[i]:offsets[i + 1]]`` = prompt + response.

    Per-token arrays (length T) hold, on prompt positions: ``loss_mask`` 0, ``behavior_logprobs`` 0.0,
    ``versions`` -1. On response positions ``behavior_logprobs[t]`` is the log-probability of token t
    under the distribution it was sampled from, and ``versions[t]`` the policy version that produced it.
    Tokens an environment inserted into a multi-turn response (tool output) have the prompt's values: they
    are part of the sequence but never trained.
    Samples of one group are contiguous; ``group_index`` numbers groups 0..n_groups-1 in batch order.
    """

    tokens: np.ndarray  # int32 [T]
    offsets: np.ndarray  # int64 [S + 1]
    prompt_lens: np.ndarray  # int32 [S]
    loss_mask: np.ndarray  # uint8 [T]
    behavior_logprobs: np.ndarray  # float32 [T]
    versions: np.ndarray  # int32 [T]
    rewards: np.ndarray  # float32 [S]
    group_index: np.ndarray  # int32 [S]
    sample_ids: np.ndarray  # int64 [S]
    finish_reasons: np.ndarray  # uint8 [S], FinishReason values
    policy_version: int  # the version the trainer is about to update
    prompt_ids: list[Any] = field(default_factory=list)  # [G] data-source id of each group's prompt
    metadata: list[dict[str, Any]] = field(default_factory=list)  # [G] data-source metadata per group

    @property
    def n_samples(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def n_groups(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def sequence_lens(self) -> np.ndarray:
        return np.diff(self.offsets)

    @property
    def response_lens(self) -> np.ndarray:
        return self.sequence_lens - self.prompt_lens

    def to_torch(self) -> dict[str, Any]:
        """The arrays as torch tensors sharing this batch's memory (no copies)."""
        import torch

        names = ("tokens", "offsets", "prompt_lens", "loss_mask", "behavior_logprobs", "versions",
                 "rewards", "group_index", "sample_ids", "finish_reasons")
        return {name: torch.from_numpy(getattr(self, name)) for name in names}


def version_lags(batch: TrainingBatch) -> dict[str, Any]:
    """The lag of the trained model tokens behind the version they are trained at (batch.policy_version): mean,
    max and a histogram (lag -> tokens); and multi_version_frac, the share of samples whose model tokens came
    from more than one version (slime's name)."""
    trained = batch.loss_mask.astype(bool)
    lags = batch.policy_version - batch.versions[trained].astype(np.int64)
    spans = 0
    for i in range(batch.n_samples):
        # Every model token, trained or masked (the prompt's and the environment's have no version).
        versions = batch.versions[int(batch.offsets[i]) + int(batch.prompt_lens[i]):int(batch.offsets[i + 1])]
        versions = versions[versions >= 0]
        spans += bool(versions.size) and int(versions.min()) != int(versions.max())
    values, counts = np.unique(lags, return_counts=True)
    return {"version_lag_mean": float(lags.mean()) if lags.size else 0.0,
            "version_lag_max": int(lags.max()) if lags.size else 0,
            "version_lag_histogram": {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)},
            "multi_version_frac": spans / batch.n_samples if batch.n_samples else 0.0}
