/* bfloat16 GEMM through the AMX tiles, on cpu_gemm.c's tile-packed weights: y [m, n] = x [m, k] @ W [n, k]^T
 * (+ bias), float32 sums, bfloat16 outputs rounded once (nearest even, as torch rounds).
 *
 * Built where the compiler targets AMX-BF16 (-march=native on a Xeon from Sapphire Rapids on); amx_ready()
 * also asks Linux for the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, once per process) and answers 0 where
 * it is refused or the build has no AMX; the library then has no use.
 *
 * Why a second C product: on such a CPU the AVX-512 loop of cpu_gemm.c costs 2x its 1-row time at 16 rows
 * and 11x oneDNN's time at 2,048 (one vdpbf16ps adds 32 products; one tile product adds 16 x 16 x 32), and
 * the one-call decode path (cpu_layers.c) needs a C function on tile-packed weights. The packed layout
 * already is the tile operand: a tile's 16 output columns for 16 pairs of k are 16 rows of 64 bytes,
 * P[t][j..j+15], with the pair's two weights side by side (the "VNNI" layout tdpbf16ps takes). So:
 *
 *   A tile (tmm0): a block of x [rows <= 16, 32 bf16 columns] at x + 2 * 32 * s bytes, x's row stride;
 *   B tiles (tmm2, tmm3): two packed tiles' P[t][16 s .. 16 s + 15], 16 rows of 64 bytes each;
 *   C tiles (tmm4, tmm5): the float32 sums of the A block times each B tile, [rows, 16] each.
 *
 * A task is a pair of packed tiles (each thread takes a contiguous range of tasks). m <= 16 is one A block of
 * m rows; for m > 16 every block has 16 rows, the last one ending at row m (it overlaps the one before and
 * writes only its new rows), so one tile configuration serves the call and x is always read in place. A
 * thread runs its tasks over CHUNK_BLOCKS blocks of rows at a time (64 rows of x stay in cache while its
 * weights pass; 2-core Xeon, 2,048 rows, a layer's four products: 0.54x the time of every task over every
 * row in turn, which re-read x from memory for each task). A pair of tiles, not four: a B tile register is
 * then never reloaded within a step of k while a product still reads it (16 rows: four tiles through three B
 * registers took 1.10x the time; two A blocks at once gave no steady gain). These figures are single runs
 * alternated in one process on a VM whose speed swings 2x between runs: they chose the layout, and the
 * dispatch (workers/layers/gemm_timing.py) decides per shape and row count whether it runs at all.
 *
 * k must be a multiple of 32 (whole tile products: cpu_amx.py's takes); anything else keeps the other
 * products. The sums: float32, each tile product adding its 16 pairs in k order, each pair's two products as
 * tdpbf16ps adds them (denormal inputs and outputs flushed to zero); not always the bits of cpu_gemm.c
 * (tests/kernels/test_cpu_amx.py bounds the difference).
 *
 * amx_gemm_silu_mul: the merged gate/up projection and the SiLU * up after it, as cpu_gemm.c's
 * gemm_silu_mul: a task's pair is gate tile q and up tile q, each sum rounded to bfloat16 as a store would,
 * then silu_mul16. */
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(SYS_arch_prctl)
#include <omp.h>

#define TILE 16                 /* output columns per packed tile and per C tile */
#define TILE_ROWS 16            /* rows of x per A tile */
#define PAIRS 16                /* pairs of k per tile product (32 input columns, 64 bytes of a row of x) */
#define STEP_BYTES 64           /* one packed tile's weights for one pair of k */
#define B_BYTES (PAIRS * STEP_BYTES)   /* one B tile: 1 KB of a packed tile */
#define PREFETCH_B 2            /* B tiles ahead that each task's two weight streams prefetch */
#define CHUNK_BLOCKS 4          /* 16-row blocks a thread runs all its tasks over before the next ones */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_ready(void) {
    static int ready = -1;      /* the kernel's answer is per process: asked once */
    if (ready < 0) ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ready;
}

