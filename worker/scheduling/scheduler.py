"""Builds each engine step from running and waiting sequences.

Design note. Every step has a token budget (`max_num_batched_tokens`) and a cap on running
sequences (`max_num_seqs`). A sequence is just "tokens not yet computed": a decode has one,
a prompt has many and is cut into chunks that fit the budget (chunked prefill), so a long
prompt never stalls running decodes.

1. Running sequences are served first, highest priority then earliest arrival. When the
   block pool cannot hold a sequence's new tokens, the lowest-priority, latest-arrived running
   sequence is preempted (blocks freed, recomputed later; its full blocks usually survive in
   the prefix cache), repeating until it fits or the sequence preempted itself.
2. Then waiting sequences are admitted while budget, sequence cap and blocks allow, highest
   priority first, then in the order of the scheduling policy (`EngineConfig`): "fcfs" by
   arrival; "shortest-first" by arrival plus window * tokens / max_model_len (the window is
   `shortest_first_window_s`), so of requests that arrive together the shortest goes first
   (in a burst of mixed prompt lengths, the median request's first token comes sooner for the
   same work), and none goes ahead of one that arrived more than a window before it. A
   waiting sequence of higher priority may preempt running ones of lower priority, even ones
   already planned into this step (their chunk is taken back): when blocks run out, and when
   the running set is at `max_num_seqs`, so a high-priority arrival starts in the next step
   rather than after some running sequence finishes.
3. Where priorities differ, a step takes prompt chunks of one priority only: the highest that
   has prompt tokens to compute (the waiting queue's head, or a running sequence part way
   through its prompt). Lower-priority sequences still decode, but their prompts (starting or
   part done) wait. A step's length is mostly its prompt tokens, and a prompt's first token
   comes at the end of its step, so a high-priority arrival's first token is not held back
   by a budget's worth of lower-priority prompts planned beside it. With one priority
   throughout this changes nothing.

The result is a `SchedulerOutput`: plain data, no tensors. The engine runs it, samples, then
calls `update_from_output`, the one place a step's results change sequences: computed-token
counts and the prefix cache move forward, sampled tokens are appended, the stop checks run,
and sequences that stopped are finished and their blocks freed. A sequence's status, finish
reason and error are written here and nowhere else.

Samples 1..n-1 of a request follow sample 0 (`follow`): they are queued once it has drawn its
first token, when the shared prompt's full blocks are in the prefix cache for them to reuse.

With pipeline parallelism several steps are in flight at once (one per stage). Sequences
of a step still in flight are `busy`: the next step neither schedules nor preempts them,
and a cap on sequences per step shares the running ones among the steps in flight.

With LoRA, a step holds at most `max_loras` distinct adapters (the base model is free): a
running sequence whose adapter does not fit waits for a later step, and a waiting one at the
head of the queue stops admission until it fits, so nothing behind it overtakes it.

A held sequence (its reader fell behind, see `hold`) is not scheduled: a running one keeps
its blocks but may be preempted, a waiting one is HELD out of the queue until `release`.

Multi-step decode (`num_decode_steps` K): a step whose chunks are all plain greedy one-row
decodes, with nothing waiting, busy or held, runs the model up to K times (`_decode_steps`:
fewer where max_tokens, the context or the pool would be passed); the blocks of all K tokens
are allocated here, and `update_from_output` appends the runs' tokens as it appends a
speculating sequence's kept proposals, cut at a stop.

Beam search forks running sequences (`fork`): the child joins the running set with the
parent's blocks shared. Forks may take the running set past `max_num_seqs` for a while, and a
beam whose siblings wait for it (one already generating) is admitted past the cap, and may
preempt a sibling that already has its logprobs for the round: a search never waits on itself,
and runs in a pool that holds one beam (a beam alone that outgrows it ends the search).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from headrace.sdk.errors import HeadraceError
from headrace.worker.config import EngineConfig
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.output import SampledToken, ScheduledChunk, SchedulerOutput
from headrace.worker.scheduling.proposals import NgramProposer, Proposer
from headrace.worker.scheduling.stops import check_stop
from headrace.worker.sequence import (
    FinishReason,
    Sequence,
    SequenceStatus,
    is_plain,
    is_plain_greedy,
)


@dataclass(slots=True)
class _StepPlan:
    """The step being built: chunks planned so far and the token budget left."""

    budget: int
    #: Sequences this step may hold at most.
    max_seqs: int
    #: Seq ids of steps still in flight: neither scheduled nor preempted by this one.
    busy: Collection[int] = ()
    #: Distinct LoRA adapters the step may hold (0: no limit, LoRA is off).
    max_adapters: int = 0
    chunks: dict[int, ScheduledChunk] = field(default_factory=dict)  # by seq_id
    preempted: list[Sequence] = field(default_factory=list)
    out_of_blocks: list[Sequence] = field(default_factory=list)
    #: Chunks planned per LoRA adapter.
    adapters: dict[str, int] = field(default_factory=dict)
    #: The only priority whose prompt chunks the step takes (design note, 3); None: any.
    prompt_priority: int | None = None

    def holds_prompt_of(self, seq: Sequence) -> bool:
        """Whether seq's prompt waits this step for a higher priority's."""
        return self.prompt_priority is not None and seq.priority < self.prompt_priority

    def add(
        self,
        seq: Sequence,
        num_new_tokens: int,
        draft: list[int] | None = None,
        num_decode_steps: int = 1,
    ) -> None:
        """Plan tokens [computed, computed + num_new_tokens) of seq, the last len(draft) of
        them proposed ones (speculative decoding); a one-row decode may run num_decode_steps
        times (multi-step decode)."""
        if seq.adapter is not None:
            self.adapters[seq.adapter] = self.adapters.get(seq.adapter, 0) + 1
        start, draft = seq.num_computed_tokens, draft or []
        samples = start + num_new_tokens - len(draft) == seq.num_tokens
        self.chunks[seq.seq_id] = ScheduledChunk(
            seq, start, num_new_tokens, samples, draft, num_decode_steps
        )
        self.budget -= num_new_tokens

    def fits_adapter(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter (if any) fits the step's adapter limit."""
        if seq.adapter is None or not self.max_adapters:
            return True
        return seq.adapter in self.adapters or len(self.adapters) < self.max_adapters

    def take_back(self, seq: Sequence) -> None:
        chunk = self.chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self.budget += chunk.num_new_tokens
            if seq.adapter is not None:
                self.adapters[seq.adapter] -= 1
                if not self.adapters[seq.adapter]:
                    del self.adapters[seq.adapter]

    @property
    def is_full(self) -> bool:
        return self.budget <= 0 or len(self.chunks) >= self.max_seqs


