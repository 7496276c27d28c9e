"""Property-based fuzzing of router and worker with requests of random field values, and
random bytes on the raw stream: every input gets an answer (one finished chunk, a refusal,
or a stream status), later valid requests are served, and no KV block leaks.

A few hundred examples per run in CI; ``HEADRACE_FUZZ_EXAMPLES=5000`` runs more locally.
"""

from __future__ import annotations

import os
import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import duration_pb2
from headrace.protos import generation_pb2 as pb
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import ServerProcess, start_router
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.processes import start_worker, wait_all_blocks_free, wait_serving

NUM_EXAMPLES = int(os.environ.get("HEADRACE_FUZZ_EXAMPLES", "300"))
INT64 = st.integers(-(2**63), 2**63 - 1)
#: Mostly values near the valid ranges, sometimes anything an int64 or a double can hold.
SMALL_INT = st.one_of(st.integers(-3, 24), st.integers(-3, 24), INT64)
ANY_FLOAT = st.one_of(st.floats(-3.0, 3.0), st.floats(allow_nan=True, allow_infinity=True))
TEXT = st.text(max_size=40)

FUZZ_SETTINGS = settings(
    max_examples=NUM_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    database=None,
)


@st.composite
def wild_configs(draw: st.DrawFn) -> pb.GenerationConfig:
    """Any field, any value of its type."""
    config = pb.GenerationConfig()
    ints = ("max_tokens", "min_tokens", "top_k", "seed", "n", "logprobs", "prompt_logprobs")
    for name in (*ints, "no_repeat_ngram_size"):
        if draw(st.booleans()):
            setattr(config, name, draw(SMALL_INT))
    floats = ("temperature", "top_p", "min_p", "repetition_penalty")
    for name in (*floats, "presence_penalty", "frequency_penalty"):
        if draw(st.booleans()):
            setattr(config, name, draw(ANY_FLOAT))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if draw(st.booleans()):
            setattr(config, name, draw(st.booleans()))
    config.stop.extend(draw(st.lists(TEXT, max_size=3)))
    config.stop_token_ids.extend(draw(st.lists(SMALL_INT, max_size=3)))
    if config.HasField("max_tokens") and config.max_tokens > 64:
        config.max_tokens = 64  # bounded run time; the large values are still refused or run
    return config


@st.composite
def valid_configs(draw: st.DrawFn) -> pb.GenerationConfig:
    """Values in range, in random combinations (sampling, penalties, stops, n, logprobs)."""
    return pb.GenerationConfig(
        max_tokens=draw(st.integers(1, 24)),
        temperature=draw(st.sampled_from([0.0, 0.0, 0.7, 1.3])),
        top_k=draw(st.integers(0, 50)),
        top_p=draw(st.floats(0.05, 1.0)),
        min_p=draw(st.floats(0.0, 0.5)),
        repetition_penalty=draw(st.floats(0.5, 2.0)),
        presence_penalty=draw(st.floats(-2.0, 2.0)),
        seed=draw(st.integers(0, 2**63 - 1)),
        n=draw(st.integers(1, 3)),
        logprobs=draw(st.integers(0, 5)),
        stop=draw(st.lists(TEXT.filter(bool), max_size=2)),
        ignore_eos=draw(st.booleans()),
        no_repeat_ngram_size=draw(st.integers(0, 3)),
    )


@st.composite
def requests(draw: st.DrawFn) -> pb.Request:
    """Half of them valid (so the serving path is exercised too), half anything."""
    valid = draw(st.booleans())
    request = pb.Request(
        request_id=draw(st.text(min_size=1, max_size=12)),
        config=draw(valid_configs() if valid else wild_configs()),
        priority=draw(st.integers(-(2**31), 2**31 - 1)),
        model="" if valid else draw(st.sampled_from(["", "unknown-model"])),
        return_prompt_token_ids=draw(st.booleans()),
    )
    kind = draw(st.sampled_from(["text", "ids"] if valid else ["text", "ids", "none"]))
    if kind == "text":
        request.text = draw(st.text(min_size=1 if valid else 0, max_size=200))
    elif kind == "ids":
        ids = st.integers(1, 500) if valid else SMALL_INT
        request.token_ids.ids.extend(draw(st.lists(ids, min_size=1 if valid else 0, max_size=50)))
    if not valid and draw(st.booleans()):
        seconds = draw(st.one_of(st.floats(-1.0, 5.0), st.just(0.0)))
        request.timeout.CopyFrom(duration_pb2.Duration(nanos=int(seconds * 1e9) % 10**9))
        request.timeout.seconds = int(seconds)
    return request


