/* y = x w^T (+ bias) for bf16 x against bf16 weights packed once into panels, where the CPU
   has AVX512-BF16's pair dot instruction (vdpbf16ps) and no AMX tiles take the rows.

   Why: cpu_kernels.c's skinny kernel reads the weights as they lie, row by row, so each of
   its 16 lanes sums a share of one output's products and every output ends in a reduction
   across lanes and a store of a few values. At K = 576 that tail cost about a fifth of a
   tile, and from 16 rows on the kernel ran at about 280 GFLOP/s, 65% of what oneDNN's bf16
   GEMM reaches on the same two cores. Here a lane holds a whole output: no reduction, and a
   tile's outputs are stored 16 at a time.

   Layout (headrace_pack_panels): the weights [N, K] in panels of PANEL_ROWS weight rows; a
   panel holds, for each pair of k (2j, 2j + 1), its rows' two weights side by side:
   [ceil(N / 32)][ceil(K / 2)][32][2] bf16, zeros past N and K. One 64-byte load is 16 weight
   rows' pair j; a row of x's pair j is broadcast to all lanes, and the dot instruction adds
   each lane's two products to that lane's output. A panel is 32 rows' weights contiguous, so a
   thread's run of panels streams from memory in order.

   Summation: each output adds its pairs' products in order of j (the instruction's sum of a
   pair into the accumulator), then its bias, and is rounded once to y's dtype. A row of x
   meets the same instructions whatever the other rows are: its result does not depend on the
   batch, at any row count.

   Tiles: PANEL_TILE_ROWS rows of x against a panel: 24 accumulators, the panel's two
   vectors and a broadcast in the 32 vector registers. The panel is read from memory by the
   first block of rows and from cache by the rest. This keeps the dot instruction busy at
   any row count: on the 2-core Zen 4, 392 GFLOP/s at 64 rows and 406 at 1024, where
   oneDNN's GEMM made 356 and 399, so the panels take a bf16 parameter's rows at every
   count (kernels/cpu_ops.py). */

#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

#define PANEL_ROWS 32
#define PANEL_TILE_ROWS 12
/* Outputs per accumulator (a panel's rows are two of them). */
#define PANEL_LANES 16

int64_t headrace_panel_elements(int64_t N, int64_t K) {
    return (N + PANEL_ROWS - 1) / PANEL_ROWS * PANEL_ROWS * ((K + 1) / 2 * 2);
}

/* w [N, K] bf16 (contiguous) into panels at out (headrace_panel_elements(N, K) values). */
void headrace_pack_panels(const uint16_t *w, int64_t N, int64_t K, uint16_t *out) {
    const int64_t panels = (N + PANEL_ROWS - 1) / PANEL_ROWS, pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static) if (N * K >= (1 << 15))
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *panel = out + p * pairs * 2 * PANEL_ROWS;
        for (int r = 0; r < PANEL_ROWS; r++) {
            const int64_t n = p * PANEL_ROWS + r;
            for (int64_t k = 0; k < 2 * pairs; k++)
                panel[(k / 2 * PANEL_ROWS + r) * 2 + k % 2] = n < N && k < K ? w[n * K + k] : 0;
        }
    }
}

#if defined(__AVX512BF16__)

/* One call's operands: x [M, K] bf16 (rows strided), the panels, bias [N] float32 or NULL,
   y [M, N] in y_dtype (rows strided). */
typedef struct {
    const uint16_t *x;
    int64_t x_stride, M;
    const uint16_t *w;
    int64_t N, K;
    const float *bias;
    void *y;
    int64_t y_stride;
    int y_dtype;
} Panels;

/* Pair j of the panel at w against rows [m0, m0 + rows) of x: each row's pair (2j, 2j + 1),
   or for the last of an odd K its value alone, in every lane. */
