"""Proposers for speculative decoding: tokens a sequence is likely to produce next.

A proposer reads a sequence's tokens and guesses up to k that follow; the engine verifies the
guesses in one step (`Scheduler` schedules them as part of the sequence's decode chunk) and
keeps the longest prefix the model agrees with. A proposal that is wrong costs that step's
extra rows, never a wrong token. `Proposer` is the interface; draft models and EAGLE / MTP
heads can implement it later (they would also need rows of their own in the step).

`NgramProposer` is prompt lookup (vLLM's and TGI's n-gram speculation): the last n tokens are
searched for earlier in the prompt and output, longest n first, and the tokens that followed
the latest earlier match are proposed. It pays when outputs copy from their context
(summaries, code edits, extraction, "repeat this with one change") and finds nothing in free
text, where it must cost nothing: the search is a few list scans over the sequence's tail.
"""

from __future__ import annotations

from typing import Protocol


class Proposer(Protocol):
    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens likely to follow ``token_ids`` (none: no guess)."""
        ...


class NgramProposer:
    """Prompt lookup over the sequence's own tokens (module docstring)."""

    def __init__(self, min_n: int, max_n: int, max_lookback: int = 4096) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        #: Only the last max_lookback tokens are searched (a long context costs a bounded scan).
        self.max_lookback = max_lookback

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        if max_tokens <= 0 or len(token_ids) < 2:
            return []
        window = token_ids[-self.max_lookback :]
        last, end = window[-1], len(window) - 1
        # Earlier positions of the last token, found by C-level scans (list.index).
        ends: list[int] = []
        position = -1
        while True:
            try:
                position = window.index(last, position + 1, end)
            except ValueError:
                break
            ends.append(position)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            suffix = window[-n:]
            for p in reversed(ends):  # the latest earlier match of the n-gram wins
                if p + 1 >= n and window[p + 1 - n : p + 1] == suffix:
                    return window[p + 1 : p + 1 + max_tokens]
        return []
