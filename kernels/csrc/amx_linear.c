/* y = x w^T (+ bias) for bf16 x and bf16 weights on AMX tiles (Intel's Advanced Matrix
   Extensions: eight 1 KB tile registers and a bf16 dot-product unit), where the CPU has them.

   Why: a decode step multiplies every weight by a few to a few dozen rows. From 3 rows on,
   the vector kernel of cpu_kernels.c (skinny_linear's pairs) runs out of arithmetic, and
   oneDNN's AMX GEMM read its packed weights at 13-22 GB/s, where this kernel reads the
   weights as they lie at 23-35 GB/s up to 32 rows (numbers in kernels/cpu_ops.py).

   Layout. A tile product C[16][16] += A[16][32 bf16] B[16 pairs][16][2] takes A's rows as
   they lie and B as pairs of consecutive k. The weights w [N, K] lie row-major, so 16 weight
   rows are an A tile as they are (a 64-byte piece of each row, the row stride apart); x is
   repacked per call into B tiles (each 16 rows of x: for each pair of k, the 16 rows' pairs),
   and the product is C^T: C[n][m] = w_n . x_m. x is small beside w (its repacking is shared
   out among the threads first), so the weights stream from memory once, in place, with no
   packed copy. Each work item takes 32 weight rows against 32 rows of x at a time, a 2 x 2
   square of C tiles: each tile loaded meets two products.

   Summation. Each output is the tile unit's sum over k in 32-element steps, in the order its
   instruction fixes; a row of x meets the same instructions whatever the other rows are
   (padding rows are zeros), so a row's result does not depend on the batch.

   The tiles need the kernel's leave (arch_prctl ARCH_REQ_XCOMP_PERM): `headrace_amx_init`
   asks once per process; until it has been granted, `hr_amx_takes` is false. */

#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX 1
#else
#define HAVE_AMX 0
#endif

/* The Linux request for the tile data state (asm/prctl.h, and XFEATURE_XTILEDATA). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Rows of a tile (weight rows and x rows alike), and k per step (bf16 elements in 64 bytes). */
#define AMX_ROWS 16
#define AMX_STEP 32
/* Bytes of the next item's weights (per weight block) each step prefetches into L2: the next
   32 rows are there by the time their item starts. */
#define AMX_PREFETCH_BYTES 1024

static int amx_granted = 0;

/* Ask for the tiles (once; later calls return the answer). Returns whether they are granted:
   0 where the library was compiled without AMX or the kernel refuses. */
int headrace_amx_init(void) {
#if HAVE_AMX
    if (!amx_granted) amx_granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
    return amx_granted;
}

int hr_amx_takes(int64_t M, int64_t N, int64_t K) {
    return amx_granted && M > 0 && N % (2 * AMX_ROWS) == 0 && K % AMX_STEP == 0;
}

int64_t hr_amx_scratch_floats(int64_t M, int64_t K) {
    return (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS * K / 2;
}

#if HAVE_AMX

/* The tile configuration (palette 1): tiles 0-3 C, 4-5 A, 6-7 B, each 16 rows of 64 bytes. */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;

static void configure_tiles(void) {
    TileConfig config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < 8; t++) config.colsb[t] = 64, config.rows[t] = AMX_ROWS;
    _tile_loadconfig(&config);
}

/* x [M, K] bf16 (rows strided) into B tiles: block b of 16 rows is [K / 2][16] pairs (32-bit),
   pair p of row m at [p][m % 16]; rows past M are zeros. Shared out among the threads. */
static void pack_rows(const uint16_t *x, int64_t x_stride, int64_t M, int64_t K, uint32_t *packed) {
    const int64_t blocks = (M + AMX_ROWS - 1) / AMX_ROWS, steps = K / AMX_STEP;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < blocks * steps; item++) {
        const int64_t b = item / steps, s = item % steps;
        uint32_t *dst = packed + (b * (K / 2) + s * AMX_ROWS) * AMX_ROWS;
        for (int i = 0; i < AMX_ROWS; i++) {
            const int64_t m = b * AMX_ROWS + i;
            uint32_t pairs[AMX_ROWS] = {0};
            if (m < M) memcpy(pairs, x + m * x_stride + s * AMX_STEP, sizeof pairs);
            for (int p = 0; p < AMX_ROWS; p++) dst[p * AMX_ROWS + i] = pairs[p];
        }
    }
}

/* Two weight blocks' products with one or two blocks of x, in a 2 x 2 square of C tiles:
   tile 0 w block 0 against x block 0, 1 w block 1 against x block 0, 2 and 3 the same against
   x block 1. Each tile loaded meets two others (one load per product): weight blocks in
   tiles 4 and 5, x blocks in 6 and 7. */
