"""The C kernels of the CPU backend equal the torch references: attention read from the paged
cache in place (decodes, prefills, mixed; GQA; block sizes that do and do not divide the key
tile; fp32 / bf16 / fp16; strided queries; sliding windows, never reading the freed blocks
before one; soft-capped scores, whose tanh is within an ulp or two of torch's; attention
sinks, a logit per head in each softmax's denominator), the KV-cache
write bit for bit, and argmax with ties and NaN as numpy breaks them, and the skinny linear
against a float64 matmul (float32 weights) or a float32 matmul of the same values (bf16 /
fp16 weights), bit for bit the same for a row alone as in a batch. Also: the build is cached,
and a machine without a compiler falls back to the reference kernels.

Tolerances: fp32 agrees to float rounding (1e-5); bf16 / fp16 attention is compared with the
float32 reference over the same rounded inputs, and the kernel rounds its output once (2e-2).
"""

from __future__ import annotations

import math

import pytest
import torch
from headrace.kernels import cpu_ops, native, reference, select_kernels
from headrace.kernels.attention import AttentionMetadata, window_first_blocks
from torch import nn

from tests.kernels import needs_c_compiler
from tests.kernels.paged import build_paged_batch, contiguous_attention

pytestmark = needs_c_compiler

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
HEADS = [(4, 4), (9, 3), (8, 1)]


def mixed_seqs(block_size: int) -> tuple[list[tuple[int, int]], int]:
    """(context after the step, new tokens), decodes first: a 1-token context, block edges,
    a long context; prefills fresh, continuing a prefix, and longer than a query tile."""
    decodes = [(1, 1), (block_size, 1), (2 * block_size + 3, 1), (300, 1)]
    prefills = [(block_size, block_size), (37, 5), (3 * block_size, block_size + 1), (130, 40)]
    return decodes + prefills, len(decodes)


def wide(batch):
    return type(batch)(
        batch.query.float(),
        batch.kv_cache.float(),
        batch.metadata,
        batch.keys,
        batch.values,
        batch.seqs,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [16, 5, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 96])
def test_paged_attention_equals_reference(head_dim, block_size, num_heads, num_kv_heads, dtype):
    torch.manual_seed(head_dim + block_size + num_heads)
    seqs, num_decode = mixed_seqs(block_size)
    batch = build_paged_batch(
        seqs, num_decode, block_size, num_heads, num_kv_heads, head_dim, dtype
    )
    expected_batch = wide(batch)
    expected = reference.paged_attention(
        expected_batch.query, expected_batch.kv_cache, batch.metadata, batch.scale
    )
    out = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    "seqs,num_decode", [([(5, 1), (64, 1), (700, 1)], 3), ([(70, 70), (9, 3)], 0)]
)
def test_decode_only_and_prefill_only_against_contiguous_sdpa(seqs, num_decode):
    torch.manual_seed(1)
    batch = build_paged_batch(seqs, num_decode, 16, 6, 2, 64, torch.float32)
    out = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    for i, (_, num_new) in enumerate(seqs):
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        want = contiguous_attention(batch.queries(i), batch.keys[i], batch.values[i], num_new)
        torch.testing.assert_close(out[start:end], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8)],
    ids=str,
)
@pytest.mark.parametrize("block_size", [16, 5])
@pytest.mark.parametrize(
    ("sliding_window", "softcap", "with_sinks"),
    [(None, None, False), (7, None, False), (7, 2.0, False), (None, None, True), (7, 2.0, True)],
)
def test_a_decode_alone_and_among_many_gets_the_same_bits(
    sliding_window, softcap, with_sinks, block_size, dtype, kv_cache_dtype
):
    """Many decodes run every KV head of one decode in one work item, key tile by key tile
    (the kernel's `run_tile_heads`); a decode alone runs a head per item. Each row's sums are
    the same either way, so the outputs are equal bit for bit (over an int8 cache too, and
    within a window, whose key tiles start where it does, with capped scores, and with each
    head's sink in its softmax)."""
    torch.manual_seed(block_size)
    sinks = torch.linspace(-3.0, 6.0, 9) if with_sinks else None
    seqs = [(n, 1) for n in (1, 15, 16, 17, 40, 99, 300, 5)]
    batch = build_paged_batch(
        seqs,
        len(seqs),
        block_size,
        9,
        3,
        64,
        dtype,
        kv_cache_dtype=kv_cache_dtype,
        sliding_window=sliding_window,
    )
    together = cpu_ops.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, softcap, sinks
    )
    for i, (seq_len, _) in enumerate(seqs):
        alone = AttentionMetadata(
            slot_mapping=batch.metadata.slot_mapping[i : i + 1],
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            block_tables=batch.metadata.block_tables[i : i + 1],
            num_decode_seqs=1,
            query_start_loc_cpu=[0, 1],
            seq_lens_cpu=[seq_len],
            block_size=block_size,
        )
        out = cpu_ops.paged_attention(
            batch.query[i : i + 1],
            batch.kv_cache,
            alone,
            batch.scale,
            sliding_window,
            softcap,
            sinks,
        )
        assert torch.equal(out[0], together[i]), f"decode {i} ({seq_len} keys)"


def test_strided_query_view_of_a_fused_projection():
    """The model passes q as a view of the fused qkv output: a token stride wider than H * D."""
    torch.manual_seed(2)
    seqs, num_decode = mixed_seqs(16)
    batch = build_paged_batch(seqs, num_decode, 16, 6, 2, 64, torch.float32)
    fused = torch.randn(batch.query.shape[0], 10, 64)
    fused[:, 2:8] = batch.query
    strided = fused[:, 2:8]
    assert not strided.is_contiguous()
    want = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    got = cpu_ops.paged_attention(strided, batch.kv_cache, batch.metadata, batch.scale)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("num_kv_heads", "head_dim"), [(1, 64), (3, 64), (8, 128)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_write_kv_cache_equals_reference(block_size, num_kv_heads, head_dim, dtype):
    torch.manual_seed(3)
    num_tokens, num_blocks = 97, 24
    fused = torch.randn(num_tokens, 3, num_kv_heads, head_dim).to(dtype)
    key, value = fused[:, 1], fused[:, 2]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    want = torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim).to(dtype)
    got = want.clone()
    reference.write_kv_cache(key, value, want, slots)
    cpu_ops.write_kv_cache(key, value, got, slots)
    assert torch.equal(got, want)  # a copy: bit-exact, untouched slots too


