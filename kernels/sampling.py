"""The sampler's torch pieces that the kernels share: the Gumbel-max race, HF's top-p rule and
the row argmax (see `headrace.worker.sampling.draw`)."""

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


def draw_torch(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_p_floor: torch.Tensor,
    min_p: torch.Tensor,
    keys: torch.Tensor,
) -> torch.Tensor:
    """`draw` in torch ops (any device): scale, mask top-p (by sorting) and min-p, race."""
    scaled = x / temperature.view(-1, 1)
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
