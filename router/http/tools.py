"""OpenAI's ``tools`` and ``tool_choice`` → what the chat template is offered, how the output
is constrained, and how it is parsed (`ToolCalling`, `router/http/tool_calls.py`).

Design note. The four choices, as OpenAI defines them and vLLM serves them:

    none        the model answers in text: tools are not offered to the template (as vLLM's
                --exclude-tools-when-tool-choice-none), nothing is parsed
    auto        tools offered; the output is parsed in the model's format (`ModelInfo.
                tool_call_parser`), and what is not a call stays content. A model whose
                format is unknown answers 400, as vLLM does without --tool-call-parser:
                calls could never be recognised
    required    tools offered; the output is constrained (`GenerationConfig.json_schema`) to
                a non-empty JSON array of ``{"name", "parameters"}`` objects, one schema per
                tool under ``anyOf`` (vLLM's), at most one item with
                ``parallel_tool_calls: false``
    {"type": "function", "function": {"name": F}}
                tools offered; the output is constrained to F's parameters schema, and is
                F's arguments

so ``required`` and a named function always parse, whatever the model and its template.
Their constraint is the call's one: ``response_format`` or a ``guided_*`` field beside them
is a 400 (`requests.py`). Without tools, any ``tool_choice`` but ``none`` is a 400
(OpenAI's); ``tool_choice`` defaults to ``auto`` when tools are given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from headrace.router.http.tool_calls import FORMATS, REQUIRED, ToolCalling
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Tool

#: A tool without parameters takes none: its arguments are ``{}``.
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat call's tools and tool_choice come to."""

    #: Offered to the chat template.
    tools: tuple[Tool, ...] = ()
    #: How the output becomes calls; None: it does not.
    calling: ToolCalling | None = None
    #: The JSON schema the output is constrained to (JSON text), if any ...
    json_schema: str | None = None
    #: ... and the OpenAI param an error in it names.
    schema_param: str = ""


def plan_tools(fields: Mapping[str, Any], tool_call_format: str) -> ToolPlan:
    """A chat body's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, for a model that
    writes calls in ``tool_call_format`` ("" = unknown)."""
    tools = offered_tools(fields.get("tools"))
    choice = fields.get("tool_choice", "auto" if tools else "none")
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidArgumentError("parallel_tool_calls", f"must be a boolean, got {parallel!r}")
    if choice == "none":
        return ToolPlan()
    if not tools:
        raise InvalidArgumentError("tool_choice", "is only allowed when tools are given")
    names = frozenset(tool.name for tool in tools)
    max_calls = None if parallel else 1
    if choice == "auto":
        if tool_call_format not in FORMATS:
            raise InvalidArgumentError(
                "tool_choice",
                '"auto" needs the format the model writes tool calls in, and this model\'s '
                "chat template shows none: start its workers with --tool-call-parser, or ask "
                'for "required" or a named function',
            )
        return ToolPlan(tools, ToolCalling(names, FORMATS[tool_call_format], max_calls=max_calls))
    if choice == "required":
        schema = json.dumps(required_schema(tools, parallel))
        return ToolPlan(tools, ToolCalling(names, REQUIRED, max_calls=max_calls), schema, "tools")
    index = _named(choice, tools)
    tool = tools[index]
    schema = json.dumps(dict(tool.parameters or NO_PARAMETERS))
    param = f"tools[{index}].function.parameters"
    return ToolPlan(tools, ToolCalling(names, None, tool.name), schema, param)


def offered_tools(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise InvalidArgumentError("tools", "must be a list of function tools")
    return tuple(Tool.of(tool, f"tools[{i}]") for i, tool in enumerate(value))


def _named(choice: Any, tools: tuple[Tool, ...]) -> int:
    """The index of the tool a named ``tool_choice`` names."""
    named = isinstance(choice, dict) and choice.get("type") == "function"
    function = choice.get("function") if named else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise InvalidArgumentError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        )
    for index, tool in enumerate(tools):
        if tool.name == name:
            return index
    raise InvalidArgumentError("tool_choice.function.name", f"names no tool in tools: {name!r}")


def required_schema(tools: tuple[Tool, ...], parallel: bool) -> dict[str, Any]:
    """A JSON array of calls, each ``{"name": <a tool's>, "parameters": <its arguments>}``;
    each tool's ``$defs`` move to the top, where their ``#/$defs/...`` references point."""
    calls = []
    defs: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        parameters = dict(tool.parameters or NO_PARAMETERS)
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise InvalidArgumentError(
                    f"tools[{i}].function.parameters.$defs",
                    f"{name!r} is defined differently by another tool",
                )
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema
