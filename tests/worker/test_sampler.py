"""The batched sampler against independent oracles: transformers' logits processors for each
stage, the OpenAI formula for presence / frequency, softmax for sampled frequencies."""

from __future__ import annotations

import functools
import itertools
from typing import Any

import pytest
import torch
from headrace.kernels import select_kernels
from headrace.sdk.config import GenerationConfig
from headrace.worker.sampling.logprobs import compute_prompt_logprobs
from headrace.worker.sampling.sampler import Sampler, process_logits
from headrace.worker.sequence import Sequence
from transformers.generation.logits_process import (
    LogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

_ids = itertools.count()
#: A CPU engine's kernel set: the C draw and bitmask, or torch's where they cannot be built.
KERNELS = select_kernels("auto", torch.device("cpu"))


def make_seq(
    prompt: list[int],
    output: list[int] | None = None,
    *,
    seed: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    **config: object,
) -> Sequence:
    """A sequence with prompt + output as its tokens and GenerationConfig(**config)."""
    output = output or []
    seq_id = next(_ids)
    return Sequence(
        seq_id=seq_id,
        request_id=f"r{seq_id}",
        sample_index=0,
        config=_config(tuple(sorted(config.items()))),
        token_ids=[*prompt, *output],
        num_prompt_tokens=len(prompt),
        priority=0,
        arrival=seq_id,
        sample_seed=seed,
        stop_token_ids=frozenset(stop_token_ids),
    )


@functools.cache
def _config(items: tuple[tuple[str, object], ...]) -> GenerationConfig:
    """Shared per distinct settings: the frequency tests build tens of thousands of rows."""
    return GenerationConfig(**dict(items))


def random_tokens(generator: torch.Generator, vocab: int, length: int) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=generator).tolist()


