"""The CPU worker's thread count: its budget from affinity and cgroup quota, and the governor
that follows the cores other processes leave it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from headrace.kernels.backend import select_kernels
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.bench.neighbour import busy_neighbour
from headrace.worker.config import EngineConfig
from headrace.worker.execution import cpu_threads
from headrace.worker.execution.cpu_threads import (
    FIRST_LOOK_S,
    CpuSample,
    ThreadGovernor,
    cgroup_quota_cores,
    next_threads,
    others_cores,
    parse_cpu_list,
    sample,
)
from headrace.worker.execution.step_trials import HOLD_S, TRIAL_S
from headrace.worker.models.registry import load_model

from tests.factories import cached_checkpoint
from tests.kernels import needs_c_compiler
from tests.worker.test_models import PagedSequences


def test_cpu_lists_read_as_linux_writes_them() -> None:
    assert parse_cpu_list("0-3,6,8-9") == {0, 1, 2, 3, 6, 8, 9}
    assert parse_cpu_list("5") == {5}
    for bad in ("", "a", "3-1", "-2", "1,,x"):
        with pytest.raises(ValueError, match="CPU list"):
            parse_cpu_list(bad)


def test_a_bad_cpu_bind_or_thread_count_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError, match="cpu_bind"):
        EngineConfig("unused", cpu_bind="0-x")
    with pytest.raises(InvalidArgumentError, match="cpu_threads"):
        EngineConfig("unused", cpu_threads=-1)


@pytest.mark.parametrize(
    ("files", "cores"),
    [
        ({"cpu.max": "150000 100000\n"}, 1.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({}, None),
    ],
)
def test_the_cgroup_quota_in_cores(tmp_path: Path, files: dict[str, str], cores) -> None:  # type: ignore[no-untyped-def]
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_quota_cores(tmp_path) == cores


def test_the_budget_is_the_allowed_cpus_within_the_quota(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: [0, 1, 2, 3])
    assert cpu_threads.cpu_budget(tmp_path) == 4  # no quota
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cpu_threads.cpu_budget(tmp_path) == 2  # 1.5 cores: two threads, throttled together
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert cpu_threads.cpu_budget(tmp_path) == 1


def test_others_busy_time_is_the_cpus_busy_time_less_our_own() -> None:
    before = CpuSample(at=10.0, busy_s=100.0, own_s=5.0)
    after = CpuSample(at=12.0, busy_s=103.0, own_s=6.0)  # 3 s busy, 1 s of it ours, in 2 s
    assert others_cores(before, after) == pytest.approx(1.0)
    assert others_cores(after, after) == 0.0


def test_proc_stat_busy_time_counts_only_the_allowed_cpus(tmp_path: Path) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        f"cpu  {9 * ticks} 0 0 0 0 0 0 0 0 0\n"
        f"cpu0 {ticks} {ticks} {ticks} {50 * ticks} {7 * ticks} 0 0 {ticks} 0 0\n"
        f"cpu1 {5 * ticks} 0 0 0 0 0 0 0 0 0\n"
    )
    assert sample([0], stat).busy_s == pytest.approx(4.0)  # idle and iowait are not busy
    assert sample([0, 1], stat).busy_s == pytest.approx(9.0)


@pytest.mark.parametrize(
    ("current", "others", "expected"),
    [
        (2, 0.0, 2),  # quiet
        (2, 0.5, 1),  # a busy loop sharing a core with a spinning thread gets half of it
        (2, 0.3, 2),  # a light neighbour (a router) does not flip the count
        (1, 1.0, 1),  # the neighbour holds its core: stay at one
        (1, 0.1, 2),  # it left: a core is free again
        (1, 0.3, 1),  # between the two thresholds: no change
        (1, 1.9, 1),  # never below one
    ],
)
def test_threads_follow_the_cores_others_leave(current: int, others: float, expected: int) -> None:
    assert next_threads(current, budget=2, num_cpus=2, others=others) == expected


def test_a_thread_comes_back_only_up_to_the_budget() -> None:
    assert next_threads(2, budget=2, num_cpus=4, others=0.0) == 2


def test_a_fixed_count_is_applied_to_the_calling_thread_and_kept() -> None:
    before = torch.get_num_threads()
    try:
        governor = ThreadGovernor(1, interval_s=None)
        governor.apply()
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        governor.apply()  # something else changed it: set again
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class FakeCpus:
    """The CPUs' busy time as a test scripts it: `others` busy cores from `at` on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.others = 0.0

    def advance(self, seconds: float, others: float | None = None) -> None:
        self.others = self.others if others is None else others
        self.now += seconds
        self.busy += self.others * seconds

    def read(self, cpus: list[int]) -> CpuSample:
        return CpuSample(self.now, self.busy, 0.0)

    def clock(self) -> float:
        return self.now


