"""Weight conversion between Hugging Face (Llama / Qwen2 / Mistral) names and megatron-core GPTModel names.

Megatron fuses what HF keeps apart:
- ``self_attention.linear_qkv``: q, k and v in one matrix, interleaved per query group. For group g
  (``num_key_value_heads`` groups of ``heads_per_group`` query heads) the rows are
  ``[q heads of g (heads_per_group * head_dim), k head g (head_dim), v head g (head_dim)]``; biases alike.
- ``mlp.linear_fc1``: ``[gate_proj; up_proj]`` stacked along the output dimension (SwiGLU takes
  ``silu(first half) * second half``).
- Layer norms: the local (non-Transformer-Engine) layer spec keeps them as modules
  (``input_layernorm``, ``pre_mlp_layernorm``); the Transformer-Engine spec folds them into the next
  linear layer (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``). Both layouts are
  supported through ``layout``.

Every tensor is copied by slicing / concatenation only, so a round trip is bit-exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model import ModelConfig

LAYOUTS = ("local", "te")

_NORM_NAMES = {
    "local": ("input_layernorm.weight", "pre_mlp_layernorm.weight"),
    "te": ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"),
}


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")


class _Source:
    """Tensors by name for one conversion, taken by calling it; names never taken are an error at the end."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], subject: str, *, plural: bool) -> None:
        self.tensors = tensors
        self.lacks, self.holds = (f"{subject} lack", f"{subject} hold") if plural else \
            (f"{subject} lacks", f"{subject} holds")
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise InvalidArgumentError(f"{self.lacks} {name!r}, which the config requires")
        self.used.add(name)
        return self.tensors[name]

    def check_all_taken(self, meaning: str) -> None:
        unknown = sorted(set(self.tensors) - self.used)
        if unknown:
            raise InvalidArgumentError(f"{self.holds} {len(unknown)} names {meaning}, e.g. {unknown[:3]}")


def _suffixes(bias: bool) -> tuple[str, ...]:
    return ("weight", "bias") if bias else ("weight",)


def _dims(config: ModelConfig) -> tuple[int, int, int]:
    assert config.num_key_value_heads is not None and config.head_dim is not None
    groups = config.num_key_value_heads
    return groups, config.num_attention_heads // groups, config.head_dim


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """HF q/k/v projections (weights [out, in] or biases [out]) -> Megatron's per-group interleaved linear_qkv."""
    groups, per_group, dim = _dims(config)
    tail = q.shape[1:]
    q = q.reshape(groups, per_group * dim, *tail)
    k = k.reshape(groups, dim, *tail)
    v = v.reshape(groups, dim, *tail)
    return torch.cat((q, k, v), dim=1).reshape(groups * (per_group + 2) * dim, *tail)


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's linear_qkv weight or bias -> HF (q, k, v)."""
    groups, per_group, dim = _dims(config)
    expected = groups * (per_group + 2) * dim
    if qkv.shape[0] != expected:
        raise InvalidArgumentError(f"linear_qkv has {qkv.shape[0]} rows, the config needs {expected} "
                                   f"({groups} groups x ({per_group} q + k + v heads) x head_dim {dim})")
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, (per_group + 2) * dim, *tail)
    q, k, v = torch.split(grouped, [per_group * dim, dim, dim], dim=1)
    return (q.reshape(groups * per_group * dim, *tail), k.reshape(groups * dim, *tail),
            v.reshape(groups * dim, *tail))


def hf_to_megatron(weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                   config: ModelConfig, *, layout: str = "local") -> dict[str, torch.Tensor]:
    """HF-named tensors -> a GPTModel state dict (no ``_extra_state`` entries). Every parameter the config
    implies must be present; a tied config ignores ``lm_head.weight``; any other name is an error."""
    _check_layout(layout)
    hf = dict(weights.items() if isinstance(weights, Mapping) else weights)
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    take = _Source(hf, "HF weights", plural=True)

    attn_norm, mlp_norm = _NORM_NAMES[layout]
    out = {"embedding.word_embeddings.weight": take("model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": take("model.norm.weight")}
    if not config.tie_word_embeddings:
        out["output_layer.weight"] = take("lm_head.weight")
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[m + attn_norm] = take(h + "input_layernorm.weight")
        out[m + mlp_norm] = take(h + "post_attention_layernorm.weight")
        for s in _suffixes(config.qkv_bias):
            out[m + f"self_attention.linear_qkv.{s}"] = fuse_qkv(
                take(h + f"self_attn.q_proj.{s}"), take(h + f"self_attn.k_proj.{s}"),
                take(h + f"self_attn.v_proj.{s}"), config)
        for s in _suffixes(config.o_bias):
            out[m + f"self_attention.linear_proj.{s}"] = take(h + f"self_attn.o_proj.{s}")
        for s in _suffixes(config.mlp_bias):
            out[m + f"mlp.linear_fc1.{s}"] = torch.cat((take(h + f"mlp.gate_proj.{s}"),
                                                        take(h + f"mlp.up_proj.{s}")), dim=0)
            out[m + f"mlp.linear_fc2.{s}"] = take(h + f"mlp.down_proj.{s}")
    take.check_all_taken("this config has no parameter for")
    return out


def megatron_to_hf(state: Mapping[str, torch.Tensor], config: ModelConfig, *,
                   layout: str = "local") -> dict[str, torch.Tensor]:
    """A GPTModel state dict -> HF-named tensors (a tied config yields no ``lm_head.weight``).
    ``_extra_state`` entries are ignored; any other unexpected name is an error."""
    _check_layout(layout)
    mg = {k: v for k, v in state.items() if not k.endswith("._extra_state")}
    take = _Source(mg, "Megatron state", plural=False)

    attn_norm, mlp_norm = _NORM_NAMES[layout]
    out = {"model.embed_tokens.weight": take("embedding.word_embeddings.weight")}
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for s in _suffixes(config.qkv_bias):
            q, k, v = split_qkv(take(m + f"self_attention.linear_qkv.{s}"), config)
            out[h + f"self_attn.q_proj.{s}"], out[h + f"self_attn.k_proj.{s}"] = q, k
            out[h + f"self_attn.v_proj.{s}"] = v
        for s in _suffixes(config.o_bias):
            out[h + f"self_attn.o_proj.{s}"] = take(m + f"self_attention.linear_proj.{s}")
        for s in _suffixes(config.mlp_bias):
            fc1 = take(m + f"mlp.linear_fc1.{s}")
            if fc1.shape[0] != 2 * inter:
                raise InvalidArgumentError(f"{m}mlp.linear_fc1.{s} has {fc1.shape[0]} rows, the config needs "
                                           f"2 x intermediate_size = {2 * inter}")
            out[h + f"mlp.gate_proj.{s}"], out[h + f"mlp.up_proj.{s}"] = fc1[:inter], fc1[inter:]
            out[h + f"mlp.down_proj.{s}"] = take(m + f"mlp.linear_fc2.{s}")
        out[h + "input_layernorm.weight"] = take(m + attn_norm)
        out[h + "post_attention_layernorm.weight"] = take(m + mlp_norm)
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")
    else:
        # A GPTModel that shares embeddings has no output_layer.weight on its first pipeline stage.
        take.used.add("output_layer.weight")
    take.check_all_taken("this config has no HF weight for")
    return out
