/* Paged decode attention for the CPU: one query token per sequence, K/V read straight from the paged
 * cache (no gather), online softmax in float32. Built and loaded by cpu_decode.py (cc -O3
 * -march=native -fopenmp); called through ctypes with raw pointers and element strides.
 *
 * Work item = (sequence, KV head): its G = Hq / Hkv query heads share every K/V row they read.
 * Per cache block of the item (bs tokens): scores [G][bs] = q . k (+ ALiBi), -inf outside the visible
 * range; running max / sum / accumulator update with exp over the block's scores; acc += p @ V.
 * Vectors are GCC vector extensions of 8 floats (head_dim and block_size are multiples of 8), so the
 * same source compiles to AVX2 or AVX-512 by -march=native.
 *
 * Key j is visible from the query at p = seq_len - 1 when j <= p and, with a window W > 0, j > p - W.
 * A sequence with seq_len <= 0 outputs zeros. Block ids are clamped into [0, num_blocks) (the
 * Python wrapper's callers check them; the clamp only keeps a bad id from reading outside the cache).
 *
 * dtype codes (q, caches and out share one): 0 = float32, 1 = bfloat16 (upper half of a float32).
 * Limits (checked by the caller): head_dim <= 256 and a multiple of 8, block_size a multiple of 8
 * and <= 64, G <= 64.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define MAX_CHUNKS 32      /* head_dim / 8 */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
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
    return (v8f)(__builtin_convertvector(h, v8i) << 16);
}

/* exp(x) for x <= 0 or -inf (scores minus their running max): x = n ln2 + r, exp(r) by a degree-6
 * polynomial, 2^n built in the exponent bits. Relative error ~2e-7; x below -87 gives 0. */
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

static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline void store_float(char *dst, float x, int dtype) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, &x, sizeof x);
        return;
    }
    union { uint32_t u; float f; } v = {.f = x};
    uint16_t h;
    if ((v.u & 0x7f800000u) == 0x7f800000u && (v.u & 0x7fffffu)) {
        h = (uint16_t)((v.u >> 16) | 0x40u);                         /* NaN stays NaN */
    } else {
        h = (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);  /* nearest even, as torch */
    }
    memcpy(dst, &h, sizeof h);
}

struct item_args {
    const char *q;                       /* this sequence's query row, first head */
    int64_t q_head;                      /* head stride of q, bytes */
    const char *k, *v;                   /* the caches */
    int64_t c_block, c_tok, c_head;      /* cache strides, bytes */
    int64_t num_blocks, block_size, head_dim, group, kv_lo, kv_hi;
    const int32_t *table;
    int64_t seq_len, window;
    float scale;
    const float *slopes;                 /* [Hq], or NULL */
    char *out;                           /* this sequence's output row, first head */
    int64_t o_head;                      /* head stride of out, bytes */
};

