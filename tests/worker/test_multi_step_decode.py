"""Multi-step decode (``num_decode_steps``): a step of plain greedy decodes runs the model
several times, each run's greedy tokens the next run's inputs.

The oracle is transformers' greedy generation from the same weights: with K = 2, 4 and 7
every prompt must get exactly its tokens, in the oracle matrix's compositions (chunked
prefill, block sizes 1 and 16, preemption, a sliding window whose blocks are given back), and
on each kernel set. Each test also checks that steps did run several times (the equalities
are not vacuous), and after every run the KV pool is whole again and the prefix cache holds
only blocks of tokens the sequences really have.
"""

from __future__ import annotations

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM, Engine, EngineConfig
from headrace.worker.scheduling.output import SchedulerOutput

from tests.factories import build_checkpoint, hf_greedy
from tests.worker.test_engine_oracle import COMPOSITIONS, WINDOWED, assert_all_blocks_free
from tests.worker.test_speculative import (
    assert_cache_holds_only_real_blocks,
    assert_stop_strings_cut_as_one_token_a_step,
    greedy,
    repeating_prompts,
    run,
)

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """family -> (checkpoint, prompts, transformers' greedy tokens)."""
    cases: dict[str, tuple] = {}

    def case(family: str):
        if family not in cases:
            base, window = WINDOWED.get(family, (family, None))
            path = build_checkpoint(
                tmp_path_factory.mktemp(base), family=base, sliding_window=window
            )
            vocab_size = LLM(str(path), dtype="float32").engine.vocab_size
            prompts = repeating_prompts(vocab_size)
            cases[family] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return cases[family]

    return case


def decoding(k: int, **options) -> dict:
    return dict(dtype="float32", num_decode_steps=k, **options)


def most_runs(engine: Engine) -> list[int]:
    """Record, from now on, the most runs of each step the engine schedules (a list that
    grows as it steps)."""
    runs: list[int] = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs) -> SchedulerOutput:
        step = schedule(*args, **kwargs)
        runs.append(max((c.num_decode_steps for c in step.chunks), default=1))
        return step

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    return runs


def runs_in_one_call(engine: Engine, take: bool = True) -> list[int]:
    """Record, from now on, how many runs each step of greedy decodes the model ran in one
    call (`decode_greedy_runs`; 0 where they ran from Python); with ``take`` False the model
    is never let to, so every step runs from Python."""
    counts: list[int] = []
    model = engine.runner.model
    in_one_call = model.decode_greedy_runs

    def recording(input_ids, positions, later_slots, *rest):
        drawn = in_one_call(input_ids, positions, later_slots, *rest) if take else None
        counts.append(0 if drawn is None else 1 + len(later_slots))
        return drawn

    model.decode_greedy_runs = recording  # type: ignore[method-assign]
    return counts


# --- against the oracle ----------------------------------------------------------------------


@pytest.mark.parametrize("k", [2, 4, 7])
def test_greedy_tokens_equal_transformers_and_steps_run_k_times(oracle, k):
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), **decoding(k, block_size=4))
    runs = most_runs(llm.engine)
    assert run(llm, prompts, greedy()) == expected
    assert max(runs) == k
    assert_all_blocks_free(llm.engine)
    full = [p + out for p, out in zip(prompts, expected, strict=True)]
    assert_cache_holds_only_real_blocks(llm.engine, full)


MATRIX = [("llama", c, "cpu") for c in sorted(COMPOSITIONS)] + [
    ("mistral+sw", "block-16", "cpu"),
    ("mistral+sw", "preempting", "cpu"),
    ("qwen3", "chunked-8", "cpu"),
    ("llama", "chunked-8", "reference"),
    ("llama", "preempting", "reference"),
    ("llama", "chunked-8", "triton"),
]


@pytest.mark.parametrize(("family", "composition", "backend"), MATRIX)
def test_every_composition_equals_transformers(oracle, family, composition, backend):
    path, prompts, expected = oracle(family)
    options = {**COMPOSITIONS[composition], "kernel_backend": backend}
    if "preempting" in composition and family not in WINDOWED:
        options["num_kv_blocks"] = 24  # five sequences of up to 63 tokens in 4-token blocks
    llm = LLM(str(path), **decoding(4, **options))
    runs, one_call = most_runs(llm.engine), runs_in_one_call(llm.engine)
    assert run(llm, prompts, greedy()) == expected
    # (overlapped steps run several only when no step is in flight beside them)
    assert max(runs) == 4 or composition.startswith("overlapped")
    # The one-call C stack serves Llama's and Mistral's layers on the CPU kernels, and so
    # their steps' runs; Qwen3's q/k norms and the other kernel sets run them from Python.
    if max(runs) == 4:
        assert (max(one_call) == 4) == (backend == "cpu" and family != "qwen3")
    if "preempting" in composition:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [1, 5])
def test_runs_in_one_call_draw_the_tokens_of_runs_from_python(oracle, dtype, k):
    """A step's runs in one C call (embedding rows, the stack, the head's matmul and argmax
    in C), one run a step or five, draw every token the runs from Python draw, in bf16 too
    (no oracle there: the runs from Python are the reference), for one sequence and for a
    batch."""
    path, prompts, _ = oracle("llama")
    tokens = {}
    for take in (True, False):
        llm = LLM(str(path), **{**decoding(k, kernel_backend="cpu"), "dtype": dtype})
        one_call = runs_in_one_call(llm.engine, take)
        tokens[take] = run(llm, prompts, greedy()), run(llm, prompts[:1], greedy())
        assert (max(one_call) == k) == take
        assert_all_blocks_free(llm.engine)
    assert tokens[True] == tokens[False]


