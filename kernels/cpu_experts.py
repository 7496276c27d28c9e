"""A mixture-of-experts block's experts in one C call (``kernels/csrc/moe_experts.c``).

At a decode step's few rows each expert of the per-op path is three kernel calls (gate/up,
silu * up, down), each a Python wrapper, ctypes and an OpenMP region, for every expert of
every layer; this runs the same C ops back to back in one region, so every value is the
per-op path's, bit for bit. It serves plain experts (gated SiLU, no biases, no LoRA) whose
matrices are all in the activations' dtype or all quantized alike
(`headrace.kernels.quantized`), for blocks whose every expert has few enough rows for the
skinny matmul; `worker/layers/moe.py` asks `ExpertStack.fits` and keeps to the per-op path
otherwise.
"""

from __future__ import annotations

import torch
from headrace.kernels import cpu_decode, cpu_ops
from headrace.kernels.cpu_decode import Matrix

#: Pointers per expert, in moe_experts.c's order: gate_up, then down, each (data, scales,
#: offsets).
_EXPERT_TENSORS = 6

#: An expert's matrices: gate_up [2 I, hidden] (the gate's rows, then up's), down [hidden, I].
ExpertMatrices = tuple[Matrix, Matrix]


class ExpertStack:
    """A rank's experts for `run`: their matrices (the parameters themselves, whose pointers
    are read again after an in-place write, so weight updates are seen), checked once for what the C
    call needs: one dtype it takes, or one quantized layout, contiguous, in CPU memory."""

    def __init__(
        self,
        experts: list[ExpertMatrices],
        dtype: torch.dtype,  # the activations'
    ) -> None:
        self.experts = experts
        self.dtype = dtype
        _, down = experts[0]
        self.hidden_size, self.intermediate_size = down.shape
        gate_up_shape = (2 * self.intermediate_size, self.hidden_size)
        same_shapes = all(
            tuple(g.shape) == gate_up_shape and tuple(d.shape) == tuple(down.shape)
            for g, d in experts
        )
        #: (bits, group size, int8 activations) of the matrices (`cpu_decode.common_layout`);
        #: None where the C call cannot read them.
        matrices = [m for pair in experts for m in pair]
        self.weights = cpu_decode.common_layout(matrices, dtype) if same_shapes else None
        in_c = dtype in (torch.float32, torch.bfloat16, torch.float16)
        self.usable = cpu_ops.available() and in_c and self.weights is not None
        tensors = [t for m in matrices for t in cpu_decode.matrix_tensors(m)]
        self._pointers = cpu_decode.PointerTable(tensors)

    def _pointer_list(self) -> list[int]:
        """moe_experts.c's rows: each expert's gate_up, then down."""
        return [
            pointer
            for gate_up, down in self.experts
            for pointer in (*cpu_decode.matrix_pointers(gate_up), *cpu_decode.matrix_pointers(down))
        ]

    def holds(self, experts: list[ExpertMatrices]) -> bool:
        """Whether these are the matrices the stack was built from (a quantized weight moved
        to another device is a new object: the stack must be rebuilt)."""
        given = [m for pair in experts for m in pair]
        held = [m for pair in self.experts for m in pair]
        return len(given) == len(held) and all(a is b for a, b in zip(given, held, strict=True))

    def fits(self, grouped: torch.Tensor, counts: list[int]) -> bool:
        """Whether the per-op path would multiply every expert's rows (``counts``, one per
        expert of the stack) in the C kernels this call runs: grouped [N, hidden] contiguous
        in the stack's dtype, and no expert with more rows than the skinny matmul takes."""
        if not self.usable or self.weights is None or len(counts) != len(self.experts):
            return False
        if not cpu_decode.in_kernel(grouped, self.dtype) or grouped.shape[0] != sum(counts):
            return False
        return max(counts, default=0) <= cpu_decode.max_rows(self.weights, self.dtype)

    def run(self, grouped: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
        """out [N, hidden] (contiguous, in the stack's dtype) = each expert's MLP over its
        rows of grouped [N, hidden], as the per-op path computes it (the caller checked
        `fits`); an expert with no rows is skipped, its weights never read."""
        assert self.weights is not None and out.shape == grouped.shape and out.is_contiguous()
        table = self._pointers.get(self._pointer_list)  # [E * _EXPERT_TENSORS]
        rows = torch.tensor(counts, dtype=torch.int64)  # [E]
        assert table.numel() == len(self.experts) * _EXPERT_TENSORS
        status = cpu_ops.library().headrace_moe_experts(
            grouped.data_ptr(),
            out.data_ptr(),
            len(self.experts),
            rows.data_ptr(),
            table.data_ptr(),
            self.hidden_size,
            self.intermediate_size,
            cpu_ops.dtype_code(self.dtype),
            *self.weights,
        )
        if status != 0:
            raise MemoryError("the experts could not allocate their buffers")
