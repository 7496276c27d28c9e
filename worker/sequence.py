"""One sample of one request as the engine tracks it, from admission to finish.

The record every part of the worker reads (scheduler, block pool, runner, sampler). Its
`status` and `finish_reason` have one writer, the scheduler; everyone else asks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, Any

from headrace.sdk.config import GenerationConfig
from headrace.sdk.outputs import FinishReason

if TYPE_CHECKING:
    from headrace.sdk.outputs import TokenLogprob
    from headrace.worker.sampling.controls import RowControls

__all__ = [
    "FinishReason",
    "Sequence",
    "SequenceStatus",
    "has_penalty",
    "is_plain",
    "is_plain_greedy",
]


class SequenceStatus(IntEnum):
    """Ordered so that `Sequence.is_finished` is one comparison."""

    NEW = 0  # made, not given to the scheduler yet (samples 1..n-1 wait for sample 0)
    WAITING = 1  # queued, or preempted and waiting to be recomputed
    HELD = 2  # held while waiting (its reader fell behind): out of the queue until released
    RUNNING = 3
    FINISHED = 4


#: `Sequence.is_finished`'s bound, read as a module global: an enum member looked up on its
#: class costs ~80 ns on Python 3.11, and the engine asks each sequence several times a step.
_FINISHED = SequenceStatus.FINISHED


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    #: Which of the request's n samples this is.
    sample_index: int
    config: GenerationConfig
    #: The prompt followed by every generated token.
    token_ids: list[int]
    num_prompt_tokens: int
    #: Higher runs sooner.
    priority: int
    #: Engine-wide admission counter: lower arrived earlier.
    arrival: int
    #: The seed this sample draws from (derived from config.seed and sample_index), or None.
    sample_seed: int | None
    #: Token ids that end this sample: the model's EOS (unless ignore_eos) and stop_token_ids.
    stop_token_ids: frozenset[int]
    #: When the request arrived (time.monotonic()); the shortest-first policy orders by it.
    arrival_s: float = 0.0
    #: The LoRA adapter the sample runs with; None for the base model.
    adapter: str | None = None
    #: The adapter's load number (unique per load, 0 for the base model): the prefix cache
    #: keys on it, so no two adapters, nor two loads of one name, share KV.
    lora_id: int = 0
    status: SequenceStatus = SequenceStatus.NEW
    #: Tokens whose K/V are in the cache (or were served from the prefix cache).
    num_computed_tokens: int = 0
    #: Prompt tokens served from the prefix cache at first admission (for usage reporting).
    num_cached_tokens: int = 0
    #: KV blocks holding this sequence's tokens, in order.
    block_ids: list[int] = field(default_factory=list)
    #: The first blocks of block_ids that a sliding window has passed: no longer held, their
    #: ids left in place (stale) so that token i stays in block_ids[i // block_size].
    num_dropped_blocks: int = 0
    #: Hash of each full block of token_ids in order (prefix-cache chain).
    block_hashes: list[int] = field(default_factory=list)
    #: The prefix cache's epoch its hashes (and its KV) belong to (see `BlockManager.reset`).
    hash_epoch: int = 0
    #: Times this sequence was preempted (its blocks freed, to be recomputed).
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: Exception | None = None
    #: Logprobs of generated tokens, when config.logprobs is set.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Sample 0 of a request with config.prompt_logprobs scores the prompt for all samples.
    wants_prompt_logprobs: bool = False
    #: Logprob of prompt token k + 1 at index k, filled as prefill chunks run.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Per-sequence detokenizer state (owned by the detokenizer).
    detok_state: Any = None
    #: Logit bias, allowed ids, bad words and output constraint, if the config has any.
    controls: RowControls | None = None
    #: Speculative decoding: steps in a row whose proposals were all rejected, and steps
    #: left before it proposes again (the scheduler's backoff, `Scheduler._propose`).
    speculation_misses: int = 0
    speculation_backoff: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= _FINISHED


def is_plain_greedy(seq: Sequence) -> bool:
    """Whether the row's token is the argmax of its raw logits: greedy, with nothing that
    reads or changes the logits first (penalties, bans, logprobs, logit controls: a bias,
    allowed ids, bad words, an output constraint). A step whose rows are all plain greedy can
    take its tokens from the model's greedy head and skip the sampler."""
    return seq.config.is_greedy and is_plain(seq)


def is_plain(seq: Sequence) -> bool:
    """Whether the row's token depends on its logits and its position alone: greedy, or drawn
    by temperature, top-k, top-p and min-p, but nothing that reads the sequence's history or
    changes the logits (as `is_plain_greedy`). Such a sequence may speculate: each proposal
    is checked against the token the row would pick at its position."""
    config = seq.config
    return (
        config.num_beams == 1
        and seq.controls is None
        and config.logprobs is None
        and not has_penalty(config)
        and not config.no_repeat_ngram_size
        and not (config.min_tokens > seq.num_output_tokens and seq.stop_token_ids)
    )


def has_penalty(config: GenerationConfig) -> bool:
    return (
        config.repetition_penalty != 1.0
        or config.presence_penalty != 0.0
        or config.frequency_penalty != 0.0
    )
