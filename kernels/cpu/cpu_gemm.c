/* GEMM for the CPU linear layers: y [m, n] = x [m, k] @ W [n, k]^T (+ bias), float32 or bfloat16,
 * float32 sums.
 *
 * Built where the compiler targets AVX-512 (-march=native on such a CPU): float32 needs AVX512F,
 * bfloat16 AVX512-BF16. gemm_supported(dtype) says which; elsewhere the library has only that function,
 * which answers 0, and the layers keep oneDNN's packed product.
 *
 * Weight layout, written once at load by pack_weight ("tile-packed"): 64 bytes per step of k:
 *   float32:  P [ceil(n / 16)][k][16]          tile t holds output columns 16t .. 16t+15;
 *   bfloat16: P [ceil(n / 16)][k / 2][16][2]   for each pair of input columns (2j, 2j+1) the 16 columns'
 *             two weights side by side, the operand layout of vdpbf16ps (k must be even).
 * Columns past n are zero. One instruction then adds, for one row of x, one step of k into 16 sums:
 *   float32:  acc[row] += x[row, j] (broadcast) * P[t][j]                      (vfmadd231ps)
 *   bfloat16: acc[row] += x[row, 2j] * P[t][j][:, 0] + x[row, 2j+1] * P[t][j][:, 1]   (vdpbf16ps)
 *
 * Why not oneDNN: at decode sizes (m = 1..64 rows) the product is a stream over the whole weight, and
 * oneDNN read bf16 weights at ~27 GB/s where this loop, with each tile's weights prefetched 4 KB ahead,
 * reads at ~40 GB/s (docs/design/kernels.md: the measurements). Rows up to 16 share one pass over a
 * tile (one weight load feeds 16 products); more rows go in blocks of 12 rows over two tiles, so the
 * weights of a tile pair are loaded from memory once and from cache for the later blocks.
 *
 * Sums are float32 in k order (bfloat16: the two products of a pair added inside vdpbf16ps); bfloat16
 * outputs are rounded once at the end, nearest even, as torch rounds (cpu_vec.h: store16_first). */
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#ifdef __AVX512F__
#include <omp.h>

#define TILE 16                 /* output columns per tile: one zmm of float32 sums */
#define STEP_BYTES 64           /* one tile's weights for one step of k */
#define PREFETCH_STEPS 64       /* prefetch distance: 64 steps * 64 bytes = 4 KB ahead */
#define BLOCK_ROWS 12           /* rows per block when m > 16 (12 rows x 2 tiles = 24 accumulators) */

#ifdef __AVX512BF16__
#define HAS_BF16 1
#else
#define HAS_BF16 0
#endif

int gemm_supported(int dtype) { return dtype == DTYPE_F32 || (dtype == DTYPE_BF16 && HAS_BF16); }

/* steps of k per tile: k (float32) or k / 2 (bfloat16 pairs) */
static inline int64_t steps_of(int64_t k, int dtype) { return dtype == DTYPE_BF16 ? k / 2 : k; }

/* w [n, k] row-major (float32, or bfloat16 bits with k even) -> p (tile-packed, above) */
void pack_weight(const void *w, int64_t n, int64_t k, void *p, int dtype, int threads) {
    const int64_t steps = steps_of(k, dtype), tiles = (n + TILE - 1) / TILE;
    const int per_step = dtype == DTYPE_BF16 ? 2 : 1;       /* input columns per step */
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t j = 0; j < steps; j++)
            for (int64_t c = 0; c < TILE; c++)
                for (int e = 0; e < per_step; e++) {
                    const int64_t row = t * TILE + c, src = row * k + per_step * j + e;
                    const int64_t dst = ((t * steps + j) * TILE + c) * per_step + e;
                    if (dtype == DTYPE_BF16)
                        ((uint16_t *)p)[dst] = row < n ? ((const uint16_t *)w)[src] : 0;
                    else
                        ((float *)p)[dst] = row < n ? ((const float *)w)[src] : 0.0f;
                }
}

/* acc += one step of k: x's 4 bytes (a float32, or a bfloat16 pair) times the tile's 64 bytes w (vdpbf16ps:
 * the instruction this kernel exists for, so it is named here) */
static inline v16f madd(v16f acc, uint32_t x, v16i w, int dtype) {
#if HAS_BF16
    if (dtype == DTYPE_BF16)
        return (v16f)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)x), (__m512bh)w);
#endif
    union { uint32_t u; float f; } v = {.u = x};
    return fma16(splat16(v.f), (v16f)w, acc);
}

/* the tile's 64 bytes for one step of k */
static inline v16i load_step(const char *src) {
    v16i w;
    memcpy(&w, src, sizeof w);
    return w;
}

/* rows x (tiles * 16) outputs. x: rows of 4-byte steps (row stride xs steps); tile 0 at pt and tile 1
 * (tiles == 2) right after it; columns = output columns left from this tile on (may be < 16);
 * bias and y element pointers of dtype (element size `size`) */
