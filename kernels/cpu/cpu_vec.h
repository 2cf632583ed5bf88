/* The one vector header of the CPU C kernels (cpu_decode.c, cpu_prefill.c, cpu_fused.c, cpu_gemm.c):
 * the dtype codes, and 8- and 16-float vectors with every operation the kernels share, written once.
 *
 * Vectors are GCC vector extensions: -march=native turns a 16-float vector into one AVX-512 register or
 * two AVX2 ones, so one source serves both CPU kinds. Intrinsics appear only in this header, where GCC
 * compiles the generic 16-lane form badly (fma, byte and bfloat16 widening, bfloat16 rounding, exp16 and
 * a select on a comparison: masks instead of selects); each such spelling gives the generic form's bits
 * (tests/kernels/test_cpu_vec.py). A kernel names an instruction only where the kernel exists for it
 * (cpu_gemm.c: vdpbf16ps).
 *
 * Numerics, the same at either width and in every source file:
 * - bfloat16 is the upper half of a float32; float32 -> bfloat16 rounds to nearest even as torch does,
 *   and a NaN stays a quiet NaN (to_bf16, bf16_bits8/16, round1/8/16);
 * - exp8 / exp16 (for x <= 0) use explicit fused multiply-adds, so a source compiled with
 *   fp-contract=off (cpu_fused.c) gets the same bits as one compiled with contraction.
 * cpu_build.py hashes this header with each source, so a change here rebuilds them. */
#ifndef PAGEDRAY_CPU_VEC_H
#define PAGEDRAY_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define DTYPE_F32 0
#define DTYPE_BF16 1

/* bytes per element of dtype */
static inline int64_t dtype_size(int dtype) { return dtype == DTYPE_F32 ? 4 : 2; }

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v8f splat8(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* mask lanes (all ones / all zeros, as comparisons give) pick yes, the others no */
static inline v8f select8(v8i mask, v8f yes, v8f no) { return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask)); }
static inline v16f select16(v16i mask, v16f yes, v16f no) { return (v16f)(((v16i)yes & mask) | ((v16i)no & ~mask)); }

/* yes where a < b (ordered), no elsewhere: one compare into a mask register and one blend on AVX-512,
 * where the generic select16 of a comparison costs three instructions */
static inline v16f select16_lt(v16f a, v16f b, v16f yes, v16f no) {
#if defined(__AVX512F__)
    return (v16f)_mm512_mask_blend_ps(_mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_LT_OQ), (__m512)no, (__m512)yes);
#else
    return select16(a < b, yes, no);
#endif
}

/* -|x| (sets the sign bit) */
static inline v8f neg_abs8(v8f x) { return (v8f)((v8u)x | 0x80000000u); }
static inline v16f neg_abs16(v16f x) { return (v16f)((v16u)x | 0x80000000u); }

