"""Every field of OpenAI's request types, as the installed `openai` package declares them, is
handled, ignored on purpose, or refused naming it (issue 31): a field OpenAI adds fails here
until someone decides what the door does with it."""

from __future__ import annotations

import pytest
from headrace.router.http import requests
from headrace.router.http.requests import parse_chat, parse_completion
from headrace.sdk.errors import InvalidArgumentError
from openai.types import completion_create_params as completion_params
from openai.types.chat import chat_completion_stream_options_param as stream_options_param
from openai.types.chat import completion_create_params as chat_params

CONTEXT = 512
MESSAGES = [{"role": "user", "content": "hi"}]

#: A value each ignored field may take in a real request.
IGNORED_VALUES = {
    "user": "u-1",
    "safety_identifier": "hash",
    "store": True,
    "metadata": {"k": "v"},
    "service_tier": "flex",
    "parallel_tool_calls": True,
    "prompt_cache_key": "k",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "prediction": {"type": "content", "content": "hello"},
}
#: A value each unsupported field may take that asks for what headrace cannot do.
UNSUPPORTED_VALUES = {
    "audio": {"voice": "alloy", "format": "mp3"},
    "modalities": ["text", "audio"],
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "omni-moderation-latest"},
}


def typed_dict_fields(*types: type) -> set[str]:
    return {name for kind in types for name in (*kind.__required_keys__, *kind.__optional_keys__)}  # type: ignore[attr-defined]


CHAT_FIELDS = typed_dict_fields(
    chat_params.CompletionCreateParamsStreaming, chat_params.CompletionCreateParamsNonStreaming
)
COMPLETION_FIELDS = typed_dict_fields(
    completion_params.CompletionCreateParamsStreaming,
    completion_params.CompletionCreateParamsNonStreaming,
)
HANDLED = {
    *requests.SAMPLING_FIELDS,
    *requests.EXTENSION_FIELDS,
    *requests.COMMON_FIELDS,
}


@pytest.mark.parametrize("name", sorted(CHAT_FIELDS))
def test_every_openai_chat_field_is_decided(name: str):
    decided = HANDLED | requests.CHAT_FIELDS | requests.IGNORED_FIELDS
    assert name in decided | requests.UNSUPPORTED_CHAT_FIELDS.keys(), f"review {name!r}"


@pytest.mark.parametrize("name", sorted(COMPLETION_FIELDS))
def test_every_openai_completion_field_is_decided(name: str):
    decided = HANDLED | requests.COMPLETION_FIELDS | requests.IGNORED_FIELDS
    assert name in decided, f"review {name!r}"


def test_every_stream_option_is_decided():
    options = typed_dict_fields(stream_options_param.ChatCompletionStreamOptionsParam)
    assert options <= requests.STREAM_OPTIONS


@pytest.mark.parametrize("name", sorted(requests.IGNORED_FIELDS))
def test_an_ignored_field_changes_nothing(name: str):
    plain = parse_chat({"messages": MESSAGES}, CONTEXT)
    assert parse_chat({"messages": MESSAGES, name: IGNORED_VALUES[name]}, CONTEXT) == plain
    if name in COMPLETION_FIELDS:
        plain_completion = parse_completion({"prompt": "a"})
        assert parse_completion({"prompt": "a", name: IGNORED_VALUES[name]}) == plain_completion


@pytest.mark.parametrize("name", sorted(requests.UNSUPPORTED_CHAT_FIELDS))
def test_an_unsupported_field_is_refused_naming_it_unless_harmless(name: str):
    with pytest.raises(InvalidArgumentError) as refused:
        parse_chat({"messages": MESSAGES, name: UNSUPPORTED_VALUES[name]}, CONTEXT)
    assert refused.value.field == name
    plain = parse_chat({"messages": MESSAGES}, CONTEXT)
    for harmless in (None, *requests.UNSUPPORTED_CHAT_FIELDS[name]):
        assert parse_chat({"messages": MESSAGES, name: harmless}, CONTEXT) == plain


def test_stream_options_as_guidellm_and_openai_send_them():
    def options(**values: object) -> tuple[bool, bool]:
        api = parse_chat({"messages": MESSAGES, "stream": True, "stream_options": values}, CONTEXT)
        return api.include_usage, api.continuous_usage

    assert options(include_usage=True, continuous_usage_stats=True) == (True, True)
    assert options(include_usage=True, include_obfuscation=False) == (True, False)
    assert options(include_obfuscation=True) == (False, False)
    # vLLM's rule: usage on every chunk only with include_usage.
    assert options(continuous_usage_stats=True) == (False, False)
    assert options(include_usage=None, continuous_usage_stats=None) == (False, False)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"continuous_usage_stats": "yes"}, "stream_options.continuous_usage_stats"),
        ({"include_obfuscation": 1}, "stream_options.include_obfuscation"),
        ({"include_usage": True, "shout": True}, "stream_options.shout"),
        (["include_usage"], "stream_options"),
    ],
)
def test_bad_stream_options_are_refused_naming_them(options: object, param: str):
    with pytest.raises(InvalidArgumentError) as refused:
        parse_completion({"prompt": "a", "stream": True, "stream_options": options})
    assert refused.value.field == param
