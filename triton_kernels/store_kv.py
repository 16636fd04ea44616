"""store_kv: scatter new K/V rows into the paged cache by slot mapping."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from april_ext.triton_kernels._tile import check_launchable
from april_ext.triton_kernels._validation import check_store


@triton.jit
def _store_kv_kernel(
    K, V, K_CACHE, V_CACHE, SLOTS,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + token).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask = (offs_h[:, None] < KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    k = tl.load(K + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=mask)
    v = tl.load(V + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=mask)
    tl.store(K_CACHE + page * stride_kcp + offset * stride_kcs + offs_h[:, None] * stride_kch
             + offs_d[None, :] * stride_kcd, k, mask=mask)
    tl.store(V_CACHE + page * stride_vcp + offset * stride_vcs + offs_h[:, None] * stride_vch
             + offs_d[None, :] * stride_vcd, v, mask=mask)


@torch.library.custom_op("april_ext::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    """The launch as the torch op april_ext::store_kv (writes k_cache / v_cache in place), which
    torch.compile and graph capture see. It trusts its arguments: store_kv validates them first."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, H_PAD=triton.next_power_of_2(kv_heads),
        D_PAD=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1],
        num_warps=4 if kv_heads * head_dim >= 1024 else 2,
    )


@store_kv_op.register_fake
def _store_kv_fake(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    return None


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, check_indices: bool = True) -> None:
    """Writes k[t], v[t] ([T, Hkv, D]) to cache slot slot_mapping[t] = page * page_size + offset.

    k_cache / v_cache are [pages, page_size, Hkv, D] and are updated in place; slot -1 skips a token.
    Slots must be distinct (apart from -1) and inside the cache; check_indices=False skips checking
    that (and its host synchronization) for a caller that guarantees it.
    """
    check_store(k, v, k_cache, v_cache, slot_mapping, check_indices)
    check_launchable(_store_kv_kernel, k.device.type)
    store_kv_op(k, v, k_cache, v_cache, slot_mapping)
