"""`GenerationConfig`'s constraints and logit controls: what is accepted, how it is kept, what
is refused (naming the field), and that they cross the wire unchanged."""

from __future__ import annotations

import json

import pytest
from headrace.protos import generation_pb2 as pb
from headrace.sdk import wire
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def test_a_schema_dict_is_kept_as_its_json_text_in_key_order():
    config = GenerationConfig(json_schema=SCHEMA)
    assert config.json_schema == json.dumps(SCHEMA)
    assert list(json.loads(config.json_schema)["properties"]) == ["b", "a"]  # output order
    assert config.constraint == ("json_schema", json.dumps(SCHEMA))
    assert GenerationConfig(choice=["x", "y"]).constraint == ("choice", '["x", "y"]')
    assert GenerationConfig(json_object=True).constraint == ("json_object", "")
    assert GenerationConfig().constraint is None


def test_logit_bias_keys_may_be_json_strings_and_the_config_stays_hashable():
    config = GenerationConfig(logit_bias={"5": 1, 7: -100})
    assert config.logit_bias == {5: 1.0, 7: -100.0}
    assert hash(config) == hash(GenerationConfig(logit_bias={5: 2.0}))  # bias is not hashed
    assert GenerationConfig(logit_bias={}).logit_bias is None


@pytest.mark.parametrize(
    ("options", "field", "reason"),
    [
        ({"regex": "a", "choice": ["b"]}, "choice", "only one constraint at a time"),
        ({"json_object": True, "json_schema": "{}"}, "json_object", "only one constraint"),
        ({"json_schema": "{not json"}, "json_schema", "is not valid JSON"),
        ({"json_schema": "[1]"}, "json_schema", "must be a JSON object"),
        ({"json_schema": 5}, "json_schema", "must be a JSON object"),
        ({"regex": ""}, "regex", "non-empty string"),
        ({"grammar": 3}, "grammar", "non-empty string"),
        ({"choice": ["a", ""]}, "choice", "must not be empty"),
        ({"json_object": "yes"}, "json_object", "must be a bool"),
        ({"logit_bias": {1: 101}}, "logit_bias", "[-100.0, 100.0]"),
        ({"logit_bias": {-1: 1}}, "logit_bias", ">= 0"),
        ({"logit_bias": {"one": 1}}, "logit_bias", "must be an integer"),
        ({"logit_bias": [1, 2]}, "logit_bias", "must map token ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", ">= 0"),
        ({"bad_words": ["ok", " "]}, "bad_words", "must not be empty or blank"),
    ],
)
def test_bad_controls_are_refused_naming_the_field(options: dict, field: str, reason: str):
    with pytest.raises(InvalidArgumentError) as refused:
        GenerationConfig(**options)
    assert refused.value.field == field
    assert reason in str(refused.value)


def test_controls_round_trip_the_wire_and_defaults_stay_unset():
    configs = [
        GenerationConfig(json_schema=SCHEMA, logit_bias={3: 1.5}, bad_words=("no",)),
        GenerationConfig(json_object=True, allowed_token_ids=(1, 2, 3)),
        GenerationConfig(regex=r"\d+"),
        GenerationConfig(grammar='root ::= "a"'),
        GenerationConfig(choice=("yes", "no")),
    ]
    for config in configs:
        assert wire.config_from_wire(wire.config_to_wire(config)) == config
    plain = wire.config_to_wire(GenerationConfig())
    assert not plain.HasField("json_schema") and not plain.logit_bias and not plain.choice


def test_two_constraints_on_the_wire_name_the_config_field():
    with pytest.raises(InvalidArgumentError) as refused:
        wire.config_from_wire(pb.GenerationConfig(regex="a", choice=["b"]))
    assert refused.value.field == "config.choice"


def test_num_resumed_tokens_crosses_the_wire_and_is_bounded_by_the_prompt():
    request = wire.request_to_wire("r", [1, 2, 3], GenerationConfig())
    request.num_resumed_tokens = 2
    assert wire.request_from_wire(request).num_resumed_tokens == 2
    request.num_resumed_tokens = 4
    with pytest.raises(InvalidArgumentError) as refused:
        wire.request_from_wire(request)
    assert refused.value.field == "num_resumed_tokens"
    text = wire.request_to_wire("r", "hello", GenerationConfig())
    text.num_resumed_tokens = 1
    with pytest.raises(InvalidArgumentError):
        wire.request_from_wire(text)
