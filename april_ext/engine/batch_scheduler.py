"""BatchScheduler: which sequences run in the next model step, and how many tokens each (continuous
batching with chunked prefill and preempt-and-recompute). No tensors."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from april_ext.engine.block_manager import BlockManager
from april_ext.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its first uncomputed token, run in this step."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so its last logits yield a new token."""
        return self.seq.num_computed + self.num_tokens == len(self.seq)


class BatchScheduler:
    """Waiting and running queues under a token budget per step and a cap on running sequences.

    Each step first serves the running sequences in arrival order (one token for a decoding sequence,
    the next chunk for one still prefilling); when the KV blocks run out it preempts from the tail of
    the running queue: the victim frees its blocks, keeps its tokens and returns to the front of the
    waiting queue to be recomputed later. Remaining budget admits waiting sequences in order (by priority,
    see ``add``).
    """

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        """Queues `seq` behind the waiting sequences of its priority or higher (SamplingParams.priority; None
        after every number), so that equal priorities keep their arrival order."""
        seq.status = SequenceStatus.WAITING
        priority = seq.params.priority
        if priority is not None:
            for i, other in enumerate(self.waiting):
                if other.params.priority is None or other.params.priority < priority:
                    self.waiting.insert(i, seq)
                    return
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.can_allocate(seq, n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.blocks.allocate(seq, n)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.blocks.match_prefix(seq)
            n = min(len(seq) - len(prefix) * self.blocks.block_size, budget)
            if not self.blocks.can_admit(seq, prefix, n):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, prefix, n)
            self.prefix_hit_tokens += len(prefix) * self.blocks.block_size
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def preempt(self, seq: Sequence) -> None:
        """Frees `seq`'s blocks and requeues it first; its tokens stay and are recomputed on readmission."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_all(self) -> None:
        """Moves every running sequence back to waiting, keeping their order ahead of the queue."""
        for seq in reversed(list(self.running)):
            self.preempt(seq)

    def remove(self, seq: Sequence) -> None:
        """Takes `seq` out of whichever queue holds it and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)
