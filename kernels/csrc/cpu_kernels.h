/* The CPU kernels' shared declarations: the dtype codes, and each op's work as every thread of
   an OpenMP region runs it (hr_*), so that a sequence of ops can run in one region
   (decode_stack.c) as well as one region per op (the exported headrace_* kernels of
   cpu_kernels.c, which call the same functions). Each hr_ op ends at a barrier: its outputs
   are complete when any thread returns. */

#ifndef HEADRACE_CPU_KERNELS_H
#define HEADRACE_CPU_KERNELS_H

#include <stdint.h>
#include <string.h>

enum { F32 = 0, BF16 = 1, F16 = 2, I8 = 3 };

/* ---- dtype conversion (every source's rows round alike) ------------------------------- */

static inline float bf16_to_float(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float out;
    memcpy(&out, &wide, sizeof out);
    return out;
}

/* Round to nearest, ties to even; a NaN stays a (quiet) NaN. Branch-free, so a loop of it
   vectorises (store_row's bf16 rows were scalar: 5x torch's time for a prefill's silu). */
static inline uint16_t float_to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    const uint32_t quiet_nan = (bits >> 16) | 0x40u;
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

/* n elements of a row stored in dtype, widened to float32. */
static inline void load_row(const void *src, int dtype, float *dst, int n) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        const uint16_t *s = (const uint16_t *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = bf16_to_float(s[i]);
    } else {
        const _Float16 *s = (const _Float16 *)src;
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (float)s[i];
    }
}

/* n float32 values narrowed to dtype (round to nearest even). */
static inline void store_row(void *dst, int dtype, const float *src, int n) {
    if (dtype == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == BF16) {
        uint16_t *d = (uint16_t *)dst;
#pragma omp simd
        for (int i = 0; i < n; i++) d[i] = float_to_bf16(src[i]);
    } else {
        _Float16 *d = (_Float16 *)dst;
#pragma omp simd
        for (int i = 0; i < n; i++) d[i] = (_Float16)src[i];
    }
}

static inline size_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

#ifdef __AVX512F__
#include <immintrin.h>

/* The lanes of v in `lanes` stored in dtype at dst (the others untouched), each rounded as
   store_row rounds it. */
static inline void store_lanes(void *dst, int dtype, __m512 v, __mmask16 lanes) {
    if (dtype == F32) {
        _mm512_mask_storeu_ps(dst, lanes, v);
    } else if (dtype == BF16) { /* float_to_bf16, lane by lane */
        const __m512i bits = _mm512_castps_si512(v), high = _mm512_srli_epi32(bits, 16);
        const __m512i one = _mm512_set1_epi32(1);
        const __m512i rounded = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)),
                             _mm512_and_si512(high, one)),
            16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        _mm256_mask_storeu_epi16(dst, lanes,
                                 _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet)));
    } else {
        _mm256_mask_storeu_epi16(dst, lanes,
                                 _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
}
#endif

/* I8 is a KV-cache dtype only (kernels/kv_layout.py): each (token, head) row holds head_dim
   int8 values, then their float32 scale; a value reads back as q * scale. */
#define KV_SCALE_BYTES 4

/* Widest row rms_norm and silu_and_mul hold on the stack. */
#define RMS_NORM_MAX_COLS 8192

void hr_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
                 const void *weight, float eps, void *out, void *sum, int64_t num_rows,
                 int64_t cols, int dtype);

void hr_skinny_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M, const void *w,
                      const void *panels, int w_dtype, int64_t N, int64_t K, const float *bias,
                      void *y, int64_t y_stride, int y_dtype, float *wide_x);

/* The exported matmul and running argmax (cpu_kernels.c), each a region of its own, as the
   greedy head calls them from Python; decode_stack.c's greedy runs call them the same way. */
int headrace_skinny_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M, const void *w,
                           const void *panels, int w_dtype, int64_t N, int64_t K,
                           const float *bias, void *y, int64_t y_stride, int y_dtype);
void headrace_argmax_update(const float *x, int64_t num_rows, int64_t num_cols,
                            int64_t row_stride, int64_t offset, float *best, int64_t *index);

/* panel_linear.c: bf16 x [M, K] against bf16 weights [N, K] packed into panels
   (headrace_pack_panels), as every thread of a region runs it; only where the CPU has
   AVX512-BF16. */
void hr_panel_linear(const void *x, int64_t x_stride, int64_t M, const void *panels, int64_t N,
                     int64_t K, const float *bias, void *y, int64_t y_stride, int y_dtype);

/* Scratch floats hr_skinny_linear needs for M rows of K: x widened to float32, or (bf16 on
   AMX tiles) x repacked into tiles of 16 rows. */
int64_t hr_amx_scratch_floats(int64_t M, int64_t K);
static inline int64_t hr_skinny_floats(int64_t M, int64_t K) {
    const int64_t amx = hr_amx_scratch_floats(M, K);
    return amx > M * K ? amx : M * K;
}

/* amx_linear.c: whether bf16 x [M, K] against bf16 weights [N, K] multiplies on AMX tiles
   (granted by headrace_amx_init, N a multiple of 16 and K of 32), and that product as every
   thread of a region runs it (scratch: hr_amx_scratch_floats(M, K) floats). */
