"""A real worker process, talked to over gRPC: streams equal the offline API, many requests
share one stream, cancels and timeouts free KV blocks."""

from __future__ import annotations

import asyncio
import json
import queue
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc
from headrace.sdk import wire
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import DeadlineExceededError
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import (
    ServerProcess,
    finished_request,
    load_report,
    num_log_lines,
    pause,
    start_worker,
    wait_all_blocks_free,
)

PROMPTS = ["the quick brown fox", "a story about the sea", "to be or not", "hello"]

CONFIGS = {
    "greedy": GenerationConfig(max_tokens=24, temperature=0.0, ignore_eos=True),
    "seeded": GenerationConfig(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    "two_samples_logprobs": GenerationConfig(
        max_tokens=12, temperature=1.0, seed=3, n=2, logprobs=2, ignore_eos=True
    ),
    "stop_string": GenerationConfig(max_tokens=40, temperature=0.0, stop=("e",)),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sdk_stream_equals_offline_api(worker: ServerProcess, offline: LLM, name: str) -> None:
    config = CONFIGS[name]
    expected = offline.generate(PROMPTS, config)
    with Client(worker.target) as client:
        for prompt, want in zip(PROMPTS, expected, strict=True):
            chunks = list(client.stream(prompt, config))
            assert chunks[-1].finished and chunks[-1].usage == want.usage
            for sample in want.outputs:
                mine = [c for c in chunks if c.index == sample.index]
                assert [t for c in mine for t in c.token_ids] == sample.token_ids
                assert "".join(c.text for c in mine) == sample.text
                assert mine[-1].finish_reason == sample.finish_reason
                if sample.logprobs is not None:
                    got = [lp for c in mine for lp in c.logprobs]
                    assert [lp.token_id for lp in got] == [lp.token_id for lp in sample.logprobs]
                    assert [lp.logprob for lp in got] == pytest.approx(
                        [lp.logprob for lp in sample.logprobs], abs=1e-5
                    )
                    assert [len(lp.top) for lp in got] == [2] * len(got)
            result = client.generate(prompt, config)
            assert [o.token_ids for o in result.outputs] == [o.token_ids for o in want.outputs]


def test_prompt_as_token_ids_equals_text(worker: ServerProcess, offline: LLM) -> None:
    config = CONFIGS["greedy"]
    token_ids = offline.tokenizer.encode(PROMPTS[0])
    with Client(worker.target) as client:
        assert client.generate(token_ids, config).token_ids == (
            client.generate(PROMPTS[0], config).token_ids
        )


async def _run_many(
    target: str, prompts: list[str], budgets: list[int], cancel_after: dict[int, int]
) -> dict[int, list[int]]:
    """Run every request concurrently on one client; cancel some after N chunks."""

    async def one(client: AsyncClient, i: int) -> list[int]:
        config = GenerationConfig(max_tokens=budgets[i], temperature=0.0, ignore_eos=True)
        tokens: list[int] = []
        num_chunks = 0
        async for chunk in client.stream(prompts[i], config):
            tokens.extend(chunk.token_ids)
            num_chunks += 1
            if num_chunks == cancel_after.get(i):
                break  # leaving the stream cancels the request
        return tokens

    async with AsyncClient(target) as client:
        results = await asyncio.gather(*(one(client, i) for i in range(len(prompts))))
        mux = client._mux
        assert mux is not None and mux.error is None  # one stream served them all
    return dict(enumerate(results))


def test_100_concurrent_requests_and_10_cancels(worker: ServerProcess, offline: LLM) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} number {i}" for i in range(100)]
    budgets = [8 + (i * 7) % 40 for i in range(100)]
    cancelled = {i: 3 for i in range(0, 100, 10)}
    for i in cancelled:
        budgets[i] = 400  # long enough that the cancel lands mid-generation

    results = asyncio.run(_run_many(worker.target, prompts, budgets, cancelled))

    expected = offline.generate(
        prompts, [GenerationConfig(max_tokens=b, temperature=0.0, ignore_eos=True) for b in budgets]
    )
    for i in range(100):
        if i in cancelled:
            assert 3 <= len(results[i]) < budgets[i]
            assert results[i] == expected[i].token_ids[: len(results[i])]
        else:
            assert results[i] == expected[i].token_ids, f"request {i}"
            assert len(results[i]) == budgets[i]
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks
    assert (report.running_requests, report.waiting_requests) == (0, 0)


def test_overlapped_steps_worker_streams_the_offline_tokens(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    """A worker started with --overlap-steps (each step's forward on a device thread, two in
    flight): concurrent streams, cancels among them, and every token as offline."""
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} overlapped {i}" for i in range(40)]
    budgets = [6 + (i * 5) % 30 for i in range(40)]
    cancelled = {i: 3 for i in range(0, 40, 10)}
    for i in cancelled:
        budgets[i] = 400
    with start_worker(tiny_model, tmp_path, "--overlap-steps") as worker:
        results = asyncio.run(_run_many(worker.target, prompts, budgets, cancelled))
        report = wait_all_blocks_free(worker.target)
    configs = [GenerationConfig(max_tokens=b, temperature=0.0, ignore_eos=True) for b in budgets]
    expected = offline.generate(prompts, configs)
    for i in range(40):
        if i in cancelled:
            assert 3 <= len(results[i]) < budgets[i]
        want = expected[i].token_ids
        assert results[i] == (want[: len(results[i])] if i in cancelled else want), i
    assert report.free_kv_blocks == report.total_kv_blocks


def _long_request(request_id: str) -> pb.GenerateRequest:
    config = GenerationConfig(max_tokens=450, temperature=0.0, ignore_eos=True)
    return pb.GenerateRequest(request=wire.request_to_wire(request_id, "a long one", config))


def test_cancel_message_frees_blocks_and_ends_as_cancelled(worker: ServerProcess) -> None:
    outgoing: queue.SimpleQueue[pb.GenerateRequest | None] = queue.SimpleQueue()
    outgoing.put(_long_request("a"))
    chunks: list[pb.Chunk] = []
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(iter(outgoing.get, None), timeout=60):
            chunks.extend(response.chunks)
            if len(chunks) == 2:
                outgoing.put(pb.GenerateRequest(cancel=pb.Cancel(request_id="a")))
            if chunks[-1].finished:
                outgoing.put(None)  # half-close: the server then ends the RPC
    last = chunks[-1]
    assert last.finished and last.finish_reason == pb.FINISH_REASON_CANCELLED
    assert 2 <= sum(len(c.token_ids) for c in chunks) < 450
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks


def test_cancelling_the_rpc_frees_blocks(worker: ServerProcess) -> None:
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        call = stub.Generate(iter([_long_request("a"), _long_request("b")]), timeout=60)
        num_chunks = 0
        for response in call:
            num_chunks += len(response.chunks)
            if num_chunks >= 4:
                assert _some_blocks_in_use(worker.target)
                call.cancel()
                break
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks


def _some_blocks_in_use(target: str, timeout_s: float = 5.0) -> bool:
    """Polls: the load report is a snapshot the engine refreshes every few milliseconds while
    busy, so the first one read right after the first tokens may predate them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        report = load_report(target)
        if report.free_kv_blocks < report.total_kv_blocks:
            return True
        time.sleep(0.01)
    return False


CLIENT_THAT_DIES = textwrap.dedent(
    """
    import sys
    from headrace.sdk.client import Client
    from headrace.sdk.config import GenerationConfig

    client = Client(sys.argv[1])
    config = GenerationConfig(max_tokens=450, temperature=0.0, ignore_eos=True)
    for i, chunk in enumerate(client.stream("a long one", config)):
        if i == 2:
            print("streaming", flush=True)
    """
)


def test_client_killed_mid_stream_frees_blocks(worker: ServerProcess) -> None:
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT_THAT_DIES, worker.target], stdout=subprocess.PIPE
    )
    assert client.stdout is not None
    assert client.stdout.readline().strip() == b"streaming"
    client.kill()
    client.wait()
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks


def test_request_timeout_is_deadline_exceeded_in_band(worker: ServerProcess) -> None:
    async def run() -> None:
        async with AsyncClient(worker.target) as client:
            config = GenerationConfig(max_tokens=450, temperature=0.0, ignore_eos=True)
            paused = False
            with pytest.raises(DeadlineExceededError, match=r"timeout of 0\.2 s"):
                async for chunk in client.stream("a long one", config, timeout=0.2):
                    if chunk.token_ids and not paused:  # under way: the timeout passes
                        paused = True
                        pause(0.4, worker)  # blocks this loop too: nothing else is on it
            # The stream carries on: the next request on it succeeds.
            result = await client.generate("hello", GenerationConfig(max_tokens=4, temperature=0))
            assert len(result.token_ids) == 4

    asyncio.run(run())
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks


def test_generate_one_deadline(worker: ServerProcess) -> None:
    logged = num_log_lines(worker)
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = _long_request("one").request
        with pytest.raises(grpc.RpcError) as caught:
            for number, _ in enumerate(stub.GenerateOne(request, timeout=0.3)):
                if number == 0:  # under way: the deadline passes while it runs
                    pause(0.5, worker)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # The worker stopped it at the deadline, not at its end.
    request = finished_request(worker, "request_id=one ", logged)
    assert request["finish_reason"] == "abort", request
    assert int(request["generated_tokens"]) < 450
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks


def test_generate_one_streams_a_whole_request(worker: ServerProcess, offline: LLM) -> None:
    config = CONFIGS["greedy"]
    with grpc.insecure_channel(worker.target) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = wire.request_to_wire("x", PROMPTS[1], config)
        chunks = [c for r in stub.GenerateOne(request, timeout=30) for c in r.chunks]
    assert [t for c in chunks for t in c.token_ids] == offline.generate(PROMPTS[1], config)[
        0
    ].token_ids
    assert chunks[-1].finished and chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_model_info(worker: ServerProcess, offline: LLM, tiny_model: object) -> None:
    with Client(worker.target) as client:
        info = client.model_info()
    assert info.name == str(tiny_model)
    assert info.model_type == "llama"
    assert info.max_model_len == offline.engine.max_model_len
    assert info.vocab_size == offline.engine.vocab_size
    assert info.eos_token.id == offline.tokenizer.eos_token_id
    assert set(info.eos_token_ids) == set(offline.engine.eos_token_ids)


def _headrace(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "headrace.sdk.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_generate_command_streams_text_and_json(worker: ServerProcess, offline: LLM) -> None:
    config = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = offline.generate(PROMPTS[0], config)[0]
    flags = ["--target", worker.target, "--max-tokens", "12", "--ignore-eos"]

    text = _headrace("generate", *flags, PROMPTS[0])
    assert text.returncode == 0, text.stderr
    assert text.stdout == want.text
    assert "12 tokens" in text.stderr and "finish: length" in text.stderr

    lines = _headrace("generate", *flags, "--json", PROMPTS[0])
    assert lines.returncode == 0, lines.stderr
    chunks = [json.loads(line) for line in lines.stdout.splitlines()]
    assert [t for c in chunks for t in c["token_ids"]] == want.token_ids
    assert chunks[-1]["finished"] and chunks[-1]["finish_reason"] == "length"


def test_generate_command_reports_errors(worker: ServerProcess) -> None:
    unknown = _headrace("generate", "--target", worker.target, "--model", "nope", "hi")
    assert unknown.returncode == 1
    assert "model: 'nope' is not served here" in unknown.stderr
    bad = _headrace("generate", "--target", worker.target, "--top-p", "2", "hi")
    assert bad.returncode == 1 and "top_p" in bad.stderr
