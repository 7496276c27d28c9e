"""Seeded sampling by Gumbel-max.

Design note. A sampling row draws argmax(logits + g) with g standard Gumbel noise
(Gumbel-max: the same distribution as sampling softmax(logits)). g[v] is made from a
counter-based hash of (row key, v) in int64 torch ops, so it needs no generator state:
a seeded row's key comes from (sample_seed, position) alone, so its token depends only on
those and on its logits, never on batch composition, row order or device. The integer
ops are exact everywhere; -log(-log u) runs in float64 and is rounded once to float32, so
a one-ulp CPU / CUDA difference in float64 log changes the noise with odds ~2**-29 per
entry; the add is IEEE and argmax takes the first maximum. The alternative, a per-row
CPU torch.Generator, is a Python loop of one seeding and one V-long draw per row and, on
a GPU, a [S, V] host-to-device copy every step; on a 2-core CPU, for 256 rows x 49152,
it measured 130 ms against 87 ms for this draw. Rows without a seed take the same path
with keys drawn from the sampler's generator, so there is one draw path.
"""

from __future__ import annotations

import math

import torch
from headrace.worker.sampling.ops import argmax

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
# On CPU the noise is made this many elements at a time, so its int64 working set (2 MiB)
# stays in cache: measured 4x faster than one pass over a [256, 49152] batch.
_CPU_NOISE_CHUNK = 1 << 18
# The draw makes noise for the finite logits alone when at most this share of them is finite.
_SPARSE_SHARE = 1 / 8


def seeded_key(seed: int, position: int) -> tuple[int, int]:
    """The noise key of the token at position of a request with this seed."""
    mixed = _splitmix64((_splitmix64(seed) + position) & _MASK64)
    return mixed >> 32, mixed & _MASK32


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def gumbel_argmax(x: torch.Tensor, keys: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """argmax(x + Gumbel noise) per row; x [S, V] float32, keys [S, 2] int64 on x's device.

    Filtered rows (top-k / top-p / min-p) leave few finite logits: noise is made for those
    only, with the same values the dense path would give them.
    """
    candidates = x > -math.inf
    if int(torch.count_nonzero(candidates)) <= _SPARSE_SHARE * x.numel():
        rows, token_ids = candidates.nonzero(as_tuple=True)
        noise = _gumbel_noise(keys[rows, 0], keys[rows, 1], token_ids)
        race = torch.full_like(x, -math.inf)
        race[rows, token_ids] = noise.add_(x[rows, token_ids])
        return argmax(race)
    num_rows, vocab = x.shape
    chunk = num_rows if x.device.type != "cpu" else max(1, _CPU_NOISE_CHUNK // vocab)
    winners = torch.empty(num_rows, dtype=torch.long, device=x.device)
    for start in range(0, num_rows, chunk):
        end = start + chunk
        noise = _gumbel_noise(keys[start:end, :1], keys[start:end, 1:], vocab_ids)
        winners[start:end] = argmax(noise.add_(x[start:end]))
    return winners


def _gumbel_noise(
    multiplier: torch.Tensor, offset: torch.Tensor, token_ids: torch.Tensor
) -> torch.Tensor:
    """Standard Gumbel noise, float32, broadcast over the (key, token id) arguments: each
    entry is a function of its row key (multiplier, offset) and token id only.

    Values stay in 32-bit lanes of int64 and every product stays below 2**63, so nothing
    relies on signed overflow.
    """
    h = token_ids * multiplier + offset  # a Weyl sequence per key
    h &= _MASK32
    for shift, factor in ((16, 0x21F0AAAD), (15, 0x735A2D97)):  # xorshift-multiply rounds
        h ^= h >> shift
        h *= factor
        h &= _MASK32
    h ^= h >> 15
    uniform = h.double().add_(0.5).mul_(2.0**-32)  # in (0, 1), exact
    return uniform.log_().neg_().log_().neg_().float()
