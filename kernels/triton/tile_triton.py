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
instead (dequantize first) ran at half the bf16 kernel's speed on an H200 in decode (docs/gpu.md), where a
tile serves 16 rows of scores; prefill tiles serve 64-256 rows, and there ``SCALE_ROWS`` (bf16 / fp32
queries) dequantizes first: the sm_90 loop took 808 instructions a trip against 1,231, most of the
difference the per-key scale loads each thread made for its own columns of scores. With float16
queries the scaled probabilities are divided by the tile's largest value scale, which then multiplies the
tile's ``p @ V``: rows of small values (scales near float16's smallest) would otherwise round p x scale to
float16 subnormals (bf16 has float32's range and needs no such step). ``K_CVT`` / ``V_CVT`` pick how the
codes become the query's dtype (``codes_to``). ``scale_log2`` is a scalar or a column ``[BLOCK_M, 1]`` (one
scale per query row: ``queries_in_f16``).
"""

import triton
import triton.language as tl

# Exact 8-bit code -> 16-bit conversions, four codes (one 32-bit register of bytes) per asm instance, with
# integer and add / multiply instructions instead of the conversion unit's (CUDA only; ``codes_to``).
# int8 -> bf16: each byte + 128 (xor 0x80) goes under float32's 2^23 exponent, 2^23 + 128 is subtracted,
# the high halves are kept (|code| <= 128 fits bf16's 8 bits).
INT8_TO_BF16 = tl.constexpr(
    "{ .reg .b32 t, m, f0, f1, f2, f3; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x4B000000; "
    "prmt.b32 f0, t, m, 0x7540; prmt.b32 f1, t, m, 0x7541; prmt.b32 f2, t, m, 0x7542; prmt.b32 f3, t, m, 0x7543; "
    "sub.f32 f0, f0, 0f4B000080; sub.f32 f1, f1, 0f4B000080; sub.f32 f2, f2, 0f4B000080; "
    "sub.f32 f3, f3, 0f4B000080; prmt.b32 $0, f0, f1, 0x7632; prmt.b32 $1, f2, f3, 0x7632; }")
# int8 -> fp16: each byte + 128 under float16's 1024 (high byte 0x64), minus 1152, two codes an instruction.
INT8_TO_F16 = tl.constexpr(
    "{ .reg .b32 t, m, c; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; mov.b32 c, 0x64806480; "
    "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }")
# int8 -> fp16 plus 1152 (``INT8_BIAS``): the same without the subtraction, for products that take the bias out
# afterwards (``tile_keys_major_triton``): two instructions fewer per four codes.
INT8_TO_F16_BIASED = tl.constexpr(
    "{ .reg .b32 t, m; xor.b32 t, $2, 0x80808080; mov.b32 m, 0x64646464; "
    "prmt.b32 $0, t, m, 0x4140; prmt.b32 $1, t, m, 0x4342; }")
INT8_BIAS = tl.constexpr(1152.0)
# e4m3 -> bf16: sign, exponent and mantissa moved into bf16's fields (the value times 2^-120, subnormals
# included), then times 2^120 (0x7B80). NaN codes (never stored: the quantizer saturates) are not kept.
E4M3_TO_BF16 = tl.constexpr(
    "{ .reg .b32 a, b, s, k; mov.b32 k, 0x7B807B80; prmt.b32 a, $2, 0, 0x1404; prmt.b32 b, $2, 0, 0x3424; "
    "shr.b32 s, a, 4; and.b32 s, s, 0x07F007F0; and.b32 a, a, 0x80008000; or.b32 a, a, s; "
    "shr.b32 s, b, 4; and.b32 s, s, 0x07F007F0; and.b32 b, b, 0x80008000; or.b32 b, b, s; "
    "mul.rn.bf16x2 $0, a, k; mul.rn.bf16x2 $1, b, k; }")
E4M3_TO_F16 = tl.constexpr(
    "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")


@triton.jit
def codes_to(codes, dtype: tl.constexpr, CVT: tl.constexpr, BIASED: tl.constexpr = False):
    """An 8-bit tile's codes (int8 or float8 e4m3) -> ``dtype`` (bf16 / fp16 / fp32), exactly; with ``BIASED``
    (int8 codes, float16) each code plus ``INT8_BIAS`` (1024-1279: exact in float16), the caller's products
    then subtracting the bias's share. ``CVT`` 0:
    Triton's cast; 1: the asm above as a pure op (Triton may move it after the tile's shared-memory copy
    and convert in the dot operand's registers); 2: the asm as an opaque op it cannot move, so the copy
    holds 16-bit values (``ldmatrix`` can then transpose V for ``p @ V``). 1 and 2: CUDA, bf16 / fp16 (by
    default bf16 queries only: the float16 forms run under ``F16_MATH``, which passed the ``-m gpu`` tests on an
    H100 but is not the default; every code through each asm string is checked by an interpreter of their
    PTX, tests/kernels/test_codes_asm.py)."""
    tl.static_assert(not BIASED or (codes.dtype == tl.int8 and dtype == tl.float16), "biased: int8 -> float16 only")
    if BIASED and CVT == 0:
        out = codes.to(dtype) + INT8_BIAS
    elif BIASED:
        out = tl.inline_asm_elementwise(INT8_TO_F16_BIASED, "=r,=r,r", [codes.to(tl.uint8, bitcast=True)],
                                        dtype=tl.float16, is_pure=CVT == 1, pack=4)
    elif CVT == 0:
        out = codes.to(dtype)
    elif dtype == tl.bfloat16:
        out = tl.inline_asm_elementwise(INT8_TO_BF16 if codes.dtype == tl.int8 else E4M3_TO_BF16, "=r,=r,r",
                                        [codes.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16, is_pure=CVT == 1,
                                        pack=4)
    else:
        out = tl.inline_asm_elementwise(INT8_TO_F16 if codes.dtype == tl.int8 else E4M3_TO_F16, "=r,=r,r",
                                        [codes.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=CVT == 1,
                                        pack=4)
    return out


@triton.jit
def queries_in_f16(q, scale_log2):
    """Queries [BLOCK_G, BLOCK_D] (bf16) -> (float16 queries, score scale per row [BLOCK_G, 1]): each row times
    the power of two that puts its largest magnitude in [2^14, 2^15) (built from the float32 bits: exact),
    the scale divided by it. bf16 values keep every bit in float16 there; only entries below 2^-38 of their
    row's largest lose bits. Lets 8-bit codes convert to float16, in about half the instructions bf16 takes."""
    qf = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)                              # [BLOCK_G]
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127             # floor(log2(amax))
    power = ((141 - exponent) << 23).to(tl.float32, bitcast=True)                 # 2^(14 - exponent)
    return (qf * power[:, None]).to(tl.float16), scale_log2 / power[:, None]


