"""A feature switched off and on in one engine, rounds alternating (`switched.alternate`),
and the multi-step decode comparison built on it (`multi_step.compare_decode_steps`)."""

from __future__ import annotations

from headrace.worker import EngineConfig
from headrace.worker.bench.common import Report, Workload, make_workload
from headrace.worker.bench.engine import run_headrace
from headrace.worker.bench.multi_step import compare_decode_steps
from headrace.worker.bench.switched import alternate
from headrace.worker.engine.engine import Engine

from tests.factories import cached_checkpoint


def test_rounds_alternate_which_side_runs_first_and_end_switched_on():
    switched: list[bool] = []
    ran: list[str] = []

    def run(_engine: Engine, _workload: Workload, name: str) -> Report:
        ran.append(name)
        return Report(name, 1.0, 10)

    workload = Workload([[1]], [1])
    pairs = alternate(None, workload, 3, switched.append, ("off", "on"), run)  # type: ignore[arg-type]
    assert ran == ["off", "on", "on", "off", "off", "on"]
    assert [(off.name, on.name) for off, on in pairs] == [("off", "on")] * 3
    assert switched == [False, True, True, False, False, True, True]  # left on


def test_multi_step_runs_against_one_run_a_step_give_the_same_tokens():
    config = EngineConfig(model=str(cached_checkpoint()), dtype="float32", num_decode_steps=4)
    engine = Engine(config)
    workload = make_workload(engine.vocab_size, 2, (8, 8), (13, 13), seed=5)
    reports: list[Report] = []

    def run(*args, **kwargs) -> Report:
        reports.append(run_headrace(*args, **kwargs))
        return reports[-1]

    summary = compare_decode_steps(engine, workload, 2, run)
    assert summary["multi_step_same_tokens"] is True
    assert summary["decode_steps"] == 4 and len(summary["ratio_multi_step_tok_s_rounds"]) == 2
    # 12 tokens a request after its prompt's: 12 decode steps of one run each with it off,
    # 3 of four runs with it on; rounds (off, on) then (on, off)
    names = ["headrace, one run a step", "headrace, multi-step"]
    assert [r.name for r in reports] == [*names, *reversed(names)]
    assert [len(r.decode_step_s) for r in reports] == [12, 3, 3, 12]
    assert all(r.token_ids == reports[0].token_ids for r in reports)
