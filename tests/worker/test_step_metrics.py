"""Where a request's time goes: the engine's step counts and times by kind, and the worker's
queue (from its own arrival) and prefill histograms."""

from __future__ import annotations

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.sdk import GenerationConfig
from headrace.sdk.outputs import FinishReason
from headrace.sdk.streams import FlowLimits
from headrace.sdk.telemetry import RequestTelemetry
from headrace.worker import Engine, EngineConfig
from headrace.worker.engine.outputs import RequestTimes
from headrace.worker.serving.metrics import WorkerMetrics
from headrace.worker.serving.service import GenerationService, ServingState

from tests.factories import build_checkpoint

PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = build_checkpoint(tmp_path_factory.mktemp("steps"), family="llama")
    engine = Engine(EngineConfig(model=str(ckpt), dtype="float32", max_model_len=64))
    yield engine
    engine.close()


def greedy(max_tokens: int) -> GenerationConfig:
    return GenerationConfig(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_steps_are_counted_by_kind_with_their_tokens_and_time(engine):
    """Two prompts share a step; a third arrives beside their decodes (a prompt step too);
    then decodes alone until the last request ends."""
    before = engine.load().steps
    engine.add_request("a", PROMPT, greedy(4))
    engine.add_request("b", PROMPT[:5], greedy(4))
    engine.step()  # prompts a (8 tokens) and b (5): each samples its first token
    engine.add_request("c", PROMPT[:3], greedy(2))
    engine.step()  # a's and b's second tokens, c's prompt (3 tokens) and its first
    engine.step()  # a's, b's and c's next tokens: c ends
    engine.step()  # a's and b's fourth tokens: both end
    assert not engine.has_unfinished_requests()
    steps = engine.load().steps
    assert steps.num_prompt_steps - before.num_prompt_steps == 2
    assert steps.num_decode_steps - before.num_decode_steps == 2
    assert steps.num_prompt_tokens - before.num_prompt_tokens == 8 + 5 + 3
    assert steps.num_decode_tokens - before.num_decode_tokens == 2 + 3 + 2
    assert steps.prompt_step_s > before.prompt_step_s
    assert steps.decode_step_s > before.decode_step_s
    # A load snapshot keeps its counts while the engine goes on.
    engine.add_request("d", PROMPT, greedy(1))
    engine.step()
    assert engine.load().steps.num_prompt_steps == steps.num_prompt_steps + 1
    assert steps.num_prompt_steps - before.num_prompt_steps == 2


class _NoEngine:
    """What the metrics' collector reads only at scrape time (never here)."""


def test_queue_time_runs_from_the_workers_arrival_and_prefill_to_the_first_token():
    """The engine takes a request in between steps, so its own arrival is late by the rest of
    the step in progress: the worker's queue time counts that wait."""
    state = ServingState()
    metrics = WorkerMetrics(_NoEngine(), "m", state)  # type: ignore[arg-type]
    service = GenerationService(_NoEngine(), pb.ModelInfo(name="m"), state, metrics, FlowLimits())  # type: ignore[arg-type]
    telemetry = RequestTelemetry.start("worker.generate", "r1", None)
    arrival_s = telemetry.clock.arrival_s
    times = RequestTimes(
        arrival_s=arrival_s + 0.2,  # the engine took it in after a step of 0.2 s
        first_scheduled_s=arrival_s + 0.25,
        first_token_s=arrival_s + 0.65,
        finished_s=arrival_s + 0.9,
    )
    service.finish(telemetry, FinishReason.LENGTH, None, None, times)
    sample = metrics.registry.get_sample_value
    labels = {"model": "m"}
    assert sample("headrace_worker_request_queue_time_seconds_count", labels) == 1
    assert sample("headrace_worker_request_queue_time_seconds_sum", labels) == pytest.approx(0.25)
    assert sample("headrace_worker_request_prefill_time_seconds_count", labels) == 1
    assert sample("headrace_worker_request_prefill_time_seconds_sum", labels) == pytest.approx(0.4)
