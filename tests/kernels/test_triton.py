"""Every Triton kernel equals its torch reference (on CPU through TRITON_INTERPRET=1, set by
tests/conftest.py; on a GPU compiled), across head dims, block sizes, GQA ratios, sequence
lengths around block boundaries, and fp32 / bf16; the KV-cache write and attention also over an
int8 cache (quantized rows with inline scales, `headrace.kernels.kv_layout`).

Tolerances: fp32 agrees to float rounding (1e-5). bf16 attention is compared with the float32
reference over the same bf16 inputs: both round probabilities and outputs to bf16 (2e-2).
The int8 write is bit-exact; int8-cache attention's bounds are argued in its test.
bf16 norm / rotary may differ by about one bf16 ulp (2^-7 relative to the operands): the
interpreter truncates float32 -> bf16 where a GPU rounds to nearest.
"""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import reference, triton_attention, triton_ops
from headrace.kernels.kv_layout import cache_shape, dequantize_rows
from headrace.worker.layers.rotary import RopeConfig, RotaryEmbedding

from tests.kernels.paged import build_paged_batch, contiguous_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
#: (query heads, KV heads): GQA ratios 1, 3 and 8.
HEADS = [(4, 4), (6, 2), (8, 1)]
ONE_ULP = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def decode_and_prefill_seqs(block_size: int) -> tuple[list[tuple[int, int]], int]:
    """(context length after the step, new tokens) per sequence, decodes first: contexts of
    1 token, exact block multiples and not, one long enough to split; prefills that start
    fresh, continue a cached prefix, end on / off a block edge and span two query tiles."""
    decodes = [(1, 1), (block_size, 1), (2 * block_size + 3, 1), (300, 1)]
    prefills = [
        (block_size, block_size),
        (2 * block_size + 1, 2 * block_size + 1),
        (37, 5),
        (3 * block_size, block_size + 1),
        (130, triton_attention.EXTEND_BLOCK_M + 6),
    ]
    return decodes + prefills, len(decodes)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_paged_attention_equals_reference(head_dim, block_size, num_heads, num_kv_heads, dtype):
    torch.manual_seed(head_dim + block_size + num_heads)
    seqs, num_decode = decode_and_prefill_seqs(block_size)
    batch = build_paged_batch(
        seqs, num_decode, block_size, num_heads, num_kv_heads, head_dim, dtype, DEVICE
    )
    wide = build_like(batch, torch.float32)
    expected = reference.paged_attention(wide.query, wide.kv_cache, wide.metadata, batch.scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # Default split count, no split, and a forced split (empty splits for short contexts).
    for num_kv_splits in (None, 1, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, num_kv_splits=num_kv_splits
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def build_like(batch, dtype):
    """The same batch with query and cache in another dtype (metadata shared)."""
    return type(batch)(
        batch.query.to(dtype),
        batch.kv_cache.to(dtype),
        batch.metadata,
        batch.keys,
        batch.values,
        batch.seqs,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_only_and_prefill_only_batches(dtype):
    """A step of decodes alone and one of prefills alone each launch one kernel path."""
    torch.manual_seed(1)
    for seqs, num_decode in (([(5, 1), (64, 1), (700, 1)], 3), ([(70, 70), (9, 3)], 0)):
        batch = build_paged_batch(seqs, num_decode, 16, 6, 2, 64, dtype, DEVICE)
        out = triton_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for i, (_, num_new) in enumerate(seqs):
            start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
            want = contiguous_attention(
                batch.queries(i).cpu(), batch.keys[i], batch.values[i], num_new
            )
            torch.testing.assert_close(out[start:end].float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 64), (8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_kv_cache_equals_reference(block_size, num_kv_heads, head_dim, dtype):
    torch.manual_seed(2)
    num_tokens, num_blocks = 37, 6
    # K and V as strided views of one fused projection output, as the model passes them.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    want = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, device=DEVICE).to(dtype)
    got = want.clone()
    reference.write_kv_cache(key, value, want, slots)
    triton_ops.write_kv_cache(key, value, got, slots)
    assert torch.equal(got, want)  # a copy: bit-exact, untouched slots too


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float16], ids=str)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 96), (8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_write_int8_kv_cache_equals_reference(block_size, num_kv_heads, head_dim, dtype):
    """Quantized rows bit for bit: values, scales, zero rows (scale 0), ties rounded half to
    even, rows of very different magnitudes; slots not written keep their bytes."""
    torch.manual_seed(6)
    num_tokens, num_blocks = 37, 6
    # K and V as strided views of one fused projection output, rows scaled over 1e-3..1e2.
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim, device=DEVICE)
    fused *= 10.0 ** torch.randint(-3, 3, (num_tokens, 3, num_kv_heads, 1), device=DEVICE)
    fused[0, 1, 0] = 0.0  # one zero key row
    fused[1, 2] = 0.0  # a token whose value rows are all zero
    fused[2, 1, 0, :5] = torch.tensor([127.0, 2.5, -0.5, 3.5, 1.5])  # scale 1: ties
    fused[2, 1, 0, 5:] = 0.0
    fused = fused.to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    shape = cache_shape(num_blocks, block_size, num_kv_heads, head_dim, torch.int8)
    want = torch.randint(-128, 128, shape, dtype=torch.int8, device=DEVICE)  # arbitrary bytes
    got = want.clone()
    reference.write_kv_cache(key, value, want, slots)
    triton_ops.write_kv_cache(key, value, got, slots)
    assert torch.equal(got, want)  # bit-exact, untouched slots too

    block_size = got.shape[2]
    rows = got[slots // block_size, :, slots % block_size]  # [T, 2, Hkv, D + 4]
    scales = rows[..., head_dim:].contiguous().view(torch.float32)  # [T, 2, Hkv, 1]
    assert scales[0, 0, 0].item() == 0.0 and (scales[1, 1] == 0.0).all()
    assert (rows[0, 0, 0, :head_dim] == 0).all() and (rows[1, 1, :, :head_dim] == 0).all()
    ties = dequantize_rows(rows[2, 0, 0])[:5]
    assert ties.tolist() == [127.0, 2.0, 0.0, 4.0, 2.0]


def test_int8_kv_cache_shape_checks():
    """An int8 cache's last axis is head_dim + 4, and its float32 scales must be aligned."""
    key = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    unscaled = torch.zeros(2, 2, 16, 2, 64, dtype=torch.int8, device=DEVICE)  # no scale bytes
    with pytest.raises(ValueError, match="does not fit"):
        triton_ops.write_kv_cache(key, key, unscaled, slots)
    storage = torch.zeros(2 * 2 * 16 * 2 * 68 + 1, dtype=torch.int8, device=DEVICE)
    misaligned = storage[1:].view(2, 2, 16, 2, 68)  # scales one byte off a float32 boundary
    with pytest.raises(ValueError, match="misaligned"):
        triton_ops.write_kv_cache(key, key, misaligned, slots)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (32, 128)])