/* One sequence, KV heads [kv_lo, kv_hi): each cache block is visited once for all of them. */
static inline __attribute__((always_inline)) void decode_item(const struct item_args *a, int dtype, int64_t C) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    const int64_t bs = a->block_size, G = a->group;
    const int64_t R = (a->kv_hi - a->kv_lo) * G;            /* query heads of this item */
    const int64_t h0 = a->kv_lo * G;                        /* its first query head */
    v8f qv[R][C], acc[R][C], row[MAX_CHUNKS];
    float sc[R][bs] __attribute__((aligned(32)));
    float m[R], l[R];
    for (int64_t r = 0; r < R; r++) {
        for (int64_t c = 0; c < C; c++) {
            qv[r][c] = load8(a->q + (h0 + r) * a->q_head + c * 8 * elem, dtype) * splat(a->scale);
            acc[r][c] = splat(0.0f);
        }
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    const int64_t pos = a->seq_len - 1;
    const int64_t lo = (a->window > 0 && pos - a->window + 1 > 0) ? pos - a->window + 1 : 0;
    for (int64_t b = lo / bs; a->seq_len > 0 && b * bs < a->seq_len; b++) {
        int64_t block = a->table[b];
        block = block < 0 ? 0 : (block >= a->num_blocks ? a->num_blocks - 1 : block);
        const int64_t j0 = b * bs;
        const int64_t t_lo = lo > j0 ? lo - j0 : 0;
        const int64_t t_hi = a->seq_len - j0 < bs ? a->seq_len - j0 : bs;
        if ((b + 1) * bs < a->seq_len) {        /* the next block is a random address: fetch it early */
            int64_t next = a->table[b + 1];
            next = next < 0 ? 0 : (next >= a->num_blocks ? a->num_blocks - 1 : next);
            const char *kn = a->k + next * a->c_block, *vn = a->v + next * a->c_block;
            for (int64_t off = 0; off < bs * a->c_tok; off += 64) {
                __builtin_prefetch(kn + off);
                __builtin_prefetch(vn + off);
            }
        }
        for (int64_t r = 0; r < R; r++) {
            for (int64_t t = 0; t < bs; t++) sc[r][t] = -INFINITY;
        }
        for (int64_t t = t_lo; t < t_hi; t++) {
            const char *k_row = a->k + block * a->c_block + t * a->c_tok;
            for (int64_t h = a->kv_lo; h < a->kv_hi; h++) {
                for (int64_t c = 0; c < C; c++) row[c] = load8(k_row + h * a->c_head + c * 8 * elem, dtype);
                for (int64_t r = (h - a->kv_lo) * G; r < (h - a->kv_lo + 1) * G; r++) {
                    v8f dot = qv[r][0] * row[0];
                    for (int64_t c = 1; c < C; c++) dot += qv[r][c] * row[c];
                    sc[r][t] = hsum8(dot);
                    if (a->slopes != NULL) sc[r][t] += a->slopes[h0 + r] * (float)(j0 + t - pos);
                }
            }
        }
        for (int64_t r = 0; r < R; r++) {
            float block_max = -INFINITY;
            for (int64_t t = t_lo; t < t_hi; t++) block_max = sc[r][t] > block_max ? sc[r][t] : block_max;
            const float new_max = block_max > m[r] ? block_max : m[r];
            const v8f correction = exp8(splat(m[r] - new_max));
            v8f sum = splat(0.0f);
            for (int64_t t = 0; t < bs; t += 8) {
                v8f s;
                memcpy(&s, &sc[r][t], sizeof s);
                s = exp8(s - splat(new_max));
                memcpy(&sc[r][t], &s, sizeof s);
                sum += s;
            }
            l[r] = l[r] * correction[0] + hsum8(sum);
            m[r] = new_max;
            for (int64_t c = 0; c < C; c++) acc[r][c] *= correction;
        }
        for (int64_t t = t_lo; t < t_hi; t++) {
            const char *v_row = a->v + block * a->c_block + t * a->c_tok;
            for (int64_t h = a->kv_lo; h < a->kv_hi; h++) {
                for (int64_t c = 0; c < C; c++) row[c] = load8(v_row + h * a->c_head + c * 8 * elem, dtype);
                for (int64_t r = (h - a->kv_lo) * G; r < (h - a->kv_lo + 1) * G; r++) {
                    const v8f w = splat(sc[r][t]);
                    for (int64_t c = 0; c < C; c++) acc[r][c] += w * row[c];
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        for (int64_t c = 0; c < C; c++) {
            for (int64_t i = 0; i < 8; i++) {
                store_float(a->out + (h0 + r) * a->o_head + (c * 8 + i) * elem, acc[r][c][i] * inv, dtype);
            }
        }
    }
}

/* q [S, Hq, D] (strides q_tok, q_head in elements); caches [NB, bs, Hkv, D] with element strides
 * (c_block, c_tok, c_head, 1); block_tables [S, max_blocks] int32 (row stride bt_row); seq_lens [S]
 * int32; slopes [Hq] float32 or NULL; window <= 0: none; out [S, Hq, D] (strides o_tok, o_head). */
void paged_decode_cpu(const void *q, int64_t q_tok, int64_t q_head,
                      const void *k_cache, const void *v_cache, int64_t c_block, int64_t c_tok, int64_t c_head,
                      int64_t num_blocks, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                      int64_t num_seqs, int64_t group, const int32_t *block_tables, int64_t bt_row,
                      const int32_t *seq_lens, float scale, const float *slopes, int64_t window,
                      int dtype, void *out, int64_t o_tok, int64_t o_head, int threads) {
    const int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    /* a work item is one sequence with all its KV heads (each block read once, whole); with fewer
     * sequences than two per thread, one (sequence, KV head) so that every thread has work */
    const int64_t per_seq = num_seqs >= 2 * threads ? 1 : num_kv_heads;
    const int64_t heads_per_item = num_kv_heads / per_seq;
    const int64_t items = num_seqs * per_seq;
    #pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1 && items > 1)
    for (int64_t item = 0; item < items; item++) {
        const int64_t s = item / per_seq, kv_lo = (item % per_seq) * heads_per_item;
        const struct item_args a = {
            .q = (const char *)q + s * q_tok * elem, .q_head = q_head * elem,
            .k = (const char *)k_cache, .v = (const char *)v_cache,
            .c_block = c_block * elem, .c_tok = c_tok * elem, .c_head = c_head * elem,
            .num_blocks = num_blocks, .block_size = block_size, .head_dim = head_dim, .group = group,
            .kv_lo = kv_lo, .kv_hi = kv_lo + heads_per_item,
            .table = block_tables + s * bt_row, .seq_len = seq_lens[s], .window = window, .scale = scale,
            .slopes = slopes, .out = (char *)out + s * o_tok * elem, .o_head = o_head * elem,
        };
        /* constant dtype and head_dim / 8 at the common call sites: the compiler specialises them */
        if (dtype == DTYPE_F32) {
            if (head_dim == 64) decode_item(&a, DTYPE_F32, 8);
            else if (head_dim == 128) decode_item(&a, DTYPE_F32, 16);
            else decode_item(&a, DTYPE_F32, head_dim / 8);
        } else {
            if (head_dim == 64) decode_item(&a, DTYPE_BF16, 8);
            else if (head_dim == 128) decode_item(&a, DTYPE_BF16, 16);
            else decode_item(&a, DTYPE_BF16, head_dim / 8);
        }
    }
}
