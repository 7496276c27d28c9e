"""The int8 KV cache (`headrace.kernels.kv_layout`): rows of int8 values with their float32
scale, written and read by the torch reference and the C kernels alike.

- The layout: a row reads back within half a quantization step of what was written, a zero
  row stays zero, and the cache's shape carries each row's scale.
- The C writer equals the reference writer bit for bit (the same float32 divisions and
  round-half-even), for float32 / bf16 / fp16 inputs given as strided views.
- The C attention over an int8 cache equals the reference's over the same cache: both
  dequantize each value with one float32 multiply, so they differ only as their float
  attention does (float32 queries 1e-5; bf16 / fp16 queries round the output once, the
  tolerances of tests/kernels/test_cpu.py). (That a decode alone gets the bits it gets among
  many, over an int8 cache too, is test_cpu.py's test.)
- The reference attention over int8 is close to float attention over the unquantized K/V
  (the quantization error, not a layout mix-up: a misplaced scale or row would be far off).
"""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import cpu_ops, reference
from headrace.kernels.kv_layout import (
    SCALE_BYTES,
    cache_shape,
    dequantize_rows,
    head_dim_of,
    quantize_rows,
)

from tests.kernels import needs_c_compiler
from tests.kernels.paged import build_paged_batch, contiguous_attention
from tests.kernels.test_cpu import HEADS, TOLERANCE, mixed_seqs

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_a_row_reads_back_within_half_a_step_of_its_values():
    torch.manual_seed(0)
    x = torch.randn(50, 4, 64) * torch.rand(50, 4, 1) * 10  # rows of different ranges
    rows = quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 4, 64 + SCALE_BYTES)
    step = x.abs().amax(-1, keepdim=True) / 127
    error = (dequantize_rows(rows) - x).abs()
    assert bool((error <= step / 2 * (1 + 1e-6)).all())
    assert int(rows[..., :64].abs().max()) == 127  # each row's largest value takes the range


def test_a_zero_row_is_zero_with_scale_zero():
    rows = quantize_rows(torch.zeros(3, 16))
    assert not rows.any()
    assert torch.equal(dequantize_rows(rows), torch.zeros(3, 16))


def test_the_cache_shape_carries_each_rows_scale():
    assert cache_shape(10, 16, 2, 64, torch.int8) == (10, 2, 16, 2, 68)
    assert cache_shape(10, 16, 2, 64, torch.bfloat16) == (10, 2, 16, 2, 64)
    assert head_dim_of(torch.zeros(cache_shape(1, 4, 2, 24, torch.int8), dtype=torch.int8)) == 24
    with pytest.raises(ValueError, match="head_dim divisible by 4"):
        cache_shape(10, 16, 2, 66, torch.int8)


def test_the_reference_writer_stores_quantized_rows_in_their_slots_only():
    torch.manual_seed(1)
    key, value = torch.randn(2, 5, 2, 16).unbind(0)
    cache = torch.randint(-128, 128, cache_shape(4, 4, 2, 16, torch.int8), dtype=torch.int8)
    before = cache.clone()
    slots = torch.tensor([0, 3, 5, 9, 14])
    reference.write_kv_cache(key, value, cache, slots)
    blocks, offsets = slots // 4, slots % 4
    assert torch.equal(cache[blocks, 0, offsets], quantize_rows(key))
    assert torch.equal(cache[blocks, 1, offsets], quantize_rows(value))
    untouched = torch.ones(4, 4, dtype=torch.bool)
    untouched[blocks, offsets] = False
    assert torch.equal(cache.transpose(1, 2)[untouched], before.transpose(1, 2)[untouched])


@needs_c_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 64), (8, 128), (2, 24)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_the_c_writer_equals_the_reference_bit_for_bit(block_size, num_kv_heads, head_dim, dtype):
    torch.manual_seed(3)
    num_tokens, num_blocks = 97, 24
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim).to(dtype)
    fused[7, 1] = 0  # a zero key row
    key, value = fused[:, 1], fused[:, 2]  # strided views, as the model passes them
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, torch.int8)
    want = torch.randint(-128, 128, shape, dtype=torch.int8)
    got = want.clone()
    reference.write_kv_cache(key, value, want, slots)
    cpu_ops.write_kv_cache(key, value, got, slots)
    assert torch.equal(got, want)  # untouched slots too


@needs_c_compiler
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_c_attention_over_int8_equals_the_reference(
    head_dim, block_size, num_heads, num_kv_heads, dtype
):
    torch.manual_seed(head_dim + block_size + num_heads)
    seqs, num_decode = mixed_seqs(block_size)
    batch = build_paged_batch(
        seqs, num_decode, block_size, num_heads, num_kv_heads, head_dim, dtype, "cpu", torch.int8
    )
    expected = reference.paged_attention(
        batch.query.float(), batch.kv_cache, batch.metadata, batch.scale
    )
    out = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_int8_attention_is_float_attention_within_the_quantization_error():
    torch.manual_seed(6)
    seqs, num_decode = mixed_seqs(16)
    batch = build_paged_batch(seqs, num_decode, 16, 6, 2, 64, torch.float32, "cpu", torch.int8)
    out = reference.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    worst = 0.0
    for i, (_, num_new) in enumerate(seqs):
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        want = contiguous_attention(batch.queries(i), batch.keys[i], batch.values[i], num_new)
        worst = max(worst, float((out[start:end] - want).abs().max()))
    # K/V ~ N(0, 1) over 64 values: a step of about 2.5 / 127; outputs move by about that.
    assert 0 < worst < 0.05
