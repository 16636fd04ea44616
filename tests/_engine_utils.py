"""Tiny models and reference generation shared by the engine tests."""

from __future__ import annotations

import torch

from april_ext.engine import EngineConfig, EngineCore
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.protocol import SamplingParams

TINY = ModelConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                   rope_theta=1000.0, eos_token_id=None)


def tiny_model(seed: int = 0, config: ModelConfig = TINY) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config)
    model.init_weights(seed)
    # Larger-than-default weights make the next-token distribution peaked enough that greedy
    # decisions are not near-ties (so float noise of batching cannot flip them).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.mul_(6.0)
    return model


def engine(model: LlamaForCausalLM | None = None, **overrides: object) -> EngineCore:
    settings: dict[str, object] = dict(block_size=4, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=64)
    settings.update(overrides)
    return EngineCore(model if model is not None else tiny_model(), EngineConfig(**settings))  # type: ignore[arg-type]


def greedy_reference(model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full-sequence forwards (no cache, no batching): the ground truth."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor(ids)[None])[0, -1].argmax()))
    return ids[len(prompt):]


def prompts(count: int, seed: int, low: int = 1, high: int = 30) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (count,), generator=gen).tolist()
    return [torch.randint(0, TINY.vocab_size, (n,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
