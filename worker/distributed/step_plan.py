"""What the scheduling rank tells the other ranks each step, and their copy of the sequences.

Design note. Only rank 0 runs the scheduler; every other rank must still build exactly the
same flattened batch (token ids, positions, slot mapping, block tables). Sending whole block
tables and token lists every step would cost O(context) per sequence per step, so rank 0
sends deltas instead: a sequence's tokens and blocks the first time it runs, afterwards
only the tokens sampled and blocks allocated since the ranks last saw it, and the ids of
sequences that ended. Each rank keeps a `SeqMirror` per live sequence and applies the
deltas in order. A preempted sequence (blocks freed, to be recomputed) is re-sent whole, as
is one whose last block changed (copy-on-write of a forked beam's shared block).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace.worker.scheduling.output import ScheduledChunk
from headrace.worker.sequence import Sequence


@dataclass(slots=True)
class SeqUpdate:
    seq_id: int
    #: Tokens appended since the ranks last saw the sequence (all of them when reset).
    new_token_ids: list[int]
    #: Blocks appended since the ranks last saw it (the whole table when reset).
    new_block_ids: list[int]
    #: The sequence is new to the ranks, or was preempted: replace, do not append.
    reset: bool
    #: The sequence's LoRA adapter (read on reset only).
    adapter: str | None = None


@dataclass(slots=True)
class MicroBatchPlan:
    #: (seq_id, first new position, number of new tokens, proposed tokens), decodes first.
    chunks: list[tuple[int, int, int, tuple[int, ...]]]
    #: Rows of this micro-batch whose logits the last stage computes and sends to rank 0.
    logit_rows: list[int]


@dataclass(slots=True)
class StepPlan:
    """One step as the non-scheduling ranks need it; plain data, pickled once per step."""

    updates: list[SeqUpdate]
    #: Sequences the ranks may forget (finished, aborted).
    finished_seq_ids: list[int]
    #: The step's chunks cut into micro-batches that flow through the pipeline in order.
    micro_batches: list[MicroBatchPlan]
    #: KV block copies (source, destination) to run before the step (copy-on-write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SeqMirror:
    """A rank's copy of what building a batch reads of one sequence."""

    token_ids: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    #: The LoRA adapter the sequence runs with (None: the base model).
    adapter: str | None = None


@dataclass(frozen=True, slots=True)
class MirrorChunk:
    """One chunk of a micro-batch on a non-scheduling rank (a `BatchChunk`)."""

    seq: SeqMirror
    start: int
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class _Sent:
    """What rank 0 has told the ranks about one sequence."""

    seq: Sequence
    num_tokens: int
    num_blocks: int
    num_preemptions: int
    #: The last block id sent (-1: none): a change means a copy-on-write replaced it.
    last_block: int


class PlanEncoder:
    """Rank 0's side: turns scheduled micro-batches into a `StepPlan` of deltas."""

    def __init__(self) -> None:
        self._sent: dict[int, _Sent] = {}

    def encode(
        self,
        micro_batches: list[list[ScheduledChunk]],
        logit_rows: list[list[int]],
        block_copies: list[tuple[int, int]] | None = None,
    ) -> StepPlan:
        finished = [seq_id for seq_id, sent in self._sent.items() if sent.seq.is_finished]
        for seq_id in finished:
            del self._sent[seq_id]
        updates = [
            self._update(chunk.seq) for micro_batch in micro_batches for chunk in micro_batch
        ]
        plans = [
            MicroBatchPlan([_chunk_plan(c) for c in chunks], rows)
            for chunks, rows in zip(micro_batches, logit_rows, strict=True)
        ]
        return StepPlan(updates, finished, plans, list(block_copies or ()))

    def _update(self, seq: Sequence) -> SeqUpdate:
        sent = self._sent.get(seq.seq_id)
        reset = sent is None or sent.num_preemptions != seq.num_preemptions
        if sent is not None and not reset and sent.num_blocks:
            blocks = seq.block_ids
            reset = len(blocks) < sent.num_blocks or blocks[sent.num_blocks - 1] != sent.last_block
        num_tokens = 0 if reset or sent is None else sent.num_tokens
        num_blocks = 0 if reset or sent is None else sent.num_blocks
        update = SeqUpdate(
            seq.seq_id,
            seq.token_ids[num_tokens:],
            seq.block_ids[num_blocks:],
            reset,
            seq.adapter if reset else None,
        )
        last_block = seq.block_ids[-1] if seq.block_ids else -1
        self._sent[seq.seq_id] = _Sent(
            seq, seq.num_tokens, len(seq.block_ids), seq.num_preemptions, last_block
        )
        return update


def _chunk_plan(chunk: ScheduledChunk) -> tuple[int, int, int, tuple[int, ...]]:
    return (chunk.seq.seq_id, chunk.start, chunk.num_new_tokens, tuple(chunk.draft_token_ids))


class MirrorTable:
    """A non-scheduling rank's side: applies plans and hands out each micro-batch's chunks."""

    def __init__(self) -> None:
        self.seqs: dict[int, SeqMirror] = {}

    def apply(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for update in plan.updates:
            mirror = self.seqs.get(update.seq_id)
            if mirror is None or update.reset:
                mirror = self.seqs[update.seq_id] = SeqMirror(adapter=update.adapter)
            mirror.token_ids.extend(update.new_token_ids)
            mirror.block_ids.extend(update.new_block_ids)

    def chunks(self, micro_batch: MicroBatchPlan) -> list[MirrorChunk]:
        return [
            MirrorChunk(self.seqs[seq_id], start, n, draft)
            for seq_id, start, n, draft in micro_batch.chunks
        ]
