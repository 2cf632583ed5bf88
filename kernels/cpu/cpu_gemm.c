/* GEMM for the CPU linear layers: y [m, n] = x [m, k] @ W [n, k]^T (+ bias), float32 or bfloat16,
 * float32 sums.
 *
 * Built where the compiler targets AVX-512 or AVX2 with FMA (-march=native on such a CPU): float32 needs
 * AVX512F or AVX2 + FMA, bfloat16 AVX512-BF16. gemm_supported(dtype) says which; elsewhere the library has
 * only that function, which answers 0, and the layers keep oneDNN's packed product.
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
 * weights of a tile pair are loaded from memory once and from cache for the later blocks. A block of 8-16
 * rows (m <= 16) is first copied step-major (pack_rows), so the loop reads each step's row values at fixed
 * offsets from one pointer (2-core EPYC, a decode step's 121 products: 8-16% faster at 8-16 rows). The
 * 12-row blocks of m > 16 are read in place through four row pointers, three rows each (row, row + xs,
 * row + 2 xs: a base plus a scaled index, so the loop needs 6 general registers, not 12): no copy at all,
 * 0.92-0.98x the time of packing them at 17-2,048 rows for the 576- and 960-wide layers, 0.97-1.01x for the
 * gate/up + SiLU pass (2-core EPYC, 2026-12-01, the builds alternated in one process; docs/design/kernels.md).
 *
 * Sums are float32 in k order (bfloat16: the two products of a pair added inside vdpbf16ps); bfloat16
 * outputs are rounded once at the end, nearest even, as torch rounds (cpu_vec.h: store16_first).
 *
 * On AVX2 (16 ymm registers, a tile's 16 sums of one row take two) the same loops run with smaller blocks:
 * at most ONE_TILE_ROWS = 6 rows over one tile (12 sums, 2 weight halves, 1 broadcast), more rows in blocks
 * of 6 over the same tile (its weights from memory once, then from cache), read in place (no packing below
 * PACKED_FROM rows), and a gate/up pair as its gate tile, then its up tile (gate_up_pair). The sums are the
 * same float32 sums in the same k order, so both widths give the same bits.
 *
 * gemm_silu_mul: the merged gate/up projection and the SiLU * up after it in one pass (a tile pair = 16 gate
 * and the same 16 up columns), the bits of gemm then cpu_fused.c's silu_mul_rows; it never writes the
 * [m, 2 * inter] product (2-core EPYC, bf16, 1,100 rows: 0.96x the time of the two calls, 10 ms of a
 * 16-prompt prefill step's ~620). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <omp.h>

#define TILE 16                 /* output columns per tile: one zmm (two ymm) of float32 sums */
#define STEP_BYTES 64           /* one tile's weights for one step of k */
#define PREFETCH_STEPS 64       /* prefetch distance: 64 steps * 64 bytes = 4 KB ahead */
#define BLOCK_ROWS 12           /* AVX-512, m > ONE_TILE_ROWS: rows per block over 2 tiles (24 accumulators) */
/* From this many rows (a prefill) the tasks are dealt out one at a time (schedule dynamic) instead of in
 * equal halves (static): a task is then a tile or a tile pair over every block of rows, tens of microseconds
 * or more, so taking one costs nothing, and a thread the OS preempts (a server's front end shares the
 * cores) leaves its remaining tasks to the other instead of making it wait at the end. Below it (a decode
 * step: a task is one tile of a few microseconds) the split stays static. */
#define SHARED_FROM 17
#ifdef __AVX512F__
#define ONE_TILE_ROWS 16        /* rows up to this share one pass over one tile (16 zmm sums) */
#define PAIR_ROWS BLOCK_ROWS    /* rows per block of a gate/up pair */
#define TILE_PAIRS 1            /* m > ONE_TILE_ROWS: blocks of BLOCK_ROWS rows over a tile pair */
#else
#define ONE_TILE_ROWS 6         /* 12 ymm sums + 2 weight halves + 1 broadcast of 16 registers */
#define PAIR_ROWS ONE_TILE_ROWS /* gate_up_pair: the gate tile, then the up tile */
#define TILE_PAIRS 0            /* m > ONE_TILE_ROWS: blocks of ONE_TILE_ROWS rows over one tile */
#endif

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

/* The loop's registers: a tile's 16 float32 sums of one row are PARTS registers of vsum, its 64 bytes of weights
 * for one step of k PARTS registers of vstep. The sums are named by register type, not as a 16-float vector:
 * GCC keeps a v16f that has no register of its own (AVX2) in memory, and a 6-row block ran ~40x slower so. */
#ifdef __AVX512F__
typedef v16f vsum;
typedef v16i vstep;
#else
typedef v8f vsum;
typedef v8i vstep;
#endif
#define PARTS (TILE * 4 / (int)sizeof(vsum))    /* 1 (AVX-512) or 2 (AVX2) */

/* acc += one step of k: x's 4 bytes (a float32, or a bfloat16 pair) times one register of the tile's weights w
 * (vdpbf16ps: the instruction this kernel exists for, so it is named here) */
static inline vsum madd(vsum acc, uint32_t x, vstep w, int dtype) {
#if HAS_BF16
    if (dtype == DTYPE_BF16)
        return (vsum)_mm512_dpbf16_ps((__m512)acc, (__m512bh)_mm512_set1_epi32((int)x), (__m512bh)w);
#endif
    (void)dtype;
    union { uint32_t u; float f; } v = {.u = x};
#ifdef __AVX512F__
    return fma16(splat16(v.f), (v16f)w, acc);
#else
    return fma8(splat8(v.f), (v8f)w, acc);
#endif
}

/* one register of weights at src */
static inline vstep load_step(const char *src) {
    vstep w;
    memcpy(&w, src, sizeof w);
    return w;
}

