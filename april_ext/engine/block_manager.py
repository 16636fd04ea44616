"""BlockManager: the KV-cache pages as records (free list, reference counts, prefix hashes). No tensors."""

from __future__ import annotations

from collections import OrderedDict

from april_ext.engine.sequence import Sequence
from april_ext.errors import InternalError


class BlockManager:
    """Hands out fixed-size KV blocks to sequences.

    With prefix caching, every full block whose K/V has been computed is registered under a hash of
    its tokens chained with the previous block's hash; a later sequence with the same prefix shares
    those blocks (reference count > 1) instead of recomputing them. A freed block keeps its hash until
    the free list hands it out again, so a preempted or finished sequence's prefix stays reusable.

    The cache is keyed by weight epoch (one per weight update, `reset_prefix_cache`): a sequence
    admitted in an earlier epoch keeps its KV across the update (its later blocks attend to K/V of the
    old weights), so none of its blocks is ever published, and the blocks published before the
    update are forgotten. A new request therefore never reuses K/V computed by older weights.
    """

    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref_counts = [0] * num_blocks
        # Insertion order = release order, so the least recently freed block is reused first.
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_key: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._cached: dict[tuple[int, tuple[int, ...]], int] = {}
        self.epoch = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _keys(self, token_ids: list[int], num_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        keys, parent = [], 0
        for i in range(num_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            keys.append((parent, tokens))
            parent = hash((parent, tokens))
        return keys

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of `seq` (never its last token, whose logits are needed)."""
        if not self.prefix_caching:
            return []
        blocks = []
        for key in self._keys(seq.token_ids, (len(seq) - 1) // self.block_size):
            block = self._cached.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def can_admit(self, seq: Sequence, prefix: list[int], num_tokens: int) -> bool:
        """Whether `seq` can take the cached `prefix` blocks plus room for `num_tokens` more tokens."""
        reclaimed = sum(1 for b in prefix if self.ref_counts[b] == 0)
        new = self.blocks_for(len(prefix) * self.block_size + num_tokens) - len(prefix)
        return reclaimed + new <= self.num_free

    def admit(self, seq: Sequence, prefix: list[int], num_tokens: int) -> None:
        if seq.block_table:
            raise InternalError(f"sequence {seq.request_id!r} is admitted while it still holds blocks")
        for block in prefix:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        seq.block_table = list(prefix)
        seq.kv_epoch = self.epoch
        seq.num_computed = len(prefix) * self.block_size
        keys = self._keys(seq.token_ids, len(prefix))
        seq.hashed_blocks = len(prefix)
        seq.prefix_hash = hash(keys[-1]) if keys else 0
        self.allocate(seq, num_tokens)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks for room for `num_tokens` tokens beyond the computed ones."""
        return self.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self._blocks_needed(seq, num_tokens) <= self.num_free

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = self._blocks_needed(seq, num_tokens)
        if needed > self.num_free:
            raise InternalError(f"allocate of {needed} blocks with {self.num_free} free (check can_allocate)")
        for _ in range(needed):
            block, _ = self._free.popitem(last=False)
            key = self._block_key.pop(block, None)
            if key is not None:
                del self._cached[key]
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drops the sequence's references; its blocks return to the free list when unshared."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
        seq.block_table = []
        seq.num_computed = 0
        seq.hashed_blocks = 0
        seq.prefix_hash = 0

    def register_computed(self, seq: Sequence) -> None:
        """Publishes the sequence's full, computed blocks for prefix sharing (only KV computed entirely
        under the current weights)."""
        if not self.prefix_caching or seq.kv_epoch != self.epoch or not seq.publish_prefix:
            return
        size = self.block_size
        # Incremental: each block is hashed once, chained to the previous block's hash.
        while seq.hashed_blocks < seq.num_computed // size:
            i = seq.hashed_blocks
            key = (seq.prefix_hash, tuple(seq.token_ids[i * size:(i + 1) * size]))
            block = seq.block_table[i]
            if block not in self._block_key and key not in self._cached:
                self._cached[key] = block
                self._block_key[block] = key
            seq.prefix_hash = hash(key)
            seq.hashed_blocks += 1

    def reset_prefix_cache(self) -> None:
        """Forgets every hash and starts a new weight epoch (after a weight update the cached K/V are
        stale, and so is every block that running sequences compute over their older K/V)."""
        self._cached.clear()
        self._block_key.clear()
        self.epoch += 1
