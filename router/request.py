"""`RoutedRequest`: one client request as the router tracks it, across failovers.

The router asks every worker for the prompt's token ids on the first chunk and remembers
every token it streamed to the client. If the worker dies, the request is resumed elsewhere
as ``prompt_token_ids + streamed tokens`` with the remaining budget and the same seed: a
seeded sample's draws depend only on (seed, position), so the client sees one unbroken
stream; `num_resumed_tokens` tells the worker how many prompt tokens were generated, so it
advances an output constraint (JSON schema, regex, ...) over them. A beam search streams
nothing before it ends, so it restarts whole from its original prompt (nothing resumed), even
with several beams returned (other requests with n > 1 are not resumed). Chunks are
rewritten on the way back so the client never notices: its own request id, its own prompt
length in the usage, generated tokens counted across workers.

Its state changes only through its own methods, each named for the event it records: the
worker link calls `dispatched_to` and `left_worker`, `to_client` records what streams, and
the router calls the rest. `for_worker` only reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from headrace.protos import generation_pb2 as pb
from headrace.sdk import streams, tracing
from headrace.sdk.errors import DeadlineExceededError
from headrace.sdk.outputs import Usage
from headrace.sdk.streams import ResponseQueue
from headrace.sdk.telemetry import RequestTelemetry
from headrace.sdk.wire import ParsedRequest

if TYPE_CHECKING:
    from headrace.router.workers import WorkerLink


@dataclass(eq=False, slots=True)
class RoutedRequest:
    #: The id the client chose (unique on its stream).
    client_id: str
    #: Where the client's chunks go: a session's outbox.
    outbox: ResponseQueue[list[pb.Chunk]]
    #: The request as the client sent it.
    original: pb.Request
    parsed: ParsedRequest
    #: Queue accounting: prompt tokens (text counts one per 4 characters).
    num_tokens_estimate: int
    #: What prefix-affinity hashes.
    affinity_key: bytes
    #: Its span (the parent of each worker's), latency clock and log line.
    telemetry: RequestTelemetry
    #: The id on the current worker's stream (unique per router).
    wire_id: str = ""
    worker: WorkerLink | None = None
    #: From the first chunk of the first worker.
    prompt_token_ids: list[int] | None = None
    #: Sample 0's tokens streamed to the client so far.
    streamed_token_ids: list[int] = field(default_factory=list)
    #: Tokens of all samples streamed to the client so far.
    num_streamed_tokens: int = 0
    #: Tokens streamed before the current worker took over (for usage).
    num_tokens_before_dispatch: int = 0
    prompt_logprobs_sent: bool = False
    num_failovers: int = 0
    #: The client cancelled it (its last chunk, from the worker or the router, is to come).
    cancelled: bool = False
    #: Over: nothing more is routed for it.
    done: bool = False
    #: Held for its slow reader: a worker it (re)starts on is told so at once.
    held: bool = False
    #: Its own timeout (None: it has none, or has not started it).
    _timer: asyncio.TimerHandle | None = field(default=None, init=False, repr=False)
    #: When it first went to a worker (monotonic); 0 while it has not.
    first_dispatch_s: float = 0.0
    #: The weight version of the last tokens it streamed ("" before any).
    weight_version: str = ""
    #: Set while it fails over: the version the next worker must serve, so its tokens never
    #: come from two versions of the weights (cleared by that worker's first chunk).
    required_version: str = ""

    @property
    def arrival_s(self) -> float:
        """Monotonic arrival time; kept across failovers so a resumed request keeps its place."""
        return self.telemetry.clock.arrival_s

    def usage(self) -> Usage:
        """What the client got so far, as the router saw it."""
        num_prompt_tokens = len(self.prompt_token_ids) if self.prompt_token_ids else 0
        return Usage(num_prompt_tokens, self.num_streamed_tokens)

    @property
    def remaining_tokens(self) -> int:
        return self.parsed.config.max_tokens - len(self.streamed_token_ids)

    # --- events in its life -----------------------------------------------------------------

    def start_timeout(self, expire: Callable[[DeadlineExceededError], object]) -> None:
        """Its own timeout (if it has one) calls ``expire`` when it passes first."""
        self._timer = streams.start_timeout(self.parsed.timeout_s, expire)

    def dispatched_to(self, worker: WorkerLink, wire_id: str) -> None:
        """A worker took it over, as ``wire_id`` on its stream (see `for_worker`)."""
        self.worker = worker
        self.wire_id = wire_id
        self.num_tokens_before_dispatch = len(self.streamed_token_ids)
        if not self.first_dispatch_s:
            self.first_dispatch_s = time.monotonic()

    def left_worker(self) -> None:
        """Its worker went down: nothing of it runs anywhere until it is dispatched again."""
        self.worker = None

    def fail_over(self) -> None:
        """It goes back to the queue to resume elsewhere, on the weights that produced its
        tokens so far (any, if it streamed none)."""
        self.required_version = self.weight_version if self.streamed_token_ids else ""
        self.num_failovers += 1

    def hold(self) -> None:
        """Held for its slow reader, on every worker it runs on until `release`."""
        self.held = True

    def release(self) -> None:
        self.held = False

    def mark_cancelled(self) -> None:
        self.cancelled = True

    def end(self) -> None:
        """It is over: its timeout stops, and nothing more is routed for it."""
        self.done = True
        if self._timer is not None:
            self._timer.cancel()

    # --- what goes to the worker and back to the client --------------------------------------

    def is_from_other_weights(self, chunk: pb.Chunk) -> bool:
        """A chunk after a failover from weights other than those of its tokens so far (its
        new worker was updated since the report that chose it)."""
        version = chunk.weight_version
        return bool(self.required_version and version and version != self.required_version)

    def for_worker(self, wire_id: str) -> pb.Request:
        """The request to send to a worker now: the original, or its resumption."""
        request = pb.Request()
        request.CopyFrom(self.original)
        request.request_id = wire_id
        request.return_prompt_token_ids = True
        request.ClearField("timeout")  # the router enforces the client's timeout itself
        request.trace_context.clear()
        request.trace_context.update(tracing.carrier(self.telemetry.span))
        if self.prompt_token_ids is None or not self.streamed_token_ids:
            return request
        request.ClearField("prompt")  # text, token ids or chat: resumed as token ids
        request.token_ids.ids[:] = self.prompt_token_ids + self.streamed_token_ids
        # The worker advances the request's constraint over the tokens streamed already.
        request.num_resumed_tokens = len(self.streamed_token_ids)
        config = request.config
        config.max_tokens = self.remaining_tokens
        if config.HasField("min_tokens"):
            config.min_tokens = max(0, config.min_tokens - len(self.streamed_token_ids))
        if self.prompt_logprobs_sent:
            config.ClearField("prompt_logprobs")
        return request

    def to_client(self, chunk: pb.Chunk) -> pb.Chunk:
        """Rewrite a worker's chunk for the client, recording what it streams (a chunk
        `is_from_other_weights` never comes here)."""
        if chunk.prompt_token_ids and self.prompt_token_ids is None:
            self.prompt_token_ids = list(chunk.prompt_token_ids)
        if not self.original.return_prompt_token_ids or self.num_failovers:
            chunk.ClearField("prompt_token_ids")
        if chunk.weight_version:
            self.required_version = ""  # resumed on the same weights
        if chunk.token_ids and chunk.weight_version:
            self.weight_version = chunk.weight_version
        if chunk.index == 0:
            self.streamed_token_ids.extend(chunk.token_ids)
        self.num_streamed_tokens += len(chunk.token_ids)
        if chunk.prompt_logprobs:
            self.prompt_logprobs_sent = True
        if chunk.HasField("usage"):
            usage = chunk.usage
            if self.prompt_token_ids is not None:
                usage.prompt_tokens = len(self.prompt_token_ids)
            usage.generated_tokens += self.num_tokens_before_dispatch
        chunk.request_id = self.client_id
        return chunk