/* a tile's 16 sums of one row from its PARTS registers (first, last) */
static inline v16f tile_sums(vsum first, vsum last) {
#ifdef __AVX512F__
    (void)last;
    return first;
#else
    return __builtin_shufflevector(first, last, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
}

/* x's rows, 4-byte steps (row stride xs steps) -> xp [steps][rows]: each step's values of every row side by
 * side, so the inner loop reads them at constant offsets from one pointer. With a pointer per row, blocks of
 * PACKED_FROM rows or more ran out of general registers (row pointers spilled into vector registers: ~6
 * extra moves per step at 16 rows); below that, packing costs more than it saves, and rows are read in place.
 * Used for the one block of 8-16 rows (m <= 16); the 12-row blocks of larger m read their rows in place in
 * triplets (block). */
#define PACKED_FROM 8
static inline void pack_rows(const uint32_t *x, int64_t xs, int64_t rows, int64_t j0, int64_t j1, uint32_t *xp) {
    for (int64_t j = j0; j < j1; j++)
        for (int64_t i = 0; i < rows; i++) xp[j * rows + i] = x[i * xs + j];
}

/* rows x (tiles * 16) outputs. x: the rows' steps, row i's step j at x[i * xs + j] (packed 0: in place; at
 * BLOCK_ROWS rows read as four triplets of rows, b0..b3 below) or at x[j * rows + i] (packed 1: pack_rows's
 * layout; xs unused); tile 0 at pt with its bias at bias, tile 1 (tiles == 2) at pt1 with its bias at bias1;
 * columns = output columns left from this tile on (may be < 16); bias, bias1 (either may be NULL) and y
 * element pointers of dtype (element size `size`).
 * fuse (tiles == 2, columns >= 16): tile 0 holds gate columns and tile 1 the up columns of the same 16
 * outputs; each sum is rounded to dtype as a store would, and y gets silu_mul16 of the two (16 outputs). */
static inline __attribute__((always_inline)) void block(
        const uint32_t *x, int64_t xs, const int packed, const int rows, const int tiles, int64_t steps,
        const char *pt, const char *pt1, const char *bias, const char *bias1, char *y, int64_t ys, int64_t columns,
        const int fuse, const int dtype) {
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    const int triplets = !packed && rows == BLOCK_ROWS;
    const int64_t row_stride = packed ? 1 : xs, step_stride = packed ? rows : 1;
    const uint32_t *b0 = x, *b1 = x + 3 * xs, *b2 = x + 6 * xs, *b3 = x + 9 * xs;   /* triplets: rows 3i, 3i+1, 3i+2 */
    const int64_t s1 = xs, s2 = 2 * xs;
    const int regs = tiles * PARTS;               /* registers of sums per row: tile 0's parts, then tile 1's */
    vsum acc[16][2 * PARTS];
    #pragma GCC unroll 16
    for (int i = 0; i < rows; i++)
        #pragma GCC unroll 4
        for (int c = 0; c < regs; c++) acc[i][c] = (vsum){0};
    for (int64_t j = 0; j < steps; j++) {
        vstep w[2 * PARTS];
        #pragma GCC unroll 4
        for (int c = 0; c < regs; c++)
            w[c] = load_step((c < PARTS ? pt : pt1) + j * STEP_BYTES + (c % PARTS) * (int)sizeof(vstep));
        __builtin_prefetch(pt + (j + PREFETCH_STEPS) * STEP_BYTES, 0, 3);
        if (tiles == 2) __builtin_prefetch(pt1 + (j + PREFETCH_STEPS) * STEP_BYTES, 0, 3);
        if (triplets) {
            const uint32_t a[12] = {b0[0], b0[s1], b0[s2], b1[0], b1[s1], b1[s2],
                                    b2[0], b2[s1], b2[s2], b3[0], b3[s1], b3[s2]};
            #pragma GCC unroll 12
            for (int i = 0; i < 12; i++)
                #pragma GCC unroll 4
                for (int c = 0; c < regs; c++) acc[i][c] = madd(acc[i][c], a[i], w[c], dtype);
            b0++, b1++, b2++, b3++;
            continue;
        }
        const uint32_t *xj = x + j * step_stride;
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++) {
            const uint32_t a = xj[i * row_stride];
            #pragma GCC unroll 4
            for (int c = 0; c < regs; c++) acc[i][c] = madd(acc[i][c], a, w[c], dtype);
        }
    }
    if (fuse) {
        const v16f bg = bias ? load16(bias, dtype) : splat16(0.0f), bu = bias1 ? load16(bias1, dtype) : splat16(0.0f);
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++) {
            const v16f gate = tile_sums(acc[i][0], acc[i][PARTS - 1]), up = tile_sums(acc[i][PARTS], acc[i][regs - 1]);
            store16(y + i * ys * size, silu_mul16(round16(gate + bg, dtype), round16(up + bu, dtype), dtype), dtype);
        }
        return;
    }
    #pragma GCC unroll 2
    for (int t = 0; t < tiles; t++) {
        const int64_t left = columns - TILE * t;        /* outputs of this tile that exist (> 16: all) */
        const char *bt = t ? bias1 : bias;
        const v16f b = bt ? load16_first(bt, left, dtype) : splat16(0.0f);
        #pragma GCC unroll 16
        for (int i = 0; i < rows; i++)
            store16_first(y + (i * ys + TILE * t) * size, left,
                          tile_sums(acc[i][t * PARTS], acc[i][t * PARTS + PARTS - 1]) + b, dtype);
    }
}

/* an instance of block per row count, packing (1 only from PACKED_FROM rows) and dtype: all constants in it */
#define ROWS_BLOCK(R, P) \
    if (HAS_BF16 && dtype == DTYPE_BF16) \
        block(x, xs, P, R, 1, steps, pt, pt, bias, bias, y, ys, columns, 0, DTYPE_BF16); \
    else block(x, xs, P, R, 1, steps, pt, pt, bias, bias, y, ys, columns, 0, DTYPE_F32);
