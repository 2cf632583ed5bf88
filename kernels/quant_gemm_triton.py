"""Triton GEMM over packed integer weights (GPTQ / AWQ 4-bit, 8-bit), dequantized tile by tile.

``y [M, N] = x [M, K] @ W^T`` with ``W^T [K, N]`` held as ``qweight`` int32 ``[K / per_word, N]`` (GPTQ's
layout: a word holds ``per_word = 32 / bits`` consecutive K rows, lowest bits first), zero points int32
``[groups, N]``, scales ``[groups, N]`` and ``g_idx`` int32 ``[K]`` (row -> group; ``row // group_size``
without activation order). A program computes one ``[BLOCK_M, BLOCK_N]`` tile: per ``BLOCK_K`` slice it
loads the words once, shifts out each row's codes, subtracts the zero points and multiplies by the scales
of each row's group (float32), casts to x's dtype and accumulates ``tl.dot`` in float32 (IEEE products
for float32 inputs). AWQ checkpoints are repacked to this layout at load (their words run along N).

What it is for: weights that stay 4 / 8 bits in device memory. Checked against ``quant_gemm_reference``
(dequantize, then ``F.linear``) under the interpreter; its speed against a dense bf16 GEMM is what
``benchmarks.quant_gemm`` measures on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quant_gemm_kernel(x_ptr, qw_ptr, zeros_ptr, scales_ptr, gidx_ptr, out_ptr, M, N, K,
                       stride_xm, stride_qk, stride_zg, stride_sg, stride_om,
                       BITS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)                     # [BLOCK_M]
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                     # [BLOCK_N]
    m_mask, n_mask = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)                                          # [BLOCK_K]
        k_mask = rk < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)           # [BLOCK_M, BLOCK_K]
        kn_mask = k_mask[:, None] & n_mask[None, :]
        words = tl.load(qw_ptr + (rk // PER_WORD)[:, None].to(tl.int64) * stride_qk + rn[None, :],
                        mask=kn_mask, other=0)                                   # [BLOCK_K, BLOCK_N] int32
        codes = (words >> ((rk % PER_WORD) * BITS)[:, None]) & MASK
        group = tl.load(gidx_ptr + rk, mask=k_mask, other=0).to(tl.int64)        # [BLOCK_K]
        zeros = tl.load(zeros_ptr + group[:, None] * stride_zg + rn[None, :], mask=kn_mask, other=0)
        scales = tl.load(scales_ptr + group[:, None] * stride_sg + rn[None, :], mask=kn_mask, other=0.0)
        w = ((codes - zeros).to(tl.float32) * scales.to(tl.float32)).to(x.dtype)   # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def quant_gemm_config(m: int) -> dict:
    """Tiles: 16 rows for decode-sized inputs, 64 beyond; 64 columns; 32-deep K slices."""
    return dict(BLOCK_M=16 if m <= 16 else 64, BLOCK_N=64, BLOCK_K=32, num_warps=4)


def quant_gemm_triton(x, qweight, zeros, scales, g_idx, bits: int) -> torch.Tensor:
    """x [M, K] (contiguous rows) -> [M, N] in x.dtype; the packed weight as the module docstring says."""
    m, k = x.shape
    n = qweight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = quant_gemm_config(m)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
    _quant_gemm_kernel[grid](x, qweight, zeros, scales, g_idx, out, m, n, k, x.stride(0), qweight.stride(0),
                             zeros.stride(0), scales.stride(0), out.stride(0), BITS=bits,
                             IEEE=x.dtype == torch.float32, **cfg)
    return out
