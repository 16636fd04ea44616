"""Sequence: one request's state inside the engine (token ids, KV progress, block table). No tensors."""

from __future__ import annotations

import enum

from april_ext.batch import FinishReason
from april_ext.protocol.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Prompt plus generated tokens. `num_computed` tokens have their K/V in the cache blocks of
    `block_table`; the rest (a prompt chunk, or the last sampled token) still need a forward pass."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams, seed: int,
                 stop_ids: frozenset[int]) -> None:
        self.request_id = request_id
        self.token_ids = list(prompt_ids)
        self.prompt_len = len(prompt_ids)
        self.params = params
        self.seed = seed
        self.stop_ids = stop_ids
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.status = SequenceStatus.WAITING
        self.num_computed = 0
        self.block_table: list[int] = []
        # Prefix-cache progress (owned by the BlockManager): full blocks hashed and the chain's last hash.
        self.hashed_blocks = 0
        self.prefix_hash = 0
        # The BlockManager's weight epoch when this sequence's KV started; older KV is never shared.
        self.kv_epoch = 0
        # False: this sequence's blocks are never published to the prefix cache (EngineCore.add_request).
        self.publish_prefix = True
        self.finish_reason: FinishReason | None = None
        self.matched_stop: int | None = None
        self.num_preemptions = 0
        # Output tokens already handed to the caller in chunks (the streaming cursor).
        self.num_reported = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def append(self, token: int, logprob: float, version: int) -> None:
        """Adds a sampled token and finishes the sequence if it is a stop token or the length cap."""
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if token in self.stop_ids:
            self.finish(FinishReason.STOP)
            self.matched_stop = token
        elif self.num_output >= self.params.max_new_tokens:
            self.finish(FinishReason.LENGTH)

    def finish(self, reason: FinishReason) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