def hf_process(
    processors: list[LogitsProcessor], seq: Sequence, logits: torch.Tensor
) -> torch.Tensor:
    """One row through transformers' processors, in order."""
    input_ids = torch.tensor([seq.token_ids])
    scores = logits.clone().view(1, -1)
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores.view(-1)


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same tokens allowed (finite), and the same values where they are."""
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite)
    torch.testing.assert_close(actual[finite], expected[finite])


# --- history processors ----------------------------------------------------------------------


def test_repetition_penalty_matches_hf_over_prompt_and_output() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 64
    penalties = [1.0, 1.3, 0.7, 2.0, 1.1]
    seqs = [
        make_seq(
            random_tokens(gen, vocab, 5 + i),
            random_tokens(gen, vocab, 3 * i),
            temperature=0.0,
            repetition_penalty=penalty,
        )
        for i, penalty in enumerate(penalties)
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen) * 3

    processed = process_logits(logits, seqs, KERNELS)

    for row, (seq, penalty) in enumerate(zip(seqs, penalties, strict=True)):
        expected = hf_process([RepetitionPenaltyLogitsProcessor(penalty)], seq, logits[row])
        assert_same_logits(processed[row], expected)


def test_presence_and_frequency_penalties_follow_openai_over_output_only() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 32
    settings = [(0.5, 0.0), (0.0, 0.8), (1.5, -0.4), (-1.0, 2.0)]
    seqs = [
        make_seq(
            random_tokens(gen, vocab, 10),
            random_tokens(gen, vocab, 12),
            temperature=0.0,
            presence_penalty=presence,
            frequency_penalty=frequency,
        )
        for presence, frequency in settings
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen)

    processed = process_logits(logits, seqs, KERNELS)

    for row, (seq, (presence, frequency)) in enumerate(zip(seqs, settings, strict=True)):
        expected = logits[row].clone()
        for token_id in range(vocab):
            count = seq.token_ids[seq.num_prompt_tokens :].count(
                token_id
            )  # prompt tokens do not count
            expected[token_id] -= count * frequency + (count > 0) * presence
        torch.testing.assert_close(processed[row], expected)


@pytest.mark.parametrize("ngram_size", [1, 2, 3, 4])
def test_no_repeat_ngram_matches_hf(ngram_size: int) -> None:
    gen = torch.Generator().manual_seed(ngram_size)
    vocab = 16
    # Few distinct tokens so n-grams repeat; lengths vary, one row is too short for any n-gram,
    # and in the last the suffix surely occurred before.
    histories = [random_tokens(gen, 4, length) for length in (ngram_size - 1, 6, 15, 40)]
    histories.append([9, 1, 2, 3, 4, 5] * 2 + [1, 2, 3, 4, 5])
    seqs = [
        make_seq(tokens[:3], tokens[3:], temperature=0.0, no_repeat_ngram_size=ngram_size)
        for tokens in histories
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen)

    processed = process_logits(logits, seqs, KERNELS)

    for row, seq in enumerate(seqs):
        expected = hf_process([NoRepeatNGramLogitsProcessor(ngram_size)], seq, logits[row])
        assert_same_logits(processed[row], expected)
    assert not torch.isfinite(processed).all(), "the histories should ban something"


def test_min_tokens_holds_back_stop_tokens_like_hf() -> None:
    gen = torch.Generator().manual_seed(2)
    vocab = 20
    stop_token_ids = (3, 7, 11)
    # (tokens generated so far, min_tokens): held back below min_tokens only.
    cases = [(0, 2), (1, 2), (2, 2), (5, 3), (0, 0)]
    seqs = [
        make_seq(
            random_tokens(gen, vocab, 4),
            random_tokens(gen, vocab, num_output),
            temperature=0.0,
            min_tokens=min_tokens,
            stop_token_ids=stop_token_ids,
        )
        for num_output, min_tokens in cases
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen)

    processed = process_logits(logits, seqs, KERNELS)

    for row, (seq, (_, min_tokens)) in enumerate(zip(seqs, cases, strict=True)):
        oracle = MinNewTokensLengthLogitsProcessor(
            seq.num_prompt_tokens, min_tokens, list(stop_token_ids)
        )
        assert_same_logits(processed[row], hf_process([oracle], seq, logits[row]))


# --- warpers -------------------------------------------------------------------------------

_WARP_CONFIGS: list[dict[str, Any]] = [
    {"temperature": 0.7},
    {"temperature": 1.0, "top_k": 10},
    {"temperature": 1.0, "top_p": 0.8},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 1.5, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 0.5, "top_k": 3, "top_p": 0.5},
    {"temperature": 2.0, "top_p": 0.95, "min_p": 0.2},
]


def hf_warpers(config: GenerationConfig) -> list[LogitsProcessor]:
    """HF's sampling warpers for config, in generate()'s order."""
    warpers: list[LogitsProcessor] = [TemperatureLogitsWarper(config.temperature)]
    if config.top_k:
        warpers.append(TopKLogitsWarper(config.top_k))
    if config.top_p < 1.0:
        warpers.append(TopPLogitsWarper(config.top_p))
    if config.min_p:
        warpers.append(MinPLogitsWarper(config.min_p))
    return warpers


def test_warpers_match_hf_row_by_row_in_a_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    vocab = 500
    # Each config twice, with a greedy row between, so every warper runs on a row subset.
    configs = [c for config in _WARP_CONFIGS for c in (config, {"temperature": 0.0}, config)]
    seqs = [make_seq([1, 2, 3], **config) for config in configs]
    logits = torch.randn(len(seqs), vocab, generator=gen) * 4

    processed = process_logits(logits, seqs, KERNELS)

    for row, seq in enumerate(seqs):
        warpers = [] if seq.config.is_greedy else hf_warpers(seq.config)
        assert_same_logits(processed[row], hf_process(warpers, seq, logits[row]))


def test_all_stages_apply_in_hf_order() -> None:
    gen = torch.Generator().manual_seed(4)
    vocab = 50
    config: dict[str, Any] = {
        "repetition_penalty": 1.4,
        "no_repeat_ngram_size": 2,
        "min_tokens": 4,
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "min_p": 0.02,
    }
    seqs = [
        make_seq(
            random_tokens(gen, 10, 8),
            random_tokens(gen, 10, num_output),
            stop_token_ids=(0, 5),
            **config,
        )
        for num_output in (1, 6)
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen) * 3

    processed = process_logits(logits, seqs, KERNELS)

    for row, seq in enumerate(seqs):
        oracle: list[LogitsProcessor] = [
            RepetitionPenaltyLogitsProcessor(1.4),
            NoRepeatNGramLogitsProcessor(2),
            MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, 4, [0, 5]),
            *hf_warpers(seq.config),
        ]
        assert_same_logits(processed[row], hf_process(oracle, seq, logits[row]))


# --- the draw ------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_of_processed_logits() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    seqs = [
        make_seq([1, 2, 3], temperature=0.0),
        make_seq([4, 5], [6, 7, 6], temperature=0.0, repetition_penalty=3.0),
        make_seq([8], temperature=0.0, frequency_penalty=2.0),
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen)
    logits[1, 6] = logits[1].max() + 1.0  # a repeated token the penalty must beat

    token_ids = Sampler(vocab, KERNELS)(logits, seqs).token_ids

    assert token_ids == process_logits(logits, seqs, KERNELS).argmax(dim=-1).tolist()
    assert token_ids[1] != 6


def test_plain_greedy_batch_is_argmax() -> None:
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(64, 128, generator=gen)
    seqs = [make_seq([i], temperature=0.0) for i in range(64)]

    output = Sampler(128, KERNELS)(logits, seqs)

    assert output.token_ids == logits.argmax(dim=-1).tolist()
    assert output.logprobs == [None] * 64


@pytest.mark.parametrize("seed", [None, 7])
def test_top_k_1_sampling_is_argmax(seed: int | None) -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(32, 300, generator=gen)
    seqs = [make_seq([i], seed=seed, temperature=1.3, top_k=1) for i in range(32)]

    assert Sampler(300, KERNELS)(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_seeded_row_draws_the_same_token_in_any_batch() -> None:
    """The token depends on (seed, position, logits) only: not on batch size, row index,
    neighbours (seeded or not, greedy or not, filtered or not) or the sampler's own seed."""
    gen = torch.Generator().manual_seed(9)
    vocab = 1000
    row_logits = torch.randn(vocab, generator=gen)
    # Alone, a top_k=30 row takes the sparse draw; beside unfiltered rows, the dense one.
    for config in ({}, {"top_k": 30}, {"top_p": 0.6, "temperature": 0.7}):
        seeded = make_seq([5] * 11, seed=1234, **config)
        alone = Sampler(vocab, KERNELS)(row_logits.view(1, -1), [seeded]).token_ids[0]
        for batch_size, row, sampler_seed in ((2, 1, 0), (7, 3, 1), (64, 63, 2)):
            seqs = [
                make_seq([1], seed=None if i % 2 else i, temperature=(i % 3) * 0.5)
                for i in range(batch_size)
            ]
            seqs[row] = seeded
            logits = torch.randn(batch_size, vocab, generator=gen)
            logits[row] = row_logits
            output = Sampler(vocab, KERNELS, seed=sampler_seed)(logits, seqs)
            assert output.token_ids[row] == alone, (config, batch_size)


