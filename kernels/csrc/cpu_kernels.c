/* CPU kernels of the hot path, compiled on the user's machine by headrace.kernels.native.

   Plain C with OpenMP, no torch headers: Python passes raw pointers, strides and sizes through
   ctypes. The library is linked against libgomp, which resolves to the copy torch has already
   loaded, so these kernels and torch's share one thread pool and torch.set_num_threads.

   - paged_attention: causal attention of every query row of a varlen batch over its
     sequence's K/V, read block by block from the paged cache in place (no gather, no padding;
     float32 and bf16 rows as they lie, int8 or odd head sizes widened into a scratch first),
     within a sliding window where the layer has one, its scores soft-capped where the layer
     caps them (Gemma 2), each head's sink logit in its softmax's denominator where the layer
     has sinks (GPT-OSS). Decode rows (one query) and prefill chunks (many) take the same path.
   - write_kv_cache: scatter new K/V rows into their cache slots.
   - argmax_update: each row's first maximum over column blocks that arrive in order (the
     greedy LM head's vocabulary slices), kept running.
   - draw_tokens: one seeded draw per row from softmax(logits / T), truncated by min-p and
     top-p: a Gumbel-max race with counter-based noise, whose logs are taken only for the
     tokens that could still win, then the top-p test on the best few. About 1 ns per token
     on one core (AVX-512), 3.8 ms for 256 rows of a 49k vocabulary on two.
   - skinny_linear: y = x W^T (+ b) in float32 for a decode step's few rows, each weight read
     from memory once (float32, or bf16 / float16 widened to float32 in registers) and every
     output summed in one fixed order (a row's result does not depend on the other rows);
     quantized_linear the same over int8 / 4-bit weights formed as float32 in registers, and
     dequantize those weights into a float array for a GEMM.
   - apply_token_bitmask: -inf for each token an output constraint's bitmask forbids, in place.
   - rms_norm, apply_rotary: the residual add + RMSNorm and neox rotary, one pass per row,
     rounding as the torch references round in each dtype.

   Dtypes: 0 float32, 1 bfloat16, 2 float16. Attention and the skinny linear compute in float32
   whatever the storage dtype (softmax statistics, scores and the weighted sum of V; every
   product and sum of the matmul), except that bf16 attention on a CPU with AVX512-BF16 rounds
   each probability to bf16 for the weighted sum of V, as torch's flash attention does.
*/

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

/* Keys per tile: one AVX-512 vector of float32 scores per query row. */
#define TILE_KEYS 16

/* Bytes of one cached (token, head) row: head_dim values, and an int8 row's scale. */
static inline int64_t kv_row_bytes(int kv_dtype, int head_dim) {
    return kv_dtype == I8 ? head_dim + KV_SCALE_BYTES : head_dim * (int64_t)dtype_size(kv_dtype);
}

/* A cached row widened to float32: load_row's, or each int8 value times the row's scale
   (one rounding, as kv_layout.dequantize_rows). */
static inline void load_kv_row(const void *src, int kv_dtype, float *dst, int n) {
    if (kv_dtype != I8) {
        load_row(src, kv_dtype, dst, n);
        return;
    }
    const int8_t *q = (const int8_t *)src;
    float scale;
    memcpy(&scale, q + n, sizeof scale);
#pragma omp simd
    for (int i = 0; i < n; i++) dst[i] = (float)q[i] * scale;
}

/* n float32 values as an int8 row: scale = max|x| / 127, q = round-half-even(x / scale), each
   one float32 operation (kv_layout.quantize_rows); all zeros with scale 0 for a zero row. */
static inline void store_kv_row_int8(const float *x, int n, int8_t *dst) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float scale = amax / 127.0f;
    if (scale > 0.0f) {
#pragma omp simd
        for (int i = 0; i < n; i++) dst[i] = (int8_t)nearbyintf(x[i] / scale);
    } else {
        memset(dst, 0, (size_t)n);
    }
    memcpy(dst + n, &scale, sizeof scale);
}

/* ---- vectors ------------------------------------------------------------------------------ */

/* 16 float32 lanes: one AVX-512 register (the compiler splits it where the CPU is narrower).
   A key tile is 16 keys, so one tile's scores for one query row are one v16. */
#define LANES 16
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
/* A v16 loaded from or stored to any float-aligned address. */
typedef float v16u __attribute__((vector_size(64), aligned(4)));

/* The register a hot loop works in: 16 lanes where the CPU has AVX-512, else a v16 as
   PARTS = 2 registers of 8 lanes (gcc keeps a 64-byte vector in memory where no register holds
   one: on an AVX2 Zen 3 the matmul tile's every v16 operation became loads and stores, and it
   ran 2-11x slower than oneDNN at 8 to 320 rows). Lane i of a step holds element k + i either
   way, so every sum is the same. */
#ifdef __AVX512F__
#define PART_LANES 16
#else
#define PART_LANES 8
#endif
#define PARTS (LANES / PART_LANES)
typedef float vp __attribute__((vector_size(PART_LANES * 4)));
typedef int32_t vpi __attribute__((vector_size(PART_LANES * 4)));
typedef uint32_t vpw __attribute__((vector_size(PART_LANES * 4)));
typedef float vpu __attribute__((vector_size(PART_LANES * 4), aligned(1)));
typedef uint16_t vph __attribute__((vector_size(PART_LANES * 2), aligned(2)));
typedef _Float16 vpf16 __attribute__((vector_size(PART_LANES * 2), aligned(2)));

/* The address of element i of an array of dtype. */
static inline const void *element(const void *base, int64_t i, int dtype) {
    return (const char *)base + i * (int64_t)dtype_size(dtype);
}

/* The loader of weights (and of K / V rows): elements [i, i + PART_LANES) of an array stored
   in dtype, widened to float32 exactly (bf16 is a float32's top half: a shift; float16 converts in one instruction
   where there is F16C). Reduced-precision products are never formed: the sums are float32's. */
static inline __attribute__((always_inline)) vp load_weights(const void *w, int64_t i, int dtype) {
    if (dtype == F32) return *(const vpu *)element(w, i, F32);
#ifdef __AVX512F__ /* gcc widens the generic forms below in 256-bit halves (or lane by lane) */
    const __m256i halves = _mm256_loadu_si256((const __m256i *)element(w, i, dtype));
    if (dtype == BF16) return (vp)_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
    return (vp)_mm512_cvtph_ps(halves);
#elif defined(__AVX2__) && defined(__F16C__) /* likewise: gcc's generic forms widen 4 lanes at a time */
    const __m128i half = _mm_loadu_si128((const __m128i *)element(w, i, dtype));
    if (dtype == BF16) return (vp)_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    return (vp)_mm256_cvtph_ps(half);
#else
    if (dtype == BF16) return (vp)(__builtin_convertvector(*(const vph *)element(w, i, BF16), vpw) << 16);
    return __builtin_convertvector(*(const vpf16 *)element(w, i, F16), vp);
#endif
}

static const v16i LANE_INDEX = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* Whether the CPU has AVX512-BF16's pair dot instruction (vdpbf16ps): lane i adds the
   products of elements 2i and 2i + 1 of two bf16 vectors to its float32 sum. */
#ifdef __AVX512BF16__
#define HAVE_BF16_PAIRS 1
#else
#define HAVE_BF16_PAIRS 0
#endif

static inline v16 splat(float x) { return (v16){0} + x; }

/* Lanes of a where mask is set (all ones), else lanes of b. */
static inline v16 select_lanes(v16i mask, v16 a, v16 b) {
    return (v16)(((v16i)a & mask) | ((v16i)b & ~mask));
}

/* The sum of the 16 lanes in _mm512_reduce_add_ps's order, on every CPU: lane i + lane i + 8,
   then + the sum 4 on, then + the sum 2 on, then the two left (a tree 4 adds deep, where a
   chain of 15 made AVX2's attention scores wait on their sums). */
static inline float hsum(v16 x) {
#ifdef __AVX512F__
    return _mm512_reduce_add_ps((__m512)x);
#else
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = x[i] + x[i + 8];
    for (int i = 0; i < 4; i++) t[i] = t[i] + t[i + 4];
    return (t[0] + t[2]) + (t[1] + t[3]);
#endif
}

static inline float hmax(v16 x) {
#ifdef __AVX512F__
    return _mm512_reduce_max_ps((__m512)x);
#else
    float best = x[0];
    for (int i = 1; i < LANES; i++) best = x[i] > best ? x[i] : best;
    return best;
#endif
}

/* Lanes of a where mask is set (all ones), else lanes of b: one part. */
static inline vp select_part(vpi mask, vp a, vp b) {
    return (vp)(((vpi)a & mask) | ((vpi)b & ~mask));
}

/* Part h of the v16 at x, loaded where it lies. (A v16 passed by value was copied whole to the
   stack on AVX2, in 16-byte stores, and its part then loaded in 32 bytes: the load waited for
   both stores, which held a float32 prefill chunk's scores at half their speed.) */
static inline vp part_of(const v16 *x, int h) { return *(const vpu *)((const float *)x + h * PART_LANES); }

/* Part h of LANE_INDEX: each lane's index in its 16-lane block. */
static inline vpi lane_index_part(int h) { return (vpi)part_of((const v16 *)&LANE_INDEX, h); }

/* The largest lane of a v16's parts (hmax's). */
static inline float parts_max(const vp best[PARTS]) {
#if PARTS == 1
    return hmax(best[0]);
#else
    float top = best[0][0];
    for (int h = 0; h < PARTS; h++)
        for (int k = 0; k < PART_LANES; k++) top = best[h][k] > top ? best[h][k] : top;
    return top;
#endif
}

/* The sum of a v16's parts' lanes (hsum's, in the same order). */
static inline float parts_sum(const vp x[PARTS]) {
    v16 whole;
    memcpy(&whole, x, sizeof whole);
    return hsum(whole);
}

/* exp(x) per lane for x <= 0 (softmax arguments; below -87 gives ~1e-38, not 0): Cody-Waite
   range reduction and Cephes' degree-6 polynomial, within 2 ulp of expf. One part. */
