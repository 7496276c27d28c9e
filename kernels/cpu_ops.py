"""The CPU backend: a `KernelSet` of C kernels (``kernels/csrc/cpu_kernels.c``) where they pay.
(`headrace.kernels.cpu_decode` runs a decode step's layers from the same kernels in one call.)

Decode and prefill attention read K/V block by block from the paged cache in place, with an
online softmax per row: the torch reference instead gathers every sequence's whole context
into a padded batch each layer, which dominated decode on CPU. `linear` multiplies a decode
step's few rows in C (each weight read from memory once, float32 or bf16 / fp16 widened in
registers, every output summed in float32 in a fixed order); more rows go to torch's GEMM
on weights packed once for oneDNN (`headrace.kernels.prepacked`).
The sampler's seeded draw (`draw_tokens`, noise made only for the tokens that can still
win), its grammar bitmask and the greedy head's running argmax are C too, and so are the
fused residual add + RMSNorm, rotary and silu * up: at a decode step's few rows their dozen
torch calls per layer cost more than their arithmetic. LoRA is the reference's, and so is
any call a C kernel does not take (another dtype or device, a draw its race leaves
unsettled).
`available()` says whether the library could be built; `select_kernels` falls back to the
reference otherwise.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
from headrace.kernels import native, prepacked, reference
from headrace.kernels.attention import AttentionMetadata
from headrace.kernels.huge_pages import HugePageChunks
from headrace.kernels.kv_layout import head_dim_of, is_quantized
from headrace.kernels.lora import lora_expand, lora_shrink
from headrace.kernels.precision import compute_dtype, cpu_has_flag
from headrace.kernels.quantized import QuantizedWeight
from headrace.kernels.reference import extend, extend_fresh
from torch import nn

NAME = "cpu"

__all__ = [
    "NAME",
    "apply_rotary",
    "apply_token_bitmask",
    "argmax_update",
    "draw_tokens",
    "linear",
    "lora_expand",
    "lora_shrink",
    "paged_attention",
    "quantized_linear",
    "rms_norm",
    "silu_and_mul",
    "write_kv_cache",
]

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: ... and of a KV cache's dtype: the float ones, or int8 rows with their scale (kv_layout).
_KV_DTYPE_CODES = {**_DTYPE_CODES, torch.int8: 3}
#: Queries of one prefill sequence that share each key tile (rows per work item, per KV head).
QUERY_TILE = 16
#: Prefill chunks longer than this go to torch's flash attention (measured crossover on a
#: 2-core AVX-512 machine: the C kernel is 1.1x faster at 512 new tokens, 0.85x at 768).
LONG_PREFILL = 512
#: Where torch's attention multiplies on AMX tiles (a bf16 cache on a CPU with AMX-BF16; the C
#: kernel computes in float32 on vector units), a chunk of at least AMX_MIN_QUERIES new tokens
#: whose new tokens times context reach AMX_MIN_SCORES goes to torch too. Measured on a 2-core
#: Xeon with AMX (2026-11-25, SmolLM2's 9 / 3 heads of 64; C kernel / torch, ms): chunks of 256
#: new tokens x 64: 39.3 / 21.5; 128 after 384 cached x 32: 29.8 / 13.9; 32 after 480 x 64:
#: 16.9 / 15.5; 128 new x 64: 11.4 / 9.8; 96 new x 96: 11.1 / 12.1; 64 new x 128: 7.1 / 12.1.
AMX_MIN_QUERIES = 32
AMX_MIN_SCORES = 128 * 128


#: Rows up to which `linear` runs the C kernel (float32 weights with AVX-512's tiles: up to
#: FLOAT32_MAX_ROWS, below): it reads each weight from memory once and meets every row there,
#: where torch's GEMM is slower on few rows. Measured on SmolLM2-135M's
#: 120 matmuls of a step (2 cores, float32): 1 row 16.6 ms, torch 16.6; 4: 18.1 vs 28.0;
#: 24: 26.9 vs 44.5; 64: 61.3 vs 60.4. Up to 64 rows, where the two tie, so that a decode
#: step of 64 sequences runs its layers in one C call (`cpu_decode`): 64 requests of 32-512
#: tokens, 128 new, float32 on a 2-core Xeon (2026-11-25): decode step 159-161 -> 132-135
#: ms, 247-249 -> 267-272 tok/s (the Python between the per-op path's ~300 calls).
SKINNY_MAX_ROWS = 64
#: The same for bf16 / float16 weights where torch's GEMM of the dtype is native (bf16 on
#: AVX512-BF16 or AMX) and the C kernel widens them to float32: torch computes at twice the
#: float32 rate there, so it takes over sooner. Measured 2026-11-24 on the 2-core
#: AVX512-BF16 machine (no AMX), SmolLM2-135M's 120 layer matmuls in bf16 on one thread, C
#: (widening) vs torch: 1 row 33.5 vs 48.6 ms, 8: 41.6 vs 57.4, 16: 74.5 vs 76.4, 24: 139 vs
#: 80. Where torch would widen the weights to float32 first (`precision.compute_dtype`), its
#: GEMM is float32's plus a pass over the weights: `SKINNY_MAX_ROWS` holds.
SKINNY_MAX_ROWS_BF16 = 8
#: bf16 x against bf16 weights with AVX512-BF16's dot instruction (`bf16_pairs`) against
#: torch's bf16 GEMM on a CPU without AMX: SKINNY_MAX_ROWS holds. Measured 2026-11-24, the
#: same machine, 2 threads, all 121 matmuls of a step, C vs torch: 1 row 9.7 vs 19.4 ms, 8:
#: 21.2 vs 22.9, 24: 23.8 vs 32.9, 48: 44.3 vs 49.9, 64: 58.7 vs 60.4. (AMX, untested here,
#: multiplies tiles several times faster than the dot instruction: torch keeps its rows.)
#: A bf16 weight parameter is multiplied by its panels (`panel_copy`) there since 2026-11-29,
#: at every row count (`linear`): the 120 layer matmuls (no LM head), 2 threads, panels vs
#: oneDNN's packed GEMM, ms: 8 rows 7.1-9.8 vs 11.9-12.5, 16: 11.5 vs 15.0, 32: 19.4 vs
#: 24.3, 48: 29.8 vs 37.3, 64: 34.6 vs 38.2 (the row-layout kernel: 9.3, 13.6, 24.7, 35.7,
#: 47.9), 256: 134.6 vs 136.3, 1024: 535 vs 545, 2048: 1077 vs 1044.
#: Where the CPU has AMX tiles (`amx_tiles`), bf16 rows from 3 to AMX_MAX_ROWS multiply on
#: them in C (kernels/csrc/amx_linear.c; 1 and 2 rows keep the vector kernel's row stream).
#: Measured 2026-11-25 on a 2-core Xeon with AMX, SmolLM2-135M's 30 layers' matmuls and its
#: LM head in bf16 (each weight read from memory), C vs oneDNN's packed GEMM, ms: 1 row
#: (vector) 6.1 vs 13.1; 8: 8.1-8.4 vs 12.9-13.3 (the vector kernel 14.6); 16: 9.3-9.8 vs
#: 11.2-11.6; 32: 11.7-12.8 vs 12.9-13.2; 64: 20.6 vs 15.3. The tiles keep 64 rows all the
#: same: the decode step then runs in one C call (`cpu_decode`), which more than pays for
#: the slower matmuls: 64 requests of 32-512 tokens, 128 new: decode step 78-80 -> 63 ms,
#: 576-591 -> 678 tok/s; 24 requests of 32-256, 64 new: 45 -> 23 ms, 421-430 -> 691-706.
AMX_MAX_ROWS = 64
#: Float32 rows up to FLOAT32_MAX_ROWS run in the C kernel too, past SKINNY_MAX_ROWS: a weight
#: tile stays in L1 while it meets every row, so its rate holds to a few hundred rows, and a
#: step of that many rows then runs its layers in one C call (`cpu_decode`), which saves
#: more than oneDNN's GEMM would. Past it the rows go to oneDNN's packed GEMM, which pads
#: them to a bucket (`prepacked.bucket_rows`: up to a quarter more rows) and computes the
#: padding too. Measured 2026-11-29 on the 2-core Zen 4 (AVX512-BF16, no AMX), SmolLM2-135M's
#: 120 layer matmuls (30 distinct weights each, 2 threads), oneDNN padded / oneDNN at the
#: exact row count (a kernel per count: ~0.6 MB each, which is why there are buckets) / the C
#: kernel, ms: 70 rows 96.7 / 85.3 / 81.7; 129: 184 / 143 / 148; 161: 214 / 177 / 183; 200:
#: 261 / 240 / 249; 256 (a bucket): 281 / 274 / 300; 300: 347 / 320 / 337; 400: 479 / 413 /
#: 467; 1024: 1042 / 1029 / 1225. The LM head (49152 x 576) likewise: 161 rows 60.8 / 43.6 /
#: 48.8. So up to 320 rows the C kernel runs within 3-9% of oneDNN's exact count, and ahead
#: of its buckets wherever they pad; from 400 rows it falls 13-19% behind. Steps of one or
#: two 128-token prompts beside 1 to 63 decodes, the shape of a served step at a request
#: rate, in one process, each way in turn: layer by layer with oneDNN past 64 rows where its
#: bucket pads by 8% or less and C elsewhere (the rule before this one) / layer by layer
#: with C up to 320 / in one call: one prompt 314 / 307 / 277 ms mean (the one call 1.14x
#: faster than the old rule, median of the steps' ratios), two 506 / 521 / 465 (1.07x).
#: Layer by layer the two rules tie (1.02x and 0.98x).
#: That holds for AVX-512's tiles only (`wide_tiles`). With 8-lane registers (AVX2) a tile is
#: one row against 4 weights and falls behind oneDNN sooner: the same 120 matmuls on a 2-core
#: AVX2 Zen 3 (2026-11-29), C / oneDNN packed, ms: 1 row 28.9 / 57.1; 8: 42.4 / 85.1; 24:
#: 105.5 / 147.1; 64: 247-277 / 194-269; 128: 480-552 / 355-395; 320: 1331 / 757. There
#: float32 keeps to SKINNY_MAX_ROWS.
FLOAT32_MAX_ROWS = 320


#: Rows up to which `quantized_linear` runs the C kernel, by bits: past them, torch's GEMM on
#: the weight dequantized for the call wins. Measured 2026-11-24 on the 2-core machine,
#: SmolLM2's 120 layer matmuls, C vs dequantize + GEMM: int4 48 rows 73 vs 104 ms, 96: 146 vs
#: 165, 128: 218 vs 215, 256: 412 vs 371; int8 48: 62 vs 108, 128: 172 vs 216, 256: 355 vs
#: 393 (not measured past 256). The weights are formed in registers once per 6 rows of x, so
#: the kernel keeps float32's cost where the GEMM pays for a float copy of every weight.
QUANTIZED_MAX_ROWS = {8: 256, 4: 112}
#: The same where the tiles have 8 lanes (AVX2, `wide_tiles` false): a tile forms its weights
#: once per 2 rows of x, and 4-bit weights (nibbles, a scale and an offset) cost it the most
#: there. Measured 2026-11-30 on the 2-core AVX2 Zen 3, the same 120 matmuls, alternating in
#: one process, C vs dequantize + GEMM, ms, in three processes (this machine's speed swung
#: 2x between them): int4 12 rows 124 vs 259; 16: 155 vs 268, 174 vs 170, 188 vs 186; 24:
#: 200 vs 147, 237 vs 250, 263 vs 267; 64: 433 vs 225, 345 vs 287; 112: 1124 vs 370, 480 vs
#: 471. Int8 ties from 48 rows to 128 in the matmuls (331 vs 333 at 48) and its C kernel
#: keeps the LM head well ahead (the 49152 x 576 embedding dequantized every step: a 48-row
#: decode's LM head 63 ms in C against 145), so int8 keeps AVX-512's limit.
QUANTIZED_MAX_ROWS_NARROW = {8: QUANTIZED_MAX_ROWS[8], 4: 16}


def quantized_max_rows(bits: int) -> int:
    """Rows up to which `quantized_linear` runs the C kernel for weights of these bits."""
    return (QUANTIZED_MAX_ROWS if wide_tiles() else QUANTIZED_MAX_ROWS_NARROW)[bits]


def available() -> bool:
    """Whether the C kernels built and load on this machine."""
    return native.load() is not None


def library() -> ctypes.CDLL:
    loaded = native.load()
    if loaded is None:
        raise RuntimeError(f"CPU kernels unavailable: {native.build_error()}")
    return loaded


def dtype_code(dtype: torch.dtype) -> int:
    """The C kernels' code for dtype (0 float32, 1 bfloat16, 2 float16)."""
    return _DTYPE_CODES[dtype]


