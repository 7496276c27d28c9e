"""vLLM's /tokenize and /detokenize bodies: what each field becomes, and every refusal names
the body's field."""

from __future__ import annotations

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.router.http.tokenize import (
    openai_param,
    parse_detokenize,
    parse_tokenize,
    tokenize_body,
)
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.prompts import Chat, ChatMessage

MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_prompt_or_messages_become_the_calls_prompt():
    call = parse_tokenize({"model": "m", "prompt": "hi", "add_special_tokens": False})
    assert (call.model, call.prompt, call.add_special_tokens) == ("m", "hi", False)
    assert parse_tokenize({"prompt": "hi"}).add_special_tokens is None
    chat = parse_tokenize({"messages": MESSAGES}).prompt
    assert chat == Chat((ChatMessage("user", "hi"),), add_generation_prompt=True)
    continued = parse_tokenize({"messages": MESSAGES, "continue_final_message": True})
    assert isinstance(continued.prompt, Chat) and not continued.prompt.add_generation_prompt
    assert parse_detokenize({"tokens": [1, 2]}) == ("", [1, 2])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": MESSAGES, "continue_final_message": True, "add_generation_prompt": True},
         "continue_final_message"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ({"messages": "hi"}, "messages"),
        ([], ""),
    ],
)  # fmt: skip
def test_a_bad_tokenize_body_names_its_field(body: object, param: str):
    with pytest.raises(InvalidArgumentError) as refused:
        parse_tokenize(body)
    assert refused.value.field == param


def test_the_response_is_vllms_and_a_workers_fields_are_the_bodys():
    body = tokenize_body(pb.TokenizeResponse(token_ids=[3, 4], max_model_len=512))
    assert body == {"count": 2, "max_model_len": 512, "tokens": [3, 4], "token_strs": None}
    assert (openai_param("chat"), openai_param("token_ids"), openai_param("prompt")) == (
        "messages",
        "tokens",
        "prompt",
    )