static inline void multiply_pair(const uint16_t *w_pair, int64_t K, const char *x_pair, int two,
                                 const char *next, int64_t next_bytes) {
    const int64_t block_bytes = K / 2 * AMX_ROWS * 4, row_bytes = K * 2, steps = K / AMX_STEP;
    const uint16_t *w1 = w_pair + AMX_ROWS * K;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < steps; s++) {
        /* the next pair of weight blocks, whole by the end of this one */
        const int64_t ahead = s * 2 * AMX_PREFETCH_BYTES;
        for (int64_t o = 0; o < 2 * AMX_PREFETCH_BYTES && ahead + o < next_bytes; o += 64)
            __builtin_prefetch(next + ahead + o, 0, 2);
        const char *xs = x_pair + s * AMX_ROWS * 64;
        _tile_loadd(4, w_pair + s * AMX_STEP, row_bytes);
        _tile_loadd(6, xs, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(5, w1 + s * AMX_STEP, row_bytes);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
            _tile_loadd(7, xs + block_bytes, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* rows[i] lane j <- rows[j] lane i, for a 16 x 16 block of float32: pairs of rows
   interleaved by 32 bits, then by 64, then 128-bit lanes gathered across four rows each. */
static inline void transpose_16(__m512 rows[AMX_ROWS]) {
    __m512 t[AMX_ROWS], u[AMX_ROWS];
    for (int i = 0; i < AMX_ROWS; i += 2) {
        t[i] = _mm512_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(rows[i], rows[i + 1]);
    }
    /* u[4q + k], lane l: element 4l + k of rows 4q .. 4q + 3 */
    for (int q = 0; q < AMX_ROWS; q += 4) {
        const __m512d a = (__m512d)t[q], b = (__m512d)t[q + 1], c = (__m512d)t[q + 2],
                      d = (__m512d)t[q + 3];
        u[q] = (__m512)_mm512_unpacklo_pd(a, c);
        u[q + 1] = (__m512)_mm512_unpackhi_pd(a, c);
        u[q + 2] = (__m512)_mm512_unpacklo_pd(b, d);
        u[q + 3] = (__m512)_mm512_unpackhi_pd(b, d);
    }
    for (int k = 0; k < 4; k++) {
        const __m512 low01 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x44);
        const __m512 high01 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xEE);
        const __m512 low23 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x44);
        const __m512 high23 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xEE);
        rows[k] = _mm512_shuffle_f32x4(low01, low23, 0x88);
        rows[4 + k] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
        rows[8 + k] = _mm512_shuffle_f32x4(high01, high23, 0x88);
        rows[12 + k] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
    }
}

/* C tile t into y rows [m0, m0 + 16) (those below M), columns [n0, n0 + 16), + bias, each
   rounded once to y's dtype: the tile holds C^T, so it is transposed in registers. */
static void store_block(int t, float *c, int64_t n0, int64_t m0, int64_t M, const float *bias,
                        void *y, int64_t y_stride, int y_dtype) {
    switch (t) {
    case 0: _tile_stored(0, c, 64); break;
    case 1: _tile_stored(1, c, 64); break;
    case 2: _tile_stored(2, c, 64); break;
    default: _tile_stored(3, c, 64); break;
    }
    __m512 rows[AMX_ROWS];
    for (int j = 0; j < AMX_ROWS; j++) rows[j] = _mm512_load_ps(c + j * AMX_ROWS);
    transpose_16(rows);
    const __m512 b = bias != NULL ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int i = 0; i < AMX_ROWS && m0 + i < M; i++)
        store_lanes((char *)y + ((m0 + i) * y_stride + n0) * (int64_t)dtype_size(y_dtype), y_dtype,
                    _mm512_add_ps(rows[i], b), 0xFFFF);
}

void hr_amx_linear(const void *x, int64_t x_stride, int64_t M, const void *w, int64_t N,
                   int64_t K, const float *bias, void *y, int64_t y_stride, int y_dtype,
                   float *scratch) {
    uint32_t *packed = (uint32_t *)scratch;
    pack_rows((const uint16_t *)x, x_stride, M, K, packed); /* ends at a barrier */
    configure_tiles();
    const int64_t x_blocks = (M + AMX_ROWS - 1) / AMX_ROWS, block_bytes = K / 2 * AMX_ROWS * 4;
    const int64_t pair_bytes = 2 * AMX_ROWS * K * 2, num_pairs = N / (2 * AMX_ROWS);
    float c[AMX_ROWS * AMX_ROWS] __attribute__((aligned(64)));
#pragma omp for schedule(static)
    for (int64_t np = 0; np < num_pairs; np++) {
        const uint16_t *w_pair = (const uint16_t *)w + np * 2 * AMX_ROWS * K;
        const int64_t n0 = np * 2 * AMX_ROWS;
        for (int64_t first = 0; first < x_blocks; first += 2) {
            const int two = first + 1 < x_blocks;
            multiply_pair(w_pair, K, (const char *)packed + first * block_bytes, two,
                          (const char *)(w_pair + 2 * AMX_ROWS * K),
                          first == 0 && np + 1 < num_pairs ? pair_bytes : 0);
            for (int t = 0; t < (two ? 4 : 2); t++)
                store_block(t, c, n0 + (t % 2) * AMX_ROWS, (first + t / 2) * AMX_ROWS, M, bias, y,
                            y_stride, y_dtype);
        }
    }
    _tile_release();
}

#else

void hr_amx_linear(const void *x, int64_t x_stride, int64_t M, const void *w, int64_t N,
                   int64_t K, const float *bias, void *y, int64_t y_stride, int y_dtype,
                   float *scratch) {
    (void)x, (void)x_stride, (void)M, (void)w, (void)N, (void)K, (void)bias, (void)y;
    (void)y_stride, (void)y_dtype, (void)scratch;
}

#endif
