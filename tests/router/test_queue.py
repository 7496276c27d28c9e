"""The router's priority queue: higher first, FIFO within a level, aging, removal, counts."""

from __future__ import annotations

from headrace.router.queue import PriorityQueue


def drain(queue: PriorityQueue[str]) -> list[str]:
    return [queue.pop() for _ in range(len(queue))]


def test_higher_priority_first_and_fifo_within_a_level() -> None:
    queue: PriorityQueue[str] = PriorityQueue(aging_per_s=0.0)
    for name, priority, arrival in [("a", 0, 0.0), ("b", 5, 1.0), ("c", 0, 2.0), ("d", 5, 3.0)]:
        queue.push(name, priority, arrival, num_tokens=10)
    assert drain(queue) == ["b", "d", "a", "c"]


def test_aging_lets_a_long_waiting_low_priority_request_overtake() -> None:
    queue: PriorityQueue[str] = PriorityQueue(aging_per_s=1.0)
    queue.push("old-low", 0, arrival_s=0.0, num_tokens=1)
    queue.push("new-high", 3, arrival_s=5.0, num_tokens=1)  # waited 5 s less than old-low
    queue.push("newer-high", 3, arrival_s=1.0, num_tokens=1)
    # old-low has waited 5 s longer than new-high: 0 + 5 > 3. newer-high: 3 + 4 > 0 + 5.
    assert drain(queue) == ["newer-high", "old-low", "new-high"]


def test_remove_and_counts() -> None:
    queue: PriorityQueue[str] = PriorityQueue(aging_per_s=1.0)
    queue.push("a", 0, 0.0, num_tokens=7)
    queue.push("b", 0, 1.0, num_tokens=5)
    assert (len(queue), queue.num_tokens) == (2, 12)
    assert queue.remove("a") and not queue.remove("a")
    assert (len(queue), queue.num_tokens) == (1, 5)
    assert queue.peek() == "b" and queue.items() == ["b"]
    assert drain(queue) == ["b"] and queue.peek() is None