/* lanes 0-7, lanes 8-15, and their sum */
static inline v8f low8(v16f x) { return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7); }
static inline v8f high8(v16f x) { return __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline v8f halves_sum(v16f x) { return low8(x) + high8(x); }

/* horizontal sums (a fixed pairwise order) and maxima */
static inline float hsum8(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }
static inline float hsum16(v16f v) { return hsum8(halves_sum(v)); }

static inline float hmax8(v8f v) {
    float x = v[0];
    for (int i = 1; i < 8; i++) x = v[i] > x ? v[i] : x;
    return x;
}

static inline float hmax16(v16f v) {
    float x = v[0];
    for (int i = 1; i < 16; i++) x = v[i] > x ? v[i] : x;
    return x;
}

/* a * b + c rounded once, whatever the source's fp-contract setting */
static inline v8f fma8(v8f a, v8f b, v8f c) {
#if defined(__FMA__) || defined(__AVX512F__)
    return (v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    v8f r;
    for (int i = 0; i < 8; i++) r[i] = __builtin_fmaf(a[i], b[i], c[i]);
    return r;
#endif
}

static inline v16f fma16(v16f a, v16f b, v16f c) {
#if defined(__AVX512F__)
    return (v16f)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    const v8f lo = fma8(low8(a), low8(b), low8(c)), hi = fma8(high8(a), high8(b), high8(c));
    return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* ---- loads: elements of dtype at src as float32 ---- */

static inline v8f load8(const char *src, int dtype) {
    if (dtype == DTYPE_F32) {
        v8f r;
        memcpy(&r, src, sizeof r);
        return r;
    }
    v8h h;
    memcpy(&h, src, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

static inline v16f load16_f32(const char *src) {
    v16f r;
    memcpy(&r, src, sizeof r);
    return r;
}

static inline v16f load16_bf16(const char *src) {
#if defined(__AVX512F__)      /* one vpmovzxwd (GCC 12 widens the generic form in two halves) */
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16);
#else
    v16h h;
    memcpy(&h, src, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
#endif
}

static inline v16f load16(const char *src, int dtype) {
    return dtype == DTYPE_F32 ? load16_f32(src) : load16_bf16(src);
}

/* the first n (0..16) elements at src, the other lanes 0; never reads past element n */
static inline v16f load16_first(const char *src, int64_t n, int dtype) {
    if (n >= 16) return load16(src, dtype);
    char buf[64] __attribute__((aligned(64))) = {0};
    memcpy(buf, src, (size_t)(n * dtype_size(dtype)));
    return load16(buf, dtype);
}

/* 16 bytes at src widened to 16 int32, sign- or zero-extended (one instruction on AVX-512, two on
 * AVX2; GCC's own vector conversion of bytes goes one element at a time) */
static inline v16i load16_bytes(const char *src, int is_signed) {
    v16i r;
#if defined(__AVX512F__)
    __m128i b;
    memcpy(&b, src, sizeof b);
    const __m512i w = is_signed ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
    memcpy(&r, &w, sizeof r);
#elif defined(__AVX2__)
    __m128i b;
    memcpy(&b, src, sizeof b);
    const __m128i h = _mm_srli_si128(b, 8);
    const __m256i lo = is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
    const __m256i hi = is_signed ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
    memcpy(&r, &lo, sizeof lo);
    memcpy((char *)&r + sizeof lo, &hi, sizeof hi);
#else
    for (int i = 0; i < 16; i++) r[i] = is_signed ? (int32_t)(int8_t)src[i] : (int32_t)(uint8_t)src[i];
#endif
    return r;
}

/* ---- float32 -> bfloat16 as torch rounds: nearest even, a NaN stays a quiet NaN ---- */

static inline uint16_t to_bf16(float x) {
    union { uint32_t u; float f; } v = {.f = x};
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu)) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

static inline v8u bf16_bits8(v8f x) {
    const v8u u = (v8u)x;
    const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v8u nan = (v8u)(((u & 0x7f800000u) == 0x7f800000u) & ((u & 0x7fffffu) != 0));
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
}

static inline v16u bf16_bits16(v16f x) {
#if defined(__AVX512F__)      /* bf16_bits8's steps on mask registers: about half the instructions */
    const __m512i u = (__m512i)x;
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q);
    return (v16u)_mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
#else
    const v16u u = (v16u)x;
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v16u nan = (v16u)(((u & 0x7f800000u) == 0x7f800000u) & ((u & 0x7fffffu) != 0));
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
#endif
}

/* x rounded to dtype, as float32 values */
static inline float round1(float x, int dtype) {
    if (dtype == DTYPE_F32) return x;
    union { uint32_t u; float f; } v = {.u = (uint32_t)to_bf16(x) << 16};
    return v.f;
}

static inline v8f round8(v8f x, int dtype) { return dtype == DTYPE_F32 ? x : (v8f)(bf16_bits8(x) << 16); }
static inline v16f round16(v16f x, int dtype) { return dtype == DTYPE_F32 ? x : (v16f)(bf16_bits16(x) << 16); }

/* ---- stores: float32 values to dst as dtype ---- */

static inline void store_float(char *dst, float x, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, &x, sizeof x);
        return;
    }
    const uint16_t h = to_bf16(x);
    memcpy(dst, &h, sizeof h);
}

static inline void store8(char *dst, v8f x, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, &x, sizeof x);
        return;
    }
    const v8h h = __builtin_convertvector(bf16_bits8(x), v8h);
    memcpy(dst, &h, sizeof h);
}