def test_write_kv_cache_converts_to_the_cache_dtype():
    torch.manual_seed(4)
    key, value = torch.randn(2, 7, 2, 16).unbind(0)
    want = torch.zeros(4, 2, 4, 2, 16, dtype=torch.bfloat16)
    got = want.clone()
    slots = torch.tensor([0, 3, 5, 6, 9, 12, 15])
    reference.write_kv_cache(key, value, want, slots)
    cpu_ops.write_kv_cache(key, value, got, slots)
    assert torch.equal(got, want)


def test_the_build_is_cached_and_keyed(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADRACE_CACHE", str(tmp_path))
    first = native._build()
    assert first.is_relative_to(tmp_path) and first.exists()
    mtime = first.stat().st_mtime_ns
    assert native._build() == first and first.stat().st_mtime_ns == mtime  # not rebuilt
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DHEADRACE_OTHER"))
    assert native._build() != first  # other flags: another build


def test_no_compiler_falls_back_to_the_reference(monkeypatch):
    monkeypatch.setenv("HEADRACE_CC", "/nonexistent/cc")
    monkeypatch.setenv("PATH", "/nonexistent")
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert "no C compiler" in (native.build_error() or "")
        assert select_kernels("auto", torch.device("cpu")).NAME == "reference"
        with pytest.raises(ValueError, match="no C compiler"):
            select_kernels("cpu", torch.device("cpu"))
    finally:
        native.load.cache_clear()  # the next load (with the environment restored) rebuilds


def test_auto_picks_the_c_kernels_on_the_cpu():
    assert select_kernels("auto", torch.device("cpu")).NAME == "cpu"
    assert select_kernels("cpu", torch.device("cpu")) is cpu_ops
    with pytest.raises(ValueError, match="run on the CPU"):
        select_kernels("cpu", torch.device("meta"))


def test_long_prefill_chunks_mixed_with_kernel_rows():
    """Chunks longer than LONG_PREFILL go to torch's flash attention, the rest to the kernel:
    one batch mixing both still equals the reference row for row."""
    torch.manual_seed(6)
    long = cpu_ops.LONG_PREFILL + 9
    seqs = [(40, 1), (3, 1), (long + 20, long), (50, 7), (long, long)]
    batch = build_paged_batch(seqs, 2, 16, 6, 2, 64, torch.float32)
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    got = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no-amx"])
def test_bf16_chunks_with_many_scores_go_to_torch_on_amx(monkeypatch, amx):
    """On a CPU with AMX-BF16, a bf16 chunk of at least AMX_MIN_QUERIES new tokens whose
    queries times keys reach AMX_MIN_SCORES attends in torch (whose attention runs on the AMX
    tiles); decodes, short chunks and chunks of few keys stay in the C kernel. Without AMX only
    chunks past LONG_PREFILL go to torch. Either way the batch equals the reference."""
    torch.manual_seed(11)
    monkeypatch.setattr(cpu_ops, "cpu_has_flag", lambda flag: amx and flag == "amx_bf16")
    sent: list[int] = []

    def spy(query, *args, **kwargs):
        sent.append(query.shape[0])
        return extend(query, *args, **kwargs)

    extend = cpu_ops.extend
    monkeypatch.setattr(cpu_ops, "extend", spy)
    few_keys = math.isqrt(cpu_ops.AMX_MIN_SCORES - 1)  # a fresh prompt: tokens^2 short of it
    many = cpu_ops.AMX_MIN_SCORES // cpu_ops.AMX_MIN_QUERIES  # context that reaches it
    seqs = [
        (300, 1),  # a decode
        (many, cpu_ops.AMX_MIN_QUERIES),  # just reaches both thresholds
        (many + 200, cpu_ops.AMX_MIN_QUERIES - 1),  # one token short, long context
        (few_keys, few_keys),  # scores short of the threshold
        (200, 100),  # a chunk after a cached prefix
    ]
    batch = build_paged_batch(seqs, 1, 16, 6, 2, 64, torch.bfloat16)
    got = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    expected = reference.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    assert sent == ([cpu_ops.AMX_MIN_QUERIES, 100] if amx else [])
    kernel_only = cpu_ops.attends_in_kernel(batch.metadata, torch.bfloat16)
    assert kernel_only is not amx


@pytest.mark.parametrize(
    ("dtype", "length"),
    [(torch.bfloat16, 128), (torch.float32, cpu_ops.LONG_PREFILL + 9)],
    ids=["bf16-amx", "float32"],
)
def test_adjacent_whole_prompts_of_one_length_attend_in_one_call(monkeypatch, dtype, length):
    """Adjacent chunks that are whole prompts of one length share one SDPA call (a run ends
    at a prompt of another length, a chunk after a cached prefix, or a gap), and each
    sequence's output equals, bit for bit, its own call's."""
    torch.manual_seed(12)
    monkeypatch.setattr(cpu_ops, "cpu_has_flag", lambda flag: flag == "amx_bf16")
    runs: list[int] = []

    def spy(query, *args):
        runs.append(query.shape[0])
        return extend_fresh(query, *args)

    extend_fresh = cpu_ops.extend_fresh
    monkeypatch.setattr(cpu_ops, "extend_fresh", spy)
    seqs = [
        (300, 1),  # a decode
        *[(length, length)] * 3,  # a run of three
        (length + 1, length + 1),  # another length: alone
        *[(length, length)] * 2,  # a run of two
        (length + 50, length),  # as long, but after a cached prefix
        (length, length),  # alone again: the next chunk, short, attends in the C kernel
        (20, 20),
        (length, length),  # alone after that gap
    ]
    batch = build_paged_batch(seqs, 1, 16, 6, 2, 64, dtype)
    got = cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale)
    assert runs == [3, 2]
    for i in [i for i, (_, num_new) in enumerate(seqs) if num_new >= length]:
        table = batch.metadata.block_tables[i : i + 1]
        alone = reference.extend(batch.queries(i), batch.kv_cache, table, seqs[i][0], batch.scale)
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        assert torch.equal(got[start:end], alone), i


