"""The sampler's kernels of every CPU-capable kernel set: the grammar bitmask equals xgrammar's
own apply, on some rows of a batch or all of them, in C and in torch. (The seeded draw is
pinned in tests/worker/test_draw.py, the running argmax in test_argmax.py.)"""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr
from headrace.kernels import cpu_ops, reference

from tests.kernels import needs_c_compiler

KERNEL_SETS = [pytest.param(cpu_ops, marks=needs_c_compiler), reference]
KERNEL_IDS = ["c", "torch"]


def random_bitmask(num_rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """[num_rows, ceil(vocab / 32)] int32 with random words, all-ones words in row 1 and no
    allowed token in row 2's first word."""
    num_words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, num_words), generator=generator)
    bitmask = bitmask.to(torch.int32)
    bitmask[1, : num_words // 2] = -1  # all-ones words: every token allowed
    bitmask[2, 0] = 0  # no token of the first word
    return bitmask


def xgrammar_applied(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    want = x.clone()
    selected = want[rows]
    xgr.apply_token_bitmask_inplace(selected, bitmask, vocab_size=x.shape[1])
    want[rows] = selected
    return want


@pytest.mark.parametrize("kernels", KERNEL_SETS, ids=KERNEL_IDS)
@pytest.mark.parametrize("vocab", [64, 49152, 1000])  # 1000: a last word only partly used
def test_apply_token_bitmask_equals_xgrammar(kernels, vocab):
    generator = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=generator)
    rows = [0, 2, 5]
    bitmask = random_bitmask(3, vocab, generator)
    want = xgrammar_applied(x, bitmask, rows)
    kernels.apply_token_bitmask(x, bitmask, rows)
    assert torch.equal(x, want)
    assert torch.isinf(x[5, :32]).all() and not torch.isinf(x[[1, 3, 4]]).any()


@pytest.mark.parametrize("kernels", KERNEL_SETS, ids=KERNEL_IDS)
def test_apply_token_bitmask_on_every_row_and_strided_columns(kernels):
    generator = torch.Generator().manual_seed(7)
    wide = torch.randn(4, 2 * 1000, generator=generator)
    bitmask = random_bitmask(4, 1000, generator)
    for x in (wide[:, :1000].clone(), wide[:, ::2]):  # rows of unit stride, then not
        want = xgrammar_applied(x, bitmask, [0, 1, 2, 3])
        kernels.apply_token_bitmask(x, bitmask, [0, 1, 2, 3])
        assert torch.equal(x, want)
