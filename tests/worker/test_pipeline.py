"""How layers are split into stages and a step into micro-batches."""

from __future__ import annotations

import pytest
from headrace.worker.distributed.parallel import ParallelConfig, stage_layers
from headrace.worker.distributed.pipeline import split_micro_batches


@pytest.mark.parametrize(
    ("num_layers", "num_stages", "expected"),
    [
        (4, 2, [range(0, 2), range(2, 4)]),
        (3, 2, [range(0, 2), range(2, 3)]),
        (30, 4, [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]),
        (2, 2, [range(0, 1), range(1, 2)]),
    ],
)
def test_stages_are_contiguous_and_cover_every_layer_once(num_layers, num_stages, expected):
    assert [stage_layers(num_layers, num_stages, s) for s in range(num_stages)] == expected


def test_ranks_are_laid_out_stage_major():
    configs = [ParallelConfig.for_rank(rank, 2, 3) for rank in range(6)]
    assert [(c.pipeline_parallel_rank, c.tensor_parallel_rank) for c in configs] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
    ]
    assert [c.rank for c in configs] == list(range(6))
    assert configs[3].stage_rank(2) == 5  # TP rank 1 of stage 2
    assert configs[0].is_first_stage and configs[5].is_last_stage


@pytest.mark.parametrize(
    ("num_tokens", "num_micro_batches", "expected"),
    [
        ([1] * 8, 2, [range(0, 4), range(4, 8)]),
        ([1, 1, 1, 1, 12], 2, [range(0, 4), range(4, 5)]),  # a chunk is never split
        ([1, 1, 1], 4, [range(0, 1), range(1, 2), range(2, 3)]),  # fewer chunks than asked
        ([5, 5, 5], 1, [range(0, 3)]),
        ([], 2, []),
    ],
)
def test_micro_batches_are_consecutive_and_balanced_by_tokens(
    num_tokens, num_micro_batches, expected
):
    parts = split_micro_batches(num_tokens, num_micro_batches)
    assert parts == expected
