"""Warpers of the sampling rows, with HF's TopK / TopP / MinP semantics: each masks logits to
-inf in place, on the rows whose config asks for it."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from headrace.kernels.sampling import top_p_removed
from headrace.sdk.config import GenerationConfig
from headrace.worker.sampling.ops import column


def apply_top_k(x: torch.Tensor, configs: list[GenerationConfig]) -> None:
    """Keep the top_k largest logits of each row (and any tied with the k-th)."""
    vocab = x.shape[1]
    rows = [i for i, c in enumerate(configs) if 0 < c.top_k < vocab]
    if not rows:
        return
    top_k = [configs[i].top_k for i in rows]
    last = torch.tensor(top_k, device=x.device).view(-1, 1) - 1

    def removed(scores: torch.Tensor) -> torch.Tensor:
        kth = scores.topk(max(top_k), dim=-1).values.gather(1, last)
        return scores < kth

    _mask_rows(x, rows, removed)


def apply_top_p(x: torch.Tensor, configs: list[GenerationConfig]) -> None:
    """Keep the smallest set of most likely tokens whose probability reaches top_p."""
    rows = [i for i, c in enumerate(configs) if c.top_p < 1.0]
    if not rows:
        return
    floor = top_p_floor([configs[i] for i in rows], x.device)
    _mask_rows(x, rows, lambda scores: top_p_removed(scores, floor))


def top_p_floor(configs: list[GenerationConfig], device: torch.device) -> torch.Tensor:
    """[N, 1] float32 1 - top_p per row: in double, then float32, as HF compares it."""
    return column([1.0 - c.top_p for c in configs], device)


def apply_min_p(x: torch.Tensor, configs: list[GenerationConfig]) -> None:
    """Drop tokens less likely than min_p times the row's most likely token."""
    rows = [i for i, c in enumerate(configs) if c.min_p > 0.0]
    if not rows:
        return
    min_p = column([configs[i].min_p for i in rows], x.device)

    def removed(scores: torch.Tensor) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        return probs < min_p * probs.amax(dim=-1, keepdim=True)

    _mask_rows(x, rows, removed)


def _mask_rows(
    x: torch.Tensor, rows: list[int], removed: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Set to -inf, in x[rows], the entries removed(x[rows]) marks."""
    if len(rows) == x.shape[0]:
        x.masked_fill_(removed(x), -math.inf)
    else:
        scores = x[rows]
        x[rows] = scores.masked_fill_(removed(scores), -math.inf)
