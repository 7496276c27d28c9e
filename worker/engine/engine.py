"""`Engine`: the synchronous core. Add requests, abort them, and step.

Each `step()` schedules, runs the model once, samples, detokenizes, checks stops, and returns
one `RequestOutput` per request that made progress: the step's new tokens and text for each of
its samples (deltas, for streaming), and on the last one the finish reasons and usage.

The engine is single-threaded; `AsyncEngine` runs it on a thread of its own for servers, and
`LLM` drives it to completion for offline batches. Who writes what: the scheduler alone sets
a sequence's status and finish reason (`Scheduler.finish`); the engine appends sampled tokens
and reports. Between steps it takes control calls (pause, new weights, sleep), whose state
`GenerationControl` owns; every output carries the weight version that produced it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from headrace.kernels import select_kernels
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InternalError, InvalidArgumentError
from headrace.sdk.outputs import FinishReason, SampleDelta, TokenLogprob, Usage
from headrace.sdk.prompts import Prompt
from headrace.sdk.weights import PauseMode
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.weight_sync import WeightGroupSpec, WeightSource
from headrace.worker.engine.adapters import Adapters
from headrace.worker.engine.beams import BeamRequests, pick
from headrace.worker.engine.control import GenerationControl
from headrace.worker.engine.intake import EngineRequest, RequestIntake
from headrace.worker.engine.model_spec import ModelSpec
from headrace.worker.engine.outputs import EngineLoad, RequestOutput
from headrace.worker.execution.executor import InFlightStep, start_executor
from headrace.worker.sampling.detokenizer import Detokenizer
from headrace.worker.sampling.sampler import Sampler
from headrace.worker.scheduling.stops import finish_reason
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.output import SchedulerOutput
from headrace.worker.scheduling.scheduler import Scheduler
from headrace.worker.sequence import Sequence
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: One step's outputs as they are gathered, by request id.
Outputs = dict[str, RequestOutput]


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = ModelSpec.load(config)
        self.device = config.torch_device()
        self.kernels = select_kernels(config.attention_backend, self.device)
        spec = self.spec
        self.executor = start_executor(
            config,
            spec.path,
            spec.dtype,
            self.device,
            self.kernels,
            spec.max_model_len,
            spec.hf_config,
        )
        self.runner = self.executor.runner
        self.vocab_size = self.runner.model.vocab_size
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.control = GenerationControl(
            self.spec, self.executor, self.block_manager, config.weight_version
        )
        self.sampler = Sampler(self.vocab_size, seed=config.seed)
        self.detokenizer = Detokenizer(self.spec.tokenizer)
        self.intake = RequestIntake(
            self.spec, self.vocab_size, self.block_manager, self.detokenizer
        )
        self.beam_requests = BeamRequests(self.scheduler, self.detokenizer, self.intake.new_seq_id)
        self._requests: dict[str, EngineRequest] = {}
        #: The plan of the step whose outputs the last `step()` returned (benchmarks, metrics).
        self.last_step: SchedulerOutput | None = None
        #: Submitted steps not yet collected, oldest first (at most one per pipeline stage).
        self._in_flight: deque[InFlightStep] = deque()
        self.adapters = Adapters(self.executor, self._requests, self._in_flight)  # LoRA
        logger.info(
            "engine ready: model=%s dtype=%s device=%s kernels=%s kv_blocks=%d block_size=%d "
            "tp=%d pp=%d",
            self.spec.path,
            self.spec.dtype,
            self.device,
            self.kernels.NAME,
            self.block_manager.num_blocks,
            config.block_size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
        )

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.spec.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.spec.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.spec.eos_token_ids

    def on_fatal(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` just before a fault the worker cannot survive (a rank of
        a parallel worker died) ends the process."""
        self.executor.on_failure(callback)

    def close(self) -> None:
        """Stop the worker's other ranks (if any). The engine cannot step afterwards."""
        while self._in_flight:  # the ranks finish what they were given first
            self.executor.collect(self._in_flight.popleft())
        self.executor.close()

    # --- requests -----------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        config: GenerationConfig | None = None,
        priority: int = 0,
        adapter: str | None = None,
        num_resumed_tokens: int = 0,
    ) -> None:
        """Queue a request (``adapter``: a LoRA adapter's name); bad input raises."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id", "must be a non-empty string")
        if request_id in self._requests:
            raise InvalidArgumentError("request_id", f"{request_id!r} is already in use")
        self.control.check_admission()
        lora = self.adapters.resolve(adapter)
        config = config or GenerationConfig()  # num_resumed_tokens: see RequestIntake.build
        request = self.intake.build(request_id, prompt, config, priority, lora, num_resumed_tokens)
        self._requests[request_id] = request
        self.control.admit(request_id, request.seqs[0], self.scheduler)

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
        self.control.withdraw(request_id)
        output = RequestOutput(request_id, weight_version=self.control.weight_version)
        if error is not None:
            request.seqs[0].error = error
        self._finish_all(
            request, FinishReason.ABORT if error is None else FinishReason.ERROR, output
        )
        self._finalize(request, output)
        return output

    def _finish_all(
        self, request: EngineRequest, reason: FinishReason, output: RequestOutput
    ) -> None:
        """End every unfinished sample of a request, each with a final empty delta."""
        if request.beams is not None:
            output.samples.extend(self.beam_requests.end(request, reason))
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason)
                output.samples.append(SampleDelta(seq.sample_index, [], "", [], reason))

    def hold_request(self, request_id: str) -> None:
        """Generate nothing for the request until `release_request` (its reader fell behind);
        unknown ids are ignored."""
        request = self._requests.get(request_id)
        for seq in request.seqs if request is not None else ():
            self.scheduler.hold(seq)

    def release_request(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        for seq in request.seqs if request is not None else ():
            self.scheduler.release(seq)

    def prompt_token_ids(self, request_id: str) -> list[int]:
        return self._requests[request_id].prompt_token_ids

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or steps not collected yet (which must be, in order)."""
        return bool(self._requests) or bool(self._in_flight)

    def has_runnable_work(self) -> bool:
        """Whether `step()` would do anything: held requests alone leave nothing to run."""
        runnable = self.control.may_schedule and self.scheduler.has_runnable_work()
        return bool(self._in_flight) or runnable

    def load(self) -> EngineLoad:
        seqs = [request.seqs for request in self._requests.values()]
        return EngineLoad.measure(seqs, self.block_manager, self.scheduler, self.control)

    # --- generation control (between steps: `settle` first) ----------------------------

    def settle(self) -> list[RequestOutput]:
        """Collect every step in flight and submit none; the outputs of those steps."""
        outputs: Outputs = {}
        while self._in_flight:
            self._collect_oldest(outputs)
        return self._collect(outputs)

    def pause_generation(self, mode: PauseMode) -> list[RequestOutput]:
        """Pause (see `GenerationControl`); ABORT returns every request's last output."""
        self._require_settled()
        self.control.pause(mode)
        return self._abort_all() if mode == PauseMode.ABORT else []

    def resume_generation(self) -> None:
        self.control.resume(self.scheduler)

    def update_weights(
        self, source: WeightSource, version: str, validate_only: bool = False
    ) -> None:
        """New weights on every rank; a bad update raises InvalidArgumentError, copying nothing."""
        if validate_only:
            return self.control.check_update(source, version)
        self._require_settled()
        self.control.update(source, version)

    def join_weight_group(self, spec: WeightGroupSpec) -> None:
        self._require_settled()
        self.control.join_weight_group(spec)

    def sleep(self, offload_weights: bool = False) -> list[RequestOutput]:
        """Release the KV cache; every request ends (finish reason abort): their outputs."""
        self._require_settled()
        outputs = self._abort_all()
        self.control.sleep(offload_weights)
        return outputs

    def wake_up(self) -> None:
        self.control.wake_up()

    @property
    def is_drained(self) -> bool:
        """No request is left but those a pause holds back."""
        return not self._in_flight and len(self._requests) == self.control.num_deferred

    def _abort_all(self) -> list[RequestOutput]:
        outputs = [self.abort_request(request_id) for request_id in list(self._requests)]
        return [output for output in outputs if output is not None]

    def _require_settled(self) -> None:
        if self._in_flight:
            raise InternalError("control calls need the steps in flight settled first")

    # --- stepping -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the outputs of every request that progressed.

        With pipeline stages, a call first submits steps until one per stage is in flight
        (each over sequences no other in-flight step holds), then collects the oldest, so
        stage 0 computes step k + 1 while later stages finish step k.
        """
        outputs: Outputs = {}
        self._submit_steps(outputs)
        if self._in_flight:
            self._collect_oldest(outputs)
        return self._collect(outputs)

    def _collect_oldest(self, outputs: Outputs) -> None:
        """Collect the oldest step in flight: sample, append, check stops."""
        in_flight = self._in_flight.popleft()
        step = self.last_step = in_flight.step
        try:
            result = self.executor.collect(in_flight)
            picks = pick(result, self.sampler)
        except Exception as exc:  # a fault in the step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail_step(step, InternalError(f"engine step failed: {exc!r}"), outputs)
            return
        self.scheduler.update_after_step(step)
        for span in result.prompt_spans:
            span.record()
        if picks.output is not None:
            for chunk, token_id, logprob in zip(
                picks.chunks, picks.output.token_ids, picks.output.logprobs, strict=True
            ):
                if not chunk.seq.is_finished:  # else aborted while its step was in flight
                    self._append_token(chunk.seq, token_id, logprob, outputs)
        for chunk, logprobs in picks.beams:
            request = self._requests.get(chunk.seq.request_id)
            ended = None if request is None else self.beam_requests.report(request, chunk, logprobs)
            if ended is not None:  # the search ended: its samples, whole
                _output_of(outputs, chunk.seq.request_id).samples.extend(ended)

    def _submit_steps(self, outputs: Outputs) -> None:
        """Schedule and submit steps until one per pipeline stage is in flight."""
        depth = self.config.steps_in_flight
        while len(self._in_flight) < depth and self.control.may_schedule:
            busy = {c.seq.seq_id for s in self._in_flight for c in s.step.chunks}
            # Share the sequences among the steps in flight, so each stage has work.
            num_seqs = len(self.scheduler.running) + self.scheduler.num_waiting
            max_seqs = None if depth == 1 else max(1, -(-num_seqs // depth))
            step = self.scheduler.schedule(busy, max_seqs)
            for seq in step.out_of_blocks:
                request = self._requests[seq.request_id]
                if request.beams is not None:  # the search ends where it stands
                    deltas = self.beam_requests.finish_now(request)
                    _output_of(outputs, seq.request_id).samples.extend(deltas)
                    continue
                text = self.detokenizer.finish(seq.detok_state)
                delta = SampleDelta(seq.sample_index, [], text, [], FinishReason.LENGTH)
                _output_of(outputs, seq.request_id).samples.append(delta)
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

    def _append_token(
        self, seq: Sequence, token_id: int, logprob: TokenLogprob | None, outputs: Outputs
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
        reason = finish_reason(seq, token_id, text.stop_string is not None, self.max_model_len)
        if reason is not None:
            if text.stop_string is None:
                delta.text += self.detokenizer.finish(seq.detok_state)
            delta.finish_reason = reason
            self.scheduler.finish(seq, reason)
        _output_of(outputs, seq.request_id).samples.append(delta)

    def _collect(self, outputs: Outputs) -> list[RequestOutput]:
        for request_id, output in outputs.items():
            output.weight_version = self.control.weight_version
            request = self._requests[request_id]
            if not request.prompt_token_ids_sent:
                output.prompt_token_ids = request.prompt_token_ids
                request.prompt_token_ids_sent = True
            output.prompt_logprobs = request.take_prompt_logprobs()
            if request.is_finished:
                del self._requests[request_id]
                self._finalize(request, output)
        return list(outputs.values())

    def _finalize(self, request: EngineRequest, output: RequestOutput) -> None:
        output.finished = True
        request.times.finished_s = time.monotonic()
        output.times = request.times
        output.usage = Usage(
            num_prompt_tokens=len(request.prompt_token_ids),
            num_generated_tokens=request.num_generated_tokens,
            num_cached_tokens=request.seqs[0].num_cached_tokens,
        )
        errors = [seq.error for seq in request.seqs if seq.error is not None]
        if errors:
            output.error = errors[0] if isinstance(errors[0], HeadraceError) else None

    def _fail_step(self, step: SchedulerOutput, error: HeadraceError, outputs: Outputs) -> None:
        for chunk in step.chunks:
            request = self._requests.get(chunk.seq.request_id)
            if request is None:
                continue
            request.seqs[0].error = error
            self._finish_all(request, FinishReason.ERROR, _output_of(outputs, request.request_id))


def _output_of(outputs: Outputs, request_id: str) -> RequestOutput:
    """The request's output of this step, made on first use."""
    output = outputs.get(request_id)
    if output is None:
        output = outputs[request_id] = RequestOutput(request_id)
    return output
