"""OpenAI prompts → headrace prompts: chat messages become a `Chat` (rendered by the worker
with the model's chat template), completion prompts become text or token ids.

Chat content may be a string or a list of content parts; text parts are joined with
newlines (as vLLM does), any other part (images, audio) is refused naming it. OpenAI's
``developer`` role is the ``system`` role of older models and of chat templates. An
assistant message may carry ``tool_calls`` (its content then null or empty), a ``tool``
message the ``tool_call_id`` it answers; both go to the template (`ToolCall`). The legacy
``function_call`` is refused.
"""

from __future__ import annotations

from typing import Any

from headrace.sdk.config import check_int64
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat, ChatMessage, Prompt, Tool, ToolCall

#: OpenAI role → the role chat templates know.
ROLE_ALIASES = {"developer": "system"}
#: Message keys read here.
MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})
#: Message keys that change nothing here.
IGNORED_MESSAGE_KEYS = frozenset({"name", "refusal"})


def chat_prompt(messages: Any, add_generation_prompt: bool, tools: tuple[Tool, ...] = ()) -> Chat:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgumentError("messages", "must be a non-empty list of messages")
    return Chat(
        tuple(_message(f"messages[{i}]", m) for i, m in enumerate(messages)),
        add_generation_prompt,
        tools,
    )


def _message(param: str, message: Any) -> ChatMessage:
    if not isinstance(message, dict):
        raise InvalidArgumentError(param, "must be an object with role and content")
    for key in message:
        if key not in MESSAGE_KEYS and key not in IGNORED_MESSAGE_KEYS:
            if key == "function_call":
                raise InvalidArgumentError(f"{param}.{key}", "is legacy: send tool_calls")
            raise InvalidArgumentError(f"{param}.{key}", f"unrecognized message field {key!r}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidArgumentError(f"{param}.role", f"must be a non-empty string, got {role!r}")
    content = _content(f"{param}.content", message.get("content"))
    tool_call_id = message.get("tool_call_id", "")
    if not isinstance(tool_call_id, str):
        raise InvalidArgumentError(
            f"{param}.tool_call_id", f"must be a string, got {tool_call_id!r}"
        )
    calls = _tool_calls(f"{param}.tool_calls", message.get("tool_calls"))
    return ChatMessage(ROLE_ALIASES.get(role, role), content, calls, tool_call_id)


def _tool_calls(param: str, calls: Any) -> tuple[ToolCall, ...]:
    if calls is None:
        return ()
    if not isinstance(calls, list) or not calls:
        raise InvalidArgumentError(param, "must be a non-empty list of tool calls (or left out)")
    return tuple(ToolCall.of(call, f"{param}[{i}]") for i, call in enumerate(calls))


def _content(param: str, content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidArgumentError(param, "must be a string or a list of content parts")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise InvalidArgumentError(
                f"{param}[{i}]", f"only text parts are supported, got type {kind!r}"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def completion_prompts(prompt: Any) -> tuple[Prompt, ...]:
    """Text, token ids, or a list of either (a batch: one request per prompt)."""
    if isinstance(prompt, str) or _is_token_ids(prompt):
        return (_one_prompt("prompt", prompt),)
    if isinstance(prompt, list) and prompt:
        return tuple(_one_prompt(f"prompt[{i}]", p) for i, p in enumerate(prompt))
    raise InvalidArgumentError(
        "prompt", "must be a string, a list of token ids, or a non-empty list of either"
    )


def _one_prompt(param: str, prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError(param, "must not be empty")
        return prompt
    if _is_token_ids(prompt):
        for token_id in prompt:  # the worker checks them against its vocabulary
            check_int64(param, token_id, low=0)
        return list(prompt)
    raise InvalidArgumentError(param, "must be a non-empty string or list of token ids")


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )
