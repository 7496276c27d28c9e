"""A mixture block's experts in one C call (`cpu_experts`) against the per-op path.

Both run the same C ops, so every value must match bit for bit (torch.equal): float32 and
bfloat16 experts, 8- and 4-bit ones (with float or int8 activations), experts with no rows,
one row and several. `fits` refuses what the call does not take: another dtype, rows not
contiguous, more rows for one expert than the skinny matmul takes, experts held differently.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from headrace.kernels import cpu_decode, cpu_ops, quantized
from headrace.kernels.cpu_experts import ExpertMatrices, ExpertStack
from torch import nn

from tests.kernels import needs_c_compiler

pytestmark = needs_c_compiler

HIDDEN, INTERMEDIATE = 128, 96
#: Rows per expert: none, one, several, and none again at the end.
COUNTS = [0, 1, 5, 3, 0, 2, 7, 0]


def make_experts(
    dtype: torch.dtype, bits: int = 0, int8_activations: bool = False, seed: int = 0
) -> list[ExpertMatrices]:
    generator = torch.Generator().manual_seed(seed)

    def matrix(rows: int, cols: int) -> cpu_decode.Matrix:
        w = torch.randn(rows, cols, generator=generator) / cols**0.5
        if not bits:
            return w.to(dtype)
        held = quantized.quantize(w, bits, quantized.INT4_GROUP_SIZE)
        return dataclasses.replace(held, int8_activations=int8_activations)

    return [
        (matrix(2 * INTERMEDIATE, HIDDEN), matrix(HIDDEN, INTERMEDIATE)) for _ in range(len(COUNTS))
    ]


def per_op(experts: list[ExpertMatrices], grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """`SparseMoe.run_experts`' loop: each expert's GatedMLP over its rows, op by op."""

    def multiply(x: torch.Tensor, w: cpu_decode.Matrix) -> torch.Tensor:
        if isinstance(w, torch.Tensor):
            return cpu_ops.linear(x, w)
        return cpu_ops.quantized_linear(x, w)

    out = torch.zeros_like(grouped)
    start = 0
    for (gate_up, down), count in zip(experts, counts, strict=True):
        if count:
            rows = grouped[start : start + count]
            out[start : start + count] = multiply(
                cpu_ops.silu_and_mul(multiply(rows, gate_up)), down
            )
        start += count
    return out


def rows_of(dtype: torch.dtype, counts: list[int], seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(sum(counts), HIDDEN, generator=generator).to(dtype)


@pytest.mark.parametrize(
    ("dtype", "bits", "int8_activations"),
    [
        (torch.float32, 0, False),
        (torch.bfloat16, 0, False),
        (torch.float32, 8, False),
        (torch.float32, 4, False),
        (torch.bfloat16, 4, False),
        (torch.float32, 8, True),
        (torch.float32, 4, True),
    ],
)
def test_one_call_equals_the_per_op_path(
    dtype: torch.dtype, bits: int, int8_activations: bool
) -> None:
    experts = make_experts(dtype, bits, int8_activations)
    stack = ExpertStack(experts, dtype)
    for counts in (COUNTS, [1] * len(COUNTS), [0, 0, 0, 4, 0, 0, 0, 0]):
        grouped = rows_of(dtype, counts)
        assert stack.fits(grouped, counts)
        out = torch.full_like(grouped, float("nan"))
        stack.run(grouped, counts, out)
        assert torch.equal(out, per_op(experts, grouped, counts)), counts


def test_no_rows_at_all_writes_nothing() -> None:
    stack = ExpertStack(make_experts(torch.float32), torch.float32)
    counts = [0] * len(COUNTS)
    grouped = rows_of(torch.float32, counts)
    assert stack.fits(grouped, counts)
    stack.run(grouped, counts, torch.empty_like(grouped))


def test_an_expert_with_no_rows_is_not_read() -> None:
    """Its matrices' pointers are never followed: null ones do not crash the call."""
    experts = make_experts(torch.float32)
    stack = ExpertStack(experts, torch.float32)
    counts = [0, 2, 0, 0, 0, 0, 0, 0]
    grouped = rows_of(torch.float32, counts)
    expected = per_op(experts, grouped, counts)
    stack.experts = [
        (torch.empty(0), torch.empty(0)) if count == 0 else pair
        for pair, count in zip(experts, counts, strict=True)
    ]  # (data_ptr 0)
    out = torch.empty_like(grouped)
    stack.run(grouped, counts, out)
    assert torch.equal(out, expected)


def test_fits_refuses_what_the_call_does_not_take() -> None:
    stack = ExpertStack(make_experts(torch.float32), torch.float32)
    grouped = rows_of(torch.float32, COUNTS)
    assert stack.fits(grouped, COUNTS)
    assert not stack.fits(grouped.to(torch.bfloat16), COUNTS)  # another dtype
    wide = rows_of(torch.float32, [2 * n for n in COUNTS])
    assert not stack.fits(wide[::2], COUNTS)  # rows not contiguous
    assert not stack.fits(grouped, COUNTS[:-1])  # a count per expert
    too_many = [0] * len(COUNTS)
    too_many[3] = cpu_ops.skinny_max_rows(torch.float32) + 1  # the per-op path's GEMM rows
    assert not stack.fits(rows_of(torch.float32, too_many), too_many)


def test_experts_held_differently_are_not_served() -> None:
    mixed = make_experts(torch.float32)
    mixed[2] = make_experts(torch.float32, bits=8)[2]  # one quantized, the others float
    assert not ExpertStack(mixed, torch.float32).usable
    # float matrices in another dtype than the activations'
    assert not ExpertStack(make_experts(torch.bfloat16), torch.float32).usable
    grouped = rows_of(torch.float32, COUNTS)
    assert not ExpertStack(mixed, torch.float32).fits(grouped, COUNTS)


def test_holds_only_the_matrices_it_was_built_from() -> None:
    experts = make_experts(torch.float32)
    stack = ExpertStack(experts, torch.float32)
    assert stack.holds(list(experts))
    moved = list(experts)
    moved[0] = (experts[0][0].clone(), experts[0][1])
    assert not stack.holds(moved)


def test_the_pointer_table_is_made_once_and_again_after_a_write(monkeypatch) -> None:
    """The call keeps its table of pointers from call to call (making it looks up every
    weight's panels), and makes it again once a weight is written through its parameter:
    bf16 panels are packed again, and the output is the per-op path's over the new weights."""
    old, new = make_experts(torch.bfloat16, seed=0), make_experts(torch.bfloat16, seed=1)
    experts = [
        (nn.Parameter(g, requires_grad=False), nn.Parameter(d, requires_grad=False)) for g, d in old
    ]
    stack = ExpertStack(experts, torch.bfloat16)
    looked_up: list[cpu_decode.Matrix] = []
    inner = cpu_decode.matrix_pointers
    monkeypatch.setattr(cpu_decode, "matrix_pointers", lambda m: looked_up.append(m) or inner(m))
    grouped = rows_of(torch.bfloat16, COUNTS)
    out = torch.empty_like(grouped)
    for _ in range(2):
        stack.run(grouped, COUNTS, out)
    assert len(looked_up) == 2 * len(experts)  # one table
    assert torch.equal(out, per_op(experts, grouped, COUNTS))
    for (gate_up, down), (new_gate_up, new_down) in zip(experts, new, strict=True):
        gate_up.copy_(new_gate_up)
        down.copy_(new_down)
    stack.run(grouped, COUNTS, out)
    assert len(looked_up) == 4 * len(experts)
    assert torch.equal(out, per_op(new, grouped, COUNTS))
