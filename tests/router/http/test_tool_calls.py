"""Generated text → OpenAI tool calls, per family: calls and content come out right however
the text is cut into stream pieces, a stream's deltas reassemble to the plain response's
calls, and text that is no call stays content."""

from __future__ import annotations

import json

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.router.http.requests import parse_chat
from headrace.router.http.responses import ResponseBuilder
from headrace.router.http.tool_calls import (
    FORMATS,
    REQUIRED,
    CallFormat,
    Deltas,
    NamedCallParser,
    ToolCalling,
    message_calls,
    stream_calls,
)
from headrace.sdk.tool_formats import TOOL_CALL_FORMATS

NAMES = frozenset({"get_weather", "now"})
WEATHER = {"city": "Paris", "days": [1, 2], "note": 'a } and a " inside'}
WEATHER_ARGS = json.dumps(WEATHER)

#: (format, text, content, [(name, arguments)]): the model's text and what it means.
CASES = [
    (
        "hermes",
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    (  # <tool_call> as a special token, skipped by the detokenizer: the output opens with {
        "hermes",
        f' {{"name": "get_weather", "arguments": {WEATHER_ARGS}}}',
        "",
        [("get_weather", WEATHER_ARGS)],
    ),
    ("hermes", '{"answer": 42} is JSON', '{"answer": 42} is JSON', []),
    (
        "hermes",
        'a <tool_call>{"name": "delete_all", "arguments": {}}</tool_call> b',
        'a <tool_call>{"name": "delete_all", "arguments": {}}</tool_call> b',
        [],
    ),
    ("hermes", "<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ("hermes", "Plain <tool text < here", "Plain <tool text < here", []),
    (
        "hermes",
        '<tool_call>{"name": "now"}</tool_call> Done.',
        "Done.",
        [("now", "{}")],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER_ARGS}}}; '
        '{"name": "now", "parameters": {"tz": "UTC"}}',
        "",
        [("get_weather", WEATHER_ARGS), ("now", '{"tz": "UTC"}')],
    ),
    (
        "llama3_json",
        '{"name": "now", "parameters": {}}',
        "",
        [("now", "{}")],
    ),
    ("llama3_json", 'It is {"name": "now"}', 'It is {"name": "now"}', []),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}, '
        '{"name": "now", "arguments": {}}]',
        "",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    (  # [TOOL_CALLS] skipped as a special token; arguments written as JSON text
        "mistral",
        '[{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}]',
        "",
        [("now", '{"tz": "UTC"}')],
    ),
    ("mistral", "[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
    (
        "mistral",
        'Sure. [TOOL_CALLS][{"name": "now", "arguments": {}}]',
        "Sure. ",
        [("now", "{}")],
    ),
]


def parse(call_format: CallFormat, text: str, piece: int | None, max_calls: int | None = None):
    """The text through a fresh parser in pieces of ``piece`` characters (None: whole)."""
    parser = ToolCalling(NAMES, call_format, max_calls=max_calls).parser()
    out = Deltas()
    for start in range(0, len(text), piece or len(text) or 1):
        out.extend(parser.feed(text[start : start + (piece or len(text))]))
    out.extend(parser.finish())
    return out


def calls_of(deltas: Deltas) -> list[tuple[str, str]]:
    return [
        (c["function"]["name"], c["function"]["arguments"]) for c in message_calls(deltas.calls)
    ]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("piece", [None, 1, 2, 3, 5, 11])
def test_each_family_parses_the_same_however_the_text_streams(name, text, content, calls, piece):
    deltas = parse(FORMATS[name], text, piece)
    assert deltas.content == content
    assert calls_of(deltas) == calls
    assert all(json.loads(arguments) is not None for _, arguments in calls)


def test_every_format_named_has_a_parser():
    assert set(FORMATS) == set(TOOL_CALL_FORMATS)


def test_each_call_starts_with_id_and_name_then_streams_its_arguments():
    text = f'<tool_call>{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}</tool_call>'
    deltas = parse(FORMATS["hermes"], text, 1)
    first, *rest = deltas.calls
    assert (first.index, first.name, first.arguments) == (0, "get_weather", "")
    assert first.id is not None and first.id.startswith("call_")
    assert len(rest) > 10 and all(d.id is None and d.name is None for d in rest)
    assert "".join(d.arguments for d in rest) == WEATHER_ARGS


def test_mistral_call_ids_are_nine_alphanumerics():
    (call,) = message_calls(parse(FORMATS["mistral"], '[{"name": "now"}]', 4).calls)
    assert len(call["id"]) == 9 and call["id"].isalnum()