# --- sliding windows ---------------------------------------------------------------------------

#: (context after the step, new tokens), decodes first: contexts shorter than, at and far past
#: the windows; a fresh prompt, a continued one, and one of several query tiles.
WINDOW_SEQS = [(1, 1), (9, 1), (40, 1), (300, 1), (20, 20), (37, 5), (130, 40), (50, 3)]
#: One key, windows that do and do not divide the key tile, one longer than every sequence.
WINDOWS = [1, 5, 16, 37, 1000]


def assert_equals_contiguous_sdpa(batch, out, sliding_window, tol):
    for i, (_, num_new) in enumerate(batch.seqs):
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        want = contiguous_attention(
            batch.queries(i), batch.keys[i], batch.values[i], num_new, sliding_window
        )
        torch.testing.assert_close(out[start:end].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("sliding_window", WINDOWS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_attention_equals_sdpa_and_skips_freed_blocks(
    block_size, sliding_window, num_heads, num_kv_heads, dtype
):
    """Decodes and prefill chunks mixed, each query over the last sliding_window positions up
    to its own. The table entries before each sequence's window name a NaN block: a kernel
    that read one, into a masked lane even, would return NaN."""
    torch.manual_seed(block_size + sliding_window)
    batch = build_paged_batch(
        WINDOW_SEQS,
        4,
        block_size,
        num_heads,
        num_kv_heads,
        64,
        dtype,
        sliding_window=sliding_window,
    )
    out = cpu_ops.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window
    )
    assert out.dtype == dtype
    assert_equals_contiguous_sdpa(batch, out, sliding_window, TOLERANCE[dtype])


def poison_freed_int8_blocks(batch, sliding_window):
    """NaN as the scale of every row of the blocks before each sequence's window (an int8
    row reads back as value * scale), as `build_paged_batch` poisons a float cache."""
    nan = torch.tensor([float("nan")]).view(torch.int8)  # the scale's 4 bytes
    block_size = batch.metadata.block_size
    for i, (seq_len, num_new) in enumerate(batch.seqs):
        (first,) = window_first_blocks([seq_len], num_new, block_size, sliding_window)
        for block in batch.metadata.block_tables[i, :first].tolist():
            batch.kv_cache[block, ..., -4:] = nan


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [1, 6, 16, 1000])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_sliding_window_over_an_int8_cache_equals_the_reference(
    block_size, sliding_window, query_dtype
):
    """Over an int8 cache, whose freed blocks' scales are NaN: the reference's attention over
    the same quantized rows (the tolerances of the float caches), and no NaN read."""
    torch.manual_seed(block_size * sliding_window)
    batch = build_paged_batch(
        WINDOW_SEQS,
        4,
        block_size,
        6,
        2,
        64,
        query_dtype,
        kv_cache_dtype=torch.int8,
        sliding_window=sliding_window,
    )
    poison_freed_int8_blocks(batch, sliding_window)
    query, metadata, scale = batch.query, batch.metadata, batch.scale
    want = reference.paged_attention(query.float(), batch.kv_cache, metadata, scale, sliding_window)
    got = cpu_ops.paged_attention(query, batch.kv_cache, metadata, scale, sliding_window)
    tol = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    if sliding_window < 40:  # some blocks are freed: the poison is live
        assert cpu_ops.paged_attention(query, batch.kv_cache, metadata, scale).isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_a_window_longer_than_the_sequences_gives_the_bits_of_none(block_size, dtype):
    """A window as long as the longest context, or longer, hides no key: the key tiles start
    at key 0 and the masks are the causal ones, so every sum is the one without a window."""
    torch.manual_seed(block_size)
    query_dtype = torch.float32 if dtype == torch.int8 else dtype
    batch = build_paged_batch(
        WINDOW_SEQS, 4, block_size, 6, 2, 64, query_dtype, kv_cache_dtype=dtype
    )
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale)
    unwindowed = cpu_ops.paged_attention(*args)
    longest = max(batch.metadata.seq_lens_cpu)
    for sliding_window in (longest, longest + 1, 1 << 30):
        assert torch.equal(cpu_ops.paged_attention(*args, sliding_window), unwindowed)


@pytest.mark.parametrize("sliding_window", [1, 100, 600])
def test_sliding_window_in_long_prefill_chunks_mixed_with_kernel_rows(sliding_window):
    """Chunks longer than LONG_PREFILL go to the reference's `extend`, within the window too
    (and without reading the freed blocks before it); the rest to the kernel."""
    torch.manual_seed(sliding_window)
    long = cpu_ops.LONG_PREFILL + 9
    seqs = [(700, 1), (3, 1), (long + 90, long), (50, 7), (long, long)]
    batch = build_paged_batch(seqs, 2, 16, 6, 2, 64, torch.float32, sliding_window=sliding_window)
    out = cpu_ops.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window
    )
    assert_equals_contiguous_sdpa(batch, out, sliding_window, 1e-5)


def test_a_window_of_no_keys_is_refused():
    batch = build_paged_batch([(4, 1)], 1, 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="at least one key"):
        cpu_ops.paged_attention(batch.query, batch.kv_cache, batch.metadata, batch.scale, 0)


# --- soft-capped scores ------------------------------------------------------------------------

#: Gemma 2 caps at 50; a cap of 2 against queries scaled by 8 (scores far past it) makes the
#: cap change every softmax.
SOFTCAP = 2.0


