"""Tool calling through the OpenAI door, end to end: real worker and router processes, the
`openai` package as the client.

A tiny random Llama with a Hermes-style tools template (`TOOLS_CHAT_TEMPLATE`) shows the
mechanics: the worker reports its format, renders tools and tool calls as transformers
does, ``required`` and a named function always give calls whose arguments satisfy the
tools' schemas, ``auto`` parses the model's own ``<tool_call>`` text (forced here with a
``guided_choice``, as random weights would never write it), streamed and not alike, and
the openai package's tool-calling loop runs to a final answer. SmolLM2 (a real model whose
template knows no tools) answers a named ``tool_choice`` with arguments that validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from headrace.sdk.client import Client
from headrace.sdk.launch import ServerProcess
from transformers import AutoTokenizer

from tests.e2e.processes import http_door, start_worker, wait_serving
from tests.factories import TOOLS_CHAT_TEMPLATE, cached_checkpoint

pytestmark = pytest.mark.timeout(600)

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city for the next days.",
            "parameters": WEATHER_PARAMETERS,
        },
    },
    {"type": "function", "function": {"name": "now", "description": "The time now."}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "now": {"type": "object", "properties": {}}}
QUESTION: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather"}}
#: What a Hermes model writes to call get_weather.
HERMES_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tools_model() -> Path:
    template = TOOLS_CHAT_TEMPLATE
    return cached_checkpoint("llama", chat_template=template, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def servers(tools_model: Path, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    """A router with its OpenAI door in front of a worker serving the tools model."""
    logs = tmp_path_factory.mktemp("http-tools")
    with http_door(tools_model, logs) as (_, router):
        yield router


@pytest.fixture(scope="module")
def client(servers: ServerProcess) -> openai.OpenAI:
    base_url = f"http://127.0.0.1:{servers.http_port}/v1"
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)


def rendered_length(model: Path, messages: list[Any], tools: list[Any] | None) -> int:
    """The prompt's tokens as transformers renders it (tool call arguments as objects)."""
    history = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["content"] = message.get("content") or ""
            message["tool_calls"] = [
                {**call, "function": {**call["function"],
                                      "arguments": json.loads(call["function"]["arguments"])}}
                for call in message["tool_calls"]
            ]  # fmt: skip
        history.append(message)
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.apply_chat_template(
        history, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return len(ids)


def check_calls(calls: list[Any] | None) -> None:
    """Each call names a tool and its arguments satisfy that tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_worker_reports_its_tool_call_format(servers: ServerProcess):
    with Client(servers.target) as grpc_client:
        assert grpc_client.model_info().tool_call_parser == "hermes"


def test_the_workers_flag_overrides_the_format_read_from_the_template(tools_model, tmp_path):
    with start_worker(tools_model, tmp_path, "--tool-call-parser", "llama3_json") as worker:
        assert wait_serving(worker.target)
        with Client(worker.target) as grpc_client:
            assert grpc_client.model_info().tool_call_parser == "llama3_json"


def test_tools_reach_the_template_unless_tool_choice_is_none(client, tools_model):
    offered = client.chat.completions.create(
        model="", messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=60
    )
    assert offered.usage.prompt_tokens == rendered_length(tools_model, QUESTION, TOOLS)
    hidden = client.chat.completions.create(
        model="", messages=QUESTION, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert hidden.usage.prompt_tokens == rendered_length(tools_model, QUESTION, None)
    assert hidden.choices[0].message.tool_calls is None


@pytest.mark.parametrize("seed", range(4))
def test_required_and_named_choices_always_give_valid_calls(client, seed: int):
    one = client.chat.completions.create(
        model="", messages=QUESTION, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, temperature=1.0, seed=seed, max_tokens=200,
    )  # fmt: skip
    (choice,) = one.choices
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls or []) == 1
    check_calls(choice.message.tool_calls)
    named = client.chat.completions.create(
        model="", messages=QUESTION, tools=TOOLS, tool_choice=WEATHER, temperature=1.0,
        seed=seed, max_tokens=200,
    )  # fmt: skip
    (choice,) = named.choices
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    check_calls([call])


def test_auto_parses_the_models_call_streamed_and_not(client):
    forced = {"guided_choice": [f"Checking.{HERMES_CALL}"]}
    plain = client.chat.completions.create(
        model="", messages=QUESTION, tools=TOOLS, max_tokens=200, extra_body=forced
    )
    (choice,) = plain.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo", "days": 2},
    )
    stream = client.chat.completions.create(
        model="", messages=QUESTION, tools=TOOLS, max_tokens=200, extra_body=forced, stream=True
    )
    chunks = [chunk.choices[0] for chunk in stream if chunk.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    pieces = [piece for c in chunks for piece in c.delta.tool_calls or []]
    assert content == "Checking." and chunks[-1].finish_reason == "tool_calls"
    assert pieces[0].id and pieces[0].function.name == "get_weather" and len(pieces) > 2
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def tool_result(call: Any) -> dict[str, Any]:
    result = {
        "called": call.function.name,
        "with": json.loads(call.function.arguments),
        "sky": "sunny",
    }
    return {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)}


def test_the_openai_tool_calling_loop(client, tools_model):
    messages = list(QUESTION)
    first = client.chat.completions.create(
        model="", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=200,
        parallel_tool_calls=False, temperature=0,
    )  # fmt: skip
    message = first.choices[0].message
    check_calls(message.tool_calls)
    messages.append(message.model_dump(exclude_none=True))
    messages.extend(tool_result(call) for call in message.tool_calls or [])
    final = client.chat.completions.create(
        model="", messages=messages, tools=TOOLS, max_tokens=16, temperature=0
    )
    (choice,) = final.choices
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    # the call and its result reached the template: the prompt is transformers' rendering
    assert final.usage.prompt_tokens == rendered_length(tools_model, messages, TOOLS)


def test_the_openai_tool_calling_loop_streamed(client, tools_model):
    messages = list(QUESTION)
    with client.chat.completions.stream(
        model="", messages=messages, tools=TOOLS, tool_choice=WEATHER, max_tokens=200,
        temperature=0,
    ) as stream:  # fmt: skip
        first = stream.get_final_completion()
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    check_calls(message.tool_calls)
    messages.append(
        {"role": "assistant", "content": None,
         "tool_calls": [call.model_dump(include={"id", "type", "function"})
                        for call in message.tool_calls or []]}
    )  # fmt: skip
    messages.extend(tool_result(call) for call in message.tool_calls or [])
    # The stream helper refuses a "length" finish: the (random) model is made to stop.
    answer = "It is sunny in Paris."
    with client.chat.completions.stream(
        model="", messages=messages, tools=TOOLS, max_tokens=64, temperature=0,
        stream_options={"include_usage": True}, extra_body={"guided_choice": [answer]},
    ) as stream:  # fmt: skip
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert not choice.message.tool_calls and choice.message.content == answer
    assert final.usage and final.usage.prompt_tokens == rendered_length(
        tools_model, messages, TOOLS
    )


def test_auto_for_a_model_of_unknown_format_is_a_400_naming_tool_choice(
    smollm2_servers: ServerProcess,
):
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{smollm2_servers.http_port}/v1", api_key="none", max_retries=0
    )
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="", messages=QUESTION, tools=TOOLS)
    assert refused.value.body["param"] == "tool_choice"  # type: ignore[index]


# --- SmolLM2 -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_servers(smollm2_dir: Path, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("http-tools-smollm2")
    with http_door(smollm2_dir, logs) as (_, router):
        yield router


def test_smollm2_answers_a_named_tool_choice_with_valid_arguments(smollm2_servers):
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{smollm2_servers.http_port}/v1", api_key="none", max_retries=0
    )
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    }
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    for stream in (False, True):
        answer = client.chat.completions.create(
            model="", messages=QUESTION, tools=[weather], tool_choice=WEATHER, max_tokens=64,
            temperature=0, stream=stream,
        )  # fmt: skip
        if stream:
            pieces = [p for chunk in answer for p in chunk.choices[0].delta.tool_calls or []]  # type: ignore[union-attr]
            name, arguments = pieces[0].function.name, "".join(p.function.arguments for p in pieces)
        else:
            (call,) = answer.choices[0].message.tool_calls  # type: ignore[union-attr]
            name, arguments = call.function.name, call.function.arguments
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), parameters)
