"""One online-softmax step over a tile of paged keys, shared by the decode and prefill kernels.

Query rows ``q [BLOCK_M, BLOCK_D]`` sit at absolute positions ``q_pos [BLOCK_M]``; the tile covers key
positions ``[n0, n0 + BLOCK_N)`` gathered through one sequence's block table (position ``n`` -> block
``table[n // BLOCK_SIZE]``, offset ``n % BLOCK_SIZE``), keys at or past ``kv_end`` are never loaded.
Scores are in base 2 (``scale_log2 = scale * log2(e)``, slopes pre-multiplied by log2(e)); with
``HAS_SOFTCAP`` the scaled score is first soft-capped, ``softcap * tanh(score / softcap)`` (Gemma 2). With
``MASKED`` the causal (``n <= q_pos``) and sliding-window (``n > q_pos - W``) masks are applied;
callers pass ``MASKED=False`` only for tiles they know are fully visible. A row with no visible key in
the tile keeps its state (guarded max), so fully masked tiles cannot produce NaN.

With ``QUANT`` (an 8-bit cache, ``kv_quant``) the codes go into the products as they are (int8 and
float8 e4m3 values are exact in bf16 / fp16 / fp32) and the row scales (``ks_base`` / ``vs_base``, strides
``stride_sb`` per block and ``stride_ss`` per slot) multiply what is smaller: a key's scale its column of
scores, a value's scale its column of probabilities before ``p @ V``. Scaling the ``[BLOCK_N, D]`` tiles
instead (dequantize first) ran at half the bf16 kernel's speed on an H200 (docs/gpu.md). With float16
queries the scaled probabilities are divided by the tile's largest value scale, which then multiplies the
tile's ``p @ V``: rows of small values (scales near float16's smallest) would otherwise round p x scale to
float16 subnormals (bf16 has float32's range and needs no such step).
"""

import triton
import triton.language as tl


@triton.jit
def attend_tile(q, m, l, acc, n0, k_base, v_base, table, q_pos, slope, kv_end,
                 stride_kb, stride_ks, stride_vb, stride_vs, sliding_window, scale_log2, softcap,
                 d, d_mask, ks_base, vs_base, stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 QUANT: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step over key positions [n0, n0 + BLOCK_N) -> updated (m, l, acc)."""
    n = n0 + tl.arange(0, BLOCK_N)                                               # [BLOCK_N]
    n_mask = n < kv_end
    blk = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    off = n % BLOCK_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :],
                mask=kv_mask, other=0.0)                                         # [BLOCK_N, BLOCK_D]
    if QUANT:
        k = k.to(q.dtype)                                                        # codes, exact
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if QUANT:
        s = s * tl.load(ks_base + blk * stride_sb + off * stride_ss, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:   # Gemma 2: cap * tanh(scale * s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1), then base 2
        x = s * (scale_log2 / 1.4426950408889634 / softcap)
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
    else:
        s = s * scale_log2                                                       # [BLOCK_M, BLOCK_N]
    if HAS_ALIBI:
        s += slope[:, None] * (n[None, :] - q_pos[:, None]).to(tl.float32)
    if MASKED:
        visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)                          # all-masked row guard
    alpha = tl.math.exp2(m - m_ref)
    p = tl.math.exp2(s - m_ref[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_base + blk[:, None] * stride_vb + off[:, None] * stride_vs + d[None, :],
                mask=kv_mask, other=0.0)
    v_max = 1.0
    if QUANT:
        v = v.to(q.dtype)
        v_scale = tl.load(vs_base + blk * stride_sb + off * stride_ss, mask=n_mask, other=0.0).to(tl.float32)
        if q.dtype == tl.float16:     # float16's range: p x scale in [0, 1] of the tile's largest scale
            v_max = tl.maximum(tl.max(v_scale, 0), 2.0 ** -24)
            v_scale = v_scale / v_max
        p = p * v_scale[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v) * v_max
    return m_new, l, acc


def scale_args(k_scale, v_scale, stand_in) -> tuple:
    """(k_scale, v_scale, block stride, slot stride) for an 8-bit cache's kernels; a stand-in pointer and
    zero strides without scales (the kernels then never read them)."""
    if k_scale is None:
        return stand_in, stand_in, 0, 0
    return k_scale, v_scale, k_scale.stride(0), k_scale.stride(1)