class Stream:
    """One long-lived raw `Generate` stream a test feeds message by message."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self._outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.call = self.channel.stream_stream(
            "/headrace.v1.Generation/Generate",
            request_serializer=lambda data: data,
            response_deserializer=pb.GenerateResponse.FromString,
        )(self._messages(), timeout=600)
        self.responses = iter(self.call)

    def _messages(self) -> Iterator[bytes]:
        while (data := self._outgoing.get()) is not None:
            yield data

    def send(self, data: bytes) -> None:
        self._outgoing.put(data)

    def answer(self, request_id: str) -> str:
        """Read until the request is answered: its finished chunk, or a duplicate refusal."""
        while True:
            response = next(self.responses)
            if any(d.request_id == request_id for d in response.duplicates):
                return "duplicate"
            for chunk in response.chunks:
                if chunk.request_id == request_id and chunk.finished:
                    if chunk.HasField("error"):
                        return f"error {chunk.error.code} {chunk.error.field}"
                    return "finished"

    def close(self) -> None:
        self._outgoing.put(None)
        self.call.cancel()
        self.channel.close()


@pytest.fixture(scope="module")
def servers(tiny_model: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("fuzz")
    with (
        start_worker(tiny_model, logs) as worker,
        start_router([worker.target], log_path=logs / "router.log") as router,
    ):
        assert wait_serving(router.target)
        yield worker, router


@pytest.mark.parametrize("through", ["worker", "router"])
def test_random_requests_each_get_one_answer_and_leak_nothing(servers, through: str) -> None:
    worker, router = servers
    target = worker.target if through == "worker" else router.target
    stream = Stream(target)
    outcomes: list[str] = []

    @FUZZ_SETTINGS
    @given(request=requests())
    def one(request: pb.Request) -> None:
        stream.send(pb.GenerateRequest(request=request).SerializeToString())
        outcomes.append(stream.answer(request.request_id))

    try:
        one()
        _check_still_serving(target, stream)
    finally:
        stream.close()
    kinds = {outcome.split()[0] for outcome in outcomes}
    assert len(outcomes) >= NUM_EXAMPLES // 2 and {"finished", "error"} <= kinds, outcomes
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks


def _check_still_serving(target: str, stream: Stream) -> None:
    """The same stream, and a new one, still serve a valid request."""
    valid = pb.Request(request_id="valid", token_ids=pb.TokenIds(ids=[5, 6, 7]))
    valid.config.max_tokens = 3
    stream.send(pb.GenerateRequest(request=valid).SerializeToString())
    assert stream.answer("valid") == "finished"
    with Client(target) as client:
        assert len(client.generate([5, 6], GenerationConfig(max_tokens=3)).token_ids) == 3


@pytest.mark.parametrize("through", ["worker", "router"])
def test_random_bytes_on_the_stream_end_it_with_a_status(servers, through: str) -> None:
    worker, router = servers
    target = worker.target if through == "worker" else router.target
    codes: list[grpc.StatusCode] = []

    @FUZZ_SETTINGS
    @given(data=st.binary(min_size=1, max_size=64))
    def one(data: bytes) -> None:
        with grpc.insecure_channel(target) as channel:
            call = channel.stream_stream(
                "/headrace.v1.Generation/Generate",
                request_serializer=lambda raw: raw,
                response_deserializer=pb.GenerateResponse.FromString,
            )(iter([data]), timeout=60)
            try:
                for _ in call:
                    pass  # bytes that happen to parse may be a request: it is answered
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as error:
                codes.append(error.code())

    one()
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}
    assert grpc.StatusCode.INVALID_ARGUMENT in codes
    with Client(target) as client:
        assert len(client.generate([5, 6], GenerationConfig(max_tokens=3)).token_ids) == 3
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks
