"""The per-request clock, the request metrics it feeds, and the request log line."""

from __future__ import annotations

import logging

import pytest
from headrace.sdk.telemetry import RequestClock, RequestMetrics, log_request
from prometheus_client import CollectorRegistry


def _sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_clock_observes_ttft_once_and_a_gap_per_later_step() -> None:
    registry = CollectorRegistry()
    metrics = RequestMetrics(registry, "worker", {"model": "m"})
    clock = RequestClock(arrival_s=10.0)
    clock.tokens(10.5, 0, metrics)  # a step with no token (a prompt chunk) counts nothing
    clock.tokens(11.0, 2, metrics)  # two samples of the first step
    clock.tokens(11.0, 1, metrics)  # the same response, another sample: no gap
    clock.tokens(11.25, 3, metrics)
    clock.finish("length", 7, metrics)
    prefix = "headrace_worker_"
    assert clock.ttft_s == 1.0
    assert _sample(registry, prefix + "time_to_first_token_seconds_count", model="m") == 1
    assert _sample(registry, prefix + "time_to_first_token_seconds_sum", model="m") == 1.0
    assert _sample(registry, prefix + "inter_token_latency_seconds_count", model="m") == 1
    assert _sample(registry, prefix + "inter_token_latency_seconds_sum", model="m") == 0.25
    assert _sample(registry, prefix + "generation_tokens_total", model="m") == 6
    assert _sample(registry, prefix + "prompt_tokens_total", model="m") == 7
    assert (
        _sample(registry, prefix + "requests_finished_total", model="m", finish_reason="length")
        == 1
    )


def test_log_line_is_logfmt(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("headrace.test.requests")
    with caplog.at_level(logging.INFO, logger=logger.name):
        log_request(logger, request_id='a "b"=c', tokens=3, ttft_s=0.0123456, error=None)
    assert caplog.messages == ['request finished request_id="a \\"b\\"=c" tokens=3 ttft_s=0.012346']
