"""Bad values of ModelConfig, given directly or through a Hugging Face config.json (ModelConfig.from_hf_dict),
raise ConfigError naming the field and the value, never a TypeError / AttributeError from deeper down, and
never pass into a later failure (NaN weights, an EOS id that never matches). Every valid form keeps loading."""

from __future__ import annotations

import re
from typing import Any

import pytest

from april_ext.errors import ConfigError
from april_ext.model import ModelConfig

INF = float("inf")
NAN = float("nan")
NOT_NUMBERS = [None, "5", [1], {}, object()]

# The example configs of tests/test_model.py (Llama) and tests/test_qwen3.py (Qwen3, Qwen3-MoE).
LLAMA = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=500.0)
QWEN3 = {"vocab_size": 89, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 1000.0, "model_type": "qwen3"}
MOE = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 6, "num_experts_per_tok": 2,
       "moe_intermediate_size": 24}

EXAMPLES = {
    "llama_gqa": {**LLAMA, "num_key_value_heads": 2},
    "llama_tied": {**LLAMA, "tie_word_embeddings": True},
    "llama_bias": {**LLAMA, "num_key_value_heads": 2, "qkv_bias": True, "o_bias": True, "mlp_bias": True},
    "qwen2": {**LLAMA, "num_key_value_heads": 2, "qkv_bias": True, "model_type": "qwen2",
              "tie_word_embeddings": True},
    "llama3_rope": {**LLAMA, "rope_type": "llama3",
                    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}},
    "linear_rope": {**LLAMA, "rope_type": "linear", "rope_scaling": {"factor": 2.0}},
    "qwen3": QWEN3,
    "qwen3_tied_attention_bias": {**QWEN3, "tie_word_embeddings": True, "qkv_bias": True, "o_bias": True},
    "qwen3_moe": {**MOE, "norm_topk_prob": True},
    "qwen3_moe_mixed_layers": {**MOE, "num_hidden_layers": 4, "norm_topk_prob": True, "decoder_sparse_step": 2,
                               "mlp_only_layers": (3,)},
    "token_ids": {**LLAMA, "bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0},
    "eos_list": {**LLAMA, "bos_token_id": 0, "eos_token_id": [2, 7]},
    "eos_tuple": {**LLAMA, "eos_token_id": (2, 7)},
    "eos_empty_list": {**LLAMA, "eos_token_id": []},
    "int_rope_theta": {**LLAMA, "rope_theta": 1000000},
}

# Hugging Face config.json shapes as published (layer sizes shrunk): JSON nulls, an integer rope_theta, an
# EOS list, legacy rope_scaling.
HF_EXAMPLES = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
              "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu",
              "hidden_size": 48, "initializer_range": 0.02, "intermediate_size": 80, "max_position_embeddings": 256,
              "max_window_layers": 3, "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
              "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
              "use_sliding_window": False, "vocab_size": 151936},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                  "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 16, "hidden_size": 48,
                  "intermediate_size": 80, "max_position_embeddings": 256, "mlp_only_layers": [],
                  "moe_intermediate_size": 24, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
                  "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
                  "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
                  "vocab_size": 151936},
    "llama3": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False,
               "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
               "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 112,
               "max_position_embeddings": 256, "mlp_bias": False, "num_attention_heads": 4,
               "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
               "vocab_size": 128256},
    "transformers5_layer_types": {"model_type": "qwen3", "vocab_size": 89, "hidden_size": 48,
                                  "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4,
                                  "layer_types": ["full_attention", "full_attention"], "dtype": "float32",
                                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
}


@pytest.mark.parametrize("fields", EXAMPLES.values(), ids=EXAMPLES.keys())
def test_example_configs_still_load_and_round_trip(fields: dict[str, Any]) -> None:
    config = ModelConfig(**fields)
    assert ModelConfig.from_hf_dict(config.to_hf_dict()) == config.replace(rope_theta=float(config.rope_theta))


@pytest.mark.parametrize("raw", HF_EXAMPLES.values(), ids=HF_EXAMPLES.keys())
def test_published_config_json_shapes_still_load(raw: dict[str, Any]) -> None:
    config = ModelConfig.from_hf_dict(raw)
    assert config.rope_theta == float(raw.get("rope_theta", 10000.0)) and isinstance(config.rope_theta, float)
    eos = raw.get("eos_token_id")
    assert config.eos_token_ids == (() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,))


def _refuses(base: dict[str, Any], name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=rf"ModelConfig\.{name} must be") as info:
        ModelConfig(**{**base, name: value})
    assert repr(value) in str(info.value)


# Defect 1: fields compared or computed with before their type was checked.
@pytest.mark.parametrize("name, value", [
    *[(name, v) for name in ("hidden_size", "num_attention_heads") for v in NOT_NUMBERS],
    *[(name, v) for name in ("rms_norm_eps", "rope_theta") for v in (*NOT_NUMBERS, INF, True)],
    ("dtype", []),
    ("dtype", {}),
])
def test_refuses_wrong_types(name: str, value: Any) -> None:
    _refuses(LLAMA, name, value)


