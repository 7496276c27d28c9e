"""OpenAI bodies → headrace requests: every field lands where it should, and every refusal
names the OpenAI param the caller sent."""

from __future__ import annotations

import json

import pytest
from headrace.router.http.requests import (
    COMPLETION_MAX_TOKENS,
    Endpoint,
    parse_chat,
    parse_completion,
)
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat, ChatMessage

CONTEXT = 512
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields: object):
    return parse_chat({"model": "m", "messages": MESSAGES, **fields}, CONTEXT)


def test_every_sampling_field_and_extension_lands_on_the_config():
    api = chat(
        max_tokens=7, temperature=0.5, top_p=0.9, n=3, stop=["x", "y"], seed=11,
        presence_penalty=0.5, frequency_penalty=-0.5, logprobs=True, top_logprobs=4,
        top_k=20, min_p=0.1, repetition_penalty=1.2, ignore_eos=True, priority=-3,
        stream=True, stream_options={"include_usage": True}, user="ignored",
    )  # fmt: skip
    assert api.config == GenerationConfig(
        max_tokens=7, temperature=0.5, top_p=0.9, n=3, stop=("x", "y"), seed=11,
        presence_penalty=0.5, frequency_penalty=-0.5, logprobs=4, top_k=20, min_p=0.1,
        repetition_penalty=1.2, ignore_eos=True,
    )  # fmt: skip
    assert (api.priority, api.stream, api.include_usage, api.logprobs) == (-3, True, True, True)
    assert api.endpoint is Endpoint.CHAT and api.model == "m"
    assert api.prompts == (Chat((ChatMessage("user", "hi"),)),)


def test_chat_generates_to_the_context_unless_told_and_max_completion_tokens_wins():
    assert chat().config.max_tokens == CONTEXT
    assert chat(max_tokens=5).config.max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).config.max_tokens == 9


def test_null_means_the_default():
    assert chat(temperature=None, stop=None, seed=None).config == GenerationConfig(
        max_tokens=CONTEXT
    )


def test_logprobs_without_top_logprobs_is_the_chosen_token_only():
    assert chat(logprobs=True).config.logprobs == 0
    assert chat(logprobs=False).config.logprobs is None


def test_chat_messages_text_parts_and_roles():
    messages = [
        {"role": "developer", "content": "be brief", "name": "ops"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None},
    ]
    (prompt,) = parse_chat({"messages": messages, "add_generation_prompt": False}, CONTEXT).prompts
    assert prompt == Chat(
        (
            ChatMessage("system", "be brief"),
            ChatMessage("user", "a\nb"),
            ChatMessage("assistant", ""),
        ),
        add_generation_prompt=False,
    )


def test_completion_prompts_defaults_and_batches():
    api = parse_completion({"prompt": "Once upon"})
    assert api.prompts == ("Once upon",) and api.config.max_tokens == COMPLETION_MAX_TOKENS
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == ([1, 2, 3],)
    assert parse_completion({"prompt": ["a", [4, 5]]}).prompts == ("a", [4, 5])
    assert parse_completion({"prompt": "a", "logprobs": 2}).config.logprobs == 2
    assert parse_completion({"prompt": "a", "best_of": 2, "n": 2}).config.n == 2


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stop": [""]}, "stop"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "no role"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"logit_bias": {"fifty": 1}}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"priority": True}, "priority"),
        ({"model": 3}, "model"),
        ({"num_beams": 0}, "num_beams"),
        ({"num_beams": 2.5}, "num_beams"),
        ({"num_beams": 2, "n": 3}, "n"),
        ({"num_beams": 2, "top_p": 0.5}, "top_p"),
        ({"num_beams": 2, "logprobs": True}, "top_logprobs"),
        ({"num_beams": 2, "early_stopping": "soon"}, "early_stopping"),
        ({"num_beams": 2, "length_penalty": "long"}, "length_penalty"),
    ],
)
def test_a_bad_chat_field_is_refused_naming_its_param(fields: dict, param: str):
    with pytest.raises(InvalidArgumentError) as refused:
        parse_chat({"messages": MESSAGES, **fields}, CONTEXT)
    assert refused.value.field == param


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ["ok", 5]}, "prompt[1]"),
        ({"prompt": "a", "echo": "yes"}, "echo"),
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "messages": MESSAGES}, "messages"),
        ({"prompt": "a", "num_beams": 65}, "num_beams"),
        ({"prompt": "a", "num_beams": 2, "stop": ["x"]}, "stop"),
        ({"prompt": "a", "max_tokens": 0}, "max_tokens"),  # without echo there is nothing
        ({"prompt": "a", "echo": True, "logprobs": 21}, "logprobs"),
        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": "2"}, "prompt_logprobs"),
        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": "a", "echo": True, "num_beams": 2, "logprobs": 1}, "logprobs"),
    ],
)
def test_a_bad_completion_field_is_refused_naming_its_param(fields: dict, param: str):
    with pytest.raises(InvalidArgumentError) as refused:
        parse_completion(fields)
    assert refused.value.field == param


def test_echo_with_logprobs_scores_the_prompt_with_as_many_alternatives():
    # lm-eval's loglikelihood request, word for word.
    api = parse_completion(
        {"prompt": "a b", "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    )
    assert (api.echo, api.prompt_only, api.prompt_logprobs) == (True, False, False)
    assert (api.config.logprobs, api.config.prompt_logprobs, api.config.max_tokens) == (1, 1, 1)
    # vLLM's prompt_logprobs field, when given, says how many alternatives the prompt gets.
    both = parse_completion({"prompt": "a", "echo": True, "logprobs": 1, "prompt_logprobs": 3})
    assert both.config.prompt_logprobs == 3 and both.prompt_logprobs


def test_echo_with_max_tokens_0_asks_for_the_one_token_the_worker_needs():
    api = parse_completion({"prompt": "a", "echo": True, "logprobs": 0, "max_tokens": 0})
    assert api.prompt_only and api.config.max_tokens == 1


def test_echo_without_logprobs_scores_nothing_unless_a_prompt_is_token_ids():
    assert parse_completion({"prompt": "a", "echo": True}).config.prompt_logprobs is None
    api = parse_completion({"prompt": ["a", [1, 2]], "echo": True})
    assert api.config.prompt_logprobs == 0  # the worker's decode of [1, 2] comes with them
    assert api.param("config.prompt_logprobs") == "echo"


def test_prompt_logprobs_field_on_both_endpoints_and_ignored_when_0_in_a_stream():
    api = chat(prompt_logprobs=2)
    assert api.prompt_logprobs and api.config.prompt_logprobs == 2
    streamed = parse_completion({"prompt": "a", "stream": True, "prompt_logprobs": 0})
    assert not streamed.prompt_logprobs and streamed.config.prompt_logprobs is None


def test_chat_has_no_echo():
    with pytest.raises(InvalidArgumentError) as refused:
        chat(echo=True)
    assert refused.value.field == "echo"


def test_response_format_and_guided_fields_become_constraints():
    assert chat(response_format={"type": "text"}).config == GenerationConfig(max_tokens=CONTEXT)
    assert chat(response_format={"type": "json_object"}).config.json_object
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wrapped = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}}
    assert chat(response_format=wrapped).config.constraint == ("json_schema", json.dumps(schema))
    assert chat(guided_regex=r"\d+").config.regex == r"\d+"
    assert chat(guided_choice=["yes", "no"]).config.choice == ("yes", "no")
    assert chat(guided_json=schema).config.json_schema == json.dumps(schema)
    assert chat(guided_grammar='root ::= "x"').config.grammar == 'root ::= "x"'


def test_logit_bias_and_the_logit_extensions_land_on_the_config():
    api = chat(logit_bias={"50": -100, "7": 2.5}, allowed_token_ids=[1, 2], bad_words=["no"])
    assert api.config.logit_bias == {50: -100.0, 7: 2.5}
    assert (api.config.allowed_token_ids, api.config.bad_words) == ((1, 2), ("no",))
    completion = parse_completion({"prompt": "a", "logit_bias": {"3": 1}, "guided_regex": "b"})
    assert (completion.config.logit_bias, completion.config.regex) == ({3: 1.0}, "b")


