"""What the engine hands back: per-step request outputs, phase times, and its load."""

from __future__ import annotations

from dataclasses import dataclass, field

from headrace.sdk.errors import HeadraceError
from headrace.sdk.outputs import SampleDelta, TokenLogprob, Usage


@dataclass(slots=True)
class RequestTimes:
    """When a request reached each phase, in `time.monotonic()` seconds (metrics, traces)."""

    arrival_s: float
    #: Its first step began: the end of its time in the queue.
    first_scheduled_s: float | None = None
    #: Its first token was sampled: the end of prefill.
    first_token_s: float | None = None
    finished_s: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step (a streaming delta)."""

    request_id: str
    samples: list[SampleDelta] = field(default_factory=list)
    #: True on the request's last output: every sample has finished.
    finished: bool = False
    #: Logprob of each prompt token after the first, once the prompt is fully scored.
    prompt_logprobs: list[TokenLogprob] | None = None
    #: On the last output.
    usage: Usage | None = None
    #: Why the request failed (finish reason "error"), on the last output.
    error: HeadraceError | None = None
    #: The prompt as token ids, on the request's first output from a step.
    prompt_token_ids: list[int] | None = None
    #: On the last output.
    times: RequestTimes | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """A snapshot of how busy the engine is (for load reports and routing)."""

    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    #: Requests with a sequence scheduled to run (prefilling or decoding).
    num_running_requests: int
    #: Requests none of whose sequences is running (new, or all preempted).
    num_waiting_requests: int
    #: Prompt tokens of waiting requests not yet computed.
    num_queued_tokens: int
    num_prefix_hit_blocks: int
    #: Full prompt blocks looked up in the prefix cache (the hit rate's denominator).
    num_prefix_queried_blocks: int
    #: Sequences preempted (blocks freed, recomputed later) over the engine's life.
    num_preemptions: int
