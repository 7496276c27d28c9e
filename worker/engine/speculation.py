"""Speculative decoding in the engine: which proposals a step keeps, and the counts.

The scheduler runs a speculating sequence's newest token and its proposals d_1..d_k as one
chunk (`Scheduler._propose`); each input row's logits predict the next position: g_1..g_k
after the newest token and d_1..d_{k-1}, then g_{k+1} after d_k. Only plain sequences
(`sequence.is_plain`) speculate, whose token at a position depends on that row's logits and
the position alone: the argmax (greedy, `StepResult.draft_targets`), or a draw with the
position's seeded noise (sampled, `Engine._speculative_draws`). A proposal is kept exactly
when it is the token the sequence picks there: d_i while d_i == g_i, then its own g at the
first mismatch (or g_{k+1} when every proposal is kept).

For a sampled sequence this is speculative sampling's rejection rule for a proposer that is
certain of its token (the n-gram proposer: q = one-hot at d): d is kept with probability
p(d), and on a rejection the emitted token is p's draw given that it is not d, the
residual distribution (p - q)+ renormalised. Drawing each position as decoding would also
makes a seeded sequence's tokens those it gets without speculation. The emitted tokens are
the ones decoding one token a step would give, as far as the step's arithmetic gives the
same logits (a verifying chunk is a chunk of k + 1 rows, whose float sums may round
differently from a one-row decode's; the one-call decode stack takes both alike).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field


def accept(
    draft: Sequence[int], targets: Sequence[int], next_token: int, stop_token_ids: Collection[int]
) -> tuple[list[int], int]:
    """The tokens a speculating chunk emits (module docstring), cut after the first stop
    token: the sample ends there, and nothing after it may be emitted or detokenized (a
    speculating sequence has its min_tokens out, so any stop token ends it); and how many
    proposals were kept. ``targets`` and ``next_token``: the token the sequence picks at each
    proposal's position and after the last (greedy: the argmax; sampled: its draw there)."""
    emitted: list[int] = []
    for proposed, target in zip(draft, targets, strict=True):
        emitted.append(target)
        if proposed != target:
            return emitted, len(emitted) - 1
        if target in stop_token_ids:
            return emitted, len(emitted)
    emitted.append(next_token)
    return emitted, len(draft)


@dataclass(slots=True)
class SpeculationStats:
    """Proposals made and kept since the engine started (metrics, benchmarks)."""

    #: Chunks that carried proposals.
    num_chunks: int = 0
    num_proposed: int = 0
    num_accepted: int = 0
    #: Index i: proposals made / kept at position i + 1 of a chunk.
    proposed_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_chunks += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        while len(self.proposed_at) < num_proposed:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for i in range(num_proposed):
            self.proposed_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def since(self, earlier: SpeculationStats) -> SpeculationStats:
        """What these counts gained after ``earlier`` (a snapshot of the same counts)."""

        def gained(now: list[int], then: list[int]) -> list[int]:
            return [n - (then[i] if i < len(then) else 0) for i, n in enumerate(now)]

        return SpeculationStats(
            self.num_chunks - earlier.num_chunks,
            self.num_proposed - earlier.num_proposed,
            self.num_accepted - earlier.num_accepted,
            gained(self.proposed_at, earlier.proposed_at),
            gained(self.accepted_at, earlier.accepted_at),
        )

    def snapshot(self) -> SpeculationStats:
        """A copy that later steps do not change (load reports, metrics)."""
        return SpeculationStats(
            self.num_chunks,
            self.num_proposed,
            self.num_accepted,
            list(self.proposed_at),
            list(self.accepted_at),
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0