#define ROWS_CASE(R) case R: \
    if (R >= PACKED_FROM && packed) { ROWS_BLOCK(R, 1) } else { ROWS_BLOCK(R, 0) } \
    break;
/* rows (1..ONE_TILE_ROWS) x one tile, the row count and dtype constants in each instance (x as block takes it) */
static void one_tile(const uint32_t *x, int64_t xs, int packed, int rows, int64_t steps, const char *pt,
                     const char *bias, char *y, int64_t ys, int64_t columns, int dtype) {
    switch (rows) {
        ROWS_CASE(1) ROWS_CASE(2) ROWS_CASE(3) ROWS_CASE(4) ROWS_CASE(5) ROWS_CASE(6)
#if ONE_TILE_ROWS > 6
        ROWS_CASE(7) ROWS_CASE(8) ROWS_CASE(9) ROWS_CASE(10) ROWS_CASE(11) ROWS_CASE(12) ROWS_CASE(13) ROWS_CASE(14)
        ROWS_CASE(15) ROWS_CASE(16)
#endif
    }
}

/* BLOCK_ROWS rows read in place (row stride xs) x two tiles (TILE_PAIRS only) */
static void two_tiles(const uint32_t *x, int64_t xs, int64_t steps, const char *pt, const char *bias,
                      char *y, int64_t ys, int64_t columns, int dtype) {
    const char *pt1 = pt + steps * STEP_BYTES, *bias1 = bias ? bias + TILE * dtype_size(dtype) : NULL;
#if TILE_PAIRS
    if (dtype == DTYPE_BF16) block(x, xs, 0, BLOCK_ROWS, 2, steps, pt, pt1, bias, bias1, y, ys, columns, 0, DTYPE_BF16);
    else block(x, xs, 0, BLOCK_ROWS, 2, steps, pt, pt1, bias, bias1, y, ys, columns, 0, DTYPE_F32);
#else
    (void)x, (void)xs, (void)steps, (void)pt, (void)pt1, (void)bias, (void)bias1, (void)y, (void)ys, (void)columns,
        (void)dtype;
#endif
}

#if TILE_PAIRS
#define PAIR_BLOCK(R, P) \
    if (HAS_BF16 && dtype == DTYPE_BF16) block(x, xs, P, R, 2, steps, pg, pu, bg, bu, y, ys, TILE, 1, DTYPE_BF16); \
    else block(x, xs, P, R, 2, steps, pg, pu, bg, bu, y, ys, TILE, 1, DTYPE_F32);
#define PAIR_CASE(R) case R: \
    if (R >= PACKED_FROM && packed) { PAIR_BLOCK(R, 1) } else { PAIR_BLOCK(R, 0) } \
    break;
#endif
/* rows (1..PAIR_ROWS) x 16 outputs silu(gate) * up from gate tile pg and up tile pu (x as block takes it).
 * AVX2: a pair's 4 registers of sums per row leave room for 3 rows, and GCC then spilled sums to the stack
 * (1.5x the time of oneDNN + SiLU at 128 rows; 2-row blocks 1.7x); so the gate tile, then the up tile, each as
 * one_tile's block of up to 6 rows, their float32 sums (bias added) kept here, then SiLU * up: the same bits
 * (float32 only there, so round16 is the identity). */