static inline __attribute__((always_inline)) void panel_step(const Panels *p, const uint16_t *w,
                                                             int64_t m0, int rows, int64_t j,
                                                             int lone,
                                                             __m512 acc[PANEL_TILE_ROWS][2]) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + j * 2 * PANEL_ROWS);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + j * 2 * PANEL_ROWS + 2 * PANEL_LANES);
    for (int r = 0; r < rows; r++) {
        const uint16_t *row = p->x + (m0 + r) * p->x_stride + 2 * j;
        uint32_t pair = row[0];
        if (!lone) memcpy(&pair, row, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
}

/* Rows [m0, m0 + rows) of x against panel `panel`, into y (+ bias). */
static inline __attribute__((always_inline)) void panel_tile(const Panels *p, int64_t panel,
                                                             int64_t m0, int rows) {
    const int64_t pairs = (p->K + 1) / 2, n0 = panel * PANEL_ROWS;
    const uint16_t *w = p->w + panel * pairs * 2 * PANEL_ROWS;
    __m512 acc[PANEL_TILE_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t j = 0; j < p->K / 2; j++) panel_step(p, w, m0, rows, j, 0, acc);
    if (p->K % 2) panel_step(p, w, m0, rows, pairs - 1, 1, acc);
    const size_t size = dtype_size(p->y_dtype);
    for (int h = 0; h < 2; h++) {
        const int64_t first = n0 + h * PANEL_LANES;
        if (first >= p->N) break;
        const __mmask16 cols = p->N - first >= PANEL_LANES ? 0xFFFF : (__mmask16)((1u << (p->N - first)) - 1);
        const __m512 bias = p->bias != NULL ? _mm512_maskz_loadu_ps(cols, p->bias + first)
                                            : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            char *y = (char *)p->y + ((m0 + r) * p->y_stride + first) * (int64_t)size;
            store_lanes(y, p->y_dtype, p->bias != NULL ? _mm512_add_ps(acc[r][h], bias) : acc[r][h], cols);
        }
    }
}

/* panel_tile with its row count a constant: the compiler unrolls the rows and keeps their
   accumulators in registers. */
static void panel_rows(const Panels *p, int64_t panel, int64_t m0, int rows) {
    switch (rows) {
    case 1: panel_tile(p, panel, m0, 1); break;
    case 2: panel_tile(p, panel, m0, 2); break;
    case 3: panel_tile(p, panel, m0, 3); break;
    case 4: panel_tile(p, panel, m0, 4); break;
    case 5: panel_tile(p, panel, m0, 5); break;
    case 6: panel_tile(p, panel, m0, 6); break;
    case 7: panel_tile(p, panel, m0, 7); break;
    case 8: panel_tile(p, panel, m0, 8); break;
    case 9: panel_tile(p, panel, m0, 9); break;
    case 10: panel_tile(p, panel, m0, 10); break;
    case 11: panel_tile(p, panel, m0, 11); break;
    default: panel_tile(p, panel, m0, PANEL_TILE_ROWS);
    }
}

void hr_panel_linear(const void *x, int64_t x_stride, int64_t M, const void *panels, int64_t N,
                     int64_t K, const float *bias, void *y, int64_t y_stride, int y_dtype) {
    const Panels p = {.x = x, .x_stride = x_stride, .M = M, .w = panels, .N = N, .K = K,
                      .bias = bias, .y = y, .y_stride = y_stride, .y_dtype = y_dtype};
    const int64_t count = (N + PANEL_ROWS - 1) / PANEL_ROWS;
    /* static: each thread one contiguous run of panels, read in order */
#pragma omp for schedule(static)
    for (int64_t panel = 0; panel < count; panel++)
        for (int64_t m0 = 0; m0 < M; m0 += PANEL_TILE_ROWS)
            panel_rows(&p, panel, m0, M - m0 < PANEL_TILE_ROWS ? (int)(M - m0) : PANEL_TILE_ROWS);
}

#else

/* Without the pair instruction hr_skinny_linear never takes panels. */
void hr_panel_linear(const void *x, int64_t x_stride, int64_t M, const void *panels, int64_t N,
                     int64_t K, const float *bias, void *y, int64_t y_stride, int y_dtype) {
    (void)x, (void)x_stride, (void)M, (void)panels, (void)N, (void)K, (void)bias, (void)y,
        (void)y_stride, (void)y_dtype;
}

#endif