def test_paged_attention_int8_cache_equals_reference(
    head_dim, block_size, num_heads, num_kv_heads, dtype
):
    """Attention over an int8 cache equals the reference's over the same cache.

    Both dequantize each row to the same float32 values (q * scale, one rounding) and attend
    in float32, so they differ only in summation order: 1e-5 for fp32 queries. With bf16
    queries both compute in float32 and round the output to bf16 once, but the interpreter
    truncates where torch rounds to nearest: one bf16 ulp apart (rtol 2^-7; atol 1e-5 near 0).
    Compiled on a GPU, bf16 queries score in tf32, as the float cache's test allows (2e-2).
    """
    torch.manual_seed(head_dim + block_size + num_heads)
    seqs, num_decode = decode_and_prefill_seqs(block_size)
    batch = build_paged_batch(
        seqs, num_decode, block_size, num_heads, num_kv_heads, head_dim, dtype, DEVICE,
        kv_cache_dtype=torch.int8,
    )  # fmt: skip
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    if dtype == torch.float32:
        atol, rtol = 1e-5, 1e-5
    else:
        atol, rtol = (1e-5, 2**-7) if triton_attention.INTERPRETED else (2e-2, 2e-2)
    # The float test's forced split counts: none, and splits some short contexts leave empty.
    for num_kv_splits in (1, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, num_kv_splits=num_kv_splits
        )
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 576, 4096])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_equals_reference(hidden, with_residual, dtype):
    torch.manual_seed(3)
    x = torch.randn(2, 5, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(2, 5, hidden, device=DEVICE).to(dtype) if with_residual else None
    weight = torch.randn(hidden, device=DEVICE).to(dtype)
    want_normed, want_sum = reference.rms_norm(x, weight, 1e-6, residual)
    got_normed, got_sum = triton_ops.rms_norm(x, weight, 1e-6, residual)
    tol = ONE_ULP[dtype]
    torch.testing.assert_close(got_sum, want_sum, atol=1e-5, rtol=tol)
    # The normed row inherits the sum's rounding, and the weight multiplies one more in.
    torch.testing.assert_close(got_normed, want_normed, atol=1e-4, rtol=3 * tol)
    assert got_normed.shape == x.shape
    if not with_residual:
        assert got_sum is x


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rope_type", ["default", "llama3"])
def test_rotary_equals_reference(rope_type, head_dim, dtype):
    torch.manual_seed(4)
    num_tokens, num_heads, num_kv_heads = 11, 6, 2
    rope = RopeConfig(head_dim, 8192, 500000.0, rope_type, factor=8.0, original_max_position=2048)
    with torch.device(DEVICE):
        cos, sin = RotaryEmbedding(rope)(torch.randint(0, 8192, (num_tokens,)), dtype)
    # q and k as strided views of the fused qkv projection output, as the model passes them.
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    qkv = qkv.to(dtype)
    q = qkv[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.unflatten(-1, (num_kv_heads, head_dim))
    before = qkv.clone()
    want_q, want_k = reference.apply_rotary(q, k, cos, sin)
    got_q, got_k = triton_ops.apply_rotary(q, k, cos, sin)
    # Each half is a difference of two rounded products: one ulp of the products (of the
    # inputs' size, not of the result's) bounds how far the roundings can move it.
    tol = ONE_ULP[dtype]
    atol = 2 * tol * qkv.abs().max().item()
    torch.testing.assert_close(got_q, want_q, atol=atol, rtol=tol)
    torch.testing.assert_close(got_k, want_k, atol=atol, rtol=tol)
    assert torch.equal(qkv, before)  # inputs are not rotated in place


def test_decode_splits_longer_than_a_tile_some_empty():
    """Splits of 256 tokens (four 64-token tiles: whole tiles, then a partial one) over
    contexts of 200 and 700: the short sequence's later splits start past its end and must
    attend to nothing rather than count its tokens twice."""
    torch.manual_seed(5)
    seqs = [(200, 1), (700, 1)]
    batch = build_paged_batch(seqs, 2, 16, 6, 2, 64, torch.float32, DEVICE)
    out = triton_attention.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, num_kv_splits=3
    )
    for i, (_, num_new) in enumerate(seqs):
        want = contiguous_attention(batch.queries(i).cpu(), batch.keys[i], batch.values[i], num_new)
        torch.testing.assert_close(out[i : i + 1].cpu(), want, atol=1e-5, rtol=1e-5)


# (context length after the step, new tokens), decodes first: a 1-token context, a few
# blocks' worth, one long enough to split; prefills fresh, continuing a cached prefix, and two
# spanning two query tiles (the longer one, under a 200-token window, has tiles of keys its
# window's edge masks, tiles every row sees unmasked and the causal diagonal).
WINDOW_SEQS = [
    (1, 1),
    (9, 1),
    (40, 1),
    (700, 1),
    (20, 20),
    (37, 5),
    (50, 3),
    (150, triton_attention.EXTEND_BLOCK_M + 6),
    (300, triton_attention.EXTEND_BLOCK_M + 6),
]
NUM_WINDOW_DECODES = 4


def assert_window_attention(batch, out, sliding_window, tol, softcap=None):
    """Each sequence's rows equal SDPA over its contiguous K/V within the window (with a
    soft cap, the capped scores' softmax written out)."""
    for i, (_, num_new) in enumerate(batch.seqs):
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        want = contiguous_attention(
            batch.queries(i).cpu(), batch.keys[i], batch.values[i], num_new, sliding_window,
            softcap,
        )  # fmt: skip
        torch.testing.assert_close(out[start:end].float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("sliding_window", [1, 5, 200, 1000])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_attention_equals_reference_and_skips_freed_blocks(
    block_size, sliding_window, dtype
):
    """Windows of one token, of a few, wider than a tile, and wider than every sequence,
    over decodes and prefill chunks; the table entries of blocks before each sequence's
    window name a NaN block, so a kernel that loads one, even into masked lanes, fails. The
    forced 5 splits leave every decode's later splits empty (its window has fewer keys)."""
    torch.manual_seed(block_size + sliding_window)
    batch = build_paged_batch(
        WINDOW_SEQS, NUM_WINDOW_DECODES, block_size, 6, 2, 64, dtype, DEVICE,
        sliding_window=sliding_window,
    )  # fmt: skip
    wide = build_like(batch, torch.float32)
    expected = reference.paged_attention(
        wide.query, wide.kv_cache, wide.metadata, batch.scale, sliding_window
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_kv_splits in (None, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window,
            num_kv_splits=num_kv_splits,
        )  # fmt: skip
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
        assert_window_attention(batch, out, sliding_window, tol)


def test_sliding_window_decode_splits_cut_the_window_not_the_context():
    """A 700-token decode under a 100-token window: its 3 splits of 64 tokens cover the
    window's 100 keys (the last split empty), none the 600 freed ones before them; the
    20-token decode fills only its first split."""
    torch.manual_seed(7)
    seqs = [(20, 1), (700, 1)]
    batch = build_paged_batch(seqs, 2, 16, 6, 2, 64, torch.float32, DEVICE, sliding_window=100)
    out = triton_attention.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, 100, num_kv_splits=3
    )
    assert_window_attention(batch, out, 100, 1e-5)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 1)])
