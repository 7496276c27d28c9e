"""How many threads a CPU worker computes with: as many as the cores it actually gets.

Design note. torch's intra-op threads and the C kernels share one OpenMP pool, and every
parallel region ends at a barrier: a step is as slow as its slowest thread. When another
process keeps one of the worker's cores busy, the thread there runs only part of the time
and every region waits for it (measured on a 2-core machine, a single stream with a busy
loop on one core: 2 threads 3.6x slower than quiet, 1 thread 1.8x). So the count follows
the cores the worker gets:

- `cpu_budget()`, at start: the CPUs in the affinity mask (``--cpu-bind`` sets it), capped by
  the cgroup's CPU quota (a Kubernetes CPU limit), rounded up;
- `ThreadGovernor`, while running: every `interval_s`, the time other processes were busy on
  those CPUs (``/proc/stat``'s busy time less this process's own CPU time). When they take
  more than `DOWN_AT` of a core beyond what the threads leave free, one thread fewer; when
  a whole core is free again (within `UP_AT`), one more, up to the budget. Other processes
  keep their fair share of a core even against a spinning thread, so they show up here.
  After an idle spell (no step for `IDLE_S`) the window starts afresh at the next step: what
  ran beside an idle engine (a load client starting up, then waiting on us) says nothing of
  the steps to come. So it does after a step much slower than those like it before
  (`step_trials.SLOW_STEP`: a neighbour came mid-run). The look after a fresh start comes
  within `FIRST_LOOK_S`, not a whole interval, as does the one after a step longer than
  `STALE_S` (its window hides a neighbour that came late in it): a run that starts beside a
  busy neighbour spends about that long at the old count. When a step outlasts such a first
  window, that look comes between two of its layers (the model calls `between_layers`,
  in its one-call C stack too, whose long steps run in parts for it), not after it: the
  prompt's prefill after an idle spell is a single step of half a second, and beside a
  neighbour that came in the spell it ran at two threads to its end (a single stream's TTFT
  1.09-1.26 s against one thread's 0.57-0.71 on the AVX2 Zen 3; 0.66-0.80 s since).
- A thread given up is on trial (`step_trials`): the governor times the steps (`step()`), and
  a drop that made them slower is undone and held, for a prefill chunk computes and two
  threads beside a light neighbour still beat one, where a one-row decode reads memory and
  one thread beats two beside the same neighbour. A step whose count changed between its
  layers is timed as two parts, each scaled to the whole step by the layers it ran, so the
  part before a drop is what the part after it is judged against.

OpenMP's thread count is a per-thread setting (torch keeps it per OS thread too), so the
executor calls `apply()` on each thread that computes, before it computes
(`torch.set_num_threads` runs only where the thread's count differs).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from headrace.worker.execution.step_trials import HOLD_S, StepTime, StepTrials, Verdict

logger = logging.getLogger(__name__)

#: Cores of other processes' busy time (beyond the cores the threads leave free) that take a
#: thread away, and the slack within which a free core gives one back. The gap between
#: them keeps a steady neighbour of ~0.3 cores (a router beside the worker) from flipping
#: the count at every interval.
DOWN_AT = 0.35
UP_AT = 0.2
#: Seconds between two looks. While a neighbour is new, the threads run at the old count
#: for up to this long: a single stream's 3.5 s beside a fresh busy loop measured 0.85x one
#: thread with 0.5 s (2026-11-24, the 2-core dev VM).
INTERVAL_S = 0.25
#: The window of the look after a pause, and the gap between looks that counts as a pause.
#: A tenth of a second is ten of /proc/stat's ticks per CPU: enough to tell a busy core
#: (1.0) from a quiet one (0) against DOWN_AT.
FIRST_LOOK_S = 0.1
STALE_S = 1.0
#: A gap this long between two steps (or applies) is an idle engine, not host work.
IDLE_S = 0.05


def parse_cpu_list(text: str) -> set[int]:
    """CPUs written as Linux writes them ("0-3,6,8-9")."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        first, dash, last = part.partition("-")
        try:
            low, high = int(first), int(last) if dash else int(first)
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0-3,6)") from None
        if low < 0 or high < low:
            raise ValueError(f"not a CPU list: {text!r} (expected e.g. 0-3,6)")
        cpus.update(range(low, high + 1))
    if not cpus:
        raise ValueError("the CPU list is empty")
    return cpus


