"""What a prompt may be, for every API that takes one (SDK, offline `LLM`, engine, wire).

Text is tokenized by the server's tokenizer; token ids are used as they are; a `Chat` (a
conversation) is rendered by the worker with the model's chat template, which is what an
Instruct model expects: asked a question as raw text it may answer nothing at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from headrace.sdk.errors import InvalidArgumentError


@dataclass(frozen=True, slots=True)
class ChatMessage:
    #: "system", "user", "assistant", or another role the model's template knows.
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class Chat:
    """A conversation prompt, oldest message first."""

    messages: tuple[ChatMessage, ...]
    #: End with the opening of an assistant turn, so the model answers; False leaves the
    #: last message open for the model to continue.
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        if not self.messages:
            raise InvalidArgumentError("chat.messages", "must hold at least one message")
        for i, message in enumerate(self.messages):
            if not isinstance(message.role, str) or not message.role:
                raise InvalidArgumentError(
                    f"chat.messages[{i}].role", f"must be a non-empty string, got {message.role!r}"
                )
            if not isinstance(message.content, str):
                raise InvalidArgumentError(
                    f"chat.messages[{i}].content", f"must be a string, got {message.content!r}"
                )

    @classmethod
    def of(cls, messages: Messages, add_generation_prompt: bool = True) -> Chat:
        """A chat from `ChatMessage`s or OpenAI-style dicts ``{"role": ..., "content": ...}``."""
        if isinstance(messages, str) or not isinstance(messages, Iterable):
            raise InvalidArgumentError("chat.messages", "must be a list of messages")
        return cls(tuple(_message(i, m) for i, m in enumerate(messages)), add_generation_prompt)

    @property
    def num_content_bytes(self) -> int:
        """UTF-8 bytes of the messages' contents (the rendered prompt adds the template's)."""
        return sum(len(message.content.encode()) for message in self.messages)

    def as_dicts(self) -> list[dict[str, str]]:
        """The messages as a chat template takes them."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


def _message(index: int, message: ChatMessage | Mapping[str, str]) -> ChatMessage:
    if isinstance(message, ChatMessage):
        return message
    if not isinstance(message, Mapping):
        raise InvalidArgumentError(
            f"chat.messages[{index}]", f"must be a {{role, content}} mapping, got {message!r}"
        )
    return ChatMessage(message.get("role", ""), message.get("content", ""))


#: What `Chat.of` and the SDK's chat methods take.
Messages = Iterable[ChatMessage | Mapping[str, str]]

#: Text, token ids, or a conversation.
Prompt = str | list[int] | Chat
