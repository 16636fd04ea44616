"""Triton paged-attention kernels for resumed prefill and decode, with plain PyTorch references.

On CPU the kernels run under the Triton interpreter, which must be enabled (TRITON_INTERPRET=1)
before this package is imported; the *_reference functions run anywhere.
"""

from __future__ import annotations

from april_ext.triton_kernels.config import BlockConfig, generation
from april_ext.triton_kernels.decode_attention import decode_attention
from april_ext.triton_kernels.extend_attention import extend_attention
from april_ext.triton_kernels.reference import (
    decode_attention_reference,
    extend_attention_reference,
    store_kv_reference,
)
from april_ext.triton_kernels.store_kv import store_kv

__all__ = [
    "BlockConfig",
    "decode_attention",
    "decode_attention_reference",
    "extend_attention",
    "extend_attention_reference",
    "generation",
    "store_kv",
    "store_kv_reference",
]
