/* Three of the decoder's small ops for the CPU, one call each instead of 3-9 torch ops: RMSNorm (with
 * the residual add), rotate-half rotary and SiLU(gate) * up; and the store of a step's keys and values into
 * a cache of their own dtype (a copy per token row, where torch's index_copy_ first copied the strided rows). Built and loaded by cpu_fused.py; called through
 * ctypes with raw pointers and element strides.
 *
 * Numerics follow reference/fused.py op for op: every op that torch runs on a bfloat16 tensor rounds
 * its result to bfloat16 here too (round1/8/16), and no multiply-add is contracted into an FMA (the functions
 * are compiled with fp-contract=off), so a product or sum rounds exactly as torch's does. What differs
 * from torch: the order of the RMSNorm's sum of squares, so a float32 RMSNorm can differ in the last
 * bit (its 1 / sqrt moves by an ulp); after a bfloat16 rounding it did not in the tests. SiLU's exp is
 * cpu_vec.h's exp16 / exp8 (relative error ~2e-7), not torch's: a float32 SiLU can differ by an ulp or two.
 *
 * The same source runs 16 lanes at a time (one AVX-512 register or two AVX2 ones: cpu_vec.h), then 8,
 * then one. The two vector widths give the same values; the scalar tail's SiLU uses libm's expf.
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (upper half of a float32). Row strides are in elements; the
 * last dim of every tensor is contiguous.
 */
#pragma GCC optimize("fp-contract=off")    /* every function, so that the helpers still inline */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

/* element i of a row at base, as float32 / stored there as dtype */
static inline float load1(const char *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) return ((const float *)base)[i];
    union { uint32_t u; float f; } v = {.u = (uint32_t)((const uint16_t *)base)[i] << 16};
    return v.f;
}

static inline void store1(char *base, int64_t i, float x, int dtype) { store_float(base + i * dtype_size(dtype), x, dtype); }

/* elements [i, i + 8) / [i, i + 16) of a row at base, as float32 / stored there as dtype */
static inline v8f load8_at(const char *base, int64_t i, int dtype) { return load8(base + i * dtype_size(dtype), dtype); }
static inline v16f load16_at(const char *base, int64_t i, int dtype) { return load16(base + i * dtype_size(dtype), dtype); }
static inline void store8_at(char *base, int64_t i, v8f x, int dtype) { store8(base + i * dtype_size(dtype), x, dtype); }
static inline void store16_at(char *base, int64_t i, v16f x, int dtype) { store16(base + i * dtype_size(dtype), x, dtype); }

/* rows x size. With residual: s = rnd(x + residual) is written to new_residual; else s = x. Then
 * out = rnd(weight * rnd(s * 1 / sqrt(mean(s * s) + eps))), the mean in float32. out may be x. */
void rms_norm_rows(const void *x, int64_t x_row, const void *residual, int64_t r_row,
                   const void *weight, void *out, int64_t o_row, void *new_residual, int64_t n_row,
                   int64_t rows, int64_t size, float eps, int dtype, int threads) {
    const int64_t elem = dtype_size(dtype);
    const int64_t vec16 = size / 16 * 16, vec = size / 8 * 8;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows >= 64)
    for (int64_t r = 0; r < rows; r++) {
        const char *xr = (const char *)x + r * x_row * elem;
        const char *src = xr;
        if (residual != NULL) {
            const char *rr = (const char *)residual + r * r_row * elem;
            char *nr = (char *)new_residual + r * n_row * elem;
            for (int64_t i = 0; i < vec16; i += 16) store16_at(nr, i, load16_at(xr, i, dtype) + load16_at(rr, i, dtype), dtype);
            for (int64_t i = vec16; i < vec; i += 8) store8_at(nr, i, load8_at(xr, i, dtype) + load8_at(rr, i, dtype), dtype);
            for (int64_t i = vec; i < size; i++) store1(nr, i, load1(xr, i, dtype) + load1(rr, i, dtype), dtype);
            src = nr;
        }
        /* lane j sums the squares of elements j, j + 8, j + 16, ... in that order, whatever the vector width */
        v8f lanes = splat8(0.0f);
        for (int64_t i = 0; i < vec16; i += 16) {
            const v16f v = load16_at(src, i, dtype), sq = v * v;
            lanes += low8(sq);
            lanes += high8(sq);
        }
        for (int64_t i = vec16; i < vec; i += 8) {
            const v8f v = load8_at(src, i, dtype);
            lanes += v * v;
        }
        for (int64_t i = vec; i < size; i++) {
            const float v = load1(src, i, dtype);
            lanes[i % 8] += v * v;
        }
        const float inv = 1.0f / sqrtf(hsum8(lanes) / (float)size + eps);
        char *o = (char *)out + r * o_row * elem;
        for (int64_t i = 0; i < vec16; i += 16)
            store16_at(o, i, load16_at(weight, i, dtype) * round16(load16_at(src, i, dtype) * inv, dtype), dtype);
        for (int64_t i = vec16; i < vec; i += 8)
            store8_at(o, i, load8_at(weight, i, dtype) * round8(load8_at(src, i, dtype) * inv, dtype), dtype);
        for (int64_t i = vec; i < size; i++)
            store1(o, i, load1(weight, i, dtype) * round1(load1(src, i, dtype) * inv, dtype), dtype);
    }
}

