"""What the engine hands back: per-step request outputs, phase times, and its load."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from headrace.sdk.errors import HeadraceError
from headrace.sdk.outputs import SampleDelta, TokenLogprob, Usage
from headrace.sdk.weights import GenerationState
from headrace.worker.engine.speculation import SpeculationStats
from headrace.worker.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from headrace.worker.engine.generation_control import GenerationControl
    from headrace.worker.scheduling.block_manager import BlockManager
    from headrace.worker.scheduling.output import SchedulerOutput
    from headrace.worker.scheduling.scheduler import Scheduler


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
    #: With prompt_logprobs: the prompt's first token, named (it has no logprob: 0), and the
    #: prompt as the tokenizer decodes it (special tokens kept).
    first_prompt_token: TokenLogprob | None = None
    prompt_text: str | None = None
    #: On the last output.
    usage: Usage | None = None
    #: Why the request failed (finish reason "error"), on the last output.
    error: HeadraceError | None = None
    #: The prompt as token ids, on the request's first output from a step.
    prompt_token_ids: list[int] | None = None
    #: On the last output.
    times: RequestTimes | None = None
    #: The version of the weights that produced this output.
    weight_version: str = ""


@dataclass(slots=True)
class StepStats:
    """Engine steps since the engine started, and their wall time (`Engine.step` calls that
    finished one), by kind: steps that computed prompt tokens (alone or beside decodes) and
    steps of decodes alone. Their time over wall time is how busy the engine is; at a
    request rate, a prompt's time to first token is about the rest of the step in progress
    plus one prompt step (docs/observability.md)."""

    num_prompt_steps: int = 0
    num_decode_steps: int = 0
    prompt_step_s: float = 0.0
    decode_step_s: float = 0.0
    #: Tokens the steps computed: of prompts, and the rest (decodes, a multi-step decode's
    #: every run, proposals checked).
    num_prompt_tokens: int = 0
    num_decode_tokens: int = 0

    def record(self, step: SchedulerOutput, seconds: float) -> None:
        num_prompt_tokens = sum(c.num_new_tokens for c in step.chunks if c.computes_prompt)
        self.num_prompt_tokens += num_prompt_tokens
        num_later_runs = sum(c.num_decode_steps - 1 for c in step.chunks)
        self.num_decode_tokens += step.num_batched_tokens - num_prompt_tokens + num_later_runs
        if num_prompt_tokens:
            self.num_prompt_steps += 1
            self.prompt_step_s += seconds
        else:
            self.num_decode_steps += 1
            self.decode_step_s += seconds

    def snapshot(self) -> StepStats:
        """A copy that later steps do not change (load reports, metrics)."""
        return replace(self)


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
    #: The version of the weights it serves, and whether it generates (see control.py).
    weight_version: str = ""
    state: GenerationState = GenerationState.SERVING
    #: Its first rank in a trainer's weights group (0: it joined none).
    rank_offset: int = 0
    #: Speculative decoding's proposals made and kept so far (a copy).
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    #: Steps run and their time so far (a copy).
    steps: StepStats = field(default_factory=StepStats)

    @classmethod
    def measure(
        cls,
        requests: Seq[list[Sequence]],
        block_manager: BlockManager,
        scheduler: Scheduler,
        control: GenerationControl,
        speculation: SpeculationStats | None = None,
        steps: StepStats | None = None,
    ) -> EngineLoad:
        """The load of an engine holding ``requests`` (each request's sequences)."""
        num_running = num_queued_tokens = 0
        for seqs in requests:
            if any(seq.status == SequenceStatus.RUNNING for seq in seqs):
                num_running += 1
            else:
                num_queued_tokens += max(0, seqs[0].num_tokens - seqs[0].num_computed_tokens)
        return cls(
            num_free_blocks=block_manager.num_free_blocks,
            num_total_blocks=block_manager.num_blocks,
            block_size=block_manager.block_size,
            num_running_requests=num_running,
            num_waiting_requests=len(requests) - num_running,
            num_queued_tokens=num_queued_tokens,
            num_prefix_hit_blocks=block_manager.num_prefix_hit_blocks,
            num_prefix_queried_blocks=block_manager.num_prefix_queried_blocks,
            num_preemptions=scheduler.num_preemptions,
            weight_version=control.weight_version,
            state=control.state,
            rank_offset=control.rank_offset,
            speculation=speculation or SpeculationStats(),
            steps=steps or StepStats(),
        )
