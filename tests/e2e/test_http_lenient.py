"""The HTTP door is lenient where OpenAI is, and a bad request costs nothing but itself
(issue 31): real worker and router processes, httpx as the client.

An integer the wire cannot carry is a 400 naming its field, never a 500, and never costs the
keep-alive connection: a bad request then a good one, on one connection, many times over.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from headrace.sdk.client import Client
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.launch import ServerProcess
from headrace.sdk.prompts import Chat
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.processes import http_door
from tests.factories import cached_checkpoint

pytestmark = pytest.mark.timeout(300)

CONTEXT = 512
QUESTION = [{"role": "user", "content": "Where does the quick brown fox run?"}]
PROMPT = "The quick brown fox jumps over"
TOO_BIG, TOO_SMALL = 2**63, -(2**63) - 1


@pytest.fixture(scope="module")
def chat_model() -> Path:
    return cached_checkpoint("qwen2", chat_template=True, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def servers(chat_model: Path, tmp_path_factory) -> Iterator[tuple[ServerProcess, ServerProcess]]:  # type: ignore[no-untyped-def]
    """(worker, router)."""
    logs = tmp_path_factory.mktemp("http-lenient")
    with http_door(chat_model, logs) as (worker, router):
        yield worker, router


@pytest.fixture(scope="module")
def router(servers: tuple[ServerProcess, ServerProcess]) -> ServerProcess:
    return servers[1]


@pytest.fixture(scope="module")
def http(router: ServerProcess) -> Iterator[httpx.Client]:
    """One client: one keep-alive connection, reused by every request."""
    with httpx.Client(base_url=f"http://127.0.0.1:{router.http_port}", timeout=60) as client:
        yield client


#: Each field issue 31 found giving a 500, as (route, body with V for the integer, param).
OUT_OF_RANGE = [
    ("/v1/chat/completions", {"max_tokens": "V"}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": "V"}, "max_completion_tokens"),
    ("/v1/chat/completions", {"top_k": "V"}, "top_k"),
    ("/v1/chat/completions", {"priority": "V"}, "priority"),
    ("/v1/completions", {"stop_token_ids": ["V"]}, "stop_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [1, "V"]}, "allowed_token_ids"),
    ("/v1/completions", {"logit_bias": {"K": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": [1, "V"]}, "prompt"),
    ("/v1/completions", {"max_tokens": "V", "stream": True}, "max_tokens"),
]


def _body(route: str, fields: dict, value: int) -> dict:
    base = {"messages": QUESTION} if route.endswith("chat/completions") else {"prompt": PROMPT}
    text = json.dumps(fields).replace('"V"', str(value)).replace('"K"', f'"{value}"')
    return {**base, "max_tokens": 1, **json.loads(text)}


@pytest.mark.parametrize("value", [TOO_BIG, TOO_SMALL])
@pytest.mark.parametrize(("route", "fields", "param"), OUT_OF_RANGE)
def test_an_integer_outside_int64_is_a_400_naming_it(http, route, fields, param, value):
    reply = http.post(route, content=json.dumps(_body(route, fields, value)))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_bad_request_never_costs_the_keep_alive_connection(http):
    """Issue 31: after a 500 the next request on the connection failed about 40% of the
    time (uvicorn closed it). 200 rounds of a bad request then a good one, one connection."""
    good = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    for i in range(200):
        route, fields, param = OUT_OF_RANGE[i % len(OUT_OF_RANGE)]
        value = TOO_BIG if i % 2 else TOO_SMALL
        bad = http.post(route, content=json.dumps(_body(route, fields, value)))
        assert (bad.status_code, bad.json()["error"]["param"]) == (400, param)
        answer = http.post("/v1/completions", json=good)
        assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"]
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"[" * 100_000, ""),
        (b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", "temperature"),
        (b'{"prompt": "a", "logit_bias": {"' + b"9" * 5000 + b'": 1}}', "logit_bias"),
    ],
)
def test_bodies_that_broke_python_itself_are_400s(http, body, param):
    reply = http.post("/v1/completions", content=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == (param or None)


# --- stream options -------------------------------------------------------------------------


def _events(reply: httpx.Response) -> list[dict]:
    lines = [line for line in reply.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(http):
    """guidellm's stream options: every chunk carries its choice's usage so far (vLLM's
    continuous_usage_stats), and the last one the whole call's."""
    prompts = [[5, 6, 7], [5, 6, 7, 8, 9]]
    body = {
        "prompt": prompts, "n": 2, "max_tokens": 4, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True,
                           "include_obfuscation": False},
    }  # fmt: skip
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    *events, last = _events(reply)
    seen: dict[int, int] = {}
    for event in events:
        (choice,) = event["choices"]
        usage, index = event["usage"], choice["index"]
        assert usage["prompt_tokens"] == len(prompts[index // 2])
        assert usage["completion_tokens"] >= seen.get(index, 0)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[index] = usage["completion_tokens"]
    assert seen == {0: 4, 1: 4, 2: 4, 3: 4}
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 16
    assert last["usage"]["prompt_tokens"] == 3 + 5  # a prompt counts once, whatever its n


def test_continuous_usage_on_a_chat_stream_starts_with_the_prompt(http):
    body = {
        "messages": QUESTION, "max_completion_tokens": 3, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }  # fmt: skip
    *events, last = _events(http.post("/v1/chat/completions", json=body))
    num_prompt_tokens = last["usage"]["prompt_tokens"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[0]["usage"] == {
        "prompt_tokens": num_prompt_tokens, "completion_tokens": 0,
        "total_tokens": num_prompt_tokens,
    }  # fmt: skip
    assert events[-1]["usage"]["completion_tokens"] == 3 == last["usage"]["completion_tokens"]


def test_without_continuous_usage_chunks_carry_a_null_usage(http):
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": False}}  # fmt: skip
    *events, last = _events(http.post("/v1/completions", json=body))
    assert all(event["usage"] is None for event in events) and last["usage"]


# --- max_tokens and the context -------------------------------------------------------------


@pytest.mark.parametrize(
    ("route", "fields", "param"),
    [
        ("/v1/completions", {"max_tokens": 10**9}, "max_tokens"),
        ("/v1/chat/completions", {"max_tokens": CONTEXT + 1}, "max_tokens"),
        ("/v1/chat/completions", {"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ("/v1/completions", {"max_tokens": CONTEXT + 1, "stream": True}, "max_tokens"),
    ],
)
def test_a_max_tokens_beyond_the_context_is_a_400_naming_the_limit(http, route, fields, param):
    reply = http.post(route, json={**_body(route, {}, 0), **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert f"{param}={fields[param]} cannot be greater" in error["message"]
    assert f"max_model_len={CONTEXT}" in error["message"]


def test_a_max_tokens_only_the_prompt_makes_too_long_is_clipped_at_the_context(http):
    reply = http.post("/v1/completions", json={"prompt": [5] * 10, "max_tokens": CONTEXT,
                                                "ignore_eos": True, "temperature": 0})  # fmt: skip
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == CONTEXT - 10


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"web_search_options": {}}, "web_search_options"),
    ],
)
def test_an_unsupported_openai_field_is_a_400_naming_it(http, fields, param):
    reply = http.post("/v1/chat/completions", json={"messages": QUESTION, **fields})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_ignored_openai_fields_are_accepted(http):
    body = {"messages": QUESTION, "max_tokens": 2, "user": "u", "store": False,
            "prompt_cache_key": "k", "safety_identifier": "s", "modalities": ["text"],
            "prediction": {"type": "content", "content": "x"}, "service_tier": "auto"}  # fmt: skip
    assert http.post("/v1/chat/completions", json=body).status_code == 200


# --- tokenize and detokenize ------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(chat_model)


def test_tokenize_counts_as_the_models_tokenizer_and_chat_template_do(http, tokenizer):
    reply = http.post("/tokenize", json={"prompt": PROMPT})
    assert reply.json() == {
        "count": len(tokenizer.encode(PROMPT)), "max_model_len": CONTEXT,
        "tokens": tokenizer.encode(PROMPT), "token_strs": None,
    }  # fmt: skip
    bare = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    rendered = tokenizer.apply_chat_template(
        QUESTION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    chat = http.post("/tokenize", json={"model": "", "messages": QUESTION}).json()
    assert chat["tokens"] == list(rendered)
    # The count a completion call with the same messages reports.
    answer = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1})
    assert answer.json()["usage"]["prompt_tokens"] == chat["count"]
    open_turn = {"messages": QUESTION, "add_generation_prompt": False}
    assert http.post("/tokenize", json=open_turn).json()["count"] < chat["count"]


def test_detokenize_is_the_tokenizers_decode(http, tokenizer):
    token_ids = tokenizer.encode(PROMPT)
    reply = http.post("/detokenize", json={"tokens": token_ids})
    assert reply.json() == {"prompt": tokenizer.decode(token_ids)} == {"prompt": PROMPT}
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": QUESTION}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "return_token_strs": True}, 400, "return_token_strs"),
        ("/tokenize", {"messages": QUESTION, "add_special_tokens": True}, 400,
         "add_special_tokens"),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
        ("/tokenize", {"prompt": "a", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"prompt": "a", "model": "gpt-4o"}, 404, "model"),
        ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
        ("/detokenize", {"tokens": [TOO_BIG]}, 400, "tokens"),
        ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ],
)  # fmt: skip
def test_bad_tokenize_calls_name_their_field(http, route, body, status, param):
    reply = http.post(route, json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_the_sdk_tokenizes_through_router_and_worker_alike(servers, tokenizer):
    chat = Chat.of(QUESTION)
    rendered = list(
        tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
    )  # fmt: skip
    for server in servers:
        with Client(server.target) as client:
            assert client.tokenize(PROMPT) == tokenizer.encode(PROMPT)
            assert client.tokenize(chat) == rendered
            assert client.detokenize(tokenizer.encode(PROMPT)) == PROMPT
            with pytest.raises(InvalidArgumentError) as refused:
                client.detokenize([10**6])
            assert refused.value.field == "token_ids"
            with pytest.raises(InvalidArgumentError) as refused:
                client.tokenize("")
            assert refused.value.field == "prompt"