def test_required_output_and_parallel_tool_calls_false_keeps_the_first_call():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "now", "parameters": {}}]'  # noqa: E501
    assert calls_of(parse(REQUIRED, text, 3)) == [
        ("get_weather", '{"city": "Rome"}'),
        ("now", "{}"),
    ]
    assert calls_of(parse(REQUIRED, text, 3, max_calls=1)) == [("get_weather", '{"city": "Rome"}')]


def test_a_named_function_takes_the_whole_output_as_its_arguments():
    parser = NamedCallParser("get_weather")
    pieces = [parser.feed(p) for p in ['{"ci', 'ty": ', '"Rome"}']]
    assert pieces[0].calls[0].name == "get_weather" and pieces[0].calls[0].id
    assert "".join(d.arguments for p in pieces for d in p.calls) == '{"city": "Rome"}'
    assert parser.num_calls == 1 and parser.finish() == Deltas()


def test_a_call_cut_off_keeps_what_was_written():
    deltas = parse(FORMATS["hermes"], '<tool_call>{"name": "get_weather", "arguments": {"ci', 2)
    assert calls_of(deltas) == [("get_weather", '{"ci')] and deltas.content == ""


def test_stream_entries_merge_a_calls_consecutive_pieces():
    deltas = parse(FORMATS["hermes"], '<tool_call>{"name": "now", "arguments": {"a": 1}}', 100)
    (entry,) = stream_calls(deltas.calls)
    assert entry["function"] == {"name": "now", "arguments": '{"a": 1}'}
    assert entry["type"] == "function" and entry["index"] == 0


# --- through the response builder ------------------------------------------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "now"}},
]
MESSAGES = [{"role": "user", "content": "weather?"}]
PIECES = ["I will ", "check.<tool", '_call>\n{"name": "get_w', 'eather", "arguments": {"ci',
          'ty": "Paris"}}\n</tool_call>']  # fmt: skip


def builder_for(stream: bool, **fields) -> ResponseBuilder:
    body = {"messages": MESSAGES, "tools": TOOLS, "stream": stream, **fields}
    return ResponseBuilder(parse_chat(body, 64, "hermes"), "m")


def chunks(builder: ResponseBuilder, pieces: list[str], reason=pb.FINISH_REASON_STOP):
    request_id = builder.request_ids[0]
    *body, last = [pb.Chunk(request_id=request_id, text=piece) for piece in pieces]
    last.finish_reason, last.finished = reason, True
    return [*body, last]


def sse_events(data: bytes) -> list[dict]:
    return [
        json.loads(line[6:]) for line in data.decode().splitlines() if line.startswith("data: ")
    ]


def test_a_plain_answer_with_a_call_has_tool_calls_and_finishes_with_tool_calls():
    builder = builder_for(stream=False)
    for c in chunks(builder, PIECES):
        builder.add(c)
    (choice,) = builder.body()["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "I will check." and message["role"] == "assistant"
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_streamed_deltas_reassemble_to_the_plain_answer():
    builder = builder_for(stream=True)
    events = sse_events(b"".join(builder.events(c) for c in chunks(builder, PIECES)))
    deltas = [e["choices"][0]["delta"] for e in events]
    content = "".join(d.get("content", "") for d in deltas)
    entries = [entry for d in deltas for entry in d.get("tool_calls", [])]
    assert content == "I will check."
    assert entries[0]["function"]["name"] == "get_weather" and "id" in entries[0]
    assert all("id" not in entry and "name" not in entry["function"] for entry in entries[1:])
    assert "".join(e["function"]["arguments"] for e in entries) == '{"city": "Paris"}'
    assert [e["choices"][0]["finish_reason"] for e in events][-1] == "tool_calls"


def test_without_calls_the_answer_is_plain_text_and_length_stays_length():
    builder = builder_for(stream=False)
    for c in chunks(builder, ["Sunny ", "<tool"], pb.FINISH_REASON_LENGTH):
        builder.add(c)
    (choice,) = builder.body()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Sunny <tool"}
    assert choice["finish_reason"] == "length"


def test_tool_choice_none_parses_nothing():
    builder = builder_for(stream=False, tool_choice="none")
    for c in chunks(builder, PIECES):
        builder.add(c)
    (choice,) = builder.body()["choices"]
    assert choice["message"] == {"role": "assistant", "content": "".join(PIECES)}
    assert choice["finish_reason"] == "stop"


def test_a_named_tool_choice_answer_is_its_call():
    builder = builder_for(
        stream=True, tool_choice={"type": "function", "function": {"name": "now"}}
    )
    events = sse_events(b"".join(builder.events(c) for c in chunks(builder, ["{", "}"])))
    entries = [e for event in events for e in event["choices"][0]["delta"].get("tool_calls", [])]
    assert entries[0]["function"]["name"] == "now"
    assert "".join(e["function"]["arguments"] for e in entries) == "{}"
