"""headrace chunks → OpenAI bodies, and errors → OpenAI errors: choice numbering over
prompts and samples, usage sums, logprob formats, the SSE bytes, the status per code."""

from __future__ import annotations

import json

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.router.http import errors
from headrace.router.http.requests import parse_chat, parse_completion
from headrace.router.http.responses import ResponseBuilder, byte_offsets
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
        # The chosen token joins its top alternatives (OpenAI: up to logprobs + 1 entries).
        "top_logprobs": [{"token_id:4": -0.9, "token_id:3": -1.0}] * 2, "text_offset": [0, 2],
    }  # fmt: skip


def named(token_id: int, text: str, logprob: float = 0.0, **fields) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=token_id, logprob=logprob, token=text, token_bytes=text.encode(), **fields
    )


def top(token_id: int, text: str, logprob: float) -> pb.TopLogprob:
    return pb.TopLogprob(token_id=token_id, logprob=logprob, token=text, token_bytes=text.encode())


#: A prompt "ab c" = "ab" + " c" as the worker scores it (" c" ranks 2nd after " d"), and a
#: generated "!" (the most likely).
FIRST = named(10, "ab")
PROMPT_LOGPROBS = [named(11, " c", -1.5, rank=2, top=[top(12, " d", -0.5), top(11, " c", -1.5)])]
BANG = named(13, "!", -0.25, rank=1, top=[top(13, "!", -0.25)])


def scored_chunk(builder: ResponseBuilder, prompt: int, index: int, **fields) -> pb.Chunk:
    """Sample ``index``'s first chunk: "!", with the prompt's logprobs if it is sample 0."""
    if index == 0:
        fields.update(first_prompt_token=FIRST, prompt_logprobs=PROMPT_LOGPROBS, prompt_text="ab c")
    return chunk(builder, prompt, index, "!", token_ids=[13], logprobs=[BANG], **fields)


def test_named_tokens_give_chat_logprobs_their_text_and_bytes():
    api = parse_chat({"messages": MESSAGES, "logprobs": True, "top_logprobs": 1}, 64)
    builder = ResponseBuilder(api, "m")
    builder.add(chunk(builder, 0, 0, "é", logprobs=[named(5, "é", -0.1, top=[top(5, "é", -0.1)])]))
    (entry,) = builder.body()["choices"][0]["logprobs"]["content"]
    alternative = {"token": "é", "logprob": -0.1, "bytes": [195, 169]}
    assert entry == {**alternative, "top_logprobs": [alternative]}


def test_echo_with_logprobs_starts_each_choice_with_the_prompt_and_its_logprobs():
    api = parse_completion({"prompt": "ab c", "echo": True, "logprobs": 1, "n": 2})
    builder = ResponseBuilder(api, "m")
    builder.add(scored_chunk(builder, 0, 0, finish_reason=pb.FINISH_REASON_LENGTH))
    builder.add(scored_chunk(builder, 0, 1, finish_reason=pb.FINISH_REASON_LENGTH,
                             finished=True, usage=usage(2, 2)))  # fmt: skip
    body = builder.body()
    for choice in body["choices"]:
        assert choice["text"] == "ab c!"
        assert choice["logprobs"] == {
            "tokens": ["ab", " c", "!"],
            "token_logprobs": [None, -1.5, -0.25],
            "top_logprobs": [None, {" d": -0.5, " c": -1.5}, {"!": -0.25}],
            "text_offset": [0, 2, 4],
        }
    assert body["usage"]["completion_tokens"] == 2