static inline vp exp_part(vp x) {
    x = select_part(x < -87.0f, (vp){0} - 87.0f, x);
    const vp round = (vp){0} + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer */
    vp n = (x * 1.44269504088896341f + round) - round;
    vp r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vp p = (vp){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    vpi bits = (__builtin_convertvector(n, vpi) + 127) << 23;
    return p * (vp)bits;
}

/* exp_part of every lane of a v16, a part at a time (in registers). */
static inline v16 exp_nonpositive(v16 x) {
    v16 out;
    for (int h = 0; h < PARTS; h++) {
        const vp part = exp_part(part_of(&x, h));
        memcpy((char *)&out + h * sizeof part, &part, sizeof part);
    }
    return out;
}

/* 2**t per lane for t <= 0 (below -126 gives 2**-126, not 0; the caller masks what must be
   0): a degree-5 polynomial of 2**f, f = t - round(t), within 2.4e-7 relative (fitted here,
   minimax on [-1/2, 1/2]), scaled by 2**round(t) in one instruction where there is AVX-512.
   One part. */
static inline vp exp2_part(vp t) {
#ifdef __AVX512F__
    const __m512 x = _mm512_max_ps((__m512)t, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const vp f = (vp)_mm512_sub_ps(x, n);
    vp p = (vp){0} + 1.327647129073739e-3f;
    p = p * f + 9.675540961325169e-3f;
    p = p * f + 5.550713092088699e-2f;
    p = p * f + 2.4022120237350464e-1f;
    p = p * f + 6.931469440460205e-1f;
    p = p * f + 1.0000001192092896f;
    return (vp)_mm512_scalef_ps((__m512)p, n);
#else
    return exp_part(t * 0.6931471805599453f);
#endif
}

/* tanh(x) per lane, odd, saturating to ±1, NaN kept: below |x| = 0.625 Cephes' tanhf
   polynomial, x + x^3 P(x^2); above it 1 - 2e / (1 + e) with e = exp(-2|x|) <= 0.29, so
   nothing cancels (the textbook's (1 - e) / (1 + e) left 4x as many results off the rounded
   tanh). Measured over every third float32 in [1e-30, 40]: within 1.44 ulp of the exact
   value, at most 1 ulp from the correctly rounded one and from torch.tanh's. */
static inline v16 tanh_lanes(v16 x) {
    const v16i sign = (v16i)x & INT32_MIN;
    const v16 ax = (v16)((v16i)x & 0x7fffffff), z = x * x;
    v16 p = splat(-5.70498872745e-3f);
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const v16 small = p * z * ax + ax;
    const v16 e = exp_nonpositive(-2.0f * ax);
    const v16 large = 1.0f - 2.0f * e / (1.0f + e);
    return (v16)((v16i)select_lanes(ax < 0.625f, small, large) | sign);
}

/* Gemma 2's soft cap of attention scores: softcap * tanh(x / softcap), in [-softcap, softcap],
   as transformers computes it (a division, then a product). */
static inline v16 soft_cap(v16 x, float softcap) { return softcap * tanh_lanes(x / softcap); }

/* ---- prefetching ------------------------------------------------------------------------- */

/* Which cache a prefetch of data read once, soon (the matmuls' weights, attention's K and V
   rows), fills: L1 on Intel, L2 elsewhere. Each was measured on the CPU it runs on. On a
   2-core Xeon with AMX (2026-11-25) prefetching into L1 took the matmuls' row streams from 23
   to about 30 GB/s. On a 2-core AMD EPYC (Zen 4, 2026-11-28) the same prefetches into L1 made
   the matmuls slower than none at all and left attention as slow as none, and into L2 made
   both faster: SmolLM2-135M's 121 matmuls, float32, alternating runs, one row 20.0-21.1 ms
   into L1, 18.0-18.3 none, 17.4-18.5 into L2; 8 rows (the tiles' prefetch of their next 4
   weight rows) 29.9 ms into L1, 19.5 into L2; 64 decodes' attention (the values' prefetch)
   2.3-2.4 ms a layer into L1, 2.4-2.5 none, 1.7-1.8 into L2. Set once, when the library
   loads. A row stream prefetches only into L1 (ROW_PREFETCH_BYTES). */
static int prefetch_to_l1 = 0;

__attribute__((constructor)) static void choose_prefetch_cache(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    prefetch_to_l1 = __builtin_cpu_is("intel");
#endif
}

static inline __attribute__((always_inline)) void prefetch_stream(const void *address) {
    if (prefetch_to_l1) __builtin_prefetch(address, 0, 3);
    else __builtin_prefetch(address, 0, 2);
}

/* ---- paged attention ---------------------------------------------------------------------- */

typedef struct {
    const void *query; /* [T, H, D] rows, strided */
    int64_t query_stride_token, query_stride_head;
    const void *kv_cache; /* [num_blocks, 2, block_size, Hkv, D], contiguous */
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *query_start_loc; /* [B + 1] */
    const int32_t *seq_lens;        /* [B] */
    int num_heads, num_kv_heads, head_dim, block_size;
    /* the queries' and output's dtype, and the cache's (I8: rows with their scale) */
    int dtype, kv_dtype;
    float scale;
    /* keys a query sees, its own included (the query at p sees p - W + 1 .. p); 0: all */
    int sliding_window;
    /* scores s (the scale's included) become softcap * tanh(s / softcap) if > 0; 0: as is */
    float softcap;
    /* [H]: each head's sink, a logit in its softmax's denominator with no value; NULL: none */
    const float *sinks;
    void *out; /* [T, H, D] contiguous, dtype */
    /* head_dim rounded up to whole v16s: every float32 row below is padded with zeros. */
    int padded_dim;
    /* Whether K/V rows are read from the cache as they are (float32 or bf16, whole v16s),
       rather than widened into the scratch; bf16: they are bf16 (widened in registers). */
    int direct, bf16_rows;
    /* bf16 queries and K/V rows of whole 32-value vectors on a CPU with AVX512-BF16: both
       products multiply bf16 pairs with the pair dot instruction, products exact, sums in
       float32 (`score_by_pairs`, `score_by_pair_transpose`, `accumulate_pairs`). */
    int pairs;
    /* Whether prefetch_next_tile fetches the next tile's V rows as well as its K rows (rows
       widened into the scratch, and rows read in place of at most VALUES_AHEAD_MAX_ROW_BYTES),
       so that load_key_tile does not fetch them again. */
    int values_ahead;
} Attention;

/* One unit of work: query rows [q_begin, q_end) of sequence seq, for the query heads of one
   KV head. Rows are (query, head-in-group) pairs: row r is query q_begin + r / group. */
typedef struct {
    int seq, q_begin, q_end;
} Tile;

/* Rows below this many take dot products against each key (decodes: the group's heads);
   from it on, the key tile is transposed once and shared by all rows (prefill chunks). */
#define TRANSPOSE_MIN_ROWS 8
/* One-query tiles per thread from which each takes every KV head in one work item, and the
   most KV heads one work item takes (a scratch each). */
#define HEADS_ITEMS_PER_THREAD 2
#define MAX_KV_HEADS_TOGETHER 16
/* Rows scored together against a transposed tile: independent chains keep the FMA units busy. */
#define ROW_BLOCK 4
/* Rows whose values accumulate together (a decode's group of query heads, for SmolLM2). */
#define ACC_ROWS 3

/* Scratch of one thread (64-byte aligned, rows padded_dim floats): the tile's scaled queries,
   accumulators and softmax statistics; the current keys' scores and probabilities; key and
   value rows widened to float32 (when they cannot be read in place) and keys transposed. */
typedef struct {
    float *queries, *acc, *row_max, *row_sum;
    uint16_t *queries_bf16; /* the tile's queries as given, unscaled (pairs only) */
    v16 *scores, *keys_t;
    float *key_rows, *value_rows;
    const char *keys[LANES], *values[LANES]; /* float32 rows, or bf16 (bf16_rows) */
    /* The first of ACC_ROWS - 1 rows past the last (scores and acc only) that fill the
       accumulation's last group of rows. */
    int spare_row;
} Scratch;

/* The K (plane 0) or V (plane 1) rows of the table's index-th block: [block_size, Hkv, D]. */
static const char *block_plane(const Attention *a, const int32_t *table, int index, int plane) {
    const int64_t plane_bytes =
        (int64_t)a->block_size * a->num_kv_heads * kv_row_bytes(a->kv_dtype, a->head_dim);
    return (const char *)a->kv_cache + ((int64_t)table[index] * 2 + plane) * plane_bytes;
}

/* One KV head's K and V rows of successive keys: the block is found by one division at the
   first key, then stepped (a division per row cost bf16 decodes a tenth of their attention
   time). */
typedef struct {
    const Attention *a;
    const int32_t *table;
    int64_t row_bytes, head_bytes;
    int index, offset;
    const char *keys, *values; /* the current block's K and V planes */
} KeyCursor;

static KeyCursor key_cursor(const Attention *a, const int32_t *table, int kvh, int first) {
    const int index = first / a->block_size;
    return (KeyCursor){a,
                       table,
                       a->num_kv_heads * kv_row_bytes(a->kv_dtype, a->head_dim),
                       kvh * kv_row_bytes(a->kv_dtype, a->head_dim),
                       index,
                       first % a->block_size,
                       block_plane(a, table, index, 0),
                       block_plane(a, table, index, 1)};
}

/* The cursor's key's K and V rows; the cursor moves on to the next key. */
static inline void next_rows(KeyCursor *c, const char **k, const char **v) {
    if (c->offset == c->a->block_size) {
        c->index++, c->offset = 0;
        c->keys = block_plane(c->a, c->table, c->index, 0);
        c->values = block_plane(c->a, c->table, c->index, 1);
    }
    const int64_t at = c->offset++ * c->row_bytes + c->head_bytes;
    *k = c->keys + at, *v = c->values + at;
}

/* Rows of at most this many bytes read in place (bf16 rows of 64 values) have a tile's values
   fetched a tile ahead, with its keys (prefetch_next_tile); longer ones as the tile is loaded. */
#define VALUES_AHEAD_MAX_ROW_BYTES 128

/* Point keys[j] / values[j] at the float32 rows of keys [first, first + count) of one KV head:
   in the cache itself when direct, else widened (and zero-padded) into the scratch rows. */
static void load_key_tile(const Attention *a, const int32_t *table, int kvh, int first, int count,
                          Scratch *s) {
    const int D = a->head_dim, Dp = a->padded_dim;
    KeyCursor cursor = key_cursor(a, table, kvh, first);
    for (int j = 0; j < count; j++) {
        const char *k, *v;
        next_rows(&cursor, &k, &v);
        if (a->direct) {
            s->keys[j] = k;
            s->values[j] = v;
            /* The values are read after the scores and the softmax: fetch them meanwhile, unless
               the tile before fetched them (64 decodes of ~336 keys, SmolLM2's heads: bf16
               1.48 -> 1.20 ms a layer, float32 2.25 -> 2.02; their loads had held most of
               accumulate_values' time). */
            if (a->values_ahead) continue;
            for (int64_t o = 0; o < kv_row_bytes(a->kv_dtype, D); o += 64) prefetch_stream(v + o);
        } else {
            float *kr = s->key_rows + (int64_t)j * Dp, *vr = s->value_rows + (int64_t)j * Dp;
            load_kv_row(k, a->kv_dtype, kr, D);
            load_kv_row(v, a->kv_dtype, vr, D);
            s->keys[j] = (const char *)kr;
            s->values[j] = (const char *)vr;
        }
    }
}

/* Lane j of the result: the sum of the 16 lanes of sums[j]. With AVX-512 a tree of shuffles
   adds all 16 at once (46 instructions, where 16 reductions of one vector each take about
   five times as many and a store per lane): lanes l and l + 8, then l and l + 4, then
   neighbours' pairs, then neighbours; a final permute puts key j in lane j. */
static inline v16 sum_lanes_16(const v16 sums[LANES]) {
#ifdef __AVX512F__
    __m512 half[8], quarter[4], eighth[2];
    for (int j = 0; j < 8; j++) { /* blocks 0-1: key 2j's 8 partials; 2-3: key 2j + 1's */
        const __m512 x = (__m512)sums[2 * j], y = (__m512)sums[2 * j + 1];
        half[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; i++) { /* block b: key 4i + b's 4 partials */
        const __m512 u = half[2 * i], v = half[2 * i + 1];
        quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xDD));
    }
    for (int i = 0; i < 2; i++) { /* block b: keys 8i + b's and 8i + 4 + b's 2 partials each */
        const __m512 p = quarter[2 * i], q = quarter[2 * i + 1];
        eighth[i] = _mm512_add_ps(_mm512_shuffle_ps(p, q, 0x44), _mm512_shuffle_ps(p, q, 0xEE));
    }
    /* lane 4b + m: key b + 4m */
    const __m512 totals = _mm512_add_ps(_mm512_shuffle_ps(eighth[0], eighth[1], 0x88),
                                        _mm512_shuffle_ps(eighth[0], eighth[1], 0xDD));
    const __m512i key_lane = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return (v16)_mm512_permutexvar_ps(key_lane, totals);
#elif defined(__AVX2__)
    /* The same tree in 8-lane registers: half[p] lanes 0-3 key 2p's 4 partials, 4-7 key
       2p + 1's; quarter[m] (by 128-bit half) keys 4m, 4m + 2 | 4m + 1, 4m + 3, 2 partials
       each; total[f] keys 8f, 8f + 2, 8f + 4, 8f + 6 | 8f + 1, 8f + 3, 8f + 5, 8f + 7. */
    __m256 half[8], quarter[4], total[2];
    for (int p = 0; p < 8; p++) {
        const __m256 x = _mm256_add_ps((__m256)part_of(&sums[2 * p], 0), (__m256)part_of(&sums[2 * p], 1));
        const __m256 y = _mm256_add_ps((__m256)part_of(&sums[2 * p + 1], 0), (__m256)part_of(&sums[2 * p + 1], 1));
        half[p] = _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    }
    for (int m = 0; m < 4; m++) {
        const __m256 u = half[2 * m], v = half[2 * m + 1];
        quarter[m] = _mm256_add_ps(_mm256_shuffle_ps(u, v, 0x44), _mm256_shuffle_ps(u, v, 0xEE));
    }
    for (int f = 0; f < 2; f++) {
        const __m256 u = quarter[2 * f], v = quarter[2 * f + 1];
        total[f] = _mm256_add_ps(_mm256_shuffle_ps(u, v, 0x88), _mm256_shuffle_ps(u, v, 0xDD));
    }
    const __m256i key_lane = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    v16 totals;
    for (int f = 0; f < 2; f++) {
        const __m256 keys = _mm256_permutevar8x32_ps(total[f], key_lane);
        memcpy((char *)&totals + f * sizeof keys, &keys, sizeof keys);
    }
    return totals;
#else
    v16 totals;
    for (int j = 0; j < LANES; j++) totals[j] = hsum(sums[j]);
    return totals;
#endif
}

/* Element d of a K or V row, as float32. */
static inline float row_element(const char *row, int d, int bf16) {
    if (!bf16) return ((const float *)row)[d];
    uint32_t bits = (uint32_t)((const uint16_t *)row)[d] << 16;
    float value;
    memcpy(&value, &bits, sizeof(value));
    return value;
}

#ifdef __AVX512F__
/* 16 bf16 values widened to float32 (exactly). */
static inline v16 widen_bf16(__m256i halves) {
    return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
}
#endif

/* Elements [16 c, 16 c + 16) of a K or V row, as float32 (bf16: widened exactly). */
static inline __attribute__((always_inline)) v16 row_chunk(const char *row, int c, int bf16) {
    if (!bf16) return *(const v16u *)(row + (int64_t)c * LANES * 4);
#ifdef __AVX512F__
    return widen_bf16(_mm256_loadu_si256((const __m256i *)(row + (int64_t)c * LANES * 2)));
#else
    v16 chunk;
    for (int i = 0; i < LANES; i++) chunk[i] = row_element(row, c * LANES + i, 1);
    return chunk;
#endif
}

/* Part h of row_chunk(row, c, bf16). */
static inline __attribute__((always_inline)) vp row_part(const char *row, int c, int h, int bf16) {
    return load_weights(row, (int64_t)c * LANES + h * PART_LANES, bf16 ? BF16 : F32);
}

/* scores[r] lane j = q_r . k_j for rows [row0, rows) (0 for j >= count): per row, 16
   dot products in lanes, then all 16 lane sums at once. A whole tile runs the 16 keys' sums
   side by side (16 independent chains, each a chunk of q loaded once); each key's chunks add
   in the same order either way. */
static void score_by_dots(const Attention *a, Scratch *s, int row0, int rows, int count) {
    const int chunks = a->padded_dim / LANES, bf16 = a->bf16_rows;
    for (int r = row0; r < rows; r++) {
        const float *q = s->queries + (int64_t)r * a->padded_dim;
        v16 sums[LANES];
#if PARTS == 1
        for (int j = 0; j < LANES; j++) sums[j] = splat(0.0f);
        if (count == LANES) {
            for (int c = 0; c < chunks; c++) {
                const v16 qc = *(const v16 *)(q + c * LANES);
                for (int j = 0; j < LANES; j++) sums[j] += qc * row_chunk(s->keys[j], c, bf16);
            }
        } else {
            for (int j = 0; j < count; j++)
                for (int c = 0; c < chunks; c++)
                    sums[j] += *(const v16 *)(q + c * LANES) * row_chunk(s->keys[j], c, bf16);
        }
#else /* a key at a time, in parts (16 keys' chains side by side would live in memory) */
        for (int j = 0; j < LANES; j++) {
            vp acc[PARTS] = {0};
            for (int c = 0; j < count && c < chunks; c++)
                for (int h = 0; h < PARTS; h++)
                    acc[h] += *(const vpu *)(q + c * LANES + h * PART_LANES) * row_part(s->keys[j], c, h, bf16);
            memcpy(&sums[j], acc, sizeof sums[j]);
        }
#endif
        s->scores[r] = sum_lanes_16(sums);
    }
}

/* The rows of the group from r0 (of rows ending at rows): ACC_ROWS of them, the last ones
   past rows replaced by spare rows, whose probabilities are zero (zeroed by spare_rows). */
static inline void group_rows(const Scratch *s, int r0, int rows, int r[ACC_ROWS]) {
    for (int i = 0; i < ACC_ROWS; i++) r[i] = r0 + i < rows ? r0 + i : s->spare_row + i - 1;
}

/* Zero the probabilities of the spare rows group_rows hands out. */
static inline void spare_rows(Scratch *s) {
    for (int i = 0; i < ACC_ROWS - 1; i++) s->scores[s->spare_row + i] = splat(0.0f);
}

#if HAVE_BF16_PAIRS
/* score_by_dots' scores from the bf16 queries and keys as they lie (pairs): per row, each
   key's dot product as the pair dot instruction forms it, 32 values an instruction, its 16
   lanes summed as score_by_dots sums them, then scaled. No key is widened (score_by_dots
   widens each key once per row of the group). Inlined with count a constant 16 for a whole
   tile (score_by_pairs), whose keys then unroll with no test per key: with count a variable
   the compiler tested it before every key's product and kept the sums on the stack (64
   decodes of ~336 keys, a layer, one thread, the Zen 4: 1.57 -> 1.46 ms). */
static inline __attribute__((always_inline)) void score_pairs_of(const Attention *a, Scratch *s,
                                                                 int row0, int rows, int count) {
    const int vectors = a->head_dim / (2 * LANES);
    for (int r = row0; r < rows; r++) {
        const uint16_t *q = s->queries_bf16 + (int64_t)r * a->padded_dim;
        v16 sums[LANES];
        for (int j = 0; j < LANES; j++) sums[j] = splat(0.0f);
        for (int c = 0; c < vectors; c++) {
            const __m512bh qc = (__m512bh)_mm512_loadu_si512(q + c * 2 * LANES);
            for (int j = 0; j < count; j++) {
                const __m512i kc = _mm512_loadu_si512(s->keys[j] + c * 4 * LANES);
                sums[j] = (v16)_mm512_dpbf16_ps((__m512)sums[j], qc, (__m512bh)kc);
            }
        }
        s->scores[r] = sum_lanes_16(sums) * a->scale;
    }
}

static void score_by_pairs(const Attention *a, Scratch *s, int row0, int rows, int count) {
    if (count == LANES) score_pairs_of(a, s, row0, rows, LANES);
    else score_pairs_of(a, s, row0, rows, count);
}

/* score_by_transpose's scores from bf16 pairs: the tile transposed once by pairs of values
   (lane j of keys_t[e] holds k_j[2e] and k_j[2e + 1]), then each row's pair e broadcast
   against it, one pair dot instruction for 16 keys (half score_by_transpose's products);
   each score sums its pairs in order, the even ones and the odd ones apart, then scaled. */
static void score_by_pair_transpose(const Attention *a, Scratch *s, int row0, int rows,
                                    int count) {
    const int P = a->head_dim / 2, Dp = a->padded_dim;
    uint32_t *columns = (uint32_t *)s->keys_t;
    for (int j = 0; j < LANES; j++) {
        const uint32_t *k = (const uint32_t *)s->keys[j];
        for (int e = 0; e < P; e++) columns[e * LANES + j] = j < count ? k[e] : 0;
    }
    for (int r = row0; r < rows; r += ROW_BLOCK) {
        const int n = rows - r < ROW_BLOCK ? rows - r : ROW_BLOCK;
        const uint32_t *q[ROW_BLOCK];
        for (int i = 0; i < ROW_BLOCK; i++)
            q[i] = (const uint32_t *)(s->queries_bf16 + (int64_t)(i < n ? r + i : r) * Dp);
        v16 even[ROW_BLOCK], odd[ROW_BLOCK];
        for (int i = 0; i < ROW_BLOCK; i++) even[i] = odd[i] = splat(0.0f);
        for (int e = 0; e < P; e += 2) { /* P is a multiple of 16 */
            const __m512bh k0 = (__m512bh)_mm512_load_si512(columns + e * LANES);
            const __m512bh k1 = (__m512bh)_mm512_load_si512(columns + (e + 1) * LANES);
            for (int i = 0; i < ROW_BLOCK; i++) {
                even[i] = (v16)_mm512_dpbf16_ps((__m512)even[i],
                                                (__m512bh)_mm512_set1_epi32((int)q[i][e]), k0);
                odd[i] = (v16)_mm512_dpbf16_ps((__m512)odd[i],
                                               (__m512bh)_mm512_set1_epi32((int)q[i][e + 1]), k1);
            }
        }
        for (int i = 0; i < n; i++) s->scores[r + i] = (even[i] + odd[i]) * a->scale;
    }
}

/* A row of accumulate_pairs' accumulators times inv, in order, into out. Interleaving two
   value rows leaves each 32 values in two chunks: the first holds those at 8 l + t, the
   second those at 8 l + 4 + t, each at lane 4 l + t (l, t = 0..3). */
static void pairs_in_order(const float *acc, float inv, int D, float *out) {
    const __m512i low =
        _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high =
        _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int c = 0; c < D; c += 2 * LANES) {
        const __m512 first = _mm512_load_ps(acc + c), second = _mm512_load_ps(acc + c + LANES);
        _mm512_storeu_ps(out + c, (__m512)((v16)_mm512_permutex2var_ps(first, low, second) * inv));
        _mm512_storeu_ps(out + c + LANES,
                         (__m512)((v16)_mm512_permutex2var_ps(first, high, second) * inv));
    }
}

/* accumulate_pairs' sums for value segments g (and g + 1 when width is 2) of the rows r, keys
   [0, count) in order. Inlined with width a constant (accumulate_pairs): with it a variable
   the compiler kept the value chunks and accumulators in arrays on the stack and passed each
   chunk through memory between its load and its products (perf: a sixth of the function's
   samples on one reload). Constant, the twelve accumulators, four chunks and a pair live in
   registers: 64 decodes of ~336 keys, a layer, 30 layers' caches in turn (cold, as in a
   step), the Zen 4, 1.04 -> 0.88 ms on two threads, 2.00 -> 1.69 on one (2026-11-30). */
