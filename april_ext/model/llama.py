"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA, optional tied embeddings and q/k/v biases, Qwen3's
per-head q/k RMSNorm, Qwen3-MoE's routed experts).

Parameter names equal Hugging Face's LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM /
Qwen3MoeForCausalLM, so their state dicts load as is. The same modules serve the trainer (full-sequence
causal forward, differentiable) and the rollout engine (paged KV through an AttentionBackend), so both run the same math.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from april_ext.errors import InvalidArgumentError
from april_ext.model.attention import AttentionBackend, CausalAttention
from april_ext.model.config import ModelConfig
from april_ext.model.mlp import MLP, SparseMoeBlock


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and scale in the input dtype, as Hugging Face does.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] of the rotary embedding for the config's rope type."""
    dim = config.head_dim
    assert dim is not None
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if config.rope_type == "linear":
        return inv_freq / scaling["factor"]
    if config.rope_type == "llama3":
        # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
        smooth = (context / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= context / high) & (wavelen <= context / low)
        return torch.where(in_band, blended, scaled)
    return inv_freq


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        assert config.head_dim is not None and config.num_key_value_heads is not None
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attention(self.layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer)
        self.mlp: nn.Module = SparseMoeBlock(config) if config.is_moe_layer(layer) else \
            MLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """The transformer body (HF name prefix `model.`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder with a language-model head. Construct, then `init_weights(seed)` or load weights.

    Training: `model(input_ids)` with [B, T] ids (or packed [T] ids plus `cu_seqlens`) returns logits
    ([B, T, V] or [T, V]) under causal attention. Serving: `hidden_states(ids, positions, backend)` then
    `compute_logits` on the rows that need them.
    """

    def __init__(self, config: ModelConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.config = config
        with torch.device(device or "cpu"):
            self.model = DecoderModel(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.to(dtype=dtype or config.torch_dtype)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain float32 tensor rather than a buffer, so `.to(dtype)` cannot round the frequencies.
        self._inv_freq = {torch.device("cpu"): rope_inv_freq(config)}

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Normal(0, initializer_range) for matrices and embeddings, zero biases, unit norms."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(0 if seed is None else seed)
        std = self.config.initializer_range
        for name, param in self.named_parameters():
            if name.endswith(("layernorm.weight", "_norm.weight")) or name == "model.norm.weight":
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * std
                param.copy_(values)

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq.get(positions.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[positions.device] = self._inv_freq[torch.device("cpu")].to(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attention: AttentionBackend) -> torch.Tensor:
        """Final-normed hidden states [N, hidden] of the flat token run `input_ids` [N]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, attention)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(self, input_ids: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits under causal attention. input_ids [B, T] -> [B, T, V]; packed [T] -> [T, V].

        For packed input, `cu_seqlens` [S + 1] delimits the sequences (default: one sequence) and
        positions restart at 0 in each unless given.
        """
        if input_ids.dim() == 2:
            if cu_seqlens is not None:
                raise InvalidArgumentError("cu_seqlens is only accepted with packed 1-D input_ids")
            b, t = input_ids.shape
            flat = self.forward(input_ids.reshape(-1),
                                cu_seqlens=torch.arange(b + 1, device=input_ids.device) * t,
                                positions=None if positions is None else positions.reshape(-1))
            return flat.view(b, t, -1)
        if input_ids.dim() != 1 or input_ids.numel() == 0:
            raise InvalidArgumentError(
                f"input_ids must be a non-empty [B, T] or packed [T] tensor, got shape {tuple(input_ids.shape)}")
        n = input_ids.numel()
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, n], device=input_ids.device)
        if int(cu_seqlens[-1]) != n:
            raise InvalidArgumentError(f"cu_seqlens must end at len(input_ids) = {n}, got {int(cu_seqlens[-1])}")
        attention = CausalAttention(cu_seqlens)
        if positions is None:
            positions = torch.cat([torch.arange(length, device=input_ids.device) for length in attention.lengths])
        elif positions.shape != input_ids.shape:
            raise InvalidArgumentError(
                f"positions must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(positions.shape)}")
        return self.compute_logits(self.hidden_states(input_ids, positions, attention))

    def weight_names(self) -> list[str]:
        """The checkpoint names this model reads (tied models have no lm_head.weight)."""
        return [name for name, _ in self.named_parameters()]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, require_all: bool = True,
                     atomic: bool = True) -> list[str]:
        """Copies named tensors into the existing parameters in place (their storage, e.g. an allocator
        region, is kept); a tied model ignores `lm_head.weight`. Returns the names loaded. ``atomic``:
        validates every name, shape and value (finite) before copying anything (holding every tensor of ``weights`` until
        then); otherwise each tensor is validated and copied as it is read, so a stream is held one tensor at
        a time, and an error leaves the tensors before it copied (the message says how many)."""
        params = dict(self.named_parameters())
        staged: dict[str, torch.Tensor] = {}
        copied: list[str] = []
        try:
            for name, tensor in weights:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                if name not in params:
                    raise InvalidArgumentError(
                        f"weight {name!r} is not a parameter of this model (expected names like "
                        f"'model.layers.0.self_attn.q_proj.weight')")
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise InvalidArgumentError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model "
                                               f"expects {tuple(params[name].shape)}")
                # A diverged trainer's NaN / inf would load silently and the model then generates garbage.
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise InvalidArgumentError(f"weight {name!r} holds non-finite values (NaN or infinity); "
                                               "weights must be finite")
                if atomic:
                    staged[name] = tensor
                else:
                    params[name].copy_(tensor)
                    copied.append(name)
                del tensor
            if require_all:
                missing = sorted(set(params) - set(staged) - set(copied))
                if missing:
                    raise InvalidArgumentError(f"weights lack {len(missing)} parameters, e.g. {missing[:3]}")
        except InvalidArgumentError as err:
            if copied:
                raise InvalidArgumentError(f"{err} (a streamed load: the {len(copied)} tensors before it are "
                                           f"already copied)") from None
            raise
        for name, tensor in staged.items():
            params[name].copy_(tensor)
        return sorted(staged.keys() | set(copied))
