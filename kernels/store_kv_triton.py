"""Triton kernel writing new keys/values into paged cache slots.

One program per token copies that token's ``[num_kv_heads, head_dim]`` rows of K and of V as one tile,
so each thread moves 16-byte vectors (``benchmarks/sm90_report.py`` checks the 128-bit loads and stores); warps are
sized to the tile. A negative slot means "skip" (padding tokens). Slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``; the cache may have any strides as long as head_dim is
contiguous. Duplicate non-negative slots in one call are undefined behaviour (last writer wins, in no
guaranteed order).
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
    block_size, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]                                     # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_D)[None, :]                                     # [1, BLOCK_D]
        mask = (h < num_heads) & (d < head_dim)
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask)        # [BLOCK_H, BLOCK_D]
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + block * stride_cb + offset * stride_cs + h * stride_ch + d, k, mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def store_kv_config(num_kv_heads: int, head_dim: int) -> dict:
    """Tile ``[BLOCK_H, BLOCK_D]`` and warps so that each thread holds about eight elements."""
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)))


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim]; caches [num_blocks, block_size, Hkv, head_dim]."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim, **store_kv_config(num_kv_heads, head_dim),
    )
