/* Paged prefill attention for the CPU: each sequence's newest chunk of query tokens attends causally over
 * its cached history and itself, K/V read straight from the paged cache (float32 or bfloat16, the dtype of
 * q), online softmax in float32. Built and loaded by cpu_prefill.py (cc -O3 -march=native -fopenmp); called
 * through ctypes with raw pointers and element strides.
 *
 * Work item = (sequence, KV head, tile of up to `tile` query tokens); its rows are the tile's tokens times
 * the G = Hq / Hkv query heads of that KV head. The keys the tile sees go by in chunks of whole blocks
 * (up to CHUNK keys). Each chunk is converted once per item into float32 buffers: K transposed (kt[d][key])
 * and V as rows. Then, 4 rows at a time, the scores of 16 keys come from head_dim broadcast FMAs (each
 * kt[d] line loaded once for 4 rows, no horizontal sums), one online-softmax step per row and chunk, and
 * acc += p @ V with each V row loaded once for the 4 rows; a block of 4 rows stops at the keys of its latest
 * row (the later ones are masked for all 4: bit for bit the same, 0.965x the time on a 16-prompt bf16 wave).
 * cpu_decode.c converts a chunk once per query
 * row instead, which dominates when a chunk has many query rows.
 *
 * bfloat16 on AVX512-BF16 (prefill_item_bf16): the two products run through vdpbf16ps, which multiplies two
 * bf16 pairs per lane into float32 sums: scores from q's and k's dimension pairs (kt holds each key's pairs,
 * 4 bytes a key; the scale multiplies the sum), and p @ V from the probabilities rounded to bf16, two keys a
 * step (vp holds the two keys' values of each dimension side by side). Half the instructions of the float32
 * FMAs, and the chunk's keys are copied as bits instead of widened. The softmax (max, exp, sum) stays float32;
 * rounding p to bf16 is what transformers' bf16 attention does too (its softmax output is cast to bf16 before
 * the product). Against the float64 oracle the error stays at the output's own bf16 rounding (tests). 
 *
 * bfloat16 on AMX (prefill_item_amx, where the build targets AMX and Linux grants the tile state; the caller's
 * use_amx and head_dim % 32 == 0): the same chunks, masks and softmax, with kt and vp as the B tiles of the two
 * products (they already are tdpbf16ps's pair layout) and 16 rows at a time as the A side. Its items are 4x
 * as large (AMX_ITEM_ROWS): the repacking of a key chunk then costs a quarter per row.
 *
 * Key j is visible from the query at position p when j <= p and, with a window W > 0, j > p - W. Token i
 * of a chunk of n tokens of a sequence of seq_len keys is at position seq_len - n + i. Block ids are
 * clamped into [0, num_blocks) (the callers check them; the clamp keeps a bad id from reading outside the
 * cache). Limits (checked by the caller): head_dim a multiple of 16 and <= 256, block_size a multiple of 8
 * and <= 64, G <= 64, no ALiBi, soft-capping or 8-bit cache (those run cpu_decode.c's rows).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu_vec.h"

#define CHUNK 64        /* keys per chunk: kt and v buffers of CHUNK x head_dim floats (16 KiB each at 64) */
#define ROW_BLOCK 4     /* rows sharing each loaded K / V line */
#define ITEM_ROWS 48    /* about this many rows per item: tile = max(1, ITEM_ROWS / G) tokens */

struct prefill_args {
    const char *q, *k, *v;
    char *out;
    int64_t q_tok, q_head, o_tok, o_head;   /* bytes */
    int64_t c_block, c_tok, c_head;         /* bytes */
    int64_t num_blocks, block_size, group;
    const int32_t *table;
    int64_t first_pos;                      /* position of the chunk's token 0 */
    int64_t i0, i1;                         /* the item's tokens of the chunk */
    int64_t token0;                         /* row of the chunk's token 0 in q / out */
    int64_t kv_head, window;
    float scale;
};

/* bytes from the cache's start to the item's KV head of key `key` (its block id clamped into the cache) */
static inline int64_t key_offset(const struct prefill_args *a, int64_t key) {
    int64_t block = a->table[key / a->block_size];
    block = block < 0 ? 0 : (block >= a->num_blocks ? a->num_blocks - 1 : block);
    return block * a->c_block + (key % a->block_size) * a->c_tok + a->kv_head * a->c_head;
}

/* bytes from q's (or out's) start, strides tok / head in bytes, to item row r: token i0 + r / G of the chunk,
 * query head kv_head * G + r % G */
