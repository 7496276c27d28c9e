"""The thread governor's trial drops: which steps a drop is judged by, and what a hold keeps."""

from __future__ import annotations

from headrace.worker.execution.step_trials import (
    HOLD_S,
    SLOWER_BY,
    StepTime,
    StepTrials,
    Verdict,
)


def _record(
    trials: StepTrials, num_threads: int, size_class: int, seconds: float, at: float
) -> float:
    """A step of ``seconds`` that starts at ``at``; returns when it ended."""
    trials.record(StepTime(num_threads, size_class, seconds, at + seconds))
    return at + seconds


def test_a_drop_is_judged_by_the_steps_that_ran_beside_the_neighbour() -> None:
    """Regression: a batch run started beside a fresh busy loop right after a quiet one; the
    look's window (1.06 s, others 0.61 cores) held the quiet run's last decodes (57 ms at two
    threads), the drop was judged against them (87 ms at one thread beside the loop),
    undone and held: the run made 0.55x one thread."""
    trials, window_start = StepTrials(), 0.0
    at = window_start
    for _ in range(3):  # the quiet run's last decodes
        at = _record(trials, 2, 5, 0.057, at)
    at = _record(trials, 2, 8, 0.89, at)  # the next run's prefill, beside the loop
    trials.open(2, others=0.61, since=window_start, now=at)
    assert trials.trial is not None and trials.trial.before == {8: [0.89]}
    for _ in range(30):  # its decodes at one thread: no class on both sides
        at = _record(trials, 1, 5, 0.087, at)
    assert trials.judge(at) is Verdict.STANDS


def test_a_drop_that_slowed_the_steps_is_undone_and_holds_only_their_size() -> None:
    trials, at = StepTrials(), 0.0
    at = _record(trials, 2, 12, 1.0, at)
    trials.open(2, others=0.4, since=0.0, now=at)
    assert trials.judge(at) is Verdict.PENDING  # no step since
    at = _record(trials, 1, 12, 1.0 * (1 + 2 * SLOWER_BY), at)
    assert trials.judge(at) is Verdict.UNDONE
    assert trials.hold is not None and trials.hold.num_threads == 2
    since = at
    at = _record(trials, 2, 12, 1.0, at)
    assert trials.holds(0.4, since, at)  # more prefill chunks: held
    at = _record(trials, 2, 1, 0.02, at)
    assert not trials.holds(0.4, since, at)  # decodes too: a trial of their own


def _undo_a_drop(trials: StepTrials, at: float) -> float:
    """A two-thread prefill chunk beside a neighbour of 0.4 cores, then a drop that doubles
    the next chunk's time: undone. Returns the time after."""
    window_start = at
    at = _record(trials, 2, 12, 1.0, at)
    trials.open(2, others=0.4, since=window_start, now=at)
    at = _record(trials, 1, 12, 2.0, at)
    assert trials.judge(at) is Verdict.UNDONE
    return at


def test_a_hold_ends_with_its_time_or_a_bigger_neighbour() -> None:
    trials = StepTrials()
    at = _undo_a_drop(trials, 0.0)
    assert trials.holds(0.5, since=at, now=at)
    assert not trials.holds(0.7, since=at, now=at)
    at = _undo_a_drop(trials, at)
    assert not trials.holds(0.4, since=at, now=at + HOLD_S)


def test_a_step_much_slower_than_those_like_it_is_flagged() -> None:
    trials, at = StepTrials(), 0.0
    for _ in range(4):
        assert not trials.record(StepTime(2, 1, 0.02, at))
    assert not trials.record(StepTime(1, 1, 0.05, at))  # another count: nothing to compare
    assert trials.record(StepTime(2, 1, 0.05, at))
