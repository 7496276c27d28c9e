"""Conversions between the SDK's types and the `headrace.v1` messages.

One module serves both directions, so the client, the router and the worker cannot disagree
on what a field means. `GenerationConfig`'s dataclass fields and the proto message's fields
share their names (a test holds them equal).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from headrace.protos import generation_pb2 as pb
from headrace.sdk.config import GenerationConfig, check_int64
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.outputs import FinishReason, StreamChunk, TokenLogprob, Usage
from headrace.sdk.prompts import Chat, ChatMessage, Prompt, Tool, ToolCall
from headrace.sdk.status import duration

_DEFAULT_CONFIG = GenerationConfig()
_CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(GenerationConfig))
_REPEATED_FIELDS = frozenset({"stop", "stop_token_ids", "choice", "allowed_token_ids", "bad_words"})
_MAP_FIELDS = frozenset({"logit_bias"})
#: Fields whose SDK value is a bool or a string and whose wire field a string: their bools
#: travel as "true" / "false" (`GenerationConfig` reads those back as the bools).
_BOOL_OR_STRING_FIELDS = frozenset({"early_stopping"})

FINISH_REASONS: dict[FinishReason, pb.FinishReason] = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}
_FINISH_REASONS_BACK = {wire: reason for reason, wire in FINISH_REASONS.items()}


def finish_reason_to_wire(reason: FinishReason | None) -> pb.FinishReason:
    return pb.FINISH_REASON_UNSPECIFIED if reason is None else FINISH_REASONS[reason]


def finish_reason_from_wire(reason: pb.FinishReason) -> FinishReason | None:
    return _FINISH_REASONS_BACK.get(reason)


# --- GenerationConfig ------------------------------------------------------------------


def config_to_wire(config: GenerationConfig) -> pb.GenerationConfig:
    """Only the fields that differ from the defaults are set: unset means default."""
    wire = pb.GenerationConfig()
    for name in _CONFIG_FIELDS:
        value = getattr(config, name)
        if value == getattr(_DEFAULT_CONFIG, name):
            continue
        if name in _REPEATED_FIELDS:
            getattr(wire, name).extend(value)
        elif name in _MAP_FIELDS:
            getattr(wire, name).update(value)
        elif name in _BOOL_OR_STRING_FIELDS:
            setattr(wire, name, str(value).lower())
        else:
            setattr(wire, name, value)
    return wire


def config_from_wire(wire: pb.GenerationConfig) -> GenerationConfig:
    """Validated; a bad value raises InvalidArgumentError naming ``config.<field>``."""
    options: dict[str, object] = {}
    for name in _CONFIG_FIELDS:
        if name in _REPEATED_FIELDS:
            options[name] = tuple(getattr(wire, name))
        elif name in _MAP_FIELDS:
            options[name] = dict(getattr(wire, name)) or None
        elif wire.HasField(name):
            options[name] = getattr(wire, name)
    try:
        return GenerationConfig(**options)  # type: ignore[arg-type]
    except InvalidArgumentError as error:
        message = str(error).removeprefix(f"{error.field}: ")
        raise InvalidArgumentError(f"config.{error.field}", message) from None


# --- Request ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A `headrace.v1.Request`, checked and in SDK types."""

    request_id: str
    prompt: Prompt
    config: GenerationConfig
    priority: int
    #: Seconds from arrival; None = no limit.
    timeout_s: float | None
    #: Empty = the server's model.
    model: str
    #: The LoRA adapter's name; empty = the base model.
    adapter: str = ""
    #: How many of the prompt's last tokens an earlier attempt generated (failover).
    num_resumed_tokens: int = 0


def request_to_wire(
    request_id: str,
    prompt: Prompt,
    config: GenerationConfig,
    priority: int = 0,
    timeout_s: float | None = None,
    model: str = "",
) -> pb.Request:
    """Raises InvalidArgumentError for an integer the wire cannot carry (int64), naming it
    (`GenerationConfig` has checked its own)."""
    check_int64("priority", priority)
    wire = pb.Request(
        request_id=request_id, config=config_to_wire(config), priority=priority, model=model
    )
    if isinstance(prompt, str):
        wire.text = prompt
    elif isinstance(prompt, Chat):
        wire.chat.CopyFrom(chat_to_wire(prompt))
    else:
        for token_id in prompt:
            check_int64("prompt_token_ids", token_id)
        wire.token_ids.ids.extend(prompt)
    if timeout_s is not None:
        wire.timeout.CopyFrom(duration(timeout_s))
    return wire


def chat_to_wire(chat: Chat) -> pb.Chat:
    wire = pb.Chat(
        messages=[_chat_message_to_wire(m) for m in chat.messages],
        tools=[tool.to_json() for tool in chat.tools],
    )
    if not chat.add_generation_prompt:
        wire.add_generation_prompt = False
    return wire


def _chat_message_to_wire(message: ChatMessage) -> pb.ChatMessage:
    calls = [pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in message.tool_calls]
    return pb.ChatMessage(
        role=message.role,
        content=message.content,
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
    )


def chat_from_wire(wire: pb.Chat) -> Chat:
    """Checked by `Chat`: a malformed part raises InvalidArgumentError naming it."""
    add = wire.add_generation_prompt if wire.HasField("add_generation_prompt") else True
    messages = tuple(
        ChatMessage(
            m.role,
            m.content,
            tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls),
            m.tool_call_id,
        )
        for m in wire.messages
    )
    tools = tuple(Tool.from_json(text, f"chat.tools[{i}]") for i, text in enumerate(wire.tools))
    return Chat(messages, add, tools)


