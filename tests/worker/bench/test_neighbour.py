"""The bench's busy neighbour: it spins, and it dies with the bench; its runs share no
prefix cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from headrace.worker.bench.neighbour import neighbour_configs
from headrace.worker.config import EngineConfig

from tests.worker.bench.processes import cpu_seconds, stat_fields

_BENCH = """
import os, time
from headrace.worker.bench.neighbour import busy_neighbour
with busy_neighbour(sorted(os.sched_getaffinity(0))[-1]) as pid:
    print(pid, flush=True)
    time.sleep(60)
"""


def _cpu_seconds(pid: int) -> float:
    seconds = cpu_seconds(pid)
    assert seconds is not None
    return seconds


def _running(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def test_the_busy_loop_spins_and_dies_with_a_killed_bench() -> None:
    """Regression: a bench killed by a signal ran no ``finally`` and left its loop spinning
    on a core, where the next bench's quiet runs met it (and its governor rightly ran them
    at one thread)."""
    bench = subprocess.Popen([sys.executable, "-c", _BENCH], stdout=subprocess.PIPE, text=True)
    try:
        assert bench.stdout is not None
        loop = int(bench.stdout.readline())
        before = _cpu_seconds(loop)
        time.sleep(0.5)
        assert _cpu_seconds(loop) - before > 0.2  # it spins
    finally:
        bench.send_signal(signal.SIGKILL)
        bench.wait()
    deadline = time.monotonic() + 10
    while _running(loop) and time.monotonic() < deadline:
        time.sleep(0.05)
    orphaned = _running(loop)
    if orphaned:
        os.kill(loop, signal.SIGKILL)  # not for the tests after this one
    assert not orphaned


def test_no_run_beside_the_neighbour_reuses_another_runs_prefill() -> None:
    """The adaptive engine runs the workload quiet, then noisy: with its prefix cache the
    noisy run would skip the prefill the quiet one paid for."""
    configs = neighbour_configs(EngineConfig("unused", device="cpu", cpu_threads=0), fixed=2)
    assert {name: c.cpu_threads for name, c in configs.items()} == {
        "adaptive": 0,
        "one": 1,
        "fixed": 2,
    }
    assert not any(c.enable_prefix_caching for c in configs.values())