def test_seeded_draws_differ_across_seeds_and_positions() -> None:
    vocab = 1000
    logits = torch.zeros(200, vocab)  # uniform: 200 independent draws give ~181 distinct tokens
    sampler = Sampler(vocab, KERNELS)
    by_seed = sampler(logits, [make_seq([1, 2], seed=s) for s in range(200)]).token_ids
    by_position = sampler(logits, [make_seq([1] * (n + 1), seed=5) for n in range(200)]).token_ids

    assert len(set(by_seed)) > 150
    assert len(set(by_position)) > 150
    assert by_seed != by_position


def test_seeded_tokens_repeat_and_unseeded_follow_the_sampler_seed() -> None:
    gen = torch.Generator().manual_seed(10)
    logits = torch.randn(16, 200, generator=gen)

    def draw(sampler_seed: int, request_seed: int | None) -> list[int]:
        seqs = [make_seq([i], seed=request_seed) for i in range(16)]
        return Sampler(200, KERNELS, seed=sampler_seed)(logits, seqs).token_ids

    assert draw(0, 42) == draw(1, 42)
    assert draw(3, None) == draw(3, None)
    assert draw(3, None) != draw(4, None)


def _frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double() / len(token_ids)


@pytest.mark.parametrize(
    ("seeded", "config"),
    [
        (True, {}),
        (False, {}),
        (True, {"temperature": 0.6}),
        (True, {"top_k": 4}),  # sparse noise: only 4 of 8 logits are finite
        (False, {"top_p": 0.7}),
    ],
)
def test_sampled_frequencies_match_softmax(seeded: bool, config: dict[str, Any]) -> None:
    vocab, num_draws = 8, 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0])
    # Seeded draws vary the seed and the position; unseeded ones come from the sampler.
    seqs = [
        make_seq([0] * (1 + i % 7), seed=i if seeded else None, **config) for i in range(num_draws)
    ]
    processed = process_logits(logits.view(1, -1), seqs[:1], KERNELS)
    expected = processed.softmax(dim=-1).view(-1).double()

    token_ids = Sampler(vocab, KERNELS)(logits.expand(num_draws, vocab), seqs).token_ids

    tolerance = 5 * (expected * (1 - expected) / num_draws).sqrt() + 1e-9
    assert ((_frequencies(token_ids, vocab) - expected).abs() <= tolerance).all()


