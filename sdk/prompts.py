"""What a prompt may be, for every API that takes one (SDK, offline `LLM`, engine, wire).

Text is tokenized by the server's tokenizer; token ids are used as they are; a `Chat` (a
conversation) is rendered by the worker with the model's chat template, which is what an
Instruct model expects: asked a question as raw text it may answer nothing at all.

A chat may offer the model tools (`Tool`, OpenAI's function tools) and carry the tool calls
of earlier assistant turns (`ToolCall`) and the "tool" messages that answer them. The
template gets them as transformers' `apply_chat_template` takes them: tools in OpenAI's
shape, a call's arguments as an object (OpenAI sends JSON text; templates print it with
``tojson``). `Tool.of` and `ToolCall.of` read OpenAI's dicts for the SDK, the wire and the
HTTP door alike, each naming a bad part by the field path it is given.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from headrace.sdk.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call of a tool, made by an assistant message."""

    #: The call's id; the "tool" message with its result names it as its `tool_call_id`.
    id: str
    #: The function called.
    name: str
    #: Its arguments: JSON text of an object ("" means ``{}``).
    arguments: str = ""

    @classmethod
    def of(cls, value: ToolCall | Mapping[str, Any], field: str) -> ToolCall:
        """A call from OpenAI's ``{"id", "type": "function", "function": {"name",
        "arguments"}}`` (arguments as JSON text or an object); InvalidArgumentError names
        the bad part under ``field``."""
        if isinstance(value, ToolCall):
            return value  # `Chat` checks it
        if not isinstance(value, Mapping) or value.get("type", "function") != "function":
            raise InvalidArgumentError(field, 'must be {"type": "function", "function": {...}}')
        function = value.get("function")
        if not isinstance(function, Mapping):
            raise InvalidArgumentError(f"{field}.function", "must be {name, arguments}")
        call_id = value.get("id", "")
        if not isinstance(call_id, str):
            raise InvalidArgumentError(f"{field}.id", f"must be a string, got {call_id!r}")
        arguments = function.get("arguments") or ""
        if isinstance(arguments, Mapping):
            arguments = json.dumps(arguments, ensure_ascii=False)
        call = cls(call_id, function.get("name", ""), arguments)
        call.check(f"{field}.function")
        return call

    def check(self, field: str) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgumentError(
                f"{field}.name", f"must be a non-empty string, got {self.name!r}"
            )
        if not isinstance(self.arguments, str):
            raise InvalidArgumentError(f"{field}.arguments", "must be JSON text of an object")
        self.arguments_object(f"{field}.arguments")

    def arguments_object(self, field: str = "arguments") -> dict[str, Any]:
        try:
            arguments = json.loads(self.arguments) if self.arguments.strip() else {}
        except ValueError as error:
            raise InvalidArgumentError(field, f"is not valid JSON: {error}") from None
        if not isinstance(arguments, dict):
            raise InvalidArgumentError(field, "must be JSON text of an object")
        return arguments

    def as_dict(self) -> dict[str, Any]:
        """As chat templates take it: OpenAI's shape, the arguments as an object."""
        function = {"name": self.name, "arguments": self.arguments_object()}
        return {"id": self.id, "type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class Tool:
    """A function the model may call (an OpenAI function tool)."""

    name: str
    #: What it does, for the model. None: not said.
    description: str | None = None
    #: JSON Schema of its arguments (an object schema). None: not given (no arguments).
    parameters: Mapping[str, Any] | None = None

    @classmethod
    def of(cls, value: Tool | Mapping[str, Any], field: str) -> Tool:
        """A tool from OpenAI's ``{"type": "function", "function": {"name", "description",
        "parameters"}}``; InvalidArgumentError names the bad part under ``field``."""
        if isinstance(value, Tool):
            return value
        if not isinstance(value, Mapping) or value.get("type") != "function":
            raise InvalidArgumentError(
                f"{field}.type" if isinstance(value, Mapping) else field,
                'only function tools are supported: {"type": "function", "function": {...}}',
            )
        function = value.get("function")
        if not isinstance(function, Mapping):
            raise InvalidArgumentError(
                f"{field}.function", "must be {name, description, parameters}"
            )
        name, description = function.get("name"), function.get("description")
        parameters = function.get("parameters")
        if not isinstance(name, str) or not name:
            raise InvalidArgumentError(
                f"{field}.function.name", f"must be a non-empty string, got {name!r}"
            )
        if description is not None and not isinstance(description, str):
            raise InvalidArgumentError(f"{field}.function.description", "must be a string")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise InvalidArgumentError(
                f"{field}.function.parameters", "must be a JSON Schema object"
            )
        return cls(name, description, parameters)

    @classmethod
    def from_json(cls, text: str, field: str) -> Tool:
        try:
            value = json.loads(text)
        except ValueError as error:
            raise InvalidArgumentError(field, f"is not valid JSON: {error}") from None
        return cls.of(value, field)

    def as_dict(self) -> dict[str, Any]:
        """OpenAI's shape, as chat templates take it (unset parts left out)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ChatMessage:
    #: "system", "user", "assistant", "tool", or another role the model's template knows.
    role: str
    #: What they say ("" for an assistant turn that only calls tools).
    content: str
    #: An assistant message's tool calls, in order.
    tool_calls: tuple[ToolCall, ...] = ()
    #: A "tool" message: the id of the call whose result it is.
    tool_call_id: str = ""

    def as_dict(self) -> dict[str, Any]:
        """As a chat template takes it: role and content, and the tool parts if any."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [call.as_dict() for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation prompt, oldest message first."""

    messages: tuple[ChatMessage, ...]
    #: End with the opening of an assistant turn, so the model answers; False leaves the
    #: last message open for the model to continue.
    add_generation_prompt: bool = True
    #: Tools the model may call, given to the chat template.
    tools: tuple[Tool, ...] = ()

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidArgumentError("chat.messages", "must hold at least one message")
        for i, message in enumerate(self.messages):
            _check_message(f"chat.messages[{i}]", message)
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, Tool) or not isinstance(tool.name, str) or not tool.name:
                raise InvalidArgumentError(
                    f"chat.tools[{i}]", f"must be a named Tool, got {tool!r}"
                )

    @classmethod
    def of(
        cls,
        messages: Messages,
        add_generation_prompt: bool = True,
        tools: Iterable[Tool | Mapping[str, Any]] = (),
    ) -> Chat:
        """A chat from `ChatMessage`s or OpenAI-style dicts ``{"role": ..., "content": ...}``
        (with ``tool_calls`` or ``tool_call_id`` where they belong), and tools as `Tool`s or
        OpenAI's function-tool dicts."""
        if isinstance(messages, str) or not isinstance(messages, Iterable):
            raise InvalidArgumentError("chat.messages", "must be a list of messages")
        return cls(
            tuple(_message(i, m) for i, m in enumerate(messages)),
            add_generation_prompt,
            tuple(Tool.of(tool, f"chat.tools[{i}]") for i, tool in enumerate(tools)),
        )

    @property
    def num_content_bytes(self) -> int:
        """UTF-8 bytes of the messages' contents, tool calls and tools (the rendered prompt
        adds the template's)."""
        messages = sum(
            len(m.content.encode()) + sum(len(c.arguments.encode()) for c in m.tool_calls)
            for m in self.messages
        )
        return messages + sum(len(tool.to_json().encode()) for tool in self.tools)

    def as_dicts(self) -> list[dict[str, Any]]:
        """The messages as a chat template takes them."""
        return [message.as_dict() for message in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as a chat template takes them; None without tools."""
        return [tool.as_dict() for tool in self.tools] or None


def _check_message(field: str, message: ChatMessage) -> None:
    if not isinstance(message.role, str) or not message.role:
        raise InvalidArgumentError(
            f"{field}.role", f"must be a non-empty string, got {message.role!r}"
        )
    if not isinstance(message.content, str):
        raise InvalidArgumentError(f"{field}.content", f"must be a string, got {message.content!r}")
    for i, call in enumerate(message.tool_calls):
        if not isinstance(call, ToolCall):
            raise InvalidArgumentError(
                f"{field}.tool_calls[{i}]", f"must be a ToolCall, got {call!r}"
            )
        call.check(f"{field}.tool_calls[{i}]")
    if not isinstance(message.tool_call_id, str):
        raise InvalidArgumentError(f"{field}.tool_call_id", "must be a string")


def _message(index: int, message: ChatMessage | Mapping[str, Any]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    field = f"chat.messages[{index}]"
    if not isinstance(message, Mapping):
        raise InvalidArgumentError(field, f"must be a {{role, content}} mapping, got {message!r}")
    calls = message.get("tool_calls") or ()
    if isinstance(calls, str | Mapping) or not isinstance(calls, Iterable):
        raise InvalidArgumentError(f"{field}.tool_calls", "must be a list of tool calls")
    content = message.get("content", "")
    return ChatMessage(
        message.get("role", ""),
        "" if content is None else content,  # OpenAI's null content of a tool-calling turn
        tuple(ToolCall.of(call, f"{field}.tool_calls[{i}]") for i, call in enumerate(calls)),
        message.get("tool_call_id", ""),
    )


#: What `Chat.of` and the SDK's chat methods take.
Messages = Iterable[ChatMessage | Mapping[str, Any]]

#: Text, token ids, or a conversation.
Prompt = str | list[int] | Chat