/* x [tokens, heads, D] (token stride x_tok, head stride D) -> out [tokens, heads, D] (contiguous):
 * out = rnd(rnd(x * cos) + rnd(roll(x, D / 2) * signed_sin)), cos / signed_sin [tokens, D] in dtype. */
void rotary_rows(const void *x, int64_t x_tok, const void *cos, const void *signed_sin, void *out,
                 int64_t tokens, int64_t heads, int64_t head_dim, int dtype, int threads) {
    const int64_t elem = dtype_size(dtype), half = head_dim / 2;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && tokens >= 64)
    for (int64_t t = 0; t < tokens; t++) {
        const char *c = (const char *)cos + t * head_dim * elem;
        const char *s = (const char *)signed_sin + t * head_dim * elem;
        for (int64_t h = 0; h < heads; h++) {
            const char *xr = (const char *)x + (t * x_tok + h * head_dim) * elem;
            char *o = (char *)out + ((t * heads + h) * head_dim) * elem;
            if (half % 16 == 0) {
                for (int64_t i = 0; i < head_dim; i += 16) {
                    const int64_t src = i < half ? i + half : i - half;
                    const v16f a = round16(load16_at(xr, i, dtype) * load16_at(c, i, dtype), dtype);
                    const v16f b = round16(load16_at(xr, src, dtype) * load16_at(s, i, dtype), dtype);
                    store16_at(o, i, a + b, dtype);
                }
            } else if (half % 8 == 0) {
                for (int64_t i = 0; i < head_dim; i += 8) {
                    const int64_t src = i < half ? i + half : i - half;
                    const v8f a = round8(load8_at(xr, i, dtype) * load8_at(c, i, dtype), dtype);
                    const v8f b = round8(load8_at(xr, src, dtype) * load8_at(s, i, dtype), dtype);
                    store8_at(o, i, a + b, dtype);
                }
            } else {
                for (int64_t i = 0; i < head_dim; i++) {
                    const int64_t src = i < half ? i + half : i - half;
                    const float a = round1(load1(xr, i, dtype) * load1(c, i, dtype), dtype);
                    const float b = round1(load1(xr, src, dtype) * load1(s, i, dtype), dtype);
                    store1(o, i, a + b, dtype);
                }
            }
        }
    }
}

/* gate_up [rows, 2 * inter] (row stride gu_row; gate first, then up) -> out [rows, inter] (row stride o_row):
 * out = rnd(rnd(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in float32 as torch's F.silu, then the
 * product as torch's mul (bfloat16: each result rounded). exp16 / exp8 take exp(-|g|) <= 1, so a negative
 * g goes as g * e / (1 + e), the same value. */
void silu_mul_rows(const void *gate_up, int64_t gu_row, void *out, int64_t o_row, int64_t rows, int64_t inter,
                   int dtype, int threads) {
    const int64_t elem = dtype_size(dtype);
    const int64_t vec16 = inter / 16 * 16, vec = inter / 8 * 8;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows * inter >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        const char *g = (const char *)gate_up + r * gu_row * elem, *u = g + inter * elem;
        char *o = (char *)out + r * o_row * elem;
        for (int64_t i = 0; i < vec16; i += 16)
            store16_at(o, i, silu_mul16(load16_at(g, i, dtype), load16_at(u, i, dtype), dtype), dtype);
        for (int64_t i = vec16; i < vec; i += 8) {
            const v8f x = load8_at(g, i, dtype);
            const v8f e = exp8(neg_abs8(x));
            const v8f silu = select8(x < splat8(0.0f), x * e, x) / (splat8(1.0f) + e);
            store8_at(o, i, round8(silu, dtype) * load8_at(u, i, dtype), dtype);
        }
        for (int64_t i = vec; i < inter; i++) {
            const float x = load1(g, i, dtype), e = expf(x < 0.0f ? x : -x);
            const float silu = (x < 0.0f ? x * e : x) / (1.0f + e);
            store1(o, i, round1(silu, dtype) * load1(u, i, dtype), dtype);
        }
    }
}

/* key / value [tokens, row] (token strides k_tok / v_tok, rows contiguous; row = kv_heads * head_dim elements
 * of elem bytes) -> the caches' rows at slots[t] (caches [num_slots, row], contiguous). A slot < 0 or
 * >= num_slots is skipped (the callers check slots before the step; this keeps a bad one inside the cache). */
void store_kv_rows(const void *key, int64_t k_tok, const void *value, int64_t v_tok, void *k_cache, void *v_cache,
                   const int32_t *slots, int64_t tokens, int64_t row, int64_t num_slots, int64_t elem) {
    const size_t bytes = (size_t)(row * elem);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0 || slot >= num_slots) continue;
        memcpy((char *)k_cache + slot * (int64_t)bytes, (const char *)key + t * k_tok * elem, bytes);
        memcpy((char *)v_cache + slot * (int64_t)bytes, (const char *)value + t * v_tok * elem, bytes);
    }
}
