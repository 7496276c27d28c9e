"""Beam search against transformers' `generate(num_beams=k)` on a random-weight checkpoint.

The oracle's sequences and `sequences_scores` must be headrace's beams and beam scores, for
several widths, length penalties, early-stopping modes and processors, in every batch
composition (beams beside plain requests, preemption, block size 1, a sequence cap below the
beams), with steps in flight (two pipeline stages; overlapped steps), and with every KV block
back in the pool afterwards. A few frequent tokens are made stop tokens (transformers: extra
EOS ids) so that beams finish early and the finished-hypothesis and early-stopping paths run,
not only the length limit.
"""

from __future__ import annotations

import collections
import random

import pytest
import torch
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.sdk.outputs import FinishReason
from headrace.worker import LLM, Engine, EngineConfig
from transformers import GenerationConfig as HFGenerationConfig

from tests.factories import build_checkpoint, load_hf_model
from tests.worker.test_engine_oracle import assert_all_blocks_free

MAX_TOKENS = 12
PROMPT_LENGTHS = (3, 9, 17, 30)

#: (num_beams, n, length_penalty, early_stopping, processors in transformers' names).
CASES = [
    (2, 2, 1.0, False, {}),
    (3, 2, 0.5, True, {}),
    (4, 4, 2.0, "never", {}),
    (4, 3, -1.0, False, {}),
    (3, 3, 1.0, "never", {"min_new_tokens": 4}),
    (3, 3, 1.0, False, {"no_repeat_ngram_size": 2}),
    (3, 1, 1.0, False, {"repetition_penalty": 1.3}),
]

COMPOSITIONS = {
    "roomy": dict(num_kv_blocks=512, block_size=4),
    "preempting": dict(block_size=4, num_kv_blocks=40, max_num_batched_tokens=16),
    "block-1": dict(block_size=1, num_kv_blocks=2000, max_num_batched_tokens=16),
    "seq-cap-3": dict(max_num_seqs=3, num_kv_blocks=512),
}


class Oracle:
    def __init__(self, path) -> None:
        self.path = path
        self.model = load_hf_model(path)
        gen = self.model.generation_config
        self.eos, self.pad = gen.eos_token_id, gen.pad_token_id
        rng = random.Random(0)
        vocab = self.model.config.vocab_size
        self.prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]
        self.stops: list[int] = []
        # The tokens plain beam search generates most become stop tokens.
        counts = collections.Counter(
            t for p in self.prompts for beam in self.beams(p, 4, 4, 1.0, False, {})[0] for t in beam
        )
        self.stops = [token for token, _ in counts.most_common(3)]

    def beams(self, prompt, num_beams, n, length_penalty, early_stopping, processors):
        """transformers' n best beams (generated tokens, up to the first stop) and scores."""
        stops = [self.eos, *self.stops]
        config = HFGenerationConfig(
            do_sample=False,
            num_beams=num_beams,
            num_return_sequences=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_new_tokens=MAX_TOKENS,
            eos_token_id=stops,
            pad_token_id=self.pad,
            output_scores=True,
            return_dict_in_generate=True,
            **processors,
        )
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config
            )
        beams = []
        for sequence in out.sequences:
            tokens = sequence[len(prompt) :].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
            beams.append(tokens[:end])  # what follows the stop is padding
        return beams, [float(score) for score in out.sequences_scores]

    def config(self, num_beams, n, length_penalty, early_stopping, processors):
        options = dict(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            num_beams=num_beams,
            n=n,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            stop_token_ids=tuple(self.stops),
            min_tokens=processors.get("min_new_tokens", 0),
            no_repeat_ngram_size=processors.get("no_repeat_ngram_size", 0),
            repetition_penalty=processors.get("repetition_penalty", 1.0),
        )
        return GenerationConfig(**options)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    oracle = Oracle(build_checkpoint(tmp_path_factory.mktemp("beams"), family="llama"))
    oracle.expected = {
        (c, p): oracle.beams(prompt, *case)
        for c, case in enumerate(CASES)
        for p, prompt in enumerate(oracle.prompts)
    }
    return oracle


def assert_equals_oracle(oracle, results, keys) -> None:
    for key, result in zip(keys, results, strict=True):
        beams, scores = oracle.expected[key]
        assert [o.token_ids for o in result.outputs] == beams, key
        assert [o.beam_score for o in result.outputs] == pytest.approx(scores, rel=1e-5, abs=1e-5)
        for output, beam in zip(result.outputs, beams, strict=True):
            penalty = len(beam) ** CASES[key[0]][2]
            assert output.cumulative_logprob / penalty == pytest.approx(output.beam_score, rel=1e-5)
            stopped = beam[-1] in [oracle.eos, *oracle.stops]
            assert output.finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)
        assert result.usage.num_generated_tokens == sum(len(b) for b in beams)