def tokenize_request_to_wire(
    prompt: str | Chat, add_special_tokens: bool | None = None, model: str = ""
) -> pb.TokenizeRequest:
    """``add_special_tokens``: text only; None leaves the server's default (true)."""
    wire = pb.TokenizeRequest(model=model)
    if isinstance(prompt, Chat):
        wire.chat.CopyFrom(chat_to_wire(prompt))
    elif isinstance(prompt, str):
        wire.text = prompt
    else:
        raise InvalidArgumentError("prompt", f"must be text or a Chat, got {prompt!r}")
    if add_special_tokens is not None:
        wire.add_special_tokens = add_special_tokens
    return wire


def tokenize_prompt_from_wire(wire: pb.TokenizeRequest) -> str | Chat:
    """A `Tokenize` call's prompt; InvalidArgumentError when it has none."""
    kind = wire.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgumentError("prompt", "set one of text or chat")
    return wire.text if kind == "text" else chat_from_wire(wire.chat)


def with_request_id(wire: pb.Request) -> pb.Request:
    """`GenerateOne`: the request, with a server-chosen id if it came without one (its chunks
    carry the id; only a multiplexed stream needs the client to choose)."""
    if wire.request_id:
        return wire
    named = pb.Request()
    named.CopyFrom(wire)
    named.request_id = uuid.uuid4().hex
    return named


def request_from_wire(wire: pb.Request) -> ParsedRequest:
    """Raises InvalidArgumentError naming the field for anything malformed."""
    if not wire.request_id:
        raise InvalidArgumentError("request_id", "must be a non-empty string")
    kind = wire.WhichOneof("prompt")
    if kind is None:
        raise InvalidArgumentError("prompt", "set one of text, token_ids or chat")
    prompt: Prompt
    if kind == "text":
        prompt = wire.text
    elif kind == "chat":
        prompt = chat_from_wire(wire.chat)
    else:
        prompt = list(wire.token_ids.ids)
    timeout_s = None
    if wire.HasField("timeout"):
        timeout_s = wire.timeout.ToNanoseconds() / 1e9
        if timeout_s <= 0:
            raise InvalidArgumentError("timeout", f"must be positive, got {timeout_s:g} s")
    config = config_from_wire(wire.config)
    num_resumed = wire.num_resumed_tokens
    if not 0 <= num_resumed <= (len(wire.token_ids.ids) if kind == "token_ids" else 0):
        raise InvalidArgumentError(
            "num_resumed_tokens", f"must be in [0, the token-id prompt's length], got {num_resumed}"
        )
    return ParsedRequest(
        wire.request_id,
        prompt,
        config,
        wire.priority,
        timeout_s,
        wire.model,
        wire.adapter,
        num_resumed,
    )


# --- chunks -----------------------------------------------------------------------------


def logprobs_to_wire(logprobs: Iterable[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [logprob_to_wire(entry) for entry in logprobs]


def logprob_to_wire(entry: TokenLogprob) -> pb.TokenLogprob:
    """Token names travel where the entry has them (`top_tokens` parallel to `top`)."""
    names = entry.top_tokens or [("", b"")] * len(entry.top)
    top = [
        pb.TopLogprob(token_id=t, logprob=lp, token=text, token_bytes=data)
        for (t, lp), (text, data) in zip(entry.top, names, strict=True)
    ]
    return pb.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        top=top,
        token=entry.token,
        token_bytes=entry.token_bytes,
        rank=entry.rank,
    )


def logprobs_from_wire(wire: Iterable[pb.TokenLogprob]) -> list[TokenLogprob]:
    return [logprob_from_wire(entry) for entry in wire]


def logprob_from_wire(wire: pb.TokenLogprob) -> TokenLogprob:
    """`top_tokens` stays empty when the server named no alternative (an older server)."""
    top_tokens = [(t.token, t.token_bytes) for t in wire.top]
    if not any(text or data for text, data in top_tokens):
        top_tokens = []
    return TokenLogprob(
        wire.token_id,
        wire.logprob,
        [(t.token_id, t.logprob) for t in wire.top],
        token=wire.token,
        token_bytes=wire.token_bytes,
        rank=wire.rank,
        top_tokens=top_tokens,
    )


def usage_to_wire(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.num_prompt_tokens,
        generated_tokens=usage.num_generated_tokens,
        cached_tokens=usage.num_cached_tokens,
    )


def usage_from_wire(wire: pb.Usage) -> Usage:
    return Usage(wire.prompt_tokens, wire.generated_tokens, wire.cached_tokens)


def chunk_from_wire(wire: pb.Chunk) -> StreamChunk:
    """The chunk in SDK types (its in-band error, if any, is read by the caller)."""
    usage = usage_from_wire(wire.usage) if wire.HasField("usage") else None
    # A one-token prompt's logprobs are none: the first prompt token says they came.
    has_prompt_logprobs = bool(wire.prompt_logprobs) or wire.HasField("first_prompt_token")
    return StreamChunk(
        request_id=wire.request_id,
        index=wire.index,
        token_ids=list(wire.token_ids),
        text=wire.text,
        logprobs=logprobs_from_wire(wire.logprobs),
        finish_reason=finish_reason_from_wire(wire.finish_reason),
        finished=wire.finished,
        usage=usage,
        prompt_logprobs=logprobs_from_wire(wire.prompt_logprobs) if has_prompt_logprobs else None,
        first_prompt_token=(
            logprob_from_wire(wire.first_prompt_token)
            if wire.HasField("first_prompt_token")
            else None
        ),
        prompt_text=wire.prompt_text if wire.HasField("first_prompt_token") else None,
        weight_version=wire.weight_version,
        cumulative_logprob=_optional(wire, "cumulative_logprob"),
        beam_score=_optional(wire, "beam_score"),
    )


def _optional(wire: pb.Chunk, name: str) -> float | None:
    """An optional field's value; None when it is unset."""
    return getattr(wire, name) if wire.HasField(name) else None
