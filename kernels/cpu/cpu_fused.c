/* Three of the decoder's small ops for the CPU, one call each instead of 3-9 torch ops: RMSNorm (with
 * the residual add), rotate-half rotary and SiLU(gate) * up. Built and loaded by cpu_fused.py; called through
 * ctypes with raw pointers and element strides.
 *
 * Numerics follow reference/fused.py op for op: every op that torch runs on a bfloat16 tensor rounds
 * its result to bfloat16 here too (rnd), and no multiply-add is contracted into an FMA (the functions
 * are compiled with fp-contract=off), so a product or sum rounds exactly as torch's does. What differs
 * from torch: the order of the RMSNorm's sum of squares, so a float32 RMSNorm can differ in the last
 * bit (its 1 / sqrt moves by an ulp); after a bfloat16 rounding it did not in the tests. SiLU's exp is
 * exp8 (cpu_vec.h, relative error ~2e-7), not torch's: a float32 SiLU can differ by an ulp or two.
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (upper half of a float32). Row strides are in elements; the
 * last dim of every tensor is contiguous.
 */
#pragma GCC optimize("fp-contract=off")    /* every function, so that the helpers still inline */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

static inline float load1(const char *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return ((const float *)base)[i];
    union { uint32_t u; float f; } v = {.u = (uint32_t)((const uint16_t *)base)[i] << 16};
    return v.f;
}

/* x rounded to dtype, as a float */
static inline float rnd(float x, int dtype) {
    if (dtype == DTYPE_F32) return x;
    union { uint32_t u; float f; } v = {.u = (uint32_t)to_bf16(x) << 16};
    return v.f;
}

static inline void store1(char *base, int64_t i, float x, int dtype) {
    store_float(base + i * (dtype == DTYPE_F32 ? 4 : 2), x, dtype);
}

/* 8 elements at base[i..i+8) as float32 */
static inline v8f load8_at(const char *base, int64_t i, int dtype) {
    return load8(base + i * (dtype == DTYPE_F32 ? 4 : 2), dtype);
}

/* x rounded to dtype, as floats */
static inline v8f rnd8(v8f x, int dtype) {
    return dtype == DTYPE_F32 ? x : (v8f)(bf16_bits8(x) << 16);
}

static inline void store8(char *base, int64_t i, v8f x, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(base + i * 4, &x, sizeof x);
        return;
    }
    const v8h h = __builtin_convertvector(bf16_bits8(x), v8h);
    memcpy(base + i * 2, &h, sizeof h);
}

#ifdef __AVX512F__
/* 16 elements at base[i..i+16) as float32 / stored there as dtype */
static inline __m512 load16_at(const char *base, int64_t i, int dtype) {
    return zmm_load(base + i * (dtype == DTYPE_F32 ? 4 : 2), dtype);
}

static inline void store16_at(char *base, int64_t i, __m512 x, int dtype) {
    zmm_store(base + i * (dtype == DTYPE_F32 ? 4 : 2), x, dtype);
}
#endif

/* rows x size. With residual: s = rnd(x + residual) is written to new_residual; else s = x. Then
 * out = rnd(weight * rnd(s * 1 / sqrt(mean(s * s) + eps))), the mean in float32. out may be x. */
void rms_norm_rows(const void *x, int64_t x_row, const void *residual, int64_t r_row,
                          const void *weight, void *out, int64_t o_row, void *new_residual, int64_t n_row,
                          int64_t rows, int64_t size, float eps, int dtype, int threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
#ifdef __AVX512F__
    const int64_t vec16 = size / 16 * 16;   /* 16 lanes where the CPU has them: the same values (see lanes) */
#else
    const int64_t vec16 = 0;
#endif
    const int64_t vec = size / 8 * 8;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_row * elem;
        const char *src = xr;
        if (residual != NULL) {
            const char *rr = (const char *)residual + r * r_row * elem;
            char *nr = (char *)new_residual + r * n_row * elem;
#ifdef __AVX512F__
            for (int64_t i = 0; i < vec16; i += 16)
                store16_at(nr, i, _mm512_add_ps(load16_at(xr, i, dtype), load16_at(rr, i, dtype)), dtype);
#endif
            for (int64_t i = vec16; i < vec; i += 8) store8(nr, i, load8_at(xr, i, dtype) + load8_at(rr, i, dtype), dtype);
            for (int64_t i = vec; i < size; i++) store1(nr, i, load1(xr, i, dtype) + load1(rr, i, dtype), dtype);
            src = nr;
        }
        /* lane j sums the squares of elements j, j + 8, j + 16, ... in that order, whatever the vector width */
        v8f lanes = splat(0.0f);
#ifdef __AVX512F__
        for (int64_t i = 0; i < vec16; i += 16) {
            const __m512 v = load16_at(src, i, dtype);
            const __m512 sq = _mm512_mul_ps(v, v);
            v8f lo, hi;
            const __m256 lo256 = _mm512_castps512_ps256(sq);
            const __m256 hi256 = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1));
            memcpy(&lo, &lo256, sizeof lo);
            memcpy(&hi, &hi256, sizeof hi);
            lanes += lo;
            lanes += hi;
        }
#endif
        for (int64_t i = vec16; i < vec; i += 8) {
            const v8f v = load8_at(src, i, dtype);
            lanes += v * v;
        }
        for (int64_t i = vec; i < size; i++) {
            const float v = load1(src, i, dtype);
            lanes[i % 8] += v * v;
        }
        const float sum = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
        const float inv = 1.0f / sqrtf(sum / (float)size + eps);
        char *o = (char *)out + r * o_row * elem;