def kv_dtype_code(dtype: torch.dtype) -> int:
    """The C kernels' code for a KV cache's dtype: a float one's, or 3 for int8 rows."""
    return _KV_DTYPE_CODES[dtype]


def _row_dtype(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.dtype:
    """The dtype the kernels take new K/V rows and queries in: a float cache's own; beside
    an int8 cache, x's where the kernels read it (else float32)."""
    if not is_quantized(kv_cache):
        return kv_cache.dtype
    return x.dtype if x.dtype in _DTYPE_CODES else torch.float32


def _ptr(tensor: torch.Tensor) -> int:
    return tensor.data_ptr()


def write_kv_cache(
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    _check_cache(kv_cache)
    dtype = _row_dtype(key, kv_cache)
    key, value = (_rows(t.to(dtype)) for t in (key, value))
    slots = slot_mapping.to(torch.int64).contiguous()
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    library().headrace_write_kv_cache(
        _ptr(key),
        key.stride(0),
        key.stride(1),
        _ptr(value),
        value.stride(0),
        value.stride(1),
        _ptr(kv_cache),
        _ptr(slots),
        len(slots),
        num_kv_heads,
        head_dim_of(kv_cache),
        block_size,
        _DTYPE_CODES[dtype],
        _KV_DTYPE_CODES[kv_cache.dtype],
    )


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [T, num_heads, head_dim]
    """Causal attention of each new token over its sequence's cached + new K/V; with a
    sliding window, over the last ``sliding_window`` positions up to and including its own
    (no block before a sequence's window is read: see `headrace.kernels.attention`); with a
    soft cap, each scaled score s becomes ``softcap * tanh(s / softcap)`` before the softmax
    (Gemma 2); with sinks, head h's softmax has one more logit, ``sinks[h]``, in its
    denominator and no value (GPT-OSS; taken as float32).

    Decodes and prefill chunks up to `LONG_PREFILL` tokens run in the C kernel; longer chunks
    are compute-bound, where torch's flash attention over the gathered context is faster (the
    gather is cheap next to the chunk's arithmetic), and so are shorter ones on AMX
    (`attends_in_kernel`).
    """
    _check_cache(kv_cache)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"a sliding window must hold at least one key, not {sliding_window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"a soft cap must be positive, not {softcap}")
    query_dtype = query.dtype
    query = _rows(query.to(_row_dtype(query, kv_cache)))
    num_tokens, num_heads, head_dim = query.shape
    sinks = _head_sinks(sinks, num_heads)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=query.dtype)
    starts_cpu = metadata.query_start_loc_cpu
    long = _chunks_for_torch(metadata, kv_cache.dtype)
    torch_bound = set(long)
    in_kernel = [i for i in range(metadata.num_seqs) if i not in torch_bound]
    if in_kernel:
        _attend_in_kernel(
            query, kv_cache, metadata, scale, sliding_window, softcap, sinks, in_kernel, out
        )
    plain = sliding_window is None and softcap is None and sinks is None
    for first, last in _torch_calls(long, metadata, batch_whole_prompts=plain):
        start, end = starts_cpu[first], starts_cpu[last + 1]
        tables = metadata.block_tables[first : last + 1]
        if last > first:
            batch = query[start:end].view(last + 1 - first, -1, num_heads, head_dim)
            out[start:end] = extend_fresh(batch, kv_cache, tables, scale).flatten(0, 1)
        else:
            seq_len = metadata.seq_lens_cpu[first]
            out[start:end] = extend(
                query[start:end], kv_cache, tables, seq_len, scale, sliding_window, softcap, sinks
            )
    return out.to(query_dtype)


def _torch_calls(
    chosen: list[int], metadata: AttentionMetadata, batch_whole_prompts: bool
) -> list[tuple[int, int]]:
    """The torch attention calls for the ``chosen`` sequences, as ``(first, last)`` ranges: a
    sequence alone, or (with ``batch_whole_prompts``) a run of adjacent chunks that are whole
    prompts of one length, which one SDPA call takes (a burst of equal prompts, 16 x 128
    tokens: 5.0 -> 3.1 ms a layer in bf16, the same bits as one call each)."""
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    calls: list[tuple[int, int]] = []
    grows = False  # whether the last call is a whole prompt, or a run of them
    for i in chosen:
        whole = batch_whole_prompts and starts[i + 1] - starts[i] == seq_lens[i]
        first, last = calls[-1] if calls else (-1, -1)
        if grows and whole and i == last + 1 and seq_lens[i] == seq_lens[first]:
            calls[-1] = (first, i)
        else:
            calls.append((i, i))
            grows = whole
    return calls


def attends_in_kernel(metadata: AttentionMetadata, kv_cache_dtype: torch.dtype) -> bool:
    """Whether `paged_attention` runs every sequence of the step in the C kernel."""
    return not _chunks_for_torch(metadata, kv_cache_dtype)


def _chunks_for_torch(metadata: AttentionMetadata, kv_cache_dtype: torch.dtype) -> list[int]:
    """The sequences whose chunks attend in torch's flash attention rather than the C
    kernel: past `LONG_PREFILL` new tokens, or on AMX from `AMX_MIN_QUERIES` tokens and
    `AMX_MIN_SCORES` scores on. Decodes (the first num_decode_seqs) never do; a decode
    step's answer costs nothing."""
    longest = metadata.max_prefill_query_len
    if longest < AMX_MIN_QUERIES and longest <= LONG_PREFILL:
        return []
    on_amx = kv_cache_dtype == torch.bfloat16 and cpu_has_flag("amx_bf16")
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    chosen = []
    for i in range(metadata.num_decode_seqs, metadata.num_seqs):
        num_queries = starts[i + 1] - starts[i]
        many_scores = num_queries >= AMX_MIN_QUERIES and num_queries * seq_lens[i] >= AMX_MIN_SCORES
        if num_queries > LONG_PREFILL or (on_amx and many_scores):
            chosen.append(i)
    return chosen


def _head_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """Each head's sink logit as the kernel reads it: [num_heads] float32, contiguous."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,):
        raise ValueError(
            f"sinks must hold one logit per query head ({num_heads}), not {tuple(sinks.shape)}"
        )
    return sinks.to(torch.float32).contiguous()


def attention_arrays(
    metadata: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The block tables, query starts and sequence lengths as the C attention reads them:
    contiguous int32."""
    tables = metadata.block_tables.to(torch.int32).contiguous()
    starts = metadata.query_start_loc.to(torch.int32).contiguous()
    return tables, starts, metadata.seq_lens.to(torch.int32).contiguous()


def _attend_in_kernel(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,  # [num_heads] float32, contiguous
    seq_ids: list[int],
    out: torch.Tensor,
) -> None:
    tables, starts, seq_lens = attention_arrays(metadata)
    selected = torch.tensor(seq_ids, dtype=torch.int32)
    status = library().headrace_paged_attention(
        _ptr(query),
        query.stride(0),
        query.stride(1),
        _ptr(kv_cache),
        _ptr(tables),
        tables.stride(0),
        _ptr(starts),
        _ptr(seq_lens),
        _ptr(selected),
        len(seq_ids),
        query.shape[1],
        kv_cache.shape[3],
        query.shape[2],
        kv_cache.shape[2],
        scale,
        sliding_window or 0,
        softcap or 0.0,
        None if sinks is None else _ptr(sinks),
        _DTYPE_CODES[query.dtype],
        _KV_DTYPE_CODES[kv_cache.dtype],
        QUERY_TILE,
        _ptr(out),
    )
    if status != 0:
        raise MemoryError("paged attention could not allocate its scratch memory")


def linear(
    x: torch.Tensor,  # [T, in]
    weight: torch.Tensor,  # [out, in]
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, out] in out_dtype (default: x's dtype)
    """x Wᵀ + b: a decode step's few rows (`skinny_max_rows`; float32 up to a few hundred with
    AVX-512) in the C kernel, float32 arithmetic over float32, bf16 or float16 weights (each
    output's sum in a fixed order, whatever the other rows), and bf16 rows against a weight's
    panels at any row count (`panel_copy`); else torch's on the weight packed once
    (`prepacked.linear`)."""
    on_cpu = x.dim() == 2 and x.device.type == "cpu"
    in_c, panels = skinny_operands(x.shape[0], x.dtype, weight) if on_cpu else (False, None)
    if not in_c:
        return prepacked.linear(x, weight, bias, out_dtype)

    def run(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> int:
        return int(
            library().headrace_skinny_linear(
                _ptr(x),
                x.stride(0),
                _DTYPE_CODES[x.dtype],
                x.shape[0],
                _ptr(weight),
                None if panels is None else _ptr(panels),
                _DTYPE_CODES[weight.dtype],
                weight.shape[0],
                weight.shape[1],
                None if bias is None else _ptr(bias),
                _ptr(out),
                out.stride(0),
                _DTYPE_CODES[out.dtype],
            )
        )

    return _skinny(x, bias, out_dtype, weight.shape[0], run)


#: Where panels are made: in huge pages, as the weights are (a one-row step streams them:
#: measured 5-7% faster at 1 to 8 rows than from the heap), a few matrices to a chunk.
PANEL_CHUNK_BYTES = 64 << 20
_panel_memory = HugePageChunks(PANEL_CHUNK_BYTES)


def _pack_panels(weight: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
    """weight's panels, packed into `previous` where it has their size (a weight update
    repacks in place), else into new memory."""
    rows, cols = weight.shape
    elements = library().headrace_panel_elements(rows, cols)
    panels = previous
    if panels is None or panels.numel() != elements:
        panels = _panel_memory.take((elements,), torch.bfloat16)
    library().headrace_pack_panels(_ptr(weight), rows, cols, _ptr(panels))
    return panels


_panel_copies = prepacked.PerParameter(_pack_panels)


def panel_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 weight parameter packed into panels (``kernels/csrc/panel_linear.c``), which
    `linear` multiplies bf16 rows by where the CPU has AVX512-BF16: packed on first use and
    again after a write (in place), a second copy of the weight in memory (in place of
    oneDNN's, which such a weight then never needs: the panels run at oneDNN's rate from 256
    rows to 2048 and faster below). None for any other weight: not bf16, not a parameter (a
    tensor made per call would be packed per call), or a CPU without the pair instruction or
    with AMX tiles (`makes_panels`)."""
    takes = isinstance(weight, nn.Parameter) and weight.dtype == torch.bfloat16
    if not (takes and weight.dim() == 2 and weight.is_contiguous() and makes_panels()):
        return None
    return _panel_copies(weight)


@functools.cache
def makes_panels() -> bool:
    """Whether bf16 weight parameters get panels here: AVX512-BF16 and no AMX tiles (where
    the CPU has them, the tiles take bf16 rows from 3 to AMX_MAX_ROWS on the plain weights
    and oneDNN more, so panels would be a third copy for one and two rows)."""
    return available() and bf16_pairs() and not amx_tiles()


def _skinny(
    x: torch.Tensor,  # [T, in]
    bias: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    num_outputs: int,
    run: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], int],
) -> torch.Tensor:  # [T, num_outputs] in out_dtype (default: x's dtype)
    """A C matmul's call (``run(x, bias, out)``, 0 or -1 when out of memory) with x's rows
    contiguous, the bias in float32, and out in a dtype the kernel stores."""
    if x.stride(1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    out_dtype = out_dtype or x.dtype
    store_dtype = out_dtype if out_dtype in _DTYPE_CODES else torch.float32
    out = torch.empty(x.shape[0], num_outputs, dtype=store_dtype)
    if run(x, bias, out) != 0:
        raise MemoryError("the skinny matmul could not allocate its float32 copy of x")
    return out if store_dtype == out_dtype else out.to(out_dtype)


def quantized_linear(
    x: torch.Tensor,  # [T, in]
    weight: QuantizedWeight,  # [out, in]
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:  # [T, out] in out_dtype (default: x's dtype)
    """x against quantized weights: a decode step's few rows in the C kernel, which forms each
    weight in registers as `quantized.dequantize` does and sums as `linear` sums float32
    weights; more rows multiply the weight dequantized into x's compute dtype by torch.
    Weights with ``int8_activations`` take their own C kernel at every row count."""
    on_cpu = x.device.type == weight.device.type == "cpu" and x.dtype in _DTYPE_CODES
    if not on_cpu:
        return reference.quantized_linear(x, weight, bias, out_dtype)
    in_kernel = weight.int8_activations or 0 < x.shape[0] <= quantized_max_rows(weight.bits)
    if not in_kernel:
        dtype = compute_dtype(x.dtype, x.device)
        wide_bias = None if bias is None else bias.to(dtype)
        y = torch.nn.functional.linear(x.to(dtype), dequantize(weight, dtype), wide_bias)
        return y.to(out_dtype or x.dtype)

    kernel = library().headrace_quantized_linear
    if weight.int8_activations:
        kernel = library().headrace_quantized_linear_a8  # same operands

    def run(x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> int:
        return int(
            kernel(
                _ptr(x),
                x.stride(0),
                _DTYPE_CODES[x.dtype],
                x.shape[0],
                *_quantized_operands(weight),
                None if bias is None else _ptr(bias),
                _ptr(out),
                out.stride(0),
                _DTYPE_CODES[out.dtype],
            )
        )

    return _skinny(x, bias, out_dtype, weight.shape[0], run)


def _quantized_operands(weight: QuantizedWeight) -> tuple[int | None, ...]:
    """A quantized weight as the C kernels take it: data, bits, N, K, group size, scales,
    offsets (None for 8 bits)."""
    rows, cols = weight.shape
    offsets = None if weight.offsets is None else _ptr(weight.offsets)
    return (
        _ptr(weight.data),
        weight.bits,
        rows,
        cols,
        weight.group_size,
        _ptr(weight.scales),
        offsets,
    )


def dequantize(weight: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [out, in] in dtype: `quantized.dequantize`'s values, rounded once."""
    out = torch.empty(weight.shape, dtype=dtype)
    library().headrace_dequantize(*_quantized_operands(weight), _ptr(out), _DTYPE_CODES[dtype])
    return out


def bf16_pairs() -> bool:
    """Whether `linear` sums bf16 x against bf16 weights in pairs (AVX512-BF16's dot
    instruction: lane i adds the products of elements 2i + 1, then 2i, of each 32), rather
    than as the float32 kernel sums the widened values."""
    return bool(library().headrace_skinny_bf16_pairs())


@functools.cache
def amx_tiles() -> bool:
    """Whether `linear` multiplies bf16 rows on AMX tiles: the CPU has them (the kernels
    were compiled for it) and the OS granted their use."""
    return available() and bool(library().headrace_amx_init())


@functools.cache
def wide_tiles() -> bool:
    """Whether the C matmul was compiled for 16-lane registers (AVX-512), whose tiles keep
    their rate to a few hundred rows (`FLOAT32_MAX_ROWS`)."""
    return available() and library().headrace_skinny_part_lanes() == 16


def skinny_max_rows(weight_dtype: torch.dtype) -> int:
    """Rows up to which `linear` runs the C kernel for weights of this dtype (0: never)."""
    if weight_dtype not in _DTYPE_CODES:
        return 0
    if weight_dtype == torch.float32:
        return FLOAT32_MAX_ROWS if wide_tiles() else SKINNY_MAX_ROWS
    if weight_dtype == torch.bfloat16 and amx_tiles():
        return AMX_MAX_ROWS
    in_float32 = compute_dtype(weight_dtype, torch.device("cpu")) == torch.float32
    if in_float32 or (weight_dtype == torch.bfloat16 and _pairs_beat_torch()):
        return SKINNY_MAX_ROWS
    return SKINNY_MAX_ROWS_BF16


@functools.cache
def _pairs_beat_torch() -> bool:
    return available() and bf16_pairs() and not cpu_has_flag("amx_bf16")


def skinny_operands(
    num_rows: int, dtype: torch.dtype, weight: torch.Tensor
) -> tuple[bool, torch.Tensor | None]:
    """Whether `linear` multiplies ``num_rows`` rows of ``dtype`` in CPU memory by weight in
    the C kernel, and the weight's panels it reads there (bf16 rows against a weight that has
    them), or None."""
    panels = panel_copy(weight) if dtype == torch.bfloat16 else None
    in_kernel = weight.device.type == "cpu" and dtype in _DTYPE_CODES and weight.is_contiguous()
    skinny = in_kernel and 0 < num_rows <= skinny_max_rows(weight.dtype)
    return panels is not None or skinny, panels


#: Widest row `rms_norm` takes in C (its row buffer lives on the stack); wider go to torch.
RMS_NORM_MAX_COLS = 8192


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., hidden]
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed, x + residual)
    """The reference's fused residual add + RMSNorm in one C pass per row (rounded as the
    reference rounds); shapes, dtypes or layouts it does not take go to the reference."""
    cols = x.shape[-1]
    rows = _as_rows(x)
    other = None if residual is None else _as_rows(residual)
    fits = x.dtype in _DTYPE_CODES and weight.dtype == x.dtype and cols <= RMS_NORM_MAX_COLS
    if not fits or rows is None or (residual is not None and other is None):
        return reference.rms_norm(x, weight, eps, residual)
    weight = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    total = torch.empty(x.shape, dtype=x.dtype) if residual is not None else x
    library().headrace_rms_norm(
        _ptr(rows),
        rows.stride(0),
        None if other is None else _ptr(other),
        0 if other is None else other.stride(0),
        _ptr(weight),
        eps,
        _ptr(out),
        None if residual is None else _ptr(total),
        rows.shape[0],
        cols,
        _DTYPE_CODES[x.dtype],
    )
    return out, total


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with unit column stride, without a copy; None if it cannot be."""
    if x.device.type != "cpu" or x.stride(-1) != 1:
        return None
    if x.dim() == 2:
        return x
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None


def apply_rotary(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    cos: torch.Tensor,  # [T, 1, head_dim]: both halves equal (neox layout)
    sin: torch.Tensor,  # [T, 1, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's neox rotary in one C pass over the query and key heads, each op
    rounded as the reference rounds it; into new contiguous tensors."""
    head_dim = query.shape[-1]
    same = query.dtype == key.dtype == cos.dtype == sin.dtype and query.dtype in _DTYPE_CODES
    if not (same and query.device.type == "cpu" and head_dim % 2 == 0 and head_dim <= 1024):
        return reference.apply_rotary(query, key, cos, sin)
    query, key = _rows(query), _rows(key)
    cos, sin = cos.contiguous(), sin.contiguous()
    query_out, key_out = (
        torch.empty(query.shape, dtype=query.dtype),
        torch.empty(key.shape, dtype=key.dtype),
    )
    library().headrace_apply_rotary(
        _ptr(query),
        query.stride(0),
        query.stride(1),
        query.shape[1],
        _ptr(key),
        key.stride(0),
        key.stride(1),
        key.shape[1],
        _ptr(cos),
        _ptr(sin),
        _ptr(query_out),
        _ptr(key_out),
        query.shape[0],
        head_dim,
        _DTYPE_CODES[query.dtype],
    )
    return query_out, key_out


def silu_and_mul(
    gate_up: torch.Tensor,  # [T, 2 * intermediate]: the gate's columns, then up's
) -> torch.Tensor:  # [T, intermediate]
    """The reference's silu(gate) * up in one C pass, rounded as the reference rounds."""
    in_kernel = gate_up.dim() == 2 and gate_up.dtype in _DTYPE_CODES and gate_up.stride(1) == 1
    if not in_kernel or gate_up.device.type != "cpu":
        return reference.silu_and_mul(gate_up)
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, cols, dtype=gate_up.dtype)
    library().headrace_silu_and_mul(
        _ptr(gate_up), gate_up.stride(0), _ptr(out), rows, cols, _DTYPE_CODES[gate_up.dtype]
    )
    return out


def argmax_update(
    x: torch.Tensor,  # [N, C] float32: columns [offset, offset + C) of every row
    offset: int,
    best: torch.Tensor,  # [N] float32, updated in place
    index: torch.Tensor,  # [N] int64, updated in place
) -> None:
    """A running argmax over column blocks in ascending order: after the last block, index
    holds each row's first maximum over all columns (as `argmax` of the whole rows)."""
    in_kernel = x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"
    if not (in_kernel and best.is_contiguous() and index.is_contiguous()):
        reference.argmax_update(x, offset, best, index)
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    library().headrace_argmax_update(
        _ptr(x), x.shape[0], x.shape[1], x.stride(0), offset, _ptr(best), _ptr(index)
    )


def draw_tokens(
    logits: torch.Tensor,  # [S, V] float32 (top-k applied as -inf)
    temperature: torch.Tensor,  # [S] float32, > 0
    top_p_floor: torch.Tensor,  # [S] float32: 1 - top_p (<= 0: no top-p)
    min_p: torch.Tensor,  # [S] float32
    keys: torch.Tensor,  # [S, 2] int64: (odd multiplier, offset) of each row's noise
) -> torch.Tensor:  # [S] int64
    """One seeded draw per row: argmax of logits / T plus Gumbel noise over the tokens top-p
    and min-p keep (see `headrace.kernels.sampling`). A row whose race's best few tokens are
    all outside its top-p set is drawn by the reference, as is any call off the CPU."""
    if logits.dtype != torch.float32 or logits.device.type != "cpu":
        return reference.draw_tokens(logits, temperature, top_p_floor, min_p, keys)
    tokens = _race(logits, temperature, top_p_floor, min_p, keys)
    unsettled = (tokens < 0).nonzero().view(-1)
    if len(unsettled):
        rows = unsettled.tolist()
        tokens[unsettled] = reference.draw_tokens(
            logits[rows], temperature[rows], top_p_floor[rows], min_p[rows], keys[rows]
        )
    return tokens


def _race(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:  # [S] int64; -1 for a row the kernel leaves unsettled
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    columns = [t.to(torch.float32).contiguous() for t in (temperature, top_p_floor, min_p)]
    keys = keys.to(torch.int64).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    library().headrace_draw_tokens(
        _ptr(logits),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        *(_ptr(c) for c in columns),
        _ptr(keys),
        _ptr(out),
    )
    return out


def _check_cache(kv_cache: torch.Tensor) -> None:
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        raise ValueError("the CPU kernels need a contiguous KV cache in CPU memory")
    if kv_cache.dtype not in _KV_DTYPE_CODES:
        raise ValueError(f"the CPU kernels do not support KV-cache dtype {kv_cache.dtype}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] with unit stride along head_dim (its other strides may be any)."""
    return x if x.stride(2) == 1 else x.contiguous()


def apply_token_bitmask(
    x: torch.Tensor,  # [B, V] float32, edited in place
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32: bit t % 32 of word t / 32 = token t allowed
    rows: list[int],  # [R] the row of x of each bitmask row
) -> None:
    """Set to -inf each token a row's bitmask forbids (one thread: memory-bound); rows not of
    unit stride, or off the CPU, go to the reference."""
    assert bitmask.dtype == torch.int32 and bitmask.shape[0] == len(rows), bitmask.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1:
        reference.apply_token_bitmask(x, bitmask, rows)
        return
    bitmask = bitmask.contiguous()
    row_ids = torch.tensor(rows, dtype=torch.int64)
    library().headrace_apply_token_bitmask(
        _ptr(x), x.stride(0), x.shape[1], _ptr(bitmask), bitmask.shape[1], _ptr(row_ids), len(rows)
    )