#: Backoff of a sequence whose proposals keep failing: after its second step in a row with
#: none kept it skips 2, then 4, 8 and at most this many steps before it proposes again, so
#: text the proposer cannot predict costs a verifying chunk only now and then.
MAX_SPECULATION_BACKOFF = 32


def _back_off(seq: Sequence, num_kept: int) -> None:
    """Record a speculating step's outcome for the backoff (`MAX_SPECULATION_BACKOFF`)."""
    seq.speculation_misses = 0 if num_kept else seq.speculation_misses + 1
    if seq.speculation_misses >= 2:
        seq.speculation_backoff = min(2 ** (seq.speculation_misses - 1), MAX_SPECULATION_BACKOFF)


def _in_prompt(seq: Sequence) -> bool:
    """Part way through a prompt (or a preempted sequence's recompute): more than the one
    token a decode computes."""
    return seq.num_tokens - seq.num_computed_tokens > 1


def _is_started_beam(seq: Sequence) -> bool:
    """A beam of a search under way: its siblings wait for its next logprobs."""
    return seq.config.num_beams > 1 and seq.num_output_tokens > 0


def _order(seq: Sequence) -> tuple[int, int]:
    """Sort key: higher priority first, then earlier arrival."""
    return (-seq.priority, seq.arrival)


