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


class _DenseKV:
    """An attention backend for one sequence that keeps every layer's K/V, so that tokens run by one model
    can be attended to by the next tokens run by another (a KV cache carried across a weight update)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        from april_ext.model.attention import expand_kv_heads

        past = self.k[layer].shape[0] if layer in self.k else 0
        self.k[layer] = k if layer not in self.k else torch.cat([self.k[layer], k])
        self.v[layer] = v if layer not in self.v else torch.cat([self.v[layer], v])
        groups = q.shape[1] // k.shape[1]
        keys, values = expand_kv_heads(self.k[layer], groups), expand_kv_heads(self.v[layer], groups)
        n, total = q.shape[0], past + q.shape[0]
        allowed = torch.arange(total)[None, :] <= (past + torch.arange(n))[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=allowed, scale=scale)
        return out.transpose(0, 1)


def greedy_with_carried_kv(old: LlamaForCausalLM, new: LlamaForCausalLM, ids: list[int], num_old: int,
                           n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation of `ids` whose first `num_old` tokens have K/V computed by `old`; every later
    token runs through `new` over that cache (the ground truth of a weight update that keeps the KV)."""
    cache = _DenseKV()
    tokens, logprobs = list(ids), []
    with torch.no_grad():
        old.hidden_states(torch.tensor(ids[:num_old]), torch.arange(num_old), cache)
        pending = ids[num_old:]
        for _ in range(n):
            start = len(tokens) - len(pending)
            hidden = new.hidden_states(torch.tensor(pending), torch.arange(start, len(tokens)), cache)
            logp = torch.log_softmax(new.compute_logits(hidden[-1:]).float(), dim=-1)[0]
            token = int(logp.argmax())
            tokens.append(token)
            logprobs.append(float(logp[token]))
            pending = [token]
    return tokens[len(ids):], logprobs
