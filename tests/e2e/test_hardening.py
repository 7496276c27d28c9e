"""Regressions of the faults found by probing router and worker as a hostile or careless
client would, each named after the defect it pins (real processes, loopback)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from headrace.protos import generation_pb2 as pb
from headrace.protos import worker_pb2, worker_pb2_grpc
from headrace.router.workers import MAX_BACKOFF_S
from headrace.sdk import wire
from headrace.sdk.client import AsyncClient, Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InvalidArgumentError, UnavailableError
from headrace.sdk.launch import ServerProcess, start_router

from tests.e2e.processes import (
    load_report,
    start_worker,
    stopped,
    wait_all_blocks_free,
    wait_serving,
)

LONG = GenerationConfig(max_tokens=3000, temperature=0.0, ignore_eos=True)


def health(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


def wait_for(predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def raw_stream(target: str, messages: Iterator[object], timeout_s: float = 60):  # type: ignore[no-untyped-def]
    """A Generate call sending pre-serialised bytes (or messages), reading responses. Its
    receive window stays at HTTP/2's 64 KiB (no BDP probing), so a reader that stops
    reading is felt by the server soon, as it would be after megabytes on a real network."""
    channel = grpc.insecure_channel(target, options=[("grpc.http2.bdp_probe", 0)])
    call = channel.stream_stream(
        "/headrace.v1.Generation/Generate",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=pb.GenerateResponse.FromString,
    )(messages, timeout=timeout_s)
    return channel, call


@pytest.fixture
def pair(tiny_model: Path, tmp_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A fresh worker (this test may drain or kill it) and a router in front of it."""
    with start_worker(tiny_model, tmp_path) as worker:
        router = start_router([worker.target], log_path=tmp_path / "router.log")
        with router:
            assert wait_serving(router.target)
            yield worker, router


# --- 1: draining workers --------------------------------------------------------------------


def test_a_draining_worker_leaves_the_routers_rotation_at_once(pair) -> None:
    worker, router = pair
    with grpc.insecure_channel(worker.target) as channel:
        worker_pb2_grpc.WorkerControlStub(channel).Drain(
            worker_pb2.DrainRequest(grace=wire.duration(30)), timeout=10
        )
    assert wait_for(lambda: health(router.target) == health_pb2.HealthCheckResponse.NOT_SERVING, 3)
    start = time.monotonic()
    with Client(router.target) as client, pytest.raises(UnavailableError) as refused:
        client.generate([5, 6, 7], GenerationConfig(max_tokens=2))  # no timeout of its own
    assert time.monotonic() - start < 2.0
    assert refused.value.retry_after_s is not None


def test_sigterm_of_the_only_worker_fails_queued_requests_fast(tiny_model, tmp_path) -> None:
    with start_worker(tiny_model, tmp_path, "--grace-period", "30") as worker:
        router = start_router(
            [worker.target], "--max-inflight-per-worker", "2", log_path=tmp_path / "router.log"
        )
        with router:
            assert wait_serving(router.target)
            outcomes = asyncio.run(_sigterm_under_load(router.target, worker))
    in_flight, queued, late = outcomes
    assert all(outcome == "ok" for outcome, _ in in_flight)  # finish within the grace period
    assert all(outcome == "UnavailableError" for outcome, _ in queued)
    assert max(seconds for _, seconds in queued) < 3.0  # measured from the SIGTERM
    assert late[0] == "UnavailableError" and late[1] < 1.0