def bind_process(cpus: set[int]) -> None:
    """Pin every thread of this process (and those it starts later) to ``cpus``."""
    unknown = cpus - set(range(os.cpu_count() or 1))
    if unknown:
        raise ValueError(f"--cpu-bind names CPUs this machine lacks: {sorted(unknown)}")
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cpus)


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cgroup_quota_cores(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPU quota of this process's cgroup in cores (``cpu.max``, or v1's
    ``cfs_quota_us`` / ``cfs_period_us``); None where there is none."""
    for path in _cgroup_dirs(root):
        quota = _read_quota(path)
        if quota is not None:
            return quota
    return None


def cpu_budget(root: Path = Path("/sys/fs/cgroup")) -> int:
    """Threads worth running: the allowed CPUs, capped by the cgroup quota (rounded up, so
    a limit of 1.5 cores gets 2 threads that the quota throttles together)."""
    budget = len(allowed_cpus())
    quota = cgroup_quota_cores(root)
    if quota is not None:
        budget = min(budget, max(1, math.ceil(quota)))
    return budget


@dataclass(slots=True)
class CpuSample:
    """Busy time on the allowed CPUs and this process's CPU time, in seconds, at a moment."""

    at: float
    busy_s: float
    own_s: float


def sample(cpus: list[int], stat: Path = Path("/proc/stat")) -> CpuSample:
    ticks = os.sysconf("SC_CLK_TCK")
    wanted = {f"cpu{cpu}" for cpu in cpus}
    busy = 0
    for line in stat.read_text().splitlines():
        name, *fields = line.split()
        if name in wanted:
            # user nice system idle iowait irq softirq steal ...: all but idle and iowait
            values = [int(value) for value in fields[:8]]
            busy += sum(values) - values[3] - values[4]
    return CpuSample(time.monotonic(), busy / ticks, time.process_time())


def others_cores(before: CpuSample, after: CpuSample) -> float:
    """Cores other processes kept busy on the allowed CPUs between two samples."""
    wall = after.at - before.at
    if wall <= 0:
        return 0.0
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return max(0.0, others / wall)


def next_threads(current: int, budget: int, num_cpus: int, others: float) -> int:
    """The thread count after an interval in which other processes used ``others`` cores."""
    free = num_cpus - others
    if free < current - DOWN_AT and current > 1:
        return current - 1
    if free >= current + 1 - UP_AT and current < budget:
        return current + 1
    return current


@dataclass(slots=True)
class RunningStep:
    """The step under way on the computing thread, from its last split."""

    num_threads: int
    size_class: int
    #: When the part under way began, and the share of the step's layers run before it.
    start: float
    done: float = 0.0

    def split(self, at: float, progress: float) -> StepTime:
        """The part from `start` to ``at`` (``progress`` of the layers run), as a whole step's
        time at its count; the next part starts there."""
        part = StepTime(
            self.num_threads, self.size_class, (at - self.start) / (progress - self.done), at
        )
        self.start, self.done = at, progress
        return part


