"""Output constraints on the real SmolLM2-135M: what it writes under a JSON schema parses and
validates, under a regex fullmatches, under a choice is one of them; greedy, seeded sampling
and n > 1 alike. A request resumed after a failover (prompt + tokens so far, with
num_resumed_tokens) finishes as the uninterrupted one does. Bad constraints fail in-band,
naming the field, and other requests go on."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.sdk.outputs import FinishReason
from headrace.worker import LLM, AsyncEngine, EngineConfig

pytestmark = pytest.mark.timeout(600)

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
COLOUR = {"type": "string", "enum": ["red", "green", "blue"]}
NUMBERS = {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4}
NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {
            "type": "object",
            "properties": {
                "lat": {"type": "integer", "minimum": -90, "maximum": 90},
                "lon": {"type": "integer", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
        },
    },
    "required": ["city", "location"],
}
SCHEMAS = [PERSON, COLOUR, NUMBERS, NESTED]
PROMPTS = [
    "Describe a person as JSON with a name and an age.",
    "What colour is the sky? Answer in JSON.",
    "List a few small numbers as a JSON array.",
    "Give a city and its coordinates as JSON.",
]
PHONE = r"\(\d{3}\) \d{3}-\d{4}"


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(str(smollm2_dir), dtype="float32", cpu_kv_cache_gib=0.25)


def chat(llm: LLM, prompts: list[str], configs: list[GenerationConfig]):
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], configs)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_json_schema_outputs_parse_and_validate(llm, sampled: bool):
    options = {"temperature": 0.7, "seed": 11, "n": 2} if sampled else {"temperature": 0.0}
    configs = [GenerationConfig(max_tokens=96, json_schema=s, **options) for s in SCHEMAS]
    results = chat(llm, PROMPTS, configs)
    for schema, result in zip(SCHEMAS, results, strict=True):
        assert len(result.outputs) == (2 if sampled else 1)
        for sample in result.outputs:
            assert sample.finish_reason == FinishReason.STOP, sample.text
            jsonschema.validate(json.loads(sample.text), schema)


def test_regex_choice_and_any_json(llm):
    configs = [
        GenerationConfig(max_tokens=24, temperature=0.0, regex=PHONE),
        GenerationConfig(max_tokens=24, temperature=0.9, seed=3, n=3, regex=PHONE),
        GenerationConfig(max_tokens=8, temperature=0.0, choice=("yes", "no")),
        GenerationConfig(max_tokens=8, temperature=1.0, seed=5, n=4, choice=("cat", "dog")),
        GenerationConfig(max_tokens=64, temperature=0.0, json_object=True),
    ]
    prompts = ["What is your phone number?"] * 2 + ["Is water wet?", "Which pet?", "Any JSON."]
    phone, sampled_phones, yes_no, pets, anything = chat(llm, prompts, configs)
    for sample in [*phone.outputs, *sampled_phones.outputs]:
        assert re.fullmatch(PHONE, sample.text), sample.text
    assert yes_no.text in ("yes", "no")
    assert {sample.text for sample in pets.outputs} <= {"cat", "dog"}
    assert all(
        s.finish_reason == FinishReason.STOP for r in (phone, yes_no, pets) for s in r.outputs
    )
    if anything.outputs[0].finish_reason == FinishReason.STOP:
        json.loads(anything.text)


def test_a_seeded_constrained_request_repeats_itself(llm):
    config = GenerationConfig(max_tokens=64, temperature=0.8, seed=21, json_schema=PERSON)
    first, again = chat(llm, PROMPTS[:1] * 2, [config, config])
    assert first.token_ids == again.token_ids


def test_a_resumed_request_finishes_as_the_uninterrupted_one(llm):
    """The router's failover: prompt + tokens so far, num_resumed_tokens = their number."""
    for config in (
        GenerationConfig(max_tokens=64, temperature=0.0, json_schema=PERSON),
        GenerationConfig(max_tokens=64, temperature=0.8, seed=4, json_schema=NESTED),
    ):
        (whole,) = chat(llm, PROMPTS[:1], [config])
        assert whole.outputs[0].finish_reason == FinishReason.STOP
        cut = len(whole.token_ids) // 2
        resumed_prompt = whole.prompt_token_ids + whole.token_ids[:cut]
        remaining = GenerationConfig(**{**_options(config), "max_tokens": 64 - cut})
        engine = llm.engine
        engine.add_request("resumed", resumed_prompt, remaining, num_resumed_tokens=cut)
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for output in engine.step():
                tokens.extend(t for delta in output.samples for t in delta.token_ids)
        assert whole.token_ids[:cut] + tokens == whole.token_ids
        jsonschema.validate(json.loads(whole.text), json.loads(config.json_schema or ""))


def test_resumed_tokens_the_constraint_refuses_are_invalid(llm):
    bad = llm.engine.tokenizer.encode("not json")
    config = GenerationConfig(max_tokens=8, temperature=0.0, json_schema=PERSON)
    with pytest.raises(InvalidArgumentError) as refused:
        llm.engine.add_request("bad-resume", [1, 2, *bad], config, num_resumed_tokens=len(bad))
    assert refused.value.field == "num_resumed_tokens"
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"regex": "(unclosed"}, "config.regex"),
        ({"grammar": "root ::= undefined_rule"}, "config.grammar"),
        ({"json_schema": {"type": "no-such-type"}}, "config.json_schema"),
        ({"logit_bias": {10**6: 1.0}}, "config.logit_bias"),
        ({"allowed_token_ids": (10**6,)}, "config.allowed_token_ids"),
    ],
)
def test_a_bad_constraint_fails_in_band_and_others_go_on(smollm2_dir, options, field):
    engine = AsyncEngine(EngineConfig(str(smollm2_dir), dtype="float32", cpu_kv_cache_gib=0.25))
    good = GenerationConfig(max_tokens=8, temperature=0.0, choice=("yes", "no"))

    async def collect(request_id: str, config: GenerationConfig) -> str:
        text = ""
        async for output in engine.generate(request_id, "Is water wet?", config):
            text += "".join(delta.text for delta in output.samples)
        return text

    async def main() -> str:
        answer = asyncio.create_task(collect("good", good))
        with pytest.raises(InvalidArgumentError) as refused:
            await collect("bad", GenerationConfig(max_tokens=8, **options))
        assert refused.value.field == field
        assert "does not compile" in str(refused.value) or "outside the vocab" in str(refused.value)
        return await answer

    try:
        assert asyncio.run(main()) in ("yes", "no")
    finally:
        engine.shutdown()


def _options(config: GenerationConfig) -> dict:
    return {name: getattr(config, name) for name in config.__slots__}  # type: ignore[attr-defined]
