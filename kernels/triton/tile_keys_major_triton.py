"""One online-softmax step of paged decode in keys-major form: scores as ``K @ q^T`` ([keys, query heads]).

The decode kernel (``decode_triton``) multiplies a KV head's query rows, padded to 16 for ``tl.dot``, by a tile
of keys: with 4 query heads per KV head, 12 of its 16 rows of scores are padding, and the online softmax
(scale, maxima, exponentials, sums, the conversion of the probabilities) runs over all 16. Here the keys are
the products' long side and the query heads the short one, padded to ``BLOCK_G`` = 8 (``tl.dot`` takes 8
columns): half the softmax's elements and half the products' padding (Triton 3.9 compiles the 128-key,
4-warp products for sm_90 as wgmma, 3.6 as mma.sync). ``acc`` holds the output transposed, [head_dim, query
heads], and ``p^T @ V`` is computed as ``V^T @ p``. Scores, masks, soft-capping, ALiBi, 8-bit codes and their row scales
follow ``tile_triton.attend_tile``, transposed, with two changes that take sm_90 instructions out of the loop:

* the softmax's sums stay per key slot, ``l`` [BLOCK_N, BLOCK_G] (one multiply-add an element a trip), and are
  added across keys once after the loop (``decode_triton._attend_range``) instead of across lanes and warps
  every trip;
* int8 codes going into float16 products (fp16 queries, or ``F16_MATH``) are converted biased, code + 1152
  (``tile_triton.INT8_TO_F16_BIASED``: no subtraction), and the bias's share leaves each product:
  ``(K + 1152) @ q^T`` minus ``k_bias`` = 1152 x each query column's sum, ``(V + 1152)^T @ p`` minus 1152 x the
  sum of the float16 probabilities it multiplied. The same values in exact arithmetic; float32 rounds the
  biased sums, up to 1152 / |code| times the plain ones, so about 2^-24 x that relative to the result: far
  below the codes' own step (1/254 of a row's largest). Under Triton 3.6 the int8 loop (128 keys, 4 warps,
  ``F16_MATH``) issues 22.3 warp instructions per key for sm_90 against 25.7 (fp8, from the first change
  alone: 18.9 against 19.7; docs/gpu.md).

The decode kernel runs it under its ``KEYS_MAJOR`` constant (``decode_triton._attend_range``): the default for
an 8-bit cache on CUDA with bf16 queries (``decode_config``: up to 8 query heads per KV head, head_dim <= 128,
64-key tiles, 2 warps, bf16 products), which on an H100 at batch 64, 8k ran int8 1.66x and fp8 1.68x the bf16
cache's decode (docs/gpu.md, 2026-11-27). Its float16 products (``F16_MATH``, the biased int8 codes) passed
the ``-m gpu`` tests there but ran slower (1.52x / 1.62x), despite fewer instructions per key.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tile_triton import INT8_BIAS, base2_scores, codes_to, per_key, tile_slots, value_codes


@triton.jit
def attend_keys_major(qt, m, l, acc, n0, k_base, v_base, table, q_pos, slope, kv_end,
                      stride_kb, stride_ks, stride_vb, stride_vs, scale_log2, softcap, d, d_mask,
                      ks_base, vs_base, stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                      HAS_ALIBI: tl.constexpr, IEEE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, QUANT: tl.constexpr,
                      BLOCK_N: tl.constexpr, K_CVT: tl.constexpr = 0, V_CVT: tl.constexpr = 0,
                      FULL: tl.constexpr = False, k_bias=0.0, BIASED: tl.constexpr = False):
    """``tile_triton.attend_tile`` transposed, for decode: queries ``qt [BLOCK_D, BLOCK_G]``, state ``m`` [BLOCK_G],
    ``l`` [BLOCK_N, BLOCK_G] (sums per key slot) and ``acc`` [BLOCK_D, BLOCK_G]; ``scale_log2`` a scalar or a row [1,
    BLOCK_G]; every query at ``q_pos`` [BLOCK_G] (the sequence's last token), so ``MASKED`` applies ``n < kv_end``
    and causality only (the decode kernel starts at the window's first key). ``BIASED``: int8 codes into float16
    products as code + 1152, ``k_bias`` [1, BLOCK_G] = 1152 x the sum of each query column (module docstring)."""
    n, n_mask, blk, off, kv_mask = tile_slots(n0, table, kv_end, d_mask, BLOCK_SIZE, BLOCK_N, FULL)
    k = tl.load(k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :],
                mask=kv_mask, other=0.0)                                         # [BLOCK_N, BLOCK_D]
    if QUANT:
        k = codes_to(k, qt.dtype, K_CVT, BIASED)                                 # codes (+ 1152), exact
    if IEEE:
        s = tl.dot(k, qt, input_precision="ieee")                                # [BLOCK_N, BLOCK_G]
    else:
        s = tl.dot(k, qt)
    if BIASED:
        s = s - k_bias
    if QUANT:
        s = s * per_key(ks_base + blk * stride_sb + off * stride_ss, n_mask, FULL).to(tl.float32)[:, None]
    s = base2_scores(s, scale_log2, softcap, HAS_SOFTCAP)
    if HAS_ALIBI:
        s += slope[None, :] * (n[:, None] - q_pos[None, :]).to(tl.float32)
    if MASKED:
        s = tl.where(n_mask[:, None] & (n[:, None] <= q_pos[None, :]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 0))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)                          # all-masked column guard
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(s - m_ref[None, :])                                         # [BLOCK_N, BLOCK_G]
    l = l * alpha[None, :] + p
    v = tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :],
                mask=kv_mask, other=0.0)                                         # [BLOCK_N, BLOCK_D]
    v_max = 1.0
    if QUANT:
        v, v_scale, v_max = value_codes(v, vs_base + blk * stride_sb + off * stride_ss, n_mask, qt.dtype, V_CVT,
                                        FULL, BIASED)
        p = p * v_scale[:, None]
    if IEEE:
        acc = acc * alpha[None, :] + tl.dot(tl.trans(v), p.to(v.dtype), input_precision="ieee")
    else:
        p = p.to(v.dtype)
        pv = tl.dot(tl.trans(v), p)                                              # [BLOCK_D, BLOCK_G]
        if BIASED:
            pv -= INT8_BIAS * tl.sum(p.to(tl.float32), 0)[None, :]
        acc = acc * alpha[None, :] + pv * v_max
    return m_new, l, acc
