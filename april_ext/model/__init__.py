"""The Llama-style model shared by the embedded engine and the embedded trainer."""

from __future__ import annotations

from april_ext.model.attention import AttentionBackend, CausalAttention
from april_ext.model.checkpoint import iter_safetensors, load_pretrained, save_pretrained
from april_ext.model.config import ModelConfig
from april_ext.model.llama import LlamaForCausalLM

__all__ = [
    "AttentionBackend",
    "CausalAttention",
    "LlamaForCausalLM",
    "ModelConfig",
    "iter_safetensors",
    "load_pretrained",
    "save_pretrained",
]