def soft_cap_in_kernel(x: torch.Tensor, softcap: float) -> torch.Tensor:
    """The kernel's softcap * tanh(x / softcap) of a float32 vector."""
    x = x.contiguous()
    out = torch.empty_like(x)
    cpu_ops.library().headrace_soft_cap(x.data_ptr(), x.numel(), softcap, out.data_ptr())
    return out


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Float32 values of one sign, counted in ulps apart (their bit patterns are ordered)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


def test_the_kernels_tanh_is_within_an_ulp_of_the_rounded_tanh():
    """Over a sweep of float32 from 1e-30 to 40 (both branches, their border at 0.625 and the
    saturation to 1 near 9) and its negatives: at most 1 ulp from tanh rounded from float64,
    at most 2 from torch's float32 tanh (1 measured); odd, and exact at ±0, ±inf and NaN (17
    of them: the vector tail too)."""
    low, high = (
        torch.tensor([v], dtype=torch.float32).view(torch.int32).item() for v in (1e-30, 40.0)
    )
    positive = torch.arange(low, high, 997, dtype=torch.int32).view(torch.float32)
    border = torch.linspace(0.6, 0.65, 4001)
    x = torch.cat([positive, border, torch.tensor([0.0, 1e-45, 9.0, 100.0, float("inf")])])
    got = soft_cap_in_kernel(x, 1.0)
    rounded = torch.tanh(x.double()).float()
    assert ulps_apart(got, rounded).max().item() <= 1
    assert ulps_apart(got, torch.tanh(x)).max().item() <= 2
    assert torch.equal(soft_cap_in_kernel(-x, 1.0), -got)
    assert soft_cap_in_kernel(torch.tensor([-0.0]), 1.0).signbit().item()
    assert soft_cap_in_kernel(torch.tensor([float("nan")] * 17), 1.0).isnan().all()


@pytest.mark.parametrize("softcap", [1.0, 30.0, 50.0])
def test_soft_cap_is_the_cap_times_tanh_as_transformers_computes_it(softcap):
    torch.manual_seed(int(softcap))
    x = torch.randn(4099) * 3 * softcap
    want = softcap * torch.tanh(x.double() / softcap)
    torch.testing.assert_close(soft_cap_in_kernel(x, softcap).double(), want, atol=0, rtol=3e-7)


def capped_batch(block_size, num_heads, num_kv_heads, dtype, sliding_window, **kwargs):
    """WINDOW_SEQS with queries scaled by 8, so that the cap changes every softmax."""
    batch = build_paged_batch(
        WINDOW_SEQS,
        4,
        block_size,
        num_heads,
        num_kv_heads,
        64,
        dtype,
        sliding_window=sliding_window,
        **kwargs,
    )
    batch.query.mul_(8)
    return batch


def assert_equals_capped_scores(batch, out, sliding_window, tol):
    for i, (_, num_new) in enumerate(batch.seqs):
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        want = contiguous_attention(
            batch.queries(i), batch.keys[i], batch.values[i], num_new, sliding_window, SOFTCAP
        )
        torch.testing.assert_close(out[start:end].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_soft_capped_attention_equals_the_capped_scores(
    block_size, sliding_window, num_heads, num_kv_heads, dtype
):
    """Decodes and prefill chunks mixed, scores capped before the mask and the softmax, as
    transformers' Gemma 2 computes them (within a window too, its freed blocks NaN); the
    uncapped output is far from it, so the cap is live."""
    torch.manual_seed(block_size + num_heads)
    batch = capped_batch(block_size, num_heads, num_kv_heads, dtype, sliding_window)
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window)
    out = cpu_ops.paged_attention(*args, SOFTCAP)
    assert out.dtype == dtype
    assert_equals_capped_scores(batch, out, sliding_window, TOLERANCE[dtype])
    assert not torch.allclose(out.float(), cpu_ops.paged_attention(*args).float(), atol=0.1)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_soft_capped_attention_over_an_int8_cache_equals_the_reference(
    block_size, sliding_window, query_dtype
):
    torch.manual_seed(block_size)
    batch = capped_batch(block_size, 6, 2, query_dtype, sliding_window, kv_cache_dtype=torch.int8)
    if sliding_window is not None:
        poison_freed_int8_blocks(batch, sliding_window)
    args = (batch.kv_cache, batch.metadata, batch.scale, sliding_window, SOFTCAP)
    want = reference.paged_attention(batch.query.float(), *args)
    got = cpu_ops.paged_attention(batch.query, *args)
    tol = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("sliding_window", [None, 100])
def test_soft_cap_in_long_prefill_chunks_mixed_with_kernel_rows(sliding_window):
    """Chunks longer than LONG_PREFILL go to the reference's `extend`, capped there too."""
    torch.manual_seed(3)
    long = cpu_ops.LONG_PREFILL + 9
    seqs = [(700, 1), (3, 1), (long + 90, long), (50, 7), (long, long)]
    batch = build_paged_batch(seqs, 2, 16, 6, 2, 64, torch.float32, sliding_window=sliding_window)
    batch.query.mul_(8)
    out = cpu_ops.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, SOFTCAP
    )
    assert_equals_capped_scores(batch, out, sliding_window, 1e-5)


@pytest.mark.parametrize("softcap", [0.0, -50.0, float("nan")])
def test_a_soft_cap_that_is_not_positive_is_refused(softcap):
    batch = build_paged_batch([(4, 1)], 1, 4, 2, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="soft cap must be positive"):
        cpu_ops.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, None, softcap
        )


# --- attention sinks ---------------------------------------------------------------------------


def head_sinks(num_heads: int) -> torch.Tensor:
    """A sink per head from -3 to 6: one far below the scores, one taking most of the mass."""
    return torch.linspace(-3.0, 6.0, num_heads)


def assert_equals_sink_softmax(batch, out, sliding_window, softcap, sinks, tol):
    for i, (_, num_new) in enumerate(batch.seqs):
        start, end = batch.metadata.query_start_loc_cpu[i : i + 2]
        want = contiguous_attention(
            batch.queries(i),
            batch.keys[i],
            batch.values[i],
            num_new,
            sliding_window,
            softcap,
            sinks,
        )
        torch.testing.assert_close(out[start:end].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 1)])