def _scripted_governor() -> tuple[ThreadGovernor, FakeCpus]:
    """Two threads on two CPUs whose busy time, and the clock, a test scripts."""
    cpus = FakeCpus()
    return ThreadGovernor(2, interval_s=0.25, cpus=[0, 1], read=cpus.read, clock=cpus.clock), cpus


def _counts(
    governor: ThreadGovernor, cpus: FakeCpus, steps: list[tuple[float, float]]
) -> list[int]:
    """The thread count after each step (seconds, others' busy cores), as the executor runs
    them: the step at the governor's count, then apply() for the sampling after it."""
    before = torch.get_num_threads()
    try:
        counts = []
        for seconds, others in steps:
            with governor.step(1):
                cpus.advance(seconds, others)
            governor.apply()
            counts.append(torch.get_num_threads())
        return counts
    finally:
        torch.set_num_threads(before)


def test_the_governor_gives_a_thread_up_and_takes_it_back_as_a_neighbour_comes_and_goes() -> None:
    # Others' busy cores per interval: quiet, a busy loop sharing a core, the loop alone on
    # its core, quiet again.
    governor, cpus = _scripted_governor()
    steps = [(0.25, others) for others in (0.0, 0.0, 0.6, 1.0, 1.0, 0.05)]
    assert _counts(governor, cpus, steps) == [2, 2, 1, 1, 1, 2]


def test_a_neighbour_that_came_while_the_engine_was_idle_is_seen_a_first_look_later() -> None:
    """Regression: the look after an idle spell averaged over the spell, so a busy loop that
    started a moment before the next request kept 2 threads for a whole interval more (a
    single stream beside it ran at 0.89x one thread)."""
    governor, cpus = _scripted_governor()
    assert _counts(governor, cpus, [(0.25, 0.0), (0.25, 0.0)]) == [2, 2]
    cpus.advance(9.5, 0.0)  # idle: no step looks
    cpus.advance(0.5, 1.0)  # the loop starts; then a request, a step every FIRST_LOOK_S
    assert _counts(governor, cpus, [(0.0, 1.0), (FIRST_LOOK_S + 0.01, 1.0)]) == [2, 1]


def test_what_ran_while_the_engine_was_idle_takes_no_thread_away() -> None:
    """Regression: a served burst's load client starts up (a core for seconds) while the
    engine waits for its requests; the first look averaged over that spell and gave a thread
    up for the burst's first prefill."""
    governor, cpus = _scripted_governor()
    assert _counts(governor, cpus, [(0.25, 0.0), (0.25, 0.0)]) == [2, 2]
    cpus.advance(5.0, 1.0)  # the client starting up beside an idle engine
    assert _counts(governor, cpus, [(0.05, 0.1)] * 10) == [2] * 10


def test_a_step_longer_than_an_interval_is_judged_by_its_own_window() -> None:
    # A long prefill step (2 s) beside a busy neighbour: the look after it sees the neighbour.
    governor, cpus = _scripted_governor()
    steps = [(0.25, 0.0), (0.25, 0.0), (2.0, 1.0)]
    assert _counts(governor, cpus, steps) == [2, 2, 1]


