"""A decode step's decoder layers in one C call (``kernels/csrc/decode_stack.c``).

At a decode step's few rows the per-op path costs about as much between its ~300 kernel
calls (Python wrappers, ctypes, an OpenMP region each) as the weights take to read; this
runs the same C ops back to back in one region, so every value is the per-op path's, bit for
bit. A step with prompt chunks saves the same time, a smaller share of it (a 128-token
prompt beside decodes in float32: about a tenth). It serves Llama-shaped stacks (fused qkv,
neox rotary, gated SiLU MLP, no biases, no q/k norm) on one rank without LoRA, in one dtype
shared by activations, weights and the KV cache, for steps of no more rows than the per-op
path multiplies in C (`max_rows`: decodes and a speculating sequence's proposals; in
float32 up to a few hundred, prompt chunks too; bf16 weights on panels, any) whose chunks
the per-op path attends to in C; the model asks `DecoderStack.fits` and keeps to the per-op
path otherwise. The four matrices of every
layer may instead be quantized alike (`headrace.kernels.quantized`: the same bits, and groups
of one size or one per row), and the KV cache may be int8 (`headrace.kernels.kv_layout`).
Each layer attends within its own sliding window, or to every key.

A step of greedy one-row decodes runs in one C call whole (`DecoderStack.greedy_runs`): each
run's embedding rows, the stack, the LM head's matmul and argmax, with no Python around the
stack or between a multi-step decode's runs, every token the one the runs from Python draw.
"""

from __future__ import annotations

import functools
import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from headrace.kernels import cpu_ops
from headrace.kernels.attention import AttentionMetadata
from headrace.kernels.quantized import QuantizedWeight

#: Pointers per layer, in decode_stack.c's order (INPUT_NORM .. KV_CACHE): two norms, the
#: cache, and four matrices of three (data, scales, offsets).
_LAYER_TENSORS = 15

#: A step of at least this many rows (long enough for the thread governor to look in it: a
#: bf16 SmolLM2-135M step of 128 rows takes ~70 ms on two cores) runs its layers in PARTS
#: calls when the model is watched between layers (`DecoderStack.decode`). The three more
#: calls measured nothing (2-core Zen 4, one prompt's TTFT, eight alternating pairs: bf16
#: 512 tokens, median pair 1.00; float32 256 tokens, 1.01). Fewer rows keep to one call.
PARTS_MIN_ROWS = 128
PARTS = 4

#: A layer's matrix: a float weight, or a quantized one.
Matrix = torch.Tensor | QuantizedWeight


@dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Matrix  # [(H + 2 Hkv) D, hidden]
    o_proj: Matrix  # [hidden, H D]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Matrix  # [2 I, hidden]
    down: Matrix  # [hidden, I]
    #: Keys a query sees, its own included (`cpu_ops.paged_attention`'s); None: all.
    sliding_window: int | None = None

    def norms(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.input_norm, self.post_norm)

    def matrices(self) -> tuple[Matrix, ...]:
        return (self.qkv, self.o_proj, self.gate_up, self.down)

    def pointers(self) -> list[int]:
        """decode_stack.c's row for this layer, but the KV cache."""
        qkv, o_proj, gate_up, down = (matrix_pointers(m) for m in self.matrices())
        return [
            self.input_norm.data_ptr(),
            *qkv,
            *o_proj,
            self.post_norm.data_ptr(),
            *gate_up,
            *down,
        ]


def matrix_tensors(matrix: Matrix) -> tuple[torch.Tensor, ...]:
    """The tensors `matrix_pointers` points into, but the panels (made from the first)."""
    if isinstance(matrix, torch.Tensor):
        return (matrix,)
    offsets = () if matrix.offsets is None else (matrix.offsets,)
    return (matrix.data, matrix.scales, *offsets)


def matrix_pointers(matrix: Matrix) -> tuple[int, int, int]:
    """A matrix as the C stacks take it (cpu_kernels.h's MATRIX_SLOTS): its data, then its
    panels (`cpu_ops.panel_copy`) or, quantized, its scales and offsets; 0 where none."""
    if isinstance(matrix, torch.Tensor):
        panels = cpu_ops.panel_copy(matrix)
        return (matrix.data_ptr(), 0 if panels is None else panels.data_ptr(), 0)
    data, scales, *offsets = matrix_tensors(matrix)
    return (data.data_ptr(), scales.data_ptr(), offsets[0].data_ptr() if offsets else 0)


