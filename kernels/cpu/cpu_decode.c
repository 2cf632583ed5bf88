/* Paged decode attention for the CPU: one query token per sequence, K/V read straight from the paged
 * cache (no gather), online softmax in float32. Built and loaded by cpu_decode.py (cc -O3
 * -march=native -fopenmp); called through ctypes with raw pointers and element strides.
 *
 * Work item = a sequence (or one of its KV heads, when there are few sequences). Its visible tokens go
 * by in chunks of whole blocks (up to 64 tokens per KV head's buffer): the chunk's blocks are first read
 * end to end in address order, every KV head of the item at once (touch_blocks), which the hardware
 * prefetchers stream at close to the memory bandwidth; then, per KV head, the chunk's K/V rows are
 * listed (bfloat16 rows converted once into an L1-sized float32 buffer; as each row is listed, the same
 * row of the item's next chunk is prefetched into L2, so that the next chunk's reads overlap this one's
 * arithmetic) and each of the G = Hq / Hkv
 * query heads takes its scores 8 tokens at a time (8 independent FMA chains, one transposing
 * reduction), -inf outside the visible range, one online-softmax step per chunk, and acc += p @ V.
 * Reading a head's rows straight from DRAM (a third of every token's row, block after random block)
 * ran at a third of that bandwidth, and software prefetches did not help (measured in
 * docs/design/kernels.md). Prefetching the next chunk whole, into L2 (prefetcht1), while the current one
 * computes does: 16 sequences x 1,000 tokens, 30 layers, 0.80x the time in bfloat16 and 0.88x in float32
 * (2-core AMD EPYC, 2026-12-03; into L1 instead: no gain, it evicts the chunk being read). The item's first
 * chunk is not covered (prefetching the next item's first chunk, its items claimed one ahead, gained nothing
 * at 64-200 tokens).
 * Vectors are cpu_vec.h's: 16 floats along head_dim (a multiple of 16), 8 along tokens (block_size is
 * a multiple of 8), so the same source compiles to AVX2 or AVX-512 by -march=native.
 *
 * bfloat16 q and cache where the build has AVX512-BF16 (PAIR_DOT) and head_dim is a multiple of 32: the keys
 * are not converted; each score is vdpbf16ps over q's and the key's dimension pairs, read from the cache (the
 * products are exact in float32, the sums float32 in pair order), then times scale (after the sum, where the
 * float32 path scales q first). The values are still converted for p @ V, whose p stays float32. 16 sequences,
 * SmolLM2's heads, 30 layers' caches, the builds alternated (2-core AMD EPYC, 2026-12-03): 0.86-0.88x the
 * time at 64-200 tokens, 0.80x at 1,000; outputs within one bf16 rounding of the float32 path's.
 *
 * Key j is visible from the query at p = seq_len - 1 when j <= p and, with a window W > 0, j > p - W.
 * A sequence with seq_len <= 0 outputs zeros. Block ids are clamped into [0, num_blocks) (the
 * Python wrapper's callers check them; the clamp only keeps a bad id from reading outside the cache).
 *
 * dtype codes: q and out share one, 0 = float32, 1 = bfloat16 (upper half of a float32); the caches have
 * that one or an 8-bit code (kv_quant.py): 2 = int8, 3 = float8 e4m3 (fn: no infinities), each row then
 * multiplied by its float16 scale from k_scale / v_scale ([num_blocks, block_size, num_kv_heads],
 * contiguous) as it is converted to float32.
 * Limits (checked by the caller): head_dim <= 256 and a multiple of 16, block_size a multiple of 8
 * and <= 64, G <= 64.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_vec.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

#ifdef __AVX512BF16__
#define PAIR_DOT 1
#else
#define PAIR_DOT 0
#endif
#define CACHE_I8 2
#define CACHE_FP8 3

struct item_args {
    const char *q;                       /* this sequence's query row, first head */
    int64_t q_head;                      /* head stride of q, bytes */
    const char *k, *v;                   /* the caches (store_new writes the new token's rows) */
    int64_t c_block, c_tok, c_head;      /* cache strides, bytes */
    int64_t num_blocks, block_size, head_dim, group, kv_lo, kv_hi;
    const int32_t *table;
    int64_t seq_len, window;
    float scale;
    const float *slopes;                 /* [Hq], or NULL */
    float softcap;                       /* > 0: scores become softcap * tanh(score / softcap) (Gemma 2) */
    const float *sinks;                  /* [Hq] learned logits that join each head's softmax (gpt-oss), or NULL */
    char *out;                           /* this sequence's output row, first head */
    int64_t o_head;                      /* head stride of out, bytes */
    const uint16_t *k_scale, *v_scale;   /* 8-bit caches: float16 scale bits per (block, slot, KV head) */
    int64_t num_kv_heads;
};

