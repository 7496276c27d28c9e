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

import numpy as np
import torch
from headrace.kernels import cpu_ops
from headrace.kernels.sampling import draw_torch

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1


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