static inline int64_t row_offset(const struct prefill_args *a, int64_t r, int64_t tok, int64_t head) {
    return (a->token0 + a->i0 + r / a->group) * tok + (a->kv_head * a->group + r % a->group) * head;
}

/* the online softmax's running max m and sum l of padded rows 0..padded-1 at their start, and each row's
 * position (row r >= rows: a copy of the last row) */
static inline void start_rows(const struct prefill_args *a, int64_t rows, int64_t padded, float *m, float *l,
                              int32_t *pos) {
    for (int64_t r = 0; r < padded; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        pos[r] = (int32_t)(a->first_pos + a->i0 + (r < rows ? r : rows - 1) / a->group);
    }
}

/* the keys [lo, hi) an item's rows see: from its first row's window start to its last row's position */
static inline void item_keys(const struct prefill_args *a, int64_t *lo, int64_t *hi) {
    const int64_t p_first = a->first_pos + a->i0, p_last = a->first_pos + a->i1 - 1;
    *lo = (a->window > 0 && p_first - a->window + 1 > 0) ? p_first - a->window + 1 : 0;
    *hi = p_last + 1;
}

/* the keys [first, end) of the chunk of blocks from block b0 on (chunk_blocks blocks of bs keys), within [lo, hi) */
static inline void chunk_keys(int64_t b0, int64_t bs, int64_t chunk_blocks, int64_t lo, int64_t hi, int64_t *first,
                              int64_t *end) {
    *first = lo > b0 * bs ? lo : b0 * bs;
    *end = (b0 + chunk_blocks) * bs < hi ? (b0 + chunk_blocks) * bs : hi;
}

/* One online-softmax step of one row over a chunk's scores p[0, nb16) (the masked ones -inf): p becomes
 * exp(p - the new max), or zeros when nothing in the chunk is visible; m and l are the row's running max and
 * sum. Returns the factor the row's earlier sums take (1 when nothing is visible). */
static inline float softmax_step(float *p, int64_t nb16, float *m, float *l) {
    v16f vmax = splat16(-INFINITY);
    for (int64_t k16 = 0; k16 < nb16; k16 += 16) {
        v16f x;
        memcpy(&x, &p[k16], sizeof x);
        vmax = select16(x > vmax, x, vmax);
    }
    const float cmax = hmax16(vmax);
    if (cmax == -INFINITY) {
        memset(p, 0, CHUNK * sizeof(float));
        return 1.0f;
    }
    const float new_max = cmax > *m ? cmax : *m;
    const float correction = *m == -INFINITY ? 0.0f : exp8(splat8(*m - new_max))[0];
    v16f sum = splat16(0.0f);
    for (int64_t k16 = 0; k16 < nb16; k16 += 16) {
        v16f x;
        memcpy(&x, &p[k16], sizeof x);
        x = exp16(x - splat16(new_max));
        memcpy(&p[k16], &x, sizeof x);
        sum += x;
    }
    *l = *l * correction + hsum16(sum);
    *m = new_max;
    return correction;
}

/* One item; D = 16 C. rows = (tokens i0..i1) x G heads, row r = (i - i0) * G + g, padded to a multiple of
 * ROW_BLOCK with copies of the last row (computed, never stored), so every inner loop has constant bounds
 * and keeps its accumulators in registers. */
