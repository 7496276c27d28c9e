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
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.scheduling.scheduler import ScheduledChunk, SchedulerOutput
from headrace.worker.sequence import Sequence


class CausalLM(Protocol):
    #: Layers, KV heads and hidden size held by this rank (its pipeline stage and TP shard).
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        carry: torch.Tensor | None = None,
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


class SeqTokens(Protocol):
    """What building a batch reads of a sequence: an engine `Sequence`, or a rank's mirror."""

    token_ids: list[int]
    block_ids: list[int]


#: One chunk as every rank sees it: (sequence, first new position, number of new tokens).
ChunkInput = tuple[SeqTokens, int, int]


@dataclass(slots=True)
class ModelInputs:
    """The flattened batch of one forward pass; identical on every rank of a step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata

    @property
    def num_tokens(self) -> int:
        return len(self.metadata.slot_mapping)


@dataclass(slots=True)
class PreparedBatch:
    """ModelInputs plus the bookkeeping only the scheduling rank needs to read the logits."""

    inputs: ModelInputs
    sample_rows: list[int]
    sample_chunks: list[ScheduledChunk]
    #: (chunk, first prompt position, first row, number of rows) for prompt logprobs.
    prompt_rows: list[tuple[ScheduledChunk, int, int, int]]

    @property
    def logit_rows(self) -> list[int]:
        """Rows that go through the LM head: sampling rows, then prompt-logprob rows."""
        prompt = [r for _, _, first, count in self.prompt_rows for r in range(first, first + count)]
        return self.sample_rows + prompt

    def result(self, logits: torch.Tensor | None) -> StepResult:
        """Split the logits of `logit_rows` into what the sampler and prompt logprobs read."""
        if logits is None:
            return StepResult(self.sample_chunks, None)
        num_samples = len(self.sample_rows)
        result = StepResult(self.sample_chunks, logits[:num_samples] if num_samples else None)
        offset = num_samples
        for chunk, first_position, _, count in self.prompt_rows:
            seq = chunk.seq
            targets = seq.token_ids[first_position + 1 : first_position + 1 + count]
            result.prompt_spans.append(
                PromptLogitsSpan(
                    seq,
                    first_position,
                    logits[offset : offset + count],
                    torch.tensor(targets, dtype=torch.long, device=logits.device),
                )
            )
            offset += count
        return result


def merge_results(results: list[StepResult]) -> StepResult:
    """One step's result from its micro-batches' results, in micro-batch order."""
    if len(results) == 1:
        return results[0]
    sampled = [r.sample_logits for r in results if r.sample_logits is not None]
    return StepResult(
        [chunk for r in results for chunk in r.sample_chunks],
        torch.cat(sampled) if sampled else None,
        [span for r in results for span in r.prompt_spans],
    )


def kv_block_bytes(model: CausalLM, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes across all layers."""
    element_size = torch.tensor([], dtype=dtype).element_size()
    per_layer = 2 * block_size * model.num_kv_heads * model.head_dim * element_size
    return per_layer * model.num_layers


def kv_cache_blocks(
    config: EngineConfig,
    model: CausalLM,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> int:
    """KV blocks this rank can hold: the configured count, or what its memory budget fits.

    A block costs what this rank stores of it (its layers, its KV heads), so with tensor or
    pipeline parallelism the same budget holds proportionally more blocks.
    """
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = kv_block_bytes(model, config.block_size, dtype)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * config.gpu_memory_utilization)
    else:
        budget = int(config.cpu_kv_cache_gib * 2**30)
    # More blocks than every running sequence at full length could use is wasted memory.
    useful = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(1, min(budget // block_bytes, useful))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        num_blocks: int,
        parallel: ParallelConfig | None = None,
    ) -> None:
        self.model = model
        self.parallel = parallel or ParallelConfig()
        self.device = device
        self.dtype = dtype
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
        carry = None
        if not self.parallel.is_first_stage:  # stands in for the previous stage's output
            shape = (2, len(positions), self.model.hidden_size)
            carry = torch.zeros(shape, dtype=self.dtype, device=self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, metadata, carry)
        if self.parallel.is_last_stage:
            self.model.compute_logits(hidden[-1:])

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> StepResult:
        """Run a whole step on this (single) rank: forward, then logits of the needed rows."""
        batch = self.prepare(step.chunks)
        hidden = self.forward(batch.inputs)
        return batch.result(self.compute_logits(hidden, batch.logit_rows))

    def forward(self, inputs: ModelInputs, carry: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the forward pass (its pipeline stage)."""
        return self.model(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata, carry
        )

    def compute_logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """[len(rows), V] float32 logits of the given rows of the last stage's output."""
        if not rows:
            return None
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, index))

    def prepare(self, chunks: list[ScheduledChunk]) -> PreparedBatch:
        """The batch of ``chunks`` (decodes first), with the rows whose logits are needed."""
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prompt_rows: list[tuple[ScheduledChunk, int, int, int]] = []
        first_row = 0
        for chunk in chunks:
            seq, start, num_new = chunk.seq, chunk.start, chunk.num_new_tokens
            if chunk.samples:
                sample_rows.append(first_row + num_new - 1)
                sample_chunks.append(chunk)
            if seq.wants_prompt_logprobs:
                span = _prompt_logprob_span(seq, start, start + num_new)
                if span is not None:
                    first_position, count = span
                    prompt_rows.append(
                        (chunk, first_position, first_row + first_position - start, count)
                    )
            first_row += num_new
        items: list[ChunkInput] = [(c.seq, c.start, c.num_new_tokens) for c in chunks]
        return PreparedBatch(self.build_inputs(items), sample_rows, sample_chunks, prompt_rows)

    def build_inputs(self, chunks: list[ChunkInput]) -> ModelInputs:
        """The flattened varlen batch of ``chunks``, which must come decodes first."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for seq, start, num_new in chunks:
            end = start + num_new
            if num_new == 1:
                input_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
            query_start_loc.append(query_start_loc[-1] + num_new)
            seq_lens.append(end)
        # Single-token chunks lead the batch; attention treats them as decodes.
        num_decode_seqs = next((i for i, c in enumerate(chunks) if c[2] != 1), len(chunks))
        metadata = self._metadata(
            [seq.block_ids for seq, _, _ in chunks],
            positions,
            query_start_loc,
            seq_lens,
            num_decode_seqs,
        )
        return ModelInputs(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            metadata,
        )

    def _metadata(
        self,
        block_ids_per_seq: list[list[int]],
        positions: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        num_decode_seqs: int,
    ) -> AttentionMetadata:
        num_seqs = len(block_ids_per_seq)
        max_blocks = max(len(block_ids) for block_ids in block_ids_per_seq)
        table = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, block_ids in enumerate(block_ids_per_seq):
            table[i, : len(block_ids)] = block_ids
        block_tables = torch.from_numpy(table)
        # Slot of token t: its sequence's block for that position, then the offset inside it.
        counts = np.diff(query_start_loc)
        seq_index = torch.from_numpy(np.repeat(np.arange(num_seqs), counts))
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