def test_echo_with_max_tokens_0_is_the_prompt_alone():
    api = parse_completion({"prompt": "ab c", "echo": True, "logprobs": 1, "max_tokens": 0})
    builder = ResponseBuilder(api, "m")
    builder.add(scored_chunk(builder, 0, 0, finish_reason=pb.FINISH_REASON_STOP, finished=True,
                             usage=usage(2, 1)))  # fmt: skip
    body = builder.body()
    (choice,) = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("ab c", "length")
    assert choice["logprobs"]["tokens"] == ["ab", " c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.5]
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (2, 0)


def test_a_token_id_prompt_is_echoed_as_the_worker_decodes_it():
    api = parse_completion({"prompt": [[10, 11], "x"], "echo": True})
    builder = ResponseBuilder(api, "m")
    builder.add(scored_chunk(builder, 0, 0))
    builder.add(chunk(builder, 1, 0, "y"))
    assert [c["text"] for c in builder.body()["choices"]] == ["ab c!", "xy"]


def test_an_echoed_stream_sends_the_prompt_in_each_choices_first_event():
    api = parse_completion({"prompt": "ab c", "echo": True, "logprobs": 1, "stream": True})
    builder = ResponseBuilder(api, "m")
    (first,) = events(builder.events(scored_chunk(builder, 0, 0)))
    assert first["choices"][0]["text"] == "ab c!"
    assert first["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.5, -0.25]
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 2, 4]
    (second,) = events(builder.events(chunk(builder, 0, 0, "?", token_ids=[14], logprobs=[BANG])))
    assert second["choices"][0]["text"] == "?"
    assert second["choices"][0]["logprobs"]["text_offset"] == [5]


def test_an_echoed_stream_with_max_tokens_0_is_one_event_per_choice():
    api = parse_completion({"prompt": "ab c", "echo": True, "max_tokens": 0, "stream": True})
    builder = ResponseBuilder(api, "m")
    last = scored_chunk(builder, 0, 0, finish_reason=pb.FINISH_REASON_STOP)
    (only,) = events(builder.events(last))
    assert (only["choices"][0]["text"], only["choices"][0]["finish_reason"]) == ("ab c", "length")


def test_prompt_logprobs_have_vllms_shape_on_both_endpoints():
    want = [None, {"11": {"logprob": -1.5, "rank": 2, "decoded_token": " c"},
                   "12": {"logprob": -0.5, "rank": 1, "decoded_token": " d"}}]  # fmt: skip
    api = parse_completion({"prompt": "ab c", "prompt_logprobs": 2})
    builder = ResponseBuilder(api, "m")
    builder.add(scored_chunk(builder, 0, 0))
    (choice,) = builder.body()["choices"]
    assert choice["prompt_logprobs"] == want and choice["logprobs"] is None
    chat_api = parse_chat({"messages": MESSAGES, "prompt_logprobs": 2}, 64)
    chat_builder = ResponseBuilder(chat_api, "m")
    chat_builder.add(scored_chunk(chat_builder, 0, 0))
    assert chat_builder.body()["prompt_logprobs"] == want


def test_a_split_characters_tokens_start_where_the_character_does():
    first_half = pb.TokenLogprob(token_id=2, token="\ufffd", token_bytes=b"\xc3")
    second_half = pb.TokenLogprob(token_id=3, token="\ufffd", token_bytes=b"\xa9")
    halves = [named(1, "a"), first_half, second_half, named(4, "b")]  # "aéb"
    assert byte_offsets(halves) == [0, 1, 1, 2]


def test_a_token_sharing_its_name_with_a_likelier_one_does_not_look_greedy():
    builder = ResponseBuilder(parse_completion({"prompt": "a", "logprobs": 1}), "m")
    chosen = pb.TokenLogprob(token_id=2, logprob=-2.0, token="\ufffd", token_bytes=b"\xa9",
                             top=[pb.TopLogprob(token_id=1, logprob=-0.5, token="\ufffd",
                                                token_bytes=b"\xc3")])  # fmt: skip
    builder.add(chunk(builder, 0, 0, "", logprobs=[chosen]))
    logprobs = builder.body()["choices"][0]["logprobs"]
    # lm-eval: greedy when the token's logprob is its position's best value.
    assert logprobs["top_logprobs"] == [{"\ufffd": -0.5}]
    assert logprobs["token_logprobs"][0] != max(logprobs["top_logprobs"][0].values())


def test_an_infinite_logprob_is_written_as_vllm_writes_it():
    builder = ResponseBuilder(parse_completion({"prompt": "a", "logprobs": 0}), "m")
    builder.add(chunk(builder, 0, 0, "x", logprobs=[named(1, "x", float("-inf"))]))
    assert builder.body()["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0]


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