@pytest.mark.parametrize("sliding_window", [5, 200])
def test_sliding_window_int8_cache_equals_reference(sliding_window, num_heads, num_kv_heads):
    """Over an int8 cache, as the float cache's test; the freed blocks' bytes are all -1,
    so their float32 scales are NaN (0xFFFFFFFF) and a kernel that loads one fails."""
    torch.manual_seed(sliding_window + num_heads)
    batch = build_paged_batch(
        WINDOW_SEQS, NUM_WINDOW_DECODES, 16, num_heads, num_kv_heads, 64, torch.float32,
        DEVICE, kv_cache_dtype=torch.int8, sliding_window=sliding_window,
    )  # fmt: skip
    poison = batch.metadata.block_tables[NUM_WINDOW_DECODES - 1, 0]  # the 700-token decode's
    batch.kv_cache[poison] = -1
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window
    )
    for num_kv_splits in (1, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window,
            num_kv_splits=num_kv_splits,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_sliding_window_must_see_a_key():
    batch = build_paged_batch([(5, 1)], 1, 16, 6, 2, 64, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="sliding_window must be at least 1"):
        triton_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale, 0)


#: Gemma 2 caps at 50; a cap of 2 under queries scaled by 8 (scores of a few tens) flattens
#: nearly every score, so a kernel that skipped or misplaced the cap would be far off.
SOFTCAP = 2.0


