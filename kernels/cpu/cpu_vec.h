/* What the CPU C kernels (cpu_decode.c, cpu_prefill.c, cpu_fused.c, cpu_gemm.c) share: the dtype codes,
 * 8- and 16-float vectors (GCC vector extensions: AVX2 or AVX-512 code by -march=native), float32 <->
 * bfloat16 as torch does it (bfloat16 = the upper half of a float32; rounding to nearest even, NaN stays
 * NaN) and exp8; where the compiler targets AVX-512, the same on one __m512 register (zmm_*: loads and
 * stores of 16 elements, whole or the first lanes of a mask, bfloat16 rounding and exp). cpu_build.py
 * hashes this header with each source, so a change here rebuilds them. */
#ifndef PAGEDRAY_CPU_VEC_H
#define PAGEDRAY_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* 16-float vectors (the head_dim axis of the attention kernels; head_dim is a multiple of 16): one
 * AVX-512 register, two AVX2 ones */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16f load16_f32(const char *src) {
    v16f r;
    memcpy(&r, src, sizeof r);
    return r;
}

static inline v16f load16_bf16(const char *src) {
    v16h h;
    memcpy(&h, src, sizeof h);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

/* 16 elements at src (float32 or bfloat16) as float32 */
static inline v16f load16(const char *src, int dtype) {
    return dtype == DTYPE_F32 ? load16_f32(src) : load16_bf16(src);
}

/* lanes 0-7 + lanes 8-15 */
static inline v8f halves_sum(v16f x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7)
         + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}

static inline v8f select8(v8i mask, v8f yes, v8f no) {
    return (v8f)(((v8i)yes & mask) | ((v8i)no & ~mask));
}

/* 8 elements at src (float32 or bfloat16) as float32 */
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

/* bfloat16 bits of x */
static inline uint16_t to_bf16(float x) {
    union { uint32_t u; float f; } v = {.f = x};
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu)) return (uint16_t)((v.u >> 16) | 0x40u);
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* bfloat16 bits of 8 floats */
static inline v8u bf16_bits8(v8f x) {
    const v8u u = (v8u)x;
    const v8u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const v8u nan = (v8u)(((u & 0x7f800000u) == 0x7f800000u) & ((u & 0x7fffffu) != 0));
    return (rounded & ~nan) | (((u >> 16) | 0x40u) & nan);
}

/* x stored at dst as float32 or bfloat16 */
static inline void store_float(char *dst, float x, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, &x, sizeof x);
        return;
    }
    const uint16_t h = to_bf16(x);
    memcpy(dst, &h, sizeof h);
}

/* exp(x) for x <= 0 or -inf (cpu_decode.c: scores minus their running max; cpu_fused.c: silu's
 * exp(-|x|)): x = n ln2 + r, exp(r) by a degree-6 polynomial, 2^n built in the exponent bits. Relative
 * error ~2e-7; x below -87 gives 0. */
static inline v8f exp8(v8f x) {
    const v8i tiny = x < splat(-87.0f);
    const v8f xc = select8(tiny, splat(-87.0f), x);
    const v8i n = __builtin_convertvector(xc * splat(1.44269504088896341f) - splat(0.5f), v8i);
    const v8f nf = __builtin_convertvector(n, v8f);
    const v8f r = xc - nf * splat(0.693145751953125f) - nf * splat(1.428606765330187e-06f);
    v8f p = splat(1.0f / 720.0f);
    p = p * r + splat(1.0f / 120.0f);
    p = p * r + splat(1.0f / 24.0f);
    p = p * r + splat(1.0f / 6.0f);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    const v8f two_n = (v8f)((n + 127) << 23);
    return select8(tiny, splat(0.0f), p * two_n);
}

#ifdef __AVX512F__
#include <immintrin.h>

/* 16 elements at src (float32 or bfloat16) as float32 */
static inline __m512 zmm_load(const char *src, int dtype) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps(src);
    const __m256i h = _mm256_loadu_si256((const __m256i *)src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the lanes of mask at src (float32 or bfloat16) as float32; the others 0 */
static inline __m512 zmm_load_masked(const char *src, __mmask16 mask, int dtype) {
    if (dtype == DTYPE_F32) return _mm512_maskz_loadu_ps(mask, src);
    const __m256i h = _mm256_maskz_loadu_epi16(mask, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* x rounded to bfloat16 as to_bf16 does it (nearest even; a NaN stays a quiet NaN), as float32 values */
static inline __m512 zmm_round_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    const __m512i bits = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x400000));
    return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32((int)0xffff0000u)));
}

/* x rounded to dtype, as float32 values */
static inline __m512 zmm_round(__m512 x, int dtype) {
    return dtype == DTYPE_F32 ? x : zmm_round_bf16(x);
}

/* the bfloat16 bits of x (rounded as to_bf16) */
static inline __m256i zmm_bf16_bits(__m512 x) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(zmm_round_bf16(x)), 16));
}

/* 16 float32 stored at dst as dtype */
static inline void zmm_store(char *dst, __m512 x, int dtype) {
    if (dtype == DTYPE_F32) _mm512_storeu_ps(dst, x);
    else _mm256_storeu_si256((__m256i *)dst, zmm_bf16_bits(x));
}

/* the lanes of mask of x stored at dst as dtype */
static inline void zmm_store_masked(char *dst, __mmask16 mask, __m512 x, int dtype) {
    if (dtype == DTYPE_F32) _mm512_mask_storeu_ps(dst, mask, x);
    else _mm256_mask_storeu_epi16(dst, mask, zmm_bf16_bits(x));
}

/* exp(x) for 16 x <= 0: exp8's algorithm with explicit FMAs, x below -87 gives 0 */
static inline __m512 zmm_exp_nonpositive(__m512 x) {
    const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(nf, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i n = _mm512_cvtps_epi32(nf);
    const __m512 two_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23));
    return _mm512_maskz_mul_ps((__mmask16)~tiny, p, two_n);
}
#endif

#endif
