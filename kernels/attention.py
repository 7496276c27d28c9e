"""The per-step description of a flattened varlen batch that every attention kernel reads.

One `AttentionMetadata` is built per engine step by the model runner and shared by every
layer. The batch is flattened (varlen): sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``. Decode sequences (one query token each) come
first, so a backend runs them as one batch and tiles only the prefill chunks after them.

Sliding windows. A layer with a window of W lets the token at position p see keys
``p - W + 1 .. p`` (transformers' ``kv_idx > q_idx - sliding_window``); the window is the
layer's, passed to ``paged_attention`` beside the metadata. Once a sequence's window has
moved past a block, the scheduler may free the block: its block-table entry stays, stale (a
valid id whose block may hold another sequence's K/V), so a kernel starts each sequence's
keys at `window_first_blocks` and never reads an entry before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    #: [T] int64: cache slot (block_id * block_size + offset) for each new token's K/V.
    slot_mapping: torch.Tensor
    #: [B + 1] int32: where each sequence's query rows start in the flattened batch.
    query_start_loc: torch.Tensor
    #: [B] int32: each sequence's context length (cached + new tokens) after this step.
    seq_lens: torch.Tensor
    #: [B, max_num_blocks] int32: each sequence's KV block ids, padded with 0.
    block_tables: torch.Tensor
    #: The first num_decode_seqs sequences have exactly one query token.
    num_decode_seqs: int
    #: Host copies of query_start_loc / seq_lens, so backends need no device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    block_size: int
    #: Derived once per step (not per layer): the longest decode context, 0 without decodes,
    #: and the most new tokens of one prefill sequence, 0 without prefills.
    max_decode_seq_len: int = field(init=False)
    max_prefill_query_len: int = field(init=False)

    def __post_init__(self) -> None:
        decodes = self.seq_lens_cpu[: self.num_decode_seqs]
        self.max_decode_seq_len = max(decodes, default=0)
        starts = self.query_start_loc_cpu
        self.max_prefill_query_len = max(
            (starts[i + 1] - starts[i] for i in range(self.num_decode_seqs, self.num_seqs)),
            default=0,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


def window_first_blocks(
    seq_lens: list[int], num_queries: int, block_size: int, sliding_window: int | None
) -> list[int]:
    """Per sequence, the block (index into its table) that holds the first key the first of
    its ``num_queries`` new tokens sees: 0 without a window."""
    if sliding_window is None:
        return [0] * len(seq_lens)
    return [max(0, n - num_queries - sliding_window + 1) // block_size for n in seq_lens]
