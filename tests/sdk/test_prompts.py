"""Chat prompts with tools: OpenAI's dicts are read into typed parts (a bad part named by its
field path), templates get transformers' shapes, and the wire carries every part."""

from __future__ import annotations

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.sdk import wire
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat, ChatMessage, Tool, ToolCall
from headrace.sdk.tool_formats import format_of_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def test_openai_dicts_become_typed_parts_and_templates_get_transformers_shapes():
    chat = Chat.of(CONVERSATION, tools=[WEATHER, Tool("now")])
    assert chat.messages[1] == ChatMessage(
        "assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)
    )
    assert chat.messages[2] == ChatMessage("tool", "sunny", tool_call_id="call_1")
    assert chat.as_dicts() == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    assert chat.tool_dicts() == [WEATHER, {"type": "function", "function": {"name": "now"}}]
    assert Chat.of(CONVERSATION[:1]).tool_dicts() is None


def test_arguments_given_as_an_object_or_empty_are_json_text():
    call = {"id": "c", "function": {"name": "f", "arguments": {"a": [1, "é"]}}}
    (message,) = Chat.of([{"role": "assistant", "content": "", "tool_calls": [call]}]).messages
    assert message.tool_calls == (ToolCall("c", "f", '{"a": [1, "é"]}'),)
    assert ToolCall("c", "f").as_dict()["function"]["arguments"] == {}


@pytest.mark.parametrize(
    ("tools", "messages", "field"),
    [
        ([{"type": "custom", "custom": {}}], [], "chat.tools[0].type"),
        ([{"type": "function", "function": {"name": ""}}], [], "chat.tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            [],
            "chat.tools[0].function.parameters",
        ),
        (
            [],
            [{**CALL, "function": {"name": "f", "arguments": "{oops"}}],
            "chat.messages[0].tool_calls[0].function.arguments",
        ),
        (
            [],
            [{**CALL, "function": {"name": "f", "arguments": "[1]"}}],
            "chat.messages[0].tool_calls[0].function.arguments",
        ),
        (
            [],
            [{**CALL, "function": {"arguments": "{}"}}],
            "chat.messages[0].tool_calls[0].function.name",
        ),
        ([], [{**CALL, "id": 7}], "chat.messages[0].tool_calls[0].id"),
    ],
)
def test_a_malformed_tool_or_call_names_its_field(tools, messages, field):
    conversation = [{"role": "assistant", "content": "", "tool_calls": messages}]
    with pytest.raises(InvalidArgumentError) as refused:
        Chat.of(conversation, tools=tools)
    assert refused.value.field == field


def test_the_wire_carries_tools_calls_and_call_ids():
    chat = Chat.of(CONVERSATION, add_generation_prompt=False, tools=[WEATHER])
    sent = wire.chat_to_wire(chat)
    assert sent.messages[1].tool_calls[0] == pb.ToolCall(
        id="call_1", name="get_weather", arguments='{"city": "Paris"}'
    )
    assert sent.messages[2].tool_call_id == "call_1" and len(sent.tools) == 1
    assert wire.chat_from_wire(pb.Chat.FromString(sent.SerializeToString())) == chat


def test_a_malformed_tool_on_the_wire_names_its_field():
    bad = pb.Chat(messages=[pb.ChatMessage(role="user", content="hi")], tools=["{nope"])
    with pytest.raises(InvalidArgumentError) as refused:
        wire.chat_from_wire(bad)
    assert refused.value.field == "chat.tools[0]"
    call = pb.ToolCall(id="c", name="f", arguments="[]")
    bad = pb.Chat(messages=[pb.ChatMessage(role="assistant", tool_calls=[call])])
    with pytest.raises(InvalidArgumentError) as refused:
        wire.chat_from_wire(bad)
    assert refused.value.field == "chat.messages[0].tool_calls[0].arguments"


@pytest.mark.parametrize(
    ("template", "name"),
    [
        ("{{ '<tool_call>' }}{{ tool_call.arguments | tojson }}", "hermes"),
        ("{{ '[TOOL_CALLS]' }} <tool_call>", "mistral"),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ({"default": "plain", "tool_use": "<tool_call>"}, "hermes"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", ""),
        (None, ""),
    ],
)
def test_a_chat_template_shows_its_tool_call_format(template, name):
    assert format_of_template(template) == name
