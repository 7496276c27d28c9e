"""Batched LoRA shrink / expand: the torch reference against a plain per-row loop, and the
Triton kernels (the CPU interpreter here, compiled on a GPU) against the reference, over
batches mixing adapter slots and base rows, ranks that are not powers of two, and a column
slice of a wider shrink output (a fused q | k | v layer's pieces).

Tolerances: fp32 agrees to float rounding; bf16 is compared after both round once to bf16.
"""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import reference, triton_ops
from headrace.kernels.lora import LoraIndices

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
#: Row slots: all base, one adapter for every row, and a mix with base rows between.
SLOT_PATTERNS = {
    "all-base": [-1] * 5,
    "one-adapter": [2] * 7,
    "mixed": [0, -1, 3, 0, 1, -1, 3, 3, 2, 0, -1],
}


def per_row(
    x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: list[int]
) -> torch.Tensor:  # [T, out]: B_s A_s x per row, in float64
    rows = []
    for row, slot in zip(x.double(), slots, strict=True):
        if slot < 0:
            rows.append(torch.zeros(b.shape[2], dtype=torch.float64))
        else:
            rows.append((a[slot].double() @ row) @ b[slot].double())
    return torch.stack(rows)


def weights(num_slots: int, rank: int, in_features: int, out_features: int, dtype):
    generator = torch.Generator().manual_seed(rank * 31 + in_features)
    a = torch.randn(num_slots, rank, in_features, generator=generator) / in_features**0.5
    b = torch.randn(num_slots, rank, out_features, generator=generator) / rank**0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("rank", [4, 12])
def test_reference_equals_per_row_loop(pattern, rank):
    slots = SLOT_PATTERNS[pattern]
    a, b = weights(4, rank, 48, 40, torch.float32)
    x = torch.randn(len(slots), 48, device=DEVICE)
    indices = LoraIndices.build(slots, 4, torch.device(DEVICE), torch.float32)
    y = torch.randn(len(slots), 50, device=DEVICE)
    before = y.clone()
    h = reference.lora_shrink(x, a, indices)
    reference.lora_expand(h, b, indices, y, offset=6)
    expected = per_row(x.cpu(), a.cpu(), b.cpu(), slots)
    delta = y[:, 6:46].cpu().double() - before[:, 6:46].cpu().double()
    torch.testing.assert_close(delta, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[:, :6], before[:, :6]) and torch.equal(y[:, 46:], before[:, 46:])


def test_indices_group_rows_by_slot():
    cpu = torch.device("cpu")
    indices = LoraIndices.build(SLOT_PATTERNS["mixed"], 4, cpu, torch.float32)
    groups = {g.slot: g.rows.tolist() for g in indices.groups if g.rows is not None}
    assert groups == {0: [0, 3, 9], 1: [4], 2: [8], 3: [2, 6, 7]}
    whole = LoraIndices.build([2, 2, 2], 4, cpu, torch.float32)
    assert [(g.slot, g.rows) for g in whole.groups] == [(2, None)]
    assert not LoraIndices.build([-1, -1], 4, cpu, torch.float32).active
    assert indices.slot_mask[:, :, 0].tolist()[:3] == [[1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("rank", [8, 12])
def test_triton_equals_reference(dtype, pattern, rank):
    slots = SLOT_PATTERNS[pattern]
    num_pieces = 3  # a fused q | k | v: one shrink, three expands into their own columns
    a, _ = weights(4, num_pieces * rank, 96, 1, dtype)
    bs = [weights(4, rank, 1, out, dtype)[1] for out in (64, 32, 32)]
    x = torch.randn(len(slots), 96, device=DEVICE).to(dtype)
    indices = LoraIndices.build(slots, 4, torch.device(DEVICE), dtype)
    y0 = torch.randn(len(slots), 128, device=DEVICE).to(dtype)
    outputs = []
    for ops in (reference, triton_ops):
        y = y0.clone()
        h = ops.lora_shrink(x, a, indices)
        offset = 0
        for i, b in enumerate(bs):
            ops.lora_expand(h[:, i * rank : (i + 1) * rank], b, indices, y, offset)
            offset += b.shape[2]
        outputs.append((h, y))
    (h_ref, y_ref), (h_tri, y_tri) = outputs
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(h_tri.float(), h_ref.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(y_tri.float(), y_ref.float(), atol=tol, rtol=tol)
    base_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y_tri[base_rows], y0[base_rows])
