"""megatron-core GPTModel built from an april_ext ModelConfig, behind the packed-sequence forward of
april_ext.model.LlamaForCausalLM so the torch trainer's loss code drives it unchanged."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from april_ext.errors import ConfigError, InvalidArgumentError
from april_ext.model import ModelConfig
from april_ext.model.llama import rope_inv_freq
from april_ext.trainer.megatron import compat
from april_ext.trainer.megatron.conversion import hf_to_megatron, megatron_to_hf


def transformer_config(config: ModelConfig, *, params_dtype: torch.dtype = torch.float32) -> object:
    """The megatron-core TransformerConfig of a Llama-style ModelConfig (no dropout, no fused kernels,
    so the local layer spec runs anywhere). Qwen3's per-head q/k RMSNorm is ``qk_layernorm``; Qwen3-MoE's
    sparse layers are megatron-core MoE layers (see ``_moe_fields``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    biases = (config.qkv_bias, config.o_bias, config.mlp_bias)
    # Megatron has two switches: add_bias_linear (every linear, q/k/v included) and add_qkv_bias.
    if biases not in ((False, False, False), (True, False, False), (True, True, True)):
        raise ConfigError(f"ModelConfig biases (qkv_bias, o_bias, mlp_bias) = {biases} have no megatron-core "
                          f"equivalent; allowed: none, q/k/v only (Qwen2), or all three")
    return TransformerConfig(
        num_layers=config.num_hidden_layers,
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=config.o_bias,
        add_qkv_bias=config.qkv_bias,
        init_method_std=config.initializer_range,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        qk_layernorm=config.qk_norm,
        **_moe_fields(config),
    )


def _moe_fields(config: ModelConfig) -> dict[str, object]:
    """TransformerConfig fields of the experts. HF's router takes the softmax over all experts, then the
    top k, renormalised when norm_topk_prob; megatron's softmax router with pre_softmax=True is the first
    (softmax, then top k, no renormalisation), with pre_softmax=False it takes the top-k logits, then
    their softmax, which is the renormalised form. No token is dropped (no capacity factor), no expert
    bias, no auxiliary loss (it would change the training loss, not the logits)."""
    if config.num_experts == 0:
        return {}
    return {
        "num_moe_experts": config.num_experts,
        "moe_ffn_hidden_size": config.moe_intermediate_size,
        "moe_router_topk": config.num_experts_per_tok,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not config.norm_topk_prob,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_router_dtype": "fp32",
        # The all-gather dispatcher: the all-to-all one also needs CUDA streams and split sizes on the GPU.
        "moe_token_dispatcher_type": "allgather",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_layer_freq": [int(config.is_moe_layer(i)) for i in range(config.num_hidden_layers)],
    }


def _patch_moe_runtime() -> None:
    """Two stand-ins for megatron-core 0.16's router, applied once and only where they are needed (a
    small compatibility patch kept here, next to the only code that builds MoE layers):
    - ``moe_utils.te_general_gemm`` is imported only with Transformer Engine but read unconditionally by
      ``router_gating_linear`` (a NameError without TE, on any device): define it as None, the value
      megatron itself tests for.
    - ``Router.gating`` moves CPU router weights to ``torch.cuda.current_device()``, which raises on a
      CPU-only torch: on such a torch, the same gating without the move.
    """
    from megatron.core.transformer.moe import moe_utils, router

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if compat.cpu_patches_needed() and router.Router.gating is not _cpu_gating:
        router.Router.gating = _cpu_gating


def _cpu_gating(self: Any, input: torch.Tensor) -> torch.Tensor:
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
    return router_gating_linear(input, self.weight, self.bias, dtype)


def build_gpt_model(config: ModelConfig, *, params_dtype: torch.dtype = torch.float32, packed: bool = False,
                    pre_process: bool = True, post_process: bool = True, vocab_size: int | None = None,
                    **transformer_changes: object) -> nn.Module:
    """A GPTModel with the local (non-Transformer-Engine) layer specs, dense or MoE per layer. Needs
    ``parallel.initialize()``. packed: attention takes THD input (packed.PackedDotProductAttention);
    pre_process / post_process: this pipeline stage holds the embedding / the output layer; vocab_size:
    the embedding and output rows when padded past ``config.vocab_size``; transformer_changes:
    TransformerConfig fields (e.g. sequence_parallel) replaced after the mapping."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if config.num_experts:
        _patch_moe_runtime()
    transformer = dataclasses.replace(transformer_config(config, params_dtype=params_dtype), **transformer_changes)
    spec = get_gpt_decoder_block_spec(transformer, use_transformer_engine=False, normalization="RMSNorm")
    if packed:
        from april_ext.trainer.megatron.packed import packed_layer_spec

        spec = packed_layer_spec(spec, transformer)
    model = GPTModel(
        config=transformer,
        transformer_layer_spec=spec,
        pre_process=pre_process,
        post_process=post_process,
        vocab_size=vocab_size if vocab_size is not None else config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type="rope",
        rotary_base=int(config.rope_theta),
        share_embeddings_and_output_weights=config.tie_word_embeddings,
    )
    # Megatron knows only the default and a fixed-parameter llama3 scaling; our frequencies cover every
    # rope type of the config exactly. Set before the first forward (RotaryEmbedding caches its tables).
    model.rotary_pos_emb.inv_freq = rope_inv_freq(config)
    return model


def length_buckets(lengths: list[int], max_padding: float) -> list[list[int]]:
    """Groups sequence indices, longest first, into buckets whose right-padded size (bucket size x its
    longest length) stays within ``max_padding`` x their real tokens; a sequence alone always fits."""
    buckets: list[list[int]] = []
    width = real = 0
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        if buckets and width * (len(buckets[-1]) + 1) <= max_padding * (real + lengths[i]):
            buckets[-1].append(i)
            real += lengths[i]
        else:
            buckets.append([i])
            width = real = lengths[i]
    return buckets


class MegatronCausalLM(nn.Module):
    """A GPTModel with the forward of LlamaForCausalLM: packed [T] ids plus ``cu_seqlens`` -> [T, V] logits.

    Megatron's local attention takes no packed input, so the sequences are right-padded into [n, width]
    batches (causal attention keeps padding from reaching real tokens), one GPTModel call per bucket of
    similar lengths (``max_padding``: the padded / real token bound of a bucket), and the logits of the
    real tokens are put back in packed order. Weights go in and out in Hugging Face names through
    ``load_weights`` / ``hf_weights``.
    """

    max_padding = 1.25

    def __init__(self, config: ModelConfig, *, params_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.params_dtype = params_dtype
        self.gpt = build_gpt_model(config, params_dtype=params_dtype)

    def __deepcopy__(self, memo: dict[int, object]) -> MegatronCausalLM:
        """A new model with copied weights (the trainer's frozen KL reference). GPTModel holds process
        groups, which copy.deepcopy cannot copy, so the copy is rebuilt from the config instead."""
        clone = MegatronCausalLM(self.config, params_dtype=self.params_dtype)
        device = next(self.parameters()).device
        clone.to(device)
        with torch.no_grad():
            for mine, theirs in zip(self.gpt.parameters(), clone.gpt.parameters()):
                theirs.copy_(mine)
        clone.train(self.training)
        memo[id(self)] = clone
        return clone

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise InvalidArgumentError(f"input_ids must be a non-empty packed [T] tensor, got shape "
                                       f"{tuple(input_ids.shape)}")
        n, device = input_ids.numel(), input_ids.device
        cu = torch.tensor([0, n]) if cu_seqlens is None else cu_seqlens.to("cpu", torch.int64)
        lengths = cu.diff()
        if int(cu[0]) != 0 or int(cu[-1]) != n or bool((lengths < 1).any()):
            raise InvalidArgumentError(f"cu_seqlens must rise strictly from 0 to len(input_ids) = {n}, got "
                                       f"{cu.tolist()}")
        pieces, order = [], []
        for bucket in length_buckets(lengths.tolist(), self.max_padding):
            rows = lengths[bucket]
            columns = torch.arange(int(rows.max()))
            valid = columns[None, :] < rows[:, None]
            # Packed token index of every real cell of the [len(bucket), width] grid, row by row.
            index = (cu[bucket][:, None] + columns[None, :])[valid].to(device)
            valid = valid.to(device)
            ids = input_ids.new_zeros(valid.shape)
            ids[valid] = input_ids[index]
            positions = columns.to(device).expand(valid.shape)
            pieces.append(self.gpt(ids, positions, attention_mask=None)[valid])
            order.append(index)
        logits = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        return logits[torch.argsort(torch.cat(order))]

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """The current weights in HF names (views or fresh tensors built from the parameters, detached)."""
        state = {name: p.detach() for name, p in self.gpt.named_parameters()}
        return megatron_to_hf(state, self.config)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copies HF-named weights into the parameters in place (their storage is kept); every parameter
        must be given. Returns the Megatron names loaded."""
        converted = hf_to_megatron(weights, self.config)
        params = dict(self.gpt.named_parameters())
        missing = sorted(set(params) - set(converted))
        extra = sorted(set(converted) - set(params))
        if missing or extra:
            raise InvalidArgumentError(f"converted weights do not match the GPTModel: missing {missing[:3]}, "
                                       f"unexpected {extra[:3]}")
        for name, tensor in converted.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise InvalidArgumentError(f"weight for {name!r} has shape {tuple(tensor.shape)}, the GPTModel "
                                           f"expects {tuple(params[name].shape)}")
        for name, tensor in converted.items():
            params[name].copy_(tensor)
        return sorted(converted)
