/* bfloat16 GEMM for the CPU linear layers: y [m, n] = x [m, k] @ W [n, k]^T (+ bias), float32 sums.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere the library
 * has just gemm_bf16_supported(), which answers 0, and the layers keep oneDNN's packed product.
 *
 * Weight layout ("pair-packed"), written once at load by pack_bf16_pairs:
 *   P [ceil(n / 16)][k / 2][16][2]: tile t holds output columns 16t .. 16t+15; for each pair of input
 *   columns (2j, 2j+1) the 16 columns' two weights lie side by side, which is the operand layout of
 *   vdpbf16ps. Columns past n are zero. k must be even (the caller checks).
 * One vdpbf16ps then adds, for one row of x, the products of one input pair with 16 output columns:
 *   acc[row] (16 x f32) += x[row, 2j:2j+2] (broadcast) . P[t][j] (16 x 2 bf16).
 *
 * Why not oneDNN: at decode sizes (m = 1..64 rows) the product is a stream over the whole weight, and
 * oneDNN read it at ~27 GB/s where this loop, with each tile's weights prefetched 4 KB ahead, reads at
 * ~40 GB/s (docs/design/kernels.md: the measurements). Rows up to 16 share one pass over a tile (one
 * weight load feeds 16 products); more rows go in blocks of 12 rows over two tiles, so the weights of
 * a tile pair are loaded from memory once and from cache for the later blocks.
 *
 * Sums are float32 in k order (pairs added inside vdpbf16ps), rounded to bfloat16 once at the end,
 * nearest even, as torch rounds. */
#include <stdint.h>

#ifdef __AVX512BF16__
#include <immintrin.h>
#include <omp.h>

#define TILE 16                 /* output columns per tile: one zmm of float32 sums */
#define PREFETCH_PAIRS 64       /* prefetch distance in input pairs: 64 * 64 bytes = 4 KB ahead */
#define BLOCK_ROWS 12           /* rows per block when m > 16 (12 rows x 2 tiles = 24 accumulators) */

int gemm_bf16_supported(void) { return 1; }

/* w [n, k] row-major bfloat16 bits -> p (pair-packed, above); k even */
void pack_bf16_pairs(const uint16_t *w, int64_t n, int64_t k, uint16_t *p, int threads) {
    const int64_t pairs = k / 2, tiles = (n + TILE - 1) / TILE;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t j = 0; j < pairs; j++)
            for (int64_t c = 0; c < TILE; c++) {
                const int64_t row = t * TILE + c;
                uint16_t *dst = p + ((t * pairs + j) * TILE + c) * 2;
                dst[0] = row < n ? w[row * k + 2 * j] : 0;
                dst[1] = row < n ? w[row * k + 2 * j + 1] : 0;
            }
}

/* 16 bfloat16 at src (the first `mask` lanes) as float32 */
static inline __m512 widen16(const uint16_t *src, __mmask16 mask) {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* rows x (tiles * 16) outputs: x rows as 32-bit input pairs (row stride xs pairs), tile 0 at pt and
 * tile 1 (tiles == 2) right after it; columns = output columns left from this tile on (may be < 16) */
static inline __attribute__((always_inline)) void block(
        const uint32_t *x, int64_t xs, const int rows, const int tiles, int64_t pairs, const uint16_t *pt,
        const uint16_t *bias, uint16_t *y, int64_t ys, int64_t columns) {
    __m512 acc[16][2];
    #pragma GCC unroll 16
    for (int i = 0; i < rows; i++)
        #pragma GCC unroll 2
        for (int t = 0; t < tiles; t++) acc[i][t] = _mm512_setzero_ps();
    const uint16_t *pt1 = pt + pairs * TILE * 2;
    for (int64_t j = 0; j < pairs; j++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pt + j * TILE * 2);
        _mm_prefetch((const char *)(pt + (j + PREFETCH_PAIRS) * TILE * 2), _MM_HINT_T0);
        __m512bh w1 = w0;
        if (tiles == 2) {
            w1 = (__m512bh)_mm512_loadu_si512(pt1 + j * TILE * 2);
            _mm_prefetch((const char *)(pt1 + (j + PREFETCH_PAIRS) * TILE * 2), _MM_HINT_T0);
        }
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++) {
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)x[i * xs + j]);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
            if (tiles == 2) acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
        }
    }
    #pragma GCC unroll 2
    for (int t = 0; t < tiles; t++) {
        const int64_t left = columns - TILE * t;
        const __mmask16 mask = left >= TILE ? 0xffff : (__mmask16)((1u << left) - 1);
        const __m512 b = bias ? widen16(bias + TILE * t, mask) : _mm512_setzero_ps();
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++)
            _mm256_mask_storeu_epi16(y + i * ys + TILE * t, mask,
                                     (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][t], b)));
    }
}

#define ROWS_CASE(R) case R: block(x, xs, R, 1, pairs, pt, bias, y, ys, columns); break;
/* rows (1..16) x one tile, the row count a constant in each instance */
static void one_tile(const uint32_t *x, int64_t xs, int rows, int64_t pairs, const uint16_t *pt,
                     const uint16_t *bias, uint16_t *y, int64_t ys, int64_t columns) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6) ROWS_CASE(7)
        ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14)
        ROWS_CASE(15) ROWS_CASE(16)
    }
}

/* x [m, k] bfloat16 (row stride x_stride elements, k even); p pair-packed W [n, k]; bias [n] or NULL;
 * y [m, n] (row stride y_stride) */
void gemm_bf16(const uint16_t *x, int64_t x_stride, int64_t m, int64_t k, const uint16_t *p, int64_t n,
               const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads) {
    const int64_t pairs = k / 2, tiles = (n + TILE - 1) / TILE, xs = x_stride / 2;
    const uint32_t *x32 = (const uint32_t *)x;
    if (m <= 16) {
        #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
        for (int64_t t = 0; t < tiles; t++)
            one_tile(x32, xs, (int)m, pairs, p + t * pairs * TILE * 2, bias ? bias + t * TILE : 0,
                     y + t * TILE, y_stride, n - t * TILE);
        return;
    }
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t q = 0; q < (tiles + 1) / 2; q++) {
        const int64_t t = 2 * q;
        for (int64_t r = 0; r < m; r += BLOCK_ROWS) {
            const int64_t rows = m - r < BLOCK_ROWS ? m - r : BLOCK_ROWS;
            if (t + 1 < tiles && rows == BLOCK_ROWS) {
                block(x32 + r * xs, xs, BLOCK_ROWS, 2, pairs, p + t * pairs * TILE * 2, bias ? bias + t * TILE : 0,
                      y + r * y_stride + t * TILE, y_stride, n - t * TILE);
                continue;
            }
            for (int64_t u = t; u < t + 2 && u < tiles; u++)
                one_tile(x32 + r * xs, xs, (int)rows, pairs, p + u * pairs * TILE * 2, bias ? bias + u * TILE : 0,
                         y + r * y_stride + u * TILE, y_stride, n - u * TILE);
        }
    }
}

#else

int gemm_bf16_supported(void) { return 0; }

#endif