def test_fields_named_by_the_router_or_a_worker_become_openai_params():
    api = chat(max_completion_tokens=3)
    assert api.param("config.top_p") == "top_p"
    assert api.param("config.logprobs") == "top_logprobs"
    assert api.param("config.max_tokens") == "max_completion_tokens"
    assert api.param("chat.messages[1].role") == "messages[1].role"
    assert api.param("chat") == "messages" and api.param("prompt_token_ids") == "messages"
    completion = parse_completion({"prompt": "a"})
    assert completion.param("prompt") == "prompt" and completion.param("config.n") == "n"
    assert completion.param("") is None


@pytest.mark.parametrize(
    ("sent", "early_stopping"), [(True, True), ("never", "never"), (None, False)]
)
def test_beam_search_extensions_land_on_the_config(sent: object, early_stopping: object):
    api = chat(num_beams=4, n=2, length_penalty=0.5, temperature=0, early_stopping=sent)
    assert api.config == GenerationConfig(
        max_tokens=CONTEXT, num_beams=4, n=2, length_penalty=0.5, temperature=0.0,
        early_stopping=early_stopping,
    )  # fmt: skip
    completion = parse_completion({"prompt": "a", "num_beams": 3, "early_stopping": "false"})
    assert (completion.config.num_beams, completion.config.early_stopping) == (3, False)


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "V"}, "max_tokens"),
        ({"max_completion_tokens": "V"}, "max_completion_tokens"),
        ({"top_k": "V"}, "top_k"),
        ({"priority": "V"}, "priority"),
        ({"stop_token_ids": [1, "V"]}, "stop_token_ids"),
        ({"allowed_token_ids": ["V"]}, "allowed_token_ids"),
        ({"logit_bias": {"K": 1}}, "logit_bias"),
        ({"seed": "V"}, "seed"),
        ({"min_tokens": "V", "max_tokens": 8}, "min_tokens"),
    ],
)
def test_an_integer_outside_int64_is_refused_naming_its_param(fields: dict, param: str, value):
    """Issue 31: these were a 500 (`config_to_wire`: "Value out of range")."""
    body = json.loads(json.dumps(fields).replace('"V"', str(value)).replace('"K"', f'"{value}"'))
    with pytest.raises(InvalidArgumentError) as refused:
        parse_chat({"messages": MESSAGES, **body}, CONTEXT)
    assert refused.value.field == param
    if param != "max_completion_tokens":  # a chat field
        with pytest.raises(InvalidArgumentError) as refused:
            parse_completion({"prompt": "a", **body})
        assert refused.value.field == param


@pytest.mark.parametrize("value", [2**63, -(2**63) - 1])
def test_a_prompt_token_id_outside_int64_is_refused_naming_the_prompt(value):
    for prompt, param in (([1, value], "prompt"), ([[1], [2, value]], "prompt[1]")):
        with pytest.raises(InvalidArgumentError) as refused:
            parse_completion({"prompt": prompt})
        assert refused.value.field == param


def test_a_max_tokens_the_context_could_never_hold_is_refused_naming_its_param():
    """Issue 31: 10**9 was clipped silently; as vLLM, more than the whole context is a 400
    (a max_tokens only the prompt makes too long is clipped at the context)."""
    chat(max_tokens=CONTEXT).check_context(CONTEXT)  # the chat default, too
    chat().check_context(CONTEXT)
    for fields, param in (
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"max_completion_tokens": CONTEXT + 1}, "max_completion_tokens"),
    ):
        with pytest.raises(InvalidArgumentError) as refused:
            chat(**fields).check_context(CONTEXT)
        assert refused.value.field == param and f"max_model_len={CONTEXT}" in str(refused.value)
    with pytest.raises(InvalidArgumentError) as refused:
        parse_completion({"prompt": "a", "max_tokens": CONTEXT + 1}).check_context(CONTEXT)
    assert refused.value.field == "max_tokens"
