"""The waiting queue's order (`EngineConfig.scheduling_policy`): "fcfs" by arrival, and
"shortest-first", the fewest tokens first among requests that arrive together, never ahead of
one that arrived a window (`shortest_first_window_s`) earlier."""

from __future__ import annotations

import pytest
from headrace.sdk import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker import Engine, EngineConfig
from headrace.worker.scheduling.block_manager import BlockManager
from headrace.worker.scheduling.scheduler import Scheduler
from headrace.worker.sequence import Sequence

from tests.factories import build_checkpoint
from tests.worker.seqs import make_seq
from tests.worker.test_scheduler import planned, run_step

MAX_MODEL_LEN = 100


def make_scheduler(policy: str, budget: int = 16, window_s: float = 1.0) -> Scheduler:
    config = EngineConfig(
        model="unused",
        block_size=4,
        max_num_batched_tokens=budget,
        scheduling_policy=policy,
        shortest_first_window_s=window_s,
    )
    return Scheduler(config, BlockManager(64, 4, True), max_model_len=MAX_MODEL_LEN)


def arriving(num_tokens: int, at_s: float, priority: int = 0) -> Sequence:
    seq = make_seq(num_tokens, priority=priority)
    seq.arrival_s = at_s
    return seq


def first_step(scheduler: Scheduler, *seqs: Sequence) -> dict[str, int]:
    """The prompt tokens the first step plans for each request: admitted in order until the
    budget runs out, so the last one admitted may get only part of its prompt."""
    for seq in seqs:
        scheduler.add(seq)
    return planned(run_step(scheduler))


def test_fcfs_starts_a_burst_in_arrival_order():
    long, short, mid = arriving(12, 0.000), arriving(3, 0.001), arriving(7, 0.002)
    step = first_step(make_scheduler("fcfs"), long, short, mid)
    # the budget of 16: the long prompt whole, the short one whole, one token of the third
    assert step == {long.request_id: 12, short.request_id: 3, mid.request_id: 1}


def test_shortest_first_starts_a_burst_shortest_prompt_first():
    long, short, mid = arriving(12, 0.000), arriving(3, 0.001), arriving(7, 0.002)
    step = first_step(make_scheduler("shortest-first"), long, short, mid)
    # 3 + 7 tokens, then the first 6 of the long prompt fill the budget
    assert step == {short.request_id: 3, mid.request_id: 7, long.request_id: 6}


@pytest.mark.parametrize(
    ("short_at_s", "short_first"),
    [
        (0.5, True),  # its key 0.5 + 0.02 is before the long one's 0 + 0.9
        (0.95, False),  # within the window, but its key 0.97 is after 0.9
        (1.01, False),  # more than a window later: never ahead, whatever the lengths
    ],
)
def test_shortest_first_goes_ahead_only_of_requests_that_arrived_within_the_window(
    short_at_s: float, short_first: bool
):
    """A request of n tokens counts as arriving window * n / max_model_len later (window 1 s,
    max_model_len 100): the long prompt of 90 tokens at 0.9 s, the short one of 2 at its
    arrival + 0.02 s."""
    long, short = arriving(90, 0.0), arriving(2, short_at_s)
    step = first_step(make_scheduler("shortest-first"), long, short)
    # the first admitted takes the budget: the short prompt whole, or 16 of the long one's
    expected = {short.request_id: 2, long.request_id: 14} if short_first else {long.request_id: 16}
    assert step == expected


def test_shortest_first_keeps_priority_first():
    low_short, high_long = arriving(2, 0.0, priority=0), arriving(15, 0.001, priority=5)
    step = first_step(make_scheduler("shortest-first"), low_short, high_long)
    assert step == {high_long.request_id: 15, low_short.request_id: 1}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("scheduling_policy", "sjf", "must be one of fcfs, shortest-first, got 'sjf'"),
        ("shortest_first_window_s", 0.0, "must be a finite number > 0, got 0.0"),
        # an infinite window would push every key to inf: arrival order, not shortest first
        ("shortest_first_window_s", float("inf"), "must be a finite number > 0, got inf"),
    ],
)
def test_a_bad_policy_or_window_names_the_field(field: str, value: object, message: str):
    with pytest.raises(InvalidArgumentError, match=field) as raised:
        EngineConfig(model="unused", **{field: value})  # type: ignore[arg-type]
    assert message in str(raised.value)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("policy"), family="llama")


def run_burst(checkpoint, policy: str) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Three prompts added together, the longest first, on a budget of 16 tokens: the step at
    which each request's first token came, and each request's tokens."""
    engine = Engine(
        EngineConfig(
            model=str(checkpoint),
            dtype="float32",
            max_model_len=64,
            max_num_batched_tokens=16,
            scheduling_policy=policy,
        )
    )
    prompts = {"long": list(range(3, 43)), "mid": list(range(50, 70)), "short": [7, 8, 9, 10]}
    config = GenerationConfig(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        for request_id, prompt in prompts.items():
            engine.add_request(request_id, prompt, config)
        first_step_of: dict[str, int] = {}
        tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            for output in engine.step():
                for sample in output.samples:
                    if sample.token_ids:
                        first_step_of.setdefault(output.request_id, step)
                    tokens[output.request_id] += sample.token_ids
        return first_step_of, tokens
    finally:
        engine.close()


def test_a_burst_gets_its_short_prompts_answered_first_with_the_same_tokens(checkpoint):
    fcfs_first, fcfs_tokens = run_burst(checkpoint, "fcfs")
    shortest_first, shortest_tokens = run_burst(checkpoint, "shortest-first")
    # fcfs: the long prompt's 40 tokens fill three steps before the others start
    assert fcfs_first["long"] < fcfs_first["mid"] and fcfs_first["long"] < fcfs_first["short"]
    # shortest-first: 4 + 12 of 20 in step 1, the rest of mid's in step 2; long from then on
    assert shortest_first["short"] < shortest_first["mid"] < shortest_first["long"]
    assert shortest_first["short"] == 1
    assert shortest_tokens == fcfs_tokens
    assert all(len(t) == 4 for t in fcfs_tokens.values())
