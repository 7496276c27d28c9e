"""`serve_metrics`: what a server's counters moved during a load, as steps and a TTFT split.
The figures here are made up; `test_serve_peers` reads a real worker's and a fake vLLM's."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from headrace.worker.bench.serve_metrics import (
    VLLM,
    WORKER,
    Snapshot,
    StepSplit,
    TtftSplit,
    moved,
    scrape,
)


def snapshot(values: dict[str, float], **labels: str) -> Snapshot:
    """Samples by name (``name{kind}`` for a step counter of that kind), labelled."""
    out: Snapshot = {}
    for key, value in values.items():
        name, _, kind = key.partition("{")
        sample_labels = {**labels, **({"kind": kind.rstrip("}")} if kind else {})}
        out[(name, tuple(sorted(sample_labels.items())))] = value
    return out


def steps(prompt: tuple[int, float], decode: tuple[int, float]) -> dict[str, float]:
    """The worker's step counters: (steps, seconds) of each kind."""
    return {
        f"{WORKER}steps_total{{prompt}}": prompt[0],
        f"{WORKER}step_seconds_total{{prompt}}": prompt[1],
        f"{WORKER}steps_total{{decode}}": decode[0],
        f"{WORKER}step_seconds_total{{decode}}": decode[1],
    }


def test_steps_are_what_each_kind_moved() -> None:
    before = snapshot(steps((3, 1.0), (10, 0.5)), model="m")
    after = snapshot(steps((5, 1.6), (30, 1.7)), model="m")
    split = StepSplit.between(before, after, wall_s=2.0)
    assert split is not None
    assert (split.num_prompt_steps, split.num_decode_steps) == (2, 20)
    assert (split.prompt_step_s, split.decode_step_s) == pytest.approx((0.6, 1.2))
    assert split.busy == pytest.approx(0.9)
    assert split.describe() == (
        "engine steps: 2 with prompts (300 ms mean), 20 decodes alone (60 ms mean); "
        "busy 90% of 2.0 s"
    )


def test_a_kind_without_steps_has_no_mean() -> None:
    before = snapshot(steps((0, 0.0), (0, 0.0)))
    split = StepSplit.between(before, snapshot(steps((0, 0.0), (4, 0.2))), wall_s=1.0)
    assert split is not None
    assert split.describe().startswith("engine steps: 0 with prompts, 4 decodes alone (50 ms")


def test_moved_sums_the_series_that_carry_the_labels() -> None:
    before = {("x", (("kind", "a"), ("model", "m"))): 1.0, ("x", (("kind", "b"),)): 5.0}
    after = {("x", (("kind", "a"), ("model", "m"))): 4.0, ("x", (("kind", "b"),)): 6.0}
    assert moved(before, after, "x") == 4.0
    assert moved(before, after, "x", kind="a") == 3.0
    assert moved(before, after, "x", kind="c") == 0.0
    assert moved(before, after, "y") == 0.0


def ttft_histograms(
    prefix: str, count: int, ttft: float, queue: float, prefill: float
) -> dict[str, float]:
    """A server's three histograms' sums and counts after ``count`` requests."""
    values: dict[str, float] = {}
    for name, total in (
        ("time_to_first_token_seconds", ttft),
        ("request_queue_time_seconds", queue),
        ("request_prefill_time_seconds", prefill),
    ):
        values[f"{prefix}{name}_count"] = count
        values[f"{prefix}{name}_sum"] = total
    return values


@pytest.mark.parametrize("prefix", [WORKER, VLLM])
def test_the_ttft_split_is_the_means_of_the_requests_in_between(prefix: str) -> None:
    before = snapshot(ttft_histograms(prefix, 2, 1.0, 0.4, 0.5))
    after = snapshot(ttft_histograms(prefix, 6, 3.0, 1.2, 1.3))
    split = TtftSplit.between(before, after, prefix)
    assert split is not None and split.num_requests == 4
    assert (split.ttft_s, split.queue_s, split.prefill_s) == pytest.approx((0.5, 0.2, 0.2))
    assert split.describe() == (
        "server TTFT mean 500 ms = queue 200 + prefill 200 + the rest 100 (4 requests)"
    )


def test_no_ttft_split_without_requests_or_histograms() -> None:
    same = snapshot(ttft_histograms(WORKER, 2, 1.0, 0.4, 0.5))
    assert TtftSplit.between(same, same, WORKER) is None
    assert TtftSplit.between(same, same, VLLM) is None  # another server's names
    assert StepSplit.between(same, same, wall_s=1.0) is None  # no step counters (vLLM's)


@pytest.fixture
def exposition() -> Iterator[str]:
    """A /metrics endpoint serving vLLM-style histogram samples (colons in their names)."""
    text = (
        "# TYPE vllm:request_queue_time_seconds histogram\n"
        'vllm:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 3.0\n'
        'vllm:request_queue_time_seconds_count{model_name="m"} 3.0\n'
        'vllm:request_queue_time_seconds_sum{model_name="m"} 0.75\n'
    )

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = text.encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_a_scrape_keys_samples_by_name_and_labels(exposition: str) -> None:
    samples = scrape(exposition)
    assert samples[("vllm:request_queue_time_seconds_sum", (("model_name", "m"),))] == 0.75
    assert moved({}, samples, "vllm:request_queue_time_seconds_count") == 3.0
