"""Seeded sampling by Gumbel-max, with noise made only where it can win.

Design note. A sampling row draws argmax(x / T + g) over the tokens top-k, top-p and min-p
keep (HF's order: top-k, then top-p over what top-k kept, then min-p), with g standard
Gumbel noise: the same distribution as sampling the truncated softmax(x / T). g[v] comes
from a counter-based hash of (row key, token id v) in integer ops, so it needs no generator
state: a seeded row's key comes from (sample_seed, position) alone, so its token depends only
on those and on its logits, never on batch composition, row order, thread count or device.
-log(-log u) runs in float64 and is rounded once to float32.

Why Gumbel-max and not an inverse CDF (one uniform per row against the cumulative
probabilities, which needs no noise per token): logits differ in their last bits between
batch compositions (a matmul over other rows, a prefill recomputing a decode's KV after a
failover), and an inverse CDF turns that into a different token whenever the uniform lands
within that rounding of any of the CDF's steps, which sum the whole vocabulary: measured on
the tiny test model, about one seeded draw in a thousand moved when a request was resumed
on another worker. Gumbel-max moves only when the two best noisy scores tie within rounding.

The cost of noise for every token (100 ms per step for 256 rows of a 49k vocabulary in
torch on a 2-core CPU) is avoided on the CPU by the C kernel (`cpu_ops.draw_tokens`): one pass
races, keeping the best few scores (1 without top-p; with it, enough that top-p rejects them
all about once in 10^4 rows, up to 8), with a bound that needs only the integer hash for most
tokens (a token beats the race's current threshold t only if 1 - u < exp(x / T - t), tested
on a lower bound of log2(1 - u) read off the float bits of the hash); a second pass weighs the
row (exp((x - max) / T)) for top-p's test of the winner, by the mass of the tokens no more
likely, skipped when the winner is the most likely token. The draw is the first of the kept
scores that top-p keeps. When it keeps none, or elsewhere than on a CPU, `draw_torch` masks by
sorting and races every token. Both give the same tokens (the torch path is the reference the
kernel is tested against), and the same as headrace's earlier sampler for the same seeds.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from headrace.kernels import cpu_ops
from headrace.worker.sampling.ops import argmax
from headrace.worker.sampling.warpers import top_p_removed

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
#: On the CPU the torch race makes noise this many elements at a time (a 2 MiB int64 working
#: set that stays in cache).
_CPU_NOISE_CHUNK = 1 << 18
#: The torch race makes noise for the finite logits alone when at most this share is finite.
_SPARSE_SHARE = 1 / 8


def seeded_key(seed: int, position: int) -> tuple[int, int]:
    """The noise key of the token at position of a request with this seed."""
    multiplier, offset = seeded_keys([seed], [position])[0].tolist()
    return multiplier, offset


def seeded_keys(seeds: list[int], positions: list[int]) -> torch.Tensor:  # [N, 2] int64
    """Each (seed, position)'s noise key, in one vectorised pass: splitmix64 of splitmix64
    of the seed plus the position, all mod 2**64; the key is its high and low 32 bits."""
    seed = np.array([s & _MASK64 for s in seeds], dtype=np.uint64)
    position = np.array(positions, dtype=np.uint64)
    mixed = _splitmix64(_splitmix64(seed) + position)
    keys = np.stack([mixed >> np.uint64(32), mixed & np.uint64(_MASK32)], axis=1)
    return torch.from_numpy(keys.astype(np.int64))


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's output of each uint64 z plus its increment (numpy's uint64 wraps)."""
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return np.asarray(z ^ (z >> np.uint64(31)), dtype=np.uint64)


def draw(
    x: torch.Tensor,  # [S, V] float32 logits (history processing and top-k applied)
    temperature: torch.Tensor,  # [S] float32
    top_p_floor: torch.Tensor,  # [S] float32: 1 - top_p, rounded once from double (as HF)
    min_p: torch.Tensor,  # [S] float32
    keys: torch.Tensor,  # [S, 2] int64
) -> torch.Tensor:  # [S] int64
    """One token per row; see the module's design note."""
    if x.device.type != "cpu" or not cpu_ops.available():
        return draw_torch(x, temperature, top_p_floor, min_p, keys)
    tokens = cpu_ops.draw_tokens(x, temperature, top_p_floor, min_p, keys)
    unsettled = (tokens < 0).nonzero().view(-1)
    if len(unsettled):
        rows = unsettled.tolist()
        tokens[unsettled] = draw_torch(
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
