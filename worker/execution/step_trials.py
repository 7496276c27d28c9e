"""Whether giving up a thread made a CPU worker's steps faster: the steps the thread governor
times, its trial drops, and the hold after a drop it undid.

Design note. Whether one thread fewer is faster beside a neighbour depends on the steps as
much as on the neighbour. A one-row decode reads memory, and one core reads most of what two
do, so even a light neighbour costs two threads more than the second core gives; a prefill
chunk computes, and two threads beside a neighbour that takes a third of a core (the router
and a load client in a served burst) still beat one. So every drop is a `Trial`: the last
`TRIAL_STEPS` steps of each size class before it (of the window that showed the neighbour,
those that ended after it came) are compared with the steps after it, class by class; when
the steps after run `SLOWER_BY` slower, the governor takes the thread back, and a `Hold`
keeps it while the steps are of the classes compared, for `HOLD_S`, unless the neighbour
grows by `HOLD_MARGIN`. Steps of another class (decodes after the prefill that was compared)
get a trial of their own.
"""

from __future__ import annotations

import enum
import statistics
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

#: A trial drop is undone when the steps after it run this much slower than those before it
#: (a step's time swings by about a tenth on a quiet machine); the steps compared before it:
#: the last `TRIAL_STEPS` of each size class. A trial with no class on both sides after
#: `TRIAL_S` stands.
SLOWER_BY = 0.1
TRIAL_STEPS = 4
TRIAL_S = 2.0
#: After an undone drop: how long the count is held, and how much more others must take
#: (cores) to end the hold early.
HOLD_S = 10.0
HOLD_MARGIN = 0.25
#: A step this many times slower than the last `TRIAL_STEPS` of its size at its count is a
#: sign that a neighbour came (a step's time swings by a fifth on a quiet machine).
SLOW_STEP = 1.5


@dataclass(slots=True)
class StepTime:
    """One step as the governor saw it."""

    num_threads: int
    #: The bit length of its token count: steps of one class take about as long.
    size_class: int
    seconds: float
    #: When it ended, on the governor's clock.
    ended: float


@dataclass(slots=True)
class Trial:
    """A thread given up, until the steps after the drop are compared with those before."""

    from_threads: int
    #: Others' busy cores at the drop.
    others: float
    #: Size class -> the last step times at ``from_threads`` before the drop.
    before: dict[int, list[float]]
    started: float


@dataclass(slots=True)
class Hold:
    """``num_threads`` are kept while the steps are of ``size_classes``, before ``until``,
    and others take less than ``others`` + HOLD_MARGIN."""

    num_threads: int
    others: float
    until: float
    size_classes: set[int]


class Verdict(enum.Enum):
    """What the look after a drop makes of it (STANDS too when no trial is open)."""

    PENDING = enum.auto()
    STANDS = enum.auto()
    UNDONE = enum.auto()


def slowdown(trial: Trial, after: list[StepTime]) -> tuple[float, set[int]] | None:
    """How much slower the steps after a trial drop ran than those before it (the median over
    the size classes on both sides of the ratio of their median times), and those classes;
    None while no class is on both sides."""
    ratios, classes = [], set()
    for size_class, before in trial.before.items():
        times = [step.seconds for step in after if step.size_class == size_class]
        if times:
            ratios.append(statistics.median(times) / statistics.median(before))
            classes.add(size_class)
    return (statistics.median(ratios), classes) if ratios else None


@dataclass
class StepTrials:
    """The governor's record of its steps, its open trial and its hold."""

    #: The latest steps, newest last.
    steps: deque[StepTime] = field(default_factory=lambda: deque(maxlen=256))
    trial: Trial | None = None
    hold: Hold | None = None

    def record(self, step: StepTime) -> bool:
        """Keep the step; True when it ran `SLOW_STEP` times slower than those like it."""
        recent = islice(reversed(self.steps), 4 * TRIAL_STEPS)
        key = (step.num_threads, step.size_class)
        like = [s.seconds for s in recent if (s.num_threads, s.size_class) == key]
        self.steps.append(step)
        like = like[:TRIAL_STEPS]
        return len(like) == TRIAL_STEPS and step.seconds > SLOW_STEP * statistics.median(like)

    def open(self, from_threads: int, others: float, since: float, now: float) -> None:
        """Start a trial of a drop from ``from_threads`` after a window from ``since`` in which
        others used ``others`` cores. It is judged against the steps that ended after the
        neighbour came: one that takes a core and stays came at the latest ``1 - others`` of
        the way into the window; steps before then ran beside less (the end of a quiet run
        just before).
        """
        came = since + (1.0 - min(others, 1.0)) * (now - since)
        before: dict[int, list[float]] = {}
        for step in reversed(self.steps):
            if step.ended < came:
                break
            if step.num_threads != from_threads:
                continue
            times = before.setdefault(step.size_class, [])
            if len(times) < TRIAL_STEPS:
                times.append(step.seconds)
        self.trial = Trial(from_threads, others, before, now) if before else None

    def judge(self, now: float) -> Verdict:
        """The open trial's verdict; an undone one starts a hold."""
        trial = self.trial
        if trial is None:
            return Verdict.STANDS
        after = [
            s for s in self.steps if s.ended > trial.started and s.num_threads < trial.from_threads
        ]
        found = slowdown(trial, after)
        if found is None and now - trial.started < TRIAL_S:
            return Verdict.PENDING
        self.trial = None
        if found is None or found[0] <= 1 + SLOWER_BY:
            return Verdict.STANDS
        self.hold = Hold(trial.from_threads, trial.others, now + HOLD_S, found[1])
        return Verdict.UNDONE

    def holds(self, others: float, since: float, now: float) -> bool:
        """Whether the hold keeps a thread that ``others`` would take, for the steps that
        ended since ``since``."""
        hold = self.hold
        if hold is None or now >= hold.until or others >= hold.others + HOLD_MARGIN:
            self.hold = None
            return False
        classes = {step.size_class for step in self.steps if step.ended >= since}
        return classes <= hold.size_classes
