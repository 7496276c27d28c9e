"""Triton paged attention: decode (one query per sequence, GQA, split-KV) and extend
(a prefill chunk attending to its cached prefix and causally to itself).

Both read K/V straight out of the paged cache ``[num_blocks, 2, block_size, Hkv, row]``
through each sequence's block table, one token row (``D`` contiguous elements) at a time,
and run an online softmax in float32 (scores in base 2: ``exp2(s * scale * log2 e)``). An
int8 cache's rows (``D`` int8 values and a float32 scale, `headrace.kernels.kv_layout`) are
dequantized as they are loaded, ``q * scale`` in float32, and attended to as a float32
cache's would be; query and output keep the query's dtype.

Decode: one program per (sequence, KV head, split) serves all ``H / Hkv`` query heads of
that KV head, so each K/V byte is read once per step. With few sequences or long contexts
the context is cut into splits run in parallel; a second kernel merges their partial
outputs by their log-sum-exp. Extend: one program per (sequence, query head, tile of
BLOCK_M query rows), iterating over K/V tiles up to the tile's last query position; the
tiles before its first query position are visible to every row and run without masks.

Sliding windows (`headrace.kernels.attention`): the query at position p sees keys
``p - W + 1 .. p``. Table entries of blocks wholly before a sequence's window may be stale
(freed blocks holding anything), so no load may touch a position before the window: a
decode's splits cut its window ``[seq_len - W, seq_len)`` rather than its whole context, and
an extend tile's key loop starts at its first query's window (and masks each row's own). The
window's bounds and masks are compiled only where WINDOWED (a `tl.constexpr`): a layer
without a window runs none of them.

Soft caps (Gemma 2's attn_logit_softcapping): each scaled score s = q.k * scale becomes
``c * tanh(s / c)`` before the masks and the softmax. The kernels score in base 2, and capping
commutes with that change of base when the cap moves with it: ``(c log2 e) * tanh(s log2 e /
(c log2 e)) = log2 e * c * tanh(s / c)``, so they cap ``s * log2 e`` at ``c * log2 e``, the
true score's cap in base 2. Compiled only where SOFTCAP (a `tl.constexpr`).

Attention sinks (GPT-OSS): each head's softmax has one more logit, ``sinks[h]``, in its
denominator and no value. An online softmax takes it as a key seen before any other: its
state starts at ``m = sinks[h] * log2 e`` (the logit in base 2, uncapped) and ``l = 1``
(``exp2(m - m)``), acc 0. A decode's splits are merged by their log-sum-exps, so the sink
must enter exactly one of them: split 0, which always holds keys (a context has at least
one, and a window's splits start at its first). Compiled only where SINKS (a `tl.constexpr`).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from headrace.kernels.attention import AttentionMetadata
from headrace.kernels.backend import triton_interpreted
from headrace.kernels.kv_layout import head_dim_of, is_quantized
from headrace.kernels.triton_cache import check_scale_alignment, scale_pointers

LOG2E = 1.4426950408889634
LOG2E_CONST: tl.constexpr = tl.constexpr(LOG2E)  # the same, for use inside the kernels
#: Read once, at import, when triton.jit also decides whether these kernels are interpreted.
INTERPRETED = triton_interpreted()
#: Decode: K/V tokens per inner-loop tile, and the fewest tokens a split is given.
DECODE_BLOCK_N = 64
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 3
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
#: Extend: query rows and K/V tokens per tile.
EXTEND_BLOCK_M = 64
EXTEND_BLOCK_N = 64
EXTEND_NUM_WARPS = 4
EXTEND_NUM_STAGES = 2


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST multiplies reduced-precision operands as
    float32, which is exact for their products: Triton's CPU interpreter (tests) cannot
    multiply bf16 / fp16 tensors itself."""
    if UPCAST:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b, input_precision=DOT_PRECISION)
    return result


@triton.jit
def _load_rows(
    row_ptrs,  # [N]: the first element of each cache row (a token's K or V for one KV head)
    row_mask,  # [N]: rows that exist
    dims,  # [BLOCK_D]
    HEAD_DIM: tl.constexpr,
    QUANTIZED_KV: tl.constexpr,  # int8 rows with a float32 scale after their values
):  # -> [N, BLOCK_D]: the cache's dtype, or float32 for an int8 cache; 0 where masked
    """Rows of the cache as attention multiplies them: an int8 row's values times its scale,
    rounded once to float32 as kv_layout.dequantize_rows does."""
    mask = row_mask[:, None] & (dims[None, :] < HEAD_DIM)
    x = tl.load(row_ptrs[:, None] + dims[None, :], mask=mask, other=0.0)
    if QUANTIZED_KV:
        # Masked rows get scale 0, not whatever bytes their (block 0) slot holds.
        scale = tl.load(scale_pointers(row_ptrs, HEAD_DIM), mask=row_mask, other=0.0)  # [N]
        x = x.to(tl.float32) * scale[:, None]
    return x