static void gate_up_pair(const uint32_t *x, int64_t xs, int packed, int rows, int64_t steps, const char *pg,
                         const char *pu, const char *bg, const char *bu, char *y, int64_t ys, int dtype) {
#if TILE_PAIRS
    switch (rows) {
        PAIR_CASE(1) PAIR_CASE(2) PAIR_CASE(3) PAIR_CASE(4) PAIR_CASE(5) PAIR_CASE(6) PAIR_CASE(7) PAIR_CASE(8)
        PAIR_CASE(9) PAIR_CASE(10) PAIR_CASE(11) PAIR_CASE(12)
    }
#else
    (void)dtype;
    float gate[PAIR_ROWS * TILE], up[PAIR_ROWS * TILE];        /* [rows][16] */
    one_tile(x, xs, packed, rows, steps, pg, bg, (char *)gate, TILE, TILE, DTYPE_F32);
    one_tile(x, xs, packed, rows, steps, pu, bu, (char *)up, TILE, TILE, DTYPE_F32);
    for (int i = 0; i < rows; i++)
        store16(y + i * ys * 4, silu_mul16(load16((const char *)(gate + i * TILE), DTYPE_F32),
                                           load16((const char *)(up + i * TILE), DTYPE_F32), DTYPE_F32), DTYPE_F32);
#endif
}

#define PACK_STEPS 64           /* steps of k per packing task */

/* the calling thread's buffer for packed rows (grown to the largest x seen, kept for the next call) */
static __thread uint32_t *packed_x;
static __thread size_t packed_x_bytes;

static uint32_t *packed_x_buffer(size_t bytes) {
    if (bytes > packed_x_bytes) {
        free(packed_x);
        packed_x = aligned_alloc(64, (bytes + 63) / 64 * 64);
        packed_x_bytes = packed_x ? bytes : 0;
    }
    return packed_x;
}

/* Inside a parallel region, with its threads: each block of block_rows rows of x (xs: x's row stride in steps)
 * that has PACKED_FROM rows or more is packed by pack_rows into xp (block r at xp + r * steps), in tasks of
 * PACK_STEPS steps; the loop's implied barrier then lets every thread read every block. */
static void pack_blocks(const uint32_t *x32, int64_t xs, int64_t m, int64_t steps, int64_t block_rows, uint32_t *xp) {
    const int64_t blocks = (m + block_rows - 1) / block_rows, chunks = (steps + PACK_STEPS - 1) / PACK_STEPS;
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < blocks * chunks; task++) {
        const int64_t b = task / chunks, c = task % chunks, r = b * block_rows;
        const int64_t rows = m - r < block_rows ? m - r : block_rows;
        const int64_t j1 = (c + 1) * PACK_STEPS < steps ? (c + 1) * PACK_STEPS : steps;
        if (rows >= PACKED_FROM) pack_rows(x32 + r * xs, xs, rows, c * PACK_STEPS, j1, xp + r * steps);
    }
}

/* m < PACKED_FROM rows of x read in place, the tiles split over the threads (gemm's arguments; element
 * strides of x and y in their 4-byte steps / elements) */
static void rows_in_place(const uint32_t *x32, int64_t xs, int64_t m, int64_t steps, const char *pc, int64_t n,
                          const char *bc, char *yc, int64_t y_stride, int dtype, int threads) {
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t tiles = (n + TILE - 1) / TILE, tile_bytes = steps * STEP_BYTES;
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t t = 0; t < tiles; t++)
        one_tile(x32, xs, 0, (int)m, steps, pc + t * tile_bytes, bc ? bc + t * TILE * size : 0,
                 yc + t * TILE * size, y_stride, n - t * TILE, dtype);
}

/* One gemm or gemm_silu_mul call's operands, as those derive them (block_rows: rows per block; pairs: gemm's blocks
 * go over tile pairs) */
struct gemm_call {
    const uint32_t *x32, *xp;
    int64_t xs, m, steps, tiles, n, tile_bytes, block_rows, y_stride;
    const char *pc, *bc;
    char *yc;
    int pairs, size, dtype;
};

/* Task q of a gemm call: a tile (m <= ONE_TILE_ROWS: one block; AVX2: every block of 6 rows), or a pair of
 * tiles, its weights loaded from memory once for every row block */
