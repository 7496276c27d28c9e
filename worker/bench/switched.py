"""The same workload on one engine with a feature switched off and on, rounds alternating.

Two engines built apart measured 5-15% apart on this project's 2-core machine in either
role, whichever was built second running faster; so one engine runs both sides, the feature
switched between runs. Each round runs the pair in the other order than the last (the
host's speed drifts between runs); a caller sets each round's on-run against its off-run.
"""

from __future__ import annotations

from collections.abc import Callable

from headrace.worker.bench.common import Report, Workload
from headrace.worker.engine.engine import Engine


def alternate(
    engine: Engine,
    workload: Workload,
    rounds: int,
    switch: Callable[[bool], None],
    names: tuple[str, str],
    run_headrace: Callable[..., Report],
) -> list[tuple[Report, Report]]:
    """``rounds`` (off, on) pairs of runs of ``workload`` (``run_headrace``: `bench engine`'s),
    ``switch(on)`` before each run; ``names``: the off and on runs'. Leaves it switched on."""
    pairs: list[tuple[Report, Report]] = []
    try:
        for i in range(rounds):  # which runs first alternates too
            runs = {}
            for on in (True, False) if i % 2 else (False, True):
                switch(on)
                runs[on] = run_headrace(engine, workload, names[on])
            pairs.append((runs[False], runs[True]))
    finally:
        switch(True)
    return pairs
