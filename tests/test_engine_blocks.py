"""BlockManager and BatchScheduler: the engine's bookkeeping, without any model."""

from __future__ import annotations

import random

import pytest

from april_ext.engine.batch_scheduler import BatchScheduler
from april_ext.engine.block_manager import BlockManager
from april_ext.engine.sequence import Sequence, SequenceStatus
from april_ext.protocol.sampling_params import SamplingParams


def seq(tokens: list[int], name: str = "s") -> Sequence:
    return Sequence(name, tokens, SamplingParams(), seed=0, stop_ids=frozenset())


def test_allocate_and_free_track_reference_counts() -> None:
    bm = BlockManager(8, 4, prefix_caching=False)
    a = seq(list(range(10)))
    assert bm.can_allocate(a, 10)
    bm.allocate(a, 10)
    assert len(a.block_table) == 3 and bm.num_free == 5
    assert all(bm.ref_counts[b] == 1 for b in a.block_table)
    a.num_computed = 10
    bm.allocate(a, 2)  # 12 tokens still fit in 3 blocks
    assert len(a.block_table) == 3
    bm.allocate(a, 3)
    assert len(a.block_table) == 4
    assert bm.can_allocate(a, 4 * 4 + 6) and not bm.can_allocate(a, 4 * 4 + 7)
    bm.free(a)
    assert bm.num_free == 8 and a.block_table == [] and a.num_computed == 0
    assert bm.ref_counts == [0] * 8


def test_prefix_blocks_are_shared_and_survive_until_reused() -> None:
    bm = BlockManager(6, 4)
    a = seq(list(range(10)), "a")
    bm.admit(a, bm.match_prefix(a), 10)
    a.num_computed = 10
    bm.register_computed(a)
    b = seq(list(range(8)) + [99, 98, 97], "b")
    prefix = bm.match_prefix(b)
    assert prefix == a.block_table[:2]
    assert bm.can_admit(b, prefix, 3)
    bm.admit(b, prefix, 3)
    assert b.num_computed == 8
    assert [bm.ref_counts[x] for x in prefix] == [2, 2]
    bm.free(a)
    assert [bm.ref_counts[x] for x in prefix] == [1, 1]
    bm.free(b)
    # Freed but still hashed: a third sequence with the prefix finds the blocks in the free list.
    c = seq(list(range(9)), "c")
    assert bm.match_prefix(c) == prefix
    # The match never covers the last token, whose logits must be computed.
    assert bm.match_prefix(seq(list(range(8)))) == prefix[:1]
    bm.reset_prefix_cache()
    assert bm.match_prefix(c) == []


def test_reusing_a_freed_block_drops_its_hash() -> None:
    bm = BlockManager(2, 4)
    a = seq([1, 2, 3, 4, 5], "a")
    bm.admit(a, [], 5)
    a.num_computed = 5
    bm.register_computed(a)
    bm.free(a)
    b = seq([7] * 8, "b")
    bm.admit(b, bm.match_prefix(b), 8)  # takes both blocks, overwriting a's cached prefix
    assert bm.match_prefix(seq([1, 2, 3, 4, 5])) == []


def test_scheduler_chunks_prefill_within_the_token_budget() -> None:
    bm = BlockManager(64, 4)
    sched = BatchScheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(list(range(25)), "a"), seq(list(range(30, 33)), "b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.samples) for c in first] == [("a", 10, False)]
    a.num_computed += 10
    second = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in second] == [("a", 10)]
    a.num_computed += 10
    third = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens, c.samples) for c in third] == [("a", 5, True), ("b", 3, True)]


def test_scheduler_caps_running_sequences() -> None:
    sched = BatchScheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        sched.add(seq([i], f"s{i}"))
    assert len(sched.schedule()) == 2
    assert len(sched.running) == 2 and len(sched.waiting) == 1


def test_scheduler_preempts_from_the_tail_when_blocks_run_out() -> None:
    bm = BlockManager(4, 2, prefix_caching=False)
    sched = BatchScheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    a, b = seq([1, 2], "a"), seq([3, 4], "b")
    sched.add(a)
    sched.add(b)
    sched.schedule()

    def decode_step() -> list[str]:
        for s in sched.running:
            s.num_computed = len(s)
            s.token_ids.append(5)
        return [c.seq.request_id for c in sched.schedule()]

    assert decode_step() == ["a", "b"]  # 3 tokens each: both take their second block
    assert bm.num_free == 0
    assert decode_step() == ["a", "b"]  # 4 tokens each still fit in two blocks
    assert decode_step() == ["a"]  # a needs a third block: b, the tail, is preempted
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and b.num_computed == 0
    assert sched.waiting[0] is b and sched.num_preemptions == 1 and b.num_preemptions == 1
    assert len(b) == 5  # its tokens are kept for recomputation


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_remove_and_preempt_all_release_every_block(prefix_caching: bool) -> None:
    bm = BlockManager(16, 4, prefix_caching=prefix_caching)
    sched = BatchScheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    seqs = [seq(list(range(i, i + 9)), f"s{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    sched.schedule()
    sched.remove(seqs[1])
    sched.preempt_all()
    assert [s.request_id for s in sched.waiting] == ["s0", "s2"]
    assert bm.num_free == 16 and sched.running == []


@pytest.mark.parametrize("seed", range(5))
def test_random_traffic_keeps_block_accounting_consistent(seed: int) -> None:
    """Random joins, steps, finishes and removals under a small KV pool, with shared prompts."""
    rng = random.Random(seed)
    bm = BlockManager(24, 4)
    sched = BatchScheduler(bm, max_num_seqs=5, max_num_batched_tokens=12)
    shared = [rng.randrange(50) for _ in range(9)]
    live: list[Sequence] = []
    for step in range(300):
        if rng.random() < 0.3 and len(live) < 12:
            prompt = shared + [rng.randrange(50) for _ in range(rng.randrange(1, 8))] if rng.random() < 0.5 \
                else [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            s = seq(prompt, f"s{step}")
            sched.add(s)
            live.append(s)
        for chunk in sched.schedule():
            s = chunk.seq
            assert len(s.block_table) * 4 >= s.num_computed + chunk.num_tokens
            s.num_computed += chunk.num_tokens
            bm.register_computed(s)
            if chunk.samples:
                s.token_ids.append(rng.randrange(50))
                if len(s) > 40 or rng.random() < 0.05:
                    sched.remove(s)
                    live.remove(s)
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            sched.remove(victim)
            live.remove(victim)
        held = [b for s in sched.running for b in s.block_table]
        assert all(not s.block_table for s in sched.waiting)
        assert sum(bm.ref_counts) == len(held)
        assert bm.num_free == sum(1 for r in bm.ref_counts if r == 0)
        assert set(sched.running) | set(sched.waiting) == set(live)
    assert sched.num_preemptions > 0
