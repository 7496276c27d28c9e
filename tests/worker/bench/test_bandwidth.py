"""The single stream against its weight read: each one-row step beside a read made right after
it (`ReadsBeside`), from the bench run's per-step hook."""

from __future__ import annotations

import pytest
from headrace.worker import EngineConfig
from headrace.worker.bench.bandwidth import ReadsBeside
from headrace.worker.bench.common import make_workload
from headrace.worker.bench.engine import run_headrace
from headrace.worker.engine.engine import Engine

from tests.factories import cached_checkpoint


def test_each_decode_step_is_set_beside_the_read_made_after_it():
    rates = iter([100.0, 400.0, 200.0])  # bytes per second, one read per decode step
    reads = ReadsBeside(num_bytes=100, read=lambda: next(rates))
    reads.after_step(5.0, is_decode=False)  # a prefill step: no read
    reads.after_step(2.0, is_decode=True)  # read 1.0 s -> 2.0x
    reads.after_step(1.0, is_decode=True)  # read 0.25 s -> 4.0x
    reads.after_step(1.5, is_decode=True)  # read 0.5 s -> 3.0x
    assert reads.pairs == [(2.0, 100.0), (1.0, 400.0), (1.5, 200.0)]
    summary = reads.summary()
    # The median of the pairs' ratios, not the median step over the median read (1.5 / 0.5).
    assert summary["ratio_step_weight_read"] == 3.0
    assert summary["weight_read_ms"] == 500.0  # 100 bytes at the median rate, 200/s


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model=str(cached_checkpoint()), dtype="float32"))


def _run_recording(engine: Engine, max_tokens: int) -> list[bool]:
    workload = make_workload(engine.vocab_size, 1, (8, 8), (max_tokens, max_tokens), seed=3)
    steps: list[bool] = []
    report = run_headrace(engine, workload, after_step=lambda _s, decode: steps.append(decode))
    assert report.num_tokens == max_tokens
    assert len(report.decode_step_s) == steps.count(True)
    return steps


def test_the_run_calls_after_step_once_a_step_telling_the_decodes(engine: Engine):
    steps = _run_recording(engine, max_tokens=5)
    # the prompt's step draws the first token; each of the other four decodes one
    assert steps == [False, True, True, True, True]


def test_a_multi_step_decode_is_one_step_of_several_runs():
    """With num_decode_steps=4, nine tokens take three steps: the prompt's (one token), then
    two of four runs each; the hook and the report see one decode step each (timed per run)."""
    config = EngineConfig(model=str(cached_checkpoint()), dtype="float32", num_decode_steps=4)
    assert _run_recording(Engine(config), max_tokens=9) == [False, True, True]
