"""Integers the wire cannot carry (int64) and numbers no float can hold are refused where the
config or request is built, naming the field: never a protobuf ``ValueError`` later
(issue 31: a 500 from `config_to_wire`)."""

from __future__ import annotations

import pytest
from headrace.sdk import wire
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError

TOO_BIG, TOO_SMALL = 2**63, -(2**63) - 1


@pytest.mark.parametrize("value", [TOO_BIG, TOO_SMALL])
@pytest.mark.parametrize(
    ("field", "wrap"),
    [
        ("max_tokens", lambda v: v),
        ("min_tokens", lambda v: v),
        ("top_k", lambda v: v),
        ("no_repeat_ngram_size", lambda v: v),
        ("seed", lambda v: v),
        ("stop_token_ids", lambda v: [v]),
        ("allowed_token_ids", lambda v: [1, v]),
        ("logit_bias", lambda v: {v: 1.0}),
        ("logit_bias", lambda v: {str(v): 1.0} if v > 0 else {v: 1.0}),
    ],
)
def test_an_integer_outside_int64_is_refused_naming_its_field(field, wrap, value):
    options = {field: wrap(value)}
    if field == "min_tokens":
        options["max_tokens"] = 2**62
    with pytest.raises(InvalidArgumentError) as refused:
        GenerationConfig(**options)
    assert refused.value.field == field


def test_the_int64_edges_themselves_travel():
    config = GenerationConfig(
        max_tokens=2**63 - 1, top_k=2**63 - 1, stop_token_ids=(2**63 - 1,),
        allowed_token_ids=(0, 2**63 - 1), logit_bias={2**63 - 1: 1.0},
    )  # fmt: skip
    assert wire.config_from_wire(wire.config_to_wire(config)) == config
    request = wire.request_to_wire("r", [0, 2**63 - 1], config, priority=-(2**63))
    assert wire.request_from_wire(request).priority == -(2**63)


@pytest.mark.parametrize("value", [TOO_BIG, TOO_SMALL])
def test_a_request_with_an_int64_overflow_is_refused_naming_it(value):
    with pytest.raises(InvalidArgumentError) as refused:
        wire.request_to_wire("r", "hi", GenerationConfig(), priority=value)
    assert refused.value.field == "priority"
    with pytest.raises(InvalidArgumentError) as refused:
        wire.request_to_wire("r", [1, value], GenerationConfig())
    assert refused.value.field == "prompt_token_ids"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 10**400),
        ("top_p", 10**400),
        ("presence_penalty", -(10**400)),
        ("length_penalty", 10**400),
        ("logit_bias", {"5": 10**400}),
        ("logit_bias", {"9" * 5000: 1}),
        ("logit_bias", {"²": 1}),
    ],
)
def test_a_number_no_float_can_hold_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidArgumentError) as refused:
        GenerationConfig(**{field: value})
    assert refused.value.field == field