static void gemm_task(const struct gemm_call *c, int64_t q) {
    const int64_t t = c->pairs ? 2 * q : q, last = c->pairs ? t + 2 : t + 1;
    const int size = c->size;
    for (int64_t r = 0; r < c->m; r += c->block_rows) {
        const int64_t rows = c->m - r < c->block_rows ? c->m - r : c->block_rows;
        const int packed = c->xp != NULL && rows >= PACKED_FROM;
        const uint32_t *xr = packed ? c->xp + r * c->steps : c->x32 + r * c->xs;
        char *yr = c->yc + r * c->y_stride * size;
        if (last == t + 2 && t + 1 < c->tiles && rows == BLOCK_ROWS) {      /* pairs: in place */
            two_tiles(xr, c->xs, c->steps, c->pc + t * c->tile_bytes, c->bc ? c->bc + t * TILE * size : 0,
                      yr + t * TILE * size, c->y_stride, c->n - t * TILE, c->dtype);
            continue;
        }
        for (int64_t u = t; u < last && u < c->tiles; u++)
            one_tile(xr, c->xs, packed, (int)rows, c->steps, c->pc + u * c->tile_bytes,
                     c->bc ? c->bc + u * TILE * size : 0, yr + u * TILE * size, c->y_stride, c->n - u * TILE, c->dtype);
    }
}

/* Inside a parallel region, with its threads: tasks 0 .. tasks - 1 of call c, each run by task(c, q), dealt out
 * one at a time from SHARED_FROM rows, in equal static halves below (SHARED_FROM says why); nowait: the
 * parallel region's end is the one barrier after the products */
static void deal_tasks(const struct gemm_call *c, int64_t tasks, void (*task)(const struct gemm_call *, int64_t)) {
    if (c->m >= SHARED_FROM) {
        #pragma omp for schedule(dynamic, 1) nowait
        for (int64_t q = 0; q < tasks; q++) task(c, q);
    } else {
        #pragma omp for schedule(static) nowait
        for (int64_t q = 0; q < tasks; q++) task(c, q);
    }
}

/* x [m, k] of dtype (row stride x_stride elements; bfloat16: k even); p tile-packed W [n, k]; bias [n]
 * or NULL; y [m, n] (row stride y_stride). x rows are read 4 bytes at a time (a float32, a bf16 pair), in
 * blocks (m <= ONE_TILE_ROWS: one block of m rows; else blocks of BLOCK_ROWS over a tile pair, AVX2: of
 * ONE_TILE_ROWS over one tile, the last one shorter, all read in place); a block of PACKED_FROM..16 rows
 * (AVX-512, m <= 16) is first packed by pack_rows, into the calling thread's buffer.
 * Where that buffer cannot be allocated, the rows go in place, PACKED_FROM - 1 at a time (the same sums,
 * slower). */
void gemm(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *p, int64_t n, const void *bias,
          void *y, int64_t y_stride, int dtype, int threads) {
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t steps = steps_of(k, dtype), tiles = (n + TILE - 1) / TILE, xs = x_stride * size / 4;
    const int64_t tile_bytes = steps * STEP_BYTES;
    const uint32_t *x32 = (const uint32_t *)x;
    const char *pc = (const char *)p, *bc = (const char *)bias;
    char *yc = (char *)y;
    const int packs = m >= PACKED_FROM && m <= ONE_TILE_ROWS;   /* one block of 8-16 rows; more: in place */
    uint32_t *xp = packs ? packed_x_buffer((size_t)m * (size_t)steps * 4) : NULL;   /* [steps][m] */
    if (packs && !xp) {
        for (int64_t r = 0; r < m; r += PACKED_FROM - 1)
            rows_in_place(x32 + r * xs, xs, m - r < PACKED_FROM - 1 ? m - r : PACKED_FROM - 1, steps, pc, n, bc,
                          yc + r * y_stride * size, y_stride, dtype, threads);
        return;
    }
    const int pairs = m > ONE_TILE_ROWS && TILE_PAIRS;          /* blocks over tile pairs */
    const struct gemm_call call = {x32, xp, xs, m, steps, tiles, n, tile_bytes,
                                   m <= ONE_TILE_ROWS ? m : pairs ? BLOCK_ROWS : ONE_TILE_ROWS,
                                   y_stride, pc, bc, yc, pairs, size, dtype};
    const int64_t tasks = pairs ? (tiles + 1) / 2 : tiles;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (xp) pack_blocks(x32, xs, m, steps, call.block_rows, xp);
        deal_tasks(&call, tasks, gemm_task);
    }
}