@triton.jit
def per_key(pointers, n_mask, FULL: tl.constexpr):
    """One value per key of a tile (block-table entries, row scales); keys past the end read 0, and a ``FULL``
    tile (every key before ``kv_end``) loads without a predicate."""
    if FULL:
        values = tl.load(pointers)
    else:
        values = tl.load(pointers, mask=n_mask, other=0)
    return values


@triton.jit
def tile_slots(n0, table, kv_end, d_mask, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FULL: tl.constexpr):
    """-> (n, n_mask, blk, off, kv_mask): a tile's key positions ``n`` [BLOCK_N] from ``n0``, which exist (``n <
    kv_end``), their block (int64, through the sequence's ``table``) and offset in it, and the mask of a K / V
    tile load (the head_dim columns alone in a ``FULL`` tile)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    blk = per_key(table + n // BLOCK_SIZE, n_mask, FULL).to(tl.int64)
    off = n % BLOCK_SIZE
    if FULL:
        kv_mask = d_mask[None, :]
    else:
        kv_mask = n_mask[:, None] & d_mask[None, :]
    return n, n_mask, blk, off, kv_mask


@triton.jit
def value_codes(codes, scale_pointers, n_mask, dtype: tl.constexpr, V_CVT: tl.constexpr, FULL: tl.constexpr,
                BIASED: tl.constexpr = False):
    """An 8-bit V tile [BLOCK_N, BLOCK_D] -> (its values in ``dtype``, each key's scale [BLOCK_N] to multiply its
    probabilities by, the factor the tile's ``p @ V`` then takes). In float16 the scales are taken relative to the
    tile's largest, which becomes the factor (float16's range: p x scale stays in [0, 1]); else factor 1.
    ``BIASED``: the values are codes plus ``INT8_BIAS`` (``codes_to``)."""
    v_scale = per_key(scale_pointers, n_mask, FULL).to(tl.float32)
    v_max = 1.0
    if dtype == tl.float16:
        v_max = tl.maximum(tl.max(v_scale, 0), 2.0 ** -24)
        v_scale = v_scale / v_max
    return codes_to(codes, dtype, V_CVT, BIASED), v_scale, v_max


@triton.jit
def base2_scores(s, scale_log2, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw products ``s`` -> scores in base 2 (``scale_log2`` a scalar or broadcastable to ``s``); with
    ``HAS_SOFTCAP`` the scaled score is first soft-capped (Gemma 2): cap * tanh(scale * s / cap), tanh(x) = 1 - 2 /
    (exp(2x) + 1)."""
    if HAS_SOFTCAP:
        x = s * (scale_log2 / 1.4426950408889634 / softcap)
        s = (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * (softcap * 1.4426950408889634)
    else:
        s = s * scale_log2
    return s


@triton.jit
def _scaled_rows(codes, scale_pointers, n_mask, FULL: tl.constexpr, dtype: tl.constexpr):
    """An 8-bit tile [BLOCK_N, BLOCK_D] times each row's scale, in float32 (exact: an 8-bit code times a float16
    scale), then ``dtype`` (rounded there, as a 16-bit cache's rows are)."""
    return (codes.to(tl.float32) * per_key(scale_pointers, n_mask, FULL).to(tl.float32)[:, None]).to(dtype)


@triton.jit
def attend_tile(q, m, l, acc, n0, k_base, v_base, table, q_pos, slope, kv_end,
                 stride_kb, stride_ks, stride_vb, stride_vs, sliding_window, scale_log2, softcap,
                 d, d_mask, ks_base, vs_base, stride_sb, stride_ss, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                 QUANT: tl.constexpr, BLOCK_N: tl.constexpr, K_CVT: tl.constexpr = 0, V_CVT: tl.constexpr = 0,
                 FULL: tl.constexpr = False, SCALE_ROWS: tl.constexpr = False):
    """One online-softmax step over key positions [n0, n0 + BLOCK_N) -> updated (m, l, acc). ``FULL``: the caller
    knows every key of the tile is before ``kv_end`` (with ``MASKED`` False: every key visible to every row), so
    the tile loads without the per-key predicates (the decode loop issued 30% fewer instructions on sm_90)."""
    n, n_mask, blk, off, kv_mask = tile_slots(n0, table, kv_end, d_mask, BLOCK_SIZE, BLOCK_N, FULL)
    k = tl.load(k_base + blk[:, None] * stride_kb + off[:, None] * stride_ks + d[None, :],
                mask=kv_mask, other=0.0)                                         # [BLOCK_N, BLOCK_D]
    if QUANT and SCALE_ROWS:
        k = _scaled_rows(k, ks_base + blk * stride_sb + off * stride_ss, n_mask, FULL, q.dtype)
    elif QUANT:
        k = codes_to(k, q.dtype, K_CVT)                                          # codes, exact
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if QUANT and not SCALE_ROWS:
        s = s * per_key(ks_base + blk * stride_sb + off * stride_ss, n_mask, FULL).to(tl.float32)[None, :]
    s = base2_scores(s, scale_log2, softcap, HAS_SOFTCAP)                       # [BLOCK_M, BLOCK_N]
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
    if QUANT and SCALE_ROWS:
        v = _scaled_rows(v, vs_base + blk * stride_sb + off * stride_ss, n_mask, FULL, q.dtype)
    elif QUANT:
        v, v_scale, v_max = value_codes(v, vs_base + blk * stride_sb + off * stride_ss, n_mask, q.dtype, V_CVT, FULL)
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