/* float16 bits -> float32 (exact: every float16 is a float32) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {                                   /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * (1.0f / 16777216.0f);
        v.u |= sign;
    } else if (exp == 31) {
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return v.f;
}

/* d[0..7] -> (sum of d[0], ..., sum of d[7]): a transposing reduction, 14 shuffles and 7 adds for
 * eight dot products (eight separate horizontal sums take about twice that). */
static inline v8f hsum8x8(const v8f d[8]) {
    const v8f t0 = __builtin_shufflevector(d[0], d[1], 0, 8, 1, 9, 4, 12, 5, 13)
                 + __builtin_shufflevector(d[0], d[1], 2, 10, 3, 11, 6, 14, 7, 15);
    const v8f t1 = __builtin_shufflevector(d[2], d[3], 0, 8, 1, 9, 4, 12, 5, 13)
                 + __builtin_shufflevector(d[2], d[3], 2, 10, 3, 11, 6, 14, 7, 15);
    const v8f t2 = __builtin_shufflevector(d[4], d[5], 0, 8, 1, 9, 4, 12, 5, 13)
                 + __builtin_shufflevector(d[4], d[5], 2, 10, 3, 11, 6, 14, 7, 15);
    const v8f t3 = __builtin_shufflevector(d[6], d[7], 0, 8, 1, 9, 4, 12, 5, 13)
                 + __builtin_shufflevector(d[6], d[7], 2, 10, 3, 11, 6, 14, 7, 15);
    /* t0 = [d0 02, d1 02, d0 13, d1 13, d0 46, d1 46, d0 57, d1 57] (digits: lanes summed) */
    const v8f u0 = __builtin_shufflevector(t0, t1, 0, 1, 8, 9, 4, 5, 12, 13)
                 + __builtin_shufflevector(t0, t1, 2, 3, 10, 11, 6, 7, 14, 15);
    const v8f u1 = __builtin_shufflevector(t2, t3, 0, 1, 8, 9, 4, 5, 12, 13)
                 + __builtin_shufflevector(t2, t3, 2, 3, 10, 11, 6, 7, 14, 15);
    /* u0 = [d0 0-3, d1 0-3, d2 0-3, d3 0-3, d0 4-7, d1 4-7, d2 4-7, d3 4-7] */
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

#define CHUNK_FLOATS 4096    /* K (and V) rows of one chunk, float32: 16 KiB each (L1) */
#define MAX_CHUNK 64         /* tokens */

static const float zero_row[256] __attribute__((aligned(64)));

/* 16 codes of an 8-bit row at src as float32, times scale. float8 e4m3fn: its exponent and mantissa
 * bits placed at the top of a float32's (bits << 20) give 2^(e - 127) (1 + m / 8), or for e = 0 the
 * float32 subnormal m 2^-129, so times 2^120 the float8 value, subnormals included (NaN codes never
 * occur: the quantizer clamps to +-448). */
static inline __attribute__((always_inline)) v16f load16_q8(const char *src, int cdtype, float scale) {
    if (cdtype == CACHE_I8) return __builtin_convertvector(load16_bytes(src, 1), v16f) * splat16(scale);
    const v16i x = load16_bytes(src, 0);
    const v16i bits = ((x & 0x7f) << 20) | ((x & 0x80) << 24);
    return (v16f)bits * splat16(scale * 0x1p120f);
}

/* Load one byte of every cache line of the K and V rows of KV heads [kv_lo, kv_hi) (adjacent in a token's
 * row) in blocks [b_lo, b_hi) of the sequence's table, as far as the sequence reaches, in address order:
 * the lines land in the caches before the per-head passes read them. Never reads outside those rows. */
static inline void touch_blocks(const struct item_args *a, int64_t b_lo, int64_t b_hi, int64_t head_bytes) {
    typedef int32_t v4i __attribute__((vector_size(16)));   /* integer adds: no slow denormal floats */
    const int64_t row_bytes = (a->kv_hi - a->kv_lo) * head_bytes;      /* a multiple of 16 */
    v4i sink = {0, 0, 0, 0};
    for (int64_t b = b_lo; b < b_hi && b * a->block_size < a->seq_len; b++) {
        int64_t block = a->table[b];
        block = block < 0 ? 0 : (block >= a->num_blocks ? a->num_blocks - 1 : block);
        for (int64_t t = 0; t < a->block_size; t++) {
            const char *kr = a->k + block * a->c_block + t * a->c_tok + a->kv_lo * a->c_head;
            const char *vr = a->v + block * a->c_block + t * a->c_tok + a->kv_lo * a->c_head;
            for (int64_t off = 0; off < row_bytes; off += 64) {   /* 16 bytes of each line */
                v4i kx, vx;
                memcpy(&kx, kr + off, sizeof kx);
                memcpy(&vx, vr + off, sizeof vx);
                sink += kx + vx;
            }
        }
    }
    __asm__ volatile("" : : "x"(sink));
}

/* One sequence, KV heads [kv_lo, kv_hi), head_dim = 16 C. The visible tokens go by in chunks of whole
 * blocks (up to MAX_CHUNK tokens), read first by touch_blocks; per KV head the chunk's K/V rows are
 * listed as float32 rows (pointers into a float32 cache, or rows converted once into a chunk buffer from
 * bfloat16 or from 8-bit codes times their row's scale), then each of the G query heads takes scores 8 tokens at a time, one online-softmax step for
 * the whole chunk, and acc += p @ V (acc, m and l kept per KV head across chunks). Rows past the chunk's
 * visible ones (up to a multiple of 8) point at zeros and their scores are -inf. */
static inline __attribute__((always_inline)) void decode_item(const struct item_args *a, int dtype, int cdtype,
                                                              int64_t C) {
    const int64_t elem = dtype_size(dtype);                            /* q and out */
    const int64_t celem = cdtype == DTYPE_F32 ? 4 : (cdtype == DTYPE_BF16 ? 2 : 1);   /* the caches */
    const int64_t bs = a->block_size, G = a->group, D = 16 * C;
    const int64_t H = a->kv_hi - a->kv_lo;
    const int pair_keys = PAIR_DOT && dtype == DTYPE_BF16 && cdtype == DTYPE_BF16 && C % 2 == 0;
    const int64_t pos = a->seq_len - 1;
    const int64_t lo = (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
    int64_t chunk_blocks = (CHUNK_FLOATS / D < MAX_CHUNK ? CHUNK_FLOATS / D : MAX_CHUNK) / bs;
    chunk_blocks = chunk_blocks > 0 ? chunk_blocks : 1;
    float kbuf[cdtype == DTYPE_F32 ? 1 : chunk_blocks * bs * D] __attribute__((aligned(64)));
    float vbuf[cdtype == DTYPE_F32 ? 1 : chunk_blocks * bs * D] __attribute__((aligned(64)));
    const float *krow[chunk_blocks * bs + 8], *vrow[chunk_blocks * bs + 8];
    v16f acc[H][G][C];
    float m[H][G], l[H][G];
    for (int64_t h = 0; h < H; h++) {
        for (int64_t r = 0; r < G; r++) {
            for (int64_t c = 0; c < C; c++) acc[h][r][c] = splat16(0.0f);
            m[h][r] = -INFINITY;
            l[h][r] = 0.0f;
        }
    }
    for (int64_t b0 = lo / bs; a->seq_len > 0 && b0 * bs < a->seq_len; b0 += chunk_blocks) {
        touch_blocks(a, b0, b0 + chunk_blocks, D * celem);
        const int64_t first = lo > b0 * bs ? lo : b0 * bs;
        for (int64_t hh = 0; hh < H; hh++) {
            const int64_t h = a->kv_lo + hh;
            int64_t n = 0;
            for (int64_t b = b0; b < b0 + chunk_blocks && b * bs < a->seq_len; b++) {
                int64_t block = a->table[b];
                block = block < 0 ? 0 : (block >= a->num_blocks ? a->num_blocks - 1 : block);
                const int64_t t_lo = first > b * bs ? first - b * bs : 0;
                const int64_t t_hi = a->seq_len - b * bs < bs ? a->seq_len - b * bs : bs;
                const int64_t later = b + chunk_blocks;          /* this block's place in the next chunk */
                int64_t next = later * bs < a->seq_len ? a->table[later] : -1;
                next = next < 0 ? -1 : (next >= a->num_blocks ? a->num_blocks - 1 : next);
                for (int64_t t = t_lo; t < t_hi; t++, n++) {
                    const char *k_src = a->k + block * a->c_block + t * a->c_tok + h * a->c_head;
                    const char *v_src = a->v + block * a->c_block + t * a->c_tok + h * a->c_head;
                    if (next >= 0 && later * bs + t < a->seq_len) {      /* the next chunk's row, into L2 */
                        const int64_t off = next * a->c_block + t * a->c_tok + h * a->c_head;
                        for (int64_t line = 0; line < D * celem; line += 64) {
                            __builtin_prefetch(a->k + off + line, 0, 2);
                            __builtin_prefetch(a->v + off + line, 0, 2);
                        }
                    }
                    if (cdtype == DTYPE_F32) {
                        krow[n] = (const float *)k_src;
                        vrow[n] = (const float *)v_src;
                    } else if (cdtype != DTYPE_BF16) {
                        const int64_t row = (block * bs + t) * a->num_kv_heads + h;
                        const float ks = half_to_float(a->k_scale[row]), vs = half_to_float(a->v_scale[row]);
                        float *kd = kbuf + n * D, *vd = vbuf + n * D;
                        for (int64_t c = 0; c < C; c++) {
                            const v16f kx = load16_q8(k_src + c * 16, cdtype, ks);
                            const v16f vx = load16_q8(v_src + c * 16, cdtype, vs);
                            memcpy(kd + c * 16, &kx, sizeof kx);
                            memcpy(vd + c * 16, &vx, sizeof vx);
                        }
                        krow[n] = kd;
                        vrow[n] = vd;
                    } else if (pair_keys) {              /* keys stay bf16 in the cache: scores by vdpbf16ps */
                        float *vd = vbuf + n * D;
                        for (int64_t c = 0; c < C; c++) {
                            const v16f vx = load16_bf16(v_src + c * 32);
                            memcpy(vd + c * 16, &vx, sizeof vx);
                        }
                        krow[n] = (const float *)k_src;
                        vrow[n] = vd;
                    } else {
                        float *kd = kbuf + n * D, *vd = vbuf + n * D;
                        for (int64_t c = 0; c < C; c++) {
                            const v16f kx = load16_bf16(k_src + c * 32), vx = load16_bf16(v_src + c * 32);
                            memcpy(kd + c * 16, &kx, sizeof kx);
                            memcpy(vd + c * 16, &vx, sizeof vx);
                        }
                        krow[n] = kd;
                        vrow[n] = vd;
                    }
                }
            }
            const int64_t n8 = (n + 7) / 8 * 8;
            for (int64_t i = n; i < n8; i++) krow[i] = zero_row;
            for (int64_t r = 0; r < G; r++) {
                const int64_t head = h * G + r;
                v16f qv[C];
                for (int64_t c = 0; c < C && !pair_keys; c++)   /* the pairs path reads q's bf16 pairs instead */
                    qv[c] = load16(a->q + head * a->q_head + c * 16 * elem, dtype) * splat16(a->scale);
                v8f sc[MAX_CHUNK / 8 + 1];
                v8f chunk_max = splat8(-INFINITY);
                for (int64_t i8 = 0; i8 < n8; i8 += 8) {
                    v16f d16[8];
                    for (int64_t i = 0; i < 8; i++) d16[i] = splat16(0.0f);
                    if (pair_keys) {
#if PAIR_DOT
                        const char *qrow = a->q + head * a->q_head;
                        for (int64_t c2 = 0; c2 < C / 2; c2++) {
                            const __m512bh qp = (__m512bh)_mm512_loadu_si512(qrow + c2 * 64);
                            for (int64_t i = 0; i < 8; i++)
                                d16[i] = (v16f)_mm512_dpbf16_ps((__m512)d16[i], qp,
                                    (__m512bh)_mm512_loadu_si512((const char *)krow[i8 + i] + c2 * 64));
                        }
#endif
                    } else {
                        for (int64_t c = 0; c < C; c++) {
                            for (int64_t i = 0; i < 8; i++) d16[i] += qv[c] * load16_f32((const char *)(krow[i8 + i] + c * 16));
                        }
                    }
                    v8f d[8];
                    for (int64_t i = 0; i < 8; i++) d[i] = halves_sum(d16[i]);
                    v8f s = hsum8x8(d);
                    if (pair_keys) s *= splat8(a->scale);
                    const v8i idx = (v8i){0, 1, 2, 3, 4, 5, 6, 7} + (int32_t)i8;
                    if (a->softcap > 0.0f) {
                        for (int i = 0; i < 8; i++) s[i] = a->softcap * tanhf(s[i] / a->softcap);
                    }
                    if (a->slopes != NULL) {
                        s += splat8(a->slopes[head]) * __builtin_convertvector(idx + (int32_t)(first - pos), v8f);
                    }
                    s = select8(idx < (int32_t)n, s, splat8(-INFINITY));
                    sc[i8 / 8] = s;
                    chunk_max = select8(s > chunk_max, s, chunk_max);
                }
                const float cmax = hmax8(chunk_max);
                const float new_max = cmax > m[hh][r] ? cmax : m[hh][r];
                const v8f correction = exp8(splat8(m[hh][r] - new_max));
                v8f sum = splat8(0.0f);
                for (int64_t i8 = 0; i8 < n8 / 8; i8++) {
                    sc[i8] = exp8(sc[i8] - splat8(new_max));
                    sum += sc[i8];
                }
                l[hh][r] = l[hh][r] * correction[0] + hsum8(sum);
                m[hh][r] = new_max;
                v16f o[C];
                for (int64_t c = 0; c < C; c++) o[c] = acc[hh][r][c] * splat16(correction[0]);
                for (int64_t i = 0; i < n; i++) {
                    const v16f w = splat16(sc[i / 8][i % 8]);
                    for (int64_t c = 0; c < C; c++) o[c] += w * load16_f32((const char *)(vrow[i] + c * 16));
                }
                for (int64_t c = 0; c < C; c++) acc[hh][r][c] = o[c];
            }
        }
    }
    for (int64_t hh = 0; hh < H; hh++) {
        for (int64_t r = 0; r < G; r++) {
            /* a sink is one more logit in the softmax with no value row: it only adds to the denominator
             * (with no visible key m is -inf, the sum inf and the row 0, as the reference gives) */
            const float sum = a->sinks != NULL ? l[hh][r] + expf(a->sinks[(a->kv_lo + hh) * G + r] - m[hh][r])
                                               : l[hh][r];
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            char *dst = a->out + ((a->kv_lo + hh) * G + r) * a->o_head;
            for (int64_t c = 0; c < C; c++) store16(dst + c * 16 * elem, acc[hh][r][c] * inv, dtype);
        }
    }
}

/* Sequence s's new key and value rows, KV heads [kv_lo, kv_hi), into cache slot slots[s] (skipped when
 * negative): the store_kv of a decode step, done by the work item that then reads them. The slot is in a
 * block of this sequence that no other sequence reads at that position (the engine never shares a block
 * a sequence still writes), so items running in parallel never race on it. */
#if defined(__F16C__)
/* float32 -> float16 bits, rounded to nearest even (IEEE, as torch's .to(float16)) */
static inline uint16_t float_to_half(float x) { return (uint16_t)_cvtss_sh(x, 0); }
#endif

#if defined(__F16C__)
/* One row (head_dim values of q's dtype at src) as float32 into x -> the float16 bits of its scale as
 * kv_quant.quantize_rows computes it: clamp(float16(max |x| / qmax), 2^-24, 65504), or static_bits (a
 * checkpoint's scale) when not 0. IEEE float32 division (no -ffast-math): the same scales as torch. */
static inline uint16_t load_row_scale(const char *src, int dtype, int64_t D, float *x, float qmax,
                                      uint16_t static_bits) {
    float amax = 0.0f;
    for (int64_t i = 0; i < D; i++) {
        if (dtype == DTYPE_F32) {
            x[i] = ((const float *)src)[i];
        } else {
            const union { uint32_t u; float f; } v = {.u = (uint32_t)((const uint16_t *)src)[i] << 16};
            x[i] = v.f;
        }
        amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    }
    if (static_bits != 0) return static_bits;
    uint16_t h = float_to_half(amax / qmax);
    h = (h & 0x7fffu) > 0x7bffu ? 0x7bffu : h;       /* inf (or beyond 65504) -> 65504 */
    return (h & 0x7fffu) == 0 ? 0x0001u : h;          /* 0 -> 2^-24 */
}
#endif

/* One row quantized to int8 as kv_quant.quantize_rows does: code = clamp(floor(x / scale + 0.5), -127, 127);
 * the scale's float16 bits to *scale_bits. IEEE float32 division and addition: the same codes. */
static inline void quantize_row_i8(const char *src, int dtype, int64_t D, int8_t *dst, uint16_t *scale_bits) {
#if defined(__F16C__)
    float x[256];
    const uint16_t h = load_row_scale(src, dtype, D, x, 127.0f, 0);
    const float scale = half_to_float(h);
    for (int64_t i = 0; i < D; i++) {
        float q = floorf(x[i] / scale + 0.5f);
        q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
        dst[i] = (int8_t)q;
    }
    *scale_bits = h;
#else
    (void)src; (void)dtype; (void)D; (void)dst; (void)scale_bits;
#endif
}

/* float32 -> float8 e4m3fn bits, rounded to nearest even, as torch's .to(torch.float8_e4m3fn) computes it
 * (c10's fp8_e4m3fn_from_fp32_value: subnormals by one IEEE float addition, normals by integer rounding);
 * |x| <= 448 here (the quantizer clamps first), so no NaN is made. */
static inline uint8_t float_to_e4m3(float x) {
    union { float f; uint32_t u; } v = {.f = x};
    const uint32_t sign = v.u & 0x80000000u;
    v.u ^= sign;
    uint8_t result;
    if (v.u >= (1087u << 20)) {                         /* >= 480: NaN, as torch (not reached) */
        result = 0x7f;
    } else if (v.u < (121u << 23)) {                    /* below 2^-6: a subnormal or zero */
        const union { uint32_t u; float f; } mask = {.u = 141u << 23};
        v.f = v.f + mask.f;
        result = (uint8_t)(v.u - mask.u);
    } else {
        const uint32_t mant_odd = (v.u >> 20) & 1u;
        v.u += ((uint32_t)(7 - 127) << 23) + 0x7ffffu;
        v.u += mant_odd;
        result = (uint8_t)(v.u >> 20);
    }
    return result | (uint8_t)(sign >> 24);
}

/* One row quantized to float8 e4m3fn as kv_quant.quantize_rows does: scale as load_row_scale's (qmax 448, or
 * the checkpoint's: static_bits, 0 for none), code = e4m3(clamp(x / scale, -448, 448)); the scale's float16
 * bits to *scale_bits. */
static inline void quantize_row_fp8(const char *src, int dtype, int64_t D, uint8_t *dst, uint16_t *scale_bits,
                                    uint16_t static_bits) {
#if defined(__F16C__)
    float x[256];
    const uint16_t h = load_row_scale(src, dtype, D, x, 448.0f, static_bits);
    const float scale = half_to_float(h);
    for (int64_t i = 0; i < D; i++) {
        float y = x[i] / scale;
        y = y > 448.0f ? 448.0f : (y < -448.0f ? -448.0f : y);
        dst[i] = float_to_e4m3(y);
    }
    *scale_bits = h;
#else
    (void)src; (void)dtype; (void)D; (void)dst; (void)scale_bits; (void)static_bits;
#endif
}

/* 1 when this build quantizes 8-bit rows in store_new (it needs F16C for the float16 scale) */
int stores_8bit_rows(void) {
#if defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

static inline void store_new(const struct item_args *a, int64_t s, const char *k_new, int64_t k_tok, int64_t k_head,
                             const char *v_new, int64_t v_tok, int64_t v_head, const int32_t *slots,
                             int64_t elem, int dtype, int cache_dtype, uint16_t k_static, uint16_t v_static) {
    const int64_t slot = slots[s];
    if (slot < 0) return;
    const int64_t block = slot / a->block_size, offset = slot % a->block_size;
    if (block >= a->num_blocks) return;                 /* checked by the caller; never write outside */
    for (int64_t h = a->kv_lo; h < a->kv_hi; h++) {
        const int64_t dst = block * a->c_block + offset * a->c_tok + h * a->c_head;
        if (cache_dtype == CACHE_I8) {                  /* element strides of an int8 cache are bytes */
            const int64_t row = slot * a->num_kv_heads + h;
            quantize_row_i8(k_new + s * k_tok + h * k_head, dtype, a->head_dim, (int8_t *)a->k + dst,
                            (uint16_t *)a->k_scale + row);
            quantize_row_i8(v_new + s * v_tok + h * v_head, dtype, a->head_dim, (int8_t *)a->v + dst,
                            (uint16_t *)a->v_scale + row);
        } else if (cache_dtype == CACHE_FP8) {
            const int64_t row = slot * a->num_kv_heads + h;
            quantize_row_fp8(k_new + s * k_tok + h * k_head, dtype, a->head_dim, (uint8_t *)a->k + dst,
                             (uint16_t *)a->k_scale + row, k_static);
            quantize_row_fp8(v_new + s * v_tok + h * v_head, dtype, a->head_dim, (uint8_t *)a->v + dst,
                             (uint16_t *)a->v_scale + row, v_static);
        } else {
            memcpy((char *)a->k + dst, k_new + s * k_tok + h * k_head, a->head_dim * elem);
            memcpy((char *)a->v + dst, v_new + s * v_tok + h * v_head, a->head_dim * elem);
        }
    }
}

/* q [S, Hq, D] (strides q_tok, q_head in elements); caches [NB, bs, Hkv, D] with element strides (of
 * cache_dtype; with an 8-bit cache_dtype, k_scale / v_scale hold each row's float16 scale)
 * (c_block, c_tok, c_head, 1); block_tables [S, max_blocks] int32 (row stride bt_row); seq_lens [S]
 * int32; slopes [Hq] float32 or NULL; window <= 0: none; out [S, Hq, D] (strides o_tok, o_head).
 * slots [S] int32 or NULL: with it, k_new [S, Hkv, D] (strides k_tok, k_head) and v_new (v_tok, v_head)
 * are stored into the caches first (store_new; a float8 cache's rows with the checkpoint's scales k_static /
 * v_static, float16 bits, when not 0). softcap > 0: the scaled scores are soft-capped (Gemma 2). sinks [Hq]
 * float32 or NULL: per-head logits added to each softmax's denominator (gpt-oss's attention sinks). */
void paged_decode_cpu(const void *q, int64_t q_tok, int64_t q_head,
                      const void *k_cache, const void *v_cache, int64_t c_block, int64_t c_tok, int64_t c_head,
                      int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                      int64_t num_seqs, int64_t group, const int32_t *block_tables, int64_t bt_row,
                      const int32_t *seq_lens, float scale, const float *slopes, int64_t window,
                      int dtype, void *out, int64_t o_tok, int64_t o_head, int threads,
                      const void *k_new, int64_t k_tok, int64_t k_head,
                      const void *v_new, int64_t v_tok, int64_t v_head, const int32_t *slots, float softcap,
                      int cache_dtype, const uint16_t *k_scale, const uint16_t *v_scale, uint16_t k_static,
                      uint16_t v_static, const float *sinks) {
    const int64_t elem = dtype_size(dtype);
    const int64_t celem = cache_dtype == DTYPE_F32 ? 4 : (cache_dtype == DTYPE_BF16 ? 2 : 1);
    /* a work item is one sequence with all its KV heads (each block read once, whole); with fewer
     * sequences than two per thread, one (sequence, KV head) so that every thread has work */
    const int64_t per_seq = num_seqs >= 2 * threads ? 1 : num_kv_heads;
    const int64_t heads_per_item = num_kv_heads / per_seq;
    const int64_t items = num_seqs * per_seq;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && items > 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t s = item / per_seq, kv_lo = (item % per_seq) * heads_per_item;
        const struct item_args a = {
            .q = (const char *)q + s * q_tok * elem, .q_head = q_head * elem,
            .k = (const char *)k_cache, .v = (const char *)v_cache,
            .c_block = c_block * celem, .c_tok = c_tok * celem, .c_head = c_head * celem,
            .num_blocks = num_blocks, .block_size = block_size, .head_dim = head_dim, .group = group,
            .kv_lo = kv_lo, .kv_hi = kv_lo + heads_per_item,
            .table = block_tables + s * bt_row, .seq_len = seq_lens[s], .window = window, .scale = scale,
            .slopes = slopes, .softcap = softcap, .sinks = sinks, .out = (char *)out + s * o_tok * elem, .o_head = o_head * elem,
            .k_scale = k_scale, .v_scale = v_scale, .num_kv_heads = num_kv_heads,
        };
        if (slots != NULL)
            store_new(&a, s, (const char *)k_new, k_tok * elem, k_head * elem, (const char *)v_new,
                      v_tok * elem, v_head * elem, slots, elem, dtype, cache_dtype, k_static, v_static);
        /* constant dtypes and head_dim / 16 at the common call sites: the compiler specialises them */
#define DECODE_ITEM(DT, CDT) do { \
            if (head_dim == 64) decode_item(&a, DT, CDT, 4); \
            else if (head_dim == 128) decode_item(&a, DT, CDT, 8); \
            else decode_item(&a, DT, CDT, head_dim / 16); \
        } while (0)
        if (dtype == DTYPE_F32) {
            if (cache_dtype == CACHE_I8) DECODE_ITEM(DTYPE_F32, CACHE_I8);
            else if (cache_dtype == CACHE_FP8) DECODE_ITEM(DTYPE_F32, CACHE_FP8);
            else DECODE_ITEM(DTYPE_F32, DTYPE_F32);
        } else {
            if (cache_dtype == CACHE_I8) DECODE_ITEM(DTYPE_BF16, CACHE_I8);
            else if (cache_dtype == CACHE_FP8) DECODE_ITEM(DTYPE_BF16, CACHE_FP8);
            else DECODE_ITEM(DTYPE_BF16, DTYPE_BF16);
        }
#undef DECODE_ITEM
    }
}