async def _sigterm_under_load(target: str, worker: ServerProcess):  # type: ignore[no-untyped-def]
    config = GenerationConfig(max_tokens=600, temperature=0.0, ignore_eos=True)
    async with AsyncClient(target) as client:

        async def one(i: int, since: list[float]) -> tuple[str, float]:
            try:
                await client.generate([5 + i, 6, 7], config)
                outcome = "ok"
            except HeadraceError as error:
                outcome = type(error).__name__
            return outcome, time.monotonic() - since[0]

        sigterm_at = [0.0]
        tasks = [asyncio.create_task(one(i, sigterm_at)) for i in range(6)]
        # Two run on the worker, four wait in the router. The worker is stopped as soon as
        # both run (a tiny model's 500 tokens can take under half a second), so they are
        # still running when it gets the SIGTERM, which it handles as it continues.
        deadline = time.monotonic() + 30
        while (await asyncio.to_thread(load_report, worker.target)).running_requests < 2:
            assert time.monotonic() < deadline, "two requests never ran on the worker"
            await asyncio.sleep(0.01)
        worker.proc.send_signal(signal.SIGSTOP)
        sigterm_at[0] = time.monotonic()
        worker.proc.send_signal(signal.SIGTERM)
        worker.proc.send_signal(signal.SIGCONT)
        await asyncio.sleep(0.5)
        late_at = [time.monotonic()]
        late = await one(99, late_at)
        results = await asyncio.gather(*tasks)
    return results[:2], results[2:], late


# --- 2: prompts that can never fit ----------------------------------------------------------


def test_a_prompt_that_can_never_fit_is_refused_at_once_and_blocks_no_one(pair) -> None:
    _, router = pair
    limit = load_report(pair[0].target).max_prompt_bytes

    async def main() -> tuple[float, float]:
        async with AsyncClient(router.target) as client:
            running = [asyncio.create_task(client.generate([5 + i, 6], LONG)) for i in range(8)]
            await asyncio.sleep(0.3)
            start = time.monotonic()
            with pytest.raises(InvalidArgumentError) as refused:
                await client.generate("x" * (limit + 1), GenerationConfig(max_tokens=2))
            big_s = time.monotonic() - start
            assert refused.value.field == "prompt" and str(limit) in str(refused.value)
            start = time.monotonic()
            await client.generate([9, 9, 9], GenerationConfig(max_tokens=4))
            small_s = time.monotonic() - start
            for task in running:
                task.cancel()
            return big_s, small_s

    big_s, small_s = asyncio.run(main())
    assert big_s < 1.0 and small_s < 2.0


# --- 3 and 6: duplicate ids -----------------------------------------------------------------


def test_a_duplicate_id_through_the_router_leaves_the_original_alone(pair) -> None:
    _, router = pair
    config = GenerationConfig(max_tokens=300, temperature=0.0, ignore_eos=True)
    message = pb.GenerateRequest(request=wire.request_to_wire("same", [5, 6, 7], config))
    channel, call = raw_stream(router.target, iter([message, message]))
    with channel:
        responses = list(call)
    duplicates = [d for r in responses for d in r.duplicates]
    assert [(d.request_id, d.error.field) for d in duplicates] == [("same", "request_id")]
    chunks = [c for r in responses for c in r.chunks]
    assert sum(len(c.token_ids) for c in chunks) == 300
    assert [c.finished for c in chunks].count(True) == 1 and chunks[-1].finished
    assert not any(c.HasField("error") for c in chunks)


def test_closing_a_stream_after_a_duplicate_frees_the_original_on_the_worker(pair) -> None:
    worker, router = pair
    message = pb.GenerateRequest(request=wire.request_to_wire("same", [5, 6, 7], LONG))
    channel, call = raw_stream(router.target, iter([message, message, *_hang()]))
    with channel:
        next(iter(call))
        time.sleep(0.3)
        call.cancel()
    report = wait_all_blocks_free(worker.target, timeout_s=3.0)
    assert report.running_requests == report.waiting_requests == 0
    assert report.free_kv_blocks == report.total_kv_blocks


def _hang() -> Iterator[pb.GenerateRequest]:
    time.sleep(5)
    yield from ()


# --- 4: undecodable messages ----------------------------------------------------------------