static inline __attribute__((always_inline)) void accumulate_pair_segments(
    Scratch *s, int Dp, const int r[ACC_ROWS], const uint32_t p[ACC_ROWS][LANES / 2], int count,
    int g, int width) {
    __m512 sum[ACC_ROWS][4];
    for (int i = 0; i < ACC_ROWS; i++)
        for (int k = 0; k < 2 * width; k++)
            sum[i][k] = _mm512_load_ps(s->acc + (int64_t)r[i] * Dp + (2 * g + k) * LANES);
    for (int j = 0; j < count; j += 2) {
        const char *v0 = s->values[j], *v1 = j + 1 < count ? s->values[j + 1] : v0;
        __m512bh chunk[4];
        for (int w = 0; w < width; w++) {
            const __m512i x = _mm512_loadu_si512(v0 + (int64_t)(g + w) * 4 * LANES);
            const __m512i y = _mm512_loadu_si512(v1 + (int64_t)(g + w) * 4 * LANES);
            chunk[2 * w] = (__m512bh)_mm512_unpacklo_epi16(x, y);
            chunk[2 * w + 1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
        }
        for (int i = 0; i < ACC_ROWS; i++) {
            const __m512bh pair = (__m512bh)_mm512_set1_epi32((int)p[i][j / 2]);
            for (int k = 0; k < 2 * width; k++)
                sum[i][k] = _mm512_dpbf16_ps(sum[i][k], chunk[k], pair);
        }
    }
    for (int i = 0; i < ACC_ROWS; i++)
        for (int k = 0; k < 2 * width; k++)
            _mm512_store_ps(s->acc + (int64_t)r[i] * Dp + (2 * g + k) * LANES, sum[i][k]);
}

/* acc_r += sum_j p_rj v_j for rows [row0, rows) with the pair dot instruction: keys j and
   j + 1's values interleaved (lane i of a chunk holds the two keys' value at one position),
   against row r's two probabilities rounded to bf16 (the value's product and the sum of the
   pair exact in float32, as torch's flash attention rounds probabilities for its second
   product). Half the products of accumulate_rows and no widening; three rows and two
   32-value segments (twelve accumulators) at a time, keys in order, so a row's sums do not
   depend on the others. An odd key's partner is itself, with probability 0. */
static void accumulate_pairs(const Attention *a, Scratch *s, int row0, int rows, int count) {
    const int Dp = a->padded_dim, segments = a->head_dim / (2 * LANES);
    spare_rows(s);
    for (int r0 = row0; r0 < rows; r0 += ACC_ROWS) {
        int r[ACC_ROWS];
        group_rows(s, r0, rows, r);
        uint32_t p[ACC_ROWS][LANES / 2];
        for (int i = 0; i < ACC_ROWS; i++) {
            const __m256bh rounded = _mm512_cvtneps_pbh((__m512)s->scores[r[i]]);
            _mm256_storeu_si256((__m256i *)p[i], (__m256i)rounded);
        }
        for (int g = 0; g < segments; g += 2) {
            if (segments - g >= 2) accumulate_pair_segments(s, Dp, r, p, count, g, 2);
            else accumulate_pair_segments(s, Dp, r, p, count, g, 1);
        }
    }
}
#endif

/* The same scores from the tile transposed once (keys_t[d] lane j = k_j[d]): rows [row0, rows). */
static void score_by_transpose(const Attention *a, Scratch *s, int row0, int rows, int count) {
    const int D = a->head_dim, Dp = a->padded_dim;
    for (int d = 0; d < D; d++) {
        v16 column = splat(0.0f);
        for (int j = 0; j < count; j++) column[j] = row_element(s->keys[j], d, a->bf16_rows);
        s->keys_t[d] = column;
    }
    for (int r = row0; r < rows; r += ROW_BLOCK) {
        const int n = rows - r < ROW_BLOCK ? rows - r : ROW_BLOCK;
        for (int h = 0; h < PARTS; h++) { /* a part at a time, in registers (see PART_LANES) */
            vp even[ROW_BLOCK], odd[ROW_BLOCK];
            for (int i = 0; i < ROW_BLOCK; i++) even[i] = odd[i] = (vp){0};
            int d = 0;
            for (; d + 1 < D; d += 2) {
                const vp k0 = part_of(&s->keys_t[d], h), k1 = part_of(&s->keys_t[d + 1], h);
                for (int i = 0; i < ROW_BLOCK; i++) {
                    const float *q = s->queries + (int64_t)(i < n ? r + i : r) * Dp;
                    even[i] += q[d] * k0;
                    odd[i] += q[d + 1] * k1;
                }
            }
            for (int i = 0; i < n; i++) {
                const float *q = s->queries + (int64_t)(r + i) * Dp;
                const vp score =
                    even[i] + odd[i] + (d < D ? q[d] * part_of(&s->keys_t[d], h) : (vp){0});
                memcpy((char *)&s->scores[r + i] + h * sizeof score, &score, sizeof score);
            }
        }
    }
}

/* Fold the tile's scores into row r's online softmax: keys [first, first + count) of which the
   row sees those from first_key (its window's first) up to last_key (its own position). Leaves
   the row's probabilities in scores. A row that saw none of them would be left as it was,
   with probabilities zero (selected lanes: whatever exp made of -inf - -inf is dropped), but
   attend_key_tile passes no such row: a window's rows past the tile are skipped. The row's
   max is -inf only before its first key, and only without a sink (load_queries starts a
   sink's row at max = sink, sum = 1): the correction then zeroes an empty sum. With a sink it
   is exp(sink - new max) for the sink's term, as for any earlier tile's keys. */
static void softmax_update(Scratch *s, int r, int Dp, int first, int count, int first_key,
                           int last_key) {
    int visible = last_key - first + 1;
    visible = visible < count ? visible : count;
    vpi seen[PARTS]; /* a part at a time, in registers (see PART_LANES) */
    vp scores[PARTS], probs[PARTS];
    for (int h = 0; h < PARTS; h++) {
        const vpi lane = lane_index_part(h);
        seen[h] = (lane >= first_key - first) & (lane < visible);
        scores[h] = select_part(seen[h], part_of(&s->scores[r], h), (vp){0} - INFINITY);
    }
    const float old_max = s->row_max[r], tile_max = parts_max(scores);
    const float new_max = tile_max > old_max ? tile_max : old_max;
    for (int h = 0; h < PARTS; h++)
        probs[h] = select_part(seen[h], exp_part(scores[h] - new_max), (vp){0});
    if (new_max > old_max) {
        const float correction = old_max == -INFINITY ? 0.0f : exp_part((vp){0} + (old_max - new_max))[0];
        vpu *acc = (vpu *)(s->acc + (int64_t)r * Dp);
        for (int c = 0; c < Dp / PART_LANES; c++) acc[c] *= correction;
        s->row_sum[r] *= correction;
        s->row_max[r] = new_max;
    }
    s->row_sum[r] += parts_sum(probs);
    memcpy(&s->scores[r], probs, sizeof probs);
}

/* acc[c] += sum_j p[j] v_j[c] for chunks [c, c + 4) of rows r0, r1 and r2: twelve
   independent accumulator chains, each value chunk loaded once for the three rows (a decode's
   rows are its group's query heads: three for SmolLM2). */
static inline __attribute__((always_inline)) void accumulate_four_chunks(
    Scratch *s, int Dp, const int r[ACC_ROWS], int c, int count, int bf16) {
    v16 *acc[ACC_ROWS], sum[ACC_ROWS][4];
    for (int i = 0; i < ACC_ROWS; i++) {
        acc[i] = (v16 *)(s->acc + (int64_t)r[i] * Dp) + c;
        for (int k = 0; k < 4; k++) sum[i][k] = acc[i][k];
    }
    for (int j = 0; j < count; j++) {
        const char *v = s->values[j];
        const v16 chunk[4] = {row_chunk(v, c, bf16), row_chunk(v, c + 1, bf16),
                              row_chunk(v, c + 2, bf16), row_chunk(v, c + 3, bf16)};
        for (int i = 0; i < ACC_ROWS; i++) {
            const float p = s->scores[r[i]][j];
            for (int k = 0; k < 4; k++) sum[i][k] += p * chunk[k];
        }
    }
    for (int i = 0; i < ACC_ROWS; i++)
        for (int k = 0; k < 4; k++) acc[i][k] = sum[i][k];
}

/* accumulate_four_chunks for one chunk, in parts: 6 accumulators of 8 lanes and a value
   chunk's 2 parts in registers (four chunks' would not fit 16 registers of 8 lanes). Each
   lane adds the same products in the same order. */
static inline __attribute__((always_inline)) void accumulate_chunk_parts(
    Scratch *s, int Dp, const int r[ACC_ROWS], int c, int count, int bf16) {
    vp sum[ACC_ROWS][PARTS];
    for (int i = 0; i < ACC_ROWS; i++)
        for (int h = 0; h < PARTS; h++) sum[i][h] = *(const vpu *)(s->acc + (int64_t)r[i] * Dp + c * LANES + h * PART_LANES);
    for (int j = 0; j < count; j++) {
        vp chunk[PARTS];
        for (int h = 0; h < PARTS; h++) chunk[h] = row_part(s->values[j], c, h, bf16);
        for (int i = 0; i < ACC_ROWS; i++) {
            const float p = s->scores[r[i]][j];
            for (int h = 0; h < PARTS; h++) sum[i][h] += p * chunk[h];
        }
    }
    for (int i = 0; i < ACC_ROWS; i++)
        for (int h = 0; h < PARTS; h++)
            memcpy(s->acc + (int64_t)r[i] * Dp + c * LANES + h * PART_LANES, &sum[i][h], sizeof sum[i][h]);
}

/* acc_r += sum_j p_rj v_j for rows [row0, rows), three rows and four v16 chunks at a time. */
static inline __attribute__((always_inline)) void accumulate_rows(const Attention *a, Scratch *s,
                                                                  int row0, int rows, int count,
                                                                  int bf16) {
    const int Dp = a->padded_dim, chunks = Dp / LANES, whole = chunks / 4 * 4;
    spare_rows(s);
    for (int r0 = row0; r0 < rows; r0 += ACC_ROWS) {
        int r[ACC_ROWS];
        group_rows(s, r0, rows, r);
#if PARTS == 1
        for (int c = 0; c < whole; c += 4) accumulate_four_chunks(s, Dp, r, c, count, bf16);
#else
        for (int c = 0; c < whole; c++) accumulate_chunk_parts(s, Dp, r, c, count, bf16);
#endif
        for (int rr = r0; rr < r0 + ACC_ROWS && rr < rows; rr++) {
            v16 *acc = (v16 *)(s->acc + (int64_t)rr * Dp);
            for (int j = 0; j < count; j++) {
                const float p = s->scores[rr][j];
                for (int c = whole; c < chunks; c++) acc[c] += p * row_chunk(s->values[j], c, bf16);
            }
        }
    }
}

static void accumulate_values(const Attention *a, Scratch *s, int row0, int rows, int count) {
#if HAVE_BF16_PAIRS
    if (a->pairs) {
        accumulate_pairs(a, s, row0, rows, count);
        return;
    }
#endif
    if (a->bf16_rows) accumulate_rows(a, s, row0, rows, count, 1);
    else accumulate_rows(a, s, row0, rows, count, 0);
}

static void load_queries(const Attention *a, const Tile *t, int kvh, Scratch *s, int rows) {
    const int D = a->head_dim, Dp = a->padded_dim, group = a->num_heads / a->num_kv_heads;
    const int q_first = a->query_start_loc[t->seq];
    for (int r = 0; r < rows; r++) {
        int64_t token = q_first + t->q_begin + r / group, head = kvh * group + r % group;
        const char *src = (const char *)a->query + (token * a->query_stride_token +
                                                    head * a->query_stride_head) *
                                                       (int64_t)dtype_size(a->dtype);
        if (a->pairs) { /* scored as they are, scaled after */
            memcpy(s->queries_bf16 + (int64_t)r * Dp, src, (size_t)D * sizeof(uint16_t));
        } else {
            float *q = s->queries + (int64_t)r * Dp;
            memset(q, 0, (size_t)Dp * sizeof(float));
            load_row(src, a->dtype, q, D);
            for (int d = 0; d < D; d++) q[d] *= a->scale;
        }
        memset(s->acc + (int64_t)r * Dp, 0, (size_t)Dp * sizeof(float));
        /* A head's sink is a key seen before all others, with no value: max = sink, and its
           term exp(sink - max) = 1 in the sum (a sink of -inf: the correction zeroes it). */
        s->row_max[r] = a->sinks != NULL ? a->sinks[head] : -INFINITY;
        s->row_sum[r] = a->sinks != NULL ? 1.0f : 0.0f;
    }
}

/* The first key the query at position pos sees: its window's first, or 0 without a window. */
static inline int window_start(const Attention *a, int pos) {
    const int start = pos - a->sliding_window + 1;
    return a->sliding_window > 0 && start > 0 ? start : 0;
}

/* Where a tile's rows sit: its sequence's first query row and block table, the position of
   its first query, its rows (query, head-in-group pairs) per KV head, the first key its first
   query sees and the keys its last query sees (its key tiles span [first_key, num_keys)). */
typedef struct {
    int q_first, first_pos, rows, first_key, num_keys;
    const int32_t *table;
} TileSpan;

static TileSpan tile_span(const Attention *a, const Tile *t) {
    const int group = a->num_heads / a->num_kv_heads;
    const int q_first = a->query_start_loc[t->seq];
    const int num_queries = a->query_start_loc[t->seq + 1] - q_first;
    /* Query i of the sequence sits at position seq_len - num_queries + i. */
    const int first_pos = a->seq_lens[t->seq] - num_queries;
    return (TileSpan){q_first,
                      first_pos,
                      (t->q_end - t->q_begin) * group,
                      window_start(a, first_pos + t->q_begin),
                      first_pos + t->q_end,
                      a->block_tables + (int64_t)t->seq * a->block_table_stride};
}

/* Fetch the rows of the key tile after [first, first + 16) of KV head kvh while this one is
   computed: its K rows, and its V rows too where values_ahead (rows widened into the scratch
   as the tile is loaded: int8, odd head sizes; bf16 rows of 64 values read in place; longer
   rows read in place have their values fetched by load_key_tile). 64 decodes of ~336 keys, a
   layer, on a 2-core Zen 4 (into L2): float32 1.72-1.96 -> 1.45-1.57 ms (two or three tiles
   ahead, or the next tile's values too, measured slower), an int8 cache 1.39-1.62 ->
   1.03-1.04; bf16 rows of 64 values, the next tile's values too rather than the current
   tile's, 1.36-1.46 -> 1.31-1.41 one thread, 0.70-0.73 -> 0.70-0.71 two (2026-11-30). On
   the Xeon with AMX (into L1) the next tile's K and V of float32 rows measured level, 1.65
   -> 1.63 ms. Its cursor starts
   afresh at the next tile (a division and two table reads) rather than going on from
   load_key_tile's: going on, by value or by pointer, measured 3-10% slower in bf16 (1.08-1.11
   -> 1.11-1.23 ms a layer, alternating; the compiler's code, not the work). */
static inline __attribute__((always_inline)) void prefetch_next_tile(const Attention *a,
                                                                     const TileSpan *span, int kvh,
                                                                     int first) {
    const int next = first + LANES;
    const int count = span->num_keys - next < LANES ? span->num_keys - next : LANES;
    if (count <= 0) return;
    KeyCursor cursor = key_cursor(a, span->table, kvh, next);
    for (int j = 0; j < count; j++) {
        const char *k, *v;
        next_rows(&cursor, &k, &v);
        for (int64_t o = 0; o < kv_row_bytes(a->kv_dtype, a->head_dim); o += 64) prefetch_stream(k + o);
        if (!a->values_ahead) continue;
        for (int64_t o = 0; o < kv_row_bytes(a->kv_dtype, a->head_dim); o += 64) prefetch_stream(v + o);
    }
}

/* The key tile's scores for rows [row0, rows): against the tile transposed once from
   TRANSPOSE_MIN_ROWS rows on, else key by key; in bf16 pairs where the attention takes them. */
static void score_rows(const Attention *a, Scratch *s, int row0, int rows, int count) {
    const int transpose = rows - row0 >= TRANSPOSE_MIN_ROWS;
#if HAVE_BF16_PAIRS
    if (a->pairs) {
        if (transpose) score_by_pair_transpose(a, s, row0, rows, count);
        else score_by_pairs(a, s, row0, rows, count);
        return;
    }
#endif
    if (transpose) score_by_transpose(a, s, row0, rows, count);
    else score_by_dots(a, s, row0, rows, count);
}

/* Fold keys [first, first + 16) of KV head kvh into the tile's rows of that head. */
static void attend_key_tile(const Attention *a, const Tile *t, const TileSpan *span, int kvh,
                            int first, Scratch *s) {
    const int group = a->num_heads / a->num_kv_heads, rows = span->rows;
    const int count = span->num_keys - first < LANES ? span->num_keys - first : LANES;
    const int position0 = span->first_pos + t->q_begin;
    load_key_tile(a, span->table, kvh, first, count, s);
    prefetch_next_tile(a, span, kvh, first);
    /* Rows ascend in position, and so do their windows: skip those that see none of this
       tile, before it (their own position precedes it) or past it (their window starts
       after it). The rows between see some of it; without a window, all rows after row0. */
    int row0 = 0, row_end = rows;
    while (row0 < rows && position0 + row0 / group < first) row0++;
    while (row_end > row0 && window_start(a, position0 + (row_end - 1) / group) >= first + count)
        row_end--;
    score_rows(a, s, row0, row_end, count);
    /* Capped before the mask: lanes past count hold 0, and masked lanes become -inf anyway. */
    if (a->softcap > 0.0f) {
        for (int r = row0; r < row_end; r++) s->scores[r] = soft_cap(s->scores[r], a->softcap);
    }
    for (int r = row0; r < row_end; r++) {
        const int position = position0 + r / group;
        softmax_update(s, r, a->padded_dim, first, count, window_start(a, position), position);
    }
    accumulate_values(a, s, row0, row_end, count);
}

/* The tile's rows of KV head kvh, normalised, into the output. */
static void store_tile(const Attention *a, const Tile *t, const TileSpan *span, int kvh,
                       Scratch *s) {
    const int D = a->head_dim, H = a->num_heads, group = a->num_heads / a->num_kv_heads;
    for (int r = 0; r < span->rows; r++) {
        int64_t token = span->q_first + t->q_begin + r / group, head = kvh * group + r % group;
        float *acc = s->acc + (int64_t)r * a->padded_dim;
        const float inv = 1.0f / s->row_sum[r];
#if HAVE_BF16_PAIRS
        if (a->pairs) { /* through the key rows (unused: rows are read in place) */
            pairs_in_order(acc, inv, D, s->key_rows);
            acc = s->key_rows;
        } else
#endif
        for (int d = 0; d < D; d++) acc[d] *= inv;
        char *dst = (char *)a->out + ((token * H + head) * D) * (int64_t)dtype_size(a->dtype);
        store_row(dst, a->dtype, acc, D);
    }
}

/* The tile's rows of one KV head, key tile by key tile.

   With a window, the key tiles start at the first key the tile's first query sees, wherever
   that falls in its block (tiles are then not aligned to 16 keys): no key before it is read,
   so neither is any block before the one holding it. Those blocks' table entries may be
   stale (the scheduler frees a block once every window has passed it), and a masked lane
   would not do: 0 * NaN is NaN. The first query of a sequence sees the earliest key any of
   its queries sees. Without a window the tiles start at key 0, as they always have. */
static void run_tile(const Attention *a, const Tile *t, int kvh, Scratch *s) {
    const TileSpan span = tile_span(a, t);
    load_queries(a, t, kvh, s, span.rows);
    for (int first = span.first_key; first < span.num_keys; first += LANES) {
        attend_key_tile(a, t, &span, kvh, first, s);
    }
    store_tile(a, t, &span, kvh, s);
}

/* Every KV head's rows of a tile, all heads of one key tile before the next: one thread reads
   each block's K and V planes whole, where one head per work item read a quarter-kilobyte of
   every position's row (64 SmolLM2 decodes x 30 layers, float32: 82-90 -> 74-76 ms, three
   alternating pairs; prefetching the next key tile's rows, to L1 or L2, one to four tiles
   ahead, measured no faster). Each row's sums are run_tile's, in the same order. heads: a
   scratch per KV head. */
static void run_tile_heads(const Attention *a, const Tile *t, Scratch *heads) {
    const TileSpan span = tile_span(a, t);
    for (int kvh = 0; kvh < a->num_kv_heads; kvh++) {
        load_queries(a, t, kvh, &heads[kvh], span.rows);
    }
    for (int first = span.first_key; first < span.num_keys; first += LANES) {
        for (int kvh = 0; kvh < a->num_kv_heads; kvh++) {
            attend_key_tile(a, t, &span, kvh, first, &heads[kvh]);
        }
    }
    for (int kvh = 0; kvh < a->num_kv_heads; kvh++) store_tile(a, t, &span, kvh, &heads[kvh]);
}

/* Per-thread scratch for up to max_rows rows; NULL if out of memory. */
static float *alloc_scratch(const Attention *a, int max_rows, Scratch *s) {
    const size_t Dp = (size_t)a->padded_dim, rows = (size_t)max_rows + ACC_ROWS - 1;
    s->spare_row = max_rows;
    const size_t floats = rows * Dp * 2 + rows * 2 + rows * LANES + (size_t)a->head_dim * LANES +
                          (size_t)LANES * Dp * 2 + 3 * LANES + rows * Dp / 2;
    const size_t bytes = (floats * sizeof(float) + 63) / 64 * 64;
    float *buffer = aligned_alloc(64, bytes);
    if (buffer == NULL) return NULL;
    memset(buffer, 0, bytes);
    float *next = buffer;
    s->queries = next, next += rows * Dp;
    s->acc = next, next += rows * Dp;
    s->scores = (v16 *)next, next += rows * LANES;
    s->keys_t = (v16 *)next, next += (size_t)a->head_dim * LANES;
    s->key_rows = next, next += (size_t)LANES * Dp;
    s->value_rows = next, next += (size_t)LANES * Dp;
    s->row_max = next, next += rows + LANES;
    s->row_sum = next, next += rows + 2 * LANES;
    s->queries_bf16 = (uint16_t *)next;
    return buffer;
}

/* Tiles of query_tile queries of the selected sequences. */
static int count_tiles(const int32_t *query_start_loc, const int32_t *seq_ids, int num_selected,
                       int query_tile) {
    int num_tiles = 0;
    for (int k = 0; k < num_selected; k++) {
        int n = query_start_loc[seq_ids[k] + 1] - query_start_loc[seq_ids[k]];
        num_tiles += (n + query_tile - 1) / query_tile;
    }
    return num_tiles;
}

/* headrace_paged_attention's work, called by every thread of an OpenMP region (the tiles are
   shared out among them). Sets *failed when a scratch or tile list could not be allocated. */
void hr_paged_attention(const void *query, int64_t query_stride_token, int64_t query_stride_head,
                        const void *kv_cache, const int32_t *block_tables,
                        int64_t block_table_stride, const int32_t *query_start_loc,
                        const int32_t *seq_lens, const int32_t *seq_ids, int num_selected,
                        int num_heads, int num_kv_heads, int head_dim, int block_size,
                        float scale, int sliding_window, float softcap, const float *sinks,
                        int dtype, int kv_dtype, int query_tile, void *out, int *failed) {
    const int padded_dim = (head_dim + LANES - 1) / LANES * LANES;
    const int direct = (kv_dtype == F32 || kv_dtype == BF16) && head_dim == padded_dim;
    Attention a = {query,        query_stride_token, query_stride_head, kv_cache,
                   block_tables, block_table_stride, query_start_loc,   seq_lens,
                   num_heads,    num_kv_heads,       head_dim,          block_size,
                   dtype,        kv_dtype,           scale,             sliding_window,
                   softcap,      sinks,              out,               padded_dim,
                   direct,
                   kv_dtype == BF16 && head_dim == padded_dim,
                   HAVE_BF16_PAIRS && dtype == BF16 && kv_dtype == BF16 &&
                       head_dim % (2 * LANES) == 0,
                   !direct || kv_row_bytes(kv_dtype, head_dim) <= VALUES_AHEAD_MAX_ROW_BYTES};
    const int num_tiles = count_tiles(query_start_loc, seq_ids, num_selected, query_tile);
    /* each thread's own list (a few entries per sequence): no thread waits for another's */
    Tile *tiles = malloc((size_t)(num_tiles > 0 ? num_tiles : 1) * sizeof(Tile));
    /* Prefill chunks (last in the batch, the longest work) first, so the dynamic schedule ends
       with the short one-query tiles (decodes), which come last. */
    int next = 0, num_single = 0;
    for (int single = 0; single < 2; single++) {
        for (int k = num_selected - 1; tiles != NULL && k >= 0; k--) {
            const int i = seq_ids[k], n = query_start_loc[i + 1] - query_start_loc[i];
            if ((n == 1) != single) continue;
            num_single += single;
            for (int q = 0; q < n; q += query_tile) {
                tiles[next].seq = i;
                tiles[next].q_begin = q;
                tiles[next].q_end = q + query_tile < n ? q + query_tile : n;
                next++;
            }
        }
    }
    /* One-query tiles take every KV head in one work item where there are enough of them to
       share out (`run_tile_heads`); otherwise, and prefill tiles always, one head per item. */
    const int whole_heads = num_kv_heads <= MAX_KV_HEADS_TOGETHER &&
                            num_single >= HEADS_ITEMS_PER_THREAD * omp_get_num_threads();
    const int grouped = whole_heads ? num_single : 0;
    const int64_t num_items = (int64_t)(num_tiles - grouped) * num_kv_heads + grouped;
    const int max_rows = query_tile * (num_heads / num_kv_heads);
    const int num_scratches = whole_heads ? num_kv_heads : 1;
    Scratch heads[MAX_KV_HEADS_TOGETHER] = {{0}};
    float *buffers[MAX_KV_HEADS_TOGETHER] = {NULL};
    int ready = tiles != NULL;
    for (int h = 0; h < num_scratches && ready; h++) {
        buffers[h] = alloc_scratch(&a, max_rows, &heads[h]);
        ready = buffers[h] != NULL;
    }
    if (!ready) {
#pragma omp atomic write
        *failed = 1;
    }
    const int64_t first_grouped = num_items - grouped;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_items; item++) {
        if (!ready) continue;
        if (item >= first_grouped) {
            run_tile_heads(&a, &tiles[num_tiles - grouped + (item - first_grouped)], heads);
        } else {
            run_tile(&a, &tiles[item / num_kv_heads], (int)(item % num_kv_heads), &heads[0]);
        }
    }
    for (int h = 0; h < num_scratches; h++) free(buffers[h]);
    free(tiles);
}

/* Attention of the query rows of the sequences seq_ids[0..num_selected) of a varlen batch
   (rows of other sequences are left alone). Returns 0, or -1 if scratch memory could not be
   allocated. `query_tile`: queries of one sequence handled together (they share each key
   tile); decode sequences have one. `sliding_window`: keys a query sees, its own included (0:
   all); the block-table entries before the block holding the first key a sequence's first
   query sees are never read. `softcap`: each scaled score s becomes softcap * tanh(s /
   softcap) before the softmax (0: none; Gemma 2's attn_logit_softcapping). `sinks`: [H]
   float32, head h's softmax has exp(sinks[h]) in its denominator, beside its keys', and no
   value (NULL: none; GPT-OSS's attention sinks). */
int headrace_paged_attention(const void *query, int64_t query_stride_token,
                             int64_t query_stride_head, const void *kv_cache,
                             const int32_t *block_tables, int64_t block_table_stride,
                             const int32_t *query_start_loc, const int32_t *seq_lens,
                             const int32_t *seq_ids, int num_selected, int num_heads,
                             int num_kv_heads, int head_dim, int block_size, float scale,
                             int sliding_window, float softcap, const float *sinks,
                             int dtype, int kv_dtype, int query_tile, void *out) {
    const int num_tiles = count_tiles(query_start_loc, seq_ids, num_selected, query_tile);
    int failed = 0;
#pragma omp parallel if ((int64_t)num_tiles * num_kv_heads > 1)
    hr_paged_attention(query, query_stride_token, query_stride_head, kv_cache, block_tables,
                       block_table_stride, query_start_loc, seq_lens, seq_ids, num_selected,
                       num_heads, num_kv_heads, head_dim, block_size, scale, sliding_window,
                       softcap, sinks, dtype, kv_dtype, query_tile, out, &failed);
    return failed ? -1 : 0;
}

/* out[i] = softcap * tanh(x[i] / softcap) over n float32 values (out may be x): attention's
   soft cap, exported on its own (its accuracy is tested against torch.tanh through it). */