def soft_capped_batch(block_size, num_heads, num_kv_heads, dtype, sliding_window, **kwargs):
    """WINDOW_SEQS with the queries scaled up so the cap matters."""
    batch = build_paged_batch(
        WINDOW_SEQS, NUM_WINDOW_DECODES, block_size, num_heads, num_kv_heads, 64, dtype,
        DEVICE, sliding_window=sliding_window, **kwargs,
    )  # fmt: skip
    batch.query.mul_(8)  # a power of two: exact in bf16 too
    return batch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("block_size", "sliding_window", "num_heads", "num_kv_heads"),
    [(16, None, 6, 2), (4, 5, 8, 1), (1, 200, 4, 4)],
)
def test_soft_capped_attention_equals_reference(
    block_size, sliding_window, num_heads, num_kv_heads, dtype
):
    """Capped scores over decodes and prefill chunks, with no window, a narrow one and one
    wider than a tile (freed blocks poisoned); the forced 5 splits leave the short decodes'
    later splits empty. The output is far from the uncapped attention's, so the cap acted."""
    torch.manual_seed(block_size + num_heads)
    batch = soft_capped_batch(block_size, num_heads, num_kv_heads, dtype, sliding_window)
    wide = build_like(batch, torch.float32)
    expected = reference.paged_attention(
        wide.query, wide.kv_cache, wide.metadata, batch.scale, sliding_window, SOFTCAP
    )
    uncapped = reference.paged_attention(
        wide.query, wide.kv_cache, wide.metadata, batch.scale, sliding_window
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_kv_splits in (None, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, SOFTCAP,
            num_kv_splits=num_kv_splits,
        )  # fmt: skip
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
        assert_window_attention(batch, out, sliding_window, tol, SOFTCAP)
        assert not torch.allclose(out.float(), uncapped, atol=0.1)


@pytest.mark.parametrize("sliding_window", [None, 200])
def test_soft_capped_attention_int8_cache_equals_reference(sliding_window):
    """Over an int8 cache both dequantize the same rows and cap the same float32 scores."""
    torch.manual_seed(8)
    batch = soft_capped_batch(16, 6, 2, torch.float32, sliding_window, kv_cache_dtype=torch.int8)
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, SOFTCAP
    )
    for num_kv_splits in (1, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, SOFTCAP,
            num_kv_splits=num_kv_splits,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap", [0.0, -50.0, float("inf"), float("nan")])
def test_softcap_must_be_positive_and_finite(softcap):
    batch = build_paged_batch([(5, 1)], 1, 16, 6, 2, 64, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="softcap must be positive and finite"):
        triton_ops.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, None, softcap
        )


