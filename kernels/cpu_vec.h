/* What the CPU C kernels (cpu_decode.c, cpu_fused.c) share: the dtype codes, 8-float vectors (GCC
 * vector extensions: AVX2 or AVX-512 code by -march=native), and float32 <-> bfloat16 as torch does
 * it (bfloat16 = the upper half of a float32; rounding to nearest even, NaN stays NaN).
 * cpu_build.py hashes this header with each source, so a change here rebuilds both. */
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

#endif