static inline void store16(char *dst, v16f x, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, &x, sizeof x);
        return;
    }
    const v16h h = __builtin_convertvector(bf16_bits16(x), v16h);
    memcpy(dst, &h, sizeof h);
}

/* the first n (0..16) lanes of x; never writes past element n */
static inline void store16_first(char *dst, int64_t n, v16f x, int dtype) {
    if (n >= 16) {
        store16(dst, x, dtype);
        return;
    }
    char buf[64] __attribute__((aligned(64)));
    store16(buf, x, dtype);
    memcpy(dst, buf, (size_t)(n * dtype_size(dtype)));
}

/* ---- exp(x) for x <= 0 or -inf (attention: scores minus their running max; SiLU: exp(-|x|)) ----
 * x = n ln2 + r with n = trunc(x log2(e) - 1/2) (x log2(e) rounded, ties down), exp(r) by a degree-6
 * polynomial, 2^n built in the exponent bits. Relative error ~2e-7; x below -87 gives 0. Written once
 * for both widths (V: the vector type, W: its width). */
#define DEFINE_EXP(W, V, VI)                                                                        \
    static inline V exp##W(V x) {                                                                   \
        const VI tiny = x < splat##W(-87.0f);                                                       \
        const V xc = select##W(tiny, splat##W(-87.0f), x);                                          \
        const VI n = __builtin_convertvector(fma##W(xc, splat##W(1.44269504088896341f), splat##W(-0.5f)), VI); \
        const V nf = __builtin_convertvector(n, V);                                                 \
        V r = fma##W(-nf, splat##W(0.693145751953125f), xc);                                        \
        r = fma##W(-nf, splat##W(1.428606765330187e-06f), r);                                      \
        V p = splat##W(1.0f / 720.0f);                                                              \
        p = fma##W(p, r, splat##W(1.0f / 120.0f));                                                  \
        p = fma##W(p, r, splat##W(1.0f / 24.0f));                                                   \
        p = fma##W(p, r, splat##W(1.0f / 6.0f));                                                    \
        p = fma##W(p, r, splat##W(0.5f));                                                           \
        p = fma##W(p, r, splat##W(1.0f));                                                           \
        p = fma##W(p, r, splat##W(1.0f));                                                           \
        const V two_n = (V)((n + 127) << 23);                                                       \
        return select##W(tiny, splat##W(0.0f), p * two_n);                                          \
    }
DEFINE_EXP(8, v8f, v8i)
#if defined(__AVX512F__)
/* exp8's steps, one for one, on one register with mask registers for the two selects (the generic form
 * spends two instructions on each); the same bits lane for lane (tests/kernels/test_cpu_vec.py) */
static inline v16f exp16(v16f x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    const __m512 xc = _mm512_mask_blend_ps(tiny, (__m512)x, _mm512_set1_ps(-87.0f));
    const __m512i n = _mm512_cvttps_epi32(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(-0.5f)));
    const __m512 nf = _mm512_cvtepi32_ps(n);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693145751953125f), xc);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 two_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
    return (v16f)_mm512_maskz_mul_ps((__mmask16)~tiny, p, two_n);
}
#else
DEFINE_EXP(16, v16f, v16i)
#endif
#undef DEFINE_EXP

/* SiLU(g) * u as torch computes F.silu(gate) * up in dtype: silu = g / (1 + exp(-g)) in float32, rounded to
 * dtype, times u (the caller's store rounds the product). g and u hold values of dtype. exp16 takes
 * exp(-|g|) <= 1, so a negative g goes as g * e / (1 + e), the same value. Shared by cpu_fused.c's
 * silu_mul_rows and cpu_gemm.c's fused gate/up product, so the two give the same bits. */
static inline v16f silu_mul16(v16f g, v16f u, int dtype) {
    const v16f e = exp16(neg_abs16(g));
    const v16f silu = select16_lt(g, splat16(0.0f), g * e, g) / (splat16(1.0f) + e);
    return round16(silu, dtype) * u;
}

#endif
