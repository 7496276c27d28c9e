"""One step as tensors: the flattened varlen batch every rank runs, and what comes back.

`ModelInputs` is identical on every rank of a step. `PreparedBatch` adds what only the
scheduling rank needs to read the logits back: which rows sample and which score the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Protocol

import torch
from headrace.kernels import AttentionMetadata
from headrace.kernels.lora import LoraIndices
from headrace.kernels.sampling import argmax
from headrace.worker.sampling.logprobs import compute_prompt_logprobs
from headrace.worker.scheduling.output import ScheduledChunk
from headrace.worker.sequence import Sequence, is_plain_greedy


class SeqTokens(Protocol):
    """What building a batch reads of a sequence: an engine `Sequence`, or a rank's mirror."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def block_ids(self) -> list[int]: ...

    @property
    def adapter(self) -> str | None: ...


class BatchChunk(Protocol):
    """What building a batch reads of one chunk: a `ScheduledChunk`, or a rank's mirror chunk
    (the same fields, rebuilt from the step plan)."""

    @property
    def seq(self) -> SeqTokens: ...

    @property
    def start(self) -> int: ...

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def draft_token_ids(self) -> Seq[int]:
        """Proposed tokens the chunk runs after the sequence's newest (speculation)."""
        ...


@dataclass(slots=True)
class ModelInputs:
    """The flattened batch of one forward pass; identical on every rank of a step."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    #: Each row's LoRA adapter slot; None when LoRA is off (every row runs the base model).
    lora_indices: LoraIndices | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.metadata.slot_mapping)


@dataclass(slots=True)
class PromptLogitsSpan:
    """Logits at prompt positions [first_position, first_position + len(logits))."""

    seq: Sequence
    first_position: int
    logits: torch.Tensor  # [k, V] float32
    target_ids: torch.Tensor  # [k]: the prompt token that follows each position

    def record(self) -> None:
        """Score these prompt positions into the sequence's prompt_logprobs (a span
        recomputed after a preemption replaces what it covers)."""
        num_top = self.seq.config.prompt_logprobs or 0
        scored = compute_prompt_logprobs(self.logits, self.target_ids, num_top)
        del self.seq.prompt_logprobs[self.first_position :]
        self.seq.prompt_logprobs.extend(scored)


@dataclass(slots=True)
class StepResult:
    #: Chunks that sample, in the order of sample_logits' rows.
    sample_chunks: list[ScheduledChunk]
    sample_logits: torch.Tensor | None  # [S, V] float32
    prompt_spans: list[PromptLogitsSpan] = field(default_factory=list)
    #: The sampled tokens themselves, when every sampling row was plain greedy and the
    #: model's greedy head chose them (sample_logits is then None).
    sample_token_ids: list[int] | None = None
    #: Speculation: for each sampling chunk, the model's greedy token at each of its
    #: proposals' positions (what a greedy sequence's proposal must equal to be kept); []
    #: when no chunk of the step speculates.
    draft_targets: list[list[int]] = field(default_factory=list)
    #: The logits of those positions, every speculating chunk's in turn (a sampled
    #: sequence draws at each); None when the step took tokens from the greedy head.
    draft_logits: torch.Tensor | None = None
    #: Multi-step decode: for each sampling chunk, the greedy tokens its runs drew before
    #: the last (whose token is its sample_token_ids entry); [] when the step ran once.
    decoded_token_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class PromptRows:
    """Batch rows whose logits score prompt tokens (prompt_logprobs) for one chunk."""

    chunk: ScheduledChunk
    #: The first prompt position scored; its logits row is `first_row`.
    first_position: int
    first_row: int
    num_rows: int


@dataclass(slots=True)
class PreparedBatch:
    """ModelInputs plus the bookkeeping only the scheduling rank needs to read the logits."""

    inputs: ModelInputs
    sample_rows: list[int]
    sample_chunks: list[ScheduledChunk]
    prompt_rows: list[PromptRows]
    #: Rows whose next token checks a proposal, in sampling-chunk order (speculation).
    draft_rows: list[int] = field(default_factory=list)
    #: Multi-step decode (every chunk a one-row decode): for each run after the first, each
    #: row's KV cache slot; [] when the step runs once.
    later_slots: list[list[int]] = field(default_factory=list)
    #: Whether the step needs no logits at all: rows sample, every one plain greedy, and no
    #: prompt logprobs are asked for. Decided when the batch is built, from the sequences as
    #: they stand then (the step may run while the engine appends other steps' tokens).
    is_plain_greedy: bool = field(init=False)
    #: Whether, besides, every row is a sequence's one-row decode (no proposals): the
    #: step's runs may go in one call of the model's (`CausalLM.decode_greedy_runs`).
    decodes_greedily: bool = field(init=False)

    def __post_init__(self) -> None:
        self.is_plain_greedy = (
            bool(self.sample_chunks)
            and not self.prompt_rows
            and all(is_plain_greedy(chunk.seq) for chunk in self.sample_chunks)
        )
        one_row_each = len(self.sample_rows) == self.inputs.num_tokens
        self.decodes_greedily = self.is_plain_greedy and one_row_each and not self.draft_rows

    @property
    def logit_rows(self) -> list[int]:
        """Rows that go through the LM head: sampling rows, prompt-logprob rows, then the
        rows that check proposals."""
        prompt = [r for p in self.prompt_rows for r in range(p.first_row, p.first_row + p.num_rows)]
        return self.sample_rows + prompt + self.draft_rows

    def split_drafts(self, targets: list[int]) -> list[list[int]]:
        """The greedy tokens of `draft_rows`, as each sampling chunk's list ([] if none)."""
        if not self.draft_rows:
            return []
        lists, offset = [], 0
        for chunk in self.sample_chunks:
            count = len(chunk.draft_token_ids)
            lists.append(targets[offset : offset + count])
            offset += count
        return lists

    def runs_result(self, drawn: list[list[int]]) -> StepResult:
        """The result of a step of greedy decodes from each run's tokens ([runs][rows]): the
        last run's are the sampled ones, the others each chunk's `decoded_token_ids`."""
        result = StepResult(self.sample_chunks, None, sample_token_ids=drawn[-1])
        result.decoded_token_ids = [list(tokens) for tokens in zip(*drawn[:-1], strict=True)]
        return result

    def result(self, logits: torch.Tensor | None) -> StepResult:
        """Split the logits of `logit_rows` into what the sampler, prompt logprobs and the
        proposals' checks read."""
        if logits is None:
            return StepResult(self.sample_chunks, None)
        num_samples = len(self.sample_rows)
        result = StepResult(self.sample_chunks, logits[:num_samples] if num_samples else None)
        if self.draft_rows:
            result.draft_logits = logits[logits.shape[0] - len(self.draft_rows) :]
            result.draft_targets = self.split_drafts(argmax(result.draft_logits).tolist())
        offset = num_samples
        for rows in self.prompt_rows:
            seq, first, count = rows.chunk.seq, rows.first_position, rows.num_rows
            targets = seq.token_ids[first + 1 : first + 1 + count]
            result.prompt_spans.append(
                PromptLogitsSpan(
                    seq,
                    first,
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
    merged = StepResult(
        [chunk for r in results for chunk in r.sample_chunks],
        torch.cat(sampled) if sampled else None,
        [span for r in results for span in r.prompt_spans],
    )
    if any(r.draft_targets for r in results):
        merged.draft_targets = [
            targets
            for r in results
            for targets in (r.draft_targets or [[] for _ in r.sample_chunks])
        ]
        drafts = [r.draft_logits for r in results if r.draft_logits is not None]
        merged.draft_logits = torch.cat(drafts) if drafts else None
    return merged


def prompt_logprob_rows(chunk: ScheduledChunk, first_row: int) -> PromptRows | None:
    """The rows of ``chunk`` (whose first token is batch row ``first_row``) that score prompt
    positions whose next-token logprob is still missing, or None.

    Position p's logits score prompt token p + 1, so positions run up to num_prompt_tokens - 2.
    Positions already scored (before a preemption) are not scored again.
    """
    seq, start = chunk.seq, chunk.start
    first = max(start, len(seq.prompt_logprobs))
    last = min(start + chunk.num_new_tokens, seq.num_prompt_tokens - 1)
    if first >= last:
        return None
    return PromptRows(chunk, first, first_row + first - start, last - first)
