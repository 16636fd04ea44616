"""ModelConfig: the architecture of a Llama-style decoder (Llama, Qwen2, Mistral, Qwen3, Qwen3-MoE), read from
and written to Hugging Face config.json."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from april_ext.errors import ConfigError
from april_ext.persistence import atomic_write_json, ensure_dir

# Qwen2 always has q/k/v biases and no o bias; the others read `attention_bias` for all four projections.
# Qwen3 and Qwen3-MoE add an RMSNorm over each query / key head; Qwen3-MoE replaces the MLP of its sparse
# layers by top-k routed experts.
_SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe")
_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
_ROPE_TYPES = ("default", "linear", "llama3")
# The dtype names config.json (and the serve CLI) may give, and their torch dtypes.
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_BOOL_FIELDS = ("tie_word_embeddings", "qkv_bias", "o_bias", "mlp_bias", "norm_topk_prob")
_JsonContainer = TypeVar("_JsonContainer", list[Any], dict[str, Any])


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    # Compared with the largest float rather than inf, so that the value also converts to a float (10**400 does not).
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= sys.float_info.max


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _json_container(raw: dict[str, Any], key: str, kind: type[_JsonContainer], allowed: str) -> _JsonContainer:
    """raw[key] where it is a `kind`, an empty one where it is absent or null."""
    value = raw.get(key)
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise ConfigError(f"config.json {key} must be {allowed}, got {value!r}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-style decoder; field names follow Hugging Face config.json.

    rope_scaling holds the extra RoPE parameters of the non-default rope types ("linear": factor;
    "llama3": factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).

    Mixture of experts (qwen3_moe only; num_experts 0 means dense): layer i is sparse when i is not in
    mlp_only_layers and (i + 1) % decoder_sparse_step == 0. A sparse layer routes each token to the
    num_experts_per_tok experts of highest softmax probability, weighted by those probabilities
    (renormalised to sum to 1 when norm_topk_prob); each expert is a SwiGLU MLP of width
    moe_intermediate_size. Dense layers keep intermediate_size.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_scaling: dict[str, float] = field(default_factory=dict)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    model_type: str = "llama"
    dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Resolve the HF defaults once so every reader sees concrete values.
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        # Only from valid values: _validate reports the others (it checks both fields before head_dim).
        if self.head_dim is None and _is_int(self.hidden_size) and _is_int(self.num_attention_heads) \
                and self.num_attention_heads > 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self._validate()

    def _validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        assert self.num_key_value_heads is not None and self.head_dim is not None
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ConfigError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ConfigError(f"ModelConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _is_finite_number(value) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a finite number > 0, got {value!r}")
        if not _is_finite_number(self.initializer_range) or self.initializer_range < 0:
            raise ConfigError(
                f"ModelConfig.initializer_range must be a finite number >= 0, got {self.initializer_range!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"ModelConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.rope_type not in _ROPE_TYPES:
            raise ConfigError(f"ModelConfig.rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        if not isinstance(self.rope_scaling, dict):
            raise ConfigError(f"ModelConfig.rope_scaling must be a dict, got {self.rope_scaling!r}")
        required = {"default": (), "linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings")}[self.rope_type]
        missing = [k for k in required if k not in self.rope_scaling]
        if missing:
            raise ConfigError(f"ModelConfig.rope_scaling for rope_type {self.rope_type!r} lacks {missing}")
        bad = {k: self.rope_scaling[k] for k in required
               if not _is_finite_number(self.rope_scaling[k]) or self.rope_scaling[k] <= 0}
        if bad:
            raise ConfigError(f"ModelConfig.rope_scaling for rope_type {self.rope_type!r} needs finite numbers > 0, "
                              f"got {bad}")
        # llama3 interpolates between the two wavelength bounds: equal factors would divide by zero.
        if self.rope_type == "llama3" and self.rope_scaling["high_freq_factor"] <= self.rope_scaling["low_freq_factor"]:
            raise ConfigError(f"ModelConfig.rope_scaling high_freq_factor must exceed low_freq_factor, got "
                              f"{self.rope_scaling['high_freq_factor']!r} <= {self.rope_scaling['low_freq_factor']!r}")
        if self.hidden_act != "silu":
            raise ConfigError(f"ModelConfig.hidden_act must be 'silu', got {self.hidden_act!r}")
        if self.model_type not in _SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"ModelConfig.model_type must be one of {_SUPPORTED_MODEL_TYPES}, got {self.model_type!r}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPES:
            raise ConfigError(f"ModelConfig.dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.model_type in _QK_NORM_MODEL_TYPES and self.mlp_bias:
            raise ConfigError(f"ModelConfig.mlp_bias must be False for model_type {self.model_type!r}")
        if self.bos_token_id is not None and not _is_token_id(self.bos_token_id):
            raise ConfigError(
                f"ModelConfig.bos_token_id must be None or a token id (an integer >= 0), got {self.bos_token_id!r}")
        eos = self.eos_token_id
        if eos is not None and not _is_token_id(eos) and \
                not (isinstance(eos, (list, tuple)) and all(_is_token_id(i) for i in eos)):
            raise ConfigError(f"ModelConfig.eos_token_id must be None, a token id (an integer >= 0) or a list of "
                              f"token ids, got {eos!r}")
        self._validate_experts()

    def _validate_experts(self) -> None:
        if not isinstance(self.num_experts, int) or isinstance(self.num_experts, bool) or self.num_experts < 0:
            raise ConfigError(f"ModelConfig.num_experts must be an integer >= 0, got {self.num_experts!r}")
        if self.num_experts == 0:
            return
        if self.model_type != "qwen3_moe":
            raise ConfigError(f"ModelConfig.num_experts must be 0 for model_type {self.model_type!r} "
                              f"(experts exist for 'qwen3_moe' only), got {self.num_experts}")
        if not _is_int(self.num_experts_per_tok) or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts = {self.num_experts}], "
                              f"got {self.num_experts_per_tok!r}")
        for name in ("moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.mlp_only_layers, tuple) or \
                any(not _is_int(i) or not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ConfigError(f"ModelConfig.mlp_only_layers must be a tuple of layer indices in "
                              f"[0, {self.num_hidden_layers}), got {self.mlp_only_layers!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    @property
    def qk_norm(self) -> bool:
        """Whether attention normalises each query and key head (RMSNorm over head_dim) before RoPE."""
        return self.model_type in _QK_NORM_MODEL_TYPES

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes its tokens to experts instead of one MLP."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Builds a config from the fields of a Hugging Face config.json (Llama, Qwen2, Mistral, Qwen3,
        Qwen3-MoE)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {raw!r}")
        model_type = raw.get("model_type", "llama")
        if model_type not in _SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config.json model_type must be one of {_SUPPORTED_MODEL_TYPES}, got {model_type!r}")
        if raw.get("use_sliding_window") or (model_type == "mistral" and raw.get("sliding_window")):
            raise ConfigError("config.json enables a sliding window, which the embedded model does not support")
        layer_types = _json_container(raw, "layer_types", list, "a JSON array or null")
        if any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(f"config.json layer_types must all be 'full_attention' (the embedded model has no "
                              f"sliding window), got {layer_types}")
        # transformers >= 5 writes rope_parameters; older versions write rope_theta + rope_scaling.
        rope = dict(_json_container(raw, "rope_parameters", dict, "a JSON object or null"))
        legacy = _json_container(raw, "rope_scaling", dict, "a JSON object or null")
        rope_theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        if not _is_finite_number(rope_theta):
            raise ConfigError(f"config.json rope_theta must be a finite number, got {rope_theta!r}")
        rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or \
            legacy.get("rope_type") or legacy.get("type") or "default"
        scaling = {k: v for k, v in {**legacy, **rope}.items() if k not in ("rope_type", "type", "rope_theta")}
        if model_type == "qwen2":
            qkv_bias, o_bias = True, False
        else:
            qkv_bias = o_bias = raw.get("attention_bias", False)
            if not isinstance(qkv_bias, bool):
                raise ConfigError(f"config.json attention_bias must be true or false, got {qkv_bias!r}")
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        known = {f.name for f in dataclasses.fields(cls)}
        plain = {k: raw[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "head_dim",
                                     "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                                     "mlp_bias", "hidden_act", "initializer_range", "bos_token_id",
                                     "eos_token_id") if k in raw and k in known}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in plain]
        if missing:
            raise ConfigError(f"config.json lacks required fields {missing}")
        if model_type == "qwen3_moe":
            # transformers >= 5 writes num_local_experts; the published checkpoints write num_experts.
            plain["num_experts"] = raw.get("num_experts", raw.get("num_local_experts", 0))
            plain.update({k: raw[k] for k in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                                              "decoder_sparse_step") if k in raw})
            plain["mlp_only_layers"] = tuple(_json_container(raw, "mlp_only_layers", list, "a JSON array or null"))
        return cls(**plain, rope_theta=float(rope_theta), rope_type=rope_type, rope_scaling=scaling,
                   qkv_bias=qkv_bias, o_bias=o_bias, model_type=model_type, dtype=str(dtype))

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face config.json fields describing this architecture (readable by transformers)."""
        if self.model_type == "qwen2" and not (self.qkv_bias and not self.o_bias):
            raise ConfigError("a qwen2 config needs qkv_bias=True and o_bias=False")
        if self.model_type != "qwen2" and self.qkv_bias != self.o_bias:
            raise ConfigError(f"a {self.model_type} config needs qkv_bias == o_bias (HF attention_bias)")
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.rope_theta, **self.rope_scaling},
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "hidden_act": self.hidden_act,
            "initializer_range": self.initializer_range,
            "dtype": self.dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.model_type != "qwen2":
            out["attention_bias"] = self.qkv_bias
        if self.rope_type != "default":
            out["rope_scaling"] = {"rope_type": self.rope_type, **self.rope_scaling}
        if self.model_type == "qwen3_moe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers))
        return out

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Reads `path/config.json` (or `path` itself when it is a file)."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)
        try:
            with open(file, encoding="utf-8") as handle:
                raw = json.load(handle)
        except FileNotFoundError as exc:
            raise ConfigError(f"no config.json at {file!r}") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{file!r} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw)

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        atomic_write_json(os.path.join(ensure_dir(directory), "config.json"), self.to_hf_dict(), indent=2)