@dataclass
class ThreadGovernor:
    """The thread count of a one-rank CPU worker, following the cores it gets."""

    #: Most threads (`cpu_budget()`, or the count the user gave).
    budget: int
    #: Seconds between two looks at the CPUs; None keeps the count at `budget` (a count the
    #: user fixed with --cpu-threads).
    interval_s: float | None = INTERVAL_S
    #: The CPUs it may use (the affinity mask).
    cpus: list[int] = field(default_factory=allowed_cpus)
    #: Reads the CPUs' busy time and this process's (`sample`; tests give their own).
    read: Callable[[list[int]], CpuSample] = sample
    #: Now, in `CpuSample.at`'s seconds (`sample` uses time.monotonic; tests give their own).
    clock: Callable[[], float] = time.monotonic
    #: The count now.
    num_threads: int = field(init=False)
    _last: CpuSample | None = field(init=False, default=None)
    #: Whether the next look comes after FIRST_LOOK_S (the first look, or the one after a pause).
    _fresh: bool = field(init=False, default=True)
    #: When a step or an apply() last ran: a longer gap than IDLE_S is an idle spell.
    _last_active: float | None = field(init=False, default=None)
    #: A step since the last look ran much slower than those like it before.
    _slowed: bool = field(init=False, default=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    #: The steps it timed (`step()`), its trial drops and its hold.
    _trials: StepTrials = field(init=False, default_factory=StepTrials)
    #: The step under way (`step()`), None between steps.
    _running: RunningStep | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.num_threads = self.budget

    @contextmanager
    def step(self, num_tokens: int) -> Iterator[None]:
        """Apply the count on the calling thread for a step of ``num_tokens``, and time it."""
        self.apply()
        running = RunningStep(torch.get_num_threads(), num_tokens.bit_length(), self.clock())
        self._running = running
        try:
            yield
        finally:
            self._running = None
        self._last_active = self.clock()
        self._record(running.split(self._last_active, 1.0))

    def between_layers(self, progress: float) -> None:
        """Between two layers of a step, ``progress`` of the way through them: the look that
        ends a fresh window comes here once the window is over, and the step is split there."""
        running, last = self._running, self._last
        if running is None or last is None or not self._fresh or self.interval_s is None:
            return
        if progress <= running.done:  # (one forward a step: its layers only go forward)
            return
        at = self.clock()
        if at - last.at < min(self.interval_s, FIRST_LOOK_S):
            return
        self._record(running.split(at, progress))  # the part before a drop, for its trial
        self._look(between_layers=True)
        self._take_count()
        running.num_threads = self.num_threads

    def _record(self, step: StepTime) -> None:
        with self._lock:  # a look on the other computing thread reads the steps
            self._slowed |= self._trials.record(step)

    def apply(self) -> None:
        """Set the calling thread's OpenMP count to the governor's, looking at the CPUs
        first when an interval has passed."""
        if self.interval_s is not None:
            self._look()
        self._take_count()

    def _take_count(self) -> None:
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _look(self, between_layers: bool = False) -> None:
        last, interval, at = self._last, self.interval_s or 0.0, self.clock()
        # An idle spell says nothing of the steps to come (a load client that started up in
        # it had a core, then waits on us), and the steps before a much slower one little of
        # those after it: after either, a fresh window starts here. (A gap between two
        # layers of one step is no idle spell.)
        active = self._last_active
        idle = not between_layers and active is not None and at - active > IDLE_S
        idle |= self._slowed and not self._fresh
        self._last_active, self._slowed = at, False
        if last is not None and not idle:
            window = min(interval, FIRST_LOOK_S) if self._fresh else interval
            if at - last.at < window:
                return
        if not self._lock.acquire(blocking=False):
            return  # the other computing thread is looking
        try:
            now = self.read(self.cpus)
            if last is not None and not idle:
                self._decide(others_cores(last, now), since=last.at)
            # After a long step the next window is a short one: a neighbour that came late in
            # it was averaged over all of it.
            pause = max(STALE_S, 2 * interval)
            self._last = now
            self._fresh = last is None or idle or now.at - last.at > pause
        finally:
            self._lock.release()

    def _decide(self, others: float, since: float) -> None:
        """The count after a window, from ``since``, in which others used ``others`` cores."""
        from_threads, at = self.num_threads, self.clock()
        verdict = self._trials.judge(at)
        if verdict is Verdict.PENDING:
            return
        if verdict is Verdict.UNDONE:
            assert self._trials.hold is not None
            self.num_threads = self._trials.hold.num_threads
            message = "steps ran slower with %d threads: %d again, held for %.0f s"
            logger.info(message, from_threads, self.num_threads, HOLD_S)
            return
        count = next_threads(from_threads, self.budget, len(self.cpus), others)
        if count < from_threads and self._trials.holds(others, since, at):
            return
        if count != from_threads:
            message = "other processes used %.2f of %d cores: %d threads (of %d)"
            logger.info(message, others, len(self.cpus), count, self.budget)
            self.num_threads = count
        if count < from_threads:
            self._trials.open(from_threads, others, since, at)


def start_governor(cpu_threads: int) -> ThreadGovernor:
    """The governor for EngineConfig's ``cpu_threads``: that many threads, or (0) as many as
    the cores the worker gets, within `cpu_budget()`."""
    if cpu_threads > 0:
        return ThreadGovernor(cpu_threads, interval_s=None)
    return ThreadGovernor(cpu_budget())


def _cgroup_dirs(root: Path) -> list[Path]:
    dirs = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers in ("", "cpu", "cpu,cpuacct", "cpuacct,cpu"):
                sub = "" if controllers == "" else "cpu"
                dirs.append(root / sub / path.lstrip("/"))
    except (OSError, ValueError):
        pass
    return [*dirs, root, root / "cpu"]


def _read_quota(path: Path) -> float | None:
    try:
        if (path / "cpu.max").exists():
            quota, period = (path / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        if (path / "cpu.cfs_quota_us").exists():
            quota_us = int((path / "cpu.cfs_quota_us").read_text())
            period_us = int((path / "cpu.cfs_period_us").read_text())
            return None if quota_us < 0 else quota_us / period_us
    except (OSError, ValueError):
        return None
    return None
