"""`BlockTables`: every recent sequence's block table, kept across steps in one array.

Building a step's block tables from each sequence's Python list costs a copy of every block
id of every sequence, every step, although a decoding sequence gains a block only once per
``block_size`` tokens. Here each sequence holds a row of a preallocated table; a step copies
in only the block ids its sequences gained since their last step, then takes its rows in
one vectorised gather.

A row belongs to one block list object (``seq.block_ids``): the block manager appends to it
while the sequence holds its blocks and gives the sequence a new list when it frees them
(preemption, recompute), as a rank's mirror does on a reset. So a row is extended while its
list only grew, and a sequence whose list is a new object gets a row written afresh. Rows
are kept for sequences absent from a step (they may come back) and reclaimed least recently
used first when the table is full; the table doubles when a step needs more rows or wider
ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np


class BlockTables:
    def __init__(self, num_rows: int = 64, num_columns: int = 16) -> None:
        self.table = np.zeros((num_rows, num_columns), dtype=np.int32)
        #: Row -> the block list it mirrors (held, so its id is never reused while mapped).
        self._lists: list[list[int] | None] = [None] * num_rows
        #: Row -> how many of that list's block ids the row holds, and the last of them (the
        #: check that a list only grew reads it here, not from the numpy table: a Python
        #: list's item costs a tenth of an array element's, for every sequence of every step).
        self._written = [0] * num_rows
        self._tails = [0] * num_rows
        self._row_of: dict[int, int] = {}  # id(block list) -> row
        #: Mapped rows, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._free = list(range(num_rows - 1, -1, -1))

    def gather(self, block_lists: Sequence[list[int]]) -> np.ndarray:
        """[len(block_lists), max blocks] int32: the block tables of one step's sequences,
        in order, zero-padded on the right."""
        width = max((len(ids) for ids in block_lists), default=0)
        if width > self.table.shape[1]:
            self._grow(self.table.shape[0], max(width, 2 * self.table.shape[1]))
        rows = [self._row_for(ids, len(block_lists)) for ids in block_lists]
        return self.table[rows, : max(width, 1)]

    def _row_for(self, block_ids: list[int], num_in_step: int) -> int:
        row = self._row_of.get(id(block_ids))
        if row is None:
            row = self._new_row(block_ids, num_in_step)
        written, total = self._written[row], len(block_ids)
        # A list only grows while it is the sequence's (a copy-on-write change to its last
        # block would show here: then the row is written whole).
        if written and (total < written or self._tails[row] != block_ids[written - 1]):
            self.table[row, :written] = 0
            written = 0
        if total != written:
            self.table[row, written:total] = block_ids[written:]
            self._written[row], self._tails[row] = total, block_ids[-1]
        self._lru.move_to_end(row)
        return row

    def _new_row(self, block_ids: list[int], num_in_step: int) -> int:
        if not self._free:
            if len(self._lru) <= num_in_step:  # rows of this step may be in use: grow
                self._grow(2 * self.table.shape[0], self.table.shape[1])
            else:  # the least recently used row, from an earlier step
                old_row = next(iter(self._lru))
                self._unmap(old_row)
        row = self._free.pop()
        self._lists[row], self._written[row] = block_ids, 0
        self._row_of[id(block_ids)] = row
        self._lru[row] = None
        return row

    def _unmap(self, row: int) -> None:
        old = self._lists[row]
        assert old is not None
        del self._row_of[id(old)], self._lru[row]
        self.table[row, : self._written[row]] = 0
        self._lists[row], self._written[row] = None, 0
        self._free.append(row)

    def _grow(self, num_rows: int, num_columns: int) -> None:
        table = np.zeros((num_rows, num_columns), dtype=np.int32)
        table[: self.table.shape[0], : self.table.shape[1]] = self.table
        old_rows = self.table.shape[0]
        self._lists.extend([None] * (num_rows - old_rows))
        self._written.extend([0] * (num_rows - old_rows))
        self._tails.extend([0] * (num_rows - old_rows))
        self._free.extend(range(num_rows - 1, old_rows - 1, -1))
        self.table = table
