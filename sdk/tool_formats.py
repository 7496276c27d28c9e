"""The formats models write tool calls in: their names, and how a chat template tells which.

The names are those of vLLM's ``--tool-call-parser``, so a flag that works there works here:

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (Hermes, Qwen)
    llama3_json   {"name": ..., "parameters": {...}}, maybe after <|python_tag|>   (Llama 3.x)
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]   (Mistral)

A worker reports its model's format in `ModelInfo.tool_call_parser`: its ``--tool-call-parser``
if given, else what its chat template shows (`format_of_template`): a template that renders
tool calls writes them in the format the model was trained to produce. The router's HTTP door
parses generated text with it (`headrace.router.http.tool_calls`).
"""

from __future__ import annotations

from collections.abc import Mapping

HERMES = "hermes"
LLAMA3_JSON = "llama3_json"
MISTRAL = "mistral"
#: Every format, by name.
TOOL_CALL_FORMATS = (HERMES, LLAMA3_JSON, MISTRAL)

#: Text whose presence in a chat template marks its format, checked in this order.
_TEMPLATE_MARKS = (
    (MISTRAL, "[TOOL_CALLS]"),
    (HERMES, "<tool_call>"),
    (LLAMA3_JSON, "<|python_tag|>"),
    (LLAMA3_JSON, '"parameters": dictionary of argument name and its value'),
)


def format_of_template(template: str | Mapping[str, str] | None) -> str:
    """The tool-call format a chat template renders calls in; "" when it shows none. A
    tokenizer with several named templates renders tools with its "tool_use" one, if any
    (as transformers picks), else its "default"."""
    if isinstance(template, Mapping):
        template = template.get("tool_use") or template.get("default")
    for name, mark in _TEMPLATE_MARKS:
        if template and mark in template:
            return name
    return ""