struct tile_config {            /* ldtilecfg's 64 bytes, palette 1 */
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* this thread's tiles: A (tmm0) and C (tmm4, tmm5) with `rows` rows, B (tmm2, tmm3) with 16; every row
 * 64 bytes. Loaded at every call: other code on the thread (oneDNN) configures the tiles its own way */
static void configure(int rows) {
    struct tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = (uint8_t)(t == 2 || t == 3 ? PAIRS : rows);     /* tiles 1, 6, 7 configured, unused */
        c.colsb[t] = 64;
    }
    __asm__ volatile("" : : "r"(&c) : "memory");   /* ldtilecfg's asm names only c's first 8 bytes as read */
    _tile_loadconfig(&c);
}

/* (__builtin_prefetch: GCC 12 at -O3 dropped every _mm_prefetch of this file as dead code) */
static inline void prefetch_b(const char *b) {
    #pragma GCC unroll 16
    for (int line = 0; line < B_BYTES; line += 64) __builtin_prefetch(b + PREFETCH_B * B_BYTES + line, 0, 3);
}

/* The sums of one A block (x0, row stride xb bytes) times G packed tiles (b0, b1) over all of k, stored to
 * out [G][TILE_ROWS][16] floats. The weights' two streams are prefetched PREFETCH_B tiles ahead (2-core Xeon,
 * a decode step's linear layers at 1-16 rows: ~0.8x the time without). G a constant in each instance: tile
 * registers are immediates. */
static inline __attribute__((always_inline)) void tile_sums(const char *x0, int64_t xb, int64_t pairs,
                                                            const char *b0, const char *b1, const int G, float *out) {
    _tile_zero(4);
    if (G > 1) _tile_zero(5);
    for (int64_t j = 0; j < pairs; j += PAIRS) {
        const int64_t w = j * STEP_BYTES;
        prefetch_b(b0 + w);
        if (G > 1) prefetch_b(b1 + w);
        _tile_loadd(0, x0 + j * 4, xb);
        _tile_loadd(2, b0 + w, STEP_BYTES);
        _tile_dpbf16ps(4, 0, 2);
        if (G > 1) {
            _tile_loadd(3, b1 + w, STEP_BYTES);
            _tile_dpbf16ps(5, 0, 3);
        }
    }
    _tile_stored(4, out, 64);
    if (G > 1) _tile_stored(5, out + TILE_ROWS * TILE, 64);
}

/* rows [from, to) of y from the sums of one A block whose first row is `first` (sums [G][16][16]), for the
 * tile pair whose first output column is col (fuse: gate sums then up sums of the same 16 outputs) */
static void write_rows(const float *sums, int64_t first, int64_t from, int64_t to, int G, int64_t col, int64_t n,
                       const char *bias, char *y, int64_t y_stride, int fuse) {
    const int64_t c = TILE_ROWS * TILE;
    if (fuse) {
        const v16f bg = bias ? load16(bias + col * 2, DTYPE_BF16) : splat16(0.0f);
        const v16f bu = bias ? load16(bias + (n + col) * 2, DTYPE_BF16) : splat16(0.0f);
        for (int64_t r = from; r < to; r++) {
            v16f g, u;
            memcpy(&g, sums + (r - first) * TILE, sizeof g);
            memcpy(&u, sums + c + (r - first) * TILE, sizeof u);
            store16(y + (r * y_stride + col) * 2,
                    silu_mul16(round16(g + bg, DTYPE_BF16), round16(u + bu, DTYPE_BF16), DTYPE_BF16), DTYPE_BF16);
        }
        return;
    }
    for (int t = 0; t < G; t++) {
        const int64_t left = n - col - t * TILE;
        const v16f b = bias ? load16_first(bias + (col + t * TILE) * 2, left, DTYPE_BF16) : splat16(0.0f);
        for (int64_t r = from; r < to; r++) {
            v16f s;
            memcpy(&s, sums + t * c + (r - first) * TILE, sizeof s);
            store16_first(y + (r * y_stride + col + t * TILE) * 2, left, s + b, DTYPE_BF16);
        }
    }
}

