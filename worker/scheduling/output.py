"""The scheduler's contracts: what one engine step runs, and what it sampled.

Both sides import this module and never each other: the scheduler fills a `SchedulerOutput`,
the runner (and the ranks' step plans) read it; after the step, the engine hands the
scheduler one `SampledToken` per sampling row (`Scheduler.update_from_output`). Plain data, no
tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace.sdk.outputs import TokenLogprob
from headrace.worker.sequence import Sequence


@dataclass(slots=True)
class ScheduledChunk:
    """Run tokens [start, start + num_new_tokens) of seq this step."""

    seq: Sequence
    #: Position of the first new token (the sequence's computed-token count before the step).
    start: int
    num_new_tokens: int
    #: The chunk reaches the sequence's newest token, so the step samples its successor.
    samples: bool
    #: Speculative decoding: tokens proposed to follow the newest one, run after it in this
    #: chunk (num_new_tokens counts them) so the step can check each (`proposals.py`).
    draft_token_ids: list[int] = field(default_factory=list)
    #: Multi-step decode (`EngineConfig.num_decode_steps`): a one-row decode runs this many
    #: times in the step, each run's greedy token the next one's input; its blocks hold the
    #: KV of them all.
    num_decode_steps: int = 1

    @property
    def num_tokens_run(self) -> int:
        """Tokens the model runs for the chunk (KV it writes): its new tokens, and a
        multi-step decode's later runs."""
        return self.num_new_tokens + self.num_decode_steps - 1

    @property
    def appends_several(self) -> bool:
        """The step may append more than one token to the sequence (it speculates, or
        decodes several steps), so how far its KV counts is settled by what was kept."""
        return bool(self.draft_token_ids) or self.num_decode_steps > 1

    @property
    def computes_prompt(self) -> bool:
        """The chunk computes prompt tokens (a prefill chunk; decodes start past the prompt)."""
        return self.start < self.seq.num_prompt_tokens


@dataclass(slots=True)
class SchedulerOutput:
    """The whole scheduler -> model runner contract for one step."""

    #: Single-token chunks first (decodes), then multi-token prefill chunks.
    chunks: list[ScheduledChunk]
    #: How many leading chunks have exactly one new token.
    num_decode_seqs: int
    num_batched_tokens: int
    #: Sequences preempted while building this step (already back in the waiting queue).
    preempted: list[Sequence] = field(default_factory=list)
    #: Sequences that outgrew the whole KV pool: finished with reason LENGTH, blocks freed.
    out_of_blocks: list[Sequence] = field(default_factory=list)
    #: (source, destination) KV block copies to run before the forward pass: the
    #: copy-on-write of blocks that forked beams share (see `BlockManager.fork`).
    block_copies: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class SampledToken:
    """The token a step drew for one live sequence, and what the detokenizer made of it."""

    seq: Sequence
    token_id: int
    #: Its logprob (and top alternatives), when the sequence's config asks for logprobs.
    logprob: TokenLogprob | None
    #: The text the token adds to the output (cut before a stop string it completed).
    text: str
    #: The token completed a stop string.
    hit_stop_string: bool
