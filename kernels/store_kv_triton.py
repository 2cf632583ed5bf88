"""Triton kernel writing new keys/values into paged cache slots.

One program per (token, KV head) copies one head_dim row of K and of V. A negative slot means "skip"
(padding tokens). Slot ``s`` lives at block ``s // block_size``, offset ``s % block_size``; the cache
may have any strides as long as head_dim is contiguous. Duplicate non-negative slots in one call are
undefined behaviour (last writer wins, in no guaranteed order).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_vcb, stride_vcs, stride_vch,
    block_size, head_dim,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        d = tl.arange(0, BLOCK_D)
        d_mask = d < head_dim
        k = tl.load(key_ptr + token * stride_kt + head * stride_kh + d, mask=d_mask)
        v = tl.load(value_ptr + token * stride_vt + head * stride_vh + d, mask=d_mask)
        k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + head * stride_ch + d
        v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + head * stride_vch + d
        tl.store(k_dst, k, mask=d_mask)
        tl.store(v_dst, v, mask=d_mask)


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim]; caches [num_blocks, block_size, Hkv, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    grid = (num_tokens, num_kv_heads)
    _store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
