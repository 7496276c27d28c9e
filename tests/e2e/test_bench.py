"""`headrace bench`: the commands run end to end and end with the JSON line they promise."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from headrace.kernels import cpu_ops
from headrace.worker.models.store import CACHE_ENV

from tests.e2e.processes import ServerProcess, start_router, wait_serving


def bench(*args: str, env: dict[str, str] | None = None) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "headrace.sdk.cli", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_bench_engine_tiny_prints_its_figures_as_json(prepared_cache: Path):
    summary = bench(
        "engine", "--tiny", "--num-requests", "8", "--max-tokens", "4",
        env={CACHE_ENV: str(prepared_cache)},
    )  # fmt: skip
    assert summary["num_tokens"] == 8 * 4
    for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "step_p50_ms", "host_overhead_p50_ms"):
        assert summary[key] > 0, key
    assert summary["ttft_p50_ms"] <= summary["ttft_p99_ms"]


def test_bench_engine_profile_splits_decode_steps_and_sampled_reruns(prepared_cache: Path):
    summary = bench(
        "engine", "--tiny", "--num-requests", "8", "--max-tokens", "6", "--profile",
        "--sampled", "--rounds", "2", env={CACHE_ENV: str(prepared_cache)},
    )  # fmt: skip
    assert summary["num_tokens"] == summary["sampled_num_tokens"] == 8 * 6
    phases = [k for k in summary if k.startswith("profile_")]
    model = ("profile_forward_ms", "profile_lm_head_ms", "profile_one_call_ms")
    assert {"profile_schedule_ms", *model} <= set(phases)
    forward, lm_head, one_call = (summary[k] for k in model)
    if cpu_ops.available():  # each greedy decode step whole in the model's one C call
        assert one_call > 0 and forward == lm_head == 0
    else:  # the layers, then the greedy head
        assert forward > 0 and lm_head > 0
    # Greedy rows take the greedy head: the sampler never runs in the profiled run.
    assert summary["profile_sample_ms"] == 0
    assert sum(summary[k] for k in phases) <= summary["step_p99_ms"] * 1.5
    rounds = summary["ratio_sampled_greedy_step_rounds"]
    assert len(rounds) == 2 and all(ratio > 0 for ratio in rounds)
    assert summary["ratio_sampled_greedy_step"] == max(rounds)  # the upper median of two


def test_bench_engine_speculative_compares_with_and_without(prepared_cache: Path):
    summary = bench(
        "engine", "--tiny", "--num-requests", "2", "--max-tokens", "24", "--speculative", "3",
        "--prompts", "copy", "--rounds", "2", env={CACHE_ENV: str(prepared_cache)},
    )  # fmt: skip
    assert summary["speculative_tokens"] == 3
    assert summary["speculation_same_tokens"] is True  # greedy: the tokens never change
    # The tiny random model's tokens rarely repeat, so there may be nothing to look up: the
    # engine tests (tests/worker/test_speculative.py) check proposals made and kept.
    assert summary["speculation_proposed"] >= summary["speculation_accepted"] >= 0
    assert len(summary["speculation_acceptance_by_position"]) <= 3
    assert len(summary["ratio_speculative_tok_s_rounds"]) == 2


def test_bench_serve_reports_a_priority_burst_apart(worker: ServerProcess):
    summary = bench(
        "serve", "--target", worker.target, "--num-requests", "12", "--prompt-lens", "4-9",
        "--output-lens", "3-5", "--max-concurrency", "4", "--priority-burst", "3",
        "--burst-delay", "0.05",
    )  # fmt: skip
    assert 12 * 3 <= summary["num_tokens"] <= 12 * 5
    assert 3 * 3 <= summary["burst_num_tokens"] <= 3 * 5
    assert summary["burst_ttft_p50_ms"] > 0


def test_bench_serve_loads_a_running_worker(worker: ServerProcess):
    summary = bench(
        "serve", "--target", worker.target, "--num-requests", "12", "--prompt-lens", "4-9",
        "--output-lens", "3-5", "--request-rate", "200", "--max-concurrency", "4",
    )  # fmt: skip
    assert 12 * 3 <= summary["num_tokens"] <= 12 * 5
    for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"):
        assert summary[key] > 0, key


def test_bench_serve_api_openai_loads_the_routers_http_door(worker: ServerProcess, tmp_path: Path):
    with start_router([worker.target], "--http-port", "0", log_path=tmp_path / "r.log") as router:
        assert wait_serving(router.target)
        summary = bench(
            "serve", "--target", router.target, "--api", "openai", "--http-target",
            f"127.0.0.1:{router.http_port}", "--num-requests", "12", "--prompt-lens", "4-9",
            "--output-lens", "3-5", "--max-concurrency", "4",
        )  # fmt: skip
    assert 12 * 3 <= summary["num_tokens"] <= 12 * 5  # the usage each stream reported
    for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"):
        assert summary[key] > 0, key


def test_bench_weights_times_every_update_path(tiny_model: Path):
    summary = bench("weights", "--model", str(tiny_model), "--rounds", "1")
    for key in (
        "restart_ms", "in_process_from_disk_ms", "in_process_from_tensors_ms",
        "gRPC_from_disk_ms", "gRPC_streamed_tensors_ms", "worker_start_ms",
    ):  # fmt: skip
        assert summary[key] > 0, key
    assert summary["ratio_gRPC_streamed_tensors"] > 0


def test_bench_parallel_over_two_nodes_makes_the_one_node_tokens(prepared_cache: Path):
    """``@2``: node 1 is a ``headrace worker --node-rank 1`` process tree of its own."""
    summary = bench(
        "parallel", "--tiny", "--configs", "1x2,1x2@2", "--batch-size", "4",
        "--warmup-steps", "1", "--decode-steps", "4",
        env={CACHE_ENV: str(prepared_cache)},
    )  # fmt: skip
    one_node, two_nodes = summary["configs"]
    assert (one_node["config"], two_nodes["config"]) == ("1x2", "1x2@2")
    assert two_nodes["tokens"].startswith("equal (") and two_nodes["tok_s"] > 0
