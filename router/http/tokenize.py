"""vLLM's ``/tokenize`` and ``/detokenize`` bodies ↔ the `Tokenize` / `Detokenize` calls.

Design note. The router has no tokenizer: both calls go to a healthy worker, which tokenizes
exactly as it does a request's prompt (text with the tokenizer's special tokens unless told
not to, messages rendered with the model's chat template), so a count from here is the count
a completion call with that prompt would report. The shapes are vLLM's:

    POST /tokenize   {model?, prompt | messages, add_special_tokens?, add_generation_prompt?,
                      continue_final_message?}  →  {count, max_model_len, tokens, token_strs}
    POST /detokenize {model?, tokens}           →  {prompt}

``token_strs`` is always null: token strings would need the tokenizer here, so
``return_token_strs: true`` is refused. With messages the chat template places the special
tokens, so ``add_special_tokens`` may only be false there (vLLM's default for messages).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from headrace.protos import generation_pb2 as pb
from headrace.router.http.prompts import chat_prompt
from headrace.router.http.requests import _typed
from headrace.sdk.config import check_int64
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat

TOKENIZE_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "messages",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "return_token_strs",
    }
)
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})
#: The fields a worker's refusal names → the body's.
PARAMS = {"chat": "messages", "token_ids": "tokens"}


@dataclass(frozen=True, slots=True)
class TokenizeCall:
    #: As the client named it ("" = the served model).
    model: str
    prompt: str | Chat
    #: Text only; None: the tokenizer's default (true).
    add_special_tokens: bool | None


def parse_tokenize(body: Any) -> TokenizeCall:
    fields = _fields(body, TOKENIZE_FIELDS)
    model = _typed(fields, "model", str, "")
    if _typed(fields, "return_token_strs", bool, False):
        raise InvalidArgumentError(
            "return_token_strs", "token strings are not supported (the router has no tokenizer)"
        )
    if ("prompt" in fields) == ("messages" in fields):
        raise InvalidArgumentError("prompt", "give exactly one of prompt or messages")
    add_special_tokens = None
    if "add_special_tokens" in fields:
        add_special_tokens = _typed(fields, "add_special_tokens", bool, True)
    if "prompt" in fields:
        prompt = _typed(fields, "prompt", str, "")
        return TokenizeCall(model, prompt, add_special_tokens)
    if add_special_tokens:
        raise InvalidArgumentError(
            "add_special_tokens", "must be false with messages: the chat template places them"
        )
    continue_final = _typed(fields, "continue_final_message", bool, False)
    add_generation_prompt = _typed(fields, "add_generation_prompt", bool, not continue_final)
    if continue_final and add_generation_prompt:
        raise InvalidArgumentError(
            "continue_final_message", "cannot be combined with add_generation_prompt: true"
        )
    return TokenizeCall(model, chat_prompt(fields["messages"], add_generation_prompt), None)


def parse_detokenize(body: Any) -> tuple[str, list[int]]:
    """(model, token ids)."""
    fields = _fields(body, DETOKENIZE_FIELDS)
    tokens = fields.get("tokens")
    if not isinstance(tokens, list) or any(
        not isinstance(t, int) or isinstance(t, bool) for t in tokens
    ):
        raise InvalidArgumentError("tokens", "must be a list of token ids")
    for token_id in tokens:
        check_int64("tokens", token_id, low=0)
    return _typed(fields, "model", str, ""), tokens


def tokenize_body(response: pb.TokenizeResponse) -> dict[str, object]:
    tokens = list(response.token_ids)
    return {
        "count": len(tokens),
        "max_model_len": response.max_model_len,
        "tokens": tokens,
        "token_strs": None,
    }


def openai_param(field: str) -> str:
    """The body's name for the field a worker's refusal names."""
    return PARAMS.get(field, field)


def _fields(body: Any, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise InvalidArgumentError("", "the request body must be a JSON object")
    for name in body:
        if name not in known:
            raise InvalidArgumentError(name, f"unrecognized request argument: {name!r}")
    return {name: value for name, value in body.items() if value is not None}