#ifdef __AVX512F__
        const __m512 inv16 = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < vec16; i += 16) {
            const __m512 normed = zmm_round(_mm512_mul_ps(load16_at(src, i, dtype), inv16), dtype);
            store16_at(o, i, _mm512_mul_ps(load16_at(weight, i, dtype), normed), dtype);
        }
#endif
        for (int64_t i = vec16; i < vec; i += 8) {
            store8(o, i, load8_at(weight, i, dtype) * rnd8(load8_at(src, i, dtype) * inv, dtype), dtype);
        }
        for (int64_t i = vec; i < size; i++) {
            store1(o, i, load1(weight, i, dtype) * rnd(load1(src, i, dtype) * inv, dtype), dtype);
        }
    }
}

/* x [tokens, heads, D] (token stride x_tok, head stride D) -> out [tokens, heads, D] (contiguous):
 * out = rnd(rnd(x * cos) + rnd(roll(x, D / 2) * signed_sin)), cos / signed_sin [tokens, D] in dtype. */
void rotary_rows(const void *x, int64_t x_tok, const void *cos, const void *signed_sin, void *out,
                        int64_t tokens, int64_t heads, int64_t head_dim, int dtype, int threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2, half = head_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const char *c = (const char *)cos + t * head_dim * elem;
        const char *s = (const char *)signed_sin + t * head_dim * elem;
        for (int64_t h = 0; h < heads; h++) {
            const char *xr = (const char *)x + (t * x_tok + h * head_dim) * elem;
            char *o = (char *)out + ((t * heads + h) * head_dim) * elem;
#ifdef __AVX512F__
            if (half % 16 == 0) {
                for (int64_t i = 0; i < head_dim; i += 16) {
                    const int64_t src = i < half ? i + half : i - half;
                    const __m512 a = zmm_round(_mm512_mul_ps(load16_at(xr, i, dtype), load16_at(c, i, dtype)), dtype);
                    const __m512 b = zmm_round(_mm512_mul_ps(load16_at(xr, src, dtype), load16_at(s, i, dtype)), dtype);
                    store16_at(o, i, _mm512_add_ps(a, b), dtype);
                }
                continue;
            }
#endif
            if (half % 8 == 0) {
                for (int64_t i = 0; i < head_dim; i += 8) {
                    const int64_t src = i < half ? i + half : i - half;
                    const v8f a = rnd8(load8_at(xr, i, dtype) * load8_at(c, i, dtype), dtype);
                    const v8f b = rnd8(load8_at(xr, src, dtype) * load8_at(s, i, dtype), dtype);
                    store8(o, i, a + b, dtype);
                }
                continue;
            }
            for (int64_t i = 0; i < head_dim; i++) {
                const int64_t src = i < half ? i + half : i - half;
                const float a = rnd(load1(xr, i, dtype) * load1(c, i, dtype), dtype);
                const float b = rnd(load1(xr, src, dtype) * load1(s, i, dtype), dtype);
                store1(o, i, a + b, dtype);
            }
        }
    }
}


/* gate_up [rows, 2 * inter] (row stride gu_row; gate first, then up) -> out [rows, inter] (row stride o_row):
 * out = rnd(rnd(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in float32 as torch's F.silu, then the
 * product as torch's mul (bfloat16: each result rounded). exp8 takes exp(-|g|) <= 1, so a negative g goes
 * as g * e / (1 + e), the same value. */
void silu_mul_rows(const void *gate_up, int64_t gu_row, void *out, int64_t o_row, int64_t rows, int64_t inter,
                   int dtype, int threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
#ifdef __AVX512F__
    const int64_t vec16 = inter / 16 * 16;
#else
    const int64_t vec16 = 0;
#endif
    const int64_t vec = vec16 + (inter - vec16) / 8 * 8;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + r * gu_row * elem, *u = g + inter * elem;
        char *o = (char *)out + r * o_row * elem;
#ifdef __AVX512F__
        for (int64_t i = 0; i < vec16; i += 16) {
            const __m512 x = load16_at(g, i, dtype);
            const __mmask16 negative = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 abs_x = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x),
                                                                      _mm512_set1_epi32(0x7fffffff)));
            const __m512 e = zmm_exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), abs_x));   /* exp(-|x|) */
            const __m512 num = _mm512_mask_mul_ps(x, negative, x, e);
            const __m512 silu = _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
            store16_at(o, i, _mm512_mul_ps(zmm_round(silu, dtype), load16_at(u, i, dtype)), dtype);
        }
#endif
        for (int64_t i = vec16; i < vec; i += 8) {
            const v8f x = load8_at(g, i, dtype);
            const v8i negative = x < splat(0.0f);
            const v8f e = exp8(select8(negative, x, -x));                 /* exp(-|x|) */
            const v8f silu = select8(negative, x * e, x) / (splat(1.0f) + e);
            store8(o, i, rnd8(silu, dtype) * load8_at(u, i, dtype), dtype);
        }
        for (int64_t i = vec; i < inter; i++) {
            const float x = load1(g, i, dtype), e = expf(x < 0.0f ? x : -x);
            const float silu = (x < 0.0f ? x * e : x) / (1.0f + e);
            store1(o, i, rnd(silu, dtype) * load1(u, i, dtype), dtype);
        }
    }
}
