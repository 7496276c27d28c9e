"""Speculative decoding with n-gram proposals (``num_speculative_tokens``).

The oracle is transformers' greedy generation from the same weights: with speculation on
(k = 1, 3, 5) every prompt must get exactly its tokens, in the oracle matrix's compositions
(chunked prefill, preemption, small blocks, overlapped steps), on each kernel set and at
TP = 2. The prompts repeat themselves and the tiny models' greedy outputs fall into loops,
so proposals are made and kept: each test checks that some were (the equalities are not
vacuous). After every run the KV pool is whole again, and the prefix cache holds only blocks
of tokens the sequences really have (no rejected proposal).
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM, Engine, EngineConfig
from headrace.worker.engine.speculation import SpeculationStats, accept
from headrace.worker.scheduling.proposals import NgramProposer

from tests.factories import build_checkpoint, hf_greedy, load_hf_model
from tests.lora_factories import build_adapter, hf_lora_greedy
from tests.worker.test_engine_oracle import COMPOSITIONS, assert_all_blocks_free

MAX_TOKENS = 40


# --- the proposer and the acceptance rule ------------------------------------------------


def test_ngram_proposals_follow_the_latest_match_of_the_longest_suffix() -> None:
    proposer = NgramProposer(1, 3)
    # "7 8" occurs twice before; the latest one is followed by 5, 6.
    assert proposer.propose([7, 8, 1, 2, 7, 8, 5, 6, 9, 7, 8], 2) == [5, 6]
    # The 3-gram "1 7 8" beats the later 2-gram match.
    assert proposer.propose([1, 7, 8, 4, 4, 7, 8, 6, 1, 7, 8], 1) == [4]
    assert proposer.propose([1, 2, 3, 1, 2], 10) == [3, 1, 2]  # at most what follows
    assert proposer.propose([1, 2, 3, 4], 3) == []  # no earlier match
    assert proposer.propose([5, 5], 0) == []


def test_ngram_sizes_below_the_minimum_propose_nothing() -> None:
    assert NgramProposer(2, 3).propose([4, 9, 1, 2, 9], 2) == []  # only a 1-gram matches
    assert NgramProposer(1, 3).propose([4, 9, 1, 2, 9], 2) == [1, 2]
    with pytest.raises(ValueError, match="1 <= min <= max"):
        NgramProposer(3, 2)


def test_the_lookback_bounds_the_search() -> None:
    tokens = [1, 2, 3] + list(range(100, 200)) + [1, 2]
    assert NgramProposer(2, 2).propose(tokens, 1) == [3]
    assert NgramProposer(2, 2, max_lookback=50).propose(tokens, 1) == []


def test_greedy_acceptance_keeps_the_agreeing_prefix_then_the_models_token() -> None:
    no_stops: frozenset[int] = frozenset()
    assert accept([5, 6, 7], [5, 6, 7], 8, no_stops) == ([5, 6, 7, 8], 3)
    assert accept([5, 6, 7], [5, 9, 7], 8, no_stops) == ([5, 9], 1)
    assert accept([5, 6, 7], [4, 6, 7], 8, no_stops) == ([4], 0)
    # A stop token ends the sample: nothing after it is emitted.
    assert accept([5, 6, 7], [5, 6, 7], 8, frozenset({6})) == ([5, 6], 2)
    assert accept([5, 6, 7], [5, 2, 7], 8, frozenset({2})) == ([5, 2], 1)


def test_stats_count_proposals_per_position() -> None:
    stats = SpeculationStats()
    stats.record(3, 1)
    stats.record(2, 2)
    assert (stats.num_chunks, stats.num_proposed, stats.num_accepted) == (2, 5, 3)
    assert stats.proposed_at == [2, 2, 1] and stats.accepted_at == [2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(0.6)
    earlier = stats.snapshot()
    stats.record(4, 0)
    assert earlier.num_proposed == 5  # a snapshot does not move
    gained = stats.since(earlier)
    assert (gained.num_chunks, gained.num_proposed, gained.num_accepted) == (1, 4, 0)
    assert gained.proposed_at == [1, 1, 1, 1] and gained.accepted_at == [0, 0, 0, 0]


# --- against the oracle ----------------------------------------------------------------------


def repeating_prompts(vocab_size: int) -> list[list[int]]:
    """Prompts that repeat a phrase (proposals from the prompt) and random ones (from the
    output's loops)."""
    rng = random.Random(1)
    phrases = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (4, 7)]
    randoms = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (1, 9, 23)]
    return [phrases[0] * 5, phrases[1] * 3 + phrases[1][:3], *randoms]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """family -> (checkpoint, prompts, transformers' greedy tokens)."""
    cases: dict[str, tuple] = {}

    def case(family: str):
        if family not in cases:
            path = build_checkpoint(tmp_path_factory.mktemp(family), family=family)
            vocab_size = LLM(str(path), dtype="float32").engine.vocab_size
            prompts = repeating_prompts(vocab_size)
            cases[family] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return cases[family]

    return case


