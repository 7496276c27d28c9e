"""The offline and streaming APIs: stops, logprobs, bad input, streaming == offline."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM, AsyncEngine, EngineConfig
from transformers import AutoModelForCausalLM

from tests.factories import build_checkpoint, hf_greedy

PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("api"), family="llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), dtype="float32", max_model_len=64)


@pytest.fixture(scope="module")
def expected(ckpt):
    return hf_greedy(ckpt, [PROMPT], 12)[0]


def greedy(**kw) -> GenerationConfig:
    return GenerationConfig(temperature=0.0, **{"max_tokens": 12, "ignore_eos": True, **kw})


def test_stop_token_id_ends_the_sample_and_is_kept(llm, expected):
    stop_at = next(i for i, t in enumerate(expected) if i >= 3 and t not in expected[:i])
    result = llm.generate([PROMPT], greedy(stop_token_ids=[expected[stop_at]]))[0]
    assert result.token_ids == expected[: stop_at + 1]
    assert result.finish_reason == "stop"


def test_min_tokens_holds_back_a_stop_token(llm, expected):
    result = llm.generate([PROMPT], greedy(stop_token_ids=[expected[0]], min_tokens=4))[0]
    assert len(result.token_ids) >= 4


def test_eos_ends_the_sample_unless_ignored(llm, expected, monkeypatch):
    result = llm.generate([PROMPT], greedy(ignore_eos=True))[0]
    assert len(result.token_ids) == 12
    # Make the oracle's 3rd token an EOS for this engine: the sample must stop there.
    intake = llm.engine.intake
    monkeypatch.setattr(
        intake, "spec", dataclasses.replace(intake.spec, eos_token_ids=frozenset({expected[2]}))
    )
    stopped = llm.generate([PROMPT], GenerationConfig(temperature=0.0, max_tokens=12))[0]
    assert stopped.token_ids[-1] == expected[2] and stopped.finish_reason == "stop"


def test_text_is_the_decoded_tokens_and_a_stop_string_cuts_it(llm, expected):
    full = llm.generate([PROMPT], greedy())[0]
    assert full.text == llm.tokenizer.decode(full.token_ids, skip_special_tokens=True)
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = llm.generate([PROMPT], greedy(stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    kept = llm.generate([PROMPT], greedy(stop=[stop], include_stop_str_in_output=True))[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_max_model_len_ends_a_sample_with_length(llm):
    prompt = list(range(3, 3 + 60))
    result = llm.generate([prompt], greedy(max_tokens=50))[0]
    assert len(result.token_ids) == 64 - 60 and result.finish_reason == "length"


def hf_log_softmax(ckpt, token_ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_match_the_oracle_distribution(llm, ckpt, expected):
    result = llm.generate([PROMPT], greedy(logprobs=3, prompt_logprobs=2))[0]
    reference = hf_log_softmax(ckpt, PROMPT + expected)
    n = len(PROMPT)
    for i, lp in enumerate(result.logprobs):
        row = reference[n - 1 + i]
        assert lp.token_id == expected[i]
        assert math.isclose(lp.logprob, row[expected[i]].item(), abs_tol=1e-4)
        top = torch.topk(row, 3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
    assert len(result.prompt_logprobs) == n - 1
    for k, lp in enumerate(result.prompt_logprobs):
        assert lp.token_id == PROMPT[k + 1]
        assert math.isclose(lp.logprob, reference[k][PROMPT[k + 1]].item(), abs_tol=1e-4)
        assert len(lp.top) == 2


def test_logprobs_name_their_tokens_as_the_tokenizer_decodes_each(llm, expected):
    result = llm.generate([PROMPT], greedy(logprobs=2, prompt_logprobs=1))[0]
    tokenizer = llm.engine.tokenizer

    def decode(token_ids: list[int]) -> str:
        return tokenizer.decode(token_ids, skip_special_tokens=False)

    first = result.first_prompt_token
    assert first is not None and (first.token_id, first.token) == (PROMPT[0], decode(PROMPT[:1]))
    assert result.logprobs is not None and result.prompt_logprobs is not None
    entries = [first, *result.prompt_logprobs, *result.logprobs]
    # Each token alone as decode shows it, a part of a character read in its sequence: the
    # names join into the text (an unfinished last character aside), and the bytes too.
    text = decode(PROMPT + expected)
    assert "".join(lp.token for lp in entries) in (text, text.removesuffix("\ufffd"))
    assert b"".join(lp.token_bytes for lp in entries).decode("utf-8", "replace") == text
    for lp in entries[1:]:
        for (token_id, _), (text, data) in zip(lp.top, lp.top_tokens, strict=True):
            assert data.decode("utf-8", "replace") == decode([token_id])
            assert text == decode([token_id]) or "\ufffd" in decode([token_id])
        # The rank counts tokens at least as likely: the top alternative's own is 1.
        assert lp.rank >= 1 and (lp.rank == 1) == (lp.token_id == lp.top[0][0])
    assert result.prompt_text == decode(PROMPT)
    plain = llm.generate([PROMPT], greedy(logprobs=0))[0]
    assert plain.first_prompt_token is None and plain.prompt_text is None


def test_a_one_token_prompt_has_no_prompt_logprobs_but_its_first_token(llm):
    result = llm.generate([PROMPT[:1]], greedy(max_tokens=1, prompt_logprobs=0))[0]
    assert result.prompt_logprobs == []
    assert result.first_prompt_token is not None
    assert result.first_prompt_token.token_id == PROMPT[0]


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("", "prompt"),
        ([], "prompt_token_ids"),
        ([1, 2, -1], "prompt_token_ids"),
        ([1, 10**9], "prompt_token_ids"),
        (list(range(3, 3 + 64)), "prompt"),
    ],
)
def test_bad_prompts_name_the_field_and_the_engine_keeps_serving(llm, expected, prompt, field):
    with pytest.raises(InvalidArgumentError) as info:
        llm.generate([PROMPT, prompt], greedy())
    assert info.value.field == field
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([PROMPT], greedy())[0].token_ids == expected


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"n": 0}, "n"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 100}, "logprobs"),
    ],
)
def test_bad_generation_config_names_the_field(options, field):
    with pytest.raises(InvalidArgumentError) as info:
        GenerationConfig(**options)
    assert info.value.field == field
    assert field in str(info.value)


def test_streaming_equals_offline_and_bad_input_stays_in_band(ckpt, llm):
    prompts = [PROMPT, PROMPT[:3], list(range(20, 50))]
    offline = [r.token_ids for r in llm.generate(prompts, greedy())]
    offline_text = [r.text for r in llm.generate(prompts, greedy())]
    engine = AsyncEngine(EngineConfig(str(ckpt), dtype="float32", max_model_len=64))

    async def collect(i: int, prompt) -> tuple[list[int], str]:
        tokens, text = [], ""
        async for output in engine.generate(f"s{i}", prompt, greedy()):
            for delta in output.samples:
                tokens.extend(delta.token_ids)
                text += delta.text
        return tokens, text

    async def main():
        good = [asyncio.create_task(collect(i, p)) for i, p in enumerate(prompts)]
        with pytest.raises(InvalidArgumentError) as info:
            await collect(99, [10**9])
        assert info.value.field == "prompt_token_ids"
        return await asyncio.gather(*good)

    try:
        streamed = asyncio.run(main())
    finally:
        engine.shutdown()
    assert [tokens for tokens, _ in streamed] == offline
    assert [text for _, text in streamed] == offline_text
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_leaving_a_stream_early_aborts_the_request(ckpt):
    engine = AsyncEngine(EngineConfig(str(ckpt), dtype="float32"))

    async def main():
        stream = engine.generate("early", PROMPT, greedy(max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):  # the abort is applied by the engine thread
            if not engine.engine.has_unfinished_requests():
                return
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert not engine.engine.has_unfinished_requests()
    bm = engine.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_plain_greedy_steps_skip_the_sampler_and_others_use_it(llm, expected, monkeypatch):
    """Steps whose rows are all plain greedy take their tokens from the model's greedy head
    (no [rows, vocab] logits); a row that reads the logits (logprobs, penalties) sends the
    whole step through the sampler. The tokens are the oracle's either way."""
    calls: list[int] = []
    sampler = llm.engine.sampler

    def counting(logits, seqs):
        calls.append(len(seqs))
        return sampler(logits, seqs)

    monkeypatch.setattr(llm.engine, "sampler", counting)
    plain = llm.generate([PROMPT, PROMPT], greedy())
    assert [r.token_ids for r in plain] == [expected, expected] and calls == []
    mixed = llm.generate([PROMPT, PROMPT], [greedy(), greedy(logprobs=0)])
    assert [r.token_ids for r in mixed] == [expected, expected]
    assert calls and all(n == 2 for n in calls)  # the whole step, both rows
    calls.clear()
    llm.generate([PROMPT], greedy(repetition_penalty=1.0, min_tokens=0))
    assert calls == []  # neutral settings are still plain greedy
