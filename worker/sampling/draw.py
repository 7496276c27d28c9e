"""Seeded sampling keys: each sampling row's noise key, from which the kernel set's draw
(`KernelSet.draw_tokens`; the algorithm, and why Gumbel-max: `headrace.kernels.sampling`)
makes its Gumbel noise.

Design note. A sampling row draws argmax(x / T + g) over the tokens top-k, top-p and min-p
keep, with g standard Gumbel noise: the same distribution as sampling the truncated
softmax(x / T). g[v] is a hash of (row key, token id v), so it needs no generator state: a
seeded row's key comes from (sample_seed, position) alone, so its token depends only on
those and on its logits, never on batch composition, row order, thread count or device, and
a request resumed on another worker draws the same tokens. Rows without a seed take fresh
keys from the sampler's generator.
"""

from __future__ import annotations

import numpy as np
import torch

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
