/* A decode step's dense decoder layers on CPU in one call (TP = 1), so that the ~10 Python-level calls of
 * each layer (checks, allocations, ctypes, nn.Module dispatch: ~170 us a layer on the 2-core VM, a fifth
 * of a float32 decode step of SmolLM2) become one. Built and loaded by cpu_layers.py.
 *
 * Nothing is computed here: every op is a call to the function the Python path calls (the step's product on
 * tile-packed weights, step_args.gemm: cpu_gemm.c's gemm or cpu_amx.c's amx_gemm, as the layers' plans run
 * at this row count; cpu_fused.c's rms_norm_rows / rotary_rows / silu_mul_rows, cpu_decode.c's paged_decode_cpu), through
 * pointers into those libraries, with the arguments the Python path passes (strides included), so a step
 * gives bit for bit the Python path's result. Per layer, as workers/models/decoder.py:
 *
 *   layer 0:  residual = hidden;                  normed = norm(hidden)
 *   layer i:  normed, residual = norm(hidden + residual)
 *   qkv = normed @ Wqkv^T (+ bias)                [rows, (Hq + 2 Hkv) D]
 *   qk = rotary(qkv[:, :Hq + Hkv])                [rows, Hq + Hkv, D]
 *   attn = decode(q = qk[:, :Hq]; stores k = qk[:, Hq:], v = qkv[:, Hq + Hkv:] first)   [rows, Hq, D]
 *   normed, residual = norm(attn @ Wo^T + residual)
 *   hidden = silu_mul(normed @ Wgu^T (+ bias)) @ Wdown^T
 *
 * With LoRA rows in the step (``lora_count`` > 0), each of the four products that has LoRA slots
 * (``layer_args.lora[i].a`` set) then adds their rows' adapter products (cpu_lora.c's lora_add, as the
 * layer loop's ``LoraLinearSlots.add_delta`` calls it).
 *
 * Returns the last layer's hidden and the residual stream (the final norm stays in Python). */
#include <stdint.h>
#include <string.h>

typedef void (*gemm_fn)(const void *x, int64_t x_stride, int64_t m, int64_t k, const void *p, int64_t n,
                        const void *bias, void *y, int64_t y_stride, int dtype, int threads);
typedef void (*norm_fn)(const void *x, int64_t x_row, const void *residual, int64_t r_row, const void *weight,
                        void *out, int64_t o_row, void *new_residual, int64_t n_row, int64_t rows, int64_t size,
                        float eps, int dtype, int threads);
typedef void (*rotary_fn)(const void *x, int64_t x_tok, const void *cos, const void *signed_sin, void *out,
                          int64_t tokens, int64_t heads, int64_t head_dim, int dtype, int threads);
typedef void (*silu_fn)(const void *gate_up, int64_t gu_row, void *out, int64_t o_row, int64_t rows, int64_t inter,
                        int dtype, int threads);
typedef void (*decode_fn)(const void *q, int64_t q_tok, int64_t q_head, const void *k_cache, const void *v_cache,
                          int64_t c_block, int64_t c_tok, int64_t c_head, int64_t num_blocks, int64_t block_size,
                          int64_t num_kv_heads, int64_t head_dim, int64_t num_seqs, int64_t group,
                          const int32_t *block_tables, int64_t bt_row, const int32_t *seq_lens, float scale,
                          const float *slopes, int64_t window, int dtype, void *out, int64_t o_tok, int64_t o_head,
                          int threads, const void *k_new, int64_t k_tok, int64_t k_head, const void *v_new,
                          int64_t v_tok, int64_t v_head, const int32_t *slots, float softcap, int cache_dtype,
                          const uint16_t *k_scale, const uint16_t *v_scale, uint16_t k_static, uint16_t v_static,
                          const float *sinks);

typedef int (*lora_fn)(const void *x, int64_t xs, int64_t in, const void *a, const void *e, int64_t nr, int64_t out,
                       const int64_t *seg_off, int64_t nseg, const int32_t *order, int64_t count, const int32_t *slots,
                       const float *scales, void *y, int64_t ys, int dtype, int threads);

struct kernel_table {            /* the other libraries' functions (cpu_layers.py fills it once) */
    norm_fn norm;
    rotary_fn rotary;
    silu_fn silu;
    decode_fn decode;
    lora_fn lora;                /* NULL where cpu_lora.c is not built */
};

struct lora_proj {               /* one product's LoRA slots (workers/lora/slots.py); a == NULL: none */
    const void *a, *e;           /* [S, nr, in], [S, nr, out] */
    const int64_t *seg_off;      /* [nseg + 1] */
    int64_t nseg, nr;
};

struct layer_args {              /* one layer: tile-packed weights, optional qkv bias, norms, its caches */
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *gate_up, *down;
    void *k_cache, *v_cache;     /* [num_blocks, block_size, Hkv, D], the step's dtype or 8-bit rows */
    const uint16_t *k_scale, *v_scale;   /* 8-bit rows: their float16 scales [num_blocks, block_size, Hkv]; else NULL */
    int64_t window;              /* sliding window (0: none) */
    float scale;
    uint16_t k_static, v_static; /* a float8 cache's checkpoint scales, float16 bits (0: each row its own) */
    struct lora_proj lora[4];    /* qkv, o, gate_up, down */
};

