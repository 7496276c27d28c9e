"""The router's OpenAI-compatible HTTP door, end to end: real worker and router processes,
the real `openai` package as the client (httpx where the bytes themselves are checked).

What a caller gets equals what gRPC and the offline `LLM` give for the same request: text,
n samples, logprobs, stop strings, usage. A streaming client that goes away frees the
worker's blocks. Bad fields, unknown models, overload and no worker give OpenAI-shaped
errors with the right status.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.launch import ServerProcess, start_router
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import http_door, stopped, wait_all_blocks_free, wait_serving
from tests.factories import cached_checkpoint

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "Where does the quick brown fox run?"}]
PROMPT = "The quick brown fox jumps over"
GREEDY = GenerationConfig(max_tokens=12, temperature=0.0, ignore_eos=True)
#: `GREEDY` as OpenAI fields (ignore_eos is a headrace extension).
GREEDY_FIELDS = {"max_tokens": 12, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def chat_model() -> Path:
    return cached_checkpoint("qwen2", chat_template=True, max_position_embeddings=512)


@pytest.fixture(scope="module")
def offline(chat_model: Path) -> LLM:
    return LLM(str(chat_model), dtype="float32")


@pytest.fixture(scope="module")
def servers(chat_model: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("http")
    with http_door(chat_model, logs) as (worker, router):
        yield worker, router


def base_url(router: ServerProcess) -> str:
    return f"http://127.0.0.1:{router.http_port}/v1"


def client_for(router: ServerProcess, api_key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(router), api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def client(servers: tuple[ServerProcess, ServerProcess]) -> openai.OpenAI:
    return client_for(servers[1])


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (served,) = client.models.list().data
    return served.id


# --- what a caller gets -------------------------------------------------------------------


def test_models_lists_the_served_model(client: openai.OpenAI, chat_model: Path):
    (served,) = client.models.list().data
    assert served.id == str(chat_model) and served.owned_by == "headrace"
    assert client.models.retrieve(served.id).id == served.id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_equals_the_offline_chat_and_usage_the_grpc_paths(
    servers, client: openai.OpenAI, model: str, offline: LLM
):
    (want,) = offline.chat(QUESTION, GREEDY)
    got = client.chat.completions.create(model=model, messages=QUESTION, **GREEDY_FIELDS)
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "length" and got.object == "chat.completion"
    with Client(servers[1].target) as grpc_client:
        over_grpc = grpc_client.chat(QUESTION, GREEDY)
    assert got.usage is not None
    assert (
        got.usage.prompt_tokens == over_grpc.usage.num_prompt_tokens == len(want.prompt_token_ids)
    )
    assert got.usage.completion_tokens == over_grpc.usage.num_generated_tokens == 12
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12


def test_streamed_chat_equals_the_plain_one(client: openai.OpenAI, model: str, offline: LLM):
    (want,) = offline.chat(QUESTION, GREEDY)
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, stream=True, stream_options={"include_usage": True},
        **GREEDY_FIELDS,
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.mark.parametrize("stream", [False, True])
def test_greedy_completion_equals_the_offline_text(
    client: openai.OpenAI, model: str, offline: LLM, stream: bool
):
    (want,) = offline.generate(PROMPT, GREEDY)
    got = client.completions.create(model=model, prompt=PROMPT, stream=stream, **GREEDY_FIELDS)
    text = "".join(c.choices[0].text for c in got) if stream else got.choices[0].text
    assert text == want.text


def test_a_completion_of_token_ids_and_a_batch_of_prompts(
    client: openai.OpenAI, model: str, offline: LLM
):
    prompts = [[5, 6, 7, 8], [40, 41, 42]]
    want = offline.generate(prompts, GREEDY)
    got = client.completions.create(model=model, prompt=prompts, **GREEDY_FIELDS)
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [w.text for w in want]
    assert got.usage is not None and got.usage.prompt_tokens == 7
    assert got.usage.completion_tokens == 24


def test_n_samples_equal_the_grpc_paths(servers, client: openai.OpenAI, model: str):
    config = GenerationConfig(max_tokens=8, temperature=1.0, seed=7, n=2)
    with Client(servers[1].target) as grpc_client:
        want = grpc_client.generate(PROMPT, config)
    got = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=2
    )
    assert [c.index for c in got.choices] == [0, 1]
    assert [c.text for c in got.choices] == [o.text for o in want.outputs]
    assert got.choices[0].text != got.choices[1].text  # two samples, not one twice
    generated = sum(len(o.token_ids) for o in want.outputs)  # 16, or fewer after an EOS
    assert got.usage is not None and got.usage.completion_tokens == generated


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_returns_the_n_best_beams_as_the_offline_api_does(
    client: openai.OpenAI, model: str, offline: LLM, stream: bool
):
    config = GenerationConfig(max_tokens=8, temperature=0.0, n=2, num_beams=3)
    (want,) = offline.generate(PROMPT, config)
    extra = {"num_beams": 3, "early_stopping": False}
    got = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, n=2, stream=stream,
        extra_body=extra,
    )  # fmt: skip
    texts = ["", ""]
    for choice in [c for chunk in got for c in chunk.choices] if stream else got.choices:
        texts[choice.index] += choice.text
    assert texts == [o.text for o in want.outputs]  # best first


def test_logprobs_equal_the_grpc_paths(servers, client: openai.OpenAI, model: str):
    config = GenerationConfig(max_tokens=5, temperature=0.0, logprobs=3, ignore_eos=True)
    with Client(servers[1].target) as grpc_client:
        want = grpc_client.chat(QUESTION, config).logprobs
    assert want is not None
    got = client.chat.completions.create(
        model=model, messages=QUESTION, logprobs=True, top_logprobs=3, **{**GREEDY_FIELDS,
        "max_tokens": 5},
    )  # fmt: skip
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    # Tokens are named by the worker, on gRPC and HTTP alike.
    assert [entry.token for entry in content] == [w.token for w in want]
    assert [entry.bytes for entry in content] == [list(w.token_bytes) for w in want]
    assert all(w.token_bytes and not w.token.startswith("token_id:") for w in want)
    assert [entry.logprob for entry in content] == pytest.approx([w.logprob for w in want])
    for entry, expected in zip(content, want, strict=True):
        assert [t.token for t in entry.top_logprobs] == [text for text, _ in expected.top_tokens]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(
            [lp for _, lp in expected.top]
        )
    completion = client.completions.create(
        model=model, prompt=PROMPT, logprobs=2, max_tokens=5, temperature=0
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 5
    assert all(len(top) == 2 for top in logprobs.top_logprobs or [])


def test_a_stop_string_ends_the_text_before_it(client: openai.OpenAI, model: str, offline: LLM):
    (free,) = offline.generate(PROMPT, GREEDY)
    stop = free.text[4:7]  # a piece of what greedy decoding says after a few characters
    assert stop.strip()
    got = client.completions.create(model=model, prompt=PROMPT, stop=[stop], **GREEDY_FIELDS)
    (choice,) = got.choices
    assert choice.finish_reason == "stop"
    assert choice.text == free.text[: free.text.index(stop)]


def test_structured_output_fields_constrain_and_equal_the_offline_ones(
    client: openai.OpenAI, model: str, offline: LLM
):
    schema = {
        "type": "object",
        "properties": {"side": {"type": "string", "enum": ["left", "right"]}},
        "required": ["side"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "side", "schema": schema}}
    got = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=40, temperature=0,
        response_format=response_format,  # type: ignore[arg-type]
    )  # fmt: skip
    (choice,) = got.choices
    assert choice.finish_reason == "stop"
    assert json.loads(choice.message.content or "")["side"] in ("left", "right")
    (offline_chat,) = offline.chat(
        QUESTION, GenerationConfig(max_tokens=40, temperature=0.0, json_schema=schema)
    )
    assert choice.message.content == offline_chat.text
    choices = ["over the dog", "into the forest"]
    picked = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert picked.choices[0].text in choices


# --- the bytes on the wire -----------------------------------------------------------------


def test_sse_framing_byte_for_byte(servers, model: str):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{base_url(servers[1])}/completions", json=body) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"] == "text/event-stream; charset=utf-8"
        assert reply.headers["cache-control"] == "no-cache"
        raw = reply.read()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    frames = raw.split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    events = [json.loads(frame.removeprefix(b"data: ")) for frame in frames[:-2]]
    # Every frame is exactly `data: <compact JSON>` and nothing else: rebuild the bytes.
    rebuilt = b"".join(
        b"data: " + json.dumps(e, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
        for e in events
    )
    assert raw == rebuilt + b"data: [DONE]\n\n"
    *token_events, usage_event = events
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["id"].startswith("cmpl-")
    assert all(e["object"] == "text_completion" and e["usage"] is None for e in token_events)
    assert [e["choices"][0]["finish_reason"] for e in token_events][-1] == "length"
    assert usage_event["choices"] == [] and usage_event["usage"]["completion_tokens"] == 4


def test_a_streaming_client_that_disconnects_frees_the_workers_blocks(servers, model: str):
    """32 prompts of 480 tokens each, abandoned after the first event: each is cancelled
    (the router logs it aborted, not finished) and the worker frees every block."""
    worker, router = servers
    body = {"model": model, "prompt": [PROMPT] * 32, "max_tokens": 480, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{base_url(router)}/completions", json=body) as reply:
        lines = reply.iter_lines()  # kept: dropping it would close the response
        call_id = json.loads(next(lines).removeprefix("data: "))["id"]
        # Not read further: flow control may already have paused the requests (their
        # blocks freed) before the disconnect; the router's log below shows them aborted.
    started = time.monotonic()
    report = wait_all_blocks_free(worker.target)
    assert report.free_kv_blocks == report.total_kv_blocks
    assert report.running_requests == report.waiting_requests == 0
    assert time.monotonic() - started < 5.0
    assert router.log_path is not None
    lines = [line for line in router.log_path.read_text().splitlines() if call_id in line]
    assert len(lines) == 32 and any("finish_reason=abort" in line for line in lines)


# --- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 1.5}, "top_p"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"temprature": 0.5}, "temprature"),
        ({"stream": "yes"}, "stream"),
        ({"priority": 1.5}, "priority"),
        ({"num_beams": 2, "top_p": 0.5}, "top_p"),
        ({"num_beams": 2, "early_stopping": "soon"}, "early_stopping"),
        ({"num_beams": 2, "n": 3}, "n"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(servers, model: str, fields: dict, param: str):
    body = {"model": model, "messages": QUESTION, **fields}
    reply = httpx.post(f"{base_url(servers[1])}/chat/completions", json=body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"}


def test_the_openai_client_raises_for_a_bad_field_and_an_unknown_model(
    client: openai.OpenAI, model: str
):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt=PROMPT, temperature=-1)
    assert bad.value.body["param"] == "temperature"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-4o", messages=QUESTION)
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert unknown.value.body["param"] == "model"  # type: ignore[index]


def test_a_prompt_the_worker_refuses_is_a_400_before_the_stream_starts(
    client: openai.OpenAI, model: str
):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=[10**6], stream=True)
    assert refused.value.body["param"] == "prompt"  # type: ignore[index]


def test_a_full_queue_is_a_429_with_retry_after(servers, model: str, tmp_path: Path):
    """One request on the worker (the router gives it one at a time), one queued (the queue
    holds one): the next is refused at once."""
    worker, _ = servers
    args = ["--http-port", "0", "--metrics-port", "0", "--max-inflight-per-worker", "1",
            "--max-queued-requests", "1"]  # fmt: skip
    with start_router([worker.target], *args, log_path=tmp_path / "router.log") as router:
        assert wait_serving(router.target)
        reply = asyncio.run(_overload(router, worker, model))
    assert reply.status_code == 429
    assert reply.headers["retry-after"] == "1"
    error = reply.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"


async def _overload(router: ServerProcess, worker: ServerProcess, model: str) -> httpx.Response:
    url = f"{base_url(router)}/completions"
    body = {"model": model, "prompt": PROMPT, "max_tokens": 500, "ignore_eos": True,
            "stream": True}  # fmt: skip
    async with httpx.AsyncClient(timeout=60) as http, http.stream("POST", url, json=body):
        # The first request streams (it is on the worker), stopped there so that it cannot
        # finish (a tiny model's 500 tokens take under a second); the second waits in the
        # queue.
        with stopped(worker):
            queued = asyncio.create_task(http.post(url, json=body))
            deadline = time.monotonic() + 30
            while _gauge(router, "headrace_router_requests_queued") < 1:
                assert time.monotonic() < deadline, "the second request was never queued"
                await asyncio.sleep(0.01)
            reply = await http.post(url, json=body)
            queued.cancel()
    return reply


def _gauge(router: ServerProcess, name: str) -> float:
    metrics = httpx.get(f"http://127.0.0.1:{router.metrics_port}/metrics").text
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


def test_no_worker_is_a_503(tmp_path: Path):
    with start_router(["127.0.0.1:9"], "--http-port", "0", log_path=tmp_path / "r.log") as router:
        client = client_for(router)
        with pytest.raises(openai.InternalServerError) as chat:
            client.chat.completions.create(model="any", messages=QUESTION)
        with pytest.raises(openai.InternalServerError):
            client.models.list()
        health = httpx.get(f"http://127.0.0.1:{router.http_port}/health")
    assert chat.value.status_code == 503
    assert chat.value.body["type"] == "service_unavailable_error"  # type: ignore[index]
    assert health.status_code == 503


def test_health_and_unknown_paths(servers):
    root = f"http://127.0.0.1:{servers[1].http_port}"
    assert httpx.get(f"{root}/health").json()["status"] == "serving"
    missing = httpx.get(f"{root}/v1/embeddings")
    assert missing.status_code == 404 and missing.json()["error"]["param"] is None
    assert httpx.get(f"{root}/v1/completions").status_code == 405
    assert httpx.post(f"{root}/v1/completions", content=b"{not json").status_code == 400


LIMITED_KEY = "http-limited-0123456789abcdef"
OPEN_KEY = "http-open-0123456789abcdef"


def test_api_keys_are_honoured_as_on_grpc(servers, model: str, tmp_path: Path):
    """With --api-key-file: no key or an unknown one is a 401, a priority above the key's
    ceiling a 403, more requests than its max_concurrency a 429; /health stays open."""
    keys = tmp_path / "keys.txt"
    keys.write_text(
        f"{LIMITED_KEY} name=limited max_priority=5 max_concurrency=1\n{OPEN_KEY} name=open\n"
    )
    args = ["--http-port", "0", "--api-key-file", str(keys)]
    with start_router([servers[0].target], *args, log_path=tmp_path / "router.log") as router:
        assert wait_serving(router.target)
        url = f"{base_url(router)}/completions"
        assert httpx.post(url, json={"prompt": PROMPT}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            client_for(router, "not-a-key-0123456789").completions.create(model=model, prompt="a")
        assert httpx.get(f"http://127.0.0.1:{router.http_port}/health").status_code == 200
        assert client_for(router, OPEN_KEY).models.list().data[0].id == model
        limited = client_for(router, LIMITED_KEY)
        extra = {"max_tokens": 2, "extra_body": {"priority": 6}}
        with pytest.raises(openai.PermissionDeniedError):
            limited.completions.create(model=model, prompt=PROMPT, **extra)  # type: ignore[arg-type]
        extra["extra_body"] = {"priority": 5}
        assert limited.completions.create(model=model, prompt=PROMPT, **extra).choices  # type: ignore[arg-type]
        # Two prompts are two requests: the second is one more than the key may have.
        over = httpx.post(
            url,
            json={"prompt": [PROMPT, PROMPT]},
            headers={"authorization": f"Bearer {LIMITED_KEY}"},
        )
    assert over.status_code == 429 and over.headers["retry-after"] == "1"


def test_a_draining_router_finishes_the_streams_in_flight(servers, model: str, tmp_path: Path):
    """SIGTERM while a stream runs: it still ends with its usage and [DONE]; the router then
    exits cleanly."""
    args = ["--http-port", "0", "--grace-period", "30"]
    router = start_router([servers[0].target], *args, log_path=tmp_path / "router.log")
    with router:
        assert wait_serving(router.target)
        body = {"model": model, "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        with httpx.stream("POST", f"{base_url(router)}/completions", json=body) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: {")
            router.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert router.proc.wait(timeout=60) == 0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 400