# --- limits and stops --------------------------------------------------------------------


def test_max_tokens_and_the_context_are_never_passed(oracle):
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), **decoding(4))
    for n in (1, 2, 3, 5, 7):
        results = llm.generate(prompts, greedy(n))
        assert [r.token_ids for r in results] == [e[:n] for e in expected]
        assert all(r.finish_reason == "length" for r in results)
    # A context of 30 tokens: the 23-token prompt makes 7, in two steps of up to 4.
    short = LLM(str(path), **decoding(4, max_model_len=30))
    runs = most_runs(short.engine)
    result = short.generate(prompts[4:5], greedy())[0]
    assert result.token_ids == expected[4][:7] and result.finish_reason == "length"
    assert max(runs) == 4
    assert_all_blocks_free(short.engine)


@pytest.mark.parametrize("position", [2, 9])
def test_a_stop_token_mid_step_ends_the_sample_there(oracle, position):
    """The output token at ``position`` is made a stop token: every sample ends at its first
    occurrence, though the step that drew it ran on past it."""
    path, prompts, expected = oracle("llama")
    stop = expected[0][position]
    want = [out[: out.index(stop) + 1] if stop in out else out for out in expected]
    llm = LLM(str(path), **decoding(7))
    runs = most_runs(llm.engine)
    results = llm.generate(prompts, greedy(stop_token_ids=[stop]))
    assert [r.token_ids for r in results] == want
    assert results[0].finish_reason == "stop" and max(runs) == 7
    assert_all_blocks_free(llm.engine)


def test_stop_strings_cut_the_text_as_decoding_once_a_step(oracle):
    path, prompts, _ = oracle("llama")
    assert_stop_strings_cut_as_one_token_a_step(path, prompts, decoding(5))


def test_streamed_deltas_carry_up_to_k_tokens_a_step(oracle):
    path, prompts, expected = oracle("llama")
    engine = Engine(EngineConfig(str(path), **decoding(5)))
    engine.add_request("r", prompts[0], greedy())
    tokens: list[int] = []
    sizes: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.extend(delta.token_ids)
                sizes.append(len(delta.token_ids))
    # the prompt's step draws one; then 39 in steps of 5, the last of 4
    assert tokens == expected[0] and sizes == [1] + [5] * 7 + [4]
    assert engine.step_stats.num_decode_tokens == MAX_TOKENS - 1


# --- who decodes several ---------------------------------------------------------------------


def test_a_request_that_is_not_plain_greedy_keeps_every_step_to_one_run(oracle):
    """A sampled request, or one whose logits read its history, beside greedy ones: every
    step runs once, and the greedy ones still get the oracle's tokens."""
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), **decoding(4))
    runs = most_runs(llm.engine)
    for other in (
        GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.7, seed=3, ignore_eos=True),
        greedy(repetition_penalty=1.2),
        greedy(logprobs=2),
    ):
        configs = [greedy()] * (len(prompts) - 1) + [other]
        results = llm.generate(prompts, configs)
        assert [r.token_ids for r in results[:-1]] == expected[:-1]
    assert max(runs) == 1


def test_a_waiting_request_keeps_the_step_to_one_run(oracle):
    """A request that arrives while others decode is not kept waiting for a multi-step
    step: the step that takes its prompt runs once."""
    path, prompts, expected = oracle("llama")
    engine = Engine(EngineConfig(str(path), **decoding(4)))
    runs = most_runs(engine)
    engine.add_request("a", prompts[0], greedy())
    tokens: dict[str, list[int]] = {"a": [], "b": []}

    def step() -> None:
        for output in engine.step():
            tokens[output.request_id].extend(t for d in output.samples for t in d.token_ids)

    step()
    step()
    assert runs == [1, 4]  # the prompt, then four decodes
    engine.add_request("b", prompts[1], greedy())
    step()
    assert runs[-1] == 1  # b waited: a decodes once beside b's prompt
    while engine.has_unfinished_requests():
        step()
    assert tokens == {"a": expected[0], "b": expected[1]}
    assert max(runs[3:]) == 4  # then both decode several a step
    assert_all_blocks_free(engine)


def test_aborts_between_steps_free_every_block(oracle):
    path, prompts, expected = oracle("llama")
    engine = Engine(EngineConfig(str(path), **decoding(4, block_size=4)))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    tokens: dict[str, list[int]] = {}
    for num_steps in range(1, 1000):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
        if num_steps in (4, 6):
            engine.abort_request(f"r{0 if num_steps == 4 else 3}")
    for i in (1, 2, 4):
        assert tokens[f"r{i}"] == expected[i]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (dict(num_decode_steps=0), "num_decode_steps"),
        (dict(num_decode_steps=4, tensor_parallel_size=2), "num_decode_steps"),
        (dict(num_decode_steps=4, num_speculative_tokens=3), "num_decode_steps"),
    ],
)
def test_bad_settings_are_refused_naming_the_field(options, field):
    with pytest.raises(InvalidArgumentError) as error:
        EngineConfig("unused", **options)
    assert error.value.field == field