void headrace_soft_cap(const float *x, int64_t n, float softcap, float *out) {
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) *(v16u *)(out + i) = soft_cap(*(const v16u *)(x + i), softcap);
    if (i < n) {
        v16 tail = splat(0.0f);
        memcpy(&tail, x + i, (size_t)(n - i) * sizeof(float));
        tail = soft_cap(tail, softcap);
        memcpy(out + i, &tail, (size_t)(n - i) * sizeof(float));
    }
}

/* ---- KV-cache write ----------------------------------------------------------------------- */

/* Token t's K and V rows ([Hkv, D] in dtype, strided by head) go to cache slot
   slot_mapping[t] of planes 0 and 1: copied when the cache is in dtype too, quantized when it
   is I8. (hr_: the work of every thread of a region; headrace_: the exported kernel, which
   opens one.) */
void hr_write_kv_cache(const void *key, int64_t key_stride_token, int64_t key_stride_head,
                       const void *value, int64_t value_stride_token, int64_t value_stride_head,
                       void *kv_cache, const int64_t *slot_mapping, int64_t num_tokens,
                       int num_kv_heads, int head_dim, int block_size, int dtype, int kv_dtype) {
    const size_t esize = dtype_size(dtype);
    const int64_t row_bytes = kv_row_bytes(kv_dtype, head_dim);
    float wide[kv_dtype == I8 ? head_dim : 1];
#pragma omp for
    for (int64_t t = 0; t < num_tokens; t++) {
        int64_t slot = slot_mapping[t];
        if (slot < 0) continue; /* padding: nothing to write */
        int64_t block = slot / block_size, offset = slot % block_size;
        for (int plane = 0; plane < 2; plane++) {
            const char *src = plane == 0 ? (const char *)key : (const char *)value;
            int64_t stride_t = plane == 0 ? key_stride_token : value_stride_token;
            int64_t stride_h = plane == 0 ? key_stride_head : value_stride_head;
            char *dst = (char *)kv_cache +
                        (((block * 2 + plane) * block_size + offset) * num_kv_heads) * row_bytes;
            for (int h = 0; h < num_kv_heads; h++) {
                const char *row = src + (t * stride_t + h * stride_h) * esize;
                if (kv_dtype == I8) {
                    load_row(row, dtype, wide, head_dim);
                    store_kv_row_int8(wide, head_dim, (int8_t *)(dst + h * row_bytes));
                } else {
                    memcpy(dst + h * row_bytes, row, (size_t)row_bytes);
                }
            }
        }
    }
}

void headrace_write_kv_cache(const void *key, int64_t key_stride_token, int64_t key_stride_head,
                             const void *value, int64_t value_stride_token,
                             int64_t value_stride_head, void *kv_cache,
                             const int64_t *slot_mapping, int64_t num_tokens, int num_kv_heads,
                             int head_dim, int block_size, int dtype, int kv_dtype) {
#pragma omp parallel if (num_tokens >= 64)
    hr_write_kv_cache(key, key_stride_token, key_stride_head, value, value_stride_token,
                      value_stride_head, kv_cache, slot_mapping, num_tokens, num_kv_heads,
                      head_dim, block_size, dtype, kv_dtype);
}

/* ---- argmax ------------------------------------------------------------------------------- */

/* The index of the first maximum of row[0..num_cols) and that maximum (NaN counts as the
   maximum, as in numpy: the first NaN's index). */
static inline int64_t row_argmax(const float *row, int64_t num_cols, float *value) {
    float best = -INFINITY;
    int has_nan = 0;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
    for (int64_t c = 0; c < num_cols; c++) {
        best = row[c] > best ? row[c] : best;
        has_nan |= row[c] != row[c];
    }
    for (int64_t c = 0; c < num_cols; c++) {
        if (has_nan ? row[c] != row[c] : row[c] == best) {
            *value = row[c];
            return c;
        }
    }
    *value = best;
    return 0;
}

/* A running argmax over column blocks that arrive in ascending order: x holds columns
   [offset, offset + num_cols) of every row; (best[r], index[r]) become the first maximum of
   all columns seen so far. An earlier block keeps ties, and a NaN, once seen, stays. */
void headrace_argmax_update(const float *x, int64_t num_rows, int64_t num_cols,
                            int64_t row_stride, int64_t offset, float *best, int64_t *index) {
#pragma omp parallel for schedule(static) if (num_rows * num_cols >= (1 << 16))
    for (int64_t r = 0; r < num_rows; r++) {
        float value;
        int64_t column = row_argmax(x + r * row_stride, num_cols, &value);
        if (best[r] != best[r]) continue;
        if (value != value || value > best[r]) {
            best[r] = value;
            index[r] = offset + column;
        }
    }
}

/* ---- sampling ----------------------------------------------------------------------------- */

/* The sampler works a part at a time (PART_LANES lanes of a 16-lane block): on AVX2 a v16
   lives in memory, and a draw of 24 rows of a 49,152-token vocabulary took 6-8 ms in v16s
   against 1.0-1.3 in parts (Zen 3, 2026-11-29). Lane i of part h is the block's lane
   h * PART_LANES + i either way. */

/* The noise hash of token ids under a row key (multiplier, offset): a Weyl sequence, then
   xorshift-multiply rounds, all mod 2**32 (headrace.kernels.sampling.gumbel_noise).
   `mix` is the rounds, of weyl = token * multiplier + offset. */
static inline vpw mix(vpw h) {
    h ^= h >> 16;
    h *= 0x21F0AAADu;
    h ^= h >> 15;
    h *= 0x735A2D97u;
    h ^= h >> 15;
    return h;
}

/* Standard Gumbel noise of hash h: -log(-log u), u = (h + 0.5) / 2**32, in double, rounded
   once to float (as the torch twin computes it). */
static inline float gumbel_of(uint32_t h) {
    const double u = ((double)h + 0.5) * (1.0 / 4294967296.0);
    return (float)-log(-log(u));
}

/* Bit k set where lane k of a is below lane k of b (false for NaN): one part. */
static inline uint32_t part_lanes_below(vp a, vp b) {
#ifdef __AVX512F__
    return _mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_LT_OQ);
#elif defined(__AVX__)
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_LT_OQ));
#else
    const vpi below = a < b;
    uint32_t bits = 0;
    for (int k = 0; k < PART_LANES; k++) bits |= (below[k] != 0) << k;
    return bits;
#endif
}

/* Lane-wise max of x and best, best where x is NaN: one part. */
static inline vp part_max(vp x, vp best) {
#ifdef __AVX512F__
    return (vp)_mm512_max_ps((__m512)x, (__m512)best);
#elif defined(__AVX__)
    return (vp)_mm256_max_ps((__m256)x, (__m256)best); /* the second operand where x is NaN */
#else
    return select_part(x > best, x, best);
#endif
}

/* The race keeps at most this many best (score, token) pairs: the first top-p keeps is the
   draw (`race_capacity` says how many a row needs). */
#define MAX_CANDIDATES 8
/* Rows whose race should keep candidates until top-p rejects them all about this rarely. */
#define ALL_REJECTED_RATE 1e-4
/* The race prefetches this far ahead in a row: its first read of the logits, from memory (the
   hardware prefetcher stops at 4 KiB pages). Measured: race 7.8 -> 5.7 ms on one core. */
#define PREFETCH_FLOATS 1024
/* Blocks whose weights are summed in float lanes before the sum moves to double. */
#define SUM_BLOCKS 64

/* PART_LANES floats from [first, first + PART_LANES), missing lanes as fill. */
static inline vp load_part(const float *row, int64_t first, int64_t vocab, float fill) {
    if (first + PART_LANES <= vocab) return *(const vpu *)(row + first);
    vp out = (vp){0} + fill;
    for (int64_t i = first; i < vocab; i++) out[i - first] = row[i];
    return out;
}

/* The row's largest logit, NaN ignored (-inf when every logit is -inf or NaN). */
static float row_max(const float *logits, int64_t vocab) {
    vp best[PARTS];
    for (int h = 0; h < PARTS; h++) best[h] = (vp){0} - INFINITY;
    for (int64_t first = 0; first < vocab; first += PART_LANES * PARTS)
        for (int h = 0; h < PARTS; h++) {
            const vp x = load_part(logits, first + h * PART_LANES, vocab, -INFINITY);
            best[h] = select_part(x > best[h], x, best[h]);
        }
    return parts_max(best);
}

typedef struct {
    int count, capacity;
    float score[MAX_CANDIDATES];
    int64_t token[MAX_CANDIDATES];
} Candidates;

/* How many candidates a row's race keeps, given top-p's floor (1 - top_p). Each candidate is
   outside the nucleus (rejected) with probability at most floor, so all of k are with about
   floor**k; keep the fewest that make that ALL_REJECTED_RATE (the caller then races the row in
   torch: the same token, slower). Fewer candidates, fewer entrants: the best k of N random
   scores change about k (1 + ln(N / k)) times in a scan, each a log of a log. */
static int race_capacity(float floor) {
    if (floor <= 0.0f) return 1; /* no top-p: the winner is the draw */
    /* floor**8 >= 1e-4 from here on (and floor may round to 1, whose log is 0) */
    if (floor >= 0.5f) return MAX_CANDIDATES;
    const int k = (int)ceil(log(ALL_REJECTED_RATE) / log((double)floor));
    return k < MAX_CANDIDATES ? k : MAX_CANDIDATES;
}

/* Insert (score, token) in descending order of score; tokens arrive in ascending order, so
   an equal score goes after those before it (argmax's first maximum). */
static void candidates_add(Candidates *c, float score, int64_t token) {
    int at = c->count;
    while (at > 0 && c->score[at - 1] < score) at--;
    if (at >= c->capacity) return;
    const int last = c->count < c->capacity ? c->count : c->capacity - 1;
    for (int k = last; k > at; k--) {
        c->score[k] = c->score[k - 1];
        c->token[k] = c->token[k - 1];
    }
    c->score[at] = score;
    c->token[at] = token;
    if (c->count < c->capacity) c->count++;
}

typedef struct {
    const float *logits; /* the row */
    int64_t vocab;
    float temperature;
    float min_logit;             /* min-p drops tokens below it (-inf: no min-p) */
    uint32_t multiplier, offset; /* the row's noise key */
} SampleRow;

/* The race's bound on 16 lanes: token x (hash h) can beat the race's threshold t only where
   bits(f) < x * k1 + k0, f = (float)(~h >> 8) and bits(f) its float32 bits as a number.
   Why: x / T + g beats t, g = -log(-log u), only if -log u < exp(x / T - t), which needs
   1 - u < exp(x / T - t) (as -log u >= 1 - u), i.e. log2(1 - u) < (x / T - t) log2(e). And
   1 - u = (~h + 0.5) / 2**32 has log2(1 - u) >= log2(f) - 24 >= bits(f) / 2**23 - 151
   (f exact below 2**24; log2(1 + m) >= m on [0, 1]), within 0.09 of it where ~h >= 256. */
typedef struct {
    float k1, k0;
} RaceBound;

static RaceBound race_bound(float temperature, float threshold) {
    if (threshold == -INFINITY) return (RaceBound){0.0f, INFINITY};
    /* Slack in natural-log units for the float rounding of x / T, g, their sum and the
       bound's own arithmetic (relative to the scores' magnitude, which is |t| + 23 at most
       for a token that can win: g < 23 for every 32-bit u). */
    const double slack = 1e-3 + 1e-6 * (fabs((double)threshold) + 32.0);
    const double log2e = 1.4426950408889634, scale = 8388608.0; /* 2**23 */
    return (RaceBound){(float)(log2e * scale / temperature),
                       (float)((151.0 - ((double)threshold - slack) * log2e) * scale)};
}

/* Where the race's scan stands in a row. */
typedef struct {
    int64_t first;      /* the next block's first token */
    vpw weyl[PARTS];    /* token * multiplier + offset of that block's tokens */
    vp best[PARTS];     /* the largest logit per lane so far (NaN ignored) */
} RaceScan;

/* Scan blocks until one has a token the bound lets in (min-p's too): returns its lanes' bits,
   its first token and its noise hashes, the scan then standing past it (0 at the row's end).
   No calls in the loop, so its vectors stay in registers. */
static inline uint32_t scan_to_next_entrant(const SampleRow *row, RaceBound bound, RaceScan *scan,
                                            int64_t *block_first, uint32_t hash[LANES]) {
    const int64_t vocab = row->vocab;
    const uint32_t weyl_step = LANES * row->multiplier;
    const vp k1 = (vp){0} + bound.k1, k0 = (vp){0} + bound.k0;
    const vp min_logit = (vp){0} + row->min_logit;
    int64_t first = scan->first;
    vpw weyl[PARTS];
    vp best[PARTS];
    memcpy(weyl, scan->weyl, sizeof weyl);
    memcpy(best, scan->best, sizeof best);
    uint32_t bits = 0;
    for (; first < vocab; first += LANES) {
        __builtin_prefetch(row->logits + first + PREFETCH_FLOATS);
        vpw h[PARTS];
        for (int p = 0; p < PARTS; p++) {
            const vp x = load_part(row->logits, first + p * PART_LANES, vocab, -INFINITY);
            best[p] = part_max(x, best[p]);
            h[p] = mix(weyl[p]);
            weyl[p] += weyl_step;
            const vp f = __builtin_convertvector((vpi)((~h[p]) >> 8), vp);
            const vp f_bits = __builtin_convertvector((vpi)f, vp);
            bits |= (part_lanes_below(f_bits, x * k1 + k0) & ~part_lanes_below(x, min_logit))
                    << (p * PART_LANES);
        }
        if (bits) {
            *block_first = first;
            memcpy(hash, h, sizeof h);
            first += LANES;
            break;
        }
    }
    scan->first = first;
    memcpy(scan->weyl, weyl, sizeof weyl);
    memcpy(scan->best, best, sizeof best);
    return bits;
}

/* Whether `race_bound` lets token x with hash h in (scan_to_next_entrant's test, one lane). */
static inline int bound_lets_in(RaceBound bound, float x, uint32_t h) {
    const float f = (float)(int32_t)(~h >> 8);
    int32_t f_bits;
    memcpy(&f_bits, &f, sizeof f_bits);
    return (float)f_bits < x * bound.k1 + bound.k0;
}

/* The race, one pass over the row: the best c->capacity of x / T + Gumbel noise over the
   tokens min-p keeps, each token's noise a log of a log taken only where `race_bound` says it
   could still enter the best (tested again per token: the bound rises as tokens of the block
   enter). Returns the row's largest logit (NaN ignored). */
static float race(const SampleRow *row, Candidates *c) {
    RaceScan scan = {.first = 0};
    for (int h = 0; h < PARTS; h++) {
        const vpw token = (vpw)lane_index_part(h); /* the part's tokens in the first block */
        scan.weyl[h] = token * row->multiplier + row->offset;
        scan.best[h] = (vp){0} - INFINITY;
    }
    RaceBound bound = race_bound(row->temperature, -INFINITY);
    c->count = 0;
    int64_t first;
    uint32_t h[LANES];
    for (uint32_t bits; (bits = scan_to_next_entrant(row, bound, &scan, &first, h));) {
        for (; bits; bits &= bits - 1) {
            const int lane = __builtin_ctz(bits);
            const float x = row->logits[first + lane];
            if (!bound_lets_in(bound, x, h[lane])) continue;
            candidates_add(c, x / row->temperature + gumbel_of(h[lane]), first + lane);
            if (c->count == c->capacity) {
                bound = race_bound(row->temperature, c->score[c->capacity - 1]);
            }
        }
    }
    return parts_max(scan.best);
}

/* The largest logit x with x / T <= bound in float division (monotone in x), from x0 whose
   x0 / T is bound: token x <= it exactly when x / T <= bound, without dividing every token.
   NAN when T is so large that the search would be long. */
static float largest_logit_at_most(float x0, float temperature, float bound) {
    float x = x0;
    for (int steps = 0; steps < 4096; steps++) {
        const float next = nextafterf(x, INFINITY);
        if (!(next / temperature <= bound)) return x;
        x = next;
    }
    return NAN;
}

/* Whether top-p keeps token j (1, or 0; -1: T too large to tell here): the probability of
   the tokens no more likely than it (x / T <= x_j / T) exceeds floor = 1 - top_p (HF's rule:
   drop the ascending prefix whose cumulative probability is <= 1 - top_p, never the most
   likely token). Weights exp((x - max) / T), summed in float lanes, then in double. */
static int top_p_keeps(const SampleRow *row, float max_logit, int64_t j, float floor) {
    const float scaled = row->logits[j] / row->temperature;
    if (floor <= 0.0f || scaled == max_logit / row->temperature) return 1;
    const float limit = largest_logit_at_most(row->logits[j], row->temperature, scaled);
    if (limit != limit) return -1;
    const vp top = (vp){0} + max_logit, bound = (vp){0} + limit;
    const float log2e_over_t = 1.4426950408889634f / row->temperature;
    double mass = 0.0, total = 0.0;
    vp partial_mass[PARTS] = {0}, partial_total[PARTS] = {0};
    for (int64_t b = 0, first = 0; first < row->vocab; b++, first += LANES) {
        for (int p = 0; p < PARTS; p++) {
            const vp x = load_part(row->logits, first + p * PART_LANES, row->vocab, -INFINITY);
            const vp w = select_part(x > -INFINITY, exp2_part((x - top) * log2e_over_t),
                                     (vp){0});
            partial_total[p] += w;
            partial_mass[p] += select_part(x <= bound, w, (vp){0});
        }
        if ((b + 1) % SUM_BLOCKS == 0) {
            total += parts_sum(partial_total);
            mass += parts_sum(partial_mass);
            memset(partial_total, 0, sizeof partial_total);
            memset(partial_mass, 0, sizeof partial_mass);
        }
    }
    total += parts_sum(partial_total);
    mass += parts_sum(partial_mass);
    return (float)(mass / total) > floor;
}

/* One token per row: out[r] = argmax of (logits / T + Gumbel noise) over the tokens top-k
   (already -inf), top-p and min-p keep; -1 when none of the race's best candidates is in
   the top-p set, a logit is +inf or T is huge (the caller then races the row whole, in
   torch). keys [rows, 2]. One pass over a row races; another weighs it for top-p's test of
   the winner, unless that is the most likely token (min-p's threshold takes one more, first). */
void headrace_draw_tokens(const float *logits, int64_t num_rows, int64_t vocab, int64_t row_stride,
                          const float *temperature, const float *top_p_floor, const float *min_p,
                          const int64_t *keys, int64_t *out) {
#pragma omp parallel for schedule(dynamic, 4) if (num_rows > 1)
    for (int64_t r = 0; r < num_rows; r++) {
        SampleRow row = {logits + r * row_stride, vocab, temperature[r], -INFINITY,
                         (uint32_t)keys[2 * r], (uint32_t)keys[2 * r + 1]};
        if (min_p[r] > 0.0f) { /* p >= min_p * p_max: x >= max + T log(min_p) */
            row.min_logit = row_max(row.logits, vocab) + temperature[r] * logf(min_p[r]);
        }
        Candidates c = {.capacity = race_capacity(top_p_floor[r])};
        const float max_logit = race(&row, &c);
        out[r] = -1;
        if (max_logit == INFINITY) continue;
        if (max_logit == -INFINITY) { /* every token removed (bans): nothing to race */
            out[r] = 0;
            continue;
        }
        for (int k = 0; k < c.count; k++) {
            const int keeps = top_p_keeps(&row, max_logit, c.token[k], top_p_floor[r]);
            if (keeps) {
                out[r] = keeps > 0 ? c.token[k] : -1;
                break;
            }
        }
    }
}

/* ---- skinny linear ------------------------------------------------------------------------ */

/* A tile: this many rows of x against this many weight rows. With AVX-512, 24 accumulators
   plus the tile's 6 x vectors and a weight vector in 32 registers. With 16 registers of 8
   lanes, two rows against 3 weights: 12 accumulators (two parts each), 2 x parts and a weight
   part, 10 loads to 12 FMAs a step. Measured on the AVX2 Zen 3 (2026-11-29, SmolLM2-135M's
   120 layer matmuls, 2 threads, alternating processes, ms at 16 / 64 / 128 rows): 1 x 4 72 /
   247-253 / 480-483; 2 x 3 69 / 253-255 / 502-519; 3 x 2 74-100 / 279-290 / 520-539; 2 x 2
   78 / 284 / 652. There gcc loaded 2 x 3's weights again for each row (16 loads to 12
   FMAs); held in registers (2026-11-30, alternating in one process, 1 x 4 against 2 x 3):
   8 rows 41.9 / 35.1 ms, 24 rows 88.8 / 80.9 and 86.2 / 75.9, 64 rows 219.5 / 198.8. */
#if PARTS == 1
#define SKINNY_ROWS 6
#define SKINNY_COLS 4
#else
#define SKINNY_ROWS 2
#define SKINNY_COLS 3
#endif
_Static_assert(SKINNY_COLS <= 4, "a tile row's totals are taken 4 at a time (lane_totals)");

