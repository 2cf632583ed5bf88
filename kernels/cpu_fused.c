/* Two of the decoder's small ops for the CPU, one call each instead of 4-9 torch ops: RMSNorm (with
 * the residual add) and rotate-half rotary. Built and loaded by cpu_fused.py; called through
 * ctypes with raw pointers and element strides.
 *
 * Numerics follow fused_reference.py op for op: every op that torch runs on a bfloat16 tensor rounds
 * its result to bfloat16 here too (rnd), and no multiply-add is contracted into an FMA (the functions
 * are compiled with fp-contract=off), so a product or sum rounds exactly as torch's does. What differs
 * from torch: the order of the RMSNorm's sum of squares, so a float32 RMSNorm can differ in the last
 * bit (its 1 / sqrt moves by an ulp); after a bfloat16 rounding it did not in the tests.
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

/* rows x size. With residual: s = rnd(x + residual) is written to new_residual; else s = x. Then
 * out = rnd(weight * rnd(s * 1 / sqrt(mean(s * s) + eps))), the mean in float32. out may be x. */
void rms_norm_rows(const void *x, int64_t x_row, const void *residual, int64_t r_row,
                          const void *weight, void *out, int64_t o_row, void *new_residual, int64_t n_row,
                          int64_t rows, int64_t size, float eps, int dtype, int threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_row * elem;
        const char *src = xr;
        const int64_t vec = size / 8 * 8;
        if (residual != NULL) {
            const char *rr = (const char *)residual + r * r_row * elem;
            char *nr = (char *)new_residual + r * n_row * elem;
            for (int64_t i = 0; i < vec; i += 8) store8(nr, i, load8_at(xr, i, dtype) + load8_at(rr, i, dtype), dtype);
            for (int64_t i = vec; i < size; i++) store1(nr, i, load1(xr, i, dtype) + load1(rr, i, dtype), dtype);
            src = nr;
        }
        v8f lanes = splat(0.0f);
        for (int64_t i = 0; i < vec; i += 8) {
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
        for (int64_t i = 0; i < vec; i += 8) {
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