def greedy(n: int = MAX_TOKENS, **options) -> GenerationConfig:
    return GenerationConfig(max_tokens=n, temperature=0.0, ignore_eos=True, **options)


def speculating(k: int, **options) -> dict:
    """Engine options: k proposals, in steps of up to 8 decoding sequences (every test's)."""
    return dict(dtype="float32", num_speculative_tokens=k, speculative_max_seqs=8, **options)


def assert_cache_holds_only_real_blocks(engine: Engine, sequences: list[list[int]]) -> None:
    """Every block the prefix cache offers holds block_size tokens that some sequence has at
    a block boundary: a block of rejected proposals would hold tokens none has."""
    bm = engine.block_manager
    size = bm.block_size
    real = {
        tuple(tokens[i : i + size])
        for tokens in sequences
        for i in range(0, len(tokens) - size + 1, size)
    }
    registered = [bm.block_tokens[b] for b in bm.hash_to_block.values()]
    assert registered and all(tokens in real for tokens in registered)


def run(llm: LLM, prompts: list[list[int]], config: GenerationConfig) -> list[list[int]]:
    results = llm.generate(prompts, config)
    return [r.token_ids for r in results]


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_tokens_equal_transformers_and_proposals_are_kept(oracle, k):
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), **speculating(k, block_size=4))
    assert run(llm, prompts, greedy()) == expected
    stats = llm.engine.speculation
    assert stats.num_accepted > 0 and stats.num_proposed > stats.num_accepted
    assert max(len(p) for p in [stats.proposed_at]) <= k
    assert_all_blocks_free(llm.engine)
    full = [p + out for p, out in zip(prompts, expected, strict=True)]
    assert_cache_holds_only_real_blocks(llm.engine, full)


#: The oracle matrix's compositions, with pools for these longer outputs: 24 blocks of 4 tokens
#: for five sequences that need 6 to 16 each (a sequence alone fits with its proposals).
SPECULATING_COMPOSITIONS = {
    name: {**options, "num_kv_blocks": 24} if "preempting" in name else options
    for name, options in COMPOSITIONS.items()
}
MATRIX = [("llama", c, "cpu") for c in sorted(COMPOSITIONS)] + [
    ("qwen3", "preempting", "cpu"),
    ("llama", "chunked-8", "reference"),
    ("llama", "preempting", "reference"),
    ("llama", "chunked-8", "triton"),
]


@pytest.mark.parametrize(("family", "composition", "backend"), MATRIX)
def test_every_composition_equals_transformers(oracle, family, composition, backend):
    path, prompts, expected = oracle(family)
    options = {**SPECULATING_COMPOSITIONS[composition], "kernel_backend": backend}
    llm = LLM(str(path), **speculating(3, **options))
    assert run(llm, prompts, greedy()) == expected
    assert llm.engine.speculation.num_accepted > 0
    if "preempting" in composition:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_two_tensor_parallel_ranks_equal_transformers(oracle):
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), **speculating(3, tensor_parallel_size=2, max_num_batched_tokens=16))
    try:
        assert run(llm, prompts, greedy()) == expected
        assert llm.engine.speculation.num_accepted > 0
        assert_all_blocks_free(llm.engine)
    finally:
        llm.engine.close()


