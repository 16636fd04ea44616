"""HF <-> Megatron weight conversion: exact round trips and the fused layouts, checked against a
per-head reference. Pure tensor code: runs without megatron-core."""

from __future__ import annotations

import pytest
import torch

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model import LlamaForCausalLM, ModelConfig
from april_ext.trainer.megatron import LAYOUTS, fuse_qkv, hf_to_megatron, megatron_to_hf, split_qkv

CONFIGS = {
    "gqa": ModelConfig(vocab_size=37, hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, head_dim=8),
    "mqa_tied": ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    "qwen2": ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, model_type="qwen2"),
    "all_biases_mha": ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=1,
                                  num_attention_heads=4, qkv_bias=True, o_bias=True, mlp_bias=True),
    "qwen3": ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, model_type="qwen3"),
    # Layers 0 and 2 sparse, layer 1 dense (mlp_only_layers); expert width differs from the dense one.
    "qwen3_moe": ModelConfig(vocab_size=37, hidden_size=32, intermediate_size=24, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, model_type="qwen3_moe",
                             num_experts=3, num_experts_per_tok=2, moe_intermediate_size=12, mlp_only_layers=(1,),
                             tie_word_embeddings=True),
}


def hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values everywhere (norms and biases too), so a misplaced row cannot go unnoticed."""
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(p.shape, generator=generator) for name, p in model.named_parameters()
            if not (config.tie_word_embeddings and name == "lm_head.weight")}


def reference_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """Megatron's linear_qkv row order spelled out head by head: per query group, its query heads, then
    its key head, then its value head."""
    d, groups = config.head_dim, config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    rows = []
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_round_trips_are_bit_exact(name: str, layout: str) -> None:
    config = CONFIGS[name]
    hf = hf_weights(config)
    mg = hf_to_megatron(hf, config, layout=layout)
    back = megatron_to_hf(mg, config, layout=layout)
    assert set(back) == set(hf)
    for key, tensor in hf.items():
        assert torch.equal(back[key], tensor), key
    again = hf_to_megatron(back.items(), config, layout=layout)
    assert set(again) == set(mg)
    for key, tensor in mg.items():
        assert torch.equal(again[key], tensor), key


@pytest.mark.parametrize("name", CONFIGS)
def test_fused_layouts_match_the_per_head_reference(name: str) -> None:
    config = CONFIGS[name]
    hf = hf_weights(config, seed=3)
    mg = hf_to_megatron(hf, config)
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        suffixes = ("weight", "bias") if config.qkv_bias else ("weight",)
        for s in suffixes:
            expected = reference_qkv(hf[h + f"self_attn.q_proj.{s}"], hf[h + f"self_attn.k_proj.{s}"],
                                     hf[h + f"self_attn.v_proj.{s}"], config)
            assert torch.equal(mg[m + f"self_attention.linear_qkv.{s}"], expected)
        if config.is_moe_layer(i):
            continue  # test_moe_layers_map_to_megatrons_router_and_local_experts
        fc1 = mg[m + "mlp.linear_fc1.weight"]
        assert torch.equal(fc1[:config.intermediate_size], hf[h + "mlp.gate_proj.weight"])
        assert torch.equal(fc1[config.intermediate_size:], hf[h + "mlp.up_proj.weight"])
        assert torch.equal(mg[m + "input_layernorm.weight"], hf[h + "input_layernorm.weight"])
        assert torch.equal(mg[m + "pre_mlp_layernorm.weight"], hf[h + "post_attention_layernorm.weight"])
    assert ("output_layer.weight" in mg) == (not config.tie_word_embeddings)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_moe_layers_map_to_megatrons_router_and_local_experts(layout: str) -> None:
    config = CONFIGS["qwen3_moe"]
    hf = hf_weights(config, seed=4)
    mg = hf_to_megatron(hf, config, layout=layout)
    width = config.moe_intermediate_size
    for i in (0, 2):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        assert torch.equal(mg[m + "mlp.router.weight"], hf[h + "mlp.gate.weight"])
        for e in range(config.num_experts):
            fc1 = mg[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"]
            assert fc1.shape == (2 * width, config.hidden_size)
            assert torch.equal(fc1[:width], hf[h + f"mlp.experts.{e}.gate_proj.weight"])
            assert torch.equal(fc1[width:], hf[h + f"mlp.experts.{e}.up_proj.weight"])
            assert torch.equal(mg[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"],
                               hf[h + f"mlp.experts.{e}.down_proj.weight"])
        # The norm before the experts is never folded into a linear layer.
        assert torch.equal(mg[m + "pre_mlp_layernorm.weight"], hf[h + "post_attention_layernorm.weight"])
        for which in ("q", "k"):
            assert torch.equal(mg[m + f"self_attention.{which}_layernorm.weight"],
                               hf[h + f"self_attn.{which}_norm.weight"])
    assert not any(k.startswith("decoder.layers.1.mlp.experts") or k == "decoder.layers.1.mlp.router.weight"
                   for k in mg)
    dense_fc1 = mg["decoder.layers.1.mlp.linear_fc1.weight"]
    assert dense_fc1.shape == (2 * config.intermediate_size, config.hidden_size)
    with pytest.raises(InvalidArgumentError, match="linear_fc1.weight has 12 rows, the config needs "
                                                   "2 x moe_intermediate_size = 24"):
        megatron_to_hf({**mg, "decoder.layers.2.mlp.experts.local_experts.1.linear_fc1.weight": torch.zeros(12, 32)},
                       config, layout=layout)


def test_te_layout_folds_the_norms_into_the_linear_layers() -> None:
    config = CONFIGS["gqa"]
    hf = hf_weights(config)
    te = hf_to_megatron(hf, config, layout="te")
    assert torch.equal(te["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"],
                       hf["model.layers.1.input_layernorm.weight"])
    assert torch.equal(te["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"],
                       hf["model.layers.1.post_attention_layernorm.weight"])
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in te)


def test_split_qkv_inverts_fuse_qkv_on_biases() -> None:
    config = CONFIGS["gqa"]
    q, k, v = torch.randn(48), torch.randn(16), torch.randn(16)
    fused = fuse_qkv(q, k, v, config)
    assert fused.shape == (80,)
    for a, b in zip(split_qkv(fused, config), (q, k, v)):
        assert torch.equal(a, b)


def test_bad_inputs_name_the_problem() -> None:
    config = CONFIGS["gqa"]
    hf = hf_weights(config)
    with pytest.raises(ConfigError, match="layout must be one of"):
        hf_to_megatron(hf, config, layout="fused")
    missing = dict(hf)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(InvalidArgumentError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_megatron(missing, config)
    with pytest.raises(InvalidArgumentError, match="no parameter for"):
        hf_to_megatron({**hf, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, config)
    mg = hf_to_megatron(hf, config)
    with pytest.raises(InvalidArgumentError, match="linear_qkv has 64 rows, the config needs 80"):
        megatron_to_hf({**mg, "decoder.layers.0.self_attention.linear_qkv.weight": torch.zeros(64, 48)}, config)
    with pytest.raises(InvalidArgumentError, match="no HF weight"):
        megatron_to_hf({**mg, "decoder.layers.0.self_attention.extra": torch.zeros(1)}, config)
    extra_state = {**mg, "output_layer._extra_state": torch.zeros(0)}
    assert set(megatron_to_hf(extra_state, config)) == set(hf)
