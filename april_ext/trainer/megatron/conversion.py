"""Weight conversion between Hugging Face (Llama / Qwen2 / Mistral / Qwen3 / Qwen3-MoE) names and megatron-core
GPTModel names.

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
- Qwen3's per-head q/k norms: ``self_attention.q_layernorm`` / ``k_layernorm`` (both layouts).
- Qwen3-MoE's sparse layers: the router ``mlp.router`` (HF ``mlp.gate``), expert e's SwiGLU as
  ``mlp.experts.local_experts.{e}.linear_fc1`` (``[gate_proj; up_proj]``) and ``linear_fc2``, the
  names of megatron-core's SequentialMLP (``moe_grouped_gemm=False``; the grouped-GEMM names are not
  handled). The norm before the experts stays ``pre_mlp_layernorm`` in both layouts (Transformer
  Engine's MoE layer spec does not fold it either).

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

# The norm before a MoE layer's experts: a module of its own in both layouts.
_MOE_NORM = "pre_mlp_layernorm.weight"


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


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig, *,
             groups: int | None = None) -> torch.Tensor:
    """HF q/k/v projections (weights [out, in] or biases [out]) -> Megatron's per-group interleaved linear_qkv.
    ``groups``: how many consecutive query groups q, k and v hold (a tensor-parallel rank's share; all
    by default)."""
    all_groups, per_group, dim = _dims(config)
    groups = all_groups if groups is None else groups
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


def _mlp_to_megatron(out: dict[str, torch.Tensor], take: _Source, hf: str, mg: str, *, bias: bool) -> None:
    """One SwiGLU MLP (HF prefix `hf`) into linear_fc1 = [gate_proj; up_proj] and linear_fc2 (prefix `mg`)."""
    for s in _suffixes(bias):
        out[mg + f"linear_fc1.{s}"] = torch.cat((take(hf + f"gate_proj.{s}"), take(hf + f"up_proj.{s}")), dim=0)
        out[mg + f"linear_fc2.{s}"] = take(hf + f"down_proj.{s}")


def _mlp_to_hf(out: dict[str, torch.Tensor], take: _Source, mg: str, hf: str, *, bias: bool, width: int,
               width_name: str) -> None:
    """The inverse of _mlp_to_megatron; `width` is the MLP's intermediate size (named `width_name`)."""
    for s in _suffixes(bias):
        fc1 = take(mg + f"linear_fc1.{s}")
        if fc1.shape[0] != 2 * width:
            raise InvalidArgumentError(f"{mg}linear_fc1.{s} has {fc1.shape[0]} rows, the config needs "
                                       f"2 x {width_name} = {2 * width}")
        out[hf + f"gate_proj.{s}"], out[hf + f"up_proj.{s}"] = fc1[:width], fc1[width:]
        out[hf + f"down_proj.{s}"] = take(mg + f"linear_fc2.{s}")


def _renamed(config: ModelConfig, moe: bool) -> list[tuple[str, str]]:
    """The tensors of one layer that only change name between the layouts, as (HF, Megatron) names under
    the layer prefixes, in the order both directions write them."""
    pairs = [(f"self_attn.o_proj.{s}", f"self_attention.linear_proj.{s}") for s in _suffixes(config.o_bias)]
    if config.qk_norm:
        pairs += [("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                  ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight")]
    if moe:
        pairs.append(("mlp.gate.weight", "mlp.router.weight"))
    return pairs


def hf_names(config: ModelConfig) -> set[str]:
    """The HF names ``hf_to_megatron`` takes for ``config`` (``lm_head.weight`` only when untied)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not config.tie_word_embeddings
                                                                    else set())
    for i in range(config.num_hidden_layers):
        h, moe = f"model.layers.{i}.", config.is_moe_layer(i)
        names |= {h + "input_layernorm.weight", h + "post_attention_layernorm.weight"}
        names |= {h + f"self_attn.{p}_proj.{s}" for p in "qkv" for s in _suffixes(config.qkv_bias)}
        names |= {h + hf for hf, _ in _renamed(config, moe)}
        mlps = [h + f"mlp.experts.{e}." for e in range(config.num_experts)] if moe else [h + "mlp."]
        bias = config.mlp_bias and not moe
        names |= {m + f"{p}_proj.{s}" for m in mlps for p in ("gate", "up", "down") for s in _suffixes(bias)}
    return names


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
        moe = config.is_moe_layer(i)
        out[m + attn_norm] = take(h + "input_layernorm.weight")
        out[m + (_MOE_NORM if moe else mlp_norm)] = take(h + "post_attention_layernorm.weight")
        for s in _suffixes(config.qkv_bias):
            out[m + f"self_attention.linear_qkv.{s}"] = fuse_qkv(
                take(h + f"self_attn.q_proj.{s}"), take(h + f"self_attn.k_proj.{s}"),
                take(h + f"self_attn.v_proj.{s}"), config)
        for hf_name, mg_name in _renamed(config, moe):
            out[m + mg_name] = take(h + hf_name)
        if moe:
            for e in range(config.num_experts):
                _mlp_to_megatron(out, take, h + f"mlp.experts.{e}.", m + f"mlp.experts.local_experts.{e}.",
                                 bias=False)
        else:
            _mlp_to_megatron(out, take, h + "mlp.", m + "mlp.", bias=config.mlp_bias)
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
    for i in range(config.num_hidden_layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        moe = config.is_moe_layer(i)
        for s in _suffixes(config.qkv_bias):
            q, k, v = split_qkv(take(m + f"self_attention.linear_qkv.{s}"), config)
            out[h + f"self_attn.q_proj.{s}"], out[h + f"self_attn.k_proj.{s}"] = q, k
            out[h + f"self_attn.v_proj.{s}"] = v
        for hf_name, mg_name in _renamed(config, moe):
            out[h + hf_name] = take(m + mg_name)
        if moe:
            for e in range(config.num_experts):
                _mlp_to_hf(out, take, m + f"mlp.experts.local_experts.{e}.", h + f"mlp.experts.{e}.",
                           bias=False, width=config.moe_intermediate_size, width_name="moe_intermediate_size")
        else:
            _mlp_to_hf(out, take, m + "mlp.", h + "mlp.", bias=config.mlp_bias, width=config.intermediate_size,
                       width_name="intermediate_size")
        out[h + "input_layernorm.weight"] = take(m + attn_norm)
        out[h + "post_attention_layernorm.weight"] = take(m + (_MOE_NORM if moe else mlp_norm))
    out["model.norm.weight"] = take("decoder.final_layernorm.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")
    else:
        # A GPTModel that shares embeddings has no output_layer.weight on its first pipeline stage.
        take.used.add("output_layer.weight")
    take.check_all_taken("this config has no HF weight for")
    return out