class PointerTable:
    """A C stack's table of data pointers, kept from call to call and made again (by the
    caller's ``make``) only when a tensor behind it moved or was written through: a weight
    update, whose panels making it packs again (`matrix_pointers`). Making one looks up every
    float weight's panels: 120 on SmolLM2-135M, 0.34 ms against 0.03 for the check, of a 7 ms
    bf16 one-row step."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        #: The tensors the table points into (`matrix_tensors`, norms), pointers and versions.
        self._tensors = tensors
        self._table: torch.Tensor | None = None
        self._stamp: tuple[list[tuple[int, int]], list[int]] | None = None

    def get(
        self, make: Callable[[], list[int]], moving: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:  # [len(make())] int64
        """The table; ``moving``: more tensors it points into whose pointers alone count
        (KV caches, which move at sleep and wake and are written at every step)."""
        stamp = (
            [(t.data_ptr(), t._version) for t in self._tensors],
            [t.data_ptr() for t in moving],
        )
        if self._table is None or stamp != self._stamp:
            self._table, self._stamp = torch.tensor(make(), dtype=torch.int64), stamp
        return self._table


@dataclass(frozen=True, slots=True)
class DecoderShape:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float  # attention's softmax scale


class DecoderStack:
    """A stage's layers for `decode_layers`: their weights (the parameters themselves, whose
    pointers are read again after an in-place write, so weight updates are seen), checked
    once for what the C stack needs: one dtype it takes, contiguous, in CPU memory."""

    def __init__(
        self, layers: list[DecoderLayerWeights], final_norm: torch.Tensor, shape: DecoderShape
    ) -> None:
        self.layers = layers
        self.final_norm = final_norm  # [hidden]
        self.shape = shape
        self.dtype = final_norm.dtype
        norms = [t for layer in layers for t in layer.norms()] + [final_norm]
        matrices = [m for layer in layers for m in layer.matrices()]
        #: (bits, group size, int8 activations) of the matrices: (0, 0, 0) in the dtype; a
        #: group of 0 is a row.
        self.weights = common_layout(matrices, self.dtype)
        #: [L] int32: each layer's window as decode_stack.c takes it (0: none).
        self.sliding_windows = torch.tensor(
            [layer.sliding_window or 0 for layer in layers], dtype=torch.int32
        )
        norms_in_kernel = all(in_kernel(t, self.dtype) for t in norms)
        self.usable = cpu_ops.available() and norms_in_kernel and self.weights is not None
        self.paneled = paneled(matrices)
        self._pointers = PointerTable([*norms, *(t for m in matrices for t in matrix_tensors(m))])

    def fits(
        self,
        num_rows: int,
        dtype: torch.dtype,  # the rows'
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> bool:
        """Whether this step can run in one call: no more rows than the per-op path
        multiplies in the C kernel (`max_rows`: decodes, a speculating sequence's proposals,
        and in float32, or bf16 on panels, prompt chunks beside them), the stack's dtype
        throughout (the caches in it, or all int8), and every chunk one the per-op path
        attends to in the C kernel."""
        if not self.usable or dtype != self.dtype or not num_rows <= self._max_rows():
            return False
        cache_dtype = kv_caches[0].dtype if kv_caches else self.dtype
        if cache_dtype not in (self.dtype, torch.int8):
            return False
        in_c = cpu_ops.attends_in_kernel(metadata, cache_dtype)
        return in_c and all(in_kernel(cache, cache_dtype) for cache in kv_caches)

    def decode(
        self,
        hidden: torch.Tensor,  # [T, hidden]: the tokens' embeddings
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,  # [T, 1, head_dim]
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, Hkv, row]
        metadata: AttentionMetadata,
        between: Callable[[float], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden]: the final norm's output
        """The layers' output, as the per-op path computes it (the caller checked `fits`).
        A step of at least `PARTS_MIN_ROWS` rows runs in `PARTS` calls when there is a
        ``between``, called with the share of the layers run before each call but the first,
        as the per-op forward calls it between layers."""
        table = self._pointers.get(lambda: self._pointer_list(kv_caches), kv_caches)
        parts = PARTS if between is not None and hidden.shape[0] >= PARTS_MIN_ROWS else 1
        return decode_layers(
            hidden, table, self, kv_caches[0].dtype, cos, sin, metadata, parts, between
        )

    def greedy_runs(
        self,
        input_ids: torch.Tensor,  # [T] int64: the first run's inputs
        positions: torch.Tensor,  # [T] int64: the first run's
        later_slots: list[list[int]],  # [runs - 1][T]: each later run's KV cache slots
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,  # the first run's: T one-row decodes
        tables: GreedyTables,
    ) -> list[list[int]] | None:  # [runs][T], or None: run them from Python
        """A step of greedy one-row decodes in one C call (decode_stack.c's
        `headrace_decode_greedy_runs`): its first run, at ``positions`` into the metadata's
        slots, then each of a multi-step decode's later runs one position on, its inputs the
        tokens the run before drew. Each token is the one the runs from Python draw (the same
        embedding rows, stack, head matmul and argmax). Where they would all run in C: a step
        the stack `fits` in one call, and a head the C matmul multiplies."""
        num_rows = input_ids.shape[0]
        in_c, panels = cpu_ops.skinny_operands(num_rows, self.dtype, tables.head)
        dtype_held = all(in_kernel(t, self.dtype) for t in tables.tensors())
        # (the C call reads rows of the tables unchecked: the inputs, the last run's
        # positions and the head's token ids must have theirs)
        last_position = max(metadata.seq_lens_cpu) - 1 + len(later_slots)
        vocabulary = tables.embedding.shape[0]
        in_tables = (
            last_position < tables.cos.shape[0]
            and tables.head.shape[0] <= vocabulary
            and int(input_ids.min()) >= 0
            and int(input_ids.max()) < vocabulary
        )
        one_call = num_rows < PARTS_MIN_ROWS and self.fits(
            num_rows, self.dtype, kv_caches, metadata
        )
        if not (in_c and dtype_held and in_tables and one_call):
            return None
        table = self._pointers.get(lambda: self._pointer_list(kv_caches), kv_caches)
        return greedy_runs(
            input_ids,
            positions,
            later_slots,
            tables,
            panels,
            table,
            self,
            kv_caches[0].dtype,
            metadata,
        )

    def _pointer_list(self, kv_caches: list[torch.Tensor]) -> list[int]:  # [L * 15]
        """decode_stack.c's rows: each layer's tensors, then its KV cache."""
        return [
            pointer
            for layer, cache in zip(self.layers, kv_caches, strict=True)
            for pointer in (*layer.pointers(), cache.data_ptr())
        ]

    def _max_rows(self) -> int:
        return max_rows(self.weights or (0, 0, 0), self.dtype, self.paneled)


def max_rows(layout: tuple[int, int, int], dtype: torch.dtype, paneled: bool = False) -> int:
    """Rows up to which the per-op path multiplies matrices of this layout (`common_layout`'s)
    in the C kernel a one-call stack calls (int8 activations': any, capped as the 8 bits';
    float matrices that all have panels (`paneled`): any, the chunks' attention decides)."""
    bits, _, int8_activations = layout
    if int8_activations:  # its kernel takes any rows, as the per-op path does
        return cpu_ops.quantized_max_rows(8)
    if bits:
        return cpu_ops.quantized_max_rows(bits)
    return sys.maxsize if paneled else cpu_ops.skinny_max_rows(dtype)


def paneled(matrices: list[Matrix]) -> bool:
    """Whether every matrix is a float weight with panels (`cpu_ops.panel_copy`), which the
    per-op path multiplies at any row count."""
    return all(isinstance(m, torch.Tensor) and cpu_ops.panel_copy(m) is not None for m in matrices)


def in_kernel(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    return tensor.dtype == dtype and tensor.device.type == "cpu" and tensor.is_contiguous()


def common_layout(matrices: list[Matrix], dtype: torch.dtype) -> tuple[int, int, int] | None:
    """(bits, group size, int8 activations) shared by every matrix ((0, 0, 0): all float in
    dtype; group 0: one per row), or None when they differ or one is not where the C stack
    reads it."""
    layouts = {_layout(m, dtype) for m in matrices}
    return layouts.pop() if len(layouts) == 1 and None not in layouts else None


def _layout(matrix: Matrix, dtype: torch.dtype) -> tuple[int, int, int] | None:
    if isinstance(matrix, torch.Tensor):
        return (0, 0, 0) if in_kernel(matrix, dtype) else None
    if matrix.device.type != "cpu":
        return None
    cols = matrix.shape[1]
    group = 0 if matrix.group_size == cols else matrix.group_size
    return (matrix.bits, group, int(matrix.int8_activations))


def decode_layers(
    hidden: torch.Tensor,  # [T, hidden]
    pointers: torch.Tensor,  # [L * 15] int64: each layer's tensors and KV cache
    stack: DecoderStack,
    kv_cache_dtype: torch.dtype,  # the stack's dtype, or int8
    cos: torch.Tensor,
    sin: torch.Tensor,
    metadata: AttentionMetadata,
    parts: int = 1,
    between: Callable[[float], None] | None = None,
) -> torch.Tensor:
    """The C stack on `DecoderStack.decode`'s pointer table, its layers in ``parts`` calls of
    as many layers each as they divide into (``between`` before each call but the first): the
    final norm's output, in a copy of hidden that the calls overwrite in place."""
    num_layers = len(stack.layers)
    assert pointers.numel() == num_layers * _LAYER_TENSORS
    bounds = sorted({num_layers * part // parts for part in range(parts + 1)})
    out = hidden.contiguous().clone()
    residual = torch.empty_like(out) if len(bounds) > 2 else out  # (unused in one call)
    arrays = cpu_ops.attention_arrays(metadata)
    slots = metadata.slot_mapping.to(torch.int64).contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    for first, end in itertools.pairwise(bounds):
        if first and between is not None:
            between(first / num_layers)
        status = cpu_ops.library().headrace_decode_layers(
            out.data_ptr(),
            residual.data_ptr(),
            first == 0,
            end == num_layers,
            out.shape[0],
            end - first,
            pointers.data_ptr() + first * _LAYER_TENSORS * pointers.element_size(),
            stack.sliding_windows.data_ptr() + first * stack.sliding_windows.element_size(),
            *_shape_args(stack, kv_cache_dtype),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
            *_attention_args(arrays, stack, metadata),
        )
        if status != 0:
            raise MemoryError("the decode layers could not allocate their buffers")
    return out


@dataclass(frozen=True, slots=True)
class GreedyTables:
    """What a model's greedy runs (`DecoderStack.greedy_runs`) read besides its layers, each in
    the stack's dtype."""

    embedding: torch.Tensor  # [vocabulary, hidden]: the token embeddings
    head: torch.Tensor  # [N, hidden]: the LM head's weight, as its greedy matmul takes it
    cos: torch.Tensor  # [positions, 1, head_dim]: the rotary tables
    sin: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.embedding, self.head, self.cos, self.sin)


def greedy_runs(
    input_ids: torch.Tensor,  # [T] int64
    positions: torch.Tensor,  # [T] int64
    later_slots: list[list[int]],  # [runs - 1][T]
    tables: GreedyTables,
    head_panels: torch.Tensor | None,
    pointers: torch.Tensor,  # [L * 15] int64
    stack: DecoderStack,
    kv_cache_dtype: torch.dtype,
    metadata: AttentionMetadata,
) -> list[list[int]]:  # [runs][T]
    """`DecoderStack.greedy_runs`'s C call (it checked that they fit)."""
    num_runs, num_rows = 1 + len(later_slots), input_ids.shape[0]
    tokens = torch.empty(num_runs + 1, num_rows, dtype=torch.int64)
    tokens[0] = input_ids
    slots = torch.tensor([metadata.slot_mapping.tolist(), *later_slots], dtype=torch.int64)
    block_tables, starts, seq_lens = cpu_ops.attention_arrays(metadata)
    arrays = (block_tables, starts, seq_lens.clone())  # (the call counts the lengths up)
    positions = positions.to(torch.int64).contiguous()
    status = cpu_ops.library().headrace_decode_greedy_runs(
        num_runs,
        num_rows,
        tokens.data_ptr(),
        tables.embedding.data_ptr(),
        tables.head.data_ptr(),
        None if head_panels is None else head_panels.data_ptr(),
        tables.head.shape[0],
        tables.cos.data_ptr(),
        tables.sin.data_ptr(),
        positions.data_ptr(),
        slots.data_ptr(),
        len(stack.layers),
        pointers.data_ptr(),
        stack.sliding_windows.data_ptr(),
        *_shape_args(stack, kv_cache_dtype),
        *_attention_args(arrays, stack, metadata),
    )
    if status != 0:
        raise MemoryError("the greedy decode runs could not allocate their buffers")
    return tokens[1:].tolist()


def _attention_args(
    arrays: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # `cpu_ops.attention_arrays`'
    stack: DecoderStack,
    metadata: AttentionMetadata,
) -> tuple[object, ...]:
    """The step's block tables, query starts and sequence lengths (``arrays``, which the
    caller holds through the call), its sequences, block size, scale and query tile, as the
    C stacks take them."""
    tables, starts, seq_lens = arrays
    return (
        tables.data_ptr(),
        tables.stride(0),
        starts.data_ptr(),
        seq_lens.data_ptr(),
        _all_seqs(metadata.num_seqs).data_ptr(),
        metadata.num_seqs,
        metadata.block_size,
        stack.shape.scale,
        cpu_ops.QUERY_TILE,
    )


def _shape_args(stack: DecoderStack, kv_cache_dtype: torch.dtype) -> tuple[object, ...]:
    """The stack's final norm, eps, shape, dtypes and matrix layout, as the C stacks take
    them (native.py's `_STACK_SHAPE`)."""
    shape, layout = stack.shape, stack.weights
    assert layout is not None, "a usable stack has one layout"
    return (
        stack.final_norm.data_ptr(),
        shape.eps,
        shape.hidden_size,
        shape.intermediate_size,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_dim,
        cpu_ops.dtype_code(stack.dtype),
        cpu_ops.kv_dtype_code(kv_cache_dtype),
        *layout,
    )


@functools.lru_cache(maxsize=64)
def _all_seqs(num_seqs: int) -> torch.Tensor:  # [num_seqs] int32: 0, 1, ...
    """The ids of every sequence of a step, kept per count (the C stack only reads them)."""
    return torch.arange(num_seqs, dtype=torch.int32)
