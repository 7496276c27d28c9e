"""Beam search: which beams go on, and which finish, after each round of one request.

Design note. The algorithm is transformers' (`generate(num_beams=k, do_sample=False)`), so
that its sequences and scores are the oracle: each round every live beam's next-token
logprobs (log-softmax of the raw logits, then penalties and bans, as transformers applies
its processors to the logprobs) are added to the beam's running score; the best
K = max(2, 1 + stop tokens) x k continuations over all beams are kept, best first. A
continuation that ends (a stop token, or the length limit) and ranks among the first k
becomes a finished hypothesis scored ``logprob sum / generated tokens ** length_penalty``;
the k best hypotheses are kept. The k best continuations that did not end are the next
round's beams. The search ends when k hypotheses have finished and (by `early_stopping`) no
running beam can beat the worst of them, or at the length limit. Arithmetic is float32 with
transformers' -1e9 masks, so scores agree to the last bit the logprobs allow.

This module is the arithmetic only. The engine runs each live beam as a `Sequence`: it
reports a beam's logprobs when its step yields them (`report`), and once every live beam
has reported it applies `advance`'s answer (beams that continue keep their sequence, forks
share the parent's KV blocks copy-on-write, dropped beams free theirs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from headrace.sdk.config import GenerationConfig
from headrace.sdk.outputs import FinishReason

#: transformers' mask: a score plus this is out of every ranking that matters.
_MASK = -1.0e9


@dataclass(slots=True)
class Hypothesis:
    """A finished beam."""

    #: Its generated tokens (the stop token included, if it ended on one).
    token_ids: list[int]
    #: Sum of its tokens' logprobs.
    cumulative_logprob: float
    #: cumulative_logprob / len(token_ids) ** length_penalty: how beams are ranked.
    score: float
    finish_reason: FinishReason


@dataclass(frozen=True, slots=True)
class NextBeam:
    """A beam of the next round: live beam ``parent``'s tokens followed by ``token_id``."""

    parent: int
    token_id: int


def beams_to_keep(num_beams: int, num_stop_tokens: int) -> int:
    """Continuations kept per round: enough that k of them survive even if every beam's
    best ones are stop tokens."""
    return max(2, 1 + num_stop_tokens) * num_beams