def sinks_for(num_heads):
    """GPT-OSS-like sink logits, one per head, from a negligible -3 to a dominant 6."""
    return torch.linspace(-3.0, 6.0, num_heads, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("block_size", "sliding_window", "softcap", "num_heads", "num_kv_heads"),
    [(16, None, None, 6, 2), (4, 5, SOFTCAP, 8, 1), (1, 200, None, 4, 4)],
)
def test_attention_sinks_equal_reference(
    block_size, sliding_window, softcap, num_heads, num_kv_heads, dtype
):
    """Each head's sink in its softmax's denominator, over decodes and prefill chunks, with
    no window, a narrow one under a cap, and one wider than a tile (freed blocks poisoned).
    The forced 5 splits leave the short decodes' later splits empty and cut the 700-token
    decode's keys: a sink counted in each split, or in none, would be off. The output is far
    from the sink-free attention's, so the sinks acted."""
    torch.manual_seed(block_size + num_heads)
    if softcap is None:
        batch = build_paged_batch(
            WINDOW_SEQS, NUM_WINDOW_DECODES, block_size, num_heads, num_kv_heads, 64, dtype,
            DEVICE, sliding_window=sliding_window,
        )  # fmt: skip
    else:
        batch = soft_capped_batch(block_size, num_heads, num_kv_heads, dtype, sliding_window)
    sinks = sinks_for(num_heads)
    wide = build_like(batch, torch.float32)
    args = (wide.query, wide.kv_cache, wide.metadata, batch.scale, sliding_window, softcap)
    expected = reference.paged_attention(*args, sinks)
    sink_free = reference.paged_attention(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for num_kv_splits in (None, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, softcap,
            sinks, num_kv_splits=num_kv_splits,
        )  # fmt: skip
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)
        for i, (_, num_new) in enumerate(batch.seqs):
            start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
            want = contiguous_attention(
                batch.queries(i).cpu(), batch.keys[i], batch.values[i], num_new,
                sliding_window, softcap, sinks.cpu(),
            )  # fmt: skip
            torch.testing.assert_close(out[start:end].float().cpu(), want, atol=tol, rtol=tol)
        assert not torch.allclose(out.float(), sink_free, atol=0.1)


def test_attention_sinks_int8_cache_equal_reference():
    """Over an int8 cache both dequantize the same rows; the sinks enter both softmaxes in
    float32, so they agree to float rounding, unsplit and over splits some leave empty."""
    torch.manual_seed(9)
    batch = build_paged_batch(
        WINDOW_SEQS, NUM_WINDOW_DECODES, 16, 6, 2, 64, torch.float32, DEVICE,
        kv_cache_dtype=torch.int8, sliding_window=200,
    )  # fmt: skip
    sinks = sinks_for(6)
    expected = reference.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, 200, None, sinks
    )
    for num_kv_splits in (1, 5):
        out = triton_attention.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, 200, None, sinks,
            num_kv_splits=num_kv_splits,
        )  # fmt: skip
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# Made on DEVICE: moving the strided view there would copy it into a contiguous tensor.
@pytest.mark.parametrize(
    "sinks",
    [
        torch.zeros(5, device=DEVICE),
        torch.zeros(6, dtype=torch.bfloat16, device=DEVICE),
        torch.zeros(12, device=DEVICE)[::2],
        torch.zeros(1, 6, device=DEVICE),
    ],
    ids=["length", "dtype", "strided", "shape"],
)
def test_sinks_must_be_one_float32_logit_per_head(sinks):
    batch = build_paged_batch([(5, 1)], 1, 16, 6, 2, 64, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="sinks must be a contiguous float32 tensor of the 6"):
        triton_ops.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, None, None, sinks
        )
