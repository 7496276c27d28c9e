/* A mixture-of-experts block's experts in one call and one OpenMP region.

   At a decode step's few rows each expert is three small kernel calls (gate/up matmul,
   silu * up, down matmul), each a Python wrapper, a ctypes call and an OpenMP region of its
   own, and a model has some experts per layer times its layers: about 5 ms of a 48 ms step
   on a Qwen3-MoE-shaped model at 24 rows, where the weights take the rest to read. Here the
   experts run back to back, each op the hr_ function its exported kernel calls, separated by
   barriers instead of regions: every value is the one the per-op path computes, bit for bit.

   The rows arrive grouped (worker/layers/moe.py's run_experts): each expert's rows
   contiguous, in expert order. An expert with no rows is skipped, its weights never read.
   Every matrix is in the activations' dtype, or all are quantized alike (kernels/quantized.py:
   the same bits and group size). The caller checks that every expert's rows are few enough
   for the skinny matmul, as the per-op path would take them, and keeps to that path
   otherwise. */

#include <stdlib.h>

#include "cpu_kernels.h"

/* Each expert's matrices, as data pointers: the row of `experts` for expert e. */
enum {
    GATE_UP = 0,                   /* [2 I, hidden]: the gate's rows, then up's */
    DOWN = GATE_UP + MATRIX_SLOTS, /* [hidden, I] */
    EXPERT_TENSORS = DOWN + MATRIX_SLOTS /* row length */
};

/* out [N, hidden] = each expert's MLP over its rows of x [N, hidden], N the sum of counts:
   rows [start_e, start_e + counts[e]) get down_e(silu(gate_e x) * up_e x). Returns 0, or -1
   when memory ran out (out is then undefined). */
int headrace_moe_experts(const void *x, void *out, int num_experts,
                         const int64_t *counts,  /* [num_experts]: each expert's rows */
                         const int64_t *experts, /* [num_experts, EXPERT_TENSORS] pointers */
                         int64_t hidden_size, int64_t intermediate_size, int dtype,
                         int weight_bits, int64_t group_size, int int8_activations) {
    const int64_t I = intermediate_size;
    const size_t size = dtype == F32 ? 4 : 2;
    const MatrixLayout w = {.bits = weight_bits, .group_size = group_size,
                            .int8_activations = int8_activations};
    int64_t max_rows = 0;
    for (int e = 0; e < num_experts; e++) max_rows = counts[e] > max_rows ? counts[e] : max_rows;
    if (max_rows == 0) return 0;
    /* One expert's gate/up and silu * up rows, and the widened (or int8) x of a matmul. */
    const size_t gate_up_bytes = ((size_t)(max_rows * 2 * I) * size + 63) / 64 * 64;
    const size_t act_bytes = ((size_t)(max_rows * I) * size + 63) / 64 * 64;
    const int64_t widest = hidden_size > I ? hidden_size : I;
    const int64_t a8 = hr_a8_floats(max_rows, widest);
    const int64_t skinny = hr_skinny_floats(max_rows, widest);
    const size_t wide_bytes = (size_t)(a8 > skinny ? a8 : skinny) * 4;
    char *base = aligned_alloc(64, (gate_up_bytes + act_bytes + wide_bytes + 63) / 64 * 64);
    if (base == NULL) return -1;
    char *gate_up = base, *act = base + gate_up_bytes;
    float *wide = (float *)(act + act_bytes);
#pragma omp parallel
    {
        int64_t start = 0; /* each thread walks the experts alike */
        for (int e = 0; e < num_experts; e++) {
            const int64_t rows = counts[e];
            const int64_t *t = experts + (int64_t)e * EXPERT_TENSORS;
            if (rows > 0) {
                const char *x_e = (const char *)x + start * hidden_size * (int64_t)size;
                char *out_e = (char *)out + start * hidden_size * (int64_t)size;
                hr_matmul(x_e, rows, t + GATE_UP, w, 2 * I, hidden_size, gate_up, dtype, wide);
                hr_silu_and_mul(gate_up, 2 * I, act, rows, I, dtype);
                hr_matmul(act, rows, t + DOWN, w, hidden_size, I, out_e, dtype, wide);
            }
            start += rows;
        }
    }
    free(base);
    return 0;
}
