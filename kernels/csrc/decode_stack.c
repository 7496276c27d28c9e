/* A decode step's decoder layers in one call and one OpenMP region.

   A decode step at a few rows spends as much time between its ops as in them: some 300
   kernel calls (30 layers x norm, qkv, rotary, KV write, attention, o, norm, gate/up, silu,
   down), each a Python wrapper, a ctypes call and an OpenMP region of its own, about 6 ms of
   a 25 ms step on SmolLM2-135M where the weights take 15 ms to read. Here the same ops run
   back to back, in the same order on the same buffers' values, each the hr_ function its
   exported kernel calls, separated by barriers instead of regions: every value is the one
   the per-op path computes, bit for bit.

   The layers are Llama's: pre-norm attention with fused qkv and neox rotary, a gated SiLU
   MLP with fused gate/up, no biases, one rank. Activations and the norms share one dtype,
   the KV cache is in it too or int8 (kv_dtype); the four matrices of every layer are in it
   too, or all quantized alike (kernels/quantized.py: the same bits and group size). The
   caller checks that a step fits (no more rows than the per-op path multiplies in C:
   decodes, and in float32 or on bf16 panels prompt chunks beside them, whose attention is
   the same paged-attention call as the per-op path's) and keeps to the per-op path
   otherwise. Each layer attends within its own sliding window, or to all
   keys (sliding_windows). */

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* Each layer's tensors, as data pointers: the row of `layers` for layer l. A matrix takes
   MATRIX_SLOTS (cpu_kernels.h). */
enum {
    INPUT_NORM = 0,                       /* [hidden] */
    QKV = 1,                              /* [(H + 2 Hkv) D, hidden] */
    O_PROJ = QKV + MATRIX_SLOTS,          /* [hidden, H D] */
    POST_NORM = O_PROJ + MATRIX_SLOTS,    /* [hidden] */
    GATE_UP = POST_NORM + 1,              /* [2 I, hidden] */
    DOWN = GATE_UP + MATRIX_SLOTS,        /* [hidden, I] */
    KV_CACHE = DOWN + MATRIX_SLOTS,       /* [num_blocks, 2, block_size, Hkv, row] */
    LAYER_TENSORS                         /* row length */
};

/* The step's activations: [T, n] rows in the model's dtype (wide: float32). */
typedef struct {
    char *residual, *normed, *qkv, *query, *key, *attention, *gate_up, *act, *hidden;
    float *wide;
} Buffers;

