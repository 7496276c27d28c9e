"""`Engine`: the synchronous core. Add requests, abort them, and step.

Each `step()` schedules, runs the model once, samples, detokenizes, checks stops, and returns
one `RequestOutput` per request that made progress: the step's new tokens and text for each of
its samples (deltas, for streaming), and on the last one the finish reasons and usage.

The engine is single-threaded; `AsyncEngine` runs it on a thread of its own for servers, and
`LLM` drives it to completion for offline batches.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
from headrace.kernels import select_kernels
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InternalError, InvalidArgumentError
from headrace.sdk.outputs import TokenLogprob, Usage
from headrace.worker.config import EngineConfig
from headrace.worker.execution.executor import InFlightStep, start_executor
from headrace.worker.execution.model_runner import StepResult
from headrace.worker.models.registry import model_factory, read_model_type
from headrace.worker.models.store import resolve_model
from headrace.worker.sampling.detokenizer import Detokenizer
from headrace.worker.sampling.sampler import Sampler, compute_prompt_logprobs
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.scheduler import Scheduler, SchedulerOutput
from headrace.worker.sequence import FinishReason, Sequence, SequenceStatus
from transformers import AutoTokenizer, PreTrainedTokenizerBase
from transformers import GenerationConfig as HFGenerationConfig

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass(slots=True)
class SampleDelta:
    """What one sample of a request gained in one step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)
    #: Set on the sample's last delta.
    finish_reason: FinishReason | None = None


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
    #: Why the request failed (finish_reason "error"), on the last output.
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


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    config: GenerationConfig
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    #: Samples 1..n-1 wait here until sample 0 has computed the shared prompt.
    pending_siblings: list[Sequence]
    times: RequestTimes
    prompt_logprobs_sent: bool = False
    prompt_token_ids_sent: bool = False

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        self.config = config
        self.model_path: Path = resolve_model(config.model)
        model_factory(read_model_type(self.model_path))  # before transformers reads the type
        self.hf_config = AutoConfig.from_pretrained(self.model_path)
        self.device = config.torch_device()
        self.dtype = self._checkpoint_dtype()
        self.max_model_len = self._max_model_len()
        self.kernels = select_kernels(config.attention_backend, self.device)
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(self.model_path)
        self.eos_token_ids = self._eos_token_ids()
        self.executor = start_executor(
            config,
            self.model_path,
            self.dtype,
            self.device,
            self.kernels,
            self.max_model_len,
            self.hf_config,
        )
        self.runner = self.executor.runner
        self.model = self.runner.model
        self.vocab_size = self.model.vocab_size
        num_blocks = self.runner.num_blocks
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        self.detokenizer = Detokenizer(self.tokenizer)
        self._requests: dict[str, _Request] = {}
        #: The plan of the step whose outputs the last `step()` returned (benchmarks, metrics).
        self.last_step: SchedulerOutput | None = None
        #: Submitted steps not yet collected, oldest first (at most one per pipeline stage).
        self._in_flight: deque[InFlightStep] = deque()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        logger.info(
            "engine ready: model=%s dtype=%s device=%s kernels=%s kv_blocks=%d block_size=%d "
            "tp=%d pp=%d",
            self.model_path,
            self.dtype,
            self.device,
            self.kernels.NAME,
            num_blocks,
            config.block_size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
        )

    def close(self) -> None:
        """Stop the worker's other ranks (if any). The engine cannot step afterwards."""
        while self._in_flight:  # the ranks finish what they were given first
            self.executor.collect(self._in_flight.popleft())
        self.executor.close()

    # --- set-up -------------------------------------------------------------------------

    def _checkpoint_dtype(self) -> torch.dtype:
        checkpoint_dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = getattr(torch, checkpoint_dtype, None)
        return self.config.torch_dtype(checkpoint_dtype)

    def _max_model_len(self) -> int:
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        limit = self.config.max_model_len or model_max
        if limit > model_max:
            raise InvalidArgumentError(
                "max_model_len", f"{limit} exceeds the model's context of {model_max}"
            )
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < limit:
            raise InvalidArgumentError(
                "max_num_batched_tokens",
                f"without chunked prefill it must be >= max_model_len ({limit}) so every "
                "prompt fits one step",
            )
        return limit

    def _eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        try:
            generation = HFGenerationConfig.from_pretrained(self.model_path)
            eos = generation.eos_token_id
            ids.update([eos] if isinstance(eos, int) else (eos or []))
        except OSError:
            pass  # no generation_config.json
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # --- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        priority: int = 0,
    ) -> None:
        """Queue a request; bad input raises InvalidArgumentError and changes nothing."""
        config = GenerationConfig() if config is None else config
        if not isinstance(config, GenerationConfig):
            raise InvalidArgumentError("config", "must be a GenerationConfig")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id", "must be a non-empty string")
        if request_id in self._requests:
            raise InvalidArgumentError("request_id", f"{request_id!r} is already in use")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise InvalidArgumentError("priority", f"must be an integer, got {priority!r}")
        prompt_token_ids = self._prompt_token_ids(prompt)
        self._check_fits(prompt_token_ids)
        self._check_token_ids("config.stop_token_ids", list(config.stop_token_ids))
        request = self._new_request(request_id, prompt_token_ids, config, priority)
        self._requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def abort_request(
        self, request_id: str, error: HeadraceError | None = None
    ) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its last output (None if unknown).

        Without ``error`` the request ends as cancelled (finish reason "abort"); with one
        (a timeout, say) it ends as failed with that error.
        """
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        output = RequestOutput(request_id)
        if error is not None:
            request.seqs[0].error = error
        self._finish_all(
            request, FinishReason.ABORT if error is None else FinishReason.ERROR, output
        )
        self._finalize(request, output)
        return output

    def _finish_all(self, request: _Request, reason: FinishReason, output: RequestOutput) -> None:
        """End every unfinished sample of a request, each with a final empty delta."""
        for seq in request.seqs:
            if seq.is_finished:
                continue
            if seq in request.pending_siblings:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
            else:
                self.scheduler.finish(seq, reason)
            output.samples.append(SampleDelta(seq.sample_index, [], "", [], reason))

    def prompt_token_ids(self, request_id: str) -> list[int]:
        return self._requests[request_id].prompt_token_ids

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or steps not collected yet (which must be, in order)."""
        return bool(self._requests) or bool(self._in_flight)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def load(self) -> EngineLoad:
        num_running = num_queued_tokens = 0
        for request in self._requests.values():
            if any(seq.status == SequenceStatus.RUNNING for seq in request.seqs):
                num_running += 1
            else:
                leader = request.seqs[0]
                num_queued_tokens += max(0, leader.num_tokens - leader.num_computed_tokens)
        return EngineLoad(
            num_free_blocks=self.block_manager.num_free_blocks,
            num_total_blocks=self.block_manager.num_blocks,
            block_size=self.block_manager.block_size,
            num_running_requests=num_running,
            num_waiting_requests=len(self._requests) - num_running,
            num_queued_tokens=num_queued_tokens,
            num_prefix_hit_blocks=self.block_manager.num_prefix_hit_blocks,
            num_prefix_queried_blocks=self.block_manager.num_prefix_queried_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def _prompt_token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError("prompt", "must not be empty")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, list | tuple):
            raise InvalidArgumentError("prompt", "must be a string or a list of token ids")
        if not prompt:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        token_ids = list(prompt)
        self._check_token_ids("prompt_token_ids", token_ids)
        return token_ids

    def _check_token_ids(self, field_name: str, token_ids: list[int]) -> None:
        for i, token_id in enumerate(token_ids):
            if not isinstance(token_id, int) or isinstance(token_id, bool):
                raise InvalidArgumentError(field_name, f"[{i}] is not an integer: {token_id!r}")
            if not 0 <= token_id < self.vocab_size:
                raise InvalidArgumentError(
                    field_name,
                    f"[{i}] = {token_id} is outside the vocabulary [0, {self.vocab_size})",
                )

    def _check_fits(self, prompt_token_ids: list[int]) -> None:
        num_tokens = len(prompt_token_ids)
        if num_tokens + 1 > self.max_model_len:
            raise InvalidArgumentError(
                "prompt",
                f"has {num_tokens} tokens; the model's context is {self.max_model_len} and must "
                "hold the prompt plus at least one generated token",
            )
        num_blocks = self.block_manager.num_blocks_for(num_tokens + 1)
        if num_blocks > self.block_manager.num_blocks:
            raise InvalidArgumentError(
                "prompt",
                f"needs {num_blocks} KV blocks but the cache has {self.block_manager.num_blocks}",
            )

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], config: GenerationConfig, priority: int
    ) -> _Request:
        stop_ids = frozenset(config.stop_token_ids)
        if not config.ignore_eos:
            stop_ids |= self.eos_token_ids
        arrival = next(self._arrivals)
        seqs = [
            Sequence(
                seq_id=next(self._seq_ids),
                request_id=request_id,
                sample_index=i,
                config=config,
                token_ids=list(prompt_token_ids),
                num_prompt_tokens=len(prompt_token_ids),
                priority=priority,
                arrival=arrival,
                sample_seed=_sample_seed(config.seed, i),
                stop_token_ids=stop_ids,
                wants_prompt_logprobs=(i == 0 and config.prompt_logprobs is not None),
            )
            for i in range(config.n)
        ]
        for seq in seqs:
            seq.detok_state = self.detokenizer.new_state(prompt_token_ids, config)
        times = RequestTimes(arrival_s=time.monotonic())
        return _Request(request_id, config, prompt_token_ids, seqs, seqs[1:], times)

    # --- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that progressed.

        With pipeline stages, a call first submits steps until one per stage is in flight
        (each over sequences no other in-flight step holds), then collects the oldest, so
        stage 0 computes step k + 1 while later stages finish step k.
        """
        outputs: dict[str, RequestOutput] = {}
        self._submit_steps(outputs)
        if not self._in_flight:
            return self._collect(outputs)
        in_flight = self._in_flight.popleft()
        step = self.last_step = in_flight.step
        try:
            result = self.executor.collect(in_flight)
            sampled = (
                self.sampler(result.sample_logits, [c.seq for c in result.sample_chunks])
                if result.sample_logits is not None
                else None
            )
        except Exception as exc:  # a fault in the step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail_step(step, InternalError(f"engine step failed: {exc!r}"), outputs)
            return self._collect(outputs)
        self.scheduler.update_after_step(step)
        self._record_prompt_logprobs(result)
        if sampled is not None:
            for chunk, token_id, logprob in zip(
                result.sample_chunks, sampled.token_ids, sampled.logprobs, strict=True
            ):
                if not chunk.seq.is_finished:  # else aborted while its step was in flight
                    self._append_token(chunk.seq, token_id, logprob, outputs)
        return self._collect(outputs)

    def _submit_steps(self, outputs: dict[str, RequestOutput]) -> None:
        """Schedule and submit steps until one per pipeline stage is in flight."""
        depth = self.config.steps_in_flight
        while len(self._in_flight) < depth:
            busy = {c.seq.seq_id for s in self._in_flight for c in s.step.chunks}
            # Share the sequences among the steps in flight, so each stage has work.
            num_seqs = len(self.scheduler.running) + self.scheduler.num_waiting
            max_seqs = None if depth == 1 else max(1, -(-num_seqs // depth))
            step = self.scheduler.schedule(busy, max_seqs)
            for seq in step.out_of_blocks:
                text = self.detokenizer.finish(seq.detok_state)
                delta = SampleDelta(seq.sample_index, [], text, [], FinishReason.LENGTH)
                output = outputs.setdefault(seq.request_id, RequestOutput(seq.request_id))
                output.samples.append(delta)
            if not step.chunks:
                return
            self._mark_scheduled(step)
            try:
                self._in_flight.append(self.executor.submit(step))
            except Exception as exc:  # a fault in the step fails its requests, not the engine
                logger.exception("engine step failed")
                self._fail_step(step, InternalError(f"engine step failed: {exc!r}"), outputs)

    def _mark_scheduled(self, step: SchedulerOutput) -> None:
        now = time.monotonic()
        for chunk in step.chunks:
            if chunk.start < chunk.seq.num_prompt_tokens:  # a prompt chunk; decodes ran before
                times = self._requests[chunk.seq.request_id].times
                if times.first_scheduled_s is None:
                    times.first_scheduled_s = now

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        for span in result.prompt_spans:
            num_top = span.seq.config.prompt_logprobs or 0
            scored = compute_prompt_logprobs(span.logits, span.target_ids, num_top)
            del span.seq.prompt_logprobs[span.first_position :]
            span.seq.prompt_logprobs.extend(scored)

    def _append_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: TokenLogprob | None,
        outputs: dict[str, RequestOutput],
    ) -> None:
        request = self._requests[seq.request_id]
        if request.times.first_token_s is None:
            request.times.first_token_s = time.monotonic()
        if seq.num_output_tokens == 0 and request.pending_siblings:
            # The prompt's full blocks are now in the prefix cache: siblings reuse them.
            for sibling in request.pending_siblings:
                self.scheduler.add(sibling)
            request.pending_siblings = []
        seq.token_ids.append(token_id)
        delta = SampleDelta(seq.sample_index, [token_id], "")
        if logprob is not None:
            seq.logprobs.append(logprob)
            delta.logprobs.append(logprob)
        text = self.detokenizer.add_tokens(seq.detok_state, [token_id])
        delta.text = text.text
        reason = self._finish_reason(seq, token_id, text.stop_string is not None)
        if reason is not None:
            if text.stop_string is None:
                delta.text += self.detokenizer.finish(seq.detok_state)
            delta.finish_reason = reason
            self.scheduler.finish(seq, reason)
        output = outputs.get(seq.request_id)
        if output is None:
            output = outputs[seq.request_id] = RequestOutput(seq.request_id)
        output.samples.append(delta)

    def _finish_reason(
        self, seq: Sequence, token_id: int, hit_stop_string: bool
    ) -> FinishReason | None:
        num_output = seq.num_output_tokens
        if hit_stop_string:
            return FinishReason.STOP
        if token_id in seq.stop_token_ids and num_output >= seq.config.min_tokens:
            return FinishReason.STOP
        if num_output >= seq.config.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _collect(self, outputs: dict[str, RequestOutput]) -> list[RequestOutput]:
        for request_id, output in outputs.items():
            request = self._requests[request_id]
            if not request.prompt_token_ids_sent:
                output.prompt_token_ids = request.prompt_token_ids
                request.prompt_token_ids_sent = True
            self._attach_prompt_logprobs(request, output)
            if request.is_finished:
                del self._requests[request_id]
                self._finalize(request, output)
        return list(outputs.values())

    def _attach_prompt_logprobs(self, request: _Request, output: RequestOutput) -> None:
        leader = request.seqs[0]
        if not leader.wants_prompt_logprobs or request.prompt_logprobs_sent:
            return
        if len(leader.prompt_logprobs) >= leader.num_prompt_tokens - 1:
            output.prompt_logprobs = list(leader.prompt_logprobs)
            request.prompt_logprobs_sent = True

    def _finalize(self, request: _Request, output: RequestOutput) -> None:
        output.finished = True
        request.times.finished_s = time.monotonic()
        output.times = request.times
        output.usage = Usage(
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=sum(seq.num_output_tokens for seq in request.seqs),
            num_cached_tokens=request.seqs[0].num_cached_tokens,
        )
        errors = [seq.error for seq in request.seqs if seq.error is not None]
        if errors:
            output.error = errors[0] if isinstance(errors[0], HeadraceError) else None

    def _fail_step(
        self, step: SchedulerOutput, error: HeadraceError, outputs: dict[str, RequestOutput]
    ) -> None:
        for chunk in step.chunks:
            request = self._requests.get(chunk.seq.request_id)
            if request is None:
                continue
            output = outputs.setdefault(request.request_id, RequestOutput(request.request_id))
            request.seqs[0].error = error
            self._finish_all(request, FinishReason.ERROR, output)


def _sample_seed(seed: int | None, sample_index: int) -> int | None:
    """Sample 0 uses the request's seed as is, so n=1 and sample 0 of n agree."""
    if seed is None or sample_index == 0:
        return seed
    return hash((seed, sample_index)) & (2**63 - 1)
