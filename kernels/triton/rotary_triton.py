"""Triton rotary embedding (rotate-half / NeoX layout), in place on q and k.

q ``[tokens, Hq, D]`` and k ``[tokens, Hk, D]`` have free token and head strides and D contiguous, so
they may be (disjoint) head slices of one fused qkv projection output. The angle of token t and pair
i is ``float32(positions[t]) * inv_freq[i]``, computed in the kernel: no per-step cos/sin tensors, and
every rope variant (plain, linear, llama3, LongRoPE) works because its scaling lives in ``inv_freq``
(and LongRoPE's attention factor in ``scale``, which multiplies cos and sin).

Decisions: docs/design/kernels.md, ``pagedray.kernels.triton.rotary_triton``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, token, first_head, num_heads, half, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    # cos, sin [1, BLOCK_HALF] float32 (already rounded to the tensor dtype)
    h = first_head + tl.arange(0, BLOCK_H)[:, None]                              # [BLOCK_H, 1]
    i = tl.arange(0, BLOCK_HALF)[None, :]                                         # [1, BLOCK_HALF]
    mask = (h < num_heads) & (i < half)
    first = ptr + token * stride_t + h * stride_h + i                             # [BLOCK_H, BLOCK_HALF]
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + half, mask=mask, other=0.0)
    dtype = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    x1_cos, x2_sin = (x1 * cos).to(dtype).to(tl.float32), (x2 * sin).to(dtype).to(tl.float32)
    x2_cos, x1_sin = (x2 * cos).to(dtype).to(tl.float32), (x1 * sin).to(dtype).to(tl.float32)
    tl.store(first, (x1_cos - x2_sin).to(dtype), mask=mask)
    tl.store(first + half, (x2_cos + x1_sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, inv_freq_ptr, scale,
    stride_qt, stride_qh, stride_kt, stride_kh,
    num_q_heads, num_k_heads, half,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    q_groups = tl.cdiv(num_q_heads, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)[None, :]                                         # [1, BLOCK_HALF]
    angle = tl.load(pos_ptr + token).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i < half, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos = (tl.cos(angle) * scale).to(dtype).to(tl.float32)
    sin = (tl.sin(angle) * scale).to(dtype).to(tl.float32)
    if group < q_groups:
        _rotate_heads(q_ptr, stride_qt, stride_qh, token, group * BLOCK_H, num_q_heads, half, cos, sin,
                      BLOCK_H, BLOCK_HALF)
    else:
        _rotate_heads(k_ptr, stride_kt, stride_kh, token, (group - q_groups) * BLOCK_H, num_k_heads, half,
                      cos, sin, BLOCK_H, BLOCK_HALF)


def rotary_config(num_heads: int, head_dim: int) -> dict:
    """Half-row tiles ``[BLOCK_H, BLOCK_HALF]`` of <= 2048 elements (both halves: 4096) and about eight
    elements per thread and tile."""
    block_half = triton.next_power_of_2(head_dim // 2)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_half))
    return dict(BLOCK_H=block_h, BLOCK_HALF=block_half, num_warps=max(1, min(8, block_h * block_half // 256)))


def rotary_embedding_triton(q, k, positions, inv_freq, scale: float = 1.0) -> None:
    """q [tokens, Hq, D], k [tokens, Hk, D] (D even, contiguous) rotated in place; positions [tokens]
    int32/int64; inv_freq [D / 2] float32 contiguous; cos and sin are multiplied by ``scale`` (LongRoPE's
    attention factor) in float32 before they are rounded to the dtype."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    cfg = rotary_config(max(num_q_heads, num_k_heads, 1), head_dim)
    groups = triton.cdiv(num_q_heads, cfg["BLOCK_H"]) + triton.cdiv(num_k_heads, cfg["BLOCK_H"])
    if num_tokens == 0 or groups == 0:
        return
    _rotary_kernel[(num_tokens, groups)](
        q, k, positions, inv_freq, float(scale),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        num_q_heads, num_k_heads, head_dim // 2, enable_fp_fusion=False, **cfg,
    )
