"""Qwen3 (per-head q/k RMSNorm) and Qwen3-MoE (top-k routed experts) in the embedded model against
transformers' own implementations: logits and per-token log-probs of a full forward, checkpoints written
by transformers, and greedy generation through the engine's paged KV cache."""

from __future__ import annotations

import json

import pytest
import torch
from _torch_threads import one_torch_thread

from april_ext.engine import EngineConfig, EngineCore
from april_ext.errors import ConfigError
from april_ext.model import (
    LlamaForCausalLM,
    ModelConfig,
    load_pretrained,
    save_pretrained,
)
from april_ext.model.mlp import SparseMoeBlock, route
from april_ext.protocol import SamplingParams

transformers = pytest.importorskip("transformers")

BASE = {"vocab_size": 89, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 1000.0}
MOE = {"model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 24}

CONFIGS = {
    "qwen3": ModelConfig(**BASE, model_type="qwen3"),
    "qwen3_tied_attention_bias": ModelConfig(**BASE, model_type="qwen3", tie_word_embeddings=True,
                                             qkv_bias=True, o_bias=True),
    "qwen3_moe_norm_topk": ModelConfig(**BASE, **MOE, norm_topk_prob=True),
    "qwen3_moe_raw_topk": ModelConfig(**BASE, **MOE, norm_topk_prob=False),
    # Layer 0 dense by mlp_only_layers, layer 1 sparse, layer 2 dense by decoder_sparse_step.
    "qwen3_moe_mixed_layers": ModelConfig(**{**BASE, "num_hidden_layers": 4}, **MOE, norm_topk_prob=True,
                                          decoder_sparse_step=2, mlp_only_layers=(3,)),
}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_torch_thread():
        yield


def randomized(model: LlamaForCausalLM, seed: int, scale: float = 0.2) -> LlamaForCausalLM:
    """Random values everywhere (norms, biases and the router too), so a misplaced parameter changes
    the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale + (1.0 if param.dim() == 1 else 0.0))
    return model


def hf_model_from_dir(path: str) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def test_layer_kinds_follow_the_hf_rule() -> None:
    mixed = LlamaForCausalLM(CONFIGS["qwen3_moe_mixed_layers"])
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in mixed.model.layers] == [False, True, False, False]
    names = set(dict(mixed.named_parameters()))
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in names and "model.layers.1.mlp.gate.weight" in names
    assert "model.layers.0.self_attn.q_norm.weight" in names
    assert not any("q_norm" in n for n, _ in LlamaForCausalLM(ModelConfig(**BASE)).named_parameters())
    mixed.init_weights(seed=0)
    assert torch.equal(mixed.model.layers[2].self_attn.k_norm.weight, torch.ones(16))
    assert mixed.model.layers[1].mlp.gate.weight.std() > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_and_logprobs_equal_transformers(name: str, tmp_path) -> None:
    ours = randomized(LlamaForCausalLM(CONFIGS[name]), seed=3)
    save_pretrained(ours, tmp_path)
    theirs = hf_model_from_dir(str(tmp_path))
    assert type(theirs).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[
        CONFIGS[name].model_type]
    ids = torch.randint(0, ours.config.vocab_size, (2, 37), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(token_logprobs(got, ids), token_logprobs(expected, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe_mixed_layers"])
def test_loads_a_checkpoint_written_by_transformers(name: str, tmp_path) -> None:
    hf_config = transformers.AutoConfig.for_model(**CONFIGS[name].to_hf_dict())
    torch.manual_seed(11)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        for _, param in theirs.named_parameters():
            param.add_(0.2 * torch.randn(param.shape))  # the router starts at zero in transformers
    theirs.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config == CONFIGS[name]
    ids = torch.randint(0, ours.config.vocab_size, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe_norm_topk", "qwen3_moe_mixed_layers"])
def test_engine_greedy_generation_equals_transformers_generate(name: str, tmp_path) -> None:
    # Large weights make the next-token distribution peaked, so greedy decisions are not near-ties.
    ours = randomized(LlamaForCausalLM(CONFIGS[name]), seed=7, scale=1.0)
    save_pretrained(ours, tmp_path)
    theirs = hf_model_from_dir(str(tmp_path))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=gen).tolist() for n in (5, 13, 1)]
    # Block size 4 and 8 tokens per step: paged KV across blocks and chunked prefill mixed with decodes.
    core = EngineCore(ours, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=8,
                                         memory_tag_prefix=f"qwen3-{name}-"))
    outs = core.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            expected = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12,
                                       min_new_tokens=12, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        full = torch.tensor([prompt + out.token_ids])
        with torch.no_grad():
            reference = token_logprobs(theirs(input_ids=full).logits, full)[0, len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(out.logprobs), reference, rtol=1e-4, atol=1e-4)


def test_every_expert_gets_a_gradient_even_when_no_token_chose_it() -> None:
    config = CONFIGS["qwen3_moe_norm_topk"].replace(num_experts_per_tok=1, num_hidden_layers=1)
    model = randomized(LlamaForCausalLM(config), seed=1)
    logits = model(torch.tensor([3]))
    logits.sum().backward()
    experts = model.model.layers[0].mlp.experts
    used = [bool(e.up_proj.weight.grad.abs().sum() > 0) for e in experts]
    assert sum(used) == 1
    assert all(e.down_proj.weight.grad is not None for e in experts)
    # Without gradients only the chosen expert runs; the result is the same.
    with torch.no_grad():
        assert torch.equal(model(torch.tensor([3])), logits.detach())


def test_route_picks_the_top_k_and_renormalises() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, dim=-1)
    raw, experts = route(logits, 2, normalize=False)
    assert experts.tolist() == [[1, 2]]
    torch.testing.assert_close(raw, probs[:, [1, 2]])
    normalised, _ = route(logits, 2, normalize=True)
    torch.testing.assert_close(normalised, probs[:, [1, 2]] / probs[:, [1, 2]].sum())


def test_config_round_trips_through_config_json(tmp_path) -> None:
    config = CONFIGS["qwen3_moe_mixed_layers"]
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3MoeForCausalLM"] and raw["mlp_only_layers"] == [3]
    assert ModelConfig.from_pretrained(tmp_path) == config
    # transformers >= 5 writes the expert count as num_local_experts.
    raw["num_local_experts"] = raw.pop("num_experts")
    assert ModelConfig.from_hf_dict(raw) == config


@pytest.mark.parametrize("changes, field", [
    ({"model_type": "qwen3", "mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen3", "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8},
     "num_experts must be 0 for model_type 'qwen3'"),
    ({**MOE, "num_experts_per_tok": 7}, r"num_experts_per_tok must be in \[1, num_experts = 6\]"),
    ({**MOE, "moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({**MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({**MOE, "mlp_only_layers": (3,)}, r"mlp_only_layers must be a tuple of layer indices in \[0, 3\)"),
])
def test_config_validation_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**BASE, **changes})


def test_sliding_window_layers_are_refused() -> None:
    raw = CONFIGS["qwen3"].to_hf_dict()
    with pytest.raises(ConfigError, match="layer_types must all be 'full_attention'"):
        ModelConfig.from_hf_dict({**raw, "layer_types": ["full_attention", "sliding_attention", "full_attention"]})
    with pytest.raises(ConfigError, match="sliding window"):
        ModelConfig.from_hf_dict({**raw, "use_sliding_window": True})
