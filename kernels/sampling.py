"""The sampler's kernels in torch: the seeded token draw and the grammar bitmask, the
reference twins of the CPU backend's C kernels (any device; the oracle they are tested
against), with the pieces the sampler's own stages share (HF's top-p rule, the row argmax).

Design note. A sampling row draws argmax(x / T + g) over the tokens top-k, top-p and min-p
keep (HF's order: top-k, then top-p over what top-k kept, then min-p), with g standard
Gumbel noise: the same distribution as sampling the truncated softmax(x / T). g[v] comes
from a counter-based hash of (row key, token id v) in integer ops (`gumbel_noise`), so it
needs no generator state: a row's token depends only on its key and its logits, never on
batch composition, row order, thread count or device (the sampler makes a seeded row's key
from its seed and position alone). -log(-log u) runs in float64 and is rounded once to
float32.

Why Gumbel-max and not an inverse CDF (one uniform per row against the cumulative
probabilities, which needs no noise per token): logits differ in their last bits between
batch compositions (a matmul over other rows, a prefill recomputing a decode's KV after a
failover), and an inverse CDF turns that into a different token whenever the uniform lands
within that rounding of any of the CDF's steps, which sum the whole vocabulary: measured on
the tiny test model, about one seeded draw in a thousand moved when a request was resumed
on another worker. Gumbel-max moves only when the two best noisy scores tie within rounding.

`draw_tokens` here masks top-p by sorting and races every token. That noise for every
token costs 100 ms per step for 256 rows of a 49k vocabulary in torch on a 2-core CPU; the
CPU backend's C kernel (`cpu_ops.draw_tokens`) avoids it: one pass races, keeping the best
few scores (1 without top-p; with it, enough that top-p rejects them all about once in 10^4
rows, up to 8), with a bound that needs only the integer hash for most tokens (a token
beats the race's current threshold t only if 1 - u < exp(x / T - t), tested on a lower
bound of log2(1 - u) read off the float bits of the hash); a second pass weighs the row
(exp((x - max) / T)) for top-p's test of the winner, by the mass of the tokens no more
likely, skipped when the winner is the most likely token. The draw is the first of the kept
scores that top-p keeps; a row where it keeps none is drawn here. Both give the same
tokens, and the same as headrace's earlier sampler for the same seeds.
"""

from __future__ import annotations

import math

import numpy as np
import torch

_MASK32 = (1 << 32) - 1
#: On the CPU the torch race makes noise this many elements at a time (a 2 MiB int64 working
#: set that stays in cache).
_CPU_NOISE_CHUNK = 1 << 18
#: The torch race makes noise for the finite logits alone when at most this share is finite.
_SPARSE_SHARE = 1 / 8


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum; on CPU numpy's SIMD argmax is several times torch's."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.argmax(x.detach().numpy(), axis=-1))
    return x.argmax(dim=-1)


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


def draw_tokens(
    logits: torch.Tensor,  # [S, V] float32 (history processing and top-k applied)
    temperature: torch.Tensor,  # [S] float32, > 0
    top_p_floor: torch.Tensor,  # [S] float32: 1 - top_p, rounded once from double (as HF)
    min_p: torch.Tensor,  # [S] float32
    keys: torch.Tensor,  # [S, 2] int64: (odd multiplier, offset) of each row's noise
) -> torch.Tensor:  # [S] int64
    """One seeded draw per row (see the design note): scale, mask top-p (by sorting) and
    min-p, race."""
    scaled = logits / temperature.view(-1, 1)
    scaled.masked_fill_(top_p_removed(scaled, top_p_floor.view(-1, 1)), -math.inf)
    probs = scaled.softmax(dim=-1)
    below = probs < min_p.view(-1, 1) * probs.amax(dim=-1, keepdim=True)
    scaled.masked_fill_(below, -math.inf)
    return gumbel_argmax(scaled, keys)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """argmax(x + Gumbel noise) per row; x [S, V] float32, keys [S, 2] int64 on x's device.

    Masked rows (top-k / top-p / min-p) leave few finite logits: noise is made for those
    only, with the same values the dense path would give them.
    """
    candidates = x > -math.inf
    if int(torch.count_nonzero(candidates)) <= _SPARSE_SHARE * x.numel():
        rows, token_ids = candidates.nonzero(as_tuple=True)
        noise = gumbel_noise(keys[rows, 0], keys[rows, 1], token_ids)
        race = torch.full_like(x, -math.inf)
        race[rows, token_ids] = noise.add_(x[rows, token_ids])
        return argmax(race)
    num_rows, vocab = x.shape
    vocab_ids = torch.arange(vocab, device=x.device)
    chunk = num_rows if x.device.type != "cpu" else max(1, _CPU_NOISE_CHUNK // vocab)
    winners = torch.empty(num_rows, dtype=torch.long, device=x.device)
    for start in range(0, num_rows, chunk):
        end = start + chunk
        noise = gumbel_noise(keys[start:end, :1], keys[start:end, 1:], vocab_ids)
        winners[start:end] = argmax(noise.add_(x[start:end]))
    return winners


def gumbel_noise(
    multiplier: torch.Tensor, offset: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Standard Gumbel noise, float32, broadcast over the (key, token id) arguments: each
    entry is a function of its row key (multiplier, offset) and token id only. Values stay
    in 32-bit lanes of int64 and every product below 2**63 (no signed overflow)."""
    h = token_ids * multiplier + offset  # a Weyl sequence per key
    h &= _MASK32
    for shift, factor in ((16, 0x21F0AAAD), (15, 0x735A2D97)):  # xorshift-multiply rounds
        h ^= h >> shift
        h *= factor
        h &= _MASK32
    h ^= h >> 15
    uniform = h.double().add_(0.5).mul_(2.0**-32)  # in (0, 1), exact
    return uniform.log_().neg_().log_().neg_().float()


def apply_token_bitmask(
    x: torch.Tensor,  # [B, V] float32, edited in place
    bitmask: torch.Tensor,  # [R, ceil(V / 32)] int32: bit t % 32 of word t / 32 = token t allowed
    rows: list[int],  # [R] the row of x of each bitmask row
) -> None:
    """Set to -inf each token a row's bitmask forbids (an output constraint's, as xgrammar
    fills them)."""
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = (bitmask.to(x.device).unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    forbidden = bits.view(len(rows), -1)[:, : x.shape[1]] == 0  # [R, V]
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        x.masked_fill_(forbidden, -math.inf)
    else:
        x[rows] = x[rows].masked_fill_(forbidden, -math.inf)
