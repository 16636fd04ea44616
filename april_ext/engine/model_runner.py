"""ModelRunner: the one place where scheduled sequences become tensors, a forward pass and samples."""

from __future__ import annotations

from collections.abc import Callable

import torch

from april_ext.engine.batch_scheduler import ScheduledChunk
from april_ext.engine.paged_attention import PagedAttention, StepMetadata, check_step
from april_ext.engine.sampler import sample
from april_ext.engine.sequence import Sequence
from april_ext.model import LlamaForCausalLM

# allocate(shape, dtype, tag) -> tensor on the engine's device, inside the allocator region `tag`.
Allocate = Callable[[tuple[int, ...], torch.dtype, str], torch.Tensor]


class ModelRunner:
    """Holds the model and its paged KV cache ([num_blocks, block_size, Hkv, D] per layer for K and V)."""

    def __init__(self, model: LlamaForCausalLM, *, num_blocks: int, block_size: int, use_triton: bool,
                 allocate: Allocate) -> None:
        config = model.config
        assert config.num_key_value_heads is not None and config.head_dim is not None
        self.model = model
        self.device = model.lm_head.weight.device
        self.use_triton = use_triton
        self.block_size = block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        dtype = model.lm_head.weight.dtype
        self.k_caches = [allocate(shape, dtype, "kv_cache") for _ in range(config.num_hidden_layers)]
        self.v_caches = [allocate(shape, dtype, "kv_cache") for _ in range(config.num_hidden_layers)]

    @property
    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_caches + self.v_caches)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> list[tuple[Sequence, int, float]]:
        """One forward over every chunk; returns (sequence, token, logprob) for the chunks that sample."""
        # Decode-like chunks (one new token) first: they take the decode kernel, the rest the extend one.
        ordered = sorted(chunks, key=lambda c: c.num_tokens != 1)
        num_decode = sum(1 for c in ordered if c.num_tokens == 1)
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefix_lens: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        sampling: list[Sequence] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for chunk in ordered:
            seq, start = chunk.seq, chunk.seq.num_computed
            end = start + chunk.num_tokens
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            prefix_lens.append(start)
            seq_lens.append(end)
            tables.append(seq.block_table)
            if chunk.samples:
                last_rows.append(len(ids) - 1)
                sampling.append(seq)
        # Once per step on the host lists, so that the kernels can skip their per-layer checks (and syncs).
        check_step(tables, prefix_lens, seq_lens, num_blocks=self.k_caches[0].shape[0], block_size=bs)
        for table, start, end in zip(tables, prefix_lens, seq_lens):
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        max_pages = -(-max(seq_lens) // bs)
        table_rows = [t[:max_pages] + [0] * (max_pages - len(t[:max_pages])) for t in tables]
        new = [c.num_tokens for c in ordered[num_decode:]]
        indptr = [0]
        for n in new:
            indptr.append(indptr[-1] + n)

        def tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        meta = StepMetadata(
            num_decode=num_decode, slot_mapping=tensor(slots),
            block_table=tensor(table_rows, torch.int32), prefix_lens=tensor(prefix_lens, torch.int32),
            seq_lens=tensor(seq_lens, torch.int32), qo_indptr=tensor(indptr, torch.int32),
            max_new=max(new, default=1))
        attention = PagedAttention(self.k_caches, self.v_caches, meta, use_triton=self.use_triton)
        hidden = self.model.hidden_states(tensor(ids), tensor(positions), attention)
        if not sampling:
            return []
        logits = self.model.compute_logits(hidden[tensor(last_rows)])
        tokens, logprobs = sample(logits, [s.params for s in sampling], [s.seed for s in sampling],
                                  [len(s) for s in sampling])
        return list(zip(sampling, tokens, logprobs))