static inline __attribute__((always_inline)) void prefill_item(const struct prefill_args *a, int dtype, int64_t C) {
    const int64_t elem = dtype_size(dtype);
    const int64_t D = 16 * C, G = a->group, bs = a->block_size;
    const int64_t rows = (a->i1 - a->i0) * G, padded = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    int64_t lo, hi;                                                  /* keys [lo, hi) */
    item_keys(a, &lo, &hi);
    const int64_t chunk_blocks = CHUNK / bs;
    float qs[padded][D] __attribute__((aligned(64)));                /* scaled queries */
    v16f acc[padded][C];
    float m[padded], l[padded];
    int32_t pos[padded];
    float kt[D][CHUNK] __attribute__((aligned(64)));                 /* K transposed */
    float vb[CHUNK][D] __attribute__((aligned(64)));
    float p[ROW_BLOCK][CHUNK] __attribute__((aligned(64)));          /* a row block's probabilities */
    for (int64_t r = 0; r < padded; r++) {
        const int64_t real = r < rows ? r : rows - 1;
        const char *src = a->q + row_offset(a, real, a->q_tok, a->q_head);
        for (int64_t c = 0; c < C; c++) {
            const v16f x = load16(src + c * 16 * elem, dtype) * splat16(a->scale);
            memcpy(&qs[r][c * 16], &x, sizeof x);
            acc[r][c] = splat16(0.0f);
        }
    }
    start_rows(a, rows, padded, m, l, pos);
    for (int64_t b0 = lo / bs; b0 * bs < hi; b0 += chunk_blocks) {
        int64_t first, end;
        chunk_keys(b0, bs, chunk_blocks, lo, hi, &first, &end);
        const int64_t n = end - first, n16 = (n + 15) / 16 * 16;
        for (int64_t j = 0; j < n; j++) {                            /* the chunk's keys, as float32 */
            const int64_t off = key_offset(a, first + j);
            for (int64_t c = 0; c < C; c++) {
                const v16f kx = load16(a->k + off + c * 16 * elem, dtype);
                const v16f vx = load16(a->v + off + c * 16 * elem, dtype);
                for (int64_t e = 0; e < 16; e++) kt[c * 16 + e][j] = kx[e];
                memcpy(&vb[j][c * 16], &vx, sizeof vx);
            }
        }
        for (int64_t j = n; j < n16; j++) {
            for (int64_t d = 0; d < D; d++) kt[d][j] = 0.0f;
        }
        for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
            const int64_t last = pos[r0 + ROW_BLOCK - 1];            /* the block's latest row (pos never decreases) */
            if (last < first) continue;                              /* the chunk is after every row */
            /* keys past the block's latest row are masked for all its rows: only [first, first + nb) are scored */
            const int64_t nb = (last + 1 < end ? last + 1 : end) - first, nb16 = (nb + 15) / 16 * 16;
            for (int64_t k16 = 0; k16 < nb16; k16 += 16) {           /* scores, masked */
                v16f sc[ROW_BLOCK];
                for (int rr = 0; rr < ROW_BLOCK; rr++) sc[rr] = splat16(0.0f);
                for (int64_t d = 0; d < D; d++) {
                    v16f kv;
                    memcpy(&kv, &kt[d][k16], sizeof kv);
                    for (int rr = 0; rr < ROW_BLOCK; rr++) sc[rr] += splat16(qs[r0 + rr][d]) * kv;
                }
                const v16i key = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + (int32_t)(first + k16);
                for (int rr = 0; rr < ROW_BLOCK; rr++) {
                    v16i visible = (key <= pos[r0 + rr]) & (key < (int32_t)end);
                    if (a->window > 0) visible &= key > pos[r0 + rr] - (int32_t)a->window;
                    const v16f masked = select16(visible, sc[rr], splat16(-INFINITY));
                    memcpy(&p[rr][k16], &masked, sizeof masked);
                }
            }
            float correction[ROW_BLOCK];
            for (int rr = 0; rr < ROW_BLOCK; rr++)                   /* online softmax, one step per chunk */
                correction[rr] = softmax_step(p[rr], nb16, &m[r0 + rr], &l[r0 + rr]);
            v16f o[ROW_BLOCK][C];                                     /* acc += p @ V, in registers */
            for (int rr = 0; rr < ROW_BLOCK; rr++) {
                for (int64_t c = 0; c < C; c++) o[rr][c] = acc[r0 + rr][c] * splat16(correction[rr]);
            }
            for (int64_t j = 0; j < nb; j++) {
                for (int64_t c = 0; c < C; c++) {
                    v16f vv;
                    memcpy(&vv, &vb[j][c * 16], sizeof vv);
                    for (int rr = 0; rr < ROW_BLOCK; rr++) o[rr][c] += splat16(p[rr][j]) * vv;
                }
            }
            for (int rr = 0; rr < ROW_BLOCK; rr++) {
                for (int64_t c = 0; c < C; c++) acc[r0 + rr][c] = o[rr][c];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        char *dst = a->out + row_offset(a, r, a->o_tok, a->o_head);
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t c = 0; c < C; c++) store16(dst + c * 16 * elem, acc[r][c] * inv, dtype);
    }
}

#if defined(__AVX512BF16__)
/* The n keys from position `first` as bf16 pairs, both items' operand layouts: kt[e][j] key j's dimensions
 * 2e, 2e + 1; vp[i][d] keys 2i, 2i + 1 at dimension d (D = head_dim). */