def _timed_counts(
    governor: ThreadGovernor,
    cpus: FakeCpus,
    seconds: dict[int, float],
    others: float,
    num_steps: int,
    num_tokens: int = 1,
) -> list[int]:
    """The thread count each of ``num_steps`` steps ran with, a step taking ``seconds[count]``
    beside ``others`` busy cores."""
    before = torch.get_num_threads()
    try:
        counts = []
        for _ in range(num_steps):
            with governor.step(num_tokens):
                counts.append(torch.get_num_threads())
                cpus.advance(seconds[counts[-1]], others)
        return counts
    finally:
        torch.set_num_threads(before)


def test_a_drop_that_slows_the_steps_is_undone_and_held() -> None:
    """Regression: a served burst's router and load client (a third of a core) took a thread
    away, and its prefill steps, compute-bound, ran at one thread: 0.96x vLLM's tok/s where
    two fixed threads made 1.08x."""
    governor, cpus = _scripted_governor()
    steps = {2: 0.05, 1: 0.1}  # two threads beat one beside this neighbour
    counts = _timed_counts(governor, cpus, steps, others=0.4, num_steps=12)
    assert counts[:2] == [2, 2] and 1 in counts  # given up at the first look...
    assert counts[-1] == 2  # ...and taken back at the look after
    assert set(_timed_counts(governor, cpus, steps, others=0.4, num_steps=40)) == {2}  # held
    # The neighbour grows by HOLD_MARGIN: the hold ends and one thread is faster now.
    steps = {2: 0.15, 1: 0.1}
    assert _timed_counts(governor, cpus, steps, others=0.7, num_steps=20)[-1] == 1


def test_a_held_count_is_tried_again_after_the_hold() -> None:
    governor, cpus = _scripted_governor()
    _timed_counts(governor, cpus, {2: 0.05, 1: 0.1}, others=0.4, num_steps=12)
    num_steps = round(HOLD_S / 0.05) + 10
    counts = _timed_counts(governor, cpus, {2: 0.05, 1: 0.01}, others=0.4, num_steps=num_steps)
    assert counts[-1] == 1


def test_a_drop_that_speeds_the_steps_up_stands() -> None:
    # A busy loop on one core: every region waits for the thread that shares it.
    governor, cpus = _scripted_governor()
    counts = _timed_counts(governor, cpus, {2: 0.06, 1: 0.02}, others=1.0, num_steps=40)
    assert counts[-30:] == [1] * 30


def test_a_neighbour_that_comes_mid_run_is_seen_a_first_look_after_the_first_slow_step() -> None:
    governor, cpus = _scripted_governor()
    _timed_counts(governor, cpus, {2: 0.02, 1: 0.03}, others=0.0, num_steps=56)
    # It comes late in an interval: the look that ends it averages it over the quiet part.
    counts = _timed_counts(governor, cpus, {2: 0.06, 1: 0.025}, others=1.0, num_steps=12)
    assert counts.count(2) <= 3 and counts[-1] == 1


def test_a_drop_with_no_step_of_a_size_seen_before_stands() -> None:
    governor, cpus = _scripted_governor()
    _timed_counts(governor, cpus, {2: 0.05, 1: 0.1}, others=1.0, num_steps=2, num_tokens=1)
    # Prefill chunks from the first look on (the drop), slower than the decodes before it.
    num_steps = round(TRIAL_S / 0.1) + 5
    counts = _timed_counts(governor, cpus, {2: 0.05, 1: 0.1}, 1.0, num_steps, num_tokens=512)
    assert counts == [1] * num_steps


def _layered_step(
    governor: ThreadGovernor,
    cpus: FakeCpus,
    layer_s: dict[int, float],
    others: float,
    num_layers: int = 10,
) -> list[int]:
    """One step of ``num_layers`` layers, each taking ``layer_s[count]`` beside ``others``
    busy cores, as a forward runs them (the model's call before each layer but the
    first); the count each layer ran with."""
    counts = []
    with governor.step(512):
        for index in range(num_layers):
            if index:
                governor.between_layers(index / num_layers)
            counts.append(torch.get_num_threads())
            cpus.advance(layer_s[counts[-1]], others)
    return counts


