"""Seeded sampling by inverse CDF with a top-p rejection test.

Design note. A sampling row draws from softmax(logits / T) restricted to the tokens top-k,
top-p and min-p keep (HF's order: top-k, then top-p over what top-k kept, then min-p). The
draw needs no sort and touches the vocabulary a few times per row:

1. weigh: w_i = exp(x_i / T - max) over the row; min-p drops w_i < min_p (p_i < min_p *
   p_max); top-k was applied before as -inf logits;
2. draw: u from a counter-based hash of the row's key and an attempt counter; the token is
   where the cumulative kept weight, in vocabulary order, first exceeds u * (their sum);
3. test top-p: top-p keeps token j iff the probability of the tokens no more likely than j
   exceeds 1 - top_p (HF's rule, the most likely token always kept). If j is outside, draw
   again with the next attempt. An accepted draw is distributed exactly as the truncated,
   renormalised softmax (rejection sampling); acceptance is at least top_p per attempt.
   After `MAX_ATTEMPTS` rejections (odds (1 - top_p)^16) the row draws once more, exactly,
   from the sorted top-p set.

A seeded row's key comes from (sample_seed, position) alone, so its token depends only on
those and on its logits: never on batch composition, row order or thread count. On the CPU
the C kernel (`headrace.kernels.cpu_ops.sample_rows`) runs all three steps per row in cache,
rows split among threads; elsewhere `draw_torch` runs the same algorithm in torch ops. The
two round the exponentials and sums differently, so their tokens differ only where u lands
within rounding of a CDF step or a token's top-p mass within rounding of 1 - top_p.

This replaced a Gumbel-max draw (argmax(x + Gumbel noise)), which made noise for every
vocabulary entry of every row: 100 ms per step for 256 rows of a 49k vocabulary on a 2-core
CPU, against a few ms here. The seeded stream changed with it (same seeds, other tokens);
tests pin the new one.
"""

from __future__ import annotations

import math

import torch
from headrace.kernels import cpu_ops
from headrace.worker.sampling.warpers import top_p_removed

#: Draws per row before the exact (sorting) fallback.
MAX_ATTEMPTS = 16

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
#: Rows per chunk of the torch path on the CPU (keeps a chunk's temporaries in cache).
_CPU_ROWS_PER_CHUNK = 16


def seeded_key(seed: int, position: int) -> tuple[int, int]:
    """The key of the draws for the token at position of a request with this seed."""
    mixed = _splitmix64((_splitmix64(seed) + position) & _MASK64)
    return mixed >> 32, mixed & _MASK32


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniforms(keys: torch.Tensor, attempt: int) -> torch.Tensor:  # [S, 2] int64 -> [S] float64
    """The uniform in (0, 1) of draw ``attempt`` of each row: a Weyl sequence per key, then
    xorshift-multiply rounds, in int64 ops that stay below 2**63 (exact on every device)."""
    h = (attempt * keys[:, 0] + keys[:, 1]) & _MASK32
    for shift, factor in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        h = ((h ^ (h >> shift)) * factor) & _MASK32
    h = h ^ (h >> 15)
    return h.double().add_(0.5).mul_(2.0**-32)


def draw(
    x: torch.Tensor,  # [S, V] float32 logits (history processing and top-k applied)
    temperature: torch.Tensor,  # [S] float32
    top_p_floor: torch.Tensor,  # [S] float32: 1 - top_p, rounded once from double (as HF)
    min_p: torch.Tensor,  # [S] float32
    keys: torch.Tensor,  # [S, 2] int64
) -> torch.Tensor:  # [S] int64
    """One token per row; see the module's design note."""
    if x.device.type == "cpu" and cpu_ops.available():
        tokens = cpu_ops.sample_rows(x, temperature, top_p_floor, min_p, keys, MAX_ATTEMPTS)
    else:
        tokens = draw_torch(x, temperature, top_p_floor, min_p, keys)
    rejected = (tokens < 0).nonzero().view(-1)
    if len(rejected):
        rows = rejected.tolist()
        tokens[rejected] = _draw_exact(
            x[rows], temperature[rows], top_p_floor[rows], min_p[rows], keys[rows]
        )
    return tokens


def draw_torch(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """`draw` in torch ops (any device), rows in chunks on the CPU; -1 where all attempts
    were rejected."""
    num_rows = x.shape[0]
    step = _CPU_ROWS_PER_CHUNK if x.device.type == "cpu" else max(1, num_rows)
    out = torch.empty(num_rows, dtype=torch.long, device=x.device)
    for start in range(0, num_rows, step):
        rows = slice(start, start + step)
        out[rows] = _draw_chunk(
            x[rows], temperature[rows], top_p_floor[rows], min_p[rows], keys[rows]
        )
    return out


def _draw_chunk(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    scaled = x / temperature.view(-1, 1)
    best = scaled.amax(dim=-1, keepdim=True)
    weights = (scaled - best).exp_()  # exp(-inf) = 0
    all_total = weights.sum(dim=-1, dtype=torch.float64)
    kept = weights.masked_fill(weights < min_p.view(-1, 1), 0.0)
    cdf = kept.cumsum(dim=-1, dtype=torch.float64)
    out = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
    pending = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    for attempt in range(MAX_ATTEMPTS):
        target = uniforms(keys, attempt) * cdf[:, -1]
        token = torch.searchsorted(cdf, target.view(-1, 1), right=True).view(-1)
        token = token.clamp_(max=x.shape[1] - 1)
        value = scaled.gather(1, token.view(-1, 1))
        mass = (weights * (scaled <= value)).sum(dim=-1, dtype=torch.float64) / all_total
        accepted = (mass.float() > top_p_floor) | (value.view(-1) == best.view(-1))
        accepted &= pending
        out[accepted] = token[accepted]
        pending &= ~accepted
        if not bool(pending.any()):
            break
    out[best.view(-1) == -math.inf] = 0  # every token removed (bans): nothing to weigh
    return out


def _draw_exact(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """The fallback: mask top-p by sorting, then one inverse-CDF draw over what is left."""
    scaled = x / temperature.view(-1, 1)
    scaled = scaled.masked_fill(top_p_removed(scaled, top_p_floor.view(-1, 1)), -math.inf)
    weights = (scaled - scaled.amax(dim=-1, keepdim=True)).exp_()
    weights.masked_fill_(weights < min_p.view(-1, 1), 0.0).nan_to_num_(0.0)
    cdf = weights.cumsum(dim=-1, dtype=torch.float64)
    target = uniforms(keys, MAX_ATTEMPTS) * cdf[:, -1]
    token = torch.searchsorted(cdf, target.view(-1, 1), right=True).view(-1)
    return token.clamp_(max=x.shape[1] - 1)