static inline __attribute__((always_inline)) void pair_chunk(const struct prefill_args *a, int64_t first,
                                                             int64_t n, int64_t D, uint32_t kt[][CHUNK],
                                                             uint32_t vp[][D]) {
    const int64_t D2 = D / 2;
    for (int64_t j = 0; j < n; j++) {
        const int64_t off = key_offset(a, first + j);
        uint32_t kr[D2];
        memcpy(kr, a->k + off, (size_t)D * 2);
        for (int64_t e = 0; e < D2; e++) kt[e][j] = kr[e];
        uint16_t vr[D], *vdst = (uint16_t *)vp[j / 2];
        memcpy(vr, a->v + off, (size_t)D * 2);
        for (int64_t d = 0; d < D; d++) vdst[2 * d + (j & 1)] = vr[d];
    }
}

/* prefill_item for bfloat16 through vdpbf16ps (two products per lane and instruction, twice the float32 FMA's):
 * scores from the q / k bf16 pairs of two dimensions (kt: each key's dimension pairs transposed, 4 bytes a key),
 * times scale after the sum; probabilities rounded to bf16 (nearest even) for p @ V, which takes two keys a step
 * (vp: the two keys' values of each dimension side by side). The softmax, its max and its sum stay float32 as in
 * prefill_item. */
