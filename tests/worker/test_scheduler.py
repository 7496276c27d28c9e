from headrace.worker.config import EngineConfig
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.output import SampledToken, SchedulerOutput
from headrace.worker.scheduling.scheduler import Scheduler
from headrace.worker.sequence import FinishReason, SequenceStatus

from tests.worker.seqs import make_seq


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 16,
    max_num_seqs: int = 8,
    chunked: bool = True,
) -> Scheduler:
    config = EngineConfig(
        model="unused",
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=chunked,
    )
    block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=True)
    return Scheduler(config, block_manager, max_model_len=100_000)


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """Schedule, pretend the model ran, and give each sampling chunk one new token."""
    step = scheduler.schedule()
    sampled = [SampledToken(c.seq, 7, None, "", False) for c in step.chunks if c.samples]
    scheduler.update_from_output(step, sampled)
    return step


def planned(step: SchedulerOutput) -> dict[str, int]:
    return {chunk.seq.request_id: chunk.num_new_tokens for chunk in step.chunks}


def test_long_prompt_is_chunked_and_never_stalls_running_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    short = make_seq(5)
    scheduler.add(short)
    run_step(scheduler)  # short's prompt fits in one step and samples
    long = make_seq(40)
    scheduler.add(long)
    step = run_step(scheduler)
    assert planned(step) == {short.request_id: 1, long.request_id: 15}
    assert step.num_decode_seqs == 1 and step.chunks[0].seq is short
    step = run_step(scheduler)
    assert planned(step) == {short.request_id: 1, long.request_id: 15}
    step = run_step(scheduler)
    assert planned(step) == {short.request_id: 1, long.request_id: 10}
    assert step.chunks[1].samples  # the last chunk reaches the prompt's end
    assert long.num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=16, chunked=False)
    first, second = make_seq(10), make_seq(10)
    scheduler.add(first)
    scheduler.add(second)
    assert planned(run_step(scheduler)) == {first.request_id: 10}
    assert planned(run_step(scheduler)) == {first.request_id: 1, second.request_id: 10}


def test_waiting_requests_start_by_priority_then_arrival():
    scheduler = make_scheduler(max_num_batched_tokens=4)
    low = make_seq(4, priority=0)
    high_late = make_seq(4, priority=5)
    high_early = make_seq(4, priority=5)
    high_early.arrival, high_late.arrival = -2, -1
    for seq in (low, high_late, high_early):
        scheduler.add(seq)
    order = [next(iter(planned(run_step(scheduler)))) for _ in range(3)]
    assert order[0] == high_early.request_id


def test_out_of_blocks_preempts_the_lowest_priority_latest_request():
    # 6 blocks of 4 tokens; three sequences of 8 tokens take 2 blocks each.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b, c = make_seq(8, priority=1), make_seq(8, priority=0), make_seq(8, priority=0)
    for seq in (a, b, c):
        scheduler.add(seq)
    run_step(scheduler)
    assert scheduler.block_manager.num_free_blocks == 0
    # Each now needs a third block for its decode: c (lowest priority, latest) goes first.
    step = run_step(scheduler)
    assert step.preempted == [c]
    assert c.status == SequenceStatus.WAITING and c.block_ids == []
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert set(planned(step)) == {a.request_id, b.request_id}


def test_high_priority_arrival_preempts_lower_running_work():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low = make_seq(15, priority=0)
    scheduler.add(low)
    run_step(scheduler)
    urgent = make_seq(6, priority=9)
    scheduler.add(urgent)
    step = run_step(scheduler)
    assert step.preempted == [low]
    assert planned(step) == {urgent.request_id: 6}
    # An equal-priority newcomer would have waited instead.
    scheduler2 = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    low2 = make_seq(15)
    scheduler2.add(low2)
    run_step(scheduler2)
    peer = make_seq(6)
    scheduler2.add(peer)
    step = run_step(scheduler2)
    assert step.preempted == [] and planned(step) == {low2.request_id: 1}


