"""Runs one scheduled step on the model: one flattened varlen batch, no padding.

The scheduler's chunks become `input_ids [T]`, `positions [T]`, `slot_mapping [T]` and an
`AttentionMetadata` (query_start_loc, seq_lens, block_tables) shared by every layer. Only the
rows that need logits go through the LM head: the last row of each chunk that samples, and
prompt rows whose logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from headrace.kernels import AttentionMetadata
from headrace.worker.scheduler import ScheduledChunk, SchedulerOutput
from headrace.worker.sequence import Sequence


class CausalLM(Protocol):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(slots=True)
class PromptLogitsSpan:
    """Logits at prompt positions [first_position, first_position + len(logits))."""

    seq: Sequence
    first_position: int
    logits: torch.Tensor  # [k, V] float32
    target_ids: torch.Tensor  # [k]: the prompt token that follows each position


@dataclass(slots=True)
class StepResult:
    #: Chunks that sample, in the order of sample_logits' rows.
    sample_chunks: list[ScheduledChunk]
    sample_logits: torch.Tensor | None  # [S, V] float32
    prompt_spans: list[PromptLogitsSpan] = field(default_factory=list)


@dataclass(slots=True)
class _Batch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    sample_rows: list[int]
    sample_chunks: list[ScheduledChunk]
    #: (chunk, first prompt position, first row, number of rows) for prompt logprobs.
    prompt_rows: list[tuple[ScheduledChunk, int, int, int]]


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * block_size * model.num_kv_heads * model.head_dim * element_size
    return per_layer * model.num_layers


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Per layer: [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim].
        shape = (num_blocks, 2, block_size, model.num_kv_heads, model.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(model.num_layers)
        ]

    @torch.inference_mode()
    def warm_up(self, max_model_len: int) -> None:
        """Run the kernels once per variant a step can need, before the first request, so JIT
        compilation (Triton) and library set-up never land on a request's latency: one step of
        1-token decodes with a prefill chunk, then one decode whose context is long enough
        that decode attention splits it."""
        chunk, long_context = min(48, max_model_len), min(1024, max_model_len)
        self._run_synthetic([(1, 1), (1, 1), (chunk, chunk)], num_decode_seqs=2)
        self._run_synthetic([(long_context, 1)], num_decode_seqs=1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_synthetic(self, seqs: list[tuple[int, int]], num_decode_seqs: int) -> None:
        """One forward pass over made-up sequences ((context length, new tokens) each).

        Every block-table entry points at block 0, which no request holds yet: what lands
        there is garbage no request reads, as a sequence writes each slot before attending.
        """
        query_start_loc = [0]
        for _, num_new in seqs:
            query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens = [seq_len for seq_len, _ in seqs]
        positions = torch.tensor(
            [p for seq_len, n in seqs for p in range(seq_len - n, seq_len)], device=self.device
        )
        max_blocks = -(-max(seq_lens) // self.block_size)
        metadata = AttentionMetadata(
            slot_mapping=positions % self.block_size,
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=torch.zeros(len(seqs), max_blocks, dtype=torch.int32, device=self.device),
            num_decode_seqs=num_decode_seqs,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )
        input_ids = torch.zeros_like(positions)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata)
        self.model.compute_logits(hidden[-1:])

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        batch = self._prepare(step)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.metadata)
        rows = batch.sample_rows + [
            r for _, _, first, count in batch.prompt_rows for r in range(first, first + count)
        ]
        if not rows:
            return StepResult(batch.sample_chunks, None)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))  # [R, V]
        num_samples = len(batch.sample_rows)
        result = StepResult(batch.sample_chunks, logits[:num_samples] if num_samples else None)
        offset = num_samples
        for chunk, first_position, _, count in batch.prompt_rows:
            seq = chunk.seq
            targets = seq.token_ids[first_position + 1 : first_position + 1 + count]
            result.prompt_spans.append(
                PromptLogitsSpan(
                    seq,
                    first_position,
                    logits[offset : offset + count],
                    torch.tensor(targets, dtype=torch.long, device=self.device),
                )
            )
            offset += count
        return result

    def _prepare(self, step: SchedulerOutput) -> _Batch:
        chunks = step.chunks
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prompt_rows: list[tuple[ScheduledChunk, int, int, int]] = []
        for chunk in chunks:
            seq, start, num_new = chunk.seq, chunk.start, chunk.num_new_tokens
            end = start + num_new
            if num_new == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
            first_row = query_start_loc[-1]
            query_start_loc.append(first_row + num_new)
            seq_lens.append(end)
            if chunk.samples:
                sample_rows.append(first_row + num_new - 1)
                sample_chunks.append(chunk)
            if seq.wants_prompt_logprobs:
                span = _prompt_logprob_span(seq, start, end)
                if span is not None:
                    first_position, count = span
                    prompt_rows.append(
                        (chunk, first_position, first_row + first_position - start, count)
                    )
        metadata = self._metadata(
            chunks, positions, query_start_loc, seq_lens, step.num_decode_seqs
        )
        return _Batch(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata,
            sample_rows,
            sample_chunks,
            prompt_rows,
        )

    def _metadata(
        self,
        chunks: list[ScheduledChunk],
        positions: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        num_decode_seqs: int,
    ) -> AttentionMetadata:
        max_blocks = max(len(chunk.seq.block_ids) for chunk in chunks)
        table = np.zeros((len(chunks), max_blocks), dtype=np.int64)
        for i, chunk in enumerate(chunks):
            block_ids = chunk.seq.block_ids
            table[i, : len(block_ids)] = block_ids
        block_tables = torch.from_numpy(table)
        # Slot of token t: its sequence's block for that position, then the offset inside it.
        counts = np.diff(query_start_loc)
        seq_index = torch.from_numpy(np.repeat(np.arange(len(chunks)), counts))
        pos = torch.tensor(positions, dtype=torch.long)
        slot_mapping = (
            block_tables[seq_index, pos // self.block_size] * self.block_size
            + pos % self.block_size
        )
        return AttentionMetadata(
            slot_mapping=slot_mapping.to(self.device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=self.device),
            block_tables=block_tables.to(self.device, torch.int32),
            num_decode_seqs=num_decode_seqs,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
            block_size=self.block_size,
        )


def _prompt_logprob_span(seq: Sequence, start: int, end: int) -> tuple[int, int] | None:
    """Prompt positions in [start, end) whose next-token logprob is still missing.

    Position p's logits score prompt token p + 1, so positions run up to num_prompt_tokens - 2.
    Positions already scored (before a preemption) are not scored again.
    """
    first = max(start, len(seq.prompt_logprobs))
    last = min(end, seq.num_prompt_tokens - 1)
    if first >= last:
        return None
    return first, last - first