/* The driver of both products. A task is a pair of packed tiles (fuse: gate tile q and up tile q; else tiles
 * 2q, 2q + 1, the last one alone when the count is odd), the tasks split over the threads; each task runs
 * over every A block. The A blocks: m <= 16, one of m rows; else blocks of 16 rows starting
 * at 0, 16, 32, ..., the last one at m - 16 (it overlaps the one before and writes only rows from 16 i on). */
static void run(const char *x, int64_t x_stride, int64_t m, int64_t k, const char *p, int64_t n, const char *bias,
                char *y, int64_t y_stride, int threads, int fuse) {
    const int64_t pairs = k / 2, tile_bytes = pairs * STEP_BYTES, xb = x_stride * 2;
    const int64_t tiles = (n + TILE - 1) / TILE, tasks = fuse ? n / TILE : (tiles + 1) / 2;   /* fuse: n = inter */
    const int64_t blocks = (m + TILE_ROWS - 1) / TILE_ROWS;
    const int rows = m < TILE_ROWS ? (int)m : TILE_ROWS;
    #pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float out[2 * TILE_ROWS * TILE] __attribute__((aligned(64)));   /* [G][16 rows][16 columns] */
        configure(rows);
        const int64_t id = omp_get_thread_num(), team = omp_get_num_threads();
        const int64_t q0 = tasks * id / team, q1 = tasks * (id + 1) / team;     /* this thread's tasks */
        for (int64_t c = 0; c < blocks; c += CHUNK_BLOCKS)
            for (int64_t q = q0; q < q1; q++) {
                const char *b0 = p + (fuse ? q : 2 * q) * tile_bytes;
                const char *b1 = fuse ? p + (tasks + q) * tile_bytes : b0 + tile_bytes;
                const int G = fuse || 2 * q + 1 < tiles ? 2 : 1;
                const int64_t col = fuse ? q * TILE : 2 * q * TILE;
                for (int64_t i = c; i < blocks && i < c + CHUNK_BLOCKS; i++) {
                    const int64_t first = i < blocks - 1 ? i * TILE_ROWS : m - rows;   /* the block's first row */
                    const int64_t from = i * TILE_ROWS, to = from + TILE_ROWS < m ? from + TILE_ROWS : m;
                    if (G > 1) tile_sums(x + first * xb, xb, pairs, b0, b1, 2, out);
                    else tile_sums(x + first * xb, xb, pairs, b0, b1, 1, out);
                    write_rows(out, first, from, to, G, col, n, bias, y, y_stride, fuse);
                }
            }
        _tile_release();
    }
}

/* x [m, k] bfloat16 (row stride x_stride elements, k a multiple of 32), p tile-packed bfloat16 W [n, k]
 * (cpu_gemm.c), bias [n] or NULL, y [m, n] (row stride y_stride); dtype must be bfloat16 (the argument
 * makes the signature cpu_gemm.c's gemm, which cpu_layers.c calls through one pointer type) */
void amx_gemm(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *p, int64_t n, const void *bias,
              void *y, int64_t y_stride, int dtype, int threads) {
    (void)dtype;
    run(x, x_stride, m, k, p, n, bias, y, y_stride, threads, 0);
}

/* p tile-packed W [2 * inter, k] (gate rows, then up rows; inter a multiple of 16), bias [2 * inter] or NULL,
 * y [m, inter] = silu(x @ Wg^T + bg) * (x @ Wu^T + bu), each sum rounded to bfloat16 first */
void amx_gemm_silu_mul(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *p, int64_t inter,
                       const void *bias, void *y, int64_t y_stride, int dtype, int threads) {
    (void)dtype;
    run(x, x_stride, m, k, p, inter, bias, y, y_stride, threads, 1);
}

#else

int amx_ready(void) { return 0; }

#endif
