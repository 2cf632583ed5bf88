"""Triton kernel writing new keys/values into paged cache slots.

One program per token copies that token's ``[num_kv_heads, head_dim]`` rows of K and of V as one tile,
so each thread moves 16-byte vectors (``benchmarks/sm90_report.py`` checks the 128-bit loads and stores); warps are
sized to the tile. A negative slot means "skip" (padding tokens). Slot ``s`` lives at block
``s // block_size``, offset ``s % block_size``; the cache may have any strides as long as head_dim is
contiguous. Duplicate non-negative slots in one call are undefined behaviour (last writer wins, in no
guaranteed order).

An 8-bit cache (``QUANT`` 1 = int8, 2 = float8 e4m3) gets each row quantized as ``kv_quant`` defines it,
its float16 scale stored into ``k_scale`` / ``v_scale`` (contiguous ``[num_blocks, block_size, Hkv]``);
the division is IEEE (``div_rn``) as torch's. float8 rounding is the GPU's (nearest even, as torch's);
the CPU interpreter rounds float8 differently, so its tests allow one float8 step. With ``STATIC`` (a
checkpoint's K / V scales, ``kv_quant.static_scale``'s values) every row takes those scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_quant import QMAX, SCALE_MAX, SCALE_MIN

QUANT_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}


@triton.jit
def _quantize_rows(x, static, QUANT: tl.constexpr, QMAX_: tl.constexpr, SMIN: tl.constexpr, SMAX: tl.constexpr,
                   STATIC: tl.constexpr):
    """x [BLOCK_H, BLOCK_D] (zeros outside the rows) -> (codes, float16 scales [BLOCK_H]); ``STATIC``: every
    row's scale is ``static``."""
    xf = x.to(tl.float32)
    amax = tl.max(tl.abs(xf), axis=1)
    if STATIC:
        scale = tl.full(amax.shape, static, tl.float32)
    else:
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX_, tl.float32)).to(tl.float16).to(tl.float32)
        scale = tl.minimum(tl.maximum(scale, SMIN), SMAX)
    y = tl.math.div_rn(xf, tl.broadcast_to(scale[:, None], xf.shape))
    if QUANT == 1:
        codes = tl.minimum(tl.maximum(tl.floor(y + 0.5), -127.0), 127.0).to(tl.int8)
    else:
        codes = tl.minimum(tl.maximum(y, -448.0), 448.0).to(tl.float8e4nv)
    return codes, scale.to(tl.float16)


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr, k_static, v_static,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    stride_vcb, stride_vcs, stride_vch,
    block_size, num_heads, head_dim,
    QUANT: tl.constexpr, QMAX_: tl.constexpr, SMIN: tl.constexpr, SMAX: tl.constexpr, STATIC: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)        # token * stride passes 2^31 in a call of > 2M tokens x 1,024
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        block = slot // block_size
        offset = slot % block_size
        h = tl.arange(0, BLOCK_H)[:, None]                                     # [BLOCK_H, 1]
        d = tl.arange(0, BLOCK_D)[None, :]                                     # [1, BLOCK_D]
        mask = (h < num_heads) & (d < head_dim)
        k = tl.load(key_ptr + token * stride_kt + h * stride_kh + d, mask=mask, other=0.0)   # [BLOCK_H, BLOCK_D]
        v = tl.load(value_ptr + token * stride_vt + h * stride_vh + d, mask=mask, other=0.0)
        if QUANT != 0:
            k, k_scale = _quantize_rows(k, k_static, QUANT, QMAX_, SMIN, SMAX, STATIC)
            v, v_scale = _quantize_rows(v, v_static, QUANT, QMAX_, SMIN, SMAX, STATIC)
            row = slot * num_heads + tl.arange(0, BLOCK_H)                      # [BLOCK_H] scale index
            tl.store(k_scale_ptr + row, k_scale, mask=tl.arange(0, BLOCK_H) < num_heads)
            tl.store(v_scale_ptr + row, v_scale, mask=tl.arange(0, BLOCK_H) < num_heads)
        tl.store(k_cache_ptr + block * stride_cb + offset * stride_cs + h * stride_ch + d, k, mask=mask)
        tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


def store_kv_config(num_kv_heads: int, head_dim: int) -> dict:
    """Tile ``[BLOCK_H, BLOCK_D]`` and warps so that each thread holds about eight elements."""
    block_h, block_d = triton.next_power_of_2(num_kv_heads), triton.next_power_of_2(head_dim)
    return dict(BLOCK_H=block_h, BLOCK_D=block_d, num_warps=max(1, min(8, block_h * block_d // 256)))


def store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None,
                    static_scales=None) -> None:
    """key/value [num_tokens, num_kv_heads, head_dim]; caches [num_blocks, block_size, Hkv, head_dim]
    (with an 8-bit cache, k_scale / v_scale [num_blocks, block_size, Hkv] float16, contiguous;
    ``static_scales`` (k, v): a checkpoint's scales for every row)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    quant = QUANT_CODES.get(k_cache.dtype, 0)
    _store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if quant else slot_mapping, v_scale if quant else slot_mapping, *(static_scales or (1.0, 1.0)),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_cache.shape[1], num_kv_heads, head_dim, QUANT=quant, QMAX_=QMAX.get(k_cache.dtype, 1.0),
        SMIN=SCALE_MIN, SMAX=SCALE_MAX, STATIC=static_scales is not None, **store_kv_config(num_kv_heads, head_dim),
    )
