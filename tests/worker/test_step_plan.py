"""Step plans carry only what changed, and a rank's mirror rebuilds the scheduler's view."""

from __future__ import annotations

from headrace.worker.distributed.step_plan import MirrorTable, PlanEncoder
from headrace.worker.scheduling.output import ScheduledChunk
from headrace.worker.sequence import SequenceStatus

from tests.worker.seqs import make_seq


def chunk(seq, num_new: int) -> ScheduledChunk:  # type: ignore[no-untyped-def]
    start = seq.num_computed_tokens
    return ScheduledChunk(seq, start, num_new, start + num_new == seq.num_tokens)


def step(encoder: PlanEncoder, mirrors: MirrorTable, *chunks: ScheduledChunk):  # type: ignore[no-untyped-def]
    plan = encoder.encode([list(chunks)], [[]])
    mirrors.apply(plan)
    for c in chunks:
        c.seq.num_computed_tokens += c.num_new_tokens
    return plan


def test_first_step_sends_everything_later_steps_only_the_new_tokens_and_blocks():
    encoder, mirrors = PlanEncoder(), MirrorTable()
    seq = make_seq(10)
    seq.block_ids = [3, 4, 5]
    plan = step(encoder, mirrors, chunk(seq, 10))
    assert plan.updates[0].reset
    assert plan.updates[0].new_token_ids == seq.token_ids
    seq.token_ids.append(99)  # sampled
    plan = step(encoder, mirrors, chunk(seq, 1))
    assert (plan.updates[0].new_token_ids, plan.updates[0].new_block_ids) == ([99], [])
    assert not plan.updates[0].reset
    seq.token_ids.append(98)
    seq.block_ids.append(8)  # the step crosses into a new block
    plan = step(encoder, mirrors, chunk(seq, 1))
    assert (plan.updates[0].new_token_ids, plan.updates[0].new_block_ids) == ([98], [8])
    mirror = mirrors.seqs[seq.seq_id]
    assert (mirror.token_ids, mirror.block_ids) == (seq.token_ids, seq.block_ids)


def test_a_preempted_sequence_is_sent_whole_again():
    encoder, mirrors = PlanEncoder(), MirrorTable()
    seq = make_seq(6)
    seq.block_ids = [1, 2]
    step(encoder, mirrors, chunk(seq, 6))
    seq.token_ids.append(7)
    seq.block_ids, seq.num_computed_tokens, seq.num_preemptions = [9, 10], 0, 1
    plan = step(encoder, mirrors, chunk(seq, 7))
    assert plan.updates[0].reset and plan.updates[0].new_block_ids == [9, 10]
    assert mirrors.seqs[seq.seq_id].block_ids == [9, 10]
    assert mirrors.seqs[seq.seq_id].token_ids == seq.token_ids


def test_finished_sequences_are_forgotten_on_every_rank():
    encoder, mirrors = PlanEncoder(), MirrorTable()
    done, running = make_seq(4), make_seq(4)
    done.block_ids, running.block_ids = [1], [2]
    step(encoder, mirrors, chunk(done, 4), chunk(running, 4))
    done.status = SequenceStatus.FINISHED
    running.token_ids.append(5)
    plan = step(encoder, mirrors, chunk(running, 1))
    assert plan.finished_seq_ids == [done.seq_id]
    assert set(mirrors.seqs) == {running.seq_id}


def test_micro_batches_name_their_chunks_and_rows():
    encoder, mirrors = PlanEncoder(), MirrorTable()
    a, b = make_seq(3), make_seq(5)
    a.block_ids, b.block_ids = [1], [2]
    plan = encoder.encode([[chunk(a, 3)], [chunk(b, 2)]], [[2], []])
    mirrors.apply(plan)
    chunks = [mb.chunks for mb in plan.micro_batches]
    assert chunks == [[(a.seq_id, 0, 3, ())], [(b.seq_id, 0, 2, ())]]
    assert [mb.logit_rows for mb in plan.micro_batches] == [[2], []]
    (mirror_b,) = mirrors.chunks(plan.micro_batches[1])
    assert (mirror_b.seq.token_ids, mirror_b.start, mirror_b.num_new_tokens) == (b.token_ids, 0, 2)


def test_a_speculating_chunk_sends_its_proposals():
    encoder, mirrors = PlanEncoder(), MirrorTable()
    seq = make_seq(4)
    seq.block_ids = [1]
    step(encoder, mirrors, chunk(seq, 4))
    seq.token_ids.append(9)
    speculating = ScheduledChunk(seq, 4, 3, True, [5, 6])
    plan = encoder.encode([[speculating]], [[0, 1, 2]])
    mirrors.apply(plan)
    assert plan.micro_batches[0].chunks == [(seq.seq_id, 4, 3, (5, 6))]
    (mirror,) = mirrors.chunks(plan.micro_batches[0])
    assert (mirror.start, mirror.num_new_tokens, mirror.draft_token_ids) == (4, 3, (5, 6))
    assert mirror.seq.token_ids == seq.token_ids  # the proposals are not the sequence's


def test_a_copied_last_block_is_sent_whole_again():
    """Copy-on-write replaces a forked beam's shared last block in place: not an append."""
    encoder, mirrors = PlanEncoder(), MirrorTable()
    seq = make_seq(6)
    seq.block_ids = [1, 2]
    step(encoder, mirrors, chunk(seq, 6))
    seq.token_ids.append(7)
    seq.block_ids[1] = 5  # its own copy of shared block 2
    plan = step(encoder, mirrors, chunk(seq, 1))
    assert plan.updates[0].reset and plan.updates[0].new_block_ids == [1, 5]
    assert mirrors.seqs[seq.seq_id].block_ids == [1, 5]
    assert mirrors.seqs[seq.seq_id].token_ids == seq.token_ids