@triton.jit
def _soft_cap(
    x,  # [M, N] float32: scores
    cap,  # > 0
):  # -> [M, N]: cap * tanh(x / cap)
    """tanh from exp, since neither every Triton nor its interpreter offers one (3.9's
    libdevice.tanh fails interpreted): tanh|y| = (1 - e) / (1 + e) with e = exp(-2|y|) in
    (0, 1], which cannot overflow, and the sign put back. In float32 its absolute error is a
    few ulps of 1 (e's rounding, where 1 - e cancels for small |y|), the score's a few
    cap * 2^-23: far below what moves a softmax."""
    y = x * (1.0 / cap)
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(y < 0, -t, t)


@triton.jit
def _softmax_start(
    sink_ptrs,  # [M]: each row's head's sink logit, float32 (read only where SINKS)
    with_sink,  # [M]: rows whose softmax holds the sink (a decode: split 0's real heads)
    M: tl.constexpr,
    SINKS: tl.constexpr,
):  # -> (m, l), each [M] float32
    """The online softmax's running max and sum before any key: nothing seen, or the sink's
    logit seen (in base 2, as the scores are), weighing exp2(m - m) = 1 with no value."""
    if SINKS:
        sink = tl.load(sink_ptrs, mask=with_sink, other=float("-inf"))
        m = sink * LOG2E_CONST
        l = tl.where(m > float("-inf"), 1.0, 0.0)  # rows without it: nothing seen  # noqa: E741
    else:
        m = tl.full([M], float("-inf"), tl.float32)
        l = tl.zeros([M], tl.float32)  # noqa: E741
    return m, l


@triton.jit
def _attend_tile(
    q,  # [M, BLOCK_D]: the query rows (decode: a KV head's query heads; extend: query tokens)
    acc,  # [M, BLOCK_D] float32: running sum of p @ V
    m,  # [M] float32: running max of the scores
    l,  # [M] float32: running sum of exp2(score - m)  # noqa: E741
    kv_base,  # the cache pointer moved to this KV head
    block_table,  # this sequence's row of the block tables
    positions,  # [BLOCK_N]: the tile's token positions
    in_range,  # [BLOCK_N]: positions that exist
    visible,  # [M, BLOCK_N]: which row may attend to which position
    dims,  # [BLOCK_D]
    scale_log2e,
    softcap_log2e,  # the soft cap in base 2 (read only where SOFTCAP)
    cache_stride_block,
    cache_stride_plane,
    cache_stride_token,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    MASKED: tl.constexpr,  # false: every position exists and every row sees it (no masks)
    QUANTIZED_KV: tl.constexpr,  # an int8 cache: rows are dequantized to float32
    SOFTCAP: tl.constexpr,  # scores are soft-capped before the masks
):
    """One K/V tile of the online softmax: the tile's rows gathered through the block table,
    scored, and folded into (acc, m, l)."""
    if MASKED:
        block_ids = tl.load(block_table + positions // PAGE_SIZE, mask=in_range, other=0)
        row_mask = in_range
    else:
        block_ids = tl.load(block_table + positions // PAGE_SIZE)
        row_mask = positions >= 0  # [N]: all true, only head_dim is masked
    rows = block_ids.to(tl.int64) * cache_stride_block + (positions % PAGE_SIZE) * (
        cache_stride_token
    )
    k_rows = kv_base + rows  # [N]
    k = _load_rows(k_rows, row_mask, dims, HEAD_DIM, QUANTIZED_KV)  # [N, D]
    # q in K's dtype: a no-op for a float cache; float32 queries for an int8 one.
    scores = _dot(q.to(k.dtype), tl.trans(k), UPCAST, DOT_PRECISION) * scale_log2e  # [M, N]
    if SOFTCAP:
        scores = _soft_cap(scores, softcap_log2e)
    if MASKED:
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)  # noqa: E741
    v = _load_rows(k_rows + cache_stride_plane, row_mask, dims, HEAD_DIM, QUANTIZED_KV)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, DOT_PRECISION)
    return acc, m_new, l