def test_the_first_step_after_an_idle_spell_looks_between_its_layers() -> None:
    """Regression: a prompt's prefill after an idle spell is one long step, and it ran at two
    threads to its end beside a neighbour that came in the spell (a single stream's TTFT
    1.09-1.26 s beside a busy loop, one thread's 0.57-0.71)."""
    governor, cpus = _scripted_governor()
    before = torch.get_num_threads()
    try:
        _counts(governor, cpus, [(0.25, 0.0), (0.25, 0.0)])
        cpus.advance(5.0, 1.0)  # idle, and a busy loop starts
        counts = _layered_step(governor, cpus, {2: 0.05, 1: 0.03}, others=1.0)
        # The fresh window (FIRST_LOOK_S) ends in the third layer: the fourth has one thread.
        assert counts == [2, 2, 2] + [1] * 7
        # The drop made the layers faster: it stands at the next steps' looks.
        assert _counts(governor, cpus, [(0.1, 1.0)] * 10) == [1] * 10
    finally:
        torch.set_num_threads(before)


def test_a_drop_between_layers_that_slows_them_is_undone() -> None:
    """The step's parts before and after the drop are its trial: beside a light neighbour
    (a third of a core), two threads still compute a prefill faster than one."""
    governor, cpus = _scripted_governor()
    before = torch.get_num_threads()
    try:
        _counts(governor, cpus, [(0.25, 0.0), (0.25, 0.0)])
        cpus.advance(5.0, 0.4)
        first = _layered_step(governor, cpus, {2: 0.05, 1: 0.1}, others=0.4)
        assert first[0] == 2 and first[-1] == 1
        second = _layered_step(governor, cpus, {2: 0.05, 1: 0.1}, others=0.4)
        assert second[-1] == 2  # undone at the look the next step starts with
    finally:
        torch.set_num_threads(before)


def test_only_a_fresh_window_looks_between_layers() -> None:
    # A steady run: its long steps are judged after each, by the trials, never split.
    governor, cpus = _scripted_governor()
    before = torch.get_num_threads()
    try:
        _counts(governor, cpus, [(0.1, 0.0)] * 6)
        counts = _layered_step(governor, cpus, {2: 0.05, 1: 0.03}, others=1.0)
        assert counts == [2] * 10
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_c_compiler)])
def test_a_watched_forward_looks_between_its_layers_and_computes_the_same(backend: str) -> None:
    """The model calls the governor's look between two layers, in order, in the per-op
    forward and in the C kernels' one-call stack, which runs a step of 130 rows in parts for
    it where its tiles take that many (float32: AVX-512's, up to 320), and the logits are an
    unwatched forward's, bit for bit. Regression: the look came from forward hooks on the
    layers, which the stack never runs, so a prefill there ran at two threads to its end."""
    path = cached_checkpoint("llama", num_layers=4)
    cpu = torch.device("cpu")
    kernels = select_kernels(backend, cpu)
    seen: list[float] = []
    logits = []
    for watched in (False, True):
        model = load_model(path, torch.float32, cpu, kernels=kernels).model
        if watched:
            model.watch_layers(seen.append)
        paged = PagedSequences.allocate(model, [130])
        logits.append(paged.step(model, [list(range(3, 131))], [0]))
    assert seen == [0.25, 0.5, 0.75]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_busy_loop_on_a_cpu_takes_a_thread_away() -> None:
    cpus = sorted(os.sched_getaffinity(0))[-2:]
    governor = ThreadGovernor(2, interval_s=0.3, cpus=cpus)
    before = torch.get_num_threads()
    try:
        with busy_neighbour(cpus[-1]):
            assert _settles(governor, 1)
    finally:
        torch.set_num_threads(before)


def _settles(governor: ThreadGovernor, count: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        governor.apply()
        if governor.num_threads == count == torch.get_num_threads():
            return True
        time.sleep(0.01)  # an engine between steps: not idle (IDLE_S)
    return False