# --- limits and stops --------------------------------------------------------------------


def test_max_tokens_is_never_passed(oracle):
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), **speculating(5))
    for n in (1, 2, 3, 7):
        results = llm.generate(prompts, greedy(n))
        assert [r.token_ids for r in results] == [e[:n] for e in expected]
        assert all(r.finish_reason == "length" for r in results)
    assert llm.engine.speculation.num_accepted > 0


class Foresight:
    """A `Proposer` that knows each prompt's greedy output, so every proposal is kept."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]]) -> None:
        self.sequences = [p + o for p, o in zip(prompts, outputs, strict=True)]

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        for full in self.sequences:
            if full[: len(token_ids)] == token_ids:
                return full[len(token_ids) : len(token_ids) + max_tokens]
        return []


@pytest.mark.parametrize("position", [3, 10])
def test_a_stop_token_among_kept_proposals_ends_the_sample_there(oracle, position):
    """With proposals that are always right, the output token at ``position`` is made a stop
    token: every sample ends at its first occurrence of it, as it would decoding one token a
    step, though the step that reached it had proposals past it."""
    path, prompts, expected = oracle("llama")
    stop = expected[0][position]
    want = [out[: out.index(stop) + 1] if stop in out else out for out in expected]
    llm = LLM(str(path), **speculating(5))
    llm.engine.scheduler.proposer = Foresight(prompts, expected)
    results = llm.generate(prompts, greedy(stop_token_ids=[stop]))
    assert [r.token_ids for r in results] == want
    assert results[0].finish_reason == "stop"
    stats = llm.engine.speculation  # all kept, but those past a stop token in its chunk
    assert stats.accepted_at[0] == stats.proposed_at[0] > 0
    assert stats.num_proposed - stats.num_accepted < len(prompts) * 5
    assert_all_blocks_free(llm.engine)


def test_stop_strings_cut_the_text_as_without_speculation(oracle):
    path, prompts, _ = oracle("llama")
    assert_stop_strings_cut_as_one_token_a_step(path, prompts, speculating(5))


def assert_stop_strings_cut_as_one_token_a_step(path, prompts, options: dict) -> None:
    """A stop string from the middle of the first prompt's greedy text: an engine with
    ``options`` gives every prompt the text, tokens and finish reason of an engine decoding
    one token a step."""
    plain = LLM(str(path), dtype="float32")
    first = plain.generate(prompts[:1], greedy())[0].text
    stop = first[len(first) // 2 : len(first) // 2 + 3]
    config = greedy(stop=[stop])
    want = [(r.text, r.token_ids, r.finish_reason) for r in plain.generate(prompts, config)]
    llm = LLM(str(path), **options)
    got = [(r.text, r.token_ids, r.finish_reason) for r in llm.generate(prompts, config)]
    assert got == want and want[0][2] == "stop"


def test_streamed_deltas_carry_several_tokens_a_step(oracle):
    path, prompts, expected = oracle("llama")
    engine = Engine(EngineConfig(str(path), **speculating(5)))
    engine.add_request("r", prompts[0], greedy())
    tokens: list[int] = []
    most = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.extend(delta.token_ids)
                most = max(most, len(delta.token_ids))
    assert tokens == expected[0] and most > 1


# --- who speculates ---------------------------------------------------------------------


def seeded(i: int, temperature: float = 0.25) -> GenerationConfig:
    return GenerationConfig(
        max_tokens=MAX_TOKENS, temperature=temperature, top_p=0.95, seed=i, ignore_eos=True
    )


@pytest.mark.parametrize("composition", ["chunked-8", "block-1", "preempting", "unchunked"])
def test_seeded_sampling_gives_the_tokens_it_gives_without_speculation(oracle, composition):
    """A sampled sequence draws each proposal's position with that position's seeded noise,
    keeping the proposals it draws: its tokens are those of decoding one token a step."""
    path, prompts, _ = oracle("llama")
    configs = [seeded(i) for i in range(len(prompts))]
    want = [r.token_ids for r in LLM(str(path), dtype="float32").generate(prompts, configs)]
    options = SPECULATING_COMPOSITIONS[composition]
    llm = LLM(str(path), **speculating(3, **options))
    assert [r.token_ids for r in llm.generate(prompts, configs)] == want
    stats = llm.engine.speculation
    assert stats.num_proposed > stats.num_accepted
    # A pool this small leaves proposals few blocks (they never preempt): some are made,
    # few kept; elsewhere some are kept.
    assert stats.num_proposed > 0 if composition == "preempting" else stats.num_accepted > 0
    assert_all_blocks_free(llm.engine)


def test_sampled_proposals_that_are_the_draws_are_all_kept(oracle):
    path, prompts, _ = oracle("llama")
    configs = [seeded(i, temperature=1.0) for i in range(len(prompts))]
    want = [r.token_ids for r in LLM(str(path), dtype="float32").generate(prompts, configs)]
    llm = LLM(str(path), **speculating(5))
    llm.engine.scheduler.proposer = Foresight(prompts, want)
    assert [r.token_ids for r in llm.generate(prompts, configs)] == want
    stats = llm.engine.speculation
    assert stats.num_accepted == stats.num_proposed > 0


def test_unseeded_sampling_speculates_and_ends_whole(oracle):
    path, prompts, _ = oracle("llama")
    config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.5, ignore_eos=True)
    llm = LLM(str(path), **speculating(3))
    results = llm.generate(prompts, config)
    assert [len(r.token_ids) for r in results] == [MAX_TOKENS] * len(prompts)
    assert llm.engine.speculation.num_proposed > 0
    assert_all_blocks_free(llm.engine)


def test_requests_whose_logits_depend_on_their_history_do_not_speculate(oracle):
    """Penalties, logprobs and beams read more than a position's logits: no proposals."""
    path, prompts, _ = oracle("llama")
    llm = LLM(str(path), **speculating(3))
    for config in (greedy(repetition_penalty=1.2), greedy(logprobs=2), greedy(num_beams=2)):
        llm.generate(prompts[:2], config)
    assert llm.engine.speculation.num_proposed == 0