def test_a_step_takes_prompts_of_the_highest_priority_only():
    """Where priorities differ, a step plans prompt chunks of the highest priority with a
    prompt to compute; lower-priority sequences decode, their prompts (part done or not yet
    started) wait, and resume once no higher prompt is left."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    decoding = make_seq(3, priority=0)
    scheduler.add(decoding)
    run_step(scheduler)  # its prompt, whole: it decodes from now on
    long = make_seq(40, priority=0)
    scheduler.add(long)
    assert planned(run_step(scheduler)) == {decoding.request_id: 1, long.request_id: 15}
    urgent = make_seq(20, priority=5)
    scheduler.add(urgent)
    # Running first would have given long the other 15 tokens and urgent none; instead
    # long's prompt waits and urgent takes the 15 the decode leaves.
    assert planned(run_step(scheduler)) == {decoding.request_id: 1, urgent.request_id: 15}
    # urgent still has 5 prompt tokens: a priority-0 newcomer waits with long, budget or not.
    newcomer = make_seq(4, priority=0)
    scheduler.add(newcomer)
    step = run_step(scheduler)
    assert planned(step) == {decoding.request_id: 1, urgent.request_id: 5}
    assert step.chunks[-1].samples and newcomer.status == SequenceStatus.WAITING
    # No priority-5 prompt left: the priority-0 ones take the budget again, running first.
    step = run_step(scheduler)
    assert planned(step) == {urgent.request_id: 1, decoding.request_id: 1, long.request_id: 14}
    assert newcomer.status == SequenceStatus.WAITING  # (no budget left for it)


def test_one_priority_throughout_plans_prompts_as_they_come():
    """The same arrivals at one priority: the running prompt keeps its chunks, as before."""
    scheduler = make_scheduler(max_num_batched_tokens=16)
    decoding, long = make_seq(3), make_seq(40)
    scheduler.add(decoding)
    run_step(scheduler)
    scheduler.add(long)
    run_step(scheduler)
    late = make_seq(20)
    scheduler.add(late)
    assert planned(run_step(scheduler)) == {decoding.request_id: 1, long.request_id: 15}


def test_sequence_cap_limits_running_sequences():
    scheduler = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(3) for _ in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    step = run_step(scheduler)
    assert len(step.chunks) == 2 and scheduler.num_waiting == 1


def test_high_priority_arrival_preempts_at_the_sequence_cap():
    """With blocks to spare but the running set full, a higher-priority arrival takes the
    place of the lowest-priority, latest running sequence in the very next step."""
    scheduler = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    low = [make_seq(3, priority=p) for p in (1, 0, 0)]
    for seq in low:
        scheduler.add(seq)
    run_step(scheduler)
    assert len(scheduler.running) == 3
    urgent = make_seq(5, priority=5)
    scheduler.add(urgent)
    step = run_step(scheduler)
    assert step.preempted == [low[2]]  # priority 0, the later of the two
    assert planned(step) == {low[0].request_id: 1, low[1].request_id: 1, urgent.request_id: 5}
    assert low[2].status == SequenceStatus.WAITING and low[2].num_computed_tokens == 0
    # Priority 1 displaces the other priority-0 sequence; priority 0 then displaces nobody.
    peer = make_seq(2, priority=1)
    scheduler.add(peer)
    step = run_step(scheduler)
    assert step.preempted == [low[1]] and peer.request_id in planned(step)
    late = make_seq(2, priority=1)
    scheduler.add(late)
    step = run_step(scheduler)
    assert step.preempted == [] and late.status == SequenceStatus.WAITING
    # A finished sequence frees a place: the waiting one of highest priority takes it.
    scheduler.finish(urgent, FinishReason.LENGTH)
    step = run_step(scheduler)
    assert late.request_id in planned(step)
    assert low[1].status == low[2].status == SequenceStatus.WAITING


def test_finish_frees_blocks_wherever_the_sequence_is():
    scheduler = make_scheduler(num_blocks=8)
    running, waiting = make_seq(8), make_seq(8)
    scheduler.add(running)
    run_step(scheduler)
    scheduler.add(waiting)
    scheduler.finish(running, FinishReason.ABORT)
    scheduler.finish(waiting, FinishReason.ABORT)
    assert scheduler.block_manager.num_free_blocks == 8
    assert not scheduler.running and scheduler.num_waiting == 0
    step = scheduler.schedule()
    assert step.chunks == [] and step.out_of_blocks == []


def test_sequence_outgrowing_the_whole_pool_finishes_instead_of_preempting_itself_forever():
    scheduler = make_scheduler(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    seq = make_seq(8)  # fills both blocks; its first decode needs a third
    scheduler.add(seq)
    run_step(scheduler)
    step = run_step(scheduler)
    assert step.out_of_blocks == [seq] and step.chunks == [] and step.preempted == []
    assert seq.finish_reason == FinishReason.LENGTH
    assert scheduler.block_manager.num_free_blocks == 2
    assert not scheduler.running and scheduler.num_waiting == 0


# --- steps in flight (pipeline parallel) -----------------------------------------------------


def test_busy_sequences_are_neither_scheduled_nor_preempted():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=32)
    low, high = make_seq(8, priority=0), make_seq(4, priority=1)
    scheduler.add(low)
    first = scheduler.schedule()  # low's step is now in flight, holding 2 of the 4 blocks
    assert planned(first) == {low.request_id: 8}
    scheduler.add(high)
    second = scheduler.schedule(busy={low.seq_id})
    # high fits beside low; low, in flight, is not planned again and not preempted.
    assert planned(second) == {high.request_id: 4}
    waiting = make_seq(12, priority=5)
    scheduler.add(waiting)
    third = scheduler.schedule(busy={low.seq_id, high.seq_id})
    assert third.chunks == [] and third.preempted == []
    assert low.status == high.status == SequenceStatus.RUNNING


def test_a_step_cap_shares_the_running_sequences_among_steps_in_flight():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    seqs = [make_seq(3) for _ in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    first = scheduler.schedule(max_seqs=2)
    busy = {chunk.seq.seq_id for chunk in first.chunks}
    second = scheduler.schedule(busy=busy, max_seqs=2)
    assert len(first.chunks) == len(second.chunks) == 2
    assert busy.isdisjoint(chunk.seq.seq_id for chunk in second.chunks)
