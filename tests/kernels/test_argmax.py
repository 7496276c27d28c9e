"""The running argmax over column blocks (the greedy LM head's reduction) equals numpy's
argmax of the whole rows, in C and in torch, however the columns are split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from headrace.kernels import cpu_ops, reference
from headrace.kernels.argmax import RunningArgmax

from tests.kernels import needs_c_compiler


def awkward_rows() -> torch.Tensor:
    torch.manual_seed(11)
    x = torch.randn(9, 1000)
    x[0, 10] = x[0, 900] = 50.0  # a tie across blocks: the first wins
    x[1, 300] = x[1, 301] = 50.0  # a tie inside a block
    x[2, :] = -torch.inf  # all -inf: index 0, as numpy
    x[3, 700] = torch.nan  # a NaN in a later block wins
    x[3, 5] = 1e9
    x[4, 20] = torch.nan  # an early NaN wins over a later one and over +inf
    x[4, 800] = torch.nan
    x[4, 600] = torch.inf
    x[5, 999] = 80.0  # the very last column
    return x


@pytest.mark.parametrize(
    "kernels", [pytest.param(cpu_ops, marks=needs_c_compiler), reference], ids=["c", "torch"]
)
@pytest.mark.parametrize("block", [1, 7, 256, 300, 1000])
def test_running_argmax_equals_numpy_argmax(kernels, block):
    x = awkward_rows()
    running = RunningArgmax(x.shape[0], x.device, kernels)
    for start in range(0, x.shape[1], block):
        running.update(x[:, start : start + block], start)
    want = np.argmax(x.numpy(), axis=-1).tolist()
    assert running.index.tolist() == want


@pytest.mark.parametrize(
    "kernels", [pytest.param(cpu_ops, marks=needs_c_compiler), reference], ids=["c", "torch"]
)
def test_running_argmax_reads_strided_blocks(kernels):
    """Blocks are column slices of a wider matrix (row stride > block width)."""
    x = awkward_rows()
    running = RunningArgmax(x.shape[0], x.device, kernels)
    for start in range(0, 1000, 128):
        running.update(x[:, start : start + 128], start)
    assert running.index.tolist() == np.argmax(x.numpy(), axis=-1).tolist()