static inline __attribute__((always_inline)) void prefill_item_bf16(const struct prefill_args *a, int64_t C) {
    const int64_t D = 16 * C, D2 = D / 2, G = a->group, bs = a->block_size;
    const int64_t rows = (a->i1 - a->i0) * G, padded = (rows + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    int64_t lo, hi;                                                  /* keys [lo, hi) */
    item_keys(a, &lo, &hi);
    const int64_t chunk_blocks = CHUNK / bs;
    uint32_t qp[padded][D2];                                         /* q's dimension pairs, unscaled */
    v16f acc[padded][C];
    float m[padded], l[padded];
    int32_t pos[padded];
    uint32_t kt[D2][CHUNK] __attribute__((aligned(64)));            /* kt[e][j]: key j's dimensions 2e, 2e + 1 */
    uint32_t vp[CHUNK / 2][D] __attribute__((aligned(64)));         /* vp[i][d]: keys 2i, 2i + 1 at dimension d */
    float p[ROW_BLOCK][CHUNK] __attribute__((aligned(64)));
    uint32_t pp[ROW_BLOCK][CHUNK / 2] __attribute__((aligned(64))); /* p as bf16 pairs of keys */
    for (int64_t r = 0; r < padded; r++) {
        const int64_t real = r < rows ? r : rows - 1;
        memcpy(qp[r], a->q + row_offset(a, real, a->q_tok, a->q_head), (size_t)D * 2);
        for (int64_t c = 0; c < C; c++) acc[r][c] = splat16(0.0f);
    }
    start_rows(a, rows, padded, m, l, pos);
    for (int64_t b0 = lo / bs; b0 * bs < hi; b0 += chunk_blocks) {
        int64_t first, end;
        chunk_keys(b0, bs, chunk_blocks, lo, hi, &first, &end);
        const int64_t n = end - first;
        pair_chunk(a, first, n, D, kt, vp);
        for (int64_t j = n; j < (n + 31) / 32 * 32; j++)             /* zeros up to the 32-key step */
            for (int64_t e = 0; e < D2; e++) kt[e][j] = 0;
        if (n & 1) {                                                  /* the last pair's missing key: zeros */
            uint16_t *vdst = (uint16_t *)vp[n / 2];
            for (int64_t d = 0; d < D; d++) vdst[2 * d + 1] = 0;
        }
        for (int64_t r0 = 0; r0 < padded; r0 += ROW_BLOCK) {
            const int64_t last = pos[r0 + ROW_BLOCK - 1];
            if (last < first) continue;
            const int64_t nb = (last + 1 < end ? last + 1 : end) - first, nb16 = (nb + 15) / 16 * 16;
            for (int64_t k32 = 0; k32 < nb16; k32 += 32) {           /* 32 keys at a time: 8 independent sums */
                const int two = k32 + 16 < nb16;
                __m512 sc[ROW_BLOCK][2];
                for (int rr = 0; rr < ROW_BLOCK; rr++) sc[rr][0] = sc[rr][1] = _mm512_setzero_ps();
                for (int64_t e = 0; e < D2; e++) {
                    const __m512bh k0 = (__m512bh)_mm512_load_si512(&kt[e][k32]);
                    const __m512bh k1 = (__m512bh)_mm512_load_si512(&kt[e][k32 + 16]);   /* zeros past the chunk */
                    for (int rr = 0; rr < ROW_BLOCK; rr++) {
                        const __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[r0 + rr][e]);
                        sc[rr][0] = _mm512_dpbf16_ps(sc[rr][0], qv, k0);
                        sc[rr][1] = _mm512_dpbf16_ps(sc[rr][1], qv, k1);
                    }
                }
                for (int h = 0; h < 1 + two; h++) {
                    const v16i key = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} +
                                     (int32_t)(first + k32 + 16 * h);
                    for (int rr = 0; rr < ROW_BLOCK; rr++) {
                        v16i visible = (key <= pos[r0 + rr]) & (key < (int32_t)end);
                        if (a->window > 0) visible &= key > pos[r0 + rr] - (int32_t)a->window;
                        const v16f masked = select16(visible, (v16f)sc[rr][h] * splat16(a->scale), splat16(-INFINITY));
                        memcpy(&p[rr][k32 + 16 * h], &masked, sizeof masked);
                    }
                }
            }
            float correction[ROW_BLOCK];
            for (int rr = 0; rr < ROW_BLOCK; rr++) {                 /* online softmax, as prefill_item */
                correction[rr] = softmax_step(p[rr], nb16, &m[r0 + rr], &l[r0 + rr]);
                for (int64_t k32 = 0; k32 < nb16; k32 += 32) {        /* keys k32 .. k32 + 31 as 16 bf16 pairs */
                    const __m512 lo16 = _mm512_load_ps(&p[rr][k32]);
                    const __m512 hi16 = k32 + 16 < nb16 ? _mm512_load_ps(&p[rr][k32 + 16]) : _mm512_setzero_ps();
                    _mm512_store_si512(&pp[rr][k32 / 2], (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16));
                }
            }
            __m512 o[ROW_BLOCK][C];                                   /* acc += p @ V, two keys a step */
            for (int rr = 0; rr < ROW_BLOCK; rr++) {
                for (int64_t c = 0; c < C; c++) o[rr][c] = (__m512)(acc[r0 + rr][c] * splat16(correction[rr]));
            }
            for (int64_t i = 0; i < (nb + 1) / 2; i++) {
                for (int64_t c = 0; c < C; c++) {
                    const __m512bh vv = (__m512bh)_mm512_load_si512(&vp[i][c * 16]);
                    for (int rr = 0; rr < ROW_BLOCK; rr++)
                        o[rr][c] = _mm512_dpbf16_ps(o[rr][c], (__m512bh)_mm512_set1_epi32((int)pp[rr][i]), vv);
                }
            }
            for (int rr = 0; rr < ROW_BLOCK; rr++) {
                for (int64_t c = 0; c < C; c++) acc[r0 + rr][c] = (v16f)o[rr][c];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        char *dst = a->out + row_offset(a, r, a->o_tok, a->o_head);
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t c = 0; c < C; c++) store16(dst + c * 16 * 2, acc[r][c] * inv, DTYPE_BF16);
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(SYS_arch_prctl)
#define PREFILL_AMX 1
#define AMX_ROWS 16     /* rows per A tile: items run their rows 16 at a time */
#define AMX_ITEM_ROWS 192 /* rows per item at head_dim 64 (64 tokens x 3 heads; half at 128, a quarter at 256,
                             * so an item's buffers stay ~100 KiB of stack): each key chunk is repacked once per
                             * item, and its tile products are too quick to hide the repacking of 48 rows' items */

/* 1 when this process may use the AMX tiles (Linux grants the tile state per process: asked once, before
 * the threads start) */
static int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return granted;
}

/* tiles of 16 rows of 64 bytes: tmm0 A, tmm1 / tmm2 B (alternating, so a load does not wait on the product
 * still reading the other), tmm4..tmm7 C */
static void configure_tiles(void) {
    struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = AMX_ROWS;
        c.colsb[t] = 64;
    }
    __asm__ volatile("" : : "r"(&c) : "memory");   /* ldtilecfg's asm names only c's first 8 bytes as read */
    _tile_loadconfig(&c);
}

/* product T (of `count`): B tile register BR (1 or 2, alternating) times tmm0 into C tile register CR = 4 + T
 * (the intrinsics take register numbers as literal tokens) */
#define TILE_PRODUCT(T, CR, BR, count, b, stride)                           \
    if ((count) > (T)) {                                                     \
        _tile_loadd(BR, (b), (stride));                                      \
        _tile_dpbf16ps(CR, 0, BR);                                           \
    }
#define TILE_STORE(T, CR, count, dst, stride) if ((count) > (T)) _tile_stored(CR, (dst), (stride))
#define TILE_ZERO(T, CR, count) if ((count) > (T)) _tile_zero(CR)