/* Keep a loaded vp in a register: gcc, short of registers in a tile, otherwise loads a
   value again as the memory operand of each FMA that uses it. An empty asm that takes and
   gives the value in a vector register ("+v"); only where one register holds a vp (AVX,
   AVX-512): elsewhere (SSE only, Arm's 16-byte registers) the constraint cannot be met.
   ROUNDED(v): a value the compiler must take as it is, so that an operation on it is not fused
   with the one that made it (a product rounded before a sum): the same empty asm, else
   (no register holds a vp) the value passed through memory. The store and load cost 4-bit
   weights a third of their time (SmolLM2's 120 layer matmuls on the AVX2 Zen 3, 2026-11-30,
   alternating builds: 1 row 32.7 -> 22.1 ms, 24 rows 414 -> 249). */
#if defined(__AVX__)
#define HOLD_IN_REGISTER(v) __asm__("" : "+v"(v))
#define ROUNDED(v) HOLD_IN_REGISTER(v)
#else
#define HOLD_IN_REGISTER(v) ((void)0)
#define ROUNDED(v) __asm__ volatile("" : "+m"(v))
#endif

/* The weight layouts a tile is compiled for: the dtype codes, and BF16_PAIRS, bf16 weights
   against bf16 x where the CPU has AVX512-BF16: each step takes 32 elements, and lane i adds
   the products of elements 2i and 2i + 1 (exact: a bf16 product fits a float32) to its sum,
   one instruction for what float32 does in two loads, two widenings and two FMAs. */
#define BF16_PAIRS 3
/* Quantized weights (kernels/quantized.py): int8 in groups along K (Q8), or 4-bit nibble
   blocks with a scale and an offset per group (Q4), formed as float32 in registers exactly
   as `dequantize` forms them, then multiplied as float32 weights are. */
#define Q8 4
#define Q4 5

/* Elements of x and w per step of a tile's loop. */
static inline int step_of(int layout) { return layout == BF16_PAIRS ? 2 * LANES : LANES; }

/* One call's operands: x [M, K] (float32, or bf16 for BF16_PAIRS; rows strided), w [N, K]
   contiguous in w_dtype (quantized: its integers, with scales and offsets [N, K / group_size]
   float32, offsets NULL for Q8), bias [N] float32 or NULL, y [M, N] in y_dtype (rows
   strided; groups of a power of two, or one per row); how many whole 6-row blocks of x there are, and how many rows of the next tile's
   weights each of them prefetches. */
typedef struct {
    const void *x;
    int64_t x_stride, M;
    const void *w;
    int64_t N, K;
    const float *scales, *offsets;
    int group_shift; /* log2 of the group size, or -1: one group per row */
    const float *bias;
    void *y;
    int64_t y_stride;
    int y_dtype;
    int64_t full_blocks, share;
} Skinny;

/* Where weight (n, k) is stored: its element, its byte (Q8), or for Q4 the first byte of its
   32-element nibble block (k a multiple of 16). */
static inline const void *weight_address(const Skinny *s, int64_t n, int64_t k, int layout) {
    if (layout == Q8) return (const int8_t *)s->w + n * s->K + k;
    if (layout == Q4) return (const uint8_t *)s->w + (n * s->K + (k & ~(int64_t)31)) / 2;
    return element(s->w, n * s->K + k, layout == BF16_PAIRS ? BF16 : layout);
}

/* Weights (n, [k + h * PART_LANES, ...)) of a quantized row, part h of the step at k (a
   multiple of 16): q * scale (+ offset), each operation rounded on its own (the _round_ forms
   are never fused into one). */
static inline __attribute__((always_inline)) vp dequantize_part(const Skinny *s, int64_t n,
                                                                int64_t k, int h, int layout) {
    const int shift = s->group_shift; /* (a division per step cost more than the arithmetic) */
    const int64_t group = shift < 0 ? n : n * (s->K >> shift) + (k >> shift);
    /* Q8: the step's bytes; Q4: its 32-block's, low nibbles for k % 32 < 16, else high */
    const uint8_t *address = (const uint8_t *)weight_address(s, n, k, layout) + h * PART_LANES;
#ifdef __AVX512F__
    const __m128i bytes = _mm_loadu_si128((const __m128i *)address);
    __m512i q;
    if (layout == Q8) {
        q = _mm512_cvtepi8_epi32(bytes);
    } else {
        q = _mm512_cvtepu8_epi32(bytes);
        q = (k & 16) ? _mm512_srli_epi32(q, 4) : _mm512_and_si512(q, _mm512_set1_epi32(15));
    }
    const int round = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    __m512 w = _mm512_mul_round_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s->scales[group]), round);
    if (layout == Q4) w = _mm512_add_round_ps(w, _mm512_set1_ps(s->offsets[group]), round);
    return (vp)w;
#else
#if defined(__AVX2__) && PART_LANES == 8
    /* 8 bytes widened in one instruction (gcc's generic form gathered them byte by byte) */
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)address);
    vpi q = (vpi)(layout == Q8 ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
#else
    typedef int8_t vpb __attribute__((vector_size(PART_LANES), aligned(1)));
    typedef uint8_t vpub __attribute__((vector_size(PART_LANES), aligned(1)));
    vpi q = layout == Q8 ? __builtin_convertvector(*(const vpb *)address, vpi)
                         : __builtin_convertvector(*(const vpub *)address, vpi);
#endif
    if (layout == Q4) q = (k & 16) ? q >> 4 : q & 15;
    vp w = __builtin_convertvector(q, vp) * ((vp){0} + s->scales[group]);
    if (layout == Q4) {
        ROUNDED(w); /* the product rounded before the sum: no fused op */
        w = w + ((vp){0} + s->offsets[group]);
    }
    return w;
#endif
}


/* Part h of a step's weight vector: weights (n, [k, k + step)) (BF16_PAIRS, where PARTS is 1:
   the 32 bf16 as they are). */
static inline __attribute__((always_inline)) vp load_step(const Skinny *s, int64_t n, int64_t k,
                                                          int h, int layout) {
    if (layout == BF16_PAIRS) return *(const vpu *)weight_address(s, n, k, layout);
    if (layout == Q8 || layout == Q4) return dequantize_part(s, n, k, h, layout);
    return load_weights(s->w, n * s->K + k + h * PART_LANES, layout);
}

/* Part h of the first width (< step) of those weights, the other lanes zero. Never
   quantized: their rows are whole groups of 32 (kernels/quantized.py), so every step is whole. */
static inline vp load_step_partial(const Skinny *s, int64_t n, int64_t k, int64_t width, int h,
                                   int layout) {
    float lanes[LANES] = {0};
    const void *address = weight_address(s, n, k, layout);
    if (layout == BF16_PAIRS) memcpy(lanes, address, (size_t)width * 2);
    else if (layout < BF16_PAIRS) load_row(address, layout, lanes, (int)width);
    return *(const vpu *)(lanes + h * PART_LANES);
}

/* The same for x, whose rows are float32 (bf16 for BF16_PAIRS). */
static inline __attribute__((always_inline)) vp load_x(const void *x, int64_t i, int h, int layout) {
    return *(const vpu *)element(x, i + h * PART_LANES, layout == BF16_PAIRS ? BF16 : F32);
}

static inline vp load_x_partial(const void *x, int64_t i, int64_t width, int h, int layout) {
    float lanes[LANES] = {0};
    const int dtype = layout == BF16_PAIRS ? BF16 : F32;
    memcpy(lanes, element(x, i, dtype), (size_t)width * dtype_size(dtype));
    return *(const vpu *)(lanes + h * PART_LANES);
}

/* acc + the step's products: lane by lane, or (BF16_PAIRS) each lane's pair. */
static inline __attribute__((always_inline)) vp multiply_add(vp acc, vp x, vp w, int layout) {
#if HAVE_BF16_PAIRS
    if (layout == BF16_PAIRS) return (vp)_mm512_dpbf16_ps((__m512)acc, (__m512bh)x, (__m512bh)w);
#endif
    return acc + x * w;
}

/* The sum of an accumulator's 16 lanes (its parts) in the order `store_totals` adds them:
   lanes i and i + 8, then neighbours, then pairs of pairs, then the two halves. */
static inline float lane_total(const vp a[PARTS]) {
    float t[8];
#if PARTS == 1
    for (int i = 0; i < 8; i++) t[i] = a[0][i] + a[0][i + 8];
#else
    for (int i = 0; i < 8; i++) t[i] = a[0][i] + a[1][i];
#endif
    return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}

/* lane_total of n <= 4 accumulators at once, into sums[0..n): with vector registers, the
   accumulators' halves (AVX-512) or parts (AVX2) added lane by lane, then the pairs of each
   in two horizontal adds and the last pair across the register's halves: lane_total's sums
   in its order (fewer than 4 repeat the last). A tile's totals took a fifth of its time at
   24 rows in lane_total's scalar adds on AVX2 (SmolLM2-135M's 120 layer matmuls, Zen 3,
   2026-11-30, alternating builds: 80.6 -> 79.4, 75.3 -> 70.8, 77.4 -> 73.2 ms). */
static inline __attribute__((always_inline)) void lane_totals(const vp acc[][PARTS], int n,
                                                              float sums[4]) {
#if defined(__AVX__) && (PARTS == 2 || defined(__AVX512F__))
    __m256 t[4];
    for (int i = 0; i < 4; i++) {
        const vp *a = acc[i < n ? i : n - 1];
#if PARTS == 1
        t[i] = _mm256_add_ps(_mm512_castps512_ps256((__m512)a[0]), _mm512_extractf32x8_ps((__m512)a[0], 1));
#else
        t[i] = _mm256_add_ps((__m256)a[0], (__m256)a[1]);
#endif
    }
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(t[0], t[1]), _mm256_hadd_ps(t[2], t[3]));
    _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)));
#else
    for (int i = 0; i < n; i++) sums[i] = lane_total(acc[i]);
#endif
}

/* Store n float32 sums as outputs [m, n0, n0 + n) of y, rounded once to y's dtype. */
static inline void store_outputs(const Skinny *s, int64_t m, int64_t n0, const float *sums, int n) {
    store_row((char *)s->y + (m * s->y_stride + n0) * (int64_t)dtype_size(s->y_dtype), s->y_dtype,
              sums, n);
}

/* Prefetch weight rows [next, next + rows) at column k (for bf16 / float16 every other
   line twice: prefetching each line once measured no faster). */
static inline __attribute__((always_inline)) void prefetch_weights(const Skinny *s, int64_t next,
                                                                   int rows, int64_t k, int layout) {
    for (int c = 0; c < rows; c++) prefetch_stream(weight_address(s, next + c, k, layout));
}

/* A whole tile: rows [m0, m0 + SKINNY_ROWS) of x against weight rows [n0, n0 + SKINNY_COLS),
   into y (+ bias). While it computes, it prefetches prefetch_rows rows of the weights that
   come next (from weight row `next`): the weights stream from memory once, so their reads
   must overlap the arithmetic. */
static inline __attribute__((always_inline)) void skinny_full_tile(
    const Skinny *s, int64_t m0, int64_t n0, int64_t next, int prefetch_rows, int layout) {
    const int64_t K = s->K;
    vp acc[SKINNY_ROWS][SKINNY_COLS][PARTS];
    for (int m = 0; m < SKINNY_ROWS; m++)
        for (int c = 0; c < SKINNY_COLS; c++)
            for (int h = 0; h < PARTS; h++) acc[m][c][h] = (vp){0};
    for (int64_t k = 0; k < K; k += step_of(layout)) { /* K % step == 0 (full_blocks' test) */
        prefetch_weights(s, next, prefetch_rows, k, layout);
        for (int h = 0; h < PARTS; h++) { /* a part at a time: the tile's registers hold it */
            /* x's rows, then each weight once, every load held in a register */
            vp xv[SKINNY_ROWS];
            for (int m = 0; m < SKINNY_ROWS; m++) {
                xv[m] = load_x(s->x, (m0 + m) * s->x_stride + k, h, layout);
                HOLD_IN_REGISTER(xv[m]);
            }
            for (int c = 0; c < SKINNY_COLS; c++) {
                vp wv = load_step(s, n0 + c, k, h, layout);
                HOLD_IN_REGISTER(wv);
                for (int m = 0; m < SKINNY_ROWS; m++)
                    acc[m][c][h] = multiply_add(acc[m][c][h], xv[m], wv, layout);
            }
        }
    }
    const float *bias = s->bias != NULL ? s->bias + n0 : NULL;
    for (int m = 0; m < SKINNY_ROWS; m++) {
        float sums[4];
        lane_totals(acc[m], SKINNY_COLS, sums);
        for (int c = 0; c < SKINNY_COLS; c++) sums[c] += bias != NULL ? bias[c] : 0.0f;
        store_outputs(s, m0 + m, n0, sums, SKINNY_COLS);
    }
}

/* One step of an edge tile: acc[m][c] += x_m[k, k + width) w_c[k, k + width) (width <= the
   step; missing lanes, rows and columns add zeros), prefetching as the whole tile. */
static inline __attribute__((always_inline)) void skinny_edge_step(
    const Skinny *s, int64_t m0, int rows, int64_t n0, int cols, int64_t k, int64_t width,
    int64_t next, int prefetch_rows, int layout, vp acc[SKINNY_ROWS][SKINNY_COLS][PARTS]) {
    const int whole = width == step_of(layout);
    prefetch_weights(s, next, prefetch_rows, k, layout);
    for (int h = 0; h < PARTS; h++) {
        vp wv[SKINNY_COLS];
        for (int c = 0; c < SKINNY_COLS; c++) {
            wv[c] = c >= cols ? (vp){0}
                    : whole   ? load_step(s, n0 + c, k, h, layout)
                              : load_step_partial(s, n0 + c, k, width, h, layout);
        }
        for (int m = 0; m < rows; m++) {
            const int64_t i = (m0 + m) * s->x_stride + k;
            const vp xv = whole ? load_x(s->x, i, h, layout) : load_x_partial(s->x, i, width, h, layout);
            for (int c = 0; c < SKINNY_COLS; c++)
                acc[m][c][h] = multiply_add(acc[m][c][h], xv, wv[c], layout);
        }
    }
}

/* Any tile at the edges (rows <= SKINNY_ROWS, cols <= SKINNY_COLS, any K): each output the same sum, in the same
   order, as a whole tile gives it. */
static inline __attribute__((always_inline)) void skinny_edge_tile(
    const Skinny *s, int64_t m0, int rows, int64_t n0, int cols, int64_t next, int prefetch_rows,
    int layout) {
    const int64_t K = s->K, step = step_of(layout);
    vp acc[SKINNY_ROWS][SKINNY_COLS][PARTS];
    for (int m = 0; m < SKINNY_ROWS; m++)
        for (int c = 0; c < SKINNY_COLS; c++)
            for (int h = 0; h < PARTS; h++) acc[m][c][h] = (vp){0};
    int64_t k = 0;
    for (; k + step <= K; k += step)
        skinny_edge_step(s, m0, rows, n0, cols, k, step, next, prefetch_rows, layout, acc);
    if (k < K) skinny_edge_step(s, m0, rows, n0, cols, k, K - k, next, prefetch_rows, layout, acc);
    for (int m = 0; m < rows; m++) {
        float sums[4]; /* all of them (constant indices keep acc in registers) */
        lane_totals(acc[m], SKINNY_COLS, sums);
        for (int c = 0; c < cols; c++) sums[c] += s->bias != NULL ? s->bias[n0 + c] : 0.0f;
        store_outputs(s, m0 + m, n0, sums, cols);
    }
}

/* skinny_edge_tile with its row count a constant: the compiler then unrolls the rows and
   keeps their accumulators in registers (a decode step of 1 to 5 rows is all edge tiles). */
static inline __attribute__((always_inline)) void skinny_edge_rows(
    const Skinny *s, int64_t m0, int rows, int64_t n0, int cols, int64_t next, int prefetch_rows,
    int layout) {
    switch (rows) {
    case 1: skinny_edge_tile(s, m0, 1, n0, cols, next, prefetch_rows, layout); break;
#if SKINNY_ROWS > 2
    case 2: skinny_edge_tile(s, m0, 2, n0, cols, next, prefetch_rows, layout); break;
#endif
#if SKINNY_ROWS > 3
    case 3: skinny_edge_tile(s, m0, 3, n0, cols, next, prefetch_rows, layout); break;
#endif
#if SKINNY_ROWS > 4
    case 4: skinny_edge_tile(s, m0, 4, n0, cols, next, prefetch_rows, layout); break;
#endif
#if SKINNY_ROWS > 5
    case 5: skinny_edge_tile(s, m0, 5, n0, cols, next, prefetch_rows, layout); break;
#endif
    default: skinny_edge_tile(s, m0, SKINNY_ROWS, n0, cols, next, prefetch_rows, layout);
    }
}

/* Weight tile t (weight rows [t c, t c + c), c = SKINNY_COLS) against every row of x: whole
   blocks of SKINNY_ROWS rows, then the rows left at the edge. Each whole block prefetches its
   share of the next tile's rows. */
static inline __attribute__((always_inline)) void skinny_tile(const Skinny *s, int64_t t, int layout) {
    const int64_t N = s->N, M = s->M, n0 = t * SKINNY_COLS;
    const int cols = N - n0 < SKINNY_COLS ? (int)(N - n0) : SKINNY_COLS;
    /* the weight rows of the next tile, which this tile's blocks prefetch (<= 0: none) */
    const int64_t next = n0 + cols;
    const int64_t next_rows = N - next < SKINNY_COLS ? N - next : SKINNY_COLS;
    int64_t m0 = 0;
    if (cols == SKINNY_COLS) {
        for (int64_t b = 0; b < s->full_blocks; b++, m0 += SKINNY_ROWS) {
            const int64_t first = b * s->share;
            const int64_t rows = first >= next_rows             ? 0
                                 : first + s->share > next_rows ? next_rows - first
                                                                : s->share;
            skinny_full_tile(s, m0, n0, next + first, (int)rows, layout);
        }
    }
    for (; m0 < M; m0 += SKINNY_ROWS) {
        const int rows = M - m0 < SKINNY_ROWS ? (int)(M - m0) : SKINNY_ROWS;
        /* with no whole block, the first edge block prefetches the next tile alone */
        const int prefetch_rows = s->full_blocks == 0 && m0 == 0 ? (int)next_rows : 0;
        skinny_edge_rows(s, m0, rows, n0, cols, next, prefetch_rows, layout);
    }
}

/* Rows of x up to which the kernel streams the weights one row at a time (`skinny_row`)
   instead of in tiles of 4 rows. One stream per thread reads at the memory's rate, where four
   interleaved row streams did not: SmolLM2-135M's 121 matmuls at one row, 2 cores, float32
   16.6 ms (32 GB/s) against 21.1 ms tiled; bf16 7.2 against 12.1 ms. From 3 rows on the
   tile's reuse of each x vector across 4 weight rows wins (float32 3 rows: 23.7 vs 21.7 ms). */
#define ROW_STREAM_ROWS 2

/* How far ahead of its loads a row stream prefetches its weights, in bytes. A thread's rows
   are one contiguous run, but the hardware prefetcher alone kept a decode step's matmuls at
   about 23 GB/s, where a 100 MB matrix streams at 40: each of a step's 121 matrices is only
   0.3-1.8 MB a thread (and a hardware prefetcher does not run past a 4 KB page, these
   machines' page size). A software prefetch 16 KB ahead (a few rows of any of SmolLM2's
   matrices) raised them to about 30 GB/s (2-core Xeon with AMX, 2026-11-25: bf16 one-row
   step 13.4-13.9 -> 10.7-11.4 ms; float32 24.8-25.6 -> 22.2-22.3; 8 and 32 KB measured no
   better). On the Zen 4 (2026-11-28), with the weights in huge pages, the stream ran faster
   with no software prefetch than with one into L2 (float32, 121 matmuls, alternating runs:
   one row 15.4-15.7 against 17.2-17.4 ms, two rows 15.9-16.1 against 17.0-17.1; bf16 one
   row 6.5 against 7.3, 8.8 against 8.9 in a slow process), and with 4 KiB pages no slower
   (17.3-17.7 against 18.7-18.8): where prefetches go into L2 (prefetch_to_l1 false), a row
   stream leaves its loads to the hardware prefetcher. */
#define ROW_PREFETCH_BYTES 16384

/* How many weight rows a thread reads at once at one row of x (half as many at two): its run
   of rows split into this many equal parts, one row of each at a time. On the AVX2 Zen 3
   (2026-11-30, weights in huge pages, 2 threads, alternating builds in one process) one
   stream per thread read at 14.7-15.7 GB/s where the memory gives torch's sum 19-21: a
   core's single stream keeps too few lines in flight. Four streams: SmolLM2-135M's 120 layer
   matmuls at one row 28.6-28.9 -> 22.3-23.3 ms, its LM head 7.2-7.7 -> 5.4-6.2 ms; two or
   three streams were between. Where the streams prefetch into L1 (`prefetch_to_l1`: Intel)
   a thread keeps one, measured at the memory's rate on the Xeon with AMX (not measured with
   more); the Zen 4 takes four unmeasured. */
