"""torch's GEMM on weights packed once (`kernels.prepacked`): the same products as the
unpacked GEMM (float32 to rounding, bf16 to bf16's rounding of the output), with a bias and
strided rows, at row counts padded up to a bucket (the padding never shows), with few buckets;
a weight loaded again is packed again, whether the loader wrote the whole parameter, a merged
shard of it or its vocabulary rows; and tensors that are not parameters are never packed (a
per-call tensor would be packed per call)."""

from __future__ import annotations

import pytest
import torch
from headrace.kernels import prepacked, select_kernels
from headrace.kernels.precision import compute_dtype
from headrace.worker.distributed.parallel import ParallelConfig
from headrace.worker.layers.embedding import ParallelLMHead
from headrace.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from torch import nn

from tests.kernels import needs_c_compiler

#: Rows past the C matmul's limit, so the CPU backend's linear takes the packed GEMM.
ROWS = 80
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_linear_equals_the_unpacked_gemm(dtype):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(96, 64).to(dtype), requires_grad=False)
    bias = torch.randn(96).to(dtype)
    x = torch.randn(ROWS, 100).to(dtype)[:, 20:84]  # rows strided 100 apart
    # bf16 is packed where the CPU multiplies it natively, else widened as before.
    assert prepacked.packs(x, weight) == (compute_dtype(dtype, torch.device("cpu")) == dtype)
    got = prepacked.linear(x, weight, bias, out_dtype=torch.float32)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    assert got.dtype == torch.float32


@pytest.mark.parametrize("rows", [1, 49, 65, 130, 1000])
def test_padded_calls_return_only_their_rows(rows):
    torch.manual_seed(rows)
    weight = nn.Parameter(torch.randn(40, 32), requires_grad=False)
    x = torch.randn(rows, 32)
    got = prepacked.linear(x, weight)
    assert got.shape == (rows, 40)
    torch.testing.assert_close(got, x @ weight.T, rtol=1e-5, atol=1e-5)


def test_row_buckets_are_few_and_pad_by_at_most_a_quarter():
    """oneDNN keeps a compiled kernel per weight and row count: the counts must stay few."""
    buckets = {prepacked.bucket_rows(rows) for rows in range(1, 8193)}
    assert len(buckets) <= 32
    for rows in range(1, 8193):
        padded = prepacked.bucket_rows(rows)
        assert rows <= padded and (rows <= 64 or padded <= 1.25 * rows), rows
        assert prepacked.bucket_rows(padded) == padded


def test_only_parameters_are_packed():
    assert prepacked.available()  # the pinned torch has oneDNN
    weight = nn.Parameter(torch.randn(8, 4), requires_grad=False)
    x = torch.randn(3, 4)
    assert prepacked.packs(x, weight)
    assert not prepacked.packs(x, weight.detach())
    assert not prepacked.packs(x, weight[:4])
    assert not prepacked.packs(x.double(), weight)


@needs_c_compiler
def test_a_reloaded_merged_weight_is_packed_again():
    """The packed copy follows the parameter: a second load of a shard (the weight updates'
    path) changes what the layer computes at rows the packed GEMM takes."""
    kernels = select_kernels("cpu", torch.device("cpu"))
    parallel = ParallelConfig()
    layer = MergedColumnParallelLinear(16, [24, 24], bias=False, parallel=parallel, kernels=kernels)
    gate, up = torch.randn(24, 16), torch.randn(24, 16)
    layer.weight_loader(layer.weight, gate, 0)
    layer.weight_loader(layer.weight, up, 1)
    x = torch.randn(ROWS, 16)
    torch.testing.assert_close(layer(x), x @ torch.cat([gate, up]).T)
    new_up = torch.randn(24, 16)
    layer.weight_loader(layer.weight, new_up, 1)
    torch.testing.assert_close(layer(x), x @ torch.cat([gate, new_up]).T)


@needs_c_compiler
def test_a_reloaded_row_parallel_weight_and_lm_head_are_packed_again():
    kernels = select_kernels("cpu", torch.device("cpu"))
    parallel = ParallelConfig()
    row = RowParallelLinear(16, 8, bias=False, parallel=parallel, kernels=kernels)
    head = ParallelLMHead(300, 16, parallel=parallel, kernels=kernels)
    x = torch.randn(ROWS, 16)
    for _ in range(2):
        down, vocab = torch.randn(8, 16), torch.randn(300, 16)
        row.weight_loader(row.weight, down, None)
        head.weight_loader(head.weight, vocab, None)
        torch.testing.assert_close(row(x), x @ down.T)
        assert head.greedy(x).tolist() == (x @ vocab.T).argmax(dim=-1).tolist()