# Values that change from step to step are not specialised on (Triton would otherwise compile
# a variant for 1 and for multiples of 16): one compiled kernel serves every step.
@triton.jit(do_not_specialize=["block_tables_stride", "split_len"])
def _decode_kernel(
    query_ptr,  # [B, H, D]: the decode rows of the query (one per sequence)
    cache_ptr,  # [num_blocks, 2, PAGE_SIZE, Hkv, row]: row D values (int8: D + 4, kv_layout)
    block_tables_ptr,  # [B, max_num_blocks] int32
    seq_lens_ptr,  # [B] int32: context length of each sequence, this token included
    sinks_ptr,  # [H] float32: each head's sink logit (read only where SINKS)
    out_ptr,  # SPLIT: [B, H, num_splits, D] float32 partial outputs; else the [B, H, D] output
    lse_ptr,  # [B, H, num_splits] float32: base-2 log-sum-exp of each split's scores
    scale_log2e,  # softmax scale * log2(e)
    softcap_log2e,  # soft cap * log2(e) (read only where SOFTCAP)
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    block_tables_stride,
    cache_stride_block,
    cache_stride_plane,
    cache_stride_token,
    cache_stride_head,
    split_len,  # tokens per split, a multiple of BLOCK_N
    sliding_window,  # keys each query sees, its own included (read only where WINDOWED)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,  # the grid's third axis cuts the context into num_splits parts
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANTIZED_KV: tl.constexpr,  # an int8 cache (kv_layout)
    WINDOWED: tl.constexpr,  # a sliding window: the splits cut only the window's keys
    SOFTCAP: tl.constexpr,  # soft-capped scores
    SINKS: tl.constexpr,  # a sink logit per head, in split 0's softmax
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOWED:
        # The query at seq_len - 1 sees the window's keys only; no position before them is
        # loaded (their blocks may be freed), so splits wholly before it cannot exist.
        start = tl.maximum(0, seq_len - sliding_window) + split * split_len
    else:
        start = split * split_len
    end = tl.maximum(start, tl.minimum(seq_len, start + split_len))  # empty: end == start

    groups = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + groups
    row_mask = (groups[:, None] < GROUP) & (dims[None, :] < HEAD_DIM)
    q = tl.load(
        query_ptr + seq * query_stride_t + heads[:, None] * query_stride_h + dims[None, :],
        mask=row_mask,
        other=0.0,
    )  # [G, D]
    kv_base = cache_ptr + kv_head * cache_stride_head
    block_table = block_tables_ptr + seq * block_tables_stride

    # Running max of the scores and sum of exp2(score - m), the sink's in split 0's real heads
    # only (written as one comparison: (groups < GROUP) & (split == 0) fails interpreted).
    with_sink = groups < tl.where(split == 0, GROUP, 0)
    m, l = _softmax_start(sinks_ptr + heads, with_sink, BLOCK_G, SINKS)  # noqa: E741
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        in_range = positions < end
        acc, m, l = _attend_tile(  # noqa: E741
            q, acc, m, l, kv_base, block_table, positions, in_range, in_range[None, :], dims,
            scale_log2e, softcap_log2e, cache_stride_block, cache_stride_plane,
            cache_stride_token, HEAD_DIM, PAGE_SIZE, DOT_PRECISION, UPCAST, True, QUANTIZED_KV,
            SOFTCAP,
        )  # fmt: skip

    if not SPLIT:
        out = acc / l[:, None]
        dst = out_ptr + seq * out_stride_t + heads[:, None] * out_stride_h + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        # An empty split (start past the context) has l == 0: lse -inf, weight 0 in the merge.
        nonempty = l > 0
        safe_l = tl.where(nonempty, l, 1.0)
        out = acc / safe_l[:, None]
        partial = (seq * (GROUP * tl.num_programs(1)) + heads) * num_splits + split  # [G]
        tl.store(out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], out, mask=row_mask)
        lse = tl.where(nonempty, m + tl.log2(safe_l), float("-inf"))
        tl.store(lse_ptr + partial, lse, mask=groups < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    partial_ptr,  # [B, H, num_splits, D] float32: each split's normalised output
    lse_ptr,  # [B, H, num_splits] float32
    out_ptr,  # [B, H, D]
    out_stride_t,
    out_stride_h,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # MAX_SPLITS as a power of two: one compiled kernel for any count
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * tl.num_programs(1) + head
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits
    lse = tl.load(lse_ptr + row * num_splits + splits, mask=split_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # [S]; empty splits weigh 0
    mask = split_mask[:, None] & (dims[None, :] < HEAD_DIM)
    partial = tl.load(
        partial_ptr + (row * num_splits + splits[:, None]) * HEAD_DIM + dims[None, :],
        mask=mask,
        other=0.0,
    )  # [S, D]
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    dst = out_ptr + seq * out_stride_t + head * out_stride_h + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _extend_key_runs(
    q_first,  # position of the tile's first query row
    seq_len,
    sliding_window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WINDOWED: tl.constexpr,
):  # -> (kv_start, unmasked_start, unmasked_end, kv_end)
    """The keys a tile of query rows attends to, ``[kv_start, kv_end)``, and the run of whole
    BLOCK_N-token tiles in it that every row sees, ``[unmasked_start, unmasked_end)``.

    kv_start is the first key of the first row's window (0 without one), kv_end one past the
    last row's position. Before the unmasked run lie the keys some rows' windows have left;
    after it, those some rows' causal masks have not reached yet.
    """
    kv_end = tl.minimum(seq_len, q_first + BLOCK_M)
    if WINDOWED:
        kv_start = tl.maximum(0, q_first - sliding_window + 1)
        shared_start = tl.maximum(kv_start, kv_end - sliding_window)  # the last row's first key
    else:
        kv_start = 0
        shared_start = 0
    unmasked_start = kv_start + tl.cdiv(shared_start - kv_start, BLOCK_N) * BLOCK_N
    num_unmasked = tl.maximum(0, q_first - unmasked_start) // BLOCK_N * BLOCK_N
    return kv_start, unmasked_start, unmasked_start + num_unmasked, kv_end


@triton.jit(do_not_specialize=["first_seq", "block_tables_stride"])
def _extend_kernel(
    query_ptr,  # [T, H, D]: the whole flattened batch's queries
    cache_ptr,  # [num_blocks, 2, PAGE_SIZE, Hkv, row]: already holds this step's K/V
    block_tables_ptr,  # [B, max_num_blocks] int32
    seq_lens_ptr,  # [B] int32: context length after this step
    query_start_loc_ptr,  # [B + 1] int32
    sinks_ptr,  # [H] float32: each head's sink logit (read only where SINKS)
    out_ptr,  # [T, H, D]
    scale_log2e,
    softcap_log2e,  # soft cap * log2(e) (read only where SOFTCAP)
    first_seq,  # index of the first prefill sequence (the decodes come before it)
    query_stride_t,
    query_stride_h,
    out_stride_t,
    out_stride_h,
    block_tables_stride,
    cache_stride_block,
    cache_stride_plane,
    cache_stride_token,
    cache_stride_head,
    sliding_window,  # keys each query sees, its own included (read only where WINDOWED)
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
    QUANTIZED_KV: tl.constexpr,  # an int8 cache (kv_layout)
    WINDOWED: tl.constexpr,  # a sliding window: rows also mask keys their window has left
    SOFTCAP: tl.constexpr,  # soft-capped scores
    SINKS: tl.constexpr,  # a sink logit per head in each row's softmax
):
    seq = first_seq + tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq)
    num_queries = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if tile * BLOCK_M >= num_queries:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # query rows of this tile within the chunk
    dims = tl.arange(0, BLOCK_D)
    row_mask = (rows[:, None] < num_queries) & (dims[None, :] < HEAD_DIM)
    # Each query's position in the sequence; padding rows past the chunk repeat its last, so
    # every row sees a key (their output is not stored).
    query_positions = seq_len - num_queries + tl.minimum(rows, num_queries - 1)
    tokens = (query_start + rows).to(tl.int64)
    q = tl.load(
        query_ptr + tokens[:, None] * query_stride_t + head * query_stride_h + dims[None, :],
        mask=row_mask,
        other=0.0,
    )  # [M, D]
    kv_base = cache_ptr + kv_head * cache_stride_head
    block_table = block_tables_ptr + seq * block_tables_stride

    sink_ptrs = sinks_ptr + tl.full([BLOCK_M], head, tl.int32)  # every row: this head's
    m, l = _softmax_start(sink_ptrs, rows >= 0, BLOCK_M, SINKS)  # noqa: E741
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_start, unmasked_start, unmasked_end, kv_end = _extend_key_runs(
        seq_len - num_queries + tile * BLOCK_M, seq_len, sliding_window, BLOCK_M, BLOCK_N, WINDOWED
    )
    for tile_start in range(unmasked_start, unmasked_end, BLOCK_N):
        positions = tile_start + tl.arange(0, BLOCK_N)
        acc, m, l = _attend_tile(  # noqa: E741
            q, acc, m, l, kv_base, block_table, positions, positions, positions, dims,
            scale_log2e, softcap_log2e, cache_stride_block, cache_stride_plane,
            cache_stride_token, HEAD_DIM, PAGE_SIZE, DOT_PRECISION, UPCAST, False, QUANTIZED_KV,
            SOFTCAP,
        )  # fmt: skip
    # The masked tiles, BLOCK_N apart from kv_start but for the unmasked run they skip: the
    # window's edge before it, the causal diagonal after it. Positions start at kv_start, so
    # no load reaches a block before the window. Each row's first key is one of the BLOCK_M
    # from kv_start, so when no unmasked tile came first, the first masked tile gives every
    # row a finite m (a row seeing no key in a tile would make exp2(-inf - -inf) NaN).
    tl.static_assert(BLOCK_M <= BLOCK_N)
    num_edge_tiles = (unmasked_start - kv_start) // BLOCK_N
    num_masked_tiles = num_edge_tiles + tl.cdiv(kv_end - unmasked_end, BLOCK_N)
    for i in range(0, num_masked_tiles):
        skip = tl.where(i < num_edge_tiles, 0, unmasked_end - unmasked_start)
        positions = kv_start + i * BLOCK_N + skip + tl.arange(0, BLOCK_N)
        in_range = positions < kv_end
        visible = in_range[None, :] & (positions[None, :] <= query_positions[:, None])
        if WINDOWED:
            visible &= positions[None, :] > query_positions[:, None] - sliding_window
        acc, m, l = _attend_tile(  # noqa: E741
            q, acc, m, l, kv_base, block_table, positions, in_range, visible, dims,
            scale_log2e, softcap_log2e, cache_stride_block, cache_stride_plane,
            cache_stride_token, HEAD_DIM, PAGE_SIZE, DOT_PRECISION, UPCAST, True, QUANTIZED_KV,
            SOFTCAP,
        )  # fmt: skip

    out = acc / l[:, None]
    dst = out_ptr + tokens[:, None] * out_stride_t + head * out_stride_h + dims[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, row] (kv_layout)
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] float32
    *,
    num_kv_splits: int | None = None,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each new token over its sequence's cached + new K/V; with a
    sliding window, over the last ``sliding_window`` positions up to and including its own
    (table entries before a sequence's window are never read); with a soft cap, each scaled
    score s becomes ``softcap * tanh(s / softcap)`` before the softmax (Gemma 2); with sinks,
    each head's softmax has one more logit, ``sinks[h]``, in its denominator and no value
    (GPT-OSS).

    ``num_kv_splits`` forces the decode split count (tests); by default it is chosen from
    the batch size and the most keys a decode sees.
    """
    _check_shapes(query, kv_cache, metadata)
    if num_kv_splits is not None and not 1 <= num_kv_splits <= MAX_SPLITS:
        raise ValueError(f"num_kv_splits must be in [1, {MAX_SPLITS}], got {num_kv_splits}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be positive and finite, got {softcap}")
    _check_sinks(sinks, query)
    out = torch.empty_like(query)
    num_decode_seqs = metadata.num_decode_seqs
    if num_decode_seqs:
        splits = num_kv_splits or _num_kv_splits(
            num_decode_seqs * kv_cache.shape[3],
            _max_decode_keys(metadata, sliding_window),
            query.device,
        )
        decodes = query[:num_decode_seqs]
        _decode(decodes, kv_cache, metadata, scale, sliding_window, softcap, sinks, splits, out)
    if metadata.num_seqs > num_decode_seqs:
        _extend(query, kv_cache, metadata, scale, sliding_window, softcap, sinks, out)
    return out


def _check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    if sinks is None:
        return
    num_heads = query.shape[1]
    if sinks.shape != (num_heads,) or sinks.dtype != torch.float32 or sinks.stride(0) != 1:
        raise ValueError(
            f"sinks must be a contiguous float32 tensor of the {num_heads} query heads, got "
            f"{sinks.dtype} {tuple(sinks.shape)} strides {sinks.stride()}"
        )
    if sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device}, the query on {query.device}")


def _check_shapes(query: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2 or head_dim_of(kv_cache) != head_dim:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit query {query.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache need a contiguous last (head_dim) axis")
    check_scale_alignment(kv_cache)
    if metadata.query_start_loc_cpu[-1] != query.shape[0]:
        raise ValueError(
            f"metadata covers {metadata.query_start_loc_cpu[-1]} rows, query has {query.shape[0]}"
        )


def _max_decode_keys(metadata: AttentionMetadata, sliding_window: int | None) -> int:
    """The most keys one decode sees, what its splits cut: its context, or its window."""
    if sliding_window is None:
        return metadata.max_decode_seq_len
    return min(metadata.max_decode_seq_len, sliding_window)


def _num_kv_splits(num_programs: int, max_keys: int, device: torch.device) -> int:
    """Splits per sequence so the grid covers the GPU about twice, each split doing at
    least MIN_SPLIT_TOKENS tokens (few keys are not worth a merge pass)."""
    wanted = -(-2 * _num_sms(device) // num_programs)
    most = max(1, max_keys // MIN_SPLIT_TOKENS)
    return max(1, min(wanted, most, MAX_SPLITS))


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return 8  # the interpreter: any small number keeps both paths reachable


def _dot_precision(dtype: torch.dtype) -> str:
    """float32 models multiply in IEEE float32 (tf32 would drift from the oracle)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    return INTERPRETED and dtype != torch.float32


def _decode(
    query: torch.Tensor,  # [B, H, D]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [H] float32
    num_splits: int,
    out: torch.Tensor,  # [T, H, D]; rows [0, B) are written
) -> None:
    batch, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    max_keys = _max_decode_keys(metadata, sliding_window)
    split_len = triton.cdiv(triton.cdiv(max_keys, num_splits), DECODE_BLOCK_N) * DECODE_BLOCK_N
    if num_splits == 1:
        target, lse = out, out  # lse unused
    else:
        target = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=query.device
        )
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        query if sinks is None else sinks,  # (unread without sinks)
        target,
        lse,
        scale * LOG2E,
        (softcap or 0.0) * LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        metadata.block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        split_len,
        sliding_window or 0,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N,
        PAGE_SIZE=kv_cache.shape[2],
        SPLIT=num_splits > 1,
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST=_upcast_dot(query.dtype),
        QUANTIZED_KV=is_quantized(kv_cache),
        WINDOWED=sliding_window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=DECODE_NUM_WARPS,
        num_stages=DECODE_NUM_STAGES,
    )
    if num_splits > 1:
        _merge_splits(target, lse, out)