def test_steps_with_more_decoding_sequences_than_the_limit_do_not_speculate(oracle):
    path, prompts, expected = oracle("llama")
    options = dict(dtype="float32", num_speculative_tokens=3, speculative_max_seqs=2)
    llm = LLM(str(path), **options)
    assert run(llm, prompts, greedy()) == expected  # five decode together: no proposals
    assert llm.engine.speculation.num_proposed == 0
    assert run(llm, prompts[:1], greedy()) == expected[:1]  # one alone speculates
    assert llm.engine.speculation.num_proposed > 0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(num_speculative_tokens=-1), "num_speculative_tokens"),
        (dict(speculative_ngram_min=0), "speculative_ngram_min"),
        (dict(speculative_ngram_min=5, speculative_ngram_max=4), "speculative_ngram_min"),
        (dict(speculative_max_seqs=0), "speculative_max_seqs"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(options, field):
    with pytest.raises(InvalidArgumentError) as error:
        EngineConfig("unused", **options)
    assert error.value.field == field


class AlwaysWrong:
    """A `Proposer` whose proposals are never the model's tokens (an id past the output's)."""

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [2] * max_tokens  # a special token the random prompts never make


def test_a_sequence_whose_proposals_keep_failing_backs_off(oracle):
    """Two misses in a row make a sequence skip 2 steps, then 4, 8, ... (at most 32): over 40
    tokens it verifies proposals in 6 steps, not 40, and its tokens are unchanged."""
    path, prompts, expected = oracle("llama")
    assert all(2 not in out for out in expected)
    llm = LLM(str(path), **speculating(3))
    llm.engine.scheduler.proposer = AlwaysWrong()
    assert run(llm, prompts[:1], greedy()) == expected[:1]
    stats = llm.engine.speculation
    assert stats.num_accepted == 0
    # Steps 1, 2 (two misses), skip 2, step 5, skip 4, step 10, skip 8, 19, skip 16, 36.
    assert stats.num_chunks == 6


class Always:
    """A `Proposer` that proposes one fixed token at every step."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        return [self.token] if max_tokens > 0 else []


def chi_square_999(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1% from df 5)."""
    z = 3.0902  # the standard normal's 0.999 quantile
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_a_speculated_tokens_distribution_is_the_models(oracle):
    """Unseeded draws, speculation on with a proposer that always proposes the likeliest
    second token d: the second token of the requests whose first is t1 (the likeliest first
    token) is distributed as softmax(logits / T) of transformers' forward over prompt + t1,
    by a chi-square test (bins merged to expected counts >= 5; a 0.1% false alarm rate), and
    d is kept about p(d) of the time, never always."""
    path, prompts, _ = oracle("llama")
    prompt, temperature, num_requests = prompts[2], 0.2, 4000
    model = load_hf_model(path)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        t1 = int(first.argmax())
        second = torch.softmax(model(torch.tensor([prompt + [t1]])).logits[0, -1] / temperature, -1)
    d = int(second.argmax())
    assert float(first[t1]) > 0.2 and 0.05 < float(second[d]) < 0.95  # a test with power
    llm = LLM(
        str(path), dtype="float32", num_speculative_tokens=1, speculative_max_seqs=num_requests
    )
    llm.engine.scheduler.proposer = Always(d)
    config = GenerationConfig(max_tokens=3, temperature=temperature, ignore_eos=True)
    results = llm.generate([prompt] * num_requests, config)
    seconds = [r.token_ids[1] for r in results if r.token_ids[0] == t1]
    counts = torch.bincount(torch.tensor(seconds), minlength=second.numel()).double()
    expected = second.double() * len(seconds)
    order = torch.argsort(expected, descending=True)
    big = [int(i) for i in order if expected[i] >= 5]
    rest = [int(i) for i in order if expected[i] < 5]
    observed_bins = [counts[i] for i in big] + [counts[rest].sum()]
    expected_bins = [expected[i] for i in big] + [expected[rest].sum()]
    statistic = sum(
        float((o - e) ** 2 / e) for o, e in zip(observed_bins, expected_bins, strict=True)
    )
    assert statistic < chi_square_999(len(big)), (statistic, len(big))
    stats = llm.engine.speculation
    assert stats.num_proposed >= len(seconds) and 0 < stats.num_accepted < stats.num_proposed


# --- a draft model -----------------------------------------------------------------------


@pytest.mark.parametrize("composition", ["chunked-8", "preempting", "block-16"])
def test_a_draft_model_that_is_the_model_has_every_proposal_kept(oracle, composition):
    """The draft's greedy continuation is the model's own: tokens equal transformers' and
    every proposal is kept; its engine ends each proposal with its blocks free."""
    path, prompts, expected = oracle("llama")
    options = {**SPECULATING_COMPOSITIONS[composition], "speculative_model": str(path)}
    llm = LLM(str(path), **speculating(4, **options))
    assert run(llm, prompts, greedy()) == expected
    stats = llm.engine.speculation
    assert stats.num_accepted == stats.num_proposed > 0
    assert_all_blocks_free(llm.engine)
    draft = llm.engine.draft
    assert draft is not None
    assert_all_blocks_free(draft.engine)


def test_a_draft_model_that_disagrees_changes_no_token(oracle, tmp_path):
    path, prompts, expected = oracle("llama")
    other = build_checkpoint(tmp_path, family="llama", seed=1)
    llm = LLM(str(path), **speculating(3, speculative_model=str(other)))
    assert run(llm, prompts, greedy()) == expected
    configs = [seeded(i) for i in range(len(prompts))]
    want = [r.token_ids for r in LLM(str(path), dtype="float32").generate(prompts, configs)]
    assert [r.token_ids for r in llm.generate(prompts, configs)] == want
    stats = llm.engine.speculation
    assert stats.num_proposed > stats.num_accepted


def test_seeded_sampling_with_a_draft_model_keeps_its_tokens(oracle):
    path, prompts, _ = oracle("llama")
    configs = [seeded(i) for i in range(len(prompts))]
    want = [r.token_ids for r in LLM(str(path), dtype="float32").generate(prompts, configs)]
    llm = LLM(str(path), **speculating(3, speculative_model=str(path)))
    assert [r.token_ids for r in llm.generate(prompts, configs)] == want
    assert llm.engine.speculation.num_accepted > 0


def test_a_draft_model_with_another_tokenizer_is_refused(oracle, tmp_path):
    """A draft whose ids mean other tokens (two of its vocabulary's entries swapped)."""
    path, _, _ = oracle("llama")
    other = tmp_path / "draft"
    shutil.copytree(path, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = list(vocab)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(InvalidArgumentError, match="tokenizer differs") as error:
        LLM(str(path), **speculating(3, speculative_model=str(other)))
    assert error.value.field == "speculative_model"


def test_a_draft_model_needs_speculative_tokens():
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens") as error:
        EngineConfig("unused", speculative_model="draft")
    assert error.value.field == "speculative_model"


def test_two_tensor_parallel_ranks_with_a_draft_model_equal_transformers(oracle):
    path, prompts, expected = oracle("llama")
    options = dict(tensor_parallel_size=2, max_num_batched_tokens=16, speculative_model=str(path))
    llm = LLM(str(path), **speculating(3, **options))
    try:
        assert run(llm, prompts, greedy()) == expected
        stats = llm.engine.speculation
        assert stats.num_accepted == stats.num_proposed > 0
    finally:
        llm.engine.close()


# --- aborts, LoRA ------------------------------------------------------------------------


class HalfRight(Foresight):
    """Proposes the true next token, then wrong ones: every step keeps one, rejects more."""

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        right = super().propose(token_ids, 1)
        return right + [2] * (max_tokens - 1) if right and max_tokens > 1 else right


def test_aborts_mid_speculation_free_every_block(oracle):
    """Requests aborted between speculating steps, one while its step is in flight
    (overlapped steps), every step keeping one proposal and rejecting the rest: every block
    comes back, the cache holds only real tokens, and the others end with the oracle's."""
    path, prompts, expected = oracle("llama")
    engine = Engine(EngineConfig(str(path), **speculating(5, overlap_steps=True)))
    engine.scheduler.proposer = HalfRight(prompts, expected)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    tokens: dict[str, list[int]] = {}
    num_steps = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
        num_steps += 1
        if num_steps in (6, 9):  # r0 and r3 mid-generation
            engine.abort_request(f"r{0 if num_steps == 6 else 3}")
    stats = engine.speculation
    assert stats.num_proposed > stats.num_accepted > 0
    for i in (1, 2, 4):
        assert tokens[f"r{i}"] == expected[i]
    assert_all_blocks_free(engine)
    full = [p + out for p, out in zip(prompts, expected, strict=True)]
    assert_cache_holds_only_real_blocks(engine, full)


def test_lora_requests_speculate_with_their_adapter(oracle, tmp_path):
    path, prompts, _ = oracle("llama")
    adapter = build_adapter(path, tmp_path / "adapter", seed=3)
    want = hf_lora_greedy(path, adapter, prompts, MAX_TOKENS)
    llm = LLM(str(path), **speculating(3, lora_modules=(("a", str(adapter)),)))
    assert [r.token_ids for r in llm.generate(prompts, greedy(), adapter="a")] == want
    assert llm.engine.speculation.num_proposed > 0