def test_seeded_stream_over_positions_matches_softmax() -> None:
    """One seed, many positions: the draws of one request are spread like the softmax."""
    vocab, num_draws = 5, 3_000
    logits = torch.tensor([1.0, 0.0, 0.3, -1.0, 2.0])
    sampler = Sampler(vocab, KERNELS)
    seqs = [make_seq([1] * n, seed=77) for n in range(1, num_draws + 1)]

    token_ids = sampler(logits.expand(num_draws, vocab), seqs).token_ids

    expected = logits.softmax(dim=-1).double()
    tolerance = 5 * (expected * (1 - expected) / num_draws).sqrt()
    assert ((_frequencies(token_ids, vocab) - expected).abs() <= tolerance).all()


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="compares CPU and CUDA draws; needs a CUDA device (none in CI)",
)
def test_seeded_tokens_are_the_same_on_cpu_and_cuda() -> None:
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(64, 49152, generator=gen) * 2
    seqs = [make_seq([1] * (i + 1), seed=i, top_k=50 * (i % 2)) for i in range(64)]

    cuda_kernels = select_kernels("auto", torch.device("cuda"))
    on_cpu = Sampler(49152, KERNELS)(logits, seqs).token_ids
    on_cuda = Sampler(49152, cuda_kernels)(logits.cuda(), seqs).token_ids

    assert on_cpu == on_cuda


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_of_raw_logits_with_top_n_most_likely_first() -> None:
    gen = torch.Generator().manual_seed(12)
    vocab = 100
    seqs = [
        make_seq([1, 2], [3], logprobs=5, temperature=0.5, repetition_penalty=2.0, top_k=7),
        make_seq([4], logprobs=None),
        make_seq([5], seed=3, logprobs=0),
        make_seq([6], temperature=0.0, logprobs=3, presence_penalty=1.0),
    ]
    logits = torch.randn(len(seqs), vocab, generator=gen) * 2
    raw = logits.clone()

    output = Sampler(vocab, KERNELS)(logits, seqs)

    assert torch.equal(logits, raw), "the sampler must not write its input"
    assert output.logprobs[1] is None
    expected = torch.log_softmax(raw, dim=-1)
    for row, num_top in ((0, 5), (2, 0), (3, 3)):
        logprob = output.logprobs[row]
        assert logprob is not None
        assert logprob.token_id == output.token_ids[row]
        assert logprob.logprob == pytest.approx(expected[row, logprob.token_id].item(), abs=1e-6)
        values, token_ids = expected[row].topk(num_top)
        assert [t for t, _ in logprob.top] == token_ids.tolist()
        assert [lp for _, lp in logprob.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in itertools.pairwise(logprob.top))


def test_prompt_logprobs_score_each_next_prompt_token() -> None:
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(6, 30, generator=gen)
    target_ids = torch.tensor([4, 0, 29, 7, 7, 12])

    scored = compute_prompt_logprobs(logits, target_ids, num_top=2)

    expected = torch.log_softmax(logits, dim=-1)
    assert [s.token_id for s in scored] == target_ids.tolist()
    for position, s in enumerate(scored):
        assert s.logprob == pytest.approx(expected[position, s.token_id].item(), abs=1e-6)
        values, token_ids = expected[position].topk(2)
        assert [t for t, _ in s.top] == token_ids.tolist()
        assert [lp for _, lp in s.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert compute_prompt_logprobs(logits, target_ids, num_top=0)[0].top == []


def test_a_logprobs_rank_counts_the_tokens_at_least_as_likely() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 1.0, 2.0], [5.0, 1.0, 1.0, 0.0, 0.0]])
    scored = compute_prompt_logprobs(logits, torch.tensor([2, 0]), num_top=1)
    # Row 0: tokens 1 and 4 beat token 2, token 3 ties it (vLLM counts >=): rank 4.
    assert [s.rank for s in scored] == [4, 1]


def test_all_banned_row_still_draws_a_token() -> None:
    """min_tokens may hold back every token of a tiny vocab; the draw must not fail."""
    seqs = [make_seq([0], stop_token_ids=(0, 1, 2), min_tokens=1, seed=1)]

    token_id = Sampler(3, KERNELS)(torch.zeros(1, 3), seqs).token_ids[0]

    assert token_id in range(3)