static inline __attribute__((always_inline)) void block(
        const uint32_t *x, int64_t xs, const int rows, const int tiles, int64_t steps, const char *pt,
        const char *bias, char *y, int64_t ys, int64_t columns, const int dtype) {
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    v16f acc[16][2];
    #pragma GCC unroll 16
    for (int i = 0; i < rows; i++)
        #pragma GCC unroll 2
        for (int t = 0; t < tiles; t++) acc[i][t] = splat16(0.0f);
    const char *pt1 = pt + steps * STEP_BYTES;
    for (int64_t j = 0; j < steps; j++) {
        const v16i w0 = load_step(pt + j * STEP_BYTES);
        __builtin_prefetch(pt + (j + PREFETCH_STEPS) * STEP_BYTES, 0, 3);
        v16i w1 = w0;
        if (tiles == 2) {
            w1 = load_step(pt1 + j * STEP_BYTES);
            __builtin_prefetch(pt1 + (j + PREFETCH_STEPS) * STEP_BYTES, 0, 3);
        }
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++) {
            const uint32_t a = x[i * xs + j];
            acc[i][0] = madd(acc[i][0], a, w0, dtype);
            if (tiles == 2) acc[i][1] = madd(acc[i][1], a, w1, dtype);
        }
    }
    #pragma GCC unroll 2
    for (int t = 0; t < tiles; t++) {
        const int64_t left = columns - TILE * t;        /* outputs of this tile that exist (> 16: all) */
        const v16f b = bias ? load16_first(bias + TILE * t * size, left, dtype) : splat16(0.0f);
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++) store16_first(y + (i * ys + TILE * t) * size, left, acc[i][t] + b, dtype);
    }
}

#define ROWS_CASE(R) case R: \
    if (dtype == DTYPE_BF16) block(x, xs, R, 1, steps, pt, bias, y, ys, columns, DTYPE_BF16); \
    else block(x, xs, R, 1, steps, pt, bias, y, ys, columns, DTYPE_F32); \
    break;
/* rows (1..16) x one tile, the row count and dtype constants in each instance */
static void one_tile(const uint32_t *x, int64_t xs, int rows, int64_t steps, const char *pt, const char *bias,
                     char *y, int64_t ys, int64_t columns, int dtype) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
        ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14)
        ROWS_CASE(15) ROWS_CASE(16)
    }
}

static void two_tiles(const uint32_t *x, int64_t xs, int64_t steps, const char *pt, const char *bias,
                      char *y, int64_t ys, int64_t columns, int dtype) {
    if (dtype == DTYPE_BF16) block(x, xs, BLOCK_ROWS, 2, steps, pt, bias, y, ys, columns, DTYPE_BF16);
    else block(x, xs, BLOCK_ROWS, 2, steps, pt, bias, y, ys, columns, DTYPE_F32);
}

/* x [m, k] of dtype (row stride x_stride elements; bfloat16: k even); p tile-packed W [n, k]; bias [n]
 * or NULL; y [m, n] (row stride y_stride). x rows are read 4 bytes at a time (a float32, a bf16 pair). */
void gemm(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *p, int64_t n, const void *bias,
          void *y, int64_t y_stride, int dtype, int threads) {
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t steps = steps_of(k, dtype), tiles = (n + TILE - 1) / TILE, xs = x_stride * size / 4;
    const int64_t tile_bytes = steps * STEP_BYTES;
    const uint32_t *x32 = (const uint32_t *)x;
    const char *pc = (const char *)p, *bc = (const char *)bias;
    char *yc = (char *)y;
    if (m <= 16) {
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = 0; t < tiles; t++)
            one_tile(x32, xs, (int)m, steps, pc + t * tile_bytes, bc ? bc + t * TILE * size : 0,
                     yc + t * TILE * size, y_stride, n - t * TILE, dtype);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t q = 0; q < (tiles + 1) / 2; q++) {
        const int64_t t = 2 * q;
        for (int64_t r = 0; r < m; r += BLOCK_ROWS) {
            const int64_t rows = m - r < BLOCK_ROWS ? m - r : BLOCK_ROWS;
            char *yr = yc + r * y_stride * size;
            if (t + 1 < tiles && rows == BLOCK_ROWS) {
                two_tiles(x32 + r * xs, xs, steps, pc + t * tile_bytes, bc ? bc + t * TILE * size : 0,
                          yr + t * TILE * size, y_stride, n - t * TILE, dtype);
                continue;
            }
            for (int64_t u = t; u < t + 2 && u < tiles; u++)
                one_tile(x32 + r * xs, xs, (int)rows, steps, pc + u * tile_bytes, bc ? bc + u * TILE * size : 0,
                         yr + u * TILE * size, y_stride, n - u * TILE, dtype);
        }
    }
}

#else

int gemm_supported(int dtype) { (void)dtype; return 0; }

#endif