int hr_amx_takes(int64_t M, int64_t N, int64_t K);
void hr_amx_linear(const void *x, int64_t x_stride, int64_t M, const void *w, int64_t N,
                   int64_t K, const float *bias, void *y, int64_t y_stride, int y_dtype,
                   float *scratch);

/* hr_skinny_linear over quantized weights (kernels/quantized.py): bits 8 or 4, scales and
   offsets [N, K / group_size] float32 (offsets NULL for 8 bits). */
void hr_quantized_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M, const void *w,
                         int bits, int64_t N, int64_t K, int64_t group_size, const float *scales,
                         const float *offsets, const float *bias, void *y, int64_t y_stride,
                         int y_dtype, float *wide_x);

/* Scratch floats hr_quantized_linear_a8 needs for M rows of K: per row, x as int8 (64 bytes a
   pair of 32-blocks), each lane's activation scale and its int32 bias (16 each a pair), each
   group's sum. */
static inline int64_t hr_a8_floats(int64_t M, int64_t K) {
    return M * (((K / 32 + 1) / 2) * 48 + K / 32);
}

/* 8- or 4-bit weights (as hr_quantized_linear's) against x quantized to int8 per block of 32
   (kernels/quantized.py's int8_activations); scratch: hr_a8_floats(M, K) floats. */
void hr_quantized_linear_a8(const void *x, int64_t x_stride, int x_dtype, int64_t M,
                            const void *w, int bits, int64_t N, int64_t K, int64_t group_size,
                            const float *scales, const float *offsets, const float *bias,
                            void *y, int64_t y_stride, int y_dtype, float *scratch);

void hr_apply_rotary(const void *query, int64_t q_stride_token, int64_t q_stride_head,
                     int64_t num_heads, const void *key, int64_t k_stride_token,
                     int64_t k_stride_head, int64_t num_kv_heads, const void *cos, const void *sin,
                     void *query_out, void *key_out, int64_t num_rows, int64_t head_dim,
                     int dtype);

void hr_write_kv_cache(const void *key, int64_t key_stride_token, int64_t key_stride_head,
                       const void *value, int64_t value_stride_token, int64_t value_stride_head,
                       void *kv_cache, const int64_t *slot_mapping, int64_t num_tokens,
                       int num_kv_heads, int head_dim, int block_size, int dtype, int kv_dtype);

/* sliding_window: keys a query sees, its own included (0: all); block-table entries before a
   sequence's window are never read (they may name freed blocks). softcap: scaled scores s
   become softcap * tanh(s / softcap) before the softmax (0: none). sinks: [H] float32, each
   head's logit in its softmax's denominator, with no value (NULL: none). */
void hr_paged_attention(const void *query, int64_t query_stride_token, int64_t query_stride_head,
                        const void *kv_cache, const int32_t *block_tables,
                        int64_t block_table_stride, const int32_t *query_start_loc,
                        const int32_t *seq_lens, const int32_t *seq_ids, int num_selected,
                        int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, int sliding_window, float softcap, const float *sinks,
                        int dtype, int kv_dtype, int query_tile, void *out, int *failed);

void hr_silu_and_mul(const void *gate_up, int64_t stride, void *out, int64_t num_rows,
                     int64_t cols, int dtype);

/* ---- A matrix as the one-call stacks hold it (decode_stack.c, moe_experts.c) ------------- */

/* A matrix as data pointers in a table: its data, then (quantized) its scales and offsets, or
   (bf16 where the CPU has AVX512-BF16) its panels (headrace_pack_panels); 0 where it has
   none. */
#define MATRIX_SLOTS 3

/* How a stack's matrices hold their weights: bits 0 (the activations' dtype), 8 or 4; groups
   of group_size along K, 0 for one per row; int8_activations: quantized weights against x
   quantized to int8. */
typedef struct {
    int bits;
    int64_t group_size;
    int int8_activations;
} MatrixLayout;

/* y [T, N] = x [T, K] w^T, no bias, by the kernel the per-op path picks for the matrix (its
   MATRIX_SLOTS pointers at `matrix`): every value that path's. wide: the larger of T K and
   hr_a8_floats(T, K) floats. */
static inline void hr_matmul(const void *x, int64_t T, const int64_t *matrix, MatrixLayout w,
                             int64_t N, int64_t K, void *y, int dtype, float *wide) {
    const void *data = (const void *)matrix[0];
    const int64_t group_size = w.group_size ? w.group_size : K;
    if (w.bits == 0) {
        hr_skinny_linear(x, K, dtype, T, data, (const void *)matrix[1], dtype, N, K, NULL, y, N,
                         dtype, wide);
    } else if (w.int8_activations) {
        hr_quantized_linear_a8(x, K, dtype, T, data, w.bits, N, K, group_size,
                               (const float *)matrix[1], (const float *)matrix[2], NULL, y, N,
                               dtype, wide);
    } else {
        hr_quantized_linear(x, K, dtype, T, data, w.bits, N, K, group_size,
                            (const float *)matrix[1], (const float *)matrix[2], NULL, y, N, dtype,
                            wide);
    }
}

#endif
