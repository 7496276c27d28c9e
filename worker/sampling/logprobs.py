"""Logprobs: of each sampled token and its top-N alternatives, and of prompt tokens. Always of
the raw logits (log_softmax before temperature, penalties and warpers). Each entry carries the
token's rank too; the engine names the tokens afterwards (`detokenizer.TokenNames`), since
naming needs the tokenizer and this module only sees ids."""

from __future__ import annotations

import collections.abc

import torch
from headrace.sdk.outputs import TokenLogprob
from headrace.worker.sampling.ops import select_rows
from headrace.worker.sequence import Sequence


def token_logprobs(
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    seqs: collections.abc.Sequence[Sequence],
    rows: list[int],
) -> list[TokenLogprob | None]:
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if rows:
        num_tops = [seqs[row].config.logprobs or 0 for row in rows]
        scored = score(select_rows(logits, rows), select_rows(token_ids, rows), num_tops)
        for row, logprob in zip(rows, scored, strict=True):
            out[row] = logprob
    return out


def score(
    logits: torch.Tensor, target_ids: torch.Tensor, num_tops: list[int]
) -> list[TokenLogprob]:
    """log_softmax(logits) [N, V]: each row's target logprob, its rank (how many tokens have
    a logprob at least its own, as vLLM counts) and its num_tops[i] best."""
    if not num_tops:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, target_ids.view(-1, 1))  # [N, 1]
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    top_logprobs, top_ids = logprobs.topk(max(num_tops), dim=-1)
    top = zip(top_ids.tolist(), top_logprobs.tolist(), strict=True)
    rows = zip(target_ids.tolist(), chosen.view(-1).tolist(), ranks, num_tops, top, strict=True)
    return [
        TokenLogprob(
            token_id, logprob, list(zip(ids[:num_top], lps[:num_top], strict=True)), rank=rank
        )
        for token_id, logprob, rank, num_top, (ids, lps) in rows
    ]


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: torch.Tensor, num_top: int
) -> list[TokenLogprob]:
    """Logprob of each target_ids[p] under log_softmax(logits[p]), and the num_top best.

    logits: [P, V] for P prompt positions; target_ids: [P], the prompt token after each.
    """
    return score(logits, target_ids.to(logits.device), [num_top] * logits.shape[0])
