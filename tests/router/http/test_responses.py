"""headrace chunks → OpenAI bodies, and errors → OpenAI errors: choice numbering over
prompts and samples, usage sums, logprob formats, the SSE bytes, the status per code."""

from __future__ import annotations

import json

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.router.http import errors
from headrace.router.http.requests import parse_chat, parse_completion
from headrace.router.http.responses import ResponseBuilder
from headrace.sdk.errors import (
    DeadlineExceededError,
    HeadraceError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
)

MESSAGES = [{"role": "user", "content": "hi"}]


def chunk(builder: ResponseBuilder, prompt: int, index: int, text: str, **fields) -> pb.Chunk:
    return pb.Chunk(request_id=builder.request_ids[prompt], index=index, text=text, **fields)


def usage(prompt_tokens: int, generated_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt_tokens, generated_tokens=generated_tokens)


def test_a_plain_completion_numbers_choices_over_prompts_and_samples_and_sums_usage():
    api = parse_completion({"prompt": ["a", "b"], "n": 2})
    builder = ResponseBuilder(api, "m")
    stop, length = pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH
    for c in [
        chunk(builder, 0, 0, "x"), chunk(builder, 1, 1, "y"), chunk(builder, 0, 1, "z"),
        chunk(builder, 0, 0, "!", finish_reason=stop),
        chunk(builder, 0, 1, "", finish_reason=length, finished=True, usage=usage(3, 5)),
        chunk(builder, 1, 0, "w", finish_reason=stop),
        chunk(builder, 1, 1, "", finish_reason=stop, finished=True, usage=usage(2, 4)),
    ]:  # fmt: skip
        builder.add(c)
    body = builder.body()
    assert body["object"] == "text_completion" and body["model"] == "m"
    assert body["id"].startswith("cmpl-") and builder.request_ids[1] == f"{body['id']}-1"
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "x!", "stop"), (1, "z", "length"), (2, "w", "stop"), (3, "y", "stop"),
    ]  # fmt: skip
    assert body["usage"] == {
        "prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0},
    }  # fmt: skip


def test_a_plain_chat_answer_is_an_assistant_message_with_logprobs():
    api = parse_chat({"messages": MESSAGES, "logprobs": True, "top_logprobs": 1}, 64)
    builder = ResponseBuilder(api, "m")
    logprob = pb.TokenLogprob(
        token_id=7, logprob=-0.5, top=[pb.TopLogprob(token_id=7, logprob=-0.5)]
    )
    builder.add(chunk(builder, 0, 0, "hey", logprobs=[logprob], finish_reason=pb.FINISH_REASON_STOP,
                      finished=True, usage=usage(4, 1)))  # fmt: skip
    (choice,) = builder.body()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "hey"}
    assert choice["logprobs"] == {
        "content": [{"token": "token_id:7", "logprob": -0.5, "bytes": None,
                     "top_logprobs": [{"token": "token_id:7", "logprob": -0.5, "bytes": None}]}],
        "refusal": None,
    }  # fmt: skip


def test_completion_logprobs_have_openais_legacy_shape():
    builder = ResponseBuilder(parse_completion({"prompt": "a", "logprobs": 1}), "m")
    entry = pb.TokenLogprob(token_id=3, logprob=-1.0, top=[pb.TopLogprob(token_id=4, logprob=-0.9)])
    builder.add(chunk(builder, 0, 0, "ab", logprobs=[entry]))
    builder.add(chunk(builder, 0, 0, "c", logprobs=[entry]))
    assert builder.body()["choices"][0]["logprobs"] == {
        "tokens": ["token_id:3", "token_id:3"], "token_logprobs": [-1.0, -1.0],
        "top_logprobs": [{"token_id:4": -0.9}, {"token_id:4": -0.9}], "text_offset": [0, 2],
    }  # fmt: skip


def events(data: bytes) -> list[dict]:
    frames = data.split(b"\n\n")
    assert frames[-1] == b"" and all(f.startswith(b"data: ") for f in frames[:-1])
    return [json.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]


def test_a_chat_stream_opens_with_roles_then_one_event_per_chunk_with_text():
    api = parse_chat({"messages": MESSAGES, "n": 2, "stream": True}, 64)
    builder = ResponseBuilder(api, "m")
    opening = events(builder.first_events())
    assert [e["choices"][0]["delta"] for e in opening] == [{"role": "assistant", "content": ""}] * 2
    assert builder.events(chunk(builder, 0, 1, "")) == b""  # a token without text yet
    (event,) = events(builder.events(chunk(builder, 0, 1, "hi")))
    assert event["object"] == "chat.completion.chunk" and "usage" not in event
    assert event["choices"] == [{"index": 1, "delta": {"content": "hi"}, "logprobs": None,
                                 "finish_reason": None}]  # fmt: skip
    (last,) = events(builder.events(chunk(builder, 0, 0, "", finish_reason=pb.FINISH_REASON_STOP)))
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"


def test_a_stream_with_include_usage_ends_with_the_usage_event():
    api = parse_completion(
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}
    )
    builder = ResponseBuilder(api, "m")
    (event,) = events(builder.events(chunk(builder, 0, 0, "x", finished=True, usage=usage(1, 1))))
    assert event["usage"] is None and event["choices"][0]["text"] == "x"
    (tail,) = events(builder.usage_event())
    assert tail["choices"] == [] and tail["usage"]["total_tokens"] == 2
    assert (tail["id"], tail["created"]) == (event["id"], event["created"])


@pytest.mark.parametrize(
    ("error", "status", "kind"),
    [
        (InvalidArgumentError("top_p", "bad"), 400, "invalid_request_error"),
        (NotFoundError("no such model"), 404, "invalid_request_error"),
        (UnauthenticatedError("no key"), 401, "authentication_error"),
        (PermissionDeniedError("ceiling"), 403, "permission_error"),
        (ResourceExhaustedError("full", 0.2), 429, "rate_limit_error"),
        (UnavailableError("no worker", 2.5), 503, "service_unavailable_error"),
        (DeadlineExceededError("late"), 504, "timeout_error"),
        (errors.BodyTooLargeError("", "big"), 413, "invalid_request_error"),
        (HeadraceError("what"), 500, "server_error"),
    ],
)
def test_each_error_has_its_status_and_openai_shape(error: HeadraceError, status: int, kind: str):
    assert errors.http_error(error).status == status
    body = errors.error_body(error)["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == kind
    assert body["message"] == str(error)


def test_params_and_retry_after():
    assert errors.error_body(InvalidArgumentError("top_p", "x"))["error"]["param"] == "top_p"
    assert errors.error_body(NotFoundError("m"))["error"]["param"] == "model"
    assert errors.error_body(UnavailableError("x"))["error"]["param"] is None
    assert errors.retry_after(ResourceExhaustedError("full", 0.2)) == {"retry-after": "1"}
    assert errors.retry_after(UnavailableError("x", 2.5)) == {"retry-after": "3"}
    assert errors.retry_after(UnavailableError("x")) == {}
