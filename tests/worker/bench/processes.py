"""What the bench tests read of processes: a process's /proc fields and CPU time, and a peer
bench's turns without the wait for quiet CPUs (the tests' runs are fakes and tiny, and the
machine running the suite is never quiet: its other test process computes)."""

from __future__ import annotations

import os

from headrace.worker.bench.peers import Quiet


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def cpu_seconds(pid: int) -> float | None:
    """The process's user and system CPU time; None once it is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def no_wait() -> Quiet:
    return Quiet(0.0, 0.0)