/* prefill_item_bf16 through the AMX tiles; D = 16 C, a multiple of 32. The same keys, masks, online softmax
 * and bf16-rounded probabilities; the two products as tile products on the same operand layouts (kt's
 * dimension pairs are QK^T's B operand, vp's key pairs P @ V's): per 16 rows and chunk, the scores are up to
 * 4 C tiles of 16 keys (D / 32 steps of k), P @ V up to 4 C tiles of 16 dimensions at a time (two steps of
 * 32 keys). Rows padded to a multiple of 16 with copies of the last row (computed, never stored). */
static inline __attribute__((always_inline)) void prefill_item_amx(const struct prefill_args *a, int64_t C) {
    const int64_t D = 16 * C, D2 = D / 2, G = a->group, bs = a->block_size;
    const int64_t rows = (a->i1 - a->i0) * G, padded = (rows + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
    int64_t lo, hi;                                                  /* keys [lo, hi) */
    item_keys(a, &lo, &hi);
    const int64_t chunk_blocks = CHUNK / bs;
    uint16_t qa[padded][D] __attribute__((aligned(64)));             /* q's rows: the A operand of QK^T */
    float acc[padded][D] __attribute__((aligned(64)));
    float m[padded], l[padded];
    int32_t pos[padded];
    uint32_t kt[D2][CHUNK] __attribute__((aligned(64)));            /* kt[e][j]: key j's dimensions 2e, 2e + 1 */
    uint32_t vp[CHUNK / 2][D] __attribute__((aligned(64)));         /* vp[i][d]: keys 2i, 2i + 1 at dimension d */
    float p[AMX_ROWS][CHUNK] __attribute__((aligned(64)));          /* scores, then probabilities */
    uint32_t pp[AMX_ROWS][CHUNK / 2] __attribute__((aligned(64)));  /* p as bf16 pairs: the A operand of P @ V */
    float o[AMX_ROWS][D] __attribute__((aligned(64)));              /* P @ V of one chunk */
    for (int64_t r = 0; r < padded; r++) {
        const int64_t real = r < rows ? r : rows - 1;
        memcpy(qa[r], a->q + row_offset(a, real, a->q_tok, a->q_head), (size_t)D * 2);
        memset(acc[r], 0, (size_t)D * sizeof(float));
    }
    start_rows(a, rows, padded, m, l, pos);
    configure_tiles();
    for (int64_t b0 = lo / bs; b0 * bs < hi; b0 += chunk_blocks) {
        int64_t first, end;
        chunk_keys(b0, bs, chunk_blocks, lo, hi, &first, &end);
        const int64_t n = end - first;
        pair_chunk(a, first, n, D, kt, vp);
        for (int64_t j = n; j < (n + 15) / 16 * 16; j++)             /* zeros up to the tile's 16 keys */
            for (int64_t e = 0; e < D2; e++) kt[e][j] = 0;
        for (int64_t j = n; j < (n + 31) / 32 * 32; j++) {           /* and up to the 32 keys of a P @ V step */
            uint16_t *vdst = (uint16_t *)vp[j / 2];                  /* (p is 0 there; stale V could be NaN) */
            for (int64_t d = 0; d < D; d++) vdst[2 * d + (j & 1)] = 0;
        }
        for (int64_t r0 = 0; r0 < padded; r0 += AMX_ROWS) {
            const int64_t last = pos[r0 + AMX_ROWS - 1];
            if (last < first) continue;
            const int64_t nb = (last + 1 < end ? last + 1 : end) - first;
            const int64_t key_tiles = (nb + 15) / 16, steps = (nb + 31) / 32;
            TILE_ZERO(0, 4, key_tiles); TILE_ZERO(1, 5, key_tiles); TILE_ZERO(2, 6, key_tiles); TILE_ZERO(3, 7, key_tiles);
            for (int64_t e = 0; e < D2; e += 16) {                   /* scores: 32 dimensions a step */
                _tile_loadd(0, qa[r0] + 2 * e, D * 2);
                TILE_PRODUCT(0, 4, 1, key_tiles, &kt[e][0], CHUNK * 4);
                TILE_PRODUCT(1, 5, 2, key_tiles, &kt[e][16], CHUNK * 4);
                TILE_PRODUCT(2, 6, 1, key_tiles, &kt[e][32], CHUNK * 4);
                TILE_PRODUCT(3, 7, 2, key_tiles, &kt[e][48], CHUNK * 4);
            }
            TILE_STORE(0, 4, key_tiles, &p[0][0], CHUNK * 4); TILE_STORE(1, 5, key_tiles, &p[0][16], CHUNK * 4);
            TILE_STORE(2, 6, key_tiles, &p[0][32], CHUNK * 4); TILE_STORE(3, 7, key_tiles, &p[0][48], CHUNK * 4);
            float correction[AMX_ROWS];
            for (int rr = 0; rr < AMX_ROWS; rr++) {
                for (int64_t k16 = 0; k16 < key_tiles * 16; k16 += 16) {
                    const v16i key = (v16i){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15} + (int32_t)(first + k16);
                    v16i visible = (key <= pos[r0 + rr]) & (key < (int32_t)end);
                    if (a->window > 0) visible &= key > pos[r0 + rr] - (int32_t)a->window;
                    v16f x;
                    memcpy(&x, &p[rr][k16], sizeof x);
                    x = select16(visible, x * splat16(a->scale), splat16(-INFINITY));
                    memcpy(&p[rr][k16], &x, sizeof x);
                }
                correction[rr] = softmax_step(p[rr], key_tiles * 16, &m[r0 + rr], &l[r0 + rr]);
                for (int64_t k32 = 0; k32 < steps * 32; k32 += 32) {  /* keys k32 .. k32 + 31 as 16 bf16 pairs */
                    const __m512 lo16 = _mm512_load_ps(&p[rr][k32]);
                    const __m512 hi16 = k32 + 16 < key_tiles * 16 ? _mm512_load_ps(&p[rr][k32 + 16])
                                                                  : _mm512_setzero_ps();
                    _mm512_store_si512(&pp[rr][k32 / 2], (__m512i)_mm512_cvtne2ps_pbh(hi16, lo16));
                }
            }
            for (int64_t c0 = 0; c0 < C; c0 += 4) {                  /* P @ V, 64 dimensions at a time */
                const int64_t dim_tiles = C - c0 < 4 ? C - c0 : 4;
                TILE_ZERO(0, 4, dim_tiles); TILE_ZERO(1, 5, dim_tiles); TILE_ZERO(2, 6, dim_tiles); TILE_ZERO(3, 7, dim_tiles);
                for (int64_t h = 0; h < steps; h++) {
                    _tile_loadd(0, &pp[0][16 * h], CHUNK * 2);
                    TILE_PRODUCT(0, 4, 1, dim_tiles, &vp[16 * h][16 * c0], D * 4);
                    TILE_PRODUCT(1, 5, 2, dim_tiles, &vp[16 * h][16 * c0 + 16], D * 4);
                    TILE_PRODUCT(2, 6, 1, dim_tiles, &vp[16 * h][16 * c0 + 32], D * 4);
                    TILE_PRODUCT(3, 7, 2, dim_tiles, &vp[16 * h][16 * c0 + 48], D * 4);
                }
                TILE_STORE(0, 4, dim_tiles, &o[0][16 * c0], D * 4); TILE_STORE(1, 5, dim_tiles, &o[0][16 * c0 + 16], D * 4);
                TILE_STORE(2, 6, dim_tiles, &o[0][16 * c0 + 32], D * 4);
                TILE_STORE(3, 7, dim_tiles, &o[0][16 * c0 + 48], D * 4);
            }
            for (int rr = 0; rr < AMX_ROWS; rr++) {                  /* acc = acc * correction + P @ V */
                for (int64_t c = 0; c < C; c++) {
                    v16f x, y;
                    memcpy(&x, &acc[r0 + rr][16 * c], sizeof x);
                    memcpy(&y, &o[rr][16 * c], sizeof y);
                    x = x * splat16(correction[rr]) + y;
                    memcpy(&acc[r0 + rr][16 * c], &x, sizeof x);
                }
            }
        }
    }
    _tile_release();
    for (int64_t r = 0; r < rows; r++) {
        char *dst = a->out + row_offset(a, r, a->o_tok, a->o_head);
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t c = 0; c < C; c++) {
            v16f x;
            memcpy(&x, &acc[r][16 * c], sizeof x);
            store16(dst + c * 16 * 2, x * inv, DTYPE_BF16);
        }
    }
}
#endif

