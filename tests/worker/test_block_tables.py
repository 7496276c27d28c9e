"""`BlockTables` (block tables kept across steps) gathers exactly what building each step's
tables from the block lists would, whatever happens to the lists between steps."""

from __future__ import annotations

import random

import numpy as np
from headrace.worker.execution.block_tables import BlockTables
from headrace.worker.execution.model_runner import cache_slots


def padded(block_lists: list[list[int]]) -> np.ndarray:
    width = max([len(ids) for ids in block_lists] + [1])
    table = np.zeros((len(block_lists), width), dtype=np.int32)
    for i, ids in enumerate(block_lists):
        table[i, : len(ids)] = ids
    return table


def test_random_steps_gather_what_the_lists_hold():
    """Sequences come and go; lists grow by a block, are replaced by new lists (preemption),
    have their last block swapped (copy-on-write) or shrink in place; few rows at first, so
    rows are reclaimed and the table grows."""
    rng = random.Random(7)
    tables = BlockTables(num_rows=4, num_columns=2)
    seqs: list[list[int]] = [[rng.randrange(1000)] for _ in range(6)]
    for _ in range(400):
        for i, ids in enumerate(seqs):
            roll = rng.random()
            if roll < 0.3:
                ids.append(rng.randrange(1000))
            elif roll < 0.35:
                seqs[i] = [rng.randrange(1000) for _ in range(rng.randrange(1, 5))]
            elif roll < 0.4 and ids:
                ids[-1] = rng.randrange(1000)
            elif roll < 0.43 and len(ids) > 1:
                del ids[rng.randrange(1, len(ids)) :]
        if rng.random() < 0.2:
            seqs.append([rng.randrange(1000)])
        if rng.random() < 0.15 and len(seqs) > 1:
            seqs.pop(rng.randrange(len(seqs)))
        step = rng.sample(seqs, rng.randrange(1, len(seqs) + 1))
        assert np.array_equal(tables.gather(step), padded(step))


def test_a_step_larger_than_the_table_grows_it_and_keeps_earlier_rows():
    tables = BlockTables(num_rows=2, num_columns=1)
    first = [[1, 2], [3]]
    assert np.array_equal(tables.gather(first), padded(first))
    many = [[i, i + 1, i + 2] for i in range(10)] + first
    assert np.array_equal(tables.gather(many), padded(many))
    assert tables.table.shape[0] >= 12
    assert np.array_equal(tables.gather(first), padded(first))


def test_an_unchanged_decode_copies_no_block_ids(monkeypatch):
    """Only the ids a list gained are written: a step of unchanged lists writes nothing."""
    tables = BlockTables()
    lists = [[1, 2, 3], [4, 5]]
    tables.gather(lists)
    writes: list[object] = []
    real = tables.table

    class Spy(np.ndarray):
        def __setitem__(self, key, value):
            writes.append(key)
            super().__setitem__(key, value)

    tables.table = real.view(Spy)
    tables.gather(lists)
    assert writes == []
    lists[1].append(6)
    assert np.array_equal(tables.gather(lists), padded(lists)) and len(writes) == 1


def test_cache_slots_are_each_positions_block_and_offset():
    """A chunk's slots, built a block at a time, are what the definition gives position by
    position: the position's block id times block_size, plus its offset in the block."""
    rng = random.Random(3)
    for _ in range(300):
        block_size = rng.choice([1, 2, 3, 16])
        block_ids = rng.sample(range(1000), rng.randrange(1, 12))
        end = rng.randrange(1, len(block_ids) * block_size + 1)
        start = rng.randrange(0, end)
        want = [block_ids[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert cache_slots(block_ids, start, end, block_size) == want