@pytest.mark.parametrize("softcap", [None, SOFTCAP])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_attention_sinks_add_a_logit_to_each_heads_denominator(
    block_size, sliding_window, softcap, num_heads, num_kv_heads, dtype
):
    """Decodes and prefill chunks mixed, each head's softmax with exp(sinks[h]) beside its
    keys' in the denominator and no value, as GPT-OSS computes it: equal to the softmax written
    out and to the reference (within a window too, its freed blocks NaN; and capped scores,
    queries scaled by 8). The sinks are live: the output is far from the sink-free one."""
    torch.manual_seed(block_size + num_heads)
    batch = capped_batch(block_size, num_heads, num_kv_heads, dtype, sliding_window)
    if softcap is None:
        batch.query.div_(8)  # scores of the unscaled queries, the sink of 6 the most of them
    sinks = head_sinks(num_heads)
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, softcap)
    out = cpu_ops.paged_attention(*args, sinks)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    assert_equals_sink_softmax(batch, out, sliding_window, softcap, sinks, tol)
    wide_batch = wide(batch)
    want = reference.paged_attention(wide_batch.query, wide_batch.kv_cache, *args[2:], sinks)
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)
    assert not torch.allclose(out.float(), cpu_ops.paged_attention(*args).float(), atol=0.1)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_attention_sinks_over_an_int8_cache_equal_the_reference(
    block_size, sliding_window, query_dtype
):
    torch.manual_seed(block_size)
    batch = build_paged_batch(
        WINDOW_SEQS,
        4,
        block_size,
        6,
        2,
        64,
        query_dtype,
        kv_cache_dtype=torch.int8,
        sliding_window=sliding_window,
    )
    if sliding_window is not None:
        poison_freed_int8_blocks(batch, sliding_window)
    args = (batch.kv_cache, batch.metadata, batch.scale, sliding_window, None, head_sinks(6))
    want = reference.paged_attention(batch.query.float(), *args)
    got = cpu_ops.paged_attention(batch.query, *args)
    tol = TOLERANCE[query_dtype]
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize(("sliding_window", "softcap"), [(None, None), (100, SOFTCAP)])
def test_attention_sinks_in_long_prefill_chunks_mixed_with_kernel_rows(sliding_window, softcap):
    """Chunks longer than LONG_PREFILL go to the reference's `extend`, with the sinks there too."""
    torch.manual_seed(5)
    long = cpu_ops.LONG_PREFILL + 9
    seqs = [(700, 1), (3, 1), (long + 90, long), (50, 7), (long, long)]
    batch = build_paged_batch(seqs, 2, 16, 6, 2, 64, torch.float32, sliding_window=sliding_window)
    sinks = head_sinks(6)
    out = cpu_ops.paged_attention(
        batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window, softcap, sinks
    )
    assert_equals_sink_softmax(batch, out, sliding_window, softcap, sinks, 1e-5)


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_a_sink_of_minus_infinity_gives_the_bits_of_none(sliding_window):
    """exp(-inf) weighs nothing: the first key tile's correction zeroes the sink's term as it
    does the empty sum of a row without one, and every sum after is the same."""
    torch.manual_seed(7)
    batch = build_paged_batch(
        WINDOW_SEQS, 4, 4, 6, 2, 64, torch.float32, sliding_window=sliding_window
    )
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, sliding_window)
    sinks = torch.full((6,), float("-inf"))
    assert torch.equal(cpu_ops.paged_attention(*args, None, sinks), cpu_ops.paged_attention(*args))


def test_sinks_are_taken_as_contiguous_float32():
    torch.manual_seed(8)
    batch = build_paged_batch(WINDOW_SEQS, 4, 4, 6, 2, 64, torch.float32)
    args = (batch.query, batch.kv_cache, batch.metadata, batch.scale, None, None)
    strided = torch.randn(6, 2, dtype=torch.float64)[:, 0]
    assert not strided.is_contiguous()
    want = cpu_ops.paged_attention(*args, strided.float().contiguous())
    assert torch.equal(cpu_ops.paged_attention(*args, strided), want)


@pytest.mark.parametrize("shape", [(5,), (7,), (6, 1), ()])
def test_sinks_not_one_per_head_are_refused(shape):
    batch = build_paged_batch([(4, 1)], 1, 4, 6, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="one logit per query head"):
        cpu_ops.paged_attention(
            batch.query, batch.kv_cache, batch.metadata, batch.scale, None, None, torch.zeros(shape)
        )


# --- the skinny linear -----------------------------------------------------------------------

# Rows of the one-row weight streams (1, 2), around the 6-row tile and the torch hand-over,
# outputs around the 4-row weight tile, inner sizes that are and are not multiples of the
# 16-lane vector.
LINEAR_SHAPES = [(1, 7, 16), (2, 5, 37), (5, 4, 37), (6, 33, 64), (13, 9, 100), (48, 40, 576)]


