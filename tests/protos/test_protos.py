"""The `.proto` files are the contract: generated code matches them, every declaration is
documented, and the SDK's config mirrors the wire's field for field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from headrace.protos import codegen
from headrace.protos import generation_pb2 as pb
from headrace.sdk import wire
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError


def test_generated_code_matches_the_protos(tmp_path: Path) -> None:
    written = codegen.generate(tmp_path)
    assert {p.name for p in written} == {
        f"{stem}{suffix}"
        for stem in ("control", "generation", "worker")
        for suffix in codegen.GENERATED_SUFFIXES
    }
    for path in written:
        committed = codegen.PROTO_ROOT / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed.name} is stale: run `python -m headrace.protos.codegen`"
        )


_DECLARATION = re.compile(
    r"^\s*(message|service|enum|rpc|oneof|(optional |repeated )?[\w.]+ \w+ = \d+;|[A-Z_]+ = \d+;)"
)


@pytest.mark.parametrize("proto", codegen.proto_files(), ids=lambda p: p.name)
def test_every_declaration_has_a_doc_comment(proto: Path) -> None:
    lines = proto.read_text().splitlines()
    undocumented = [
        line.strip()
        for i, line in enumerate(lines)
        if _DECLARATION.match(line) and not lines[i - 1].strip().startswith("//")
    ]
    assert undocumented == []


def test_config_fields_match_the_wire() -> None:
    sdk_fields = {f.name for f in dataclasses.fields(GenerationConfig)}
    assert sdk_fields == set(pb.GenerationConfig.DESCRIPTOR.fields_by_name)


def test_config_round_trips_and_defaults_stay_unset() -> None:
    config = GenerationConfig(
        max_tokens=7,
        temperature=0.0,
        top_k=5,
        seed=2**63 - 1,
        stop=("a", "b"),
        stop_token_ids=(3,),
        n=2,
        logprobs=0,
        skip_special_tokens=False,
    )
    on_wire = wire.config_to_wire(config)
    assert wire.config_from_wire(on_wire) == config
    assert not on_wire.HasField("top_p")  # a default is left unset
    assert wire.config_from_wire(pb.GenerationConfig()) == GenerationConfig()


def test_bad_wire_config_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        wire.config_from_wire(pb.GenerationConfig(top_k=-1))
    assert caught.value.field == "config.top_k"
    assert str(caught.value) == "config.top_k: must be >= 0, got -1"


def test_request_round_trip_with_token_ids_and_timeout() -> None:
    request = wire.request_to_wire(
        "r1", [1, 2, 3], GenerationConfig(), priority=-2, timeout_s=1.25, model="m"
    )
    parsed = wire.request_from_wire(request)
    assert (parsed.request_id, parsed.prompt, parsed.priority) == ("r1", [1, 2, 3], -2)
    assert (parsed.timeout_s, parsed.model) == (1.25, "m")