#define ROW_STREAMS 4
_Static_assert(ROW_STREAMS <= 4, "a row's stream totals are taken 4 at a time (lane_totals)");

/* Weight rows n[0..streams) against rows [0, M) of x (M <= ROW_STREAM_ROWS), each read once,
   in order, the streams in step. Each output is summed exactly as skinny_edge_tile sums it. */
static inline __attribute__((always_inline)) void skinny_rows(const Skinny *s, const int64_t *n,
                                                              int streams, int rows, int layout) {
    const int64_t K = s->K, step = step_of(layout);
    vp acc[ROW_STREAM_ROWS][ROW_STREAMS][PARTS]; /* a row's streams together (lane_totals) */
    const char *end = (const char *)weight_address(s, s->N, 0, layout); /* the matrix's end */
    for (int r = 0; r < streams; r++)
        for (int m = 0; m < rows; m++)
            for (int h = 0; h < PARTS; h++) acc[m][r][h] = (vp){0};
    int64_t k = 0;
    for (; k + step <= K; k += step) {
        for (int r = 0; r < streams; r++) {
            const char *ahead = (const char *)weight_address(s, n[r], k, layout) + ROW_PREFETCH_BYTES;
            if (prefetch_to_l1 && ahead < end) __builtin_prefetch(ahead, 0, 3);
        }
        for (int h = 0; h < PARTS; h++) {
            vp xv[ROW_STREAM_ROWS];
            for (int m = 0; m < rows; m++) xv[m] = load_x(s->x, m * s->x_stride + k, h, layout);
            for (int r = 0; r < streams; r++) {
                const vp wv = load_step(s, n[r], k, h, layout);
                for (int m = 0; m < rows; m++) acc[m][r][h] = multiply_add(acc[m][r][h], xv[m], wv, layout);
            }
        }
    }
    for (int h = 0; h < PARTS && k < K; h++) {
        vp xv[ROW_STREAM_ROWS];
        for (int m = 0; m < rows; m++) xv[m] = load_x_partial(s->x, m * s->x_stride + k, K - k, h, layout);
        for (int r = 0; r < streams; r++) {
            const vp wv = load_step_partial(s, n[r], k, K - k, h, layout);
            for (int m = 0; m < rows; m++) acc[m][r][h] = multiply_add(acc[m][r][h], xv[m], wv, layout);
        }
    }
    for (int m = 0; m < rows; m++) {
        float sums[4];
        lane_totals(acc[m], streams, sums);
        for (int r = 0; r < streams; r++) {
            const float sum = sums[r] + (s->bias != NULL ? s->bias[n[r]] : 0.0f);
            store_outputs(s, m, n[r], &sum, 1);
        }
    }
}

/* How many row streams a thread reads at once at M rows of x (<= ROW_STREAM_ROWS): the
   accumulators of ROW_STREAMS rows at one row; one where the stream prefetches into L1. */
static inline int row_stream_count(int64_t M) {
    return prefetch_to_l1 ? 1 : M == 1 ? ROW_STREAMS : ROW_STREAMS / ROW_STREAM_ROWS;
}

/* Row group g of a thread's row streams: rows g, g + part, g + 2 part, ... below N, where
   part = ceil(N / streams) (so consecutive groups walk each part in order). Fewer than
   `streams` rows lie past N (streams * part - N), so few groups miss one: those read each row
   they have alone. */
static inline __attribute__((always_inline)) void skinny_row_group(const Skinny *s, int64_t g,
                                                                   int streams, int rows,
                                                                   int layout) {
    const int64_t part = (s->N + streams - 1) / streams;
    int64_t n[ROW_STREAMS];
    int have = 0;
    for (int r = 0; r < streams; r++)
        if (g + r * part < s->N) n[have++] = g + r * part;
    if (have == streams) skinny_rows(s, n, streams, rows, layout);
    else
        for (int r = 0; r < have; r++) skinny_rows(s, n + r, 1, rows, layout);
}

/* skinny_tile and skinny_row with the layout fixed, one per layout (indexed by its code);
   the row streams with their row count a constant too. */
#define SKINNY_WORK(layout, tile_name, row_name)                                                  \
    static void tile_name(const Skinny *s, int64_t t) { skinny_tile(s, t, layout); }              \
    static void row_name(const Skinny *s, int64_t g) {                                            \
        const int streams = row_stream_count(s->M);                                               \
        if (streams == 1 && s->M == 1) skinny_row_group(s, g, 1, 1, layout);                      \
        else if (streams == 1) skinny_row_group(s, g, 1, ROW_STREAM_ROWS, layout);                \
        else if (s->M == 1) skinny_row_group(s, g, ROW_STREAMS, 1, layout);                       \
        else skinny_row_group(s, g, ROW_STREAMS / ROW_STREAM_ROWS, ROW_STREAM_ROWS, layout);      \
    }
SKINNY_WORK(F32, skinny_tile_f32, skinny_row_f32)
SKINNY_WORK(BF16, skinny_tile_bf16, skinny_row_bf16)
SKINNY_WORK(F16, skinny_tile_f16, skinny_row_f16)
SKINNY_WORK(BF16_PAIRS, skinny_tile_pairs, skinny_row_pairs)
SKINNY_WORK(Q8, skinny_tile_q8, skinny_row_q8)
SKINNY_WORK(Q4, skinny_tile_q4, skinny_row_q4)
static void (*const SKINNY_TILE[])(const Skinny *, int64_t) = {
    [F32] = skinny_tile_f32, [BF16] = skinny_tile_bf16,   [F16] = skinny_tile_f16,
    [BF16_PAIRS] = skinny_tile_pairs, [Q8] = skinny_tile_q8, [Q4] = skinny_tile_q4};
static void (*const SKINNY_ROW[])(const Skinny *, int64_t) = {
    [F32] = skinny_row_f32, [BF16] = skinny_row_bf16,   [F16] = skinny_row_f16,
    [BF16_PAIRS] = skinny_row_pairs, [Q8] = skinny_row_q8, [Q4] = skinny_row_q4};

/* y = x w^T (+ bias) for the operands s holds (x still in x_dtype) in the weights' layout:
   x widened into wide_x first unless the layout reads it as it is. */
static void skinny_run(Skinny s, int x_dtype, int layout, float *wide_x) {
    const int64_t M = s.M, N = s.N, K = s.K;
    if (layout != BF16_PAIRS && x_dtype != F32) {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            load_row(element(s.x, m * s.x_stride, x_dtype), x_dtype, wide_x + m * K, (int)K);
        s.x = wide_x;
        s.x_stride = K;
    }
    s.full_blocks = K % step_of(layout) == 0 ? M / SKINNY_ROWS : 0;
    /* Each whole block of rows prefetches its share of the next tile's weight rows. */
    s.share = s.full_blocks >= SKINNY_COLS ? 1
              : s.full_blocks > 0          ? (SKINNY_COLS + s.full_blocks - 1) / s.full_blocks
                                           : 0;
    /* a group of row streams (skinny_row_group), or a tile per SKINNY_COLS weight rows
       (static: each thread one contiguous run of groups or tiles) */
    const int in_streams = M > 0 && M <= ROW_STREAM_ROWS;
    void (*const work)(const Skinny *, int64_t) = in_streams ? SKINNY_ROW[layout] : SKINNY_TILE[layout];
    const int per_item = in_streams ? row_stream_count(M) : SKINNY_COLS; /* weight rows */
    const int64_t items = (N + per_item - 1) / per_item;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < items; i++) work(&s, i);
}

/* The layout hr_skinny_linear multiplies x_dtype x by w_dtype weights in. */
static inline int skinny_layout(int x_dtype, int w_dtype) {
    return HAVE_BF16_PAIRS && x_dtype == BF16 && w_dtype == BF16 ? BF16_PAIRS : w_dtype;
}

/* Whether hr_skinny_linear multiplies by the panels (which read x as it is). */
static inline int takes_panels(int x_dtype, int w_dtype, const void *panels) {
    return skinny_layout(x_dtype, w_dtype) == BF16_PAIRS && panels != NULL;
}

/* y [M, N] = x [M, K] w [N, K]^T (+ bias [N]) in float32 for the few rows of a decode step:
   each weight is read from memory once (float32, or bf16 / float16 widened in registers);
   its tile of a few rows meets every row of x from cache. Every output is lane sums over k mod
   16 (bf16 x and weights with AVX512-BF16: lane sums of pairs over k mod 32), then one fixed
   reduction: a row's result does not depend on the batch's other rows. Otherwise x
   (x_dtype) is widened to float32 once up front unless it is float32, and the sums do not
   depend on the dtypes the same values are stored in. Each output is rounded once to
   y_dtype as it is stored. Rows of x and y may be strided; w is contiguous. wide_x: room for
   M * K floats where x is widened (else unused). Called by every thread of a region.
   panels: NULL, or w packed into panels (headrace_pack_panels), which bf16 x against bf16
   weights then multiplies instead where the pair instruction runs (panel_linear.c: each
   output summed over its pairs in order, whatever the batch's rows; never made where AMX
   tiles are granted). */
void hr_skinny_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M, const void *w,
                      const void *panels, int w_dtype, int64_t N, int64_t K, const float *bias,
                      void *y, int64_t y_stride, int y_dtype, float *wide_x) {
    if (takes_panels(x_dtype, w_dtype, panels)) {
        hr_panel_linear(x, x_stride, M, panels, N, K, bias, y, y_stride, y_dtype);
        return;
    }
    const int layout = skinny_layout(x_dtype, w_dtype);
    if (layout == BF16_PAIRS && M > ROW_STREAM_ROWS && hr_amx_takes(M, N, K)) {
        hr_amx_linear(x, x_stride, M, w, N, K, bias, y, y_stride, y_dtype, wide_x);
        return;
    }
    const Skinny s = {.x = x, .x_stride = x_stride, .M = M, .w = w, .N = N, .K = K, .bias = bias,
                      .y = y, .y_stride = y_stride, .y_dtype = y_dtype};
    skinny_run(s, x_dtype, layout, wide_x);
}

/* Whether bf16 x against bf16 weights takes the pair path (BF16_PAIRS). */
int headrace_skinny_bf16_pairs(void) { return HAVE_BF16_PAIRS; }

/* Lanes of the matmul's registers: 16 (AVX-512's tiles of 6 rows x 4 weights) or 8. */
int headrace_skinny_part_lanes(void) { return PART_LANES; }

/* Room for x widened to float32 (NULL when x is float32 or empty: malloc(0) may return NULL);
   *failed set when it could not be allocated. */
static float *alloc_wide_x(int x_dtype, int64_t M, int64_t K, int *failed) {
    float *wide_x = x_dtype != F32 && M * K > 0 ? malloc((size_t)hr_skinny_floats(M, K) * sizeof(float)) : NULL;
    *failed = x_dtype != F32 && M * K > 0 && wide_x == NULL;
    return wide_x;
}

/* hr_skinny_linear in a region of its own. Returns 0, or -1 when the widened x could not be
   allocated. */
int headrace_skinny_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M, const void *w,
                           const void *panels, int w_dtype, int64_t N, int64_t K,
                           const float *bias, void *y, int64_t y_stride, int y_dtype) {
    int failed = 0;
    const int in_panels = takes_panels(x_dtype, w_dtype, panels); /* x read as it is */
    float *wide_x = in_panels ? NULL : alloc_wide_x(x_dtype, M, K, &failed);
    if (failed) return -1;
#pragma omp parallel if (N * K >= (1 << 15))
    hr_skinny_linear(x, x_stride, x_dtype, M, w, panels, w_dtype, N, K, bias, y, y_stride, y_dtype,
                     wide_x);
    free(wide_x);
    return 0;
}

/* log2 of a group size (a power of two), or -1 for one group per row of K. */
static int group_shift(int64_t group_size, int64_t K) {
    return group_size == K ? -1 : __builtin_ctzll((unsigned long long)group_size);
}

/* The same over quantized weights (bits 8 or 4: kernels/quantized.py's layout, K a multiple
   of 32, groups of a power of two or one per row): every output the float kernel's over the
   dequantized weights. */
void hr_quantized_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M, const void *w,
                         int bits, int64_t N, int64_t K, int64_t group_size, const float *scales,
                         const float *offsets, const float *bias, void *y, int64_t y_stride,
                         int y_dtype, float *wide_x) {
    const Skinny s = {.x = x, .x_stride = x_stride, .M = M, .w = w, .N = N, .K = K,
                      .scales = scales, .offsets = offsets,
                      .group_shift = group_shift(group_size, K), .bias = bias, .y = y,
                      .y_stride = y_stride, .y_dtype = y_dtype};
    skinny_run(s, x_dtype, bits == 8 ? Q8 : Q4, wide_x);
}

int headrace_quantized_linear(const void *x, int64_t x_stride, int x_dtype, int64_t M,
                              const void *w, int bits, int64_t N, int64_t K, int64_t group_size,
                              const float *scales, const float *offsets, const float *bias,
                              void *y, int64_t y_stride, int y_dtype) {
    int failed;
    float *wide_x = alloc_wide_x(x_dtype, M, K, &failed);
    if (failed) return -1;
#pragma omp parallel if (N * K >= (1 << 15))
    hr_quantized_linear(x, x_stride, x_dtype, M, w, bits, N, K, group_size, scales, offsets, bias,
                        y, y_stride, y_dtype, wide_x);
    free(wide_x);
    return 0;
}

/* ---- Quantized weights against int8 activations ------------------------------------------- */

/* kernels/quantized.py's ``int8_activations``: each row of x quantized per block of 32 to int8
   (sx = max|x| / 127, xq = round-half-even(x / sx): one float32 operation each), then every
   block's integer dot product with the weight's integers taken exactly, in int32, by the
   VNNI instruction that multiplies 64 unsigned bytes by 64 signed ones and sums each four
   (four blocks' 16-element halves per instruction, where the float kernel forms and
   multiplies 16 weights at a time). 4-bit weights are unsigned nibbles already; 8-bit ones
   are signed, so they go in as w + 128 and each lane's accumulator starts at
   -128 * (the sum of its four xq), which the instruction's sum cancels exactly. Each block's
   sum is scaled by scale * sx (rounded once) into float32 lanes; 4-bit weights' offsets add
   sum_g offset_g * S_g, S_g the group's sum_b sx_b * sum(xq_b). Every output of a row is
   computed the same way whatever the other rows, so a row's result does not depend on the
   batch. At one row of x the weight rows go 16 at a time and their 16 lane reductions share
   one tree of shuffles (each row's sum still in _mm512_reduce_add_ps's order): reducing row
   by row had cost as much as the dot products.

   Layouts, per pair of blocks (b0 = 2p, b1 = 2p + 1; a missing b1 is zeros): xq 64 bytes
   [b0 elements 0-15 | b1 0-15 | b0 16-31 | b1 16-31], which is how the 32 nibble bytes of
   the two blocks unpack (low nibbles, then high ones) and how 8-bit weights' 64 bytes are
   reordered by quarters; sxv 16 floats, sx of the block each lane of the dot product sums
   (lanes 0-3 and 8-11: b0; 4-7 and 12-15: b1); bias 16 int32, -128 * each lane's four xq. */

/* Blocks of 32 in a row of K, and pairs of them. */
static inline int64_t a8_pairs(int64_t K) { return (K / 32 + 1) / 2; }

/* Scratch floats per row of x: xq (64 bytes a pair), sxv (16 floats a pair), the lanes'
   bias (16 int32 a pair), S (a float a group, at most one a block). */
static inline int64_t a8_row_floats(int64_t K) { return hr_a8_floats(1, K); }

/* Where row m's parts lie in its scratch (a8_row_floats). */
typedef struct {
    int8_t *xq;
    float *sxv;
    int32_t *bias;
    float *S;
} A8Row;

static inline A8Row a8_row(const float *prepared, int64_t K) {
    const int64_t P = a8_pairs(K);
    float *base = (float *)prepared;
    return (A8Row){.xq = (int8_t *)base, .sxv = base + P * 16, .bias = (int32_t *)(base + P * 32),
                   .S = base + P * 48};
}

/* The shift from a block's index to its group's: groups of 2^shift blocks, or one group a
   row (A8_WHOLE_ROW: a shift past any block index). */
#define A8_WHOLE_ROW 62
static inline int a8_shift(int64_t group_size, int64_t K) {
    return group_size == K ? A8_WHOLE_ROW : __builtin_ctzll((unsigned long long)(group_size / 32));
}

/* Groups in a row of K. */
static inline int64_t a8_groups(int64_t K, int shift) { return shift == A8_WHOLE_ROW ? 1 : (K / 32) >> shift; }

/* Row m of x (x_dtype) quantized into its scratch (a shift, not a division, finds a block's
   group). */
static void a8_quantize_row(const void *x, int x_dtype, int64_t K, int shift, A8Row r) {
    const int64_t B = K / 32;
    float values[32];
    for (int64_t b = 0; b < 2 * a8_pairs(K); b++) {
        int8_t *first = r.xq + (b / 2) * 64 + (b % 2) * 16, *second = first + 32;
        float *lanes = r.sxv + (b / 2) * 16 + (b % 2) * 4;
        int32_t *bias = r.bias + (b / 2) * 16 + (b % 2) * 4;
        float sx = 0.0f;
        int32_t total = 0;
        if (b < B) {
            load_row(element(x, b * 32, x_dtype), x_dtype, values, 32);
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(values[i]));
            sx = amax / 127.0f;
            for (int i = 0; i < 32; i++) {
                const int32_t q = sx > 0.0f ? (int32_t)nearbyintf(values[i] / sx) : 0;
                (i < 16 ? first : second)[i % 16] = (int8_t)q;
                total += q;
            }
            if ((b & (((int64_t)1 << shift) - 1)) == 0) r.S[b >> shift] = 0.0f;
            /* fused, as gcc contracts it wherever the CPU has FMA: a build without (x86-64)
               then gives a group of several blocks the same bits */
            r.S[b >> shift] = fmaf(sx, (float)total, r.S[b >> shift]);
        } else {
            memset(first, 0, 16);
            memset(second, 0, 16);
        }
        for (int j = 0; j < 4; j++) {
            lanes[j] = lanes[8 + j] = sx;
            int32_t low = 0, high = 0;
            for (int i = 0; i < 4; i++) {
                low += first[4 * j + i];
                high += second[4 * j + i];
            }
            bias[j] = -128 * low;
            bias[8 + j] = -128 * high;
        }
    }
}

/* The weight scales of pair p's blocks 2p and 2p + 1 (block 2p's again where `two` is 0:
   there is no 2p + 1). */
static inline void a8_pair_scales(const float *scales, int64_t p, int two, int shift, float s[2]) {
    s[0] = scales[(2 * p) >> shift];
    s[1] = two ? scales[(2 * p + 1) >> shift] : s[0];
}

/* Weight row n's bytes: K / 2 of nibbles, or K of int8. */
static inline const uint8_t *a8_weight(const Skinny *s, int64_t n, int bits) {
    return (const uint8_t *)s->w + n * (bits == 8 ? s->K : s->K / 2);
}

#ifdef __AVX512VNNI__
/* Weight row pair p (blocks 2p and, if `two`, 2p + 1) as 64 unsigned bytes in xq's order. */
static inline __attribute__((always_inline)) __m512i a8_bytes(const uint8_t *row, int64_t p,
                                                              int two, int bits) {
    if (bits == 8) { /* quarters [b0 0-15 | b0 16-31 | b1 0-15 | b1 16-31] -> xq's order */
        const __m512i bytes = two ? _mm512_loadu_si512(row + 64 * p)
                                  : _mm512_maskz_loadu_epi8(0xFFFFFFFFull, row + 64 * p);
        return _mm512_xor_si512(_mm512_shuffle_i64x2(bytes, bytes, _MM_SHUFFLE(3, 1, 2, 0)),
                                _mm512_set1_epi8((char)0x80));
    }
    const __m256i packed = two ? _mm256_loadu_si256((const __m256i *)(row + 32 * p))
                               : _mm256_maskz_loadu_epi8(0xFFFF, row + 32 * p);
    const __m256i nibble = _mm256_set1_epi8(15);
    const __m256i low = _mm256_and_si256(packed, nibble);
    const __m256i high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
    return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

/* Each lane's weight scale for pair p (lanes 4-7 and 12-15 are block 2p + 1's). */
static inline __m512 a8_lane_scales(const float *scales, int64_t p, int two, int shift) {
    float s[2];
    a8_pair_scales(scales, p, two, shift, s);
    return _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]));
}

/* acc + pair p's contribution: the blocks' int32 dot products (VNNI; 8-bit weights' start
   from the lanes' bias), each lane scaled by its weight scale times its activation scale
   (rounded once). */
static inline __attribute__((always_inline)) __m512 a8_pair_sum(__m512 acc, __m512i bytes,
                                                                __m512 lane_scales, A8Row r,
                                                                int64_t p, int bits) {
    const __m512i start =
        bits == 8 ? _mm512_loadu_si512(r.bias + 16 * p) : _mm512_setzero_si512();
    const __m512i dots = _mm512_dpbusd_epi32(start, bytes, _mm512_loadu_si512(r.xq + 64 * p));
    const __m512 factor = _mm512_mul_ps(lane_scales, _mm512_loadu_ps(r.sxv + 16 * p));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), factor, acc);
}