def _merge_splits(
    partial: torch.Tensor,  # [B, H, S, D] float32: each split's normalised output
    lse: torch.Tensor,  # [B, H, S] float32: each split's log-sum-exp
    out: torch.Tensor,  # [T, H, D]; rows [0, B) are written
) -> None:
    batch, num_heads, num_splits, head_dim = partial.shape
    _merge_splits_kernel[(batch, num_heads)](
        partial,
        lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS),
    )


def _extend(
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [H] float32
    out: torch.Tensor,  # [T, H, D]; the prefill sequences' rows are written
) -> None:
    num_heads, head_dim = query.shape[1:]
    first = metadata.num_decode_seqs
    max_queries = metadata.max_prefill_query_len
    grid = (metadata.num_seqs - first, num_heads, triton.cdiv(max_queries, EXTEND_BLOCK_M))
    _extend_kernel[grid](
        query,
        kv_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        query if sinks is None else sinks,  # (unread without sinks)
        out,
        scale * LOG2E,
        (softcap or 0.0) * LOG2E,
        first,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        metadata.block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        sliding_window or 0,
        GROUP=num_heads // kv_cache.shape[3],
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=EXTEND_BLOCK_M,
        BLOCK_N=EXTEND_BLOCK_N,
        PAGE_SIZE=kv_cache.shape[2],
        DOT_PRECISION=_dot_precision(query.dtype),
        UPCAST=_upcast_dot(query.dtype),
        QUANTIZED_KV=is_quantized(kv_cache),
        WINDOWED=sliding_window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=EXTEND_NUM_WARPS,
        num_stages=EXTEND_NUM_STAGES,
    )