def _shortest_first(window_s: float, max_model_len: int) -> Callable[[Sequence], tuple]:
    """The waiting queue's key under "shortest-first": higher priority first, then the
    arrival time pushed back by window_s * tokens / max_model_len (never past one window),
    then arrival."""

    def key(seq: Sequence) -> tuple[int, float, int]:
        tokens = seq.num_tokens - seq.num_computed_tokens
        return (-seq.priority, seq.arrival_s + window_s * tokens / max_model_len, seq.arrival)

    return key


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        max_model_len: int,
        proposer: Proposer | None = None,
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        #: The model's context: a sequence that reaches it ends (LENGTH).
        self.max_model_len = max_model_len
        #: Sorted by _order; the tail is the first to be preempted.
        self.running: list[Sequence] = []
        #: Heap of (waiting key, seq_id, seq); aborted entries are skipped lazily.
        self._waiting: list[tuple[tuple, int, Sequence]] = []
        #: The waiting queue's order (the scheduling policy).
        self._waiting_key: Callable[[Sequence], tuple] = _order
        if config.scheduling_policy == "shortest-first":
            self._waiting_key = _shortest_first(config.shortest_first_window_s, max_model_len)
        self.num_waiting = 0
        self.num_preemptions = 0
        #: Seq ids of held sequences (running ones keep their place in `running`).
        self._held_ids: set[int] = set()
        #: Held sequences out of the waiting queue, by seq id.
        self._parked: dict[int, Sequence] = {}
        #: Sequences queued once a leader (by seq id) draws its first token (see `follow`).
        self._followers: dict[int, list[Sequence]] = {}
        #: Speculative decoding's proposer (None: off; by default prompt lookup when
        #: num_speculative_tokens is set); `speculate` switches it.
        if proposer is None and config.num_speculative_tokens:
            proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
        self.proposer = proposer
        self._speculating = self.proposer is not None
        #: Multi-step decode's most runs a step (num_decode_steps); `decode_several` switches.
        self._max_decode_steps = config.num_decode_steps

    # --- queue management ----------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._held_ids:
            self._park(seq)
            return
        seq.status = SequenceStatus.WAITING
        heapq.heappush(self._waiting, (self._waiting_key(seq), seq.seq_id, seq))
        self.num_waiting += 1

    def follow(self, leader: Sequence, followers: list[Sequence]) -> None:
        """Queue ``followers`` once ``leader`` has drawn its first token (its prompt's full
        blocks are then cached for them). A leader that ends before never queues them: a
        request's samples end together then (an abort or a failed step ends each one)."""
        if followers:
            self._followers[leader.seq_id] = followers

    def finish(
        self, seq: Sequence, reason: FinishReason, error: HeadraceError | None = None
    ) -> None:
        """End a sequence wherever it is and free its blocks; ``error``: why it failed."""
        if seq.is_finished:
            return
        self._followers.pop(seq.seq_id, None)
        if seq.status == SequenceStatus.WAITING:
            self.num_waiting -= 1  # its heap entry is dropped lazily
        elif seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        self._parked.pop(seq.seq_id, None)
        self._held_ids.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.block_manager.free(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child``, a copy of ``parent``'s tokens: running on the parent's blocks
        when the parent has computed all its tokens, else queued to compute its own."""
        if parent.status == SequenceStatus.RUNNING and (
            parent.num_computed_tokens == parent.num_tokens
        ):
            self.block_manager.fork(parent, child)
            child.status = SequenceStatus.RUNNING
            bisect.insort(self.running, child, key=_order)
        else:
            self.add(child)
        if parent.seq_id in self._held_ids:
            self.hold(child)

    def hold(self, seq: Sequence) -> None:
        """Stop scheduling ``seq`` until `release` (a running one keeps its blocks)."""
        if seq.is_finished or seq.seq_id in self._held_ids:
            return
        self._held_ids.add(seq.seq_id)
        if seq.status == SequenceStatus.WAITING:
            self.num_waiting -= 1  # its heap entry is dropped lazily
            self._park(seq)

    def release(self, seq: Sequence) -> None:
        if seq.seq_id not in self._held_ids:
            return
        self._held_ids.discard(seq.seq_id)
        if self._parked.pop(seq.seq_id, None) is not None:
            self.add(seq)

    def _park(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.HELD
        self._parked[seq.seq_id] = seq

    def has_runnable_work(self) -> bool:
        """Whether a step could schedule anything: a waiting or an unheld running one."""
        return self.num_waiting > 0 or any(s.seq_id not in self._held_ids for s in self.running)

    def _peek_waiting(self) -> Sequence | None:
        while self._waiting and self._waiting[0][2].status != SequenceStatus.WAITING:
            heapq.heappop(self._waiting)
        return self._waiting[0][2] if self._waiting else None

    # --- one step --------------------------------------------------------------------------

    def schedule(self, busy: Collection[int] = (), max_seqs: int | None = None) -> SchedulerOutput:
        """The next step. ``busy``: seq ids in steps still in flight; ``max_seqs``: a cap on
        the step's sequences (to share them among in-flight steps)."""
        cap = self.config.max_num_seqs if max_seqs is None else max_seqs
        max_adapters = self.config.max_loras if self.config.enable_lora else 0
        plan = _StepPlan(self.config.max_num_batched_tokens, cap, busy, max_adapters)
        plan.prompt_priority = self._prompt_priority()
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        chunks = sorted(plan.chunks.values(), key=lambda c: c.num_new_tokens != 1)
        num_decode_seqs = sum(1 for c in chunks if c.num_new_tokens == 1)
        num_batched_tokens = self.config.max_num_batched_tokens - plan.budget
        return SchedulerOutput(
            chunks,
            num_decode_seqs,
            num_batched_tokens,
            plan.preempted,
            plan.out_of_blocks,
            self.block_manager.take_copies(),
        )

    def _prompt_priority(self) -> int | None:
        """The priority whose prompt chunks a step takes (design note, 3): the highest of the
        waiting queue's head and the running sequences part way through a prompt (not held),
        or None when the running set (sorted by priority) and the head share one priority."""
        head = self._peek_waiting()
        ends = {seq.priority for seq in self.running[:1] + self.running[-1:]}
        if head is not None:
            ends.add(head.priority)
        if len(ends) < 2:
            return None
        prompting = [
            seq.priority
            for seq in self.running
            if _in_prompt(seq) and seq.seq_id not in self._held_ids
        ]
        return max([*prompting, *([head.priority] if head is not None else [])], default=None)

    def _chunk_size(self, num_uncomputed: int, budget: int) -> int:
        """Tokens to run this step out of num_uncomputed, or 0 to wait for a bigger budget."""
        if num_uncomputed <= budget:
            return num_uncomputed
        return budget if self.config.enable_chunked_prefill else 0

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        speculating = self._speculates(plan)
        num_steps = self._decode_steps(plan)  # (every running sequence decodes when > 1)
        bm, running, held = self.block_manager, self.running, self._held_ids  # (a row each)
        while i < len(running) and not plan.is_full:
            seq = running[i]
            num_new = self._chunk_size(seq.num_tokens - seq.num_computed_tokens, plan.budget)
            skip = seq.seq_id in plan.busy or seq.seq_id in held
            if plan.prompt_priority is not None:  # (None unless priorities differ)
                skip = skip or (_in_prompt(seq) and plan.holds_prompt_of(seq))
            if num_new == 0 or skip or not plan.fits_adapter(seq):
                i += 1
                continue
            draft = self._propose(seq, plan.budget - 1) if speculating and num_new == 1 else []
            needed = bm.num_new_blocks_needed(seq, num_new + len(draft) + num_steps - 1)
            # Proposals never preempt anyone nor end a sequence: they take blocks only while
            # a block for each running sequence's next token would still be left.
            if draft and not bm.can_allocate(needed + len(running)):
                draft = []
                needed = bm.num_new_blocks_needed(seq, num_new)
            num_new += len(draft)
            while not bm.can_allocate(needed):
                if len(running) == 1:
                    # Alone and still too big for the pool: recomputing would loop forever.
                    self.finish(seq, FinishReason.LENGTH)
                    plan.out_of_blocks.append(seq)
                    return
                # The idle tail is never planned yet: planning walks from the front.
                victim = self._victim(plan)
                if victim is None:
                    return  # only busy sequences hold blocks: wait for their steps
                self._preempt(victim, plan)
                if victim is seq:
                    return
            bm.allocate(seq, num_new + num_steps - 1)
            plan.add(seq, num_new, draft, num_steps)
            i += 1

    def speculate(self, enabled: bool) -> None:
        """Turn speculative decoding off for the steps to come, or back on (a benchmark's
        runs with and without it on one engine); it needs a proposer to turn on."""
        self._speculating = enabled and self.proposer is not None

    def decode_several(self, enabled: bool) -> None:
        """Turn multi-step decode off for the steps to come, or back on to num_decode_steps
        (a benchmark's runs with and without it on one engine)."""
        self._max_decode_steps = self.config.num_decode_steps if enabled else 1

    def _speculates(self, plan: _StepPlan) -> bool:
        """Whether this step speculates: it is on and at most speculative_max_seqs running
        sequences decode (past a few rows proposals cost more than they save)."""
        if not self._speculating:
            return False
        decoding = sum(
            1
            for s in self.running
            if s.num_tokens - s.num_computed_tokens == 1
            and s.seq_id not in plan.busy
            and s.seq_id not in self._held_ids
        )
        return decoding <= self.config.speculative_max_seqs

    def _decode_steps(self, plan: _StepPlan) -> int:
        """Tokens each sequence decodes this step: 1, or up to num_decode_steps when every
        running sequence is a plain greedy one-row decode (a prompt chunk or a drawn token
        would wait for the others' steps), none is busy or held, nothing waits (an arrival
        waits for the whole step), and the pool has the blocks for all their tokens. None
        decodes past its max_tokens or the context."""
        num_steps = self._max_decode_steps
        if num_steps == 1 or self.num_waiting or plan.busy or self._held_ids:
            return 1
        for seq in self.running:
            if seq.num_tokens - seq.num_computed_tokens != 1 or not is_plain_greedy(seq):
                return 1
            num_steps = min(
                num_steps,
                seq.config.max_tokens - seq.num_output_tokens,
                self.max_model_len - seq.num_tokens,
            )
        bm = self.block_manager
        needed = sum(bm.num_new_blocks_needed(seq, num_steps) for seq in self.running)
        return num_steps if num_steps > 1 and bm.can_allocate(needed) else 1

    def _propose(self, seq: Sequence, budget: int) -> list[int]:
        """Proposed tokens to follow seq's newest, for a plain sequence (`is_plain`): at most
        num_speculative_tokens, the step's budget left, and one fewer than the tokens it may
        still emit (max_tokens, the context), so a step never emits past either."""
        if self.proposer is None or not is_plain(seq):
            return []
        if seq.speculation_backoff > 0:
            seq.speculation_backoff -= 1
            return []
        room = min(
            self.config.num_speculative_tokens,
            budget,
            seq.config.max_tokens - seq.num_output_tokens - 1,
            self.max_model_len - seq.num_tokens - 1,
        )
        return self.proposer.propose(seq.token_ids, room) if room > 0 else []

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while plan.budget > 0:
            seq = self._peek_waiting()
            if seq is None or plan.holds_prompt_of(seq):  # (the rest rank no higher)
                return
            if len(self.running) >= self.config.max_num_seqs and not _is_started_beam(seq):
                # At the sequence cap a higher priority takes the place of the lowest one.
                victim = self._victim(plan)
                if victim is None or victim.priority >= seq.priority:
                    return
                self._preempt(victim, plan)
                continue
            if len(plan.chunks) >= plan.max_seqs or not plan.fits_adapter(seq):
                return
            if not self._try_admit(seq, plan):
                return

    def _try_admit(self, seq: Sequence, plan: _StepPlan) -> bool:
        """Admit the head of the waiting queue if budget and blocks allow (maybe preempting)."""
        bm = self.block_manager
        while True:
            cached = [] if seq.wants_prompt_logprobs else bm.match_prefix(seq)
            num_cached_tokens = len(cached) * bm.block_size
            num_new = self._chunk_size(seq.num_tokens - num_cached_tokens, plan.budget)
            if num_new == 0:
                return False
            num_new_blocks = bm.num_blocks_for(num_cached_tokens + num_new) - len(cached)
            if bm.can_allocate(bm.cost_of(cached, num_new_blocks)):
                break
            victim = self._victim(plan)
            if victim is None or victim.priority >= seq.priority:
                victim = self._idle_sibling(seq, plan)
                if victim is None:
                    return False
            self._preempt(victim, plan)
        # Its heap entry is dropped lazily: a sibling preempted for it may now head the heap.
        self.num_waiting -= 1
        seq.status = SequenceStatus.RUNNING
        bm.take_cached(seq, cached)
        if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
            seq.num_cached_tokens = num_cached_tokens
        bm.allocate(seq, num_new)
        bisect.insort(self.running, seq, key=_order)
        plan.add(seq, num_new)
        return True

    def _victim(self, plan: _StepPlan) -> Sequence | None:
        """The running sequence to preempt first: lowest priority, latest arrival, not busy."""
        for seq in reversed(self.running):
            if seq.seq_id not in plan.busy:
                return seq
        return None

    def _idle_sibling(self, seq: Sequence, plan: _StepPlan) -> Sequence | None:
        """For a beam of a search under way: a running beam of the same search that has
        computed all its tokens (its logprobs for the round are kept), so freeing its blocks
        loses nothing; else None. The search then needs only one beam's blocks at a time."""
        if not _is_started_beam(seq):
            return None
        for other in reversed(self.running):
            idle = other.num_computed_tokens == other.num_tokens
            planned = other.seq_id in plan.busy or other.seq_id in plan.chunks
            if other.request_id == seq.request_id and idle and not planned:
                return other
        return None

    def _preempt(self, seq: Sequence, plan: _StepPlan) -> None:
        """Free seq's blocks and queue it to be recomputed from its first token."""
        plan.take_back(seq)
        plan.preempted.append(seq)
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)

    # --- after the step ------------------------------------------------------------------

    def update_from_output(self, step: SchedulerOutput, sampled: list[SampledToken]) -> None:
        """Apply a step's results: its chunks' tokens count as computed (full blocks enter the
        prefix cache, blocks a sliding window has passed are given back), each live
        sequence's sampled tokens are appended (a speculating one may have several: its
        accepted proposals and the model's next token), and the sequences the stop checks
        end are finished, their blocks freed."""
        for chunk in step.chunks:
            if not chunk.seq.is_finished and not chunk.appends_several:  # else aborted
                self._advance_computed(chunk)
        for token in sampled:
            assert not token.seq.is_finished, "the engine samples live sequences only"
            self._append(token)
        for chunk in step.chunks:
            if chunk.appends_several and not chunk.seq.is_finished:
                self._settle_several(chunk)

    def _settle_several(self, chunk: ScheduledChunk) -> None:
        """After the tokens of a chunk that may append several are appended: the KV of its
        newest token and of the tokens kept (appended, but the last, which the next step
        computes) is kept; the rest, written for rejected proposals, is dropped with the
        blocks only they used, so the prefix cache never holds a rejected token. (A
        multi-step decode keeps all it wrote, unless a stop ended the sequence.)"""
        seq, block_size = chunk.seq, self.block_manager.block_size
        seq.num_computed_tokens = seq.num_tokens - 1
        assert chunk.start < seq.num_computed_tokens <= chunk.start + chunk.num_tokens_run
        if chunk.draft_token_ids:
            _back_off(seq, num_kept=seq.num_computed_tokens - chunk.start - 1)
        if seq.num_computed_tokens // block_size != chunk.start // block_size:
            self.block_manager.commit_full_blocks(seq)
        self.block_manager.trim(seq)
        self.block_manager.drop_behind_window(seq)

    def _advance_computed(self, chunk: ScheduledChunk) -> None:
        seq, block_size = chunk.seq, self.block_manager.block_size
        before = seq.num_computed_tokens
        seq.num_computed_tokens = before + chunk.num_new_tokens
        if seq.num_computed_tokens // block_size != before // block_size:
            self.block_manager.commit_full_blocks(seq)
        self.block_manager.drop_behind_window(seq)

    def _append(self, token: SampledToken) -> None:
        seq = token.seq
        if seq.num_output_tokens == 0:  # the prompt is computed and cached: followers start
            for follower in self._followers.pop(seq.seq_id, ()):
                self.add(follower)
        seq.token_ids.append(token.token_id)
        if token.logprob is not None:
            seq.logprobs.append(token.logprob)
        stop = check_stop(seq, token.token_id, token.hit_stop_string, self.max_model_len)
        if stop is not None:
            self.finish(seq, stop.reason, stop.error)
