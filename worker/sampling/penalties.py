"""History processors: logit changes that depend on what a row has generated so far.

Repetition penalty (prompt + output), presence / frequency penalties (output), n-gram bans
(no_repeat_ngram_size) and the min_tokens hold on stop tokens, each batched over the rows that
need it, with HF's and OpenAI's semantics.
"""

from __future__ import annotations

import collections.abc
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from headrace.sdk.config import GenerationConfig
from headrace.worker.sequence import Sequence

_EMPTY = torch.empty(0, dtype=torch.long)


@dataclass(slots=True)
class _History:
    """The token_ids of some batch rows, flattened: one entry per (row, position), on CPU."""

    #: [N] the batch row of each entry.
    rows: torch.Tensor
    token_ids: torch.Tensor
    #: [N] whether the entry is a generated token (not the prompt).
    is_output: torch.Tensor

    @classmethod
    def of(cls, seqs: collections.abc.Sequence[Sequence], rows: list[int]) -> _History:
        picked = [seqs[row] for row in rows]
        lengths = torch.tensor([seq.num_tokens for seq in picked])
        token_ids = torch.tensor(
            list(itertools.chain.from_iterable(seq.token_ids for seq in picked)), dtype=torch.long
        )
        local = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        positions = torch.arange(len(token_ids)) - (torch.cumsum(lengths, 0) - lengths)[local]
        num_prompt = torch.tensor([seq.num_prompt_tokens for seq in picked])
        return cls(torch.tensor(rows)[local], token_ids, positions >= num_prompt[local])


def apply_penalties(
    x: torch.Tensor, seqs: collections.abc.Sequence[Sequence], rows: list[int]
) -> None:
    """Repetition penalty (HF: tokens in prompt + output; positive logits are divided by it,
    negative ones multiplied), then presence / frequency (OpenAI: tokens in the output;
    logit -= count * frequency_penalty + presence_penalty). x is contiguous and written."""
    if not rows:
        return
    num_rows, vocab = x.shape
    history = _History.of(seqs, rows)
    in_vocab = history.token_ids < vocab
    flat_ids = history.rows * vocab + history.token_ids  # index into x.view(-1)
    flat = x.view(-1)

    repetition = _per_row(num_rows, seqs, rows, lambda c: c.repetition_penalty, 1.0)
    picked = in_vocab & (repetition[history.rows] != 1.0)
    if picked.any():
        ids = torch.unique(flat_ids[picked])
        penalty = repetition[ids // vocab].to(x.device)
        ids = ids.to(x.device)
        scores = flat[ids]
        flat[ids] = torch.where(scores < 0, scores * penalty, scores / penalty)

    presence = _per_row(num_rows, seqs, rows, lambda c: c.presence_penalty, 0.0)
    frequency = _per_row(num_rows, seqs, rows, lambda c: c.frequency_penalty, 0.0)
    picked = in_vocab & history.is_output & ((presence != 0) | (frequency != 0))[history.rows]
    if picked.any():
        ids, counts = torch.unique(flat_ids[picked], return_counts=True)
        penalty = counts * frequency[ids // vocab] + presence[ids // vocab]
        ids = ids.to(x.device)
        flat[ids] = flat[ids] - penalty.to(x.device)


def _per_row(
    num_rows: int,
    seqs: collections.abc.Sequence[Sequence],
    rows: list[int],
    param: Callable[[GenerationConfig], float],
    default: float,
) -> torch.Tensor:
    """[B] float32 on CPU: param of each row's config for rows, default elsewhere."""
    values = torch.full((num_rows,), default, dtype=torch.float32)
    values[rows] = torch.tensor([param(seqs[row].config) for row in rows], dtype=torch.float32)
    return values


def apply_bans(
    x: torch.Tensor,
    seqs: collections.abc.Sequence[Sequence],
    ngram_rows: list[int],
    min_tokens_rows: list[int],
) -> None:
    """Set to -inf the n-gram completions and the stop tokens held back by min_tokens."""
    vocab = x.shape[1]
    ngram_rows_t, ngram_ids = _ngram_bans(seqs, ngram_rows)
    stop_rows, stop_ids = _min_tokens_bans(seqs, min_tokens_rows)
    rows = torch.cat([ngram_rows_t, stop_rows])
    token_ids = torch.cat([ngram_ids, stop_ids])
    in_vocab = token_ids < vocab
    if in_vocab.any():
        rows, token_ids = rows[in_vocab].to(x.device), token_ids[in_vocab].to(x.device)
        x[rows, token_ids] = -math.inf


def _ngram_bans(
    seqs: collections.abc.Sequence[Sequence], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch rows, token ids) that would complete an n-gram already in the row's token_ids.

    HF NoRepeatNGramLogitsProcessor, batched per n: the last n - 1 tokens are matched
    against the first n - 1 of every n-token window; a match bans the window's last token.
    Rows are left-padded with -1, which never matches a token.
    """
    by_size: dict[int, list[int]] = {}
    for row in rows:
        size = seqs[row].config.no_repeat_ngram_size
        if seqs[row].num_tokens >= size:  # else no n-gram is complete yet
            by_size.setdefault(size, []).append(row)
    banned_rows, banned_ids = [_EMPTY], [_EMPTY]
    for size, group in by_size.items():
        length = max(seqs[row].num_tokens for row in group)
        padded = torch.tensor(
            [[-1] * (length - seqs[row].num_tokens) + seqs[row].token_ids for row in group]
        )  # [G, L]
        windows = padded.unfold(1, size, 1)  # [G, L - n + 1, n]
        suffix = padded[:, length - size + 1 :]  # [G, n - 1]
        matches = (windows[..., :-1] == suffix[:, None, :]).all(dim=-1) & (windows[..., -1] >= 0)
        group_index, window_index = matches.nonzero(as_tuple=True)
        banned_rows.append(torch.tensor(group)[group_index])
        banned_ids.append(windows[group_index, window_index, -1])
    return torch.cat(banned_rows), torch.cat(banned_ids)


def _min_tokens_bans(
    seqs: collections.abc.Sequence[Sequence], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch rows, token ids): each row's stop token ids (EOS included), held back."""
    pairs = [(row, token_id) for row in rows for token_id in seqs[row].stop_token_ids]
    if not pairs:
        return _EMPTY, _EMPTY
    both = torch.tensor(pairs, dtype=torch.long)
    return both[:, 0], both[:, 1]
