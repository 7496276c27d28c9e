"""What a generation produces, as the SDK and the offline API both hand it to users.

`SampleDelta` is what one sample gained in one step; the engine emits them, and `StreamChunk`
(what `stream()` yields) is one with its request's fields added. `GenerationResult` folds
deltas into whole samples (what `generate()` returns, offline and over gRPC alike).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from headrace.sdk.errors import HeadraceError


class FinishReason(StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # failed; the request's error says why


@dataclass(slots=True)
class TokenLogprob:
    """The logprob of one token, and the top-N alternatives at that position."""

    token_id: int
    #: log-softmax of the model's raw logits (before temperature and penalties).
    logprob: float
    #: The N most likely (token_id, logprob) at this position, most likely first.
    top: list[tuple[int, float]] = field(default_factory=list)
    #: The token's text: the tokenizer's decode of it alone, special tokens kept; a token
    #: inside a character split across tokens reads "" and the one that completes it the whole
    #: character (as vLLM reads them). "" where the server did not name tokens.
    token: str = ""
    #: The UTF-8 bytes it adds to the text (a part of a character split across tokens is its
    #: raw bytes, so consecutive tokens' bytes join into the text).
    token_bytes: bytes = b""
    #: How many tokens at this position have a logprob at least its own (itself included;
    #: 1 = the most likely); 0 where not computed.
    rank: int = 0
    #: The (text, bytes) of each `top` entry, in its order; empty where not named.
    top_tokens: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(slots=True)
class Usage:
    num_prompt_tokens: int = 0
    #: Summed over samples.
    num_generated_tokens: int = 0
    #: Prompt tokens served from the prefix cache instead of being computed.
    num_cached_tokens: int = 0


@dataclass(slots=True)
class SampleDelta:
    """What one sample of a request gained in one step."""

    #: Which sample (0 .. n-1).
    index: int
    token_ids: list[int]
    text: str
    #: One per token, when config.logprobs was set.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Set on the sample's last delta.
    finish_reason: FinishReason | None = None
    #: Beam search (on the sample's one delta): the sum of its tokens' logprobs, and its
    #: score (that sum / generated tokens ** length_penalty; transformers' sequences_scores).
    cumulative_logprob: float | None = None
    beam_score: float | None = None


@dataclass(slots=True, kw_only=True)
class StreamChunk(SampleDelta):
    """One sample's delta as `stream()` yields it, with its request's fields."""

    request_id: str
    #: True on the request's last chunk.
    finished: bool = False
    #: On the request's last chunk.
    usage: Usage | None = None
    #: Once, when config.prompt_logprobs was set.
    prompt_logprobs: list[TokenLogprob] | None = None
    #: With prompt_logprobs: the prompt's first token (which has no logprob: 0, and no top),
    #: and the prompt as the tokenizer decodes it (special tokens kept).
    first_prompt_token: TokenLogprob | None = None
    prompt_text: str | None = None
    #: The version of the weights that produced this chunk.
    weight_version: str = ""


@dataclass(slots=True)
class Completion:
    """One sample's whole output."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    #: Per generated token, when config.logprobs was set.
    logprobs: list[TokenLogprob] | None = None
    #: Beam search: the beam's cumulative logprob and score (see `SampleDelta`).
    cumulative_logprob: float | None = None
    beam_score: float | None = None


@dataclass(slots=True)
class GenerationResult:
    """One prompt's result; token_ids / text / finish_reason / logprobs are sample 0's."""

    request_id: str
    #: The prompt as tokens (empty where the server did not say, as over gRPC).
    prompt_token_ids: list[int]
    outputs: list[Completion]
    usage: Usage = field(default_factory=Usage)
    prompt_logprobs: list[TokenLogprob] | None = None
    #: With prompt_logprobs: the prompt's first token and the prompt's text (see `StreamChunk`).
    first_prompt_token: TokenLogprob | None = None
    prompt_text: str | None = None
    error: HeadraceError | None = None
    #: The version of the weights that produced its last chunk (a request kept through a
    #: weight update shows the new one; each streamed chunk carries its own).
    weight_version: str = ""

    @classmethod
    def empty(
        cls, request_id: str, n: int, with_logprobs: bool, prompt_token_ids: list[int] | None = None
    ) -> GenerationResult:
        completions = [Completion(k, logprobs=[] if with_logprobs else None) for k in range(n)]
        return cls(request_id, prompt_token_ids or [], completions)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    def add(self, delta: SampleDelta) -> None:
        """Append one step's progress of sample ``delta.index``."""
        completion = self.outputs[delta.index]
        completion.token_ids.extend(delta.token_ids)
        completion.text += delta.text
        if completion.logprobs is not None:
            completion.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            completion.finish_reason = delta.finish_reason
        if delta.beam_score is not None:
            completion.cumulative_logprob = delta.cumulative_logprob
            completion.beam_score = delta.beam_score

    def update(
        self,
        prompt_logprobs: list[TokenLogprob] | None = None,
        usage: Usage | None = None,
        error: HeadraceError | None = None,
        weight_version: str = "",
        first_prompt_token: TokenLogprob | None = None,
        prompt_text: str | None = None,
    ) -> None:
        """Record the request-level fields a step delivered (None / "": not in this step)."""
        if weight_version:
            self.weight_version = weight_version
        if prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs
        if first_prompt_token is not None:
            self.first_prompt_token = first_prompt_token
        if prompt_text is not None:
            self.prompt_text = prompt_text
        if usage is not None:
            self.usage = usage
        if error is not None:
            self.error = error

    def add_chunk(self, chunk: StreamChunk) -> None:
        self.add(chunk)
        self.update(
            chunk.prompt_logprobs,
            chunk.usage,
            weight_version=chunk.weight_version,
            first_prompt_token=chunk.first_prompt_token,
            prompt_text=chunk.prompt_text,
        )