def test_stop_tokens_make_beams_finish_early(oracle):
    """The cases exercise finished hypotheses, not only the length limit."""
    lengths = [len(beam) for beams, _ in oracle.expected.values() for beam in beams]
    assert min(lengths) < MAX_TOKENS and max(lengths) == MAX_TOKENS


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_beams_equal_transformers_in_every_composition(oracle, composition):
    llm = LLM(str(oracle.path), dtype="float32", **COMPOSITIONS[composition])
    keys = list(oracle.expected)
    prompts = [oracle.prompts[p] for _, p in keys]
    configs = [oracle.config(*CASES[c]) for c, _ in keys]
    # Plain greedy requests run beside the beams and keep their own tokens.
    plain = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate([*prompts, *oracle.prompts], [*configs, *[plain] * len(oracle.prompts)])
    assert_equals_oracle(oracle, results[: len(keys)], keys)
    alone = llm.generate(oracle.prompts, plain)
    assert [r.token_ids for r in results[len(keys) :]] == [r.token_ids for r in alone]
    if composition == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize(
    "steps_in_flight", [dict(pipeline_parallel_size=2), dict(overlap_steps=True)], ids=str
)
def test_beams_equal_transformers_with_steps_in_flight(oracle, steps_in_flight):
    """Forks and copy-on-write while another step is in flight: on a second pipeline stage
    (plans sent to another rank), or on the device thread (overlapped steps)."""
    llm = LLM(
        str(oracle.path), dtype="float32", block_size=4, num_kv_blocks=60,
        max_num_batched_tokens=16, **steps_in_flight,
    )  # fmt: skip
    try:
        keys = [(c, p) for c in (0, 2, 4) for p in range(len(oracle.prompts))]
        configs = [oracle.config(*CASES[c]) for c, _ in keys]
        results = llm.generate([oracle.prompts[p] for _, p in keys], configs)
        assert_equals_oracle(oracle, results, keys)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_all_blocks_free(llm.engine)
    finally:
        llm.close()


def test_forked_beams_copy_shared_blocks_before_writing(oracle):
    """Block size 4 puts most forks mid-block: each child's first write copies the block."""
    engine = Engine(EngineConfig(str(oracle.path), dtype="float32", block_size=4))
    copies = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs):
        step = schedule(*args, **kwargs)
        copies.extend(step.block_copies)
        return step

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    engine.add_request("beams", oracle.prompts[1], oracle.config(*CASES[2]))
    while engine.has_unfinished_requests():
        engine.step()
    assert copies and all(src != dst for src, dst in copies)
    assert_all_blocks_free(engine)


def test_abort_mid_search_ends_every_returned_beam_and_frees_blocks(oracle):
    engine = Engine(EngineConfig(str(oracle.path), dtype="float32", block_size=4))
    engine.add_request("beams", oracle.prompts[2], oracle.config(4, 3, 1.0, False, {}))
    engine.add_request("plain", oracle.prompts[0], GenerationConfig(max_tokens=4))
    for _ in range(4):
        outputs = engine.step()
        assert all(o.request_id != "beams" for o in outputs)  # nothing streams mid-search
    assert len(engine._requests["beams"].seqs) == 4  # four live beams
    output = engine.abort_request("beams")
    assert output is not None and output.finished
    assert [(d.index, d.token_ids, d.finish_reason) for d in output.samples] == [
        (i, [], FinishReason.ABORT) for i in range(3)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(engine)


def test_beams_too_wide_for_the_pool_end_with_what_they_have(oracle):
    """A search whose beams outgrow the KV pool returns its best beams so far (length)."""
    llm = LLM(str(oracle.path), dtype="float32", block_size=4, num_kv_blocks=9)
    prompt = oracle.prompts[3]  # 30 tokens: 8 blocks of the 9
    config = GenerationConfig(max_tokens=40, temperature=0.0, num_beams=2, ignore_eos=True)
    result = llm.generate([prompt], config)[0]
    assert result.finish_reason == FinishReason.LENGTH
    assert 0 < len(result.token_ids) < 40
    assert result.outputs[0].beam_score is not None
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(num_beams=2, top_p=0.5), "top_p"),
        (dict(num_beams=2, temperature=0.7), "temperature"),
        (dict(num_beams=2, seed=3), "seed"),
        (dict(num_beams=2, n=3), "n"),
        (dict(num_beams=2, logprobs=1), "logprobs"),
        (dict(num_beams=2, stop=("x",)), "stop"),
        (dict(num_beams=2, regex="[ab]+"), "regex"),
        (dict(num_beams=2, logit_bias={1: 2.0}), "logit_bias"),
        (dict(num_beams=65), "num_beams"),
        (dict(length_penalty=float("inf")), "length_penalty"),
        (dict(early_stopping="sometimes"), "early_stopping"),
    ],
)
def test_beam_options_that_make_no_sense_are_refused(options, field):
    with pytest.raises(InvalidArgumentError) as info:
        GenerationConfig(**options)
    assert info.value.field == field


def test_more_continuations_than_the_vocabulary_holds_are_refused(tmp_path):
    """A round keeps (1 + stop tokens) x num_beams continuations; they must exist."""
    engine = Engine(EngineConfig(str(build_checkpoint(tmp_path)), dtype="float32"))
    stops = tuple(range(3, 23))
    assert engine.vocab_size < 21 * 64
    wide = GenerationConfig(num_beams=64, stop_token_ids=stops)
    with pytest.raises(InvalidArgumentError) as info:
        engine.add_request("wide", [5, 6, 7], wide)
    assert info.value.field == "num_beams"
    engine.add_request("ok", [5, 6, 7], GenerationConfig(num_beams=2, max_tokens=3))
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert [o.request_id for o in outputs] == ["ok"] and outputs[0].finished
