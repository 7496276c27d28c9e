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
from headrace.sdk.outputs import TokenLogprob


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


@pytest.mark.parametrize(("early_stopping", "on_wire"), [(True, "true"), ("never", "never")])
def test_beam_options_round_trip_with_early_stopping_as_a_string(
    early_stopping: bool | str, on_wire: str
) -> None:
    config = GenerationConfig(
        temperature=0.0, n=2, num_beams=3, length_penalty=0.5, early_stopping=early_stopping
    )
    wired = wire.config_to_wire(config)
    assert (wired.num_beams, wired.length_penalty, wired.early_stopping) == (3, 0.5, on_wire)
    assert wire.config_from_wire(wired) == config


def test_early_stopping_false_is_the_default_and_its_wire_strings_read_as_bools() -> None:
    assert not wire.config_to_wire(GenerationConfig(early_stopping=False)).HasField(
        "early_stopping"
    )
    for text, value in (("false", False), ("true", True), ("TRUE", True)):
        config = wire.config_from_wire(pb.GenerationConfig(early_stopping=text))
        assert config.early_stopping is value


def test_bad_early_stopping_on_the_wire_names_the_field() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        wire.config_from_wire(pb.GenerationConfig(num_beams=2, early_stopping="sometimes"))
    assert caught.value.field == "config.early_stopping"
    assert "sometimes" in str(caught.value)


def test_a_beam_option_beams_cannot_honour_is_refused_naming_it() -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        wire.config_from_wire(pb.GenerationConfig(num_beams=2, top_p=0.5))
    assert caught.value.field == "config.top_p"


def test_a_beam_chunk_carries_its_scores_and_others_none() -> None:
    beam = wire.chunk_from_wire(
        pb.Chunk(request_id="r", index=1, token_ids=[4, 5], cumulative_logprob=-2.5, beam_score=0.0)
    )
    assert (beam.index, beam.cumulative_logprob, beam.beam_score) == (1, -2.5, 0.0)
    plain = wire.chunk_from_wire(pb.Chunk(request_id="r", token_ids=[4]))
    assert (plain.cumulative_logprob, plain.beam_score) == (None, None)


def test_named_logprobs_survive_the_wire_and_unnamed_ones_stay_unnamed() -> None:
    named = TokenLogprob(7, -0.5, [(7, -0.5), (9, -1.5)], "\ufffd", b"\xe6", 1,
                         [("\ufffd", b"\xe6"), (" the", b" the")])  # fmt: skip
    (back,) = wire.logprobs_from_wire(wire.logprobs_to_wire([named]))
    assert back == named
    unnamed_entry = TokenLogprob(3, -1.0, [(4, -0.9)])
    (unnamed,) = wire.logprobs_from_wire(wire.logprobs_to_wire([unnamed_entry]))
    assert (unnamed.token, unnamed.token_bytes, unnamed.top_tokens) == ("", b"", [])


def test_a_chunk_with_prompt_logprobs_carries_the_first_prompt_token_and_the_text() -> None:
    first = pb.TokenLogprob(token_id=5, token="Hi", token_bytes=b"Hi")
    chunk = wire.chunk_from_wire(
        pb.Chunk(request_id="r", first_prompt_token=first, prompt_text="Hi")
    )  # a one-token prompt: no logprobs, yet they came
    assert chunk.prompt_logprobs == [] and chunk.prompt_text == "Hi"
    assert chunk.first_prompt_token == TokenLogprob(5, 0.0, token="Hi", token_bytes=b"Hi")
    plain = wire.chunk_from_wire(pb.Chunk(request_id="r", token_ids=[4]))
    assert (plain.prompt_logprobs, plain.first_prompt_token, plain.prompt_text) == (None,) * 3
