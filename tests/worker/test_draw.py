"""The seeded Gumbel-max draw (the kernel sets' `draw_tokens`, keys from
headrace.worker.sampling.draw).

- The seeded stream is pinned against a plain-Python implementation of the documented
  algorithm (integer hash, float32 scores, HF's truncation rules): same seeds, same tokens.
- The C kernel (which skips the noise of tokens that cannot win) and the torch race give the
  same tokens, on flat and peaked rows alike.
- Every drawn token is one HF's top-k / top-p / min-p rules keep, and draws are spread like
  the truncated softmax.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from headrace.kernels import cpu_ops, reference, select_kernels
from headrace.kernels.sampling import top_p_removed
from headrace.worker.sampling.draw import seeded_key, seeded_keys

from tests.kernels import needs_c_compiler


def python_gumbel(key: tuple[int, int], token: int) -> np.float32:
    h = (token * key[0] + key[1]) & 0xFFFFFFFF
    for shift, factor in ((16, 0x21F0AAAD), (15, 0x735A2D97)):
        h = ((h ^ (h >> shift)) * factor) & 0xFFFFFFFF
    h ^= h >> 15
    return np.float32(-math.log(-math.log((h + 0.5) / 2**32)))


def python_draw(
    logits: list[float], temperature: float, top_p: float, min_p: float, key: tuple[int, int]
) -> int:
    """The algorithm as the design note states it, token by token: float32 scores, top-p
    by sorting the probabilities, min-p against the most likely token, then the race."""
    scaled = [np.float32(x) / np.float32(temperature) for x in logits]
    best = max(scaled)
    weights = [math.exp(float(x) - float(best)) for x in scaled]
    total = sum(weights)
    ascending = sorted(range(len(scaled)), key=lambda i: weights[i])
    removed, cumulative = set(), 0.0
    for i in ascending[:-1]:  # the most likely token always stays
        cumulative += weights[i] / total
        if cumulative > 1.0 - top_p:
            break
        removed.add(i)
    kept = [i for i in range(len(scaled)) if i not in removed and weights[i] >= min_p]
    scores = {i: np.float32(scaled[i] + python_gumbel(key, i)) for i in kept}
    return max(kept, key=lambda i: (scores[i], -i))  # the first maximum


def python_seeded_key(seed: int, position: int) -> tuple[int, int]:
    """The documented key, in plain Python integers: splitmix64 twice, mod 2**64."""
    mask = (1 << 64) - 1

    def splitmix64(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    mixed = splitmix64((splitmix64(seed & mask) + position) & mask)
    return mixed >> 32, mixed & 0xFFFFFFFF


def test_batched_seeded_keys_are_each_rows_key():
    """The sampler's one-pass keys equal the documented key (seeds of any int64 sign and
    size), and `seeded_key` is one row of them."""
    gen = torch.Generator().manual_seed(26)
    seeds = torch.randint(-(1 << 63), (1 << 63) - 1, (500,), generator=gen).tolist() + [0, 1]
    positions = torch.randint(0, 1 << 20, (502,), generator=gen).tolist()
    want = [list(python_seeded_key(s, p)) for s, p in zip(seeds, positions, strict=True)]
    assert seeded_keys(seeds, positions).tolist() == want
    one_by_one = zip(seeds[:20], positions[:20], strict=True)
    assert [list(seeded_key(s, p)) for s, p in one_by_one] == want[:20]


def key_tensor(keys: list[tuple[int, int]]) -> torch.Tensor:
    out = torch.tensor(keys, dtype=torch.long)
    out[:, 0] |= 1
    return out


#: What a CPU engine draws with: the C kernel, or torch's where it cannot be built.
draw = select_kernels("auto", torch.device("cpu")).draw_tokens
draw_torch = reference.draw_tokens


def draw_rows(logits, temperature, top_p, min_p, keys, fn=draw):
    rows = logits.shape[0]
    column = lambda v: torch.full((rows,), v, dtype=torch.float32)  # noqa: E731
    floor = torch.full((rows,), 1.0 - top_p, dtype=torch.float32)
    return fn(logits, column(temperature), floor, column(min_p), keys).tolist()


@pytest.mark.parametrize(
    ("temperature", "top_p", "min_p"), [(1.0, 1.0, 0.0), (0.7, 0.9, 0.0), (1.3, 0.6, 0.05)]
)
@pytest.mark.parametrize(
    "kernels", [pytest.param(cpu_ops, marks=needs_c_compiler), reference], ids=["kernel", "torch"]
)
def test_the_seeded_stream_is_the_documented_algorithm(kernels, temperature, top_p, min_p):
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(40, 300, generator=gen) * 2
    keys = [seeded_key(seed, position=seed + 7) for seed in range(40)]
    keys = [(m | 1, o) for m, o in keys]
    got = draw_rows(logits, temperature, top_p, min_p, key_tensor(keys), fn=kernels.draw_tokens)
    want = [
        python_draw(row.tolist(), temperature, top_p, min_p, key)
        for row, key in zip(logits, keys, strict=True)
    ]
    assert got == want


@needs_c_compiler
@pytest.mark.parametrize("spread", [0.01, 3.0, 40.0], ids=["flat", "normal", "peaked"])
def test_kernel_and_torch_race_agree_on_a_large_vocabulary(spread):
    """The kernel's bound skips most tokens' noise; it must never skip a winner. A low top_p
    sends rows whose race leaders top-p removes to the torch race: the same tokens."""
    gen = torch.Generator().manual_seed(22)
    logits = torch.randn(64, 49152, generator=gen) * spread
    logits[5, 1000:] = -math.inf  # a row most of whose vocabulary top-k removed
    logits[6, :] = 1.0  # every token tied
    keys = key_tensor(torch.randint(0, 1 << 32, (64, 2), generator=gen).tolist())
    for temperature, top_p, min_p in ((0.8, 0.9, 0.0), (1.0, 1.0, 0.1), (0.5, 0.05, 0.0)):
        kernel = draw_rows(logits, temperature, top_p, min_p, keys)
        twin = draw_rows(logits, temperature, top_p, min_p, keys, fn=draw_torch)
        assert kernel == twin


@needs_c_compiler
@pytest.mark.parametrize(
    ("scale", "temperature"),
    [(1e4, 1.0), (30.0, 0.05), (1.0, 5000.0)],
    ids=["huge-logits", "cold", "hot"],
)
def test_kernel_and_torch_race_agree_at_the_edges(scale, temperature):
    """The kernel's bound carries slack for float rounding at any magnitude. A NaN logit
    never wins in the kernel (the torch race, whose softmax turns a NaN row to NaNs, is no
    reference for that row)."""
    gen = torch.Generator().manual_seed(25)
    logits = torch.randn(48, 3000, generator=gen) * scale
    logits[3, ::7] = math.nan
    keys = key_tensor(torch.randint(0, 1 << 32, (48, 2), generator=gen).tolist())
    for top_p, min_p in ((0.9, 0.0), (1.0, 0.2), (0.3, 0.05)):
        kernel = draw_rows(logits, temperature, top_p, min_p, keys)
        twin = draw_rows(logits, temperature, top_p, min_p, keys, fn=draw_torch)
        assert kernel[:3] + kernel[4:] == twin[:3] + twin[4:]
        assert kernel[3] % 7 != 0  # not a NaN token


def test_a_seeded_draw_ignores_last_bit_noise_in_other_tokens_logits():
    """What an inverse CDF could not promise: logits that differ in their last bits (another
    batch's matmul) leave the token unchanged unless the two best scores tie within that."""
    gen = torch.Generator().manual_seed(24)
    logits = torch.randn(2000, 512, generator=gen) * 2
    jitter = logits * (1 + 2e-7 * torch.randn(logits.shape, generator=gen))
    keys = key_tensor([seeded_key(i, 60) for i in range(2000)])
    a = draw_rows(logits, 0.8, 0.95, 0.0, keys)
    b = draw_rows(jitter, 0.8, 0.95, 0.0, keys)
    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 1


def test_every_draw_is_a_token_top_p_keeps():
    """Against the sort-based rule on rows with ties and a low top_p (the race's leaders
    often removed)."""
    gen = torch.Generator().manual_seed(23)
    logits = torch.randint(-3, 4, (200, 40), generator=gen).float()  # many ties
    keys = key_tensor(torch.randint(0, 1 << 32, (200, 2), generator=gen).tolist())
    for top_p in (0.2, 0.5, 0.95):
        tokens = torch.tensor(draw_rows(logits, 1.0, top_p, 0.0, keys))
        floor = torch.full((200, 1), 1.0 - top_p)
        removed = top_p_removed(logits, floor)
        assert not removed.gather(1, tokens.view(-1, 1)).any()


@pytest.mark.parametrize("fn", [draw, draw_torch], ids=["kernel", "torch"])
def test_draws_are_spread_like_the_truncated_softmax(fn):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])
    num_draws = 20_000
    keys = key_tensor([seeded_key(i, 3) for i in range(num_draws)])
    tokens = draw_rows(logits.expand(num_draws, 8).contiguous(), 1.0, 0.7, 0.0, keys, fn=fn)
    probs = logits.softmax(-1)
    kept = ~top_p_removed(logits.view(1, -1), torch.tensor([[0.3]])).view(-1)
    expected = torch.where(kept, probs, 0.0)
    expected = (expected / expected.sum()).double()
    frequencies = torch.bincount(torch.tensor(tokens), minlength=8).double() / num_draws
    tolerance = 5 * (expected * (1 - expected) / num_draws).sqrt() + 1e-9
    assert ((frequencies - expected).abs() <= tolerance).all()


def test_a_row_with_every_token_removed_draws_token_zero():
    logits = torch.full((2, 5), -math.inf)
    keys = key_tensor([(3, 4), (5, 6)])
    assert draw_rows(logits, 1.0, 0.9, 0.0, keys) == [0, 0]
    assert draw_rows(logits, 1.0, 0.9, 0.0, keys, fn=draw_torch) == [0, 0]