@pytest.mark.parametrize(("rows", "out_features", "in_features"), LINEAR_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_a_float64_matmul(rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    wide_x = torch.randn(rows, in_features + 3, generator=gen)
    x = wide_x[:, 2 : 2 + in_features]  # rows strided, as a slice of a fused projection
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = cpu_ops.linear(x, weight, bias)
    want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features**0.5)


REDUCED = [torch.bfloat16, torch.float16]


@pytest.fixture
def reduced_rows_in_kernel(monkeypatch):
    """Every row count of LINEAR_SHAPES in the C kernel for bf16 / fp16 weights too (where
    their GEMM is native, torch takes more than a few rows)."""
    monkeypatch.setattr(cpu_ops, "SKINNY_MAX_ROWS_BF16", cpu_ops.SKINNY_MAX_ROWS)
    monkeypatch.setattr(cpu_ops, "AMX_MAX_ROWS", cpu_ops.SKINNY_MAX_ROWS)


@pytest.mark.parametrize(("rows", "out_features", "in_features"), LINEAR_SHAPES)
@pytest.mark.parametrize("weight_dtype", REDUCED)
@pytest.mark.parametrize("x_is_float32", [False, True])
def test_reduced_linear_equals_a_float32_matmul_of_the_same_weights(
    rows, out_features, in_features, weight_dtype, x_is_float32, reduced_rows_in_kernel
):
    """bf16 / fp16 weights (and x in their dtype or float32) widened exactly, products and
    sums in float32: a float32 matmul of the same rounded values, to float32 rounding."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x_dtype = torch.float32 if x_is_float32 else weight_dtype
    wide_x = torch.randn(rows, in_features + 3, generator=gen).to(x_dtype)
    x = wide_x[:, 2 : 2 + in_features]  # rows strided
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    bias = torch.randn(out_features, generator=gen)
    got = cpu_ops.linear(x, weight, bias, out_dtype=torch.float32)
    want = x.float() @ weight.float().T + bias
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert cpu_ops.linear(x, weight, bias).dtype == x_dtype  # out_dtype defaults to x's


@pytest.mark.parametrize(("rows", "out_features", "in_features"), LINEAR_SHAPES)
@pytest.mark.parametrize(
    ("x_dtype", "weight_dtype"), [(torch.float32, torch.bfloat16), (torch.float16, torch.float16)]
)
def test_reduced_linear_is_the_float32_kernel_on_the_widened_values(
    rows, out_features, in_features, x_dtype, weight_dtype, reduced_rows_in_kernel
):
    """Only the loads differ: the same values stored as bf16 / fp16 give the float32 kernel's
    bits (one summation order whatever the storage dtype), and outputs stored in x's dtype
    are those rounded once. (bf16 against bf16: the next test.)"""
    gen = torch.Generator().manual_seed(rows + out_features)
    x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
    weight = torch.randn(out_features, in_features, generator=gen).to(weight_dtype)
    got = cpu_ops.linear(x, weight, out_dtype=torch.float32)
    assert torch.equal(got, cpu_ops.linear(x.float(), weight.float()))
    assert torch.equal(cpu_ops.linear(x, weight), got.to(x_dtype))


def pair_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N]
    """The bf16 dot instruction's sums, modelled in float32 torch ops: lane i of each step of
    32 adds the exact product of elements 2i + 1, then of 2i (each add rounded); K is padded
    with zeros to whole steps; then the lanes' fixed reduction (i and i + 8, then neighbours,
    pairs of pairs, the halves)."""
    rows, k = x.shape
    padded = -(-k // 32) * 32
    xs = torch.nn.functional.pad(x.float(), (0, padded - k)).view(rows, 1, -1, 16, 2)
    ws = torch.nn.functional.pad(weight.float(), (0, padded - k)).view(
        1, weight.shape[0], -1, 16, 2
    )
    products = xs * ws  # [M, N, steps, 16, 2]: exact (bf16 x bf16 fits float32)
    lanes = torch.zeros(rows, weight.shape[0], 16)
    for step in range(padded // 32):
        lanes = lanes + products[:, :, step, :, 1]
        lanes = lanes + products[:, :, step, :, 0]
    t = lanes[..., :8] + lanes[..., 8:]
    return ((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3])) + (
        (t[..., 4] + t[..., 5]) + (t[..., 6] + t[..., 7])
    )


@pytest.mark.parametrize(("rows", "out_features", "in_features"), LINEAR_SHAPES)
def test_bf16_against_bf16_sums_are_the_dot_instructions_or_float32s(
    rows, out_features, in_features, reduced_rows_in_kernel
):
    """bf16 x against bf16 weights: where the CPU has AVX512-BF16, the dot instruction's
    arithmetic bit for bit (row streams, whole tiles and edges); elsewhere the float32
    kernel's on the widened values. Outputs stored in bf16 are those rounded once."""
    gen = torch.Generator().manual_seed(rows * 7 + out_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    got = cpu_ops.linear(x, weight, out_dtype=torch.float32)
    pairs = cpu_ops.bf16_pairs()
    want = pair_sums(x, weight) if pairs else cpu_ops.linear(x.float(), weight.float())
    assert torch.equal(got, want)
    assert torch.equal(cpu_ops.linear(x, weight), got.bfloat16())


def panel_sums(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # [M, K] x [N, K] -> [M, N]
    """The panels' sums (kernels/csrc/panel_linear.c), modelled in float32 torch ops: each
    output adds the exact products of its pairs in order, the dot instruction's way (element
    2j + 1, then 2j, each add rounded; an odd K's last element pairs with a zero)."""
    products = x.float()[:, None, :] * weight.float()[None, :, :]  # [M, N, K]: exact
    sums = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(0, x.shape[1], 2):
        sums = sums + (products[..., k + 1] if k + 1 < x.shape[1] else 0.0)
        sums = sums + products[..., k]
    return sums


# Panels of 32 weight rows (a part of one, one, two and a part), tiles of 12 rows of x and the
# rows past them, inner sizes odd and even; rows past the skinny matmul's 64, which the panels
# take too.
PANEL_SHAPES = [
    (1, 7, 16),
    (2, 32, 37),
    (5, 40, 37),
    (12, 33, 64),
    (13, 64, 1),
    (30, 96, 101),
    (130, 40, 37),
]


@pytest.mark.parametrize(("rows", "out_features", "in_features"), PANEL_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_parameters_multiply_by_their_panels(rows, out_features, in_features, with_bias):
    """A bf16 weight parameter against bf16 rows, where the CPU has AVX512-BF16 and no AMX
    tiles: its panels' sums bit for bit (+ bias, each output rounded once), and every row's
    alone as in the batch, at any row count. Elsewhere no panels are made, and the parameter
    is multiplied exactly as the same weights in a plain tensor are."""
    gen = torch.Generator().manual_seed(rows * 11 + in_features)
    wide_x = torch.randn(rows, in_features + 3, generator=gen).bfloat16()
    x = wide_x[:, 2 : 2 + in_features]  # rows strided, as a slice of a fused projection
    weight = nn.Parameter(
        torch.randn(out_features, in_features, generator=gen).bfloat16(), requires_grad=False
    )
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    panels = cpu_ops.panel_copy(weight) is not None
    assert panels == cpu_ops.makes_panels()
    assert cpu_ops.makes_panels() == (cpu_ops.bf16_pairs() and not cpu_ops.amx_tiles())
    got = cpu_ops.linear(x, weight, bias, out_dtype=torch.float32)
    if not panels:
        plain = cpu_ops.linear(x, weight.detach(), bias, out_dtype=torch.float32)
        assert torch.equal(got, plain)
        return
    assert torch.equal(got, panel_sums(x, weight) + (0 if bias is None else bias))
    assert torch.equal(cpu_ops.linear(x, weight, bias), got.bfloat16())
    for row in range(rows):
        alone = cpu_ops.linear(x[row : row + 1], weight, bias, out_dtype=torch.float32)
        assert torch.equal(alone[0], got[row])


def test_panels_are_packed_again_after_a_write_to_the_parameter():
    """A weight update writes through the parameter (its version moves): the next call
    multiplies the new weights, not the panels packed from the old ones, repacked into the
    same memory (updates do not grow the process)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(3, 64, generator=gen).bfloat16()
    weight = nn.Parameter(torch.randn(48, 64, generator=gen).bfloat16(), requires_grad=False)
    before = cpu_ops.linear(x, weight, out_dtype=torch.float32)
    panels = cpu_ops.panel_copy(weight)
    new = torch.randn(48, 64, generator=gen).bfloat16()
    with torch.no_grad():
        weight.copy_(new)
    after = cpu_ops.linear(x, weight, out_dtype=torch.float32)
    fresh = nn.Parameter(new, requires_grad=False)
    assert torch.equal(after, cpu_ops.linear(x, fresh, out_dtype=torch.float32))
    assert not torch.equal(after, before)
    if panels is not None:
        assert cpu_ops.panel_copy(weight) is panels


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_do_not_depend_on_the_rest_of_the_batch(dtype, reduced_rows_in_kernel):
    """Every output is summed in one fixed order, in weight-row streams, whole tiles and at
    the edges alike: a row alone or in two gives the same bits as in a batch (torch's GEMM
    picks its kernel by batch size)."""
    gen = torch.Generator().manual_seed(3)
    max_rows = cpu_ops.skinny_max_rows(dtype)
    weight = torch.randn(37, 96, generator=gen).to(dtype)
    x = torch.randn(max_rows, 96, generator=gen).to(dtype)
    batched = cpu_ops.linear(x, weight, out_dtype=torch.float32)
    for row in (0, 5, 6, 13, max_rows - 1):
        alone = cpu_ops.linear(x[row : row + 1], weight, out_dtype=torch.float32)[0]
        assert torch.equal(alone, batched[row])
        first = max(row - 1, 0)
        pair = cpu_ops.linear(x[first : first + 2], weight, out_dtype=torch.float32)
        in_two = pair[row - first]
        assert torch.equal(in_two, batched[row])
        among_seven = cpu_ops.linear(x[row : row + 7], weight, out_dtype=torch.float32)[0]
        assert torch.equal(among_seven, batched[row])


@pytest.mark.parametrize("out_features", [*range(1, 14), 49])
def test_row_streams_cover_every_weight_row_once(out_features):
    """One and two rows read the weights in several row streams a thread (rows g, g + part,
    ...; the groups past the last row read alone): for every count of weight rows around
    the streams' parts, each output is the one the tiles give that row in a batch of 7."""
    gen = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, 80, generator=gen)
    x = torch.randn(7, 80, generator=gen)
    batched = cpu_ops.linear(x, weight)
    for rows in (1, 2):
        assert torch.equal(cpu_ops.linear(x[:rows], weight), batched[:rows])


needs_amx = pytest.mark.skipif(
    not cpu_ops.amx_tiles(), reason="the CPU has no AMX tiles (or the OS did not grant them)"
)
# Row counts the tiles take (from 3: one and two rows keep the vector kernel's row stream):
# one block of 16 rows and a part, two, and a ragged pair; weight rows in pairs of 16 blocks,
# inner sizes in steps of 32.
AMX_SHAPES = [(3, 32, 32), (16, 64, 96), (17, 96, 576), (32, 64, 64), (29, 32, 1536)]


@needs_amx
@pytest.mark.parametrize(("rows", "out_features", "in_features"), AMX_SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_rows_on_amx_tiles_equal_a_float32_matmul(rows, out_features, in_features, with_bias):
    """bf16 x against bf16 weights on AMX tiles: exact products summed in float32 (to
    float32 rounding), + bias, each output rounded once to the dtype asked for."""
    gen = torch.Generator().manual_seed(rows * 100 + in_features)
    wide_x = torch.randn(rows, in_features + 5, generator=gen).bfloat16()
    x = wide_x[:, 3 : 3 + in_features]  # rows strided, as a slice of a fused projection
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    got = cpu_ops.linear(x, weight, bias, out_dtype=torch.float32)
    want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * in_features**0.5)
    assert torch.equal(cpu_ops.linear(x, weight, bias), got.bfloat16())


@needs_amx
def test_bf16_rows_on_amx_tiles_do_not_depend_on_the_rest_of_the_batch():
    """A row's sums on the tiles are the same bits in every batch of 3 to AMX_MAX_ROWS rows
    (other rows, and the zero rows that pad a block, never meet its sums)."""
    gen = torch.Generator().manual_seed(5)
    rows = cpu_ops.AMX_MAX_ROWS
    weight = torch.randn(64, 576, generator=gen).bfloat16()
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    batched = cpu_ops.linear(x, weight, out_dtype=torch.float32)
    for row in (0, 2, 15, 16, rows - 3):
        for size in (3, 7, 17):
            first = min(row, rows - size)
            part = cpu_ops.linear(x[first : first + size], weight, out_dtype=torch.float32)
            assert torch.equal(part[row - first], batched[row])
    # and the tiles' sums are not the vector kernel's (or this test would not see them)
    assert not torch.equal(batched[:2], cpu_ops.linear(x[:2], weight, out_dtype=torch.float32))


@pytest.fixture
def skinny_calls(monkeypatch) -> list[int]:
    """The row count of every call into the C matmul (``headrace_skinny_linear``)."""
    calls: list[int] = []
    library = cpu_ops.library()

    class Counting:
        def __getattr__(self, name):
            kernel = getattr(library, name)
            if name != "headrace_skinny_linear":
                return kernel

            def counted(*args):
                calls.append(args[3])  # M
                return kernel(*args)

            return counted

    monkeypatch.setattr(cpu_ops, "library", Counting)
    return calls


def test_linear_hands_larger_batches_and_other_dtypes_to_torch(skinny_calls):
    calls = skinny_calls
    weight = torch.randn(8, 32)  # not a parameter: never packed, never padded
    limit = cpu_ops.skinny_max_rows(torch.float32)
    cpu_ops.linear(torch.randn(limit, 32), weight)
    assert len(calls) == 1
    big = torch.randn(limit + 1, 32)
    torch.testing.assert_close(cpu_ops.linear(big, weight), big @ weight.T)
    wide = cpu_ops.linear(torch.randn(3, 32, dtype=torch.float64), weight.double())
    assert wide.dtype == torch.float64
    assert len(calls) == 1
    half = cpu_ops.linear(torch.randn(3, 32, dtype=torch.bfloat16), weight.bfloat16())
    assert half.dtype == torch.bfloat16
    assert len(calls) == 2
    big_half = torch.randn(cpu_ops.skinny_max_rows(torch.bfloat16) + 1, 32, dtype=torch.bfloat16)
    cpu_ops.linear(big_half, weight.bfloat16())
    assert len(calls) == 2


def test_float32_rows_up_to_a_few_hundred_run_in_the_c_kernel(skinny_calls):
    """With AVX-512's tiles, float32 rows past SKINNY_MAX_ROWS stay in the C kernel up to
    FLOAT32_MAX_ROWS, whether or not oneDNN's packed GEMM would pad them to a bucket (128
    would not, 161 would), each row's sums its bits alone; past it (with 8-lane tiles, past
    SKINNY_MAX_ROWS), torch's GEMM takes them."""
    gen = torch.Generator().manual_seed(11)
    weight = nn.Parameter(torch.randn(40, 64, generator=gen), requires_grad=False)
    x = torch.randn(cpu_ops.FLOAT32_MAX_ROWS + 1, 64, generator=gen)
    wide = cpu_ops.wide_tiles()
    in_c = {cpu_ops.SKINNY_MAX_ROWS: True, 65: wide, 128: wide, 161: wide}
    in_c |= {cpu_ops.FLOAT32_MAX_ROWS: wide, cpu_ops.FLOAT32_MAX_ROWS + 1: False}
    for rows, wanted in in_c.items():
        skinny_calls.clear()
        got = cpu_ops.linear(x[:rows], weight)
        assert skinny_calls == ([rows] if wanted else []), rows
        want = (x[:rows].double() @ weight.double().T).float()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    limit = cpu_ops.skinny_max_rows(torch.float32)
    batched = cpu_ops.linear(x[:limit], weight)
    for row in {0, 63, 100, 160, limit - 1} & set(range(limit)):
        assert torch.equal(cpu_ops.linear(x[row : row + 1], weight)[0], batched[row])


def test_the_matmul_tiles_fit_the_cpus_registers():
    """16-lane tiles where the CPU has AVX-512; elsewhere 8-lane parts (a 16-lane vector
    that no register holds lives in memory: on AVX2 such tiles ran 5-10x slower)."""
    assert cpu_ops.wide_tiles() == cpu_ops.cpu_has_flag("avx512f")


def test_reduced_weights_take_the_float32_bound_where_torch_would_widen_them(monkeypatch):
    monkeypatch.setattr(cpu_ops, "wide_tiles", lambda: True)
    assert cpu_ops.skinny_max_rows(torch.float32) == cpu_ops.FLOAT32_MAX_ROWS
    monkeypatch.setattr(cpu_ops, "wide_tiles", lambda: False)  # AVX2's 8-lane tiles
    assert cpu_ops.skinny_max_rows(torch.float32) == cpu_ops.SKINNY_MAX_ROWS
    assert cpu_ops.skinny_max_rows(torch.float64) == 0
    monkeypatch.setattr(cpu_ops, "compute_dtype", lambda dtype, device: dtype)
    monkeypatch.setattr(cpu_ops, "amx_tiles", lambda: False)
    monkeypatch.setattr(cpu_ops, "_pairs_beat_torch", lambda: False)  # e.g. AMX, not granted
    assert cpu_ops.skinny_max_rows(torch.bfloat16) == cpu_ops.SKINNY_MAX_ROWS_BF16
    assert cpu_ops.skinny_max_rows(torch.float16) == cpu_ops.SKINNY_MAX_ROWS_BF16
    monkeypatch.setattr(cpu_ops, "amx_tiles", lambda: True)  # bf16 on the tiles, in C
    assert cpu_ops.skinny_max_rows(torch.bfloat16) == cpu_ops.AMX_MAX_ROWS
    assert cpu_ops.skinny_max_rows(torch.float16) == cpu_ops.SKINNY_MAX_ROWS_BF16
    monkeypatch.setattr(cpu_ops, "amx_tiles", lambda: False)
    monkeypatch.setattr(cpu_ops, "_pairs_beat_torch", lambda: True)  # the dot instruction
    assert cpu_ops.skinny_max_rows(torch.bfloat16) == cpu_ops.SKINNY_MAX_ROWS
    assert cpu_ops.skinny_max_rows(torch.float16) == cpu_ops.SKINNY_MAX_ROWS_BF16
    monkeypatch.setattr(cpu_ops, "compute_dtype", lambda dtype, device: torch.float32)
    assert cpu_ops.skinny_max_rows(torch.bfloat16) == cpu_ops.SKINNY_MAX_ROWS