/* acc + the offsets' term offsets[g] * S[g], lane by lane over the G groups. */
static inline __m512 a8_offset_sum(__m512 acc, const float *offsets, const float *S, int64_t G) {
    int64_t g = 0;
    for (; g + LANES <= G; g += LANES)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(offsets + g), _mm512_loadu_ps(S + g), acc);
    if (g < G) {
        const __mmask16 tail = (__mmask16)((1u << (G - g)) - 1);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, offsets + g),
                              _mm512_maskz_loadu_ps(tail, S + g), acc);
    }
    return acc;
}

/* Weight row n's lanes against row r of x: the pairs in order, then (4 bits) the offsets. */
static inline __attribute__((always_inline)) __m512 a8_lanes(const Skinny *s, int64_t n,
                                                             A8Row r, int shift, int bits) {
    const int64_t K = s->K, B = K / 32, P = a8_pairs(K), G = a8_groups(K, shift);
    const uint8_t *row = a8_weight(s, n, bits);
    const float *scales = s->scales + n * G;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t p = 0; p < P; p++) {
        const int two = 2 * p + 1 < B;
        acc = a8_pair_sum(acc, a8_bytes(row, p, two, bits), a8_lane_scales(scales, p, two, shift),
                          r, p, bits);
    }
    return bits == 8 ? acc : a8_offset_sum(acc, s->offsets + n * G, r.S, G);
}

/* The lane sums of 16 vectors, each added in _mm512_reduce_add_ps's order (lane i + lane
   i + 8, then + the sum 4 on, then + the sum 2 on, then the two left), so a row's sum has the
   same bits as when it is reduced alone; the 16 trees share their shuffles and adds. */
static inline void a8_lane_sums16(const __m512 v[16], float *sums) {
    __m512 w[8], z[4], y[2];
    for (int r = 0; r < 8; r++)
        w[r] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * r], v[2 * r + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * r], v[2 * r + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 4; k++)
        z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++)
        y[m] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(z[2 * m], z[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 f = _mm512_add_ps(_mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lane 4q + j of f holds row q + 4j */
    const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_storeu_ps(sums, _mm512_permutexvar_ps(order, f));
}

/* Weight rows n0 .. n0 + 15 against a single row of x, each row's lanes exactly as
   a8_weight_row forms them; their 16 reductions go together. */
static inline __attribute__((always_inline)) void a8_weight_rows16(const Skinny *s, int64_t n0,
                                                                   const float *prepared,
                                                                   int shift, int bits) {
    const A8Row r = a8_row(prepared, s->K);
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = a8_lanes(s, n0 + i, r, shift, bits);
    float sums[16];
    a8_lane_sums16(acc, sums);
    for (int i = 0; s->bias != NULL && i < 16; i++) sums[i] += s->bias[n0 + i];
    store_outputs(s, 0, n0, sums, 16);
}
#endif

#if !defined(__AVX512VNNI__) && defined(__AVX2__)
/* Without VNNI, with AVX2: a8_lanes in two 8-lane halves (lanes 0-7 take xq's bytes 0-31,
   lanes 8-15 bytes 32-63), each lane's four products summed exactly in int32 by vpmaddubsw
   (unsigned bytes by signed ones, pairs into int16) then vpmaddwd (pairs into int32). No
   int16 pair saturates: 4-bit weights are 0..15 (a pair at most 2 * 15 * 127), and 8-bit ones
   go in as |w| against xq carrying w's sign (vpsignb; at most 2 * 128 * 127 = 32512), whose
   sums are the VNNI path's (w + 128 against xq, less its bias) exactly. The rest is a8_lanes'
   lane arithmetic and _mm512_reduce_add_ps's order, so a row gets the bits VNNI gives it, as
   the scalar form below does (SmolLM2's shipped Q4_1 file at one row, the AVX2 Zen 3,
   2026-11-30: a decode step p50 105-140 ms in that scalar form, 16-19 ms in this one). */

/* Weight row pair p as the two halves' bytes (unsigned for 4 bits, signed for 8). */
static inline __attribute__((always_inline)) void a8_bytes_avx2(const uint8_t *row, int64_t p,
                                                                int two, int bits,
                                                                __m256i half[2]) {
    if (bits == 8) { /* [b0 0-15 | b1 0-15] and [b0 16-31 | b1 16-31] */
        const uint8_t *b0 = row + 64 * p, *b1 = b0 + 32;
        for (int h = 0; h < 2; h++) {
            const __m128i first = _mm_loadu_si128((const __m128i *)(b0 + 16 * h));
            const __m128i second = two ? _mm_loadu_si128((const __m128i *)(b1 + 16 * h)) : _mm_setzero_si128();
            half[h] = _mm256_inserti128_si256(_mm256_castsi128_si256(first), second, 1);
        }
        return;
    }
    const __m128i b0 = _mm_loadu_si128((const __m128i *)(row + 32 * p));
    const __m128i b1 = two ? _mm_loadu_si128((const __m128i *)(row + 32 * p + 16)) : _mm_setzero_si128();
    const __m256i packed = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
    const __m256i nibble = _mm256_set1_epi8(15);
    half[0] = _mm256_and_si256(packed, nibble);
    half[1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), nibble);
}

/* Each lane's four products of weight bytes w and xq, summed exactly in int32. */
static inline __attribute__((always_inline)) __m256i a8_dots_avx2(__m256i w, __m256i xq, int bits) {
    const __m256i pairs = bits == 8 ? _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w))
                                    : _mm256_maddubs_epi16(w, xq);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* a8_lanes' sum for one row of x, the weight row's pairs formed already (bytes, lane_scales:
   each half's weight scales, block 2p's then 2p + 1's four). */
static inline __attribute__((always_inline)) float a8_row_sum_avx2(const __m256i (*bytes)[2],
                                                                  const __m256 *lane_scales,
                                                                  const float *offsets, A8Row r,
                                                                  int64_t P, int64_t G, int bits) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t p = 0; p < P; p++)
        for (int h = 0; h < 2; h++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(r.xq + 64 * p + 32 * h));
            const __m256 factor = _mm256_mul_ps(lane_scales[p], _mm256_loadu_ps(r.sxv + 16 * p + 8 * h));
            acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a8_dots_avx2(bytes[p][h], xq, bits)), factor, acc[h]);
        }
    for (int64_t g = 0; bits == 4 && g < G; g += LANES) { /* lanes past G add 0 * 0, as a8_offset_sum */
        for (int h = 0; h < 2; h++) {
            const int64_t first = g + 8 * h, left = G - first < 0 ? 0 : G - first;
            const __m256i take = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 8 ? left : 8)),
                                                    _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            acc[h] = _mm256_fmadd_ps(_mm256_maskload_ps(offsets + first, take),
                                     _mm256_maskload_ps(r.S + first, take), acc[h]);
        }
    }
    v16 lanes;
    memcpy(&lanes, acc, sizeof lanes);
    return hsum(lanes);
}
#elif !defined(__AVX512VNNI__)
/* Without VNNI: a8_lanes and _mm512_reduce_add_ps's sum of them, lane by lane in scalar code,
   with the same roundings in the same order (each lane's four exact products, its factor
   rounded once, a fused multiply-add, the offsets' fused terms, then lane i + lane i + 8, + the
   sum 4 on, + the sum 2 on, the two left), so a CPU without VNNI gives a row the bits one
   with it gives. (Summing whole blocks instead moved int4 models' greedy tokens on an AVX2
   machine away from the reference's, where AVX-512's met them.) */
static inline float a8_lanes_emulated(const uint8_t *row, const float *scales,
                                      const float *offsets, A8Row r, int64_t B, int64_t G,
                                      int shift, int bits) {
    float acc[16] = {0};
    for (int64_t p = 0; p < a8_pairs(B * 32); p++) {
        float s[2];
        a8_pair_scales(scales, p, 2 * p + 1 < B, shift, s);
        for (int l = 0; l < 16; l++) { /* lane l: 4 elements of block 2p (+1 for lanes 4-7, 12-15) */
            const int64_t b = 2 * p + ((l >> 2) & 1);
            const int first = (l >= 8 ? 16 : 0) + (l & 3) * 4; /* the block's element */
            int32_t dot = 0;
            for (int i = 0; b < B && i < 4; i++) {
                const int e = first + i;
                const int32_t w = bits == 8 ? (int8_t)row[32 * b + e]
                                            : (e < 16 ? row[16 * b + e] & 15 : row[16 * b + e - 16] >> 4);
                dot += w * r.xq[64 * p + 4 * l + i];
            }
            const float factor = s[(l >> 2) & 1] * r.sxv[16 * p + l];
            acc[l] = fmaf((float)dot, factor, acc[l]);
        }
    }
    for (int64_t g = 0; bits == 4 && g < G; g++) acc[g % 16] = fmaf(offsets[g], r.S[g], acc[g % 16]);
    v16 lanes;
    memcpy(&lanes, acc, sizeof lanes);
    return hsum(lanes);
}
#endif

/* Weight row n against every row of x (prepared: each row's scratch, `row_floats` apart):
   per row, the pairs in order, then the offsets' term, then one sum of the lanes (as
   a8_lanes forms them); the weight row's pairs are unpacked once for all rows of x. */
static inline __attribute__((always_inline)) void a8_weight_row(const Skinny *s, int64_t n,
                                                                const float *prepared,
                                                                int64_t row_floats, int shift,
                                                                int bits) {
    const int64_t B = s->K / 32, G = a8_groups(s->K, shift);
    const uint8_t *row = a8_weight(s, n, bits);
    const float *scales = s->scales + n * G, *offsets = s->offsets + n * G;
#ifdef __AVX512VNNI__
    const int64_t P = a8_pairs(s->K);
    __m512i bytes[P];
    __m512 lane_scales[P];
    for (int64_t p = 0; p < P; p++) {
        bytes[p] = a8_bytes(row, p, 2 * p + 1 < B, bits);
        lane_scales[p] = a8_lane_scales(scales, p, 2 * p + 1 < B, shift);
    }
#elif defined(__AVX2__)
    const int64_t P = a8_pairs(s->K);
    __m256i bytes[P][2];
    __m256 lane_scales[P];
    for (int64_t p = 0; p < P; p++) {
        const int two = 2 * p + 1 < B;
        float s[2];
        a8_pair_scales(scales, p, two, shift, s);
        a8_bytes_avx2(row, p, two, bits, bytes[p]);
        lane_scales[p] = _mm256_setr_ps(s[0], s[0], s[0], s[0], s[1], s[1], s[1], s[1]);
    }
#endif
    for (int64_t m = 0; m < s->M; m++) {
        const A8Row r = a8_row(prepared + m * row_floats, s->K);
#ifdef __AVX512VNNI__
        __m512 acc = _mm512_setzero_ps();
        for (int64_t p = 0; p < P; p++) acc = a8_pair_sum(acc, bytes[p], lane_scales[p], r, p, bits);
        float sum = _mm512_reduce_add_ps(bits == 8 ? acc : a8_offset_sum(acc, offsets, r.S, G));
#elif defined(__AVX2__)
        float sum = a8_row_sum_avx2((const __m256i (*)[2])bytes, lane_scales, offsets, r, P, G, bits);
#else
        float sum = a8_lanes_emulated(row, scales, offsets, r, B, G, shift, bits);
#endif
        sum += s->bias != NULL ? s->bias[n] : 0.0f;
        store_outputs(s, m, n, &sum, 1);
    }
}

/* The weight rows of one thread's share (`omp for`), at one bit width: at one row of x, 16
   weight rows at a time, then the last few one by one. */
static inline __attribute__((always_inline)) void a8_weight_rows(const Skinny *s,
                                                                 const float *prepared,
                                                                 int64_t row_floats, int shift,
                                                                 int bits) {
    const int64_t N = s->N;
#ifdef __AVX512VNNI__
    if (s->M == 1) {
        const int64_t groups = (N + 15) / 16;
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            if (16 * (g + 1) <= N) {
                a8_weight_rows16(s, 16 * g, prepared, shift, bits);
            } else {
                for (int64_t n = 16 * g; n < N; n++)
                    a8_weight_row(s, n, prepared, row_floats, shift, bits);
            }
        }
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) a8_weight_row(s, n, prepared, row_floats, shift, bits);
}

/* y [M, N] = x [M, K] against 8- or 4-bit weights [N, K] with int8 activations (above), x in
   x_dtype (rows strided), y in y_dtype. scratch: room for hr_a8_floats(M, K) floats. Called
   by every thread of a region. */
void hr_quantized_linear_a8(const void *x, int64_t x_stride, int x_dtype, int64_t M,
                            const void *w, int bits, int64_t N, int64_t K, int64_t group_size,
                            const float *scales, const float *offsets, const float *bias,
                            void *y, int64_t y_stride, int y_dtype, float *scratch) {
    const int shift = a8_shift(group_size, K);
    const int64_t row_floats = a8_row_floats(K);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++) {
        a8_quantize_row(element(x, m * x_stride, x_dtype), x_dtype, K, shift,
                        a8_row(scratch + m * row_floats, K));
    }
    const Skinny s = {.x = x, .x_stride = x_stride, .M = M, .w = w, .N = N, .K = K,
                      .scales = scales, .offsets = offsets, .bias = bias, .y = y,
                      .y_stride = y_stride, .y_dtype = y_dtype};
    if (bits == 8) {
        a8_weight_rows(&s, scratch, row_floats, shift, 8);
    } else {
        a8_weight_rows(&s, scratch, row_floats, shift, 4);
    }
}

/* headrace_quantized_linear's operands. */
int headrace_quantized_linear_a8(const void *x, int64_t x_stride, int x_dtype, int64_t M,
                                 const void *w, int bits, int64_t N, int64_t K, int64_t group_size,
                                 const float *scales, const float *offsets, const float *bias,
                                 void *y, int64_t y_stride, int y_dtype) {
    float *scratch = M > 0 ? malloc((size_t)hr_a8_floats(M, K) * sizeof(float)) : NULL;
    if (M > 0 && scratch == NULL) return -1;
#pragma omp parallel if (N * K >= (1 << 15))
    hr_quantized_linear_a8(x, x_stride, x_dtype, M, w, bits, N, K, group_size, scales, offsets,
                           bias, y, y_stride, y_dtype, scratch);
    free(scratch);
    return 0;
}

/* out [N, K] in out_dtype = the quantized weights as floats (`dequantize`), each rounded once
   to out_dtype: what a GEMM multiplies when a step has too many rows for the skinny kernel. */
void headrace_dequantize(const void *w, int bits, int64_t N, int64_t K, int64_t group_size,
                         const float *scales, const float *offsets, void *out, int out_dtype) {
    const Skinny s = {.w = w, .N = N, .K = K, .scales = scales, .offsets = offsets,
                      .group_shift = group_shift(group_size, K)};
    const int layout = bits == 8 ? Q8 : Q4;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 15))
    for (int64_t n = 0; n < N; n++) {
        for (int64_t k = 0; k < K; k += LANES) {
            for (int h = 0; h < PARTS; h++) {
                const vp values = dequantize_part(&s, n, k, h, layout);
                store_row((char *)out + (n * K + k + h * PART_LANES) * (int64_t)dtype_size(out_dtype),
                          out_dtype, (const float *)&values, PART_LANES);
            }
        }
    }
}

/* ---- token bitmasks ----------------------------------------------------------------------- */

/* x[rows[i], t] = -inf wherever bit t % 32 of word t / 32 of bitmask row i is 0 (the tokens an
   output constraint forbids, as xgrammar fills its masks). Words of all ones are skipped: a
   row inside a JSON string allows almost every token. One thread: it is memory-bound and
   takes about 1 ms for 64 rows of a 49k vocabulary, while an OpenMP region on a busy 2-core
   machine measured 10x slower. */
void headrace_apply_token_bitmask(float *x, int64_t row_stride, int64_t num_cols,
                                  const int32_t *bitmask, int64_t num_words, const int64_t *rows,
                                  int64_t num_rows) {
    for (int64_t i = 0; i < num_rows; i++) {
        float *row = x + rows[i] * row_stride;
        const uint32_t *words = (const uint32_t *)(bitmask + i * num_words);
        for (int64_t w = 0; w < num_words && w * 32 < num_cols; w++) {
            const uint32_t word = words[w];
            if (word == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t width = num_cols - base < 32 ? num_cols - base : 32;
#pragma omp simd
            for (int64_t b = 0; b < width; b++) {
                row[base + b] = ((word >> b) & 1u) ? row[base + b] : -INFINITY;
            }
        }
    }
}

/* ---- bf16 and fp16 rows, 16 values a step (AVX-512 with byte/word ops and 256-bit masks) -- */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HALF_LANES 1

/* float32 lanes rounded to bf16, float_to_bf16 (cpu_kernels.h) 16 lanes at a time: to nearest
   even, a NaN a quiet NaN. */
static inline __m256i narrow_bf16(v16 x) {
    const __m512i bits = (__m512i)x, high = _mm512_srli_epi32(bits, 16);
    const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                  _mm512_set1_epi32(0x7f800000));
    const __m512i quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* The 2-byte dtypes' rows (bf16, fp16) take these: 16 values of dtype widened to float32
   exactly; float32 lanes rounded to dtype as in_dtype rounds them (to nearest even, a NaN a
   quiet NaN); and the two in turn, a lane's value as dtype holds it. */
static inline int is_half(int dtype) { return dtype == BF16 || dtype == F16; }

static inline v16 widen_half(__m256i halves, int dtype) {
    return dtype == BF16 ? widen_bf16(halves) : (v16)_mm512_cvtph_ps(halves);
}

static inline __m256i narrow_half(v16 x, int dtype) {
    return dtype == BF16 ? narrow_bf16(x)
                         : _mm512_cvtps_ph((__m512)x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

static inline v16 round_to_half(v16 x, int dtype) { return widen_half(narrow_half(x, dtype), dtype); }

/* The lanes of a row's n values from i on: all 16, or the tail's (for masked loads and
   stores). */
static inline __mmask16 lanes_from(int64_t i, int64_t n) {
    return n - i >= LANES ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
}

#endif

/* ---- RMSNorm and rotary ------------------------------------------------------------------- */

/* A value as the activation dtype holds it: float32 as is, bf16 / fp16 rounded to nearest
   even (what torch does after each elementwise op in those dtypes). */
static inline float in_dtype(float value, int dtype) {
    if (dtype == BF16) return bf16_to_float(float_to_bf16(value));
    if (dtype == F16) return (float)(_Float16)value;
    return value;
}

/* Rows above which a row-wise kernel splits its rows over threads: below, one thread (an
   OpenMP region costs more than a decode step's few rows). */
#define ROWWISE_PARALLEL_ELEMENTS (1 << 16)

#ifdef HALF_LANES
/* hr_rms_norm's row for bf16 / fp16 rows of whole vectors, 16 values a step: the same
   roundings and the same sum of squares in the same order, without widening the row, the
   residual and the weight into float buffers a loop at a time (bf16, 2048 x 576 rows with a
   residual, 2 threads, ten alternating pairs against the buffered loop: 0.76 -> 0.51 ms,
   1.28-1.91x; fp16, three alternating rounds against the buffered loop it took until
   2026-11-28: 4.35 -> 0.23 ms). */
static void rms_norm_half_row(const uint16_t *x, const uint16_t *residual, const uint16_t *weight,
                              float eps, uint16_t *out, uint16_t *sum, int64_t cols, int dtype) {
    float row[RMS_NORM_MAX_COLS] __attribute__((aligned(64)));
    v16 squares = splat(0.0f);
    for (int64_t i = 0; i < cols; i += LANES) {
        v16 v = widen_half(_mm256_loadu_si256((const __m256i *)(x + i)), dtype);
        if (residual != NULL) {
            const v16 r = widen_half(_mm256_loadu_si256((const __m256i *)(residual + i)), dtype);
            const __m256i total = narrow_half(v + r, dtype);
            _mm256_storeu_si256((__m256i *)(sum + i), total);
            v = widen_half(total, dtype);
        }
        *(v16 *)(row + i) = v;
        squares += v * v;
    }
    const float scale = 1.0f / sqrtf(hsum(squares) / (float)cols + eps);
    for (int64_t i = 0; i < cols; i += LANES) {
        const v16 normed = round_to_half(*(const v16 *)(row + i) * scale, dtype);
        const v16 w = widen_half(_mm256_loadu_si256((const __m256i *)(weight + i)), dtype);
        _mm256_storeu_si256((__m256i *)(out + i), narrow_half(w * normed, dtype));
    }
}

#endif

/* hr_rms_norm's row for float32 rows of whole vectors, read and written where they lie: the
   same add, the same sum of squares in the same order (lane i of part h holds the values at
   i + h PART_LANES mod 16) and the same products as the buffered loop, without its copies of
   the row, the residual and the weight into float buffers (a float32 prefill step's rms_norm
   and silu_and_mul spent 3% of the step in those copies). */
static void rms_norm_f32_row(const float *x, const float *residual, const float *weight,
                             float eps, float *out, float *sum, int64_t cols) {
    vp squares[PARTS] = {{0}};
    for (int64_t i = 0; i < cols; i += LANES) {
        for (int h = 0; h < PARTS; h++) {
            const int64_t at = i + h * PART_LANES;
            vp v = *(const vpu *)(x + at);
            if (residual != NULL) {
                v = v + *(const vpu *)(residual + at);
                *(vpu *)(sum + at) = v;
            }
            squares[h] += v * v;
        }
    }
    const float scale = 1.0f / sqrtf(parts_sum(squares) / (float)cols + eps);
    const float *row = residual != NULL ? sum : x;
    for (int64_t i = 0; i < cols; i += PART_LANES)
        *(vpu *)(out + i) = *(const vpu *)(weight + i) * (*(const vpu *)(row + i) * scale);
}

/* out = weight * normalised(x + residual), and sum = x + residual, row by row, rounding as
   the torch reference does (Hugging Face's LlamaRMSNorm): the add in the activation dtype,
   the mean of squares and the scaling in float32, the scaled row rounded to the activation
   dtype, then the product with the weight rounded again. residual / sum may be NULL (no add;
   the row is x). Each row's sum of squares runs in one fixed order: a row's result does not
   depend on the other rows. cols <= RMS_NORM_MAX_COLS. */
void hr_rms_norm(const void *x, int64_t x_stride, const void *residual, int64_t residual_stride,
                 const void *weight, float eps, void *out, void *sum, int64_t num_rows,
                 int64_t cols, int dtype) {
    const size_t size = dtype_size(dtype);
#ifdef HALF_LANES
    if (is_half(dtype) && cols % LANES == 0) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            const uint16_t *res = residual == NULL ? NULL : (const uint16_t *)residual + r * residual_stride;
            uint16_t *total = sum == NULL ? NULL : (uint16_t *)sum + r * cols;
            rms_norm_half_row((const uint16_t *)x + r * x_stride, res, (const uint16_t *)weight, eps,
                              (uint16_t *)out + r * cols, total, cols, dtype);
        }
        return;
    }
#endif
    if (dtype == F32 && cols % LANES == 0) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            const float *res = residual == NULL ? NULL : (const float *)residual + r * residual_stride;
            float *total = sum == NULL ? NULL : (float *)sum + r * cols;
            rms_norm_f32_row((const float *)x + r * x_stride, res, (const float *)weight, eps,
                             (float *)out + r * cols, total, cols);
        }
        return;
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float row[RMS_NORM_MAX_COLS], other[RMS_NORM_MAX_COLS];
        load_row((const char *)x + r * x_stride * size, dtype, row, (int)cols);
        if (residual != NULL) {
            load_row((const char *)residual + r * residual_stride * size, dtype, other, (int)cols);
            for (int64_t i = 0; i < cols; i++) row[i] = in_dtype(row[i] + other[i], dtype);
            store_row((char *)sum + r * cols * size, dtype, row, (int)cols);
        }
        v16 squares = splat(0.0f);
        int64_t i = 0;
        for (; i + LANES <= cols; i += LANES) {
            const v16 v = *(const v16u *)(row + i);
            squares += v * v;
        }
        float total = hsum(squares);
        for (; i < cols; i++) total += row[i] * row[i];
        const float scale = 1.0f / sqrtf(total / (float)cols + eps);
        load_row(weight, dtype, other, (int)cols);
        for (int64_t j = 0; j < cols; j++) {
            row[j] = in_dtype(other[j] * in_dtype(row[j] * scale, dtype), dtype);
        }
        store_row((char *)out + r * cols * size, dtype, row, (int)cols);
    }
}

