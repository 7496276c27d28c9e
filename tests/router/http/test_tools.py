"""OpenAI's tools, tool_choice and tool messages → headrace requests: which tools the template
is offered, the constraint of required and named choices (valid calls satisfy it, others do
not), and every refusal naming the OpenAI param."""

from __future__ import annotations

import json

import jsonschema
import pytest
from headrace.router.http.requests import parse_chat
from headrace.router.http.tools import required_schema
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat, ChatMessage, Tool, ToolCall

CONTEXT = 64
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city"],
    "$defs": {"unit": {"enum": ["C", "F"]}},
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather now.",
                                      "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "now"}},
]  # fmt: skip
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def chat(tool_call_format: str = "hermes", **fields: object):
    return parse_chat({"messages": MESSAGES, **fields}, CONTEXT, tool_call_format)


def test_auto_offers_the_tools_and_parses_in_the_models_format():
    api = chat(tools=TOOLS)  # tool_choice defaults to auto with tools
    (prompt,) = api.prompts
    assert isinstance(prompt, Chat)
    assert prompt.tools == (
        Tool("get_weather", "Weather now.", WEATHER_PARAMETERS),
        Tool("now"),
    )
    assert api.tool_calls is not None and api.tool_calls.tool_names == {"get_weather", "now"}
    assert api.config.json_schema is None  # auto constrains nothing


def test_none_offers_no_tools_and_parses_nothing():
    api = chat(tools=TOOLS, tool_choice="none")
    assert api.prompts[0].tools == () and api.tool_calls is None  # type: ignore[union-attr]


def test_auto_for_a_model_of_unknown_format_is_refused():
    with pytest.raises(InvalidArgumentError, match="--tool-call-parser") as refused:
        chat("", tools=TOOLS)
    assert refused.value.field == "tool_choice"
    assert chat("", tools=TOOLS, tool_choice="required").tool_calls is not None


def test_required_constrains_the_output_to_calls_of_the_tools():
    api = chat(tools=TOOLS, tool_choice="required")
    assert api.prompts[0].tools  # type: ignore[union-attr]
    schema = json.loads(api.config.json_schema or "")
    valid = [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}},
             {"name": "now", "parameters": {}}]  # fmt: skip
    jsonschema.validate(valid, schema)
    for invalid in (
        [],
        [{"name": "delete_all", "parameters": {}}],
        [{"name": "get_weather", "parameters": {"unit": "C"}}],
        [{"name": "get_weather", "parameters": {"city": "Rome", "unit": "K"}}],
        {"name": "now", "parameters": {}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(invalid, schema)


def test_parallel_tool_calls_false_allows_one_call():
    api = chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(api.config.json_schema or "")
    assert schema["maxItems"] == 1 and api.tool_calls and api.tool_calls.max_calls == 1
    jsonschema.validate([{"name": "now", "parameters": {}}], schema)


def test_a_named_function_constrains_the_output_to_its_arguments():
    named = {"type": "function", "function": {"name": "get_weather"}}
    api = chat(tools=TOOLS, tool_choice=named)
    assert json.loads(api.config.json_schema or "") == WEATHER_PARAMETERS
    assert api.tool_calls is not None and api.tool_calls.function == "get_weather"
    none = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}})
    assert json.loads(none.config.json_schema or "") == {"type": "object", "properties": {}}


def test_tools_defining_one_name_differently_are_refused():
    other = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"unit": {"enum": ["K"]}}}}}  # fmt: skip
    with pytest.raises(InvalidArgumentError) as refused:
        required_schema(tuple(Tool.of(t, "t") for t in [*TOOLS, other]), True)
    assert refused.value.field == "tools[2].function.parameters.$defs"


def test_tool_calls_and_tool_messages_reach_the_chat():
    call = {"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
    ]
    (prompt,) = parse_chat({"messages": messages, "tools": TOOLS}, CONTEXT, "hermes").prompts
    assert isinstance(prompt, Chat)
    assert prompt.messages[1:] == (
        ChatMessage("assistant", "", (ToolCall("call_9", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "sunny", tool_call_id="call_9"),
    )


NAMED = {"type": "function", "function": {"name": "now"}}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": {"name": "f"}}, "tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]},
         "messages[0].tool_calls[0].function.arguments"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"arguments": "{}"}}]}]},
         "messages[0].tool_calls[0].function.name"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]},
         "messages[0].tool_call_id"),
        ({"messages": [{"role": "assistant", "function_call": {"name": "f"}}]},
         "messages[0].function_call"),
    ],
)  # fmt: skip
def test_a_bad_tool_field_is_refused_naming_its_param(fields: dict, param: str):
    with pytest.raises(InvalidArgumentError) as refused:
        parse_chat({"messages": MESSAGES, **fields}, CONTEXT, "hermes")
    assert refused.value.field == param