/* q [T, Hq, D] (strides q_tok, q_head in elements) holding each sequence's newest chunk, cu_q [S + 1]
 * int32 the chunks' offsets; caches [NB, bs, Hkv, D] (element strides c_block, c_tok, c_head, 1) in q's
 * dtype; block_tables [S, max_blocks] int32 (row stride bt_row); seq_lens [S] int32 (history + chunk);
 * window <= 0: none; out [T, Hq, D] (strides o_tok, o_head). Returns 0, or -1 when out of memory. */
int paged_prefill_cpu(const void *q, int64_t q_tok, int64_t q_head,
                      const void *k_cache, const void *v_cache, int64_t c_block, int64_t c_tok, int64_t c_head,
                      int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                      int64_t num_seqs, int64_t group, const int32_t *block_tables, int64_t bt_row,
                      const int32_t *cu_q, const int32_t *seq_lens, float scale, int64_t window,
                      int dtype, void *out, int64_t o_tok, int64_t o_head, int threads, int use_amx) {
    const int64_t elem = dtype_size(dtype);
#if defined(PREFILL_AMX)
    const int amx = use_amx && dtype == DTYPE_BF16 && head_dim % 32 == 0 && amx_granted();
#else
    (void)use_amx;
#endif
#if defined(PREFILL_AMX)
    const int64_t item_rows = amx ? (head_dim <= 64 ? AMX_ITEM_ROWS : AMX_ITEM_ROWS * 64 / head_dim) : ITEM_ROWS;
#else
    const int64_t item_rows = ITEM_ROWS;
#endif
    const int64_t tile = item_rows / group > 0 ? item_rows / group : 1;
    int64_t tiles = 0;
    for (int64_t s = 0; s < num_seqs; s++) tiles += (cu_q[s + 1] - cu_q[s] + tile - 1) / tile;
    int64_t *tile_seq = malloc((size_t)(tiles > 0 ? tiles : 1) * 2 * sizeof(int64_t));
    if (tile_seq == NULL) return -1;
    int64_t *tile_start = tile_seq + (tiles > 0 ? tiles : 1);
    int64_t t = 0;
    for (int64_t s = 0; s < num_seqs; s++) {
        for (int64_t i = 0; i < cu_q[s + 1] - cu_q[s]; i += tile, t++) {
            tile_seq[t] = s;
            tile_start[t] = i;
        }
    }
    const int64_t items = tiles * num_kv_heads;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && items > 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t it = items - 1 - item;     /* later tiles (more keys) first */
        const int64_t s = tile_seq[it / num_kv_heads], i0 = tile_start[it / num_kv_heads];
        const int64_t n = cu_q[s + 1] - cu_q[s];
        const struct prefill_args a = {
            .q = (const char *)q, .k = (const char *)k_cache, .v = (const char *)v_cache, .out = (char *)out,
            .q_tok = q_tok * elem, .q_head = q_head * elem, .o_tok = o_tok * elem, .o_head = o_head * elem,
            .c_block = c_block * elem, .c_tok = c_tok * elem, .c_head = c_head * elem,
            .num_blocks = num_blocks, .block_size = block_size, .group = group,
            .table = block_tables + s * bt_row, .first_pos = seq_lens[s] - n,
            .i0 = i0, .i1 = i0 + tile < n ? i0 + tile : n, .token0 = cu_q[s],
            .kv_head = it % num_kv_heads, .window = window, .scale = scale,
        };
        /* constant dtypes and head_dim / 16 at the common call sites: the compiler specialises them */
        if (dtype == DTYPE_F32) {
            if (head_dim == 64) prefill_item(&a, DTYPE_F32, 4);
            else if (head_dim == 128) prefill_item(&a, DTYPE_F32, 8);
            else prefill_item(&a, DTYPE_F32, head_dim / 16);
        } else {
#if defined(PREFILL_AMX)
            if (amx) {
                if (head_dim == 64) prefill_item_amx(&a, 4);
                else if (head_dim == 128) prefill_item_amx(&a, 8);
                else prefill_item_amx(&a, head_dim / 16);
                continue;
            }
#endif
#if defined(__AVX512BF16__)
            if (head_dim == 64) prefill_item_bf16(&a, 4);
            else if (head_dim == 128) prefill_item_bf16(&a, 8);
            else prefill_item_bf16(&a, head_dim / 16);
#else
            if (head_dim == 64) prefill_item(&a, DTYPE_BF16, 4);
            else if (head_dim == 128) prefill_item(&a, DTYPE_BF16, 8);
            else prefill_item(&a, DTYPE_BF16, head_dim / 16);
#endif
        }
    }
    free(tile_seq);
    return 0;
}

/* 1 when paged_prefill_cpu runs bfloat16 items through the AMX tiles (the build targets AMX and Linux grants
 * the tile state); 0 where it keeps the AVX-512 / generic items */
int paged_prefill_amx(void) {
#if defined(PREFILL_AMX)
    return amx_granted();
#else
    return 0;
#endif
}
