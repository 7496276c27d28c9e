"""The router's priority queue: higher priority first, FIFO within a level, with aging.

Aging adds ``aging_per_s`` priority per second waited. Two waiting requests then compare by
``priority + aging * (now - arrival)``, and ``now`` cancels out: the order is fixed by
``priority - aging * arrival``, so a plain heap on that key serves, and a low-priority
request still rises above any fixed higher level once it has waited long enough.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True, slots=True)
class _Entry(Generic[T]):
    key: tuple[float, int]
    item: T = field(compare=False)
    num_tokens: int = field(compare=False)
    live: bool = field(default=True, compare=False)


class PriorityQueue(Generic[T]):
    def __init__(self, aging_per_s: float) -> None:
        self.aging_per_s = aging_per_s
        self._heap: list[_Entry[T]] = []
        self._entries: dict[int, _Entry[T]] = {}  # by id(item), for removal
        self._order = itertools.count()
        self.num_requests = 0
        self.num_tokens = 0

    def __len__(self) -> int:
        return self.num_requests

    def push(self, item: T, priority: int, arrival_s: float, num_tokens: int) -> None:
        """``arrival_s``: when the request arrived (monotonic seconds); kept on failover."""
        key = (-(priority - self.aging_per_s * arrival_s), next(self._order))
        entry = _Entry(key, item, num_tokens)
        heapq.heappush(self._heap, entry)
        self._entries[id(item)] = entry
        self.num_requests += 1
        self.num_tokens += num_tokens

    def peek(self) -> T | None:
        while self._heap and not self._heap[0].live:
            heapq.heappop(self._heap)
        return self._heap[0].item if self._heap else None

    def pop(self) -> T:
        item = self.peek()
        assert item is not None, "pop from an empty queue"
        self.remove(item)
        return item

    def remove(self, item: T) -> bool:
        """Take an item out wherever it is (lazily); False if it was not queued."""
        entry = self._entries.pop(id(item), None)
        if entry is None:
            return False
        entry.live = False
        self.num_requests -= 1
        self.num_tokens -= entry.num_tokens
        return True

    def items(self) -> list[T]:
        return [entry.item for entry in self._entries.values()]
