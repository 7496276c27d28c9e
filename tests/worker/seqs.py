"""A factory for engine-free Sequence objects, for scheduler and block manager tests."""

from __future__ import annotations

import itertools

from headrace.sdk.config import GenerationConfig
from headrace.worker.sequence import Sequence

_ids = itertools.count()


def make_seq(
    token_ids: list[int] | int,
    *,
    priority: int = 0,
    arrival: int | None = None,
    config: GenerationConfig | None = None,
) -> Sequence:
    """A fresh waiting sequence; an int token_ids means that many tokens no other has."""
    seq_id = next(_ids)
    if isinstance(token_ids, int):
        tokens = [seq_id * 10_000 + i for i in range(token_ids)]
    else:
        tokens = list(token_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        sample_index=0,
        config=config or GenerationConfig(),
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        priority=priority,
        arrival=seq_id if arrival is None else arrival,
        sample_seed=None,
        stop_token_ids=frozenset(),
    )