struct step_args {
    int64_t rows, hidden, num_heads, num_kv_heads, head_dim, inter;
    float eps;
    int dtype, threads, cache_dtype;   /* cache_dtype: cpu_decode.CACHE_CODES (the step's dtype, 2 = int8, 3 = fp8) */
    int64_t num_blocks, block_size, c_block, c_tok, c_head;   /* cache geometry (element strides) */
    const int32_t *block_tables, *seq_lens, *slots;
    int64_t bt_row;
    const void *cos, *signed_sin;                             /* [rows, 1, D] */
    /* buffers, contiguous, the step's dtype; hidden_buf in: the embeddings, out: the last layer's output */
    void *hidden_buf, *residual, *spare_residual, *normed, *qkv, *qk, *attn, *o, *gate_up, *act;
    /* LoRA rows (lora_count 0: none): the tokens with a slot sorted by slot, each token's slot, each slot's scale */
    const int32_t *lora_order, *lora_slots;
    int64_t lora_count;
    const float *lora_scales;
    gemm_fn gemm;                /* the product of every linear layer in this step (cpu_gemm.c's gemm, cpu_amx.c's) */
};

/* y += the step's LoRA rows' products of x for product p of layer l (nothing without LoRA rows or slots) */
static inline void add_lora(const struct kernel_table *k, const struct layer_args *l, int p, const struct step_args *s,
                            const void *x, int64_t in, void *y, int64_t out) {
    const struct lora_proj *q = &l->lora[p];
    if (s->lora_count == 0 || q->a == NULL) return;
    k->lora(x, in, in, q->a, q->e, q->nr, out, q->seg_off, q->nseg, s->lora_order, s->lora_count, s->lora_slots,
            s->lora_scales, y, out, s->dtype, s->threads);
}

void decode_layers(const struct kernel_table *k, const struct layer_args *layers, int64_t num_layers,
                   const struct step_args *s) {
    const int64_t elem = s->dtype == 0 ? 4 : 2;
    const int64_t rows = s->rows, H = s->hidden, D = s->head_dim, Hq = s->num_heads, Hkv = s->num_kv_heads;
    const int64_t qkv_width = (Hq + 2 * Hkv) * D, qk_width = (Hq + Hkv) * D, I = s->inter;
    const int dt = s->dtype, th = s->threads;
    char *residual = s->residual, *spare = s->spare_residual;
    memcpy(residual, s->hidden_buf, (size_t)(rows * H * elem));          /* layer 0: residual = hidden */
    for (int64_t i = 0; i < num_layers; i++) {
        const struct layer_args *l = &layers[i];
        if (i == 0) {
            k->norm(s->hidden_buf, H, NULL, 0, l->input_norm, s->normed, H, NULL, 0, rows, H, s->eps, dt, th);
        } else {
            k->norm(s->hidden_buf, H, residual, H, l->input_norm, s->normed, H, spare, H, rows, H, s->eps, dt, th);
            char *t = residual; residual = spare; spare = t;
        }
        s->gemm(s->normed, H, rows, H, l->qkv, qkv_width, l->qkv_bias, s->qkv, qkv_width, dt, th);
        add_lora(k, l, 0, s, s->normed, H, s->qkv, qkv_width);
        k->rotary(s->qkv, qkv_width, s->cos, s->signed_sin, s->qk, rows, Hq + Hkv, D, dt, th);
        k->decode(s->qk, qk_width, D, l->k_cache, l->v_cache, s->c_block, s->c_tok, s->c_head, s->num_blocks,
                  s->block_size, Hkv, D, rows, Hq / Hkv, s->block_tables, s->bt_row, s->seq_lens, l->scale, NULL,
                  l->window, dt, s->attn, Hq * D, D, th,
                  (const char *)s->qk + Hq * D * elem, qk_width, D,
                  (const char *)s->qkv + qk_width * elem, qkv_width, D, s->slots, 0.0f, s->cache_dtype,
                  l->k_scale, l->v_scale, l->k_static, l->v_static, NULL);
        s->gemm(s->attn, Hq * D, rows, Hq * D, l->o, H, NULL, s->o, H, dt, th);
        add_lora(k, l, 1, s, s->attn, Hq * D, s->o, H);
        k->norm(s->o, H, residual, H, l->post_norm, s->normed, H, spare, H, rows, H, s->eps, dt, th);
        { char *t = residual; residual = spare; spare = t; }
        s->gemm(s->normed, H, rows, H, l->gate_up, 2 * I, NULL, s->gate_up, 2 * I, dt, th);
        add_lora(k, l, 2, s, s->normed, H, s->gate_up, 2 * I);
        k->silu(s->gate_up, 2 * I, s->act, I, rows, I, dt, th);
        s->gemm(s->act, I, rows, I, l->down, H, NULL, s->hidden_buf, H, dt, th);
        add_lora(k, l, 3, s, s->act, I, s->hidden_buf, H);
    }
    if (residual != (char *)s->residual) memcpy(s->residual, residual, (size_t)(rows * H * elem));
}