static size_t max3(size_t a, size_t b, size_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* One allocation for all of them; NULL when out of memory. */
static char *alloc_buffers(Buffers *b, int64_t T, int64_t hidden, int64_t inter, int64_t H,
                           int64_t Hkv, int64_t D, size_t size) {
    const size_t qkv = (size_t)((H + 2 * Hkv) * D);
    const size_t widths[] = {hidden, hidden, qkv, H * D, Hkv * D, H * D, 2 * inter, inter, hidden};
    size_t total = 0;
    for (int i = 0; i < 9; i++) total += (widths[i] * T * size + 63) / 64 * 64;
    const int64_t widest = (int64_t)max3(hidden, inter, H * D);
    const int64_t a8 = hr_a8_floats(T, widest); /* the int8 activations' scratch, if larger */
    const int64_t skinny = hr_skinny_floats(T, widest);
    const size_t wide = (size_t)(a8 > skinny ? a8 : skinny) * sizeof(float);
    char *base = aligned_alloc(64, (total + wide + 63) / 64 * 64);
    if (base == NULL) return NULL;
    char **slots[] = {&b->residual, &b->normed, &b->qkv,    &b->query, &b->key,
                      &b->attention, &b->gate_up, &b->act, &b->hidden};
    char *next = base;
    for (int i = 0; i < 9; i++) {
        *slots[i] = next;
        next += (widths[i] * T * size + 63) / 64 * 64;
    }
    b->wide = (float *)next;
    return base;
}

/* The decoder layers of a decode step: hidden [T, hidden] holds the tokens' embeddings on
   entry and the final norm's output on return. Returns 0, or -1 when memory ran out (hidden
   and the KV cache are then undefined).

   Or a run of them, the step's layers in several calls (so the caller can act between them:
   the thread governor's look in a long step): `residual` [T, hidden] then carries the
   residual stream from one call to the next. A call that does not start the stack
   (!starts) takes the previous layer's output in hidden and the stream in residual; one
   that does not end it (!ends) leaves them there instead of the final norm's output. The
   values are those of one call over all the layers: the same ops on the same values. */
int headrace_decode_layers(
    void *hidden, void *residual, int starts, int ends, int64_t T, int num_layers,
    const int64_t *layers,          /* [num_layers, LAYER_TENSORS] data pointers */
    const int32_t *sliding_windows, /* [num_layers]: each layer's window, 0 for none */
    const void *final_norm, float eps, int64_t hidden_size, int64_t intermediate_size,
    int num_heads, int num_kv_heads, int head_dim, int dtype, int kv_dtype, int weight_bits,
    int64_t group_size, int int8_activations,
    const void *cos, const void *sin, /* [T, head_dim] */
    const int64_t *slot_mapping,      /* [T] */
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *query_start_loc,
    const int32_t *seq_lens, const int32_t *seq_ids, int num_seqs, int block_size, float scale,
    int query_tile) {
    const int64_t H = num_heads, Hkv = num_kv_heads, D = head_dim, I = intermediate_size;
    const int64_t qkv_cols = (H + 2 * Hkv) * D;
    const size_t size = dtype == F32 ? 4 : 2;
    const MatrixLayout w = {.bits = weight_bits, .group_size = group_size,
                       .int8_activations = int8_activations};
    Buffers b;
    char *base = alloc_buffers(&b, T, hidden_size, I, H, Hkv, D, size);
    if (base == NULL) return -1;
    int failed = 0;
    const size_t rows_bytes = (size_t)(T * hidden_size) * size;
    if (starts) { /* the residual stream starts as the embeddings (layer 0's norm adds nothing) */
        memcpy(b.residual, hidden, rows_bytes);
    } else {
        memcpy(b.residual, residual, rows_bytes);
        memcpy(b.hidden, hidden, rows_bytes);
    }
#pragma omp parallel
    for (int l = 0; l < num_layers; l++) {
        const int64_t *t = layers + (int64_t)l * LAYER_TENSORS;
        void *kv_cache = (void *)t[KV_CACHE];
        if (l == 0 && starts) {
            hr_rms_norm(b.residual, hidden_size, NULL, 0, (const void *)t[INPUT_NORM], eps,
                        b.normed, NULL, T, hidden_size, dtype);
        } else { /* the previous layer's output joins the residual stream */
            hr_rms_norm(b.hidden, hidden_size, b.residual, hidden_size,
                        (const void *)t[INPUT_NORM], eps, b.normed, b.residual, T, hidden_size,
                        dtype);
        }
        hr_matmul(b.normed, T, t + QKV, w, qkv_cols, hidden_size, b.qkv, dtype, b.wide);
        const char *k = b.qkv + H * D * size, *v = k + Hkv * D * size;
        hr_apply_rotary(b.qkv, qkv_cols, D, H, k, qkv_cols, D, Hkv, cos, sin, b.query, b.key, T,
                        D, dtype);
        hr_write_kv_cache(b.key, Hkv * D, D, v, qkv_cols, D, kv_cache, slot_mapping, T,
                          num_kv_heads, head_dim, block_size, dtype, kv_dtype);
        hr_paged_attention(b.query, H * D, D, kv_cache, block_tables, block_table_stride,
                           query_start_loc, seq_lens, seq_ids, num_seqs, num_heads,
                           num_kv_heads, head_dim, block_size, scale, sliding_windows[l],
                           0.0f /* no soft cap */, NULL /* no sinks */, dtype, kv_dtype,
                           query_tile, b.attention, &failed);
        hr_matmul(b.attention, T, t + O_PROJ, w, hidden_size, H * D, b.hidden, dtype, b.wide);
        hr_rms_norm(b.hidden, hidden_size, b.residual, hidden_size, (const void *)t[POST_NORM],
                    eps, b.normed, b.residual, T, hidden_size, dtype);
        hr_matmul(b.normed, T, t + GATE_UP, w, 2 * I, hidden_size, b.gate_up, dtype, b.wide);
        hr_silu_and_mul(b.gate_up, 2 * I, b.act, T, I, dtype);
        hr_matmul(b.act, T, t + DOWN, w, hidden_size, I, b.hidden, dtype, b.wide);
    }
    if (ends) { /* the final norm of the last layer's output and the residual stream */
        hr_rms_norm(b.hidden, hidden_size, b.residual, hidden_size, final_norm, eps, hidden,
                    b.residual, T, hidden_size, dtype);
    } else {
        memcpy(hidden, b.hidden, rows_bytes);
        memcpy(residual, b.residual, rows_bytes);
    }
    free(base);
    return failed ? -1 : 0;
}

/* A step of greedy one-row decodes in one call: its run, or a multi-step decode's runs, each
   sequence one row (no Python around the stack, 1.5-2.4% of a one-row SmolLM2-135M step, nor
   between the runs, ~1.3 ms of a 10 ms bf16 run). Run r looks up the embeddings of its input tokens (row r of `tokens`: the
   step's inputs, then the tokens run r - 1 drew), runs the layers at positions + r into the KV
   slots slots[r] (headrace_decode_layers), multiplies the final norm's output by the LM head
   into float32 logits (headrace_skinny_linear) and takes each row's first maximum
   (headrace_argmax_update) into row r + 1: the calls a run from Python makes, on the same
   values, so each token is the one it draws. Returns 0, or -1 when memory ran out (the
   tokens and the KV cache are then undefined). */
int headrace_decode_greedy_runs(
    int num_runs, int64_t T,
    int64_t *tokens,          /* [num_runs + 1, T]: row 0 the inputs; the call fills the rest */
    const void *embedding,    /* [vocabulary, hidden] */
    const void *head, const void *head_panels, int64_t head_rows, /* [head_rows, hidden]; panels or NULL */
    const void *cos_table, const void *sin_table, /* [positions, head_dim] */
    const int64_t *positions, /* [T]: the first run's */
    const int64_t *slots,     /* [num_runs, T]: each run's KV cache slots */
    int num_layers, const int64_t *layers, const int32_t *sliding_windows,
    const void *final_norm, float eps, int64_t hidden_size, int64_t intermediate_size,
    int num_heads, int num_kv_heads, int head_dim, int dtype, int kv_dtype, int weight_bits,
    int64_t group_size, int int8_activations,
    const int32_t *block_tables, int64_t block_table_stride, const int32_t *query_start_loc,
    int32_t *seq_lens, /* [T]: the first run's; the call adds one a run after it */
    const int32_t *seq_ids, int num_seqs, int block_size, float scale, int query_tile) {
    const size_t size = dtype == F32 ? 4 : 2;
    const size_t row_bytes = (size_t)hidden_size * size, rotary_bytes = (size_t)head_dim * size;
    char *hidden = malloc((size_t)T * row_bytes);
    char *cos = malloc((size_t)T * rotary_bytes), *sin = malloc((size_t)T * rotary_bytes);
    float *logits = malloc((size_t)(T * head_rows) * sizeof(float)), *best = malloc(T * sizeof(float));
    int failed = hidden == NULL || cos == NULL || sin == NULL || logits == NULL || best == NULL;
    for (int r = 0; r < num_runs && !failed; r++) {
        const int64_t *inputs = tokens + r * T;
        int64_t *next = tokens + (r + 1) * T;
        for (int64_t i = 0; i < T; i++) {
            memcpy(hidden + i * row_bytes, (const char *)embedding + inputs[i] * row_bytes, row_bytes);
            const size_t at = (size_t)(positions[i] + r) * rotary_bytes;
            memcpy(cos + i * rotary_bytes, (const char *)cos_table + at, rotary_bytes);
            memcpy(sin + i * rotary_bytes, (const char *)sin_table + at, rotary_bytes);
            seq_lens[i] += r > 0;
            best[i] = -INFINITY;
            next[i] = 0;
        }
        failed = headrace_decode_layers(
                     hidden, hidden, 1, 1, T, num_layers, layers, sliding_windows, final_norm,
                     eps, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim,
                     dtype, kv_dtype, weight_bits, group_size, int8_activations, cos, sin,
                     slots + r * T, block_tables, block_table_stride, query_start_loc,
                     seq_lens, seq_ids, num_seqs, block_size, scale, query_tile) != 0;
        failed = failed || headrace_skinny_linear(hidden, hidden_size, dtype, T, head, head_panels,
                                                  dtype, head_rows, hidden_size, NULL, logits,
                                                  head_rows, F32) != 0;
        if (!failed) headrace_argmax_update(logits, T, head_rows, head_rows, 0, best, next);
    }
    free(hidden);
    free(cos);
    free(sin);
    free(logits);
    free(best);
    return failed ? -1 : 0;
}
