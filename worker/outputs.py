"""What the engine hands back: per-step deltas for streaming and whole results offline."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The logprob of one token, and the top-N alternatives at that position."""

    token_id: int
    #: log-softmax of the model's raw logits (before temperature and penalties).
    logprob: float
    #: The N most likely (token_id, logprob) at this position, most likely first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    #: Prompt tokens served from the prefix cache instead of being computed.
    num_cached_tokens: int = 0