class BeamSearch:
    """One request's search state; the live beams are indexed 0 .. num_live - 1."""

    def __init__(
        self,
        config: GenerationConfig,
        num_prompt_tokens: int,
        max_length: int,
        stop_token_ids: frozenset[int],
    ) -> None:
        self.num_beams = k = config.num_beams
        self.num_keep = beams_to_keep(k, len(stop_token_ids))
        self.length_penalty = config.length_penalty
        self.early_stopping = config.early_stopping
        self.num_prompt_tokens = num_prompt_tokens
        #: Prompt plus generated tokens at which every beam ends (transformers' max_length).
        self.max_length = max_length
        self.stop_token_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.long)
        #: Running score of each live beam (one beam, the prompt, before the first round).
        self.scores = torch.zeros(1)
        #: Prompt plus generated tokens of every live beam.
        self.length = num_prompt_tokens
        # The k finished-hypothesis slots, best first; empty ones score _MASK.
        self._slot_scores = torch.full((k,), _MASK)
        self._slot_finished = torch.zeros(k, dtype=torch.bool)
        self._slots: list[Hypothesis | None] = [None] * k
        #: Whether a running beam may still beat the finished ones (transformers' heuristic).
        self._improvable = True
        #: This round's top continuations of each reported live beam: (scores, token ids).
        self._reports: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.done = False

    @property
    def num_live(self) -> int:
        return int(self.scores.numel())

    @property
    def is_round_complete(self) -> bool:
        return len(self._reports) == self.num_live

    def report(self, beam: int, logprobs: torch.Tensor) -> None:
        """Live beam ``beam``'s processed next-token logprobs [V] (float32) this round. A
        beam reported twice (recomputed after a preemption) keeps the last report."""
        scored = logprobs + self.scores[beam]
        values, token_ids = torch.topk(scored, min(self.num_keep, scored.numel()))
        self._reports[beam] = (values, token_ids)

    def advance(self, generated: Sequence[list[int]]) -> list[NextBeam]:
        """End the round (every live beam reported): the next round's beams, best first, or
        [] when the search is done. ``generated``: each live beam's generated tokens."""
        assert self.is_round_complete and not self.done
        values, parents, token_ids = self._candidates()
        ends = torch.isin(token_ids, self.stop_token_ids) | (self.length + 1 >= self.max_length)
        running = values + ends.to(torch.float32) * _MASK
        next_index = torch.topk(running, self.num_beams).indices
        self._update_finished(values, parents, token_ids, ends, generated)
        self.length += 1
        self.scores = running[next_index]
        self._update_improvable()
        self._reports.clear()
        all_finished = bool(self._slot_finished.all())
        self.done = not self._improvable or (all_finished and self.early_stopping is True)
        self.done = self.done or bool(ends.all())
        if self.done:
            return []
        return [NextBeam(int(parents[i]), int(token_ids[i])) for i in next_index.tolist()]

    def finish_now(self, generated: Sequence[list[int]]) -> None:
        """End the search where it stands (the KV pool cannot grow the beams): the live
        beams join the hypotheses as they are, finished for length."""
        penalty = max(1, self.length - self.num_prompt_tokens) ** self.length_penalty
        finished = self._slot_scores.clone()
        for beam, tokens in enumerate(generated):
            score = float(self.scores[beam] / penalty)
            worst = int(torch.argmin(finished))
            if tokens and score > finished[worst]:
                finished[worst] = score
                self._slots[worst] = Hypothesis(
                    list(tokens), float(self.scores[beam]), score, FinishReason.LENGTH
                )
                self._slot_finished[worst] = True
        self._slot_scores = finished
        self.done = True

    def best(self, n: int) -> list[Hypothesis]:
        """The n best finished hypotheses, best first (fewer if fewer finished)."""
        order = torch.argsort(self._slot_scores, descending=True, stable=True).tolist()
        slots = [self._slots[i] for i in order if self._slot_finished[i]]
        return [slot for slot in slots if slot is not None][:n]

    # --- one round ----------------------------------------------------------------------

    def _candidates(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's K best continuations over all live beams, best first: (scores,
        parent beams, token ids)."""
        beams = sorted(self._reports)
        values = torch.cat([self._reports[b][0] for b in beams])
        token_ids = torch.cat([self._reports[b][1] for b in beams])
        parents = torch.cat([torch.full_like(self._reports[b][1], b) for b in beams])
        best = torch.topk(values, min(self.num_keep, values.numel()))
        index = best.indices
        return best.values, parents[index], token_ids[index]

    def _update_finished(
        self,
        values: torch.Tensor,
        parents: torch.Tensor,
        token_ids: torch.Tensor,
        ends: torch.Tensor,
        generated: Sequence[list[int]],
    ) -> None:
        """Merge the continuations that just ended (among the first k) into the k slots."""
        num_generated = self.length + 1 - self.num_prompt_tokens
        scores = values / (num_generated**self.length_penalty)
        full = bool(self._slot_finished.all()) and self.early_stopping is True
        scores = scores + float(full) * _MASK
        scores = scores + float(not self._improvable) * _MASK
        just_finished = ends.clone()
        just_finished[self.num_beams :] = False
        scores = scores + (~just_finished) * _MASK
        merged = torch.cat((self._slot_scores, scores))
        keep = torch.topk(merged, self.num_beams).indices.tolist()
        k = self.num_beams
        slots: list[Hypothesis | None] = []
        for i in keep:
            if i < k:
                slots.append(self._slots[i])
                continue
            c = i - k
            if not just_finished[c]:
                slots.append(None)
                continue
            token_id = int(token_ids[c])
            is_stop = bool(torch.isin(token_ids[c], self.stop_token_ids))
            slots.append(
                Hypothesis(
                    [*generated[int(parents[c])], token_id],
                    float(values[c]),
                    float(merged[i]),
                    FinishReason.STOP if is_stop else FinishReason.LENGTH,
                )
            )
        self._slot_scores = merged[keep]
        self._slot_finished = torch.cat((self._slot_finished, just_finished))[keep]
        self._slots = slots

    def _update_improvable(self) -> None:
        """transformers' early-stop heuristic, after the round (length already advanced)."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_length - self.num_prompt_tokens
        else:
            best_length = self.length - self.num_prompt_tokens
        best_running = self.scores[:1] / (best_length**self.length_penalty)
        worst = torch.where(self._slot_finished, self._slot_scores.min(), _MASK)
        self._improvable = self._improvable and bool(torch.any(best_running > worst))