@pytest.mark.parametrize("name, value", [
    ("num_experts_per_tok", "2"),
    ("num_experts_per_tok", None),
    ("num_experts_per_tok", [2]),
    ("mlp_only_layers", ("1",)),
    ("mlp_only_layers", (None,)),
])
def test_refuses_wrong_moe_types(name: str, value: Any) -> None:
    _refuses(MOE, name, value)


def test_refuses_rope_scaling_that_is_not_a_dict() -> None:
    _refuses({**LLAMA, "rope_type": "linear"}, "rope_scaling", 5)


# Defect 2: config.json of the wrong JSON shape.
@pytest.mark.parametrize("key, value", [
    ("layer_types", 5),
    ("rope_parameters", [1]),
    ("rope_parameters", "x"),
    ("rope_scaling", "x"),
    ("rope_scaling", [1]),
    ("rope_theta", "x"),
    ("rope_theta", None),
    ("rope_theta", True),
    ("rope_theta", 10 ** 400),
    ("attention_bias", "false"),
    ("attention_bias", 0),
])
def test_from_hf_dict_refuses_wrong_json_shapes(key: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=f"config.json {key} must") as info:
        ModelConfig.from_hf_dict({**HF_EXAMPLES["qwen3"], key: value})
    assert repr(value) in str(info.value)


def test_from_hf_dict_refuses_rope_theta_inside_rope_parameters() -> None:
    with pytest.raises(ConfigError, match="config.json rope_theta must be a finite number, got 'x'"):
        ModelConfig.from_hf_dict({**HF_EXAMPLES["transformers5_layer_types"], "rope_parameters": {"rope_theta": "x"}})


@pytest.mark.parametrize("value", [3, "ab"])
def test_from_hf_dict_refuses_mlp_only_layers_that_is_not_a_list(value: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"config.json mlp_only_layers must be a JSON array or null, "
                                                    f"got {value!r}")):
        ModelConfig.from_hf_dict({**HF_EXAMPLES["qwen3_moe"], "mlp_only_layers": value})


@pytest.mark.parametrize("raw", [[1], "config", None, 3])
def test_from_hf_dict_refuses_a_top_level_that_is_not_an_object(raw: Any) -> None:
    with pytest.raises(ConfigError, match="config.json must hold a JSON object"):
        ModelConfig.from_hf_dict(raw)


# Defect 3: values accepted silently that break a run later.
@pytest.mark.parametrize("value", [NAN, INF, -0.02, "0.02", None, True])
def test_refuses_bad_initializer_range(value: Any) -> None:
    _refuses(LLAMA, "initializer_range", value)


@pytest.mark.parametrize("name, value", [
    *[(name, v) for name in ("bos_token_id", "eos_token_id") for v in ("2", -1, 2.0, True, {2: 1})],
    ("bos_token_id", [1]),
    ("eos_token_id", ["2"]),
    ("eos_token_id", [2, -1]),
    ("eos_token_id", [2, True]),
])
def test_refuses_bad_token_ids(name: str, value: Any) -> None:
    _refuses(LLAMA, name, value)


def test_from_hf_dict_refuses_a_string_eos_token_id() -> None:
    with pytest.raises(ConfigError, match="ModelConfig.eos_token_id must be"):
        ModelConfig.from_hf_dict({**HF_EXAMPLES["qwen3"], "eos_token_id": "2"})


@pytest.mark.parametrize("name", ["tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "norm_topk_prob"])
@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_refuses_bool_fields_that_are_not_bools(name: str, value: Any) -> None:
    _refuses(MOE if name == "norm_topk_prob" else LLAMA, name, value)


@pytest.mark.parametrize("key, example", [("tie_word_embeddings", "qwen3"), ("mlp_bias", "llama3"),
                                          ("norm_topk_prob", "qwen3_moe")])
def test_from_hf_dict_refuses_bool_fields_that_are_not_bools(key: str, example: str) -> None:
    with pytest.raises(ConfigError, match=f"ModelConfig.{key} must be a bool, got 'false'"):
        ModelConfig.from_hf_dict({**HF_EXAMPLES[example], key: "false"})


@pytest.mark.parametrize("rope_type, scaling, match", [
    ("linear", {"factor": "x"}, "needs finite numbers > 0"),
    ("linear", {"factor": 0}, "needs finite numbers > 0"),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": NAN, "original_max_position_embeddings": 16},
     "needs finite numbers > 0"),
    ("llama3", {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0, "original_max_position_embeddings": 16},
     "high_freq_factor must exceed low_freq_factor"),
])
def test_rope_scaling_values_are_checked_before_the_model_is_built(rope_type, scaling, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(**LLAMA, rope_type=rope_type, rope_scaling=scaling)
