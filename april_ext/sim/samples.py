"""SampleBook: the samples a SimulatedEngine has seen, known by the ids a request carries.

A sample's length is drawn once, from the length model keyed by (prompt, sample ordinal, weight version), when
the engine first sees its prompt. A request whose ids are a known sample's prompt + response so far (exactly as
aborted, or as it ended at its token budget) continues that sample to the same target; the book matches them by
a hash of the ids. It also remembers when each request finished, keyed by its full ids, for the tail latency.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april_ext.sim.lengths import LengthModel
from april_ext.sim.replica import SimSample
from april_ext.sim.tokens import as_ids, prompt_key
from april_ext.sim.turns import TurnModel


@dataclass(frozen=True)
class OpenedSample:
    """The sample a request's ids continue (or start)."""

    sample: SimSample
    hasher: Any  # blake2b over the request's input ids (SimRequest.hasher)
    is_resume: bool  # the ids hold part of the sample's response
    prefix_key: bytes | None  # a continuation under the weights it ended at: its prefix-cache key


class SampleBook:
    def __init__(self, lengths: LengthModel) -> None:
        self.lengths = lengths
        self._resumable: dict[bytes, deque[SimSample]] = {}
        # Resumable ids that ended at their budget -> the weight versions they ended under.
        self._budget_ends: dict[bytes, deque[int]] = {}
        self._finish_times: dict[bytes, float] = {}  # digest of prompt + response -> virtual time of its finish
        self._ordinals: defaultdict[int, int] = defaultdict(int)
        self._uids = itertools.count()

    def open(self, ids: np.ndarray, weight_version: int) -> OpenedSample:
        """The known sample these ids continue (taken out of the book), or a new sample of their prompt."""
        hasher = hashlib.blake2b(ids.tobytes(), digest_size=16)
        digest = hasher.digest()
        known = self._resumable.get(digest)
        prefix_key = None
        if known:
            sample = known.popleft()
            if not known:
                del self._resumable[digest]
            is_resume = ids.size > sample.prompt_len
            ended = self._budget_ends.get(digest)
            if ended:
                version = ended.popleft()
                if not ended:
                    del self._budget_ends[digest]
                self._finish_times.pop(digest, None)  # a chunk boundary, not the sample's finish
                # Under other weights its prefix is no cache hit: a resume like an aborted partial's.
                prefix_key = digest if version == weight_version else None
        else:
            key = prompt_key(ids)
            ordinal = self._ordinals[key]
            self._ordinals[key] += 1
            if isinstance(self.lengths, TurnModel):
                plan = self.lengths.plan(key, ordinal, weight_version)
                sample = SimSample(uid=next(self._uids), prompt_len=int(ids.size), target=plan.model_tokens,
                                   correct=plan.correct, plan=plan)
            else:
                draw = self.lengths.draw(key, ordinal, weight_version)
                sample = SimSample(uid=next(self._uids), prompt_len=int(ids.size), target=int(draw.length),
                                   correct=bool(draw.correct))
            is_resume = False
        return OpenedSample(sample, hasher, is_resume, prefix_key)

    def aborted(self, digest: bytes, sample: SimSample) -> None:
        """A request of ``sample`` was aborted; ``digest``: of its prompt + response so far."""
        self._resumable.setdefault(digest, deque()).append(sample)

    def finished(self, digest: bytes, sample: SimSample, now: float, budget_version: int | None) -> None:
        """A request of ``sample`` finished at ``now``; ``budget_version``: the weight version it ended under at
        its token budget (the sample may go on from here: a chunk boundary), None for its natural end."""
        self._finish_times[digest] = now
        if budget_version is not None:
            self._resumable.setdefault(digest, deque()).append(sample)
            self._budget_ends.setdefault(digest, deque()).append(budget_version)

    def finish_time(self, ids: Sequence[int] | np.ndarray) -> float:
        """See SimulatedEngine.finish_time."""
        return self._finish_times.pop(_digest(as_ids(ids)), math.nan)


def _digest(ids: np.ndarray) -> bytes:
    """The key of a request's ids (as its hasher computes it)."""
    return hashlib.blake2b(ids.tobytes(), digest_size=16).digest()


__all__ = ["OpenedSample", "SampleBook"]
