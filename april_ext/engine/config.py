"""EngineConfig: the embedded rollout engine's settings, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from april_ext.errors import ConfigError
from april_ext.settings import MAX_SEED

_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Settings of the embedded engine.

    num_blocks x block_size is the KV capacity in tokens (shared by all running sequences).
    max_num_batched_tokens bounds the tokens of one step, hence the prefill chunk size.
    attention_backend: "auto" = Triton kernels on CUDA/ROCm and the PyTorch path on CPU; "triton"
    forces the kernels (on CPU they need TRITON_INTERPRET=1 and are slow); "torch" forces PyTorch.
    max_model_len: the longest prompt + response (default: the model's max_position_embeddings).
    seed: draws the seed of every request that brings none.
    memory_tag_prefix: prepended to the allocator tags "weights" and "kv_cache" (tags are
    process-wide: give engines sharing a process distinct prefixes to release them separately).
    weights_cpu_backup: keep a host copy of the weights while released (resume restores them).
    kv_cache_cpu_backup: keep a host copy of the KV cache while released, so running requests keep their
    K/V across a release (colocated `carry` runs); without it a release flushes the cache.
    """

    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    device: str = "cpu"
    attention_backend: str = "auto"
    prefix_caching: bool = True
    seed: int = 0
    weights_cpu_backup: bool = True
    kv_cache_cpu_backup: bool = False
    memory_tag_prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"EngineConfig.{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ConfigError(f"EngineConfig.max_model_len must be None or an integer >= 2, got {self.max_model_len!r}")
        if self.attention_backend not in _BACKENDS:
            raise ConfigError(
                f"EngineConfig.attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}")
        if not isinstance(self.memory_tag_prefix, str):
            raise ConfigError(f"EngineConfig.memory_tag_prefix must be a string, got {self.memory_tag_prefix!r}")
        for name in ("prefix_caching", "weights_cpu_backup", "kv_cache_cpu_backup"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"EngineConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or not 0 <= self.seed <= MAX_SEED:
            raise ConfigError(f"EngineConfig.seed must be an integer in [0, 2**63 - 1], got {self.seed!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError, ValueError):
            raise ConfigError(f"EngineConfig.device must be a torch device string such as 'cpu' or 'cuda:0', "
                              f"got {self.device!r}") from None