@pytest.mark.parametrize("server", ["worker", "router"])
def test_undecodable_bytes_are_invalid_argument_on_both_rpcs(pair, server: str) -> None:
    target = pair[0].target if server == "worker" else pair[1].target
    garbage = b"\xff\xfe\x00garbage\x99"
    channel, call = raw_stream(target, iter([garbage]), timeout_s=10)
    with channel, pytest.raises(grpc.RpcError) as stream_error:
        list(call)
    assert stream_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "could not decode" in stream_error.value.details()
    with grpc.insecure_channel(target) as channel:
        one = channel.unary_stream(
            "/headrace.v1.Generation/GenerateOne",
            request_serializer=lambda m: m,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as one_error:
            list(one(garbage, timeout=10))
    assert one_error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with Client(target) as client:  # and the server serves on
        assert client.generate([5, 6], GenerationConfig(max_tokens=3)).finish_reason == "length"


# --- 5: slow readers ------------------------------------------------------------------------


def _slow_reader_messages(
    count: int, config: GenerationConfig, done: threading.Event
) -> Iterator[pb.GenerateRequest]:
    """``count`` requests, then the stream stays open (its input is not done) until done."""
    for i in range(count):
        yield pb.GenerateRequest(request=wire.request_to_wire(f"r{i}", [5, 6, 7 + i], config))
    done.wait(30)


def _read_until_finished(responses: Iterator[pb.GenerateResponse], count: int) -> list[pb.Chunk]:
    chunks: list[pb.Chunk] = []
    while _finished(chunks) < count:
        chunks.extend(next(responses).chunks)
    return chunks


def _finished(chunks: list[pb.Chunk]) -> int:
    return sum(chunk.finished for chunk in chunks)


@pytest.mark.parametrize("through", ["worker", "router"])
def test_a_client_that_stops_reading_is_held_then_fails(tiny_model, tmp_path, through) -> None:
    """Regression (hardening defect 5): the engine kept decoding for a stalled stream and
    buffered its output without limit."""
    flow = ("--max-stream-backlog", "4", "--slow-reader-timeout", "2")
    with start_worker(tiny_model, tmp_path, *flow) as worker:
        router = start_router([worker.target], *flow, log_path=tmp_path / "router.log")
        with router:
            assert wait_serving(router.target)
            target = worker.target if through == "worker" else router.target
            config = GenerationConfig(
                max_tokens=4000, temperature=0.0, ignore_eos=True, logprobs=20
            )
            done = threading.Event()
            channel, call = raw_stream(target, _slow_reader_messages(2, config, done))
            with channel:
                responses = iter(call)
                first = list(next(responses).chunks)  # read one, then nothing for a while
                time.sleep(5.0)
                chunks = first + _read_until_finished(responses, 2 - _finished(first))
                done.set()
            assert wait_all_blocks_free(worker.target).free_kv_blocks > 0
    last = [c for c in chunks if c.finished]
    assert [c.error.code for c in last] == [grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]] * 2
    assert sum(len(c.token_ids) for c in chunks) < 2 * 4000  # held: far from done


def test_a_client_that_pauses_reading_briefly_gets_every_token(pair) -> None:
    worker, router = pair
    config = GenerationConfig(max_tokens=500, temperature=0.0, ignore_eos=True, logprobs=20)
    with Client(worker.target) as client:
        want = client.generate([5, 6, 7], config).token_ids
    done = threading.Event()
    channel, call = raw_stream(router.target, _slow_reader_messages(1, config, done))
    with channel:
        responses = iter(call)
        first = list(next(responses).chunks)
        time.sleep(1.5)  # well under the default slow-reader timeout
        rest = _read_until_finished(responses, 1 - _finished(first))
        done.set()
    chunks = first + rest
    assert [t for c in chunks for t in c.token_ids] == want
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH


# --- 7 and 8: processes ---------------------------------------------------------------------