/* Task q of a gemm_silu_mul call (c->n: inter; c->tiles: its pairs): gate tile q and up tile q over every block
 * of rows */
static void silu_task(const struct gemm_call *c, int64_t q) {
    const int size = c->size;
    const char *bg = c->bc ? c->bc + q * TILE * size : NULL, *bu = c->bc ? c->bc + (c->n + q * TILE) * size : NULL;
    for (int64_t r = 0; r < c->m; r += c->block_rows) {
        const int64_t rows = c->m - r < c->block_rows ? c->m - r : c->block_rows;
        const int packed = c->xp != NULL && rows >= PACKED_FROM;
        gate_up_pair(packed ? c->xp + r * c->steps : c->x32 + r * c->xs, c->xs, packed, (int)rows, c->steps,
                     c->pc + q * c->tile_bytes, c->pc + (c->tiles + q) * c->tile_bytes, bg, bu,
                     c->yc + (r * c->y_stride + q * TILE) * size, c->y_stride, c->dtype);
    }
}

/* The merged gate/up projection and SiLU in one pass: p tile-packed W [2 * inter, k] (the gate's rows, then
 * the up rows; inter a multiple of 16), bias [2 * inter] or NULL; y [m, inter] (row stride y_stride) =
 * silu(x @ Wg^T + bg) * (x @ Wu^T + bu), each sum rounded to dtype first: the bits of gemm followed by
 * cpu_fused.c's silu_mul_rows, without the [m, 2 * inter] product between them. A task is one pair (gate
 * tile q, up tile q) over every block of PAIR_ROWS rows, so the pair's weights come from memory once;
 * rows are read as in gemm (AVX-512: a block of 8-16 rows packed, or in place PACKED_FROM - 1 at a time where
 * the buffer cannot be allocated; the 12-row blocks of m > 16 in place; AVX2: blocks of 6 rows in place,
 * gate tile then up tile). */
void gemm_silu_mul(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *p, int64_t inter,
                   const void *bias, void *y, int64_t y_stride, int dtype, int threads) {
    const int size = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t steps = steps_of(k, dtype), pairs = inter / TILE, xs = x_stride * size / 4;
    const int64_t tile_bytes = steps * STEP_BYTES;
    const uint32_t *x32 = (const uint32_t *)x;
    const char *pc = (const char *)p, *bc = (const char *)bias;
    char *yc = (char *)y;
    const int packs = m >= PACKED_FROM && m <= ONE_TILE_ROWS;
    uint32_t *xp = packs ? packed_x_buffer((size_t)m * (size_t)steps * 4) : NULL;   /* [steps][m] */
    const int64_t block_rows = !TILE_PAIRS ? PAIR_ROWS : xp || m > 16 ? BLOCK_ROWS : PACKED_FROM - 1;
    const struct gemm_call call = {x32, xp, xs, m, steps, pairs, inter, tile_bytes, block_rows, y_stride, pc, bc, yc,
                                   1, size, dtype};
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        if (xp) pack_blocks(x32, xs, m, steps, block_rows, xp);
        deal_tasks(&call, pairs, silu_task);
    }
}

#else

int gemm_supported(int dtype) { (void)dtype; return 0; }

#endif
