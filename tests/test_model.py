"""The Llama-style model against transformers' own implementation, plus checkpoint I/O and validation."""

from __future__ import annotations

import json

import pytest
import torch

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model import LlamaForCausalLM, ModelConfig, load_pretrained, save_pretrained

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500.0)

CONFIGS = {
    "gqa": ModelConfig(**BASE, num_key_value_heads=2),
    "mha_tied": ModelConfig(**BASE, tie_word_embeddings=True),
    "mqa_head_dim_24": ModelConfig(**BASE, num_key_value_heads=1, head_dim=24),
    "head_dim_80": ModelConfig(**{**BASE, "hidden_size": 160, "num_attention_heads": 2}, num_key_value_heads=1),
    "llama_bias_mlp_bias": ModelConfig(**BASE, num_key_value_heads=2, qkv_bias=True, o_bias=True, mlp_bias=True),
    "qwen2": ModelConfig(**BASE, num_key_value_heads=2, qkv_bias=True, model_type="qwen2",
                         tie_word_embeddings=True),
    "llama3_rope": ModelConfig(**BASE, num_key_value_heads=2, rope_type="llama3",
                               rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 16}),
    "linear_rope": ModelConfig(**BASE, rope_type="linear", rope_scaling={"factor": 2.0}),
}


def hf_model_from_dir(path: str) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager")
    return model.eval()


def randomized(model: LlamaForCausalLM, seed: int) -> LlamaForCausalLM:
    """Random values everywhere (norms and biases too), so a misplaced parameter changes the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.2 + (1.0 if param.dim() == 1 else 0.0))
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_equal_transformers(name: str, tmp_path) -> None:
    ours = randomized(LlamaForCausalLM(CONFIGS[name]), seed=3)
    save_pretrained(ours, tmp_path)
    theirs = hf_model_from_dir(str(tmp_path))
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = theirs(input_ids=ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=5e-5)


@pytest.mark.parametrize("name", ["gqa", "qwen2", "mha_tied"])
def test_loads_a_transformers_checkpoint(name: str, tmp_path) -> None:
    hf_config = transformers.AutoConfig.for_model(**CONFIGS[name].to_hf_dict())
    torch.manual_seed(11)
    theirs = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    theirs.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path)
    assert ours.config.tie_word_embeddings == CONFIGS[name].tie_word_embeddings
    ids = torch.randint(0, ours.config.vocab_size, (1, 23))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_packed_forward_equals_separate_sequences() -> None:
    model = randomized(LlamaForCausalLM(CONFIGS["gqa"]), seed=1)
    lengths = [5, 1, 19]
    seqs = [torch.randint(0, 97, (n,)) for n in lengths]
    cu = torch.tensor([0, 5, 6, 25])
    with torch.no_grad():
        packed = model(torch.cat(seqs), cu_seqlens=cu)
        for i, seq in enumerate(seqs):
            torch.testing.assert_close(packed[cu[i]:cu[i + 1]], model(seq[None])[0], rtol=1e-5, atol=1e-5)


def test_forward_is_differentiable() -> None:
    model = LlamaForCausalLM(CONFIGS["mha_tied"])
    model.init_weights(seed=0)
    ids = torch.randint(0, 97, (2, 9))
    loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, 97), ids[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["model.layers.0.self_attn.q_proj.weight"].abs().sum() > 0


def test_init_weights_is_seeded() -> None:
    a, b, c = (LlamaForCausalLM(CONFIGS["gqa"]) for _ in range(3))
    a.init_weights(seed=4)
    b.init_weights(seed=4)
    c.init_weights(seed=5)
    wa, wb, wc = (m.model.layers[1].mlp.up_proj.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.equal(a.model.norm.weight, torch.ones(64))


def test_save_load_round_trip_keeps_weights_and_dtype(tmp_path) -> None:
    model = randomized(LlamaForCausalLM(CONFIGS["qwen2"], dtype=torch.bfloat16), seed=2)
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight.dtype == torch.bfloat16
    for (name, p), (_, q) in zip(model.named_parameters(), loaded.named_parameters()):
        assert torch.equal(p, q), name
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def test_load_weights_rejects_wrong_names_and_shapes_without_partial_copy() -> None:
    model = LlamaForCausalLM(CONFIGS["gqa"])
    model.init_weights(seed=0)
    before = model.model.norm.weight.clone()
    good = [("model.norm.weight", torch.full((64,), 2.0))]
    with pytest.raises(InvalidArgumentError, match="model.layers.9"):
        model.load_weights(good + [("model.layers.9.mlp.up_proj.weight", torch.zeros(112, 64))],
                           require_all=False)
    with pytest.raises(InvalidArgumentError, match=r"shape \(64, 64\)"):
        model.load_weights(good + [("model.layers.0.self_attn.k_proj.weight", torch.zeros(64, 64))],
                           require_all=False)
    with pytest.raises(InvalidArgumentError, match="lack"):
        model.load_weights(good)
    assert torch.equal(model.model.norm.weight, before)
    assert model.load_weights(good, require_all=False) == ["model.norm.weight"]
    assert torch.equal(model.model.norm.weight, torch.full((64,), 2.0))


@pytest.mark.parametrize("changes, field", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"head_dim": 7}, "head_dim"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"rope_type": "yarn"}, "rope_type"),
    ({"rope_type": "linear"}, "rope_scaling"),
    ({"model_type": "gpt2"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
])
def test_config_validation_names_the_field(changes: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        ModelConfig(**{**BASE, **changes})


def test_config_reads_legacy_rope_fields_and_rejects_sliding_window() -> None:
    raw = {**CONFIGS["gqa"].to_hf_dict()}
    del raw["rope_parameters"]
    raw.update(rope_theta=1234.0, rope_scaling={"type": "linear", "factor": 3.0})
    config = ModelConfig.from_hf_dict(raw)
    assert (config.rope_theta, config.rope_type, config.rope_scaling) == (1234.0, "linear", {"factor": 3.0})
    with pytest.raises(ConfigError, match="sliding window"):
        ModelConfig.from_hf_dict({**raw, "model_type": "qwen2", "use_sliding_window": True})
    with pytest.raises(ConfigError, match="lacks required"):
        ModelConfig.from_hf_dict({"model_type": "llama", "hidden_size": 8})
