"""`Engine`: the synchronous core. Add requests, abort them, and step.

Each `step()` reads as the loop it is: schedule, run the model, sample (and detokenize), then
one update, `Scheduler.update_from_output`, that owns what follows: appending the tokens, the
stop checks, status, errors, finishing and freeing blocks. The engine then reports one
`RequestOutput` per request that made progress: the step's new tokens and text for each of its
samples (deltas, for streaming), and on the last one the finish reasons and usage.

The engine is single-threaded; `AsyncEngine` runs it on a thread of its own for servers, and
`LLM` drives it to completion for offline batches. Who writes what: the scheduler alone sets
a sequence's status, finish reason and error; the engine reads them to report. Between steps
it takes control calls (pause, new weights, sleep), whose state `GenerationControl` owns;
every output carries the weight version that produced it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from headrace.kernels import select_kernels
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InternalError, InvalidArgumentError
from headrace.sdk.outputs import FinishReason, SampleDelta, TokenLogprob, Usage
from headrace.sdk.prompts import Prompt
from headrace.sdk.weights import PauseMode
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.weight_sync import WeightGroupSpec, WeightSource
from headrace.worker.engine.adapters import Adapters
from headrace.worker.engine.beams import BeamRequests, beam_logprobs
from headrace.worker.engine.draft import DraftModelProposer, draft_config
from headrace.worker.engine.generation_control import GenerationControl
from headrace.worker.engine.intake import EngineRequest, RequestIntake
from headrace.worker.engine.model_spec import ModelSpec
from headrace.worker.engine.outputs import EngineLoad, RequestOutput, StepStats
from headrace.worker.engine.speculation import SpeculationStats, accept
from headrace.worker.execution.batch import StepResult
from headrace.worker.execution.executor import start_executor
from headrace.worker.execution.interface import InFlightStep
from headrace.worker.lora.manager import AdapterInfo
from headrace.worker.models.registry import ModelWeights
from headrace.worker.sampling.detokenizer import Detokenizer
from headrace.worker.sampling.ops import select_rows
from headrace.worker.sampling.sampler import Sampler
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.output import SampledToken, ScheduledChunk, SchedulerOutput
from headrace.worker.scheduling.scheduler import Scheduler
from headrace.worker.sequence import Sequence
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

#: One step's outputs as they are gathered, by request id.
Outputs = dict[str, RequestOutput]


@dataclass(slots=True)
class StepPicks:
    """What a collected step drew: a token for each live sampling row, and the beam rows'
    logprobs for their searches."""

    sampled: list[SampledToken] = field(default_factory=list)
    beams: list[tuple[ScheduledChunk, torch.Tensor]] = field(default_factory=list)


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = ModelSpec.load(config)
        self.device = config.torch_device()
        self.kernels = select_kernels(config.kernel_backend, self.device)
        if config.int8_activations and self.kernels.NAME == "triton":
            raise InvalidArgumentError(
                "int8_activations", "runs on the cpu and reference kernels, not triton"
            )
        spec = self.spec
        weights = ModelWeights(
            spec.path, spec.quantization, spec.gguf_file, config.int8_activations
        )
        self.executor = start_executor(
            config,
            weights,
            spec.dtype,
            self.device,
            self.kernels,
            spec.max_model_len,
            spec.hf_config,
        )
        self.runner = self.executor.runner
        self.vocab_size = self.runner.model.vocab_size
        self.block_manager = BlockManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.runner.model.kv_window,
        )
        #: The draft model's engine, proposing for speculative decoding (None: prompt
        #: lookup, if speculating).
        self.draft: DraftModelProposer | None = None
        if config.speculative_model is not None:
            self.draft = DraftModelProposer(Engine(draft_config(config)), self.spec.tokenizer)
        max_len = self.spec.max_model_len
        self.scheduler = Scheduler(config, self.block_manager, max_len, self.draft)
        self.control = GenerationControl(
            self.spec, self.executor, self.block_manager, config.weight_version
        )
        self.sampler = Sampler(self.vocab_size, self.kernels, seed=config.seed)
        self.detokenizer = Detokenizer(self.spec.tokenizer)
        self.intake = RequestIntake(
            self.spec, self.vocab_size, self.block_manager, self.detokenizer
        )
        self.beam_requests = BeamRequests(self.scheduler, self.detokenizer, self.intake.new_seq_id)
        self._requests: dict[str, EngineRequest] = {}
        #: Speculative decoding's proposals made and kept (config.num_speculative_tokens).
        self.speculation = SpeculationStats()
        #: Steps run and their time (metrics).
        self.step_stats = StepStats()
        #: The plan of the step whose outputs the last `step()` returned (benchmarks, metrics).
        self.last_step: SchedulerOutput | None = None
        #: Submitted steps not yet collected, oldest first (at most one per pipeline stage).
        self._in_flight: deque[InFlightStep[Any]] = deque()
        self.adapters = Adapters(self.executor)  # LoRA
        logger.info(
            "engine ready: model=%s dtype=%s quantization=%s%s kv_cache=%s device=%s kernels=%s "
            "kv_blocks=%d block_size=%d tp=%d pp=%d",
            self.spec.gguf_file or self.spec.path,
            self.spec.dtype,
            self.spec.quantization,
            " (int8 activations)" if config.int8_activations else "",
            config.kv_cache_dtype,
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
        if self.draft is not None:
            self.draft.close()

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
        leader, *followers = request.seqs
        self.scheduler.follow(leader, followers)
        self.control.admit(request_id, leader, self.scheduler)

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
        reason = FinishReason.ABORT if error is None else FinishReason.ERROR
        self._finish_all(request, reason, output, error)
        self._finalize(request, output)
        return output

    def _finish_all(
        self,
        request: EngineRequest,
        reason: FinishReason,
        output: RequestOutput,
        error: HeadraceError | None = None,
    ) -> None:
        """End every unfinished sample of a request, each with a final empty delta."""
        if request.beams is not None:
            output.samples.extend(self.beam_requests.end(request, reason, error))
            return
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, reason, error)
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
        return EngineLoad.measure(
            seqs,
            self.block_manager,
            self.scheduler,
            self.control,
            self.speculation.snapshot(),
            self.step_stats.snapshot(),
        )

    # --- generation control (between steps: `settle` first) ----------------------------

    def settle(self) -> list[RequestOutput]:
        """Finish every step in flight and submit none; the outputs of those steps."""
        outputs: Outputs = {}
        while self._in_flight:
            self._finish_oldest_step(outputs)
        return self._report(outputs)

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

    def load_lora_adapter(self, name: str, path: str | Path) -> AdapterInfo:
        """Load a LoRA adapter on every rank (see `Adapters.load`)."""
        self._require_settled()
        return self.adapters.load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Forget a LoRA adapter on every rank; refused while unfinished requests use it."""
        self._require_settled()
        users = [r for r in self._requests.values() if r.adapter == name and not r.is_finished]
        self.adapters.unload(name, num_users=len(users))

    def lora_adapters(self) -> list[AdapterInfo]:
        return self.adapters.list()

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
        (each over sequences no other in-flight step holds), then finishes the oldest, so
        stage 0 computes step k + 1 while later stages finish step k.
        """
        start_s = time.monotonic()
        outputs: Outputs = {}
        self._schedule_and_submit(outputs)
        if not self._in_flight:
            return self._report(outputs)
        step = self._finish_oldest_step(outputs)
        reported = self._report(outputs)
        self.step_stats.record(step, time.monotonic() - start_s)
        return reported

    def _finish_oldest_step(self, outputs: Outputs) -> SchedulerOutput:
        """Collect the oldest step in flight, sample, and apply it: the scheduler updates the
        sequences (tokens, stops, status, blocks); the outputs report what it did. Returns
        the step's plan."""
        in_flight = self._in_flight.popleft()
        step = self.last_step = in_flight.step
        try:
            result = self.executor.collect(in_flight)
            picks = self._sample(result)
        except Exception as exc:  # a fault in the step fails its requests, not the engine
            logger.exception("engine step failed")
            self._fail_step(step, InternalError(f"engine step failed: {exc!r}"), outputs)
            return step
        for span in result.prompt_spans:
            span.record()
        self.scheduler.update_from_output(step, picks.sampled)
        self._report_tokens(picks.sampled, outputs)
        self._advance_beams(picks.beams, outputs)
        return step

    # --- schedule and submit ----------------------------------------------------------------

    def _schedule_and_submit(self, outputs: Outputs) -> None:
        """Schedule and submit steps until one per pipeline stage is in flight."""
        depth = self.config.steps_in_flight
        while len(self._in_flight) < depth and self.control.may_schedule:
            busy = {c.seq.seq_id for s in self._in_flight for c in s.step.chunks}
            # Share the sequences among the steps in flight, so each stage has work.
            num_seqs = len(self.scheduler.running) + self.scheduler.num_waiting
            max_seqs = None if depth == 1 else max(1, -(-num_seqs // depth))
            step = self.scheduler.schedule(busy, max_seqs)
            self._report_out_of_blocks(step, outputs)
            if not step.chunks:
                return
            self._mark_scheduled(step)
            try:
                self._in_flight.append(self.executor.submit(step))
            except Exception as exc:  # a fault in the step fails its requests, not the engine
                logger.exception("engine step failed")
                self._fail_step(step, InternalError(f"engine step failed: {exc!r}"), outputs)

    def _report_out_of_blocks(self, step: SchedulerOutput, outputs: Outputs) -> None:
        """The last delta of each sequence that outgrew the KV pool (the scheduler ended it)."""
        for seq in step.out_of_blocks:
            request = self._requests[seq.request_id]
            if request.beams is not None:  # the search ends where it stands
                deltas = self.beam_requests.finish_now(request)
                _output_of(outputs, seq.request_id).samples.extend(deltas)
                continue
            text = self.detokenizer.finish(seq.detok_state)
            delta = SampleDelta(seq.sample_index, [], text, [], FinishReason.LENGTH)
            _output_of(outputs, seq.request_id).samples.append(delta)

    def _mark_scheduled(self, step: SchedulerOutput) -> None:
        now = time.monotonic()
        for chunk in step.chunks:
            if chunk.computes_prompt:  # decodes ran before
                times = self._requests[chunk.seq.request_id].times
                if times.first_scheduled_s is None:
                    times.first_scheduled_s = now

    # --- sample -------------------------------------------------------------------------

    def _sample(self, result: StepResult) -> StepPicks:
        """Draw a token for each live sampling row and detokenize it; beam rows yield their
        logprobs instead (`beam_logprobs`). Rows of sequences aborted while the step ran
        draw (the batch is whole) but are dropped."""
        chunks, targets = result.sample_chunks, result.draft_targets
        if (token_ids := result.sample_token_ids) is not None:  # the model's greedy head's
            nones: list[TokenLogprob | None] = [None] * len(token_ids)
            if result.decoded_token_ids:  # a multi-step decode's
                return StepPicks(self._detokenize_runs(chunks, result.decoded_token_ids, token_ids))
            return StepPicks(self._detokenize(chunks, token_ids, nones, targets))
        if (logits := result.sample_logits) is None:
            return StepPicks()
        speculative = self._speculative_draws(result)
        beam_rows = [i for i, chunk in enumerate(chunks) if chunk.seq.config.is_beam_search]
        if not beam_rows:
            drawn = self.sampler(logits, [c.seq for c in chunks])
            return StepPicks(
                self._detokenize(chunks, drawn.token_ids, drawn.logprobs, targets, speculative)
            )
        beam_chunks = [chunks[i] for i in beam_rows]
        beam_seqs = [c.seq for c in beam_chunks]
        logprobs = beam_logprobs(select_rows(logits, beam_rows), beam_seqs, self.kernels)
        picks = StepPicks(beams=list(zip(beam_chunks, logprobs, strict=True)))
        rows = sorted(set(range(len(chunks))) - set(beam_rows))
        if rows:
            sampled_chunks = [chunks[i] for i in rows]
            drawn = self.sampler(select_rows(logits, rows), [c.seq for c in sampled_chunks])
            checks = [targets[i] for i in rows] if targets else []
            picks.sampled = self._detokenize(
                sampled_chunks, drawn.token_ids, drawn.logprobs, checks, speculative
            )
        return picks

    def _speculative_draws(self, result: StepResult) -> dict[int, list[int]]:
        """Each sampled speculating sequence's draws (by seq id) at its proposals' positions
        and the one after: what the row at each position draws, with that position's seeded
        noise, as decoding one token a step would (`accept` keeps the proposals drawn)."""
        logits, drafts = result.sample_logits, result.draft_logits
        parts: list[torch.Tensor] = []
        seqs: list[Sequence] = []
        positions: list[int] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for i, chunk in enumerate(result.sample_chunks):
            k, seq = len(chunk.draft_token_ids), chunk.seq
            if k and not seq.config.is_greedy and not seq.is_finished:
                assert logits is not None and drafts is not None
                parts += [drafts[offset : offset + k], logits[i : i + 1]]
                seqs += [seq] * (k + 1)
                positions += range(seq.num_tokens, seq.num_tokens + k + 1)
                spans.append((seq.seq_id, k + 1))
            offset += k
        if not spans:
            return {}
        drawn = self.sampler(torch.cat(parts), seqs, positions).token_ids
        out, start = {}, 0
        for seq_id, count in spans:
            out[seq_id] = drawn[start : start + count]
            start += count
        return out

    def _detokenize(
        self,
        chunks: list[ScheduledChunk],
        token_ids: list[int],
        logprobs: list[TokenLogprob | None],
        draft_targets: list[list[int]],
        speculative_draws: dict[int, list[int]] | None = None,
    ) -> list[SampledToken]:
        """Each live chunk's tokens, detokenized in order: the one it sampled, or for a
        speculating chunk the proposals kept and the model's next token (`accept`: against
        the greedy tokens, or a sampled sequence's `_speculative_draws`), up to a stop
        string."""
        sampled: list[SampledToken] = []
        targets = draft_targets or [[]] * len(chunks)  # (read only)
        for chunk, token_id, logprob, checked in zip(
            chunks, token_ids, logprobs, targets, strict=True
        ):
            seq = chunk.seq
            if seq.is_finished:  # aborted while its step was in flight
                continue
            emitted = [token_id]
            if chunk.draft_token_ids:
                draft = chunk.draft_token_ids
                if speculative_draws and seq.seq_id in speculative_draws:
                    *checked, token_id = speculative_draws[seq.seq_id]
                emitted, kept = accept(draft, checked, token_id, seq.stop_token_ids)
                self.speculation.record(len(draft), kept)
            self._detokenize_tokens(seq, emitted, logprob, sampled)
        return sampled

    def _detokenize_runs(
        self, chunks: list[ScheduledChunk], decoded: list[list[int]], last_token_ids: list[int]
    ) -> list[SampledToken]:
        """A multi-step decode's tokens, each live chunk's in order: those its runs drew
        before the last, then the last's, up to the first stop token (its sequence has
        min_tokens out: any stop token ends it) or stop string."""
        sampled: list[SampledToken] = []
        for chunk, earlier, last in zip(chunks, decoded, last_token_ids, strict=True):
            if not chunk.seq.is_finished:  # else aborted while its step was in flight
                tokens = [*earlier, last]
                stops = chunk.seq.stop_token_ids
                end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
                self._detokenize_tokens(chunk.seq, tokens[:end], None, sampled)
        return sampled

    def _detokenize_tokens(
        self,
        seq: Sequence,
        token_ids: list[int],
        logprob: TokenLogprob | None,
        sampled: list[SampledToken],
    ) -> None:
        """Detokenize a sequence's new tokens in order into ``sampled``, up to a stop
        string."""
        for token in token_ids:
            text = self.detokenizer.add_tokens(seq.detok_state, [token])
            hit_stop = text.stop_string is not None
            if logprob is not None:
                self.detokenizer.token_names.name(logprob, seq.token_ids)
            sampled.append(SampledToken(seq, token, logprob, text.text, hit_stop))
            if hit_stop:
                break

    # --- report -------------------------------------------------------------------------

    def _report_tokens(self, sampled: list[SampledToken], outputs: Outputs) -> None:
        """Each sampled token as its sample's delta; the last one of a sample that ended now
        carries the finish reason (and the detokenizer's held-back text, unless a stop string
        ended it)."""
        now, requests = time.monotonic(), self._requests
        deltas: dict[int, tuple[SampleDelta, SampledToken]] = {}  # by seq id: one a sample
        for token in sampled:
            seq = token.seq
            earlier = deltas.get(seq.seq_id)
            if earlier is None:
                delta = SampleDelta(seq.sample_index, [token.token_id], token.text)
                _output_of(outputs, seq.request_id).samples.append(delta)
                times = requests[seq.request_id].times
                if times.first_token_s is None:
                    times.first_token_s = now
            else:  # a speculating sample's next token of this step
                delta = earlier[0]
                delta.token_ids.append(token.token_id)
                delta.text += token.text
            deltas[seq.seq_id] = (delta, token)
            if token.logprob is not None:
                delta.logprobs.append(token.logprob)
        for delta, last in deltas.values():
            seq = last.seq
            if seq.is_finished:
                if not last.hit_stop_string:
                    delta.text += self.detokenizer.finish(seq.detok_state)
                delta.finish_reason = seq.finish_reason

    def _advance_beams(
        self, beams: list[tuple[ScheduledChunk, torch.Tensor]], outputs: Outputs
    ) -> None:
        for chunk, logprobs in beams:
            request = self._requests.get(chunk.seq.request_id)
            ended = None if request is None else self.beam_requests.report(request, chunk, logprobs)
            if ended is not None:  # the search ended: its samples, whole
                _output_of(outputs, chunk.seq.request_id).samples.extend(ended)

    def _report(self, outputs: Outputs) -> list[RequestOutput]:
        """The step's outputs, completed: weight version, the prompt's token ids and logprobs
        the first time they are ready, and usage on a request's last output."""
        for request_id, output in outputs.items():
            output.weight_version = self.control.weight_version
            request = self._requests[request_id]
            if not request.prompt_token_ids_sent:
                output.prompt_token_ids = request.prompt_token_ids
                request.prompt_token_ids_sent = True
            output.prompt_logprobs = request.take_prompt_logprobs()
            if output.prompt_logprobs is not None:
                self._name_prompt(request.prompt_token_ids, output)
            if request.is_finished:
                del self._requests[request_id]
                self._finalize(request, output)
        return list(outputs.values())

    def _name_prompt(self, prompt_token_ids: list[int], output: RequestOutput) -> None:
        """Name the prompt's tokens beside its logprobs: each scored one, the first (which has
        no logprob), and the prompt's text."""
        names = self.detokenizer.token_names
        assert output.prompt_logprobs is not None
        names.name_prompt(output.prompt_logprobs, prompt_token_ids)
        first = TokenLogprob(prompt_token_ids[0], 0.0)
        names.name(first, [])
        output.first_prompt_token = first
        text = self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
        assert isinstance(text, str)
        output.prompt_text = text

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
            if request is not None:
                output = _output_of(outputs, request.request_id)
                self._finish_all(request, FinishReason.ERROR, output, error)


def _output_of(outputs: Outputs, request_id: str) -> RequestOutput:
    """The request's output of this step, made on first use."""
    output = outputs.get(request_id)
    if output is None:
        output = outputs[request_id] = RequestOutput(request_id)
    return output
