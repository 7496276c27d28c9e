"""The CPU backend's fused residual add + RMSNorm, its rotary and the gated MLP's silu * up
equal the torch references.

Rotary rounds each product and the sum as the reference's three ops do: bit for bit in every
dtype. RMSNorm rounds as the reference too, but sums each row's squares in its own fixed
order, so float32 agrees to float rounding (a few ulp) and bf16 / fp16 to one unit of their
last place; the residual sum (one rounded add) is bit for bit. A row's result does not depend
on the other rows, also where the rows are split over threads. silu * up rounds as the
reference's two ops: bit for bit in bf16 / fp16, within an ulp in float32 (another exp).
"""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import cpu_ops, reference

from tests.kernels import needs_c_compiler

pytestmark = needs_c_compiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: One unit in the last place of values near 1 (normalised rows times weights near 1).
ULP = {torch.float32: 4e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _rows(num_rows: int, cols: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, cols, generator=generator).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 5, 300])  # 300 x 576 rows are split over threads
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_the_reference(dtype, num_rows, with_residual) -> None:  # type: ignore[no-untyped-def]
    x = _rows(num_rows, 576, dtype, 0)
    residual = _rows(num_rows, 576, dtype, 1) if with_residual else None
    weight = (1 + 0.1 * _rows(1, 576, torch.float32, 2)[0]).to(dtype)
    normed, total = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    expected, expected_total = reference.rms_norm(x, weight, 1e-5, residual)
    assert normed.dtype == dtype and normed.shape == x.shape
    torch.testing.assert_close(normed.float(), expected.float(), rtol=ULP[dtype], atol=ULP[dtype])
    assert torch.equal(total, expected_total)


def test_rms_norm_takes_a_batch_of_heads_and_rows_that_do_not_depend_on_each_other() -> None:
    x = _rows(300, 576, torch.float32, 3)
    weight = _rows(1, 576, torch.float32, 4)[0]
    batch, _ = cpu_ops.rms_norm(x, weight, 1e-6, x.flip(0))
    for i in (0, 151, 299):
        alone, _ = cpu_ops.rms_norm(x[i : i + 1], weight, 1e-6, x.flip(0)[i : i + 1])
        assert torch.equal(alone[0], batch[i])
    heads = x.view(300, 9, 64)  # qk-norm: every head normalised on its own
    normed, _ = cpu_ops.rms_norm(heads, weight[:64], 1e-6)
    expected, _ = reference.rms_norm(heads, weight[:64], 1e-6)
    torch.testing.assert_close(normed, expected, rtol=ULP[torch.float32], atol=ULP[torch.float32])


def test_rms_norm_hands_what_it_does_not_take_to_the_reference() -> None:
    strided = _rows(4, 2 * 576, torch.float32, 5).view(4, 2, 576)[:, 0]  # not one row stride
    heads = strided.view(4, 9, 64)
    wide = _rows(2, cpu_ops.RMS_NORM_MAX_COLS + 16, torch.float32, 6)
    for x in (heads, wide):
        weight = torch.ones(x.shape[-1])
        assert torch.equal(
            cpu_ops.rms_norm(x, weight, 1e-5)[0], reference.rms_norm(x, weight, 1e-5)[0]
        )
    mixed = _rows(3, 64, torch.bfloat16, 7)
    weight = torch.ones(64)  # float32 weight on bf16 rows: the reference's type promotion
    assert torch.equal(
        cpu_ops.rms_norm(mixed, weight, 1e-5)[0], reference.rms_norm(mixed, weight, 1e-5)[0]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_rows", "head_dim"), [(1, 64), (7, 128), (200, 64), (9, 80), (3, 18)])
def test_rotary_equals_the_reference_bit_for_bit(dtype, num_rows, head_dim) -> None:  # type: ignore[no-untyped-def]
    num_heads, num_kv_heads = 9, 3
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _rows(num_rows, width, dtype, 8)  # q and k are strided views of a fused projection
    query = qkv[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    key = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    key = key.unflatten(-1, (num_kv_heads, head_dim))
    angles = _rows(num_rows, head_dim // 2, torch.float32, 9) * 3
    angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    got = cpu_ops.apply_rotary(query, key, cos, sin)
    expected = reference.apply_rotary(query, key, cos, sin)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 3, 200])
def test_silu_and_mul_equals_the_reference(dtype, num_rows) -> None:  # type: ignore[no-untyped-def]
    wide = _rows(num_rows, 2 * 1536 + 7, dtype, 10) * 3
    gate_up = wide[:, : 2 * 1536]  # rows strided, as a view of a wider projection
    got = cpu_ops.silu_and_mul(gate_up)
    expected = reference.silu_and_mul(gate_up)
    assert got.shape == (num_rows, 1536)
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=2 * ULP[dtype], atol=1e-6)
    else:
        assert torch.equal(got, expected)


def _silu_rounded_in_float32(gate: torch.Tensor) -> torch.Tensor:
    """silu as the kernel defines it, from float64: e^-g rounded once to float32, then the add
    and the division each in float32."""
    g = gate.float()
    return g / (1.0 + torch.exp(-g.double()).float())


def test_float32_silu_rounds_e_to_the_x_once_from_float64() -> None:
    """A million float32 gates of random bits (NaNs and denormals among them), the infinities,
    and a gate where the C library's expf rounds the wrong way: silu with up = 1 is exactly
    `_silu_rounded_in_float32`'s, on every CPU (AVX2's e^x takes AVX-512's steps)."""
    generator = torch.Generator().manual_seed(3)
    bits = torch.randint(-(2**31), 2**31, ((1 << 20) - 3,), generator=generator)
    # e^-g lies 1e-6 ulp below a float32 tie at the last: expf gives 0x1.fff15ep-1, not ...5cp-1
    special = torch.tensor([float("inf"), float("-inf"), float.fromhex("0x1.d466b2p-14")])
    gate = torch.cat([bits.to(torch.int32).view(torch.float32), special]).reshape(-1, 64)
    got = cpu_ops.silu_and_mul(torch.cat([gate, torch.ones_like(gate)], dim=1))
    torch.testing.assert_close(got, _silu_rounded_in_float32(gate), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("up_seed", [None, 7])  # None: up = 1, so the product is silu's rounding
def test_silu_and_mul_rounds_every_half_gate_as_float32_silu(dtype, up_seed) -> None:  # type: ignore[no-untyped-def]
    """All 65,536 bf16 / fp16 bit patterns as gates: the kernel's table for the dtype gives the
    bits of float32 silu rounded to it (NaN included), then times up rounded again."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    gate = gate.reshape(256, 256)
    up = torch.ones_like(gate) if up_seed is None else _rows(256, 256, dtype, up_seed)
    got = cpu_ops.silu_and_mul(torch.cat([gate, up], dim=1))
    silu = _silu_rounded_in_float32(gate).to(dtype)
    expected = (silu.float() * up.float()).to(dtype)
    torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
