"""Beam-search requests in the engine: their live beams as sequences, round by round.

A beam request starts as one sequence (the prompt). Each step that yields logits for a
live beam reports its processed logprobs to the request's `BeamSearch`; once every live
beam has reported, the round ends: beams that continue keep their sequence (the first child
of a parent takes it over), further children are forks that share the parent's KV blocks
copy-on-write (`Scheduler.fork`), and parents with no child are finished, freeing their
blocks. When the search ends, its n best hypotheses are the request's samples, each one
whole delta (nothing streams before; beams change until the end).
"""

from __future__ import annotations

import collections.abc
import time
from collections.abc import Callable

import torch
from headrace.kernels import KernelSet
from headrace.sdk.errors import HeadraceError
from headrace.sdk.outputs import FinishReason, SampleDelta
from headrace.worker.engine.intake import EngineRequest
from headrace.worker.sampling.detokenizer import Detokenizer
from headrace.worker.sampling.sampler import apply_history
from headrace.worker.scheduling.output import ScheduledChunk
from headrace.worker.scheduling.scheduler import Scheduler
from headrace.worker.sequence import Sequence


def beam_logprobs(
    logits: torch.Tensor, seqs: collections.abc.Sequence[Sequence], kernels: KernelSet
) -> torch.Tensor:
    """[B, V] next-token logprobs of beam rows: log-softmax of the raw logits, then the
    penalties and bans (transformers applies its processors to the logprobs)."""
    return apply_history(torch.log_softmax(logits.float(), dim=-1), seqs, kernels)


class BeamRequests:
    """Advances the beam requests of one engine."""

    def __init__(
        self, scheduler: Scheduler, detokenizer: Detokenizer, new_seq_id: Callable[[], int]
    ) -> None:
        self.scheduler = scheduler
        self.detokenizer = detokenizer
        self.new_seq_id = new_seq_id

    def report(
        self, request: EngineRequest, chunk: ScheduledChunk, logprobs: torch.Tensor
    ) -> list[SampleDelta] | None:
        """Record the logprobs a live beam's chunk yielded; ends the round once every live
        beam reported. The request's final deltas when the search is done, else None."""
        search, seq = request.beams, chunk.seq
        assert search is not None
        if seq.is_finished or chunk.start + chunk.num_new_tokens != seq.num_tokens:
            return None  # aborted, or dropped; or the search moved on while it ran (stale)
        if request.times.first_token_s is None:
            request.times.first_token_s = time.monotonic()
        search.report(_index_of(request.seqs, seq), logprobs)
        if not search.is_round_complete:
            return None
        generated = [s.token_ids[s.num_prompt_tokens :] for s in request.seqs]
        next_beams = search.advance(generated)
        if search.done:
            return self._finish(request)
        parents, claimed = request.seqs, set[int]()
        children: list[Sequence] = []
        for beam in next_beams:  # every fork before any parent grows
            parent = parents[beam.parent]
            children.append(parent if beam.parent not in claimed else self._fork(parent))
            claimed.add(beam.parent)
        for child, beam in zip(children, next_beams, strict=True):
            child.token_ids.append(beam.token_id)
        for i, parent in enumerate(parents):
            if i not in claimed:  # a beam with no continuation among the best
                self.scheduler.finish(parent, FinishReason.ABORT)
        request.seqs = children
        return None

    def end(
        self, request: EngineRequest, reason: FinishReason, error: HeadraceError | None = None
    ) -> list[SampleDelta]:
        """Abort or fail the search: every live beam ends, and each of the n samples with a
        final empty delta (none was reported before)."""
        for seq in request.seqs:
            self.scheduler.finish(seq, reason, error)
        assert request.beams is not None
        if request.beams.done:
            return []
        request.beams.done = True
        return [SampleDelta(i, [], "", [], reason) for i in range(request.config.n)]

    def finish_now(self, request: EngineRequest) -> list[SampleDelta]:
        """End the search where it stands (a beam outgrew the KV pool)."""
        search = request.beams
        assert search is not None
        if not search.done:
            search.finish_now([s.token_ids[s.num_prompt_tokens :] for s in request.seqs])
        return self._finish(request)

    def _fork(self, parent: Sequence) -> Sequence:
        child = Sequence(
            seq_id=self.new_seq_id(),
            request_id=parent.request_id,
            sample_index=parent.sample_index,
            config=parent.config,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            priority=parent.priority,
            arrival=parent.arrival,
            arrival_s=parent.arrival_s,
            sample_seed=None,
            stop_token_ids=parent.stop_token_ids,
            adapter=parent.adapter,
            lora_id=parent.lora_id,
        )
        self.scheduler.fork(parent, child)
        return child

    def _finish(self, request: EngineRequest) -> list[SampleDelta]:
        """Free the live beams; the n best hypotheses as the request's samples."""
        for seq in request.seqs:
            self.scheduler.finish(seq, FinishReason.STOP)
        assert request.beams is not None
        best = request.beams.best(request.config.n)
        request.num_beam_tokens = sum(len(h.token_ids) for h in best)
        deltas = []
        for index, hypothesis in enumerate(best):
            state = self.detokenizer.new_state(request.prompt_token_ids, request.config)
            text = self.detokenizer.add_tokens(state, hypothesis.token_ids).text
            text += self.detokenizer.finish(state)
            deltas.append(SampleDelta(index, hypothesis.token_ids, text, []))
            deltas[-1].finish_reason = hypothesis.finish_reason
            deltas[-1].cumulative_logprob = hypothesis.cumulative_logprob
            deltas[-1].beam_score = hypothesis.score
        return deltas


def _index_of(seqs: list[Sequence], seq: Sequence) -> int:
    return next(i for i, s in enumerate(seqs) if s is seq)