void headrace_rms_norm(const void *x, int64_t x_stride, const void *residual,
                       int64_t residual_stride, const void *weight, float eps, void *out,
                       void *sum, int64_t num_rows, int64_t cols, int dtype) {
#pragma omp parallel if (num_rows * cols >= ROWWISE_PARALLEL_ELEMENTS)
    hr_rms_norm(x, x_stride, residual, residual_stride, weight, eps, out, sum, num_rows, cols,
                dtype);
}

#ifdef HALF_LANES
/* rotate_rows' ops on one bf16 / fp16 head, 16 values of each half a step (the last masked),
   each product and sum rounded to its dtype as rotate_rows rounds it, without float32 row
   buffers (bf16, 2048 rows of 9 + 3 heads of 64, 2 threads, ten alternating pairs against the
   buffered loop: 1.07 -> 0.96 ms, 1.04-1.17x; every value the same; fp16, which took the
   buffered loop until 2026-11-28: 2.8 -> 0.27 ms). */
__attribute__((optimize("fp-contract=off"))) static void rotate_half_head(
    const uint16_t *x, const uint16_t *cos, const uint16_t *sin, uint16_t *out, int64_t half,
    int dtype) {
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
    for (int64_t i = 0; i < half; i += LANES) {
        const __mmask16 m = lanes_from(i, half);
        const v16 first = widen_half(_mm256_maskz_loadu_epi16(m, x + i), dtype);
        const v16 second = widen_half(_mm256_maskz_loadu_epi16(m, x + half + i), dtype);
        const v16 cos_first = widen_half(_mm256_maskz_loadu_epi16(m, cos + i), dtype);
        const v16 cos_second = widen_half(_mm256_maskz_loadu_epi16(m, cos + half + i), dtype);
        const v16 sin_first = widen_half(_mm256_maskz_loadu_epi16(m, sin + i), dtype);
        const v16 sin_second = widen_half(_mm256_maskz_loadu_epi16(m, sin + half + i), dtype);
        const v16 low = round_to_half(first * cos_first, dtype) + round_to_half(-second * sin_first, dtype);
        const v16 high = round_to_half(second * cos_second, dtype) + round_to_half(first * sin_second, dtype);
        _mm256_mask_storeu_epi16(out + i, m, narrow_half(low, dtype));
        _mm256_mask_storeu_epi16(out + half + i, m, narrow_half(high, dtype));
    }
}
#endif

/* Neox rotary of one row of heads: out = x cos + rotate_half(x) sin, where rotate_half(x) is
   (-x[half:], x[:half]); each product and the sum rounded to the activation dtype as the
   torch reference's three ops round them. x rows may be strided (a view into the fused qkv
   output); out is [num_rows, num_heads, head_dim] contiguous. */
/* Each product and the sum rounded as the reference's three ops round them: no fused
   multiply-adds here (the vectorised loops would otherwise fuse them). */
__attribute__((optimize("fp-contract=off"))) static void rotate_rows(
    const void *x, int64_t x_stride_token, int64_t x_stride_head, const void *cos, const void *sin,
    void *out, int64_t num_rows, int64_t num_heads, int64_t head_dim, int dtype) {
#ifdef __clang__
#pragma STDC FP_CONTRACT OFF
#endif
    const size_t size = dtype_size(dtype);
    const int64_t half = head_dim / 2;
#ifdef HALF_LANES
    if (is_half(dtype)) {
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < num_rows; t++) {
            for (int64_t h = 0; h < num_heads; h++)
                rotate_half_head((const uint16_t *)x + t * x_stride_token + h * x_stride_head,
                                 (const uint16_t *)cos + t * head_dim,
                                 (const uint16_t *)sin + t * head_dim,
                                 (uint16_t *)out + (t * num_heads + h) * head_dim, half, dtype);
        }
        return;
    }
#endif
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < num_rows; t++) {
        float c[1024], s[1024], v[1024], o[1024];
        load_row((const char *)cos + t * head_dim * size, dtype, c, (int)head_dim);
        load_row((const char *)sin + t * head_dim * size, dtype, s, (int)head_dim);
        for (int64_t h = 0; h < num_heads; h++) {
            load_row((const char *)x + (t * x_stride_token + h * x_stride_head) * size, dtype, v,
                     (int)head_dim);
            /* rotate_half(v) is (-v[half:], v[:half]); two loops, so each vectorises */
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float product = in_dtype(v[i] * c[i], dtype);
                o[i] = in_dtype(product + in_dtype(-v[i + half] * s[i], dtype), dtype);
            }
#pragma omp simd
            for (int64_t i = half; i < head_dim; i++) {
                const float product = in_dtype(v[i] * c[i], dtype);
                o[i] = in_dtype(product + in_dtype(v[i - half] * s[i], dtype), dtype);
            }
            store_row((char *)out + (t * num_heads + h) * head_dim * size, dtype, o, (int)head_dim);
        }
    }
}

/* rotate_rows for the query and the key heads of a step. head_dim <= 1024, even. */
void hr_apply_rotary(const void *query, int64_t q_stride_token, int64_t q_stride_head,
                     int64_t num_heads, const void *key, int64_t k_stride_token,
                     int64_t k_stride_head, int64_t num_kv_heads, const void *cos, const void *sin,
                     void *query_out, void *key_out, int64_t num_rows, int64_t head_dim,
                     int dtype) {
    rotate_rows(query, q_stride_token, q_stride_head, cos, sin, query_out, num_rows, num_heads,
                head_dim, dtype);
    rotate_rows(key, k_stride_token, k_stride_head, cos, sin, key_out, num_rows, num_kv_heads,
                head_dim, dtype);
#pragma omp barrier
}

void headrace_apply_rotary(const void *query, int64_t q_stride_token, int64_t q_stride_head,
                           int64_t num_heads, const void *key, int64_t k_stride_token,
                           int64_t k_stride_head, int64_t num_kv_heads, const void *cos,
                           const void *sin, void *query_out, void *key_out, int64_t num_rows,
                           int64_t head_dim, int dtype) {
#pragma omp parallel if (num_rows * (num_heads + num_kv_heads) * head_dim >= ROWWISE_PARALLEL_ELEMENTS)
    hr_apply_rotary(query, q_stride_token, q_stride_head, num_heads, key, k_stride_token,
                    k_stride_head, num_kv_heads, cos, sin, query_out, key_out, num_rows, head_dim,
                    dtype);
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define HAVE_EXP_ROUNDED 1

/* 1 / k! for k = 10 down to 0: e^r's Taylor series from its r^11 term (Horner's order). */
static const double INVERSE_FACTORIALS[] = {1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,
                                            1.0 / 5040.0,    1.0 / 720.0,    1.0 / 120.0,
                                            1.0 / 24.0,      1.0 / 6.0,      0.5,
                                            1.0,             1.0};

/* The double-lane operations exp_double takes from each instruction set: the AVX-512
   register of 8 doubles, or AVX2's of 4. All but two are the same instruction by the same
   name (VD(op)); AVX2 has no roundscale (round_pd rounds to nearest even alike) and no scalef
   (2^n joins p's exponent bits instead: exact here, where p lies within [0.7, 1.5] and |n| <=
   217, so the product is a normal double; a NaN p stays a NaN, n's bits shifting out). */
#ifdef __AVX512F__
typedef __m512d vd;
#define VD(op) _mm512_##op
static inline vd round_to_integer(vd x) {
    return _mm512_roundscale_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vd times_two_to(vd p, vd n) { return _mm512_scalef_pd(p, n); }
#else
typedef __m256d vd;
#define VD(op) _mm256_##op
static inline vd round_to_integer(vd x) {
    return _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vd times_two_to(vd p, vd n) {
    /* n + 1.5 * 2^52 holds n in its low mantissa bits; shifted up 52 they are n << 52 */
    const __m256i exponent = _mm256_slli_epi64(
        _mm256_castpd_si256(_mm256_add_pd(n, _mm256_set1_pd(6755399441055744.0))), 52);
    return _mm256_castsi256_pd(_mm256_add_epi64(_mm256_castpd_si256(p), exponent));
}
#endif

/* e^x per lane in double (x clamped to [-150, 150], NaN kept): x = n ln2 + r, |r| <= ln2 / 2,
   with ln2 in two parts (fdlibm's) and e^r by its Taylor series to r^11 (relative error below
   1e-14). */
static inline vd exp_double(vd x) {
    x = VD(min_pd)(VD(set1_pd)(150.0), VD(max_pd)(VD(set1_pd)(-150.0), x));
    const vd n = round_to_integer(VD(mul_pd)(x, VD(set1_pd)(1.4426950408889634)));
    vd r = VD(fnmadd_pd)(n, VD(set1_pd)(6.93147180369123816490e-01), x);
    r = VD(fnmadd_pd)(n, VD(set1_pd)(1.90821492927058770002e-10), r);
    vd p = VD(set1_pd)(1.0 / 39916800.0);
    for (int k = 0; k < 11; k++) p = VD(fmadd_pd)(p, r, VD(set1_pd)(INVERSE_FACTORIALS[k]));
    return times_two_to(p, n);
}

/* e^x per float32 lane, computed in double and rounded once: correctly rounded (but where the
   exact value lies within 1e-6 ulp of a tie), as the C library's expf is to within 0.502 ulp,
   so the two agree but in the rarest cases. AVX-512 takes a v16's halves in registers; AVX2
   its quarters. */
static inline v16 exp_rounded(v16 x) {
#ifdef __AVX512F__
    const vd low = exp_double(_mm512_cvtps_pd(_mm512_castps512_ps256((__m512)x)));
    const vd high = exp_double(_mm512_cvtps_pd(_mm512_extractf32x8_ps((__m512)x, 1)));
    return (v16)_mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtpd_ps(low)),
                                   _mm512_cvtpd_ps(high), 1);
#else
    v16 out;
    for (int q = 0; q < LANES; q += 4) {
        __m128 quarter;
        memcpy(&quarter, (const float *)&x + q, sizeof quarter);
        const __m128 e = _mm256_cvtpd_ps(exp_double(_mm256_cvtps_pd(quarter)));
        memcpy((float *)&out + q, &e, sizeof e);
    }
    return out;
#endif
}

/* silu(g) = g / (1 + e^-g) in float32 as the reference computes it: e^-g correctly rounded
   (exp_rounded), then the add and the division each rounded. */
static inline v16 silu_rounded(v16 g) { return g / (1.0f + exp_rounded(-g)); }

#ifdef HALF_LANES
/* silu of every bf16 and every fp16 gate rounded to its dtype, indexed by the gate's bits
   (table 0 bf16, 1 fp16): silu_rounded's value for each of the 65,536 patterns, filled when
   the library loads (a few milliseconds), so a gate's silu is one lookup with the exact
   path's bits by construction. 128 KB each: one stays in L2 through a prefill's rows. The
   extra entry lets a 4-byte gather read the last one. */
static uint16_t silu_tables[2][65536 + 1];

static inline uint16_t *silu_table(int dtype) { return silu_tables[dtype == F16]; }

__attribute__((constructor)) static void fill_silu_tables(void) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int dtypes[] = {BF16, F16};
    for (int d = 0; d < 2; d++) {
        for (int32_t first = 0; first < 65536; first += LANES) {
            const __m256i gates = _mm512_cvtepi32_epi16(_mm512_add_epi32(_mm512_set1_epi32(first), lane));
            const v16 silu = silu_rounded(widen_half(gates, dtypes[d]));
            _mm256_storeu_si256((__m256i *)(silu_table(dtypes[d]) + first), narrow_half(silu, dtypes[d]));
        }
    }
}

/* silu of 16 gates of dtype from its table, as float32 lanes (a gather of 4 bytes from each
   gate's entry, its low half the entry: for bf16, shifted into the float's top half in place). */
static inline v16 silu_of_half(__m256i gates, int dtype) {
    const __m512i entries = _mm512_i32gather_epi32(_mm512_cvtepu16_epi32(gates), silu_table(dtype), 2);
    if (dtype == BF16) return (v16)_mm512_slli_epi32(entries, 16);
    return (v16)_mm512_cvtph_ps(_mm512_cvtepi32_epi16(entries));
}

/* One bf16 / fp16 row of silu(gate) * up, 16 values a step (the last masked), each op rounded
   to its dtype as silu_and_mul_row rounds it, with no float32 row buffers: a prefill's rows
   stream through once. bf16 silu from the table: 2048 SmolLM2 rows (1536 columns), 2
   threads, three alternating rounds against the approximate e^x it replaced (which checked
   its margin to a bf16 tie per lane): 1.95-2.18 -> 0.58-0.59 ms (torch's silu * up: 1.60);
   fp16 against the exact path it took until 2026-11-28: 18.9 -> 0.53 ms. */
static void silu_and_mul_half_row(const uint16_t *gate, const uint16_t *up, uint16_t *out,
                                  int64_t cols, int dtype) {
    for (int64_t i = 0; i < cols; i += LANES) {
        const __mmask16 m = lanes_from(i, cols);
        const v16 silu = silu_of_half(_mm256_maskz_loadu_epi16(m, gate + i), dtype);
        const v16 u = widen_half(_mm256_maskz_loadu_epi16(m, up + i), dtype);
        _mm256_mask_storeu_epi16(out + i, m, narrow_half(silu * u, dtype));
    }
}

#endif

/* silu_and_mul_row's float32 row read and written where it lies (the same silu and product,
   16 values a step; a last part-vector through zeroed copies), without its copies into float
   buffers. */
static void silu_and_mul_f32_row(const float *gate, const float *up, float *out, int64_t cols) {
    int64_t i = 0;
    for (; i + LANES <= cols; i += LANES)
        *(v16u *)(out + i) = silu_rounded(*(const v16u *)(gate + i)) * *(const v16u *)(up + i);
    if (i == cols) return;
    v16 g = splat(0.0f), u = splat(0.0f);
    memcpy(&g, gate + i, (size_t)(cols - i) * sizeof(float));
    memcpy(&u, up + i, (size_t)(cols - i) * sizeof(float));
    const v16 tail = silu_rounded(g) * u;
    memcpy(out + i, &tail, (size_t)(cols - i) * sizeof(float));
}

#endif

/* silu(gate) * up over n values in place in gate, rounded as in_dtype after each op. The
   buffers hold whole vectors of 16 (the lanes past n are zeroed and never stored). */
static void silu_and_mul_row(float *gate, float *up, int n, int dtype) {
#ifdef HAVE_EXP_ROUNDED
    const int whole = (n + LANES - 1) / LANES * LANES;
    memset(gate + n, 0, (size_t)(whole - n) * sizeof(float));
    memset(up + n, 0, (size_t)(whole - n) * sizeof(float));
    for (int i = 0; i < whole; i += LANES) {
        const v16 g = *(const v16 *)(gate + i);
        *(v16 *)(gate + i) = silu_rounded(g);
    }
#pragma omp simd
    for (int i = 0; i < n; i++) gate[i] = in_dtype(in_dtype(gate[i], dtype) * up[i], dtype);
#else
    for (int i = 0; i < n; i++) {
        const float silu = in_dtype(gate[i] / (1.0f + expf(-gate[i])), dtype);
        gate[i] = in_dtype(silu * up[i], dtype);
    }
#endif
}

/* The gated MLP's activation: out [rows, cols] = silu(gate) * up, where each row of gate_up is
   gate's cols values then up's; silu and the product each rounded to the activation dtype, as
   the reference's two ops round them (e^x rounded once from double: with the C library's
   expf, one value at a time, 64 rows took 5x torch's time). gate_up rows may be strided; out
   is contiguous. */
void hr_silu_and_mul(const void *gate_up, int64_t stride, void *out, int64_t num_rows,
                     int64_t cols, int dtype) {
    const size_t size = dtype_size(dtype);
#ifdef HALF_LANES
    if (is_half(dtype)) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            const uint16_t *row = (const uint16_t *)gate_up + r * stride;
            silu_and_mul_half_row(row, row + cols, (uint16_t *)out + r * cols, cols, dtype);
        }
        return;
    }
#endif
#ifdef HAVE_EXP_ROUNDED
    if (dtype == F32) {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            const float *row = (const float *)gate_up + r * stride;
            silu_and_mul_f32_row(row, row + cols, (float *)out + r * cols, cols);
        }
        return;
    }
#endif
#pragma omp for schedule(static)
    for (int64_t r = 0; r < num_rows; r++) {
        float gate[RMS_NORM_MAX_COLS] __attribute__((aligned(64)));
        float up[RMS_NORM_MAX_COLS] __attribute__((aligned(64)));
        for (int64_t first = 0; first < cols; first += RMS_NORM_MAX_COLS) {
            const int n = (int)(cols - first < RMS_NORM_MAX_COLS ? cols - first : RMS_NORM_MAX_COLS);
            const char *row = (const char *)gate_up + r * stride * size;
            load_row(row + first * size, dtype, gate, n);
            load_row(row + (cols + first) * size, dtype, up, n);
            silu_and_mul_row(gate, up, n, dtype);
            store_row((char *)out + (r * cols + first) * size, dtype, gate, n);
        }
    }
}

void headrace_silu_and_mul(const void *gate_up, int64_t stride, void *out, int64_t num_rows,
                           int64_t cols, int dtype) {
#pragma omp parallel if (num_rows * cols >= ROWWISE_PARALLEL_ELEMENTS)
    hr_silu_and_mul(gate_up, stride, out, num_rows, cols, dtype);
}
