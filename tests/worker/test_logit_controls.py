"""Logit controls on a tiny random-weight model: a bias moves the argmax as OpenAI's does, an
allow-list keeps every token inside it, bad words never appear as their token sequences, and
unconstrained rows in the same batch decode exactly as they do alone."""

from __future__ import annotations

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM
from headrace.worker.sampling.controls import banned_next_tokens

from tests.factories import cached_checkpoint

PROMPT = [5, 17, 42, 99, 7, 64, 23, 11]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(cached_checkpoint(family="llama")), dtype="float32", max_model_len=64)


def greedy(**options) -> GenerationConfig:
    return GenerationConfig(temperature=0.0, **{"max_tokens": 10, "ignore_eos": True, **options})


def test_a_large_bias_forces_a_token_and_a_negative_one_removes_it(llm):
    (plain,) = llm.generate([PROMPT], greedy())
    forced, avoided = llm.generate(
        [PROMPT, PROMPT],
        [greedy(logit_bias={300: 100.0}), greedy(logit_bias={plain.token_ids[0]: -100.0})],
    )
    assert forced.token_ids == [300] * 10
    assert avoided.token_ids[0] != plain.token_ids[0]


def test_allowed_token_ids_keep_every_token_inside_the_set(llm):
    allowed = (3, 30, 77, 200)
    greedy_out, sampled = llm.generate(
        [PROMPT, PROMPT],
        [
            greedy(allowed_token_ids=allowed),
            GenerationConfig(max_tokens=20, seed=1, ignore_eos=True, allowed_token_ids=allowed),
        ],
    )
    assert set(greedy_out.token_ids) <= set(allowed)
    assert set(sampled.token_ids) <= set(allowed)
    assert len(set(sampled.token_ids)) > 1  # it samples among them, not one forced token


def test_bad_words_never_appear(llm):
    (plain,) = llm.generate([PROMPT], greedy(max_tokens=24))
    tokenizer = llm.engine.tokenizer
    word, token_id = next(
        (tokenizer.decode([t]), t)
        for t in plain.token_ids
        if tokenizer.decode([t]).strip() and tokenizer.encode(tokenizer.decode([t])) == [t]
    )
    (banned,) = llm.generate([PROMPT], greedy(max_tokens=24, bad_words=(word,)))
    assert token_id in plain.token_ids and token_id not in banned.token_ids
    for ids in llm.engine.intake.controls._bad_word_ids((word,)):
        n = len(ids)
        windows = [banned.token_ids[i : i + n] for i in range(len(banned.token_ids) - n + 1)]
        assert list(ids) not in windows


def test_controlled_rows_leave_their_batch_neighbours_unchanged(llm):
    (alone,) = llm.generate([PROMPT[:5]], greedy())
    results = llm.generate(
        [PROMPT, PROMPT[:5], PROMPT],
        [greedy(logit_bias={4: 50.0}), greedy(), greedy(allowed_token_ids=(9, 10))],
    )
    assert results[1].token_ids == alone.token_ids


def test_an_out_of_vocabulary_id_is_refused_naming_the_field(llm):
    vocab = llm.engine.vocab_size
    for options, field in (
        ({"logit_bias": {vocab: 1.0}}, "config.logit_bias"),
        ({"allowed_token_ids": (1, vocab + 5)}, "config.allowed_token_ids"),
    ):
        with pytest.raises(InvalidArgumentError) as refused:
            llm.generate([PROMPT], greedy(**options))
        assert refused.value.field == field
        assert f"outside the vocabulary [0, {vocab})" in str(refused.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_bad_word_bans_its_last_token_only_after_the_rest_of_it():
    words = ((7,), (1, 2, 3))
    assert banned_next_tokens(words, [9, 9]) == [7]
    assert banned_next_tokens(words, [9, 1, 2]) == [7, 3]
    assert banned_next_tokens(words, [2]) == [7]  # too short to hold the prefix


def test_a_constraint_the_other_controls_starve_ends_in_error(llm):
    """Every token the grammar allows is outside allowed_token_ids: the sample fails in-band."""
    (result,) = llm.generate([PROMPT], greedy(choice=("abc",), allowed_token_ids=(0,)))
    assert isinstance(result.error, InvalidArgumentError)
