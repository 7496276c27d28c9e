"""Warpers of the sampling rows, with HF's TopK / TopP / MinP semantics: each masks logits to
-inf in place, on the rows whose config asks for it."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
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


def top_p_removed(scores: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """Where top-p removes a token of scores [N, V], given floor = 1 - top_p [N, 1].

    HF's rule (drop the ascending prefix whose cumulative probability is <= 1 - top_p, never
    the last), with the prefix found by count and applied as a logit threshold, so only
    the values are sorted: the same tokens unless logits tie at the cut.
    """
    ascending = _sorted_values(scores)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    num_removed = (cumulative <= floor).sum(dim=-1, keepdim=True)
    num_removed.clamp_(max=scores.shape[1] - 1)  # the most likely token always stays
    return scores < ascending.gather(1, num_removed)


def _sorted_values(x: torch.Tensor) -> torch.Tensor:
    """Each row of x in ascending order; on CPU numpy sorts values alone ~7x faster."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.sort(x.detach().numpy(), axis=-1))
    return x.sort(dim=-1).values


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