def test_two_servers_cannot_share_a_port(tiny_model, tmp_path) -> None:
    with start_worker(tiny_model, tmp_path) as worker:
        second = subprocess.run(
            [sys.executable, "-m", "headrace.sdk.cli", "worker", "--model", str(tiny_model),
             "--host", "127.0.0.1", "--port", str(worker.port)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert second.returncode == 1
    assert "address is in use" in second.stderr and "Traceback" not in second.stderr


def test_headrace_up_children_die_with_it_even_on_sigkill(tiny_model) -> None:
    up = subprocess.Popen(
        [sys.executable, "-m", "headrace.sdk.cli", "up", "--model", str(tiny_model),
         "--host", "127.0.0.1", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert up.stdout is not None
    for line in up.stdout:
        if line.startswith("headrace up:"):
            break
    children = psutil.Process(up.pid).children(recursive=True)
    assert len(children) >= 2  # the router and the worker
    up.kill()
    up.wait()
    alive = lambda: [c for c in children if c.is_running() and c.status() != "zombie"]  # noqa: E731
    assert wait_for(lambda: not alive(), 15), [c.cmdline() for c in alive()]


def test_the_same_client_works_after_a_router_restart(pair, tmp_path) -> None:
    worker, router = pair
    port = router.port

    async def main() -> list[str]:
        async with AsyncClient(router.target) as client:
            # The worker is stopped while the router dies, so no stream can finish first (a
            # tiny model's 20 x 500 tokens can take less than the wait below).
            with stopped(worker):
                streams = [
                    asyncio.create_task(_outcome(client.generate([5 + i], LONG))) for i in range(20)
                ]
                await asyncio.sleep(0.5)
                start = time.monotonic()
                router.kill()
                outcomes = await asyncio.gather(*streams)
            assert time.monotonic() - start < 2.0  # UNAVAILABLE at once, not after a timeout
            again = ServerProcess(
                ["router", "--workers", worker.target], tmp_path / "r2.log", port=port
            )
            with again:
                assert wait_serving(again.target)
                result = await client.generate([5, 6], GenerationConfig(max_tokens=3))
                outcomes.append(result.finish_reason or "")
            return outcomes

    outcomes = asyncio.run(main())
    assert outcomes[:20] == ["UnavailableError"] * 20 and outcomes[20] == "length"


async def _outcome(call) -> str:  # type: ignore[no-untyped-def]
    try:
        await call
        return "ok"
    except HeadraceError as error:
        return type(error).__name__


def test_a_restarted_worker_is_back_in_rotation_within_the_backoff(tiny_model, tmp_path) -> None:
    worker = start_worker(tiny_model, tmp_path)
    port = worker.port
    with start_router([worker.target], log_path=tmp_path / "router.log") as router:
        assert wait_serving(router.target)
        worker.kill()
        time.sleep(4.0)  # long enough for gRPC's own reconnect backoff to grow
        again = ServerProcess(
            ["worker", "--model", str(tiny_model)], tmp_path / "w2.log", port=port
        )
        with again:
            up_at = time.monotonic()
            assert wait_serving(router.target, timeout_s=10)
            # gRPC's reconnect backoff is capped at MAX_BACKOFF_S and jittered by 20%; the
            # second allows for the handshake and the first load report on a busy machine.
            assert time.monotonic() - up_at < MAX_BACKOFF_S * 1.2 + 1.0


def test_an_aborted_request_logs_what_it_streamed(tiny_model, tmp_path) -> None:
    with start_worker(tiny_model, tmp_path) as worker:
        with Client(worker.target) as client:
            for i, _ in enumerate(client.stream([5, 6, 7], LONG)):
                if i == 20:
                    break  # the client leaves: its request is aborted
        assert wait_all_blocks_free(worker.target).free_kv_blocks > 0
    log = (tmp_path / "worker.log").read_text()
    (line,) = [line for line in log.splitlines() if "finish_reason=abort" in line]
    assert "prompt_tokens=3" in line and "generated_tokens=0" not in line


def test_cancelling_a_stream_with_unsent_responses_logs_no_error(pair, tmp_path) -> None:
    """Regression: gRPC logged an ERROR traceback (ExecuteBatchError) when a handler yielded
    a response to a client that had just cancelled."""
    worker, router = pair
    config = GenerationConfig(max_tokens=3000, temperature=0.0, ignore_eos=True, logprobs=20)
    for target in (worker.target, router.target):
        done = threading.Event()
        channel, call = raw_stream(target, _slow_reader_messages(8, config, done))
        with channel:
            next(iter(call))
            time.sleep(1.0)  # unsent responses pile up
            call.cancel()
            done.set()
    assert wait_all_blocks_free(worker.target).free_kv_blocks > 0
    for log in (tmp_path / "worker.log", tmp_path / "router.log"):
        text = log.read_text()
        assert "Traceback" not in text and " ERROR " not in text, text[-2000:]
