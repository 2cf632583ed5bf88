/* The LoRA product of a step's rows on CPU, every adapter at once (workers/lora/slots.py): for each token t
 * whose slot s = slots[t] is >= 0,
 *
 *     y[t] += scale[s] * ((x[t] @ A[s]^T) @ E[s])
 *
 * with A [S, nr, in] (nr = segments x R: each segment's A rows, zero-padded to rank R) and E [S, nr, out]
 * (segment j's R rows hold its B^T in output columns [seg_off[j], seg_off[j + 1]) and nothing elsewhere:
 * only those blocks are read). Shrink, expand, then the scale: PEFT's order of operations. Sums in float32;
 * a bfloat16 y is rounded once per element, after the add. One call per layer instead of a handful of torch
 * ops per adapter: the step's cost no longer grows with the number of adapters it mixes.
 *
 * Work item = a block of up to BLOCK tokens of one slot (``order`` lists the tokens with a slot, sorted by
 * slot; OpenMP, dynamic): each A row and each 16 columns of E are loaded once for the whole block, which
 * keeps BLOCK accumulators in registers (a small GEMM's micro-kernel). Built and loaded by cpu_lora.py;
 * called through ctypes with raw pointers and element strides (the last dim of every tensor contiguous).
 * Limits (checked by the caller): nr <= MAX_NR.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#define MAX_NR 2048     /* segments x rank */
#define BLOCK 8         /* tokens of one slot per work item */

static inline float load_one(const char *base, int64_t i, int dtype) {
    if (dtype == DTYPE_F32) {
        float v;
        memcpy(&v, base + i * 4, 4);
        return v;
    }
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[i] << 16;
    float v;
    memcpy(&v, &bits, 4);
    return v;
}

/* tokens tok[0..tb) of slot s: y[tok] += scale * ((x[tok] @ A^T) @ E), tb a constant at each call site */
static inline __attribute__((always_inline)) void block(
        const char *x, int64_t xs, int64_t in, const char *as, const char *es, int64_t nr, int64_t out,
        const int64_t *seg_off, int64_t nseg, const int32_t *tok, const int tb, float scale, char *y, int64_t ys,
        const int dtype) {
    const int64_t size = dtype_size(dtype), rank = nr / nseg, vin = in / 16 * 16;
    const char *xt[BLOCK];
    char *yt[BLOCK];
    for (int b = 0; b < tb; b++) {
        xt[b] = x + tok[b] * xs * size;
        yt[b] = y + tok[b] * ys * size;
    }
    float shrunk[BLOCK][nr];
    for (int64_t r = 0; r < nr; r++) {                       /* shrink: each A row once for the block */
        const char *ar = as + r * in * size;
        v16f acc[BLOCK];
        for (int b = 0; b < tb; b++) acc[b] = splat16(0.0f);
        for (int64_t i = 0; i < vin; i += 16) {
            const v16f w = load16(ar + i * size, dtype);
            for (int b = 0; b < tb; b++) acc[b] = fma16(load16(xt[b] + i * size, dtype), w, acc[b]);
        }
        for (int b = 0; b < tb; b++) {
            float sum = hsum16(acc[b]);
            for (int64_t i = vin; i < in; i++) sum += load_one(xt[b], i, dtype) * load_one(ar, i, dtype);
            shrunk[b][r] = sum;
        }
    }
    for (int64_t j = 0; j < nseg; j++) {                     /* expand: each 16 columns of E once */
        const int64_t lo = seg_off[j], hi = seg_off[j + 1], vec = lo + (hi - lo) / 16 * 16;
        for (int64_t o = lo; o < vec; o += 16) {
            v16f acc[BLOCK];
            for (int b = 0; b < tb; b++) acc[b] = splat16(0.0f);
            for (int64_t r = j * rank; r < (j + 1) * rank; r++) {
                const v16f w = load16(es + (r * out + o) * size, dtype);
                for (int b = 0; b < tb; b++) acc[b] = fma16(splat16(shrunk[b][r]), w, acc[b]);
            }
            for (int b = 0; b < tb; b++)
                store16(yt[b] + o * size, fma16(acc[b], splat16(scale), load16(yt[b] + o * size, dtype)), dtype);
        }
        for (int64_t o = vec; o < hi; o++) {
            for (int b = 0; b < tb; b++) {
                float acc = 0.0f;
                for (int64_t r = j * rank; r < (j + 1) * rank; r++) acc += shrunk[b][r] * load_one(es, r * out + o, dtype);
                store_float(yt[b] + o * size, load_one(yt[b], o, dtype) + acc * scale, dtype);
            }
        }
    }
}

#define BLOCK_CASE(TB) case TB: \
    if (dtype == DTYPE_F32) block(x, xs, in, as, es, nr, out, seg_off, nseg, tok, TB, scale, y, ys, DTYPE_F32); \
    else block(x, xs, in, as, es, nr, out, seg_off, nseg, tok, TB, scale, y, ys, DTYPE_BF16); \
    break;

/* x [tokens, in] (row stride xs); a [S, nr, in], e [S, nr, out] contiguous; seg_off [nseg + 1] column
 * offsets of the segments in y (seg_off[nseg] = out); each segment has nr / nseg rows of A and E; order
 * [count] int32: the tokens with a slot, sorted by slot; slots [tokens] int32 (-1: none); scales [S]
 * float32; y [tokens, out] (row stride ys), updated in place. Returns 0, or -1 when out of memory. */
int lora_add(const void *x, int64_t xs, int64_t in, const void *a, const void *e, int64_t nr, int64_t out,
             const int64_t *seg_off, int64_t nseg, const int32_t *order, int64_t count, const int32_t *slots,
             const float *scales, void *y, int64_t ys, int dtype, int threads) {
    const int64_t size = dtype_size(dtype);
    int64_t *starts = malloc((size_t)(count + 1) * sizeof(int64_t));
    if (starts == NULL) return -1;
    int64_t blocks = 0;
    for (int64_t i = 0; i < count;) {                         /* runs of one slot, cut every BLOCK tokens */
        starts[blocks++] = i;
        const int32_t s = slots[order[i]];
        int64_t n = 1;
        while (i + n < count && n < BLOCK && slots[order[i + n]] == s) n++;
        i += n;
    }
    starts[blocks] = count;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && blocks > 1)
    for (int64_t k = 0; k < blocks; k++) {
        const int32_t *tok = order + starts[k];
        const int tb = (int)(starts[k + 1] - starts[k]);
        const int32_t s = slots[tok[0]];
        const char *as = (const char *)a + (int64_t)s * nr * in * size;
        const char *es = (const char *)e + (int64_t)s * nr * out * size;
        const float scale = scales[s];
        switch (tb) {
            BLOCK_CASE(1) BLOCK_CASE(2) BLOCK_CASE(3) BLOCK_CASE(4) BLOCK_CASE(5) BLOCK_CASE(6) BLOCK_CASE(7)
            BLOCK_CASE(8)
        }
    }
    free(starts);
    return 0;
}
