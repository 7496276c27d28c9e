"""headrace's tokens against transformers' generate on the same random-weight checkpoints.

Greedy output must equal the oracle token for token in every batch composition: one request
at a time, all at once, staggered admission, chunked prefill on and off, block sizes 1 and 16,
and a KV pool so small that requests are preempted and recomputed. Seeded sampling must give
the same tokens in all of those compositions.
"""

from __future__ import annotations

import random

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.worker import LLM, Engine, EngineConfig

from tests.factories import build_checkpoint, hf_greedy

MAX_TOKENS = 10
# "+sw": a sliding window of 8, shorter than most prompts: on every layer (mistral and phi3,
# whose blocks behind the window are given back as they decode), and on every layer but the
# first (qwen2's full/windowed alternation).
WINDOWED = {"mistral+sw": ("mistral", 8), "qwen2+sw": ("qwen2", 8), "phi3+sw": ("phi3", 8)}
FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    *WINDOWED,
    "gemma2",
    "gemma3_text",
    "gpt_oss",
]

# Engine options per batch composition. "preempting" gives the pool 14 blocks of 4 tokens
# for 6 sequences that need 1 to 13 each (34 in all), so preemption must happen. "overlapped"
# runs two steps in flight over different sequences, each on the device thread while the
# engine samples and plans the other.
PREEMPTING = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
COMPOSITIONS = {
    "chunked-8": dict(max_num_batched_tokens=8),
    "unchunked": dict(enable_chunked_prefill=False, max_num_batched_tokens=512),
    "block-1": dict(block_size=1, max_num_batched_tokens=16),
    "block-16": dict(block_size=16),
    "preempting": PREEMPTING,
    "overlapped-chunked-8": dict(overlap_steps=True, max_num_batched_tokens=8),
    "overlapped-preempting": dict(overlap_steps=True, **PREEMPTING),
}


def make_prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 3, 9, 17, 26, 40]
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


# The whole composition matrix runs on every family, on the CPU backend's C kernels (what
# "auto" picks on a CPU); cases again with every layer on the torch reference kernels and on
# the Triton kernels (Triton's CPU interpreter here, compiled on a GPU): chunks mixed with
# decodes, and preemption.
MATRIX = [
    (family, composition, "cpu") for family in FAMILIES for composition in sorted(COMPOSITIONS)
] + [
    (family, composition, backend)
    for backend in ("reference", "triton")
    for family, composition in (
        ("llama", "chunked-8"),
        ("qwen3", "preempting"),
        ("qwen2_moe", "chunked-8"),
        ("mistral+sw", "preempting"),
        ("qwen2+sw", "chunked-8"),
        ("gemma2", "chunked-8"),
        ("gemma3_text", "preempting"),
        ("gpt_oss", "chunked-8"),
        ("phi3+sw", "preempting"),
    )
]


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """family -> (checkpoint, prompts, the oracle's greedy tokens), built once per family."""
    cases: dict[str, tuple] = {}

    def case(family: str):
        if family not in cases:
            model_type, window = WINDOWED.get(family, (family, None))
            path = build_checkpoint(
                tmp_path_factory.mktemp(model_type), family=model_type, sliding_window=window
            )
            llm = LLM(str(path), dtype="float32", num_kv_blocks=512)
            prompts = make_prompts(llm.engine.vocab_size)
            cases[family] = (path, prompts, hf_greedy(path, prompts, MAX_TOKENS))
        return cases[family]

    return case


@pytest.fixture(params=FAMILIES)
def family_case(request, oracle):
    return oracle(request.param)


def greedy(n: int = MAX_TOKENS) -> GenerationConfig:
    return GenerationConfig(max_tokens=n, temperature=0.0, ignore_eos=True)


def assert_all_blocks_free(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert all(count == 0 for count in bm.ref_counts)


def test_all_at_once_equals_oracle(family_case):
    path, prompts, expected = family_case
    llm = LLM(str(path), dtype="float32", num_kv_blocks=512)
    results = llm.generate(prompts, greedy())
    assert [r.token_ids for r in results] == expected
    assert all(r.finish_reason == "length" for r in results)
    assert_all_blocks_free(llm.engine)


def test_one_at_a_time_equals_oracle(family_case):
    path, prompts, expected = family_case
    llm = LLM(str(path), dtype="float32", num_kv_blocks=512, enable_prefix_caching=False)
    assert [llm.generate([p], greedy())[0].token_ids for p in prompts] == expected


@pytest.mark.parametrize(("family", "composition", "backend"), MATRIX)
def test_batch_compositions_equal_oracle(oracle, family, composition, backend):
    path, prompts, expected = oracle(family)
    llm = LLM(str(path), dtype="float32", kernel_backend=backend, **COMPOSITIONS[composition])
    assert backend == llm.engine.kernels.NAME
    results = llm.generate(prompts, greedy())
    assert [r.token_ids for r in results] == expected
    if composition.endswith("preempting"):
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm.engine)


def test_staggered_admission_equals_oracle(family_case):
    """Requests join while others are mid-prefill or mid-decode."""
    path, prompts, expected = family_case
    engine = Engine(EngineConfig(str(path), dtype="float32", max_num_batched_tokens=8))
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, greedy())
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    assert_all_blocks_free(engine)


def seeded(i: int) -> GenerationConfig:
    return GenerationConfig(
        max_tokens=MAX_TOKENS,
        temperature=0.9,
        top_k=50,
        top_p=0.95,
        seed=1000 + i,
        ignore_eos=True,
    )


def test_seeded_sampling_is_the_same_in_every_composition(family_case):
    path, prompts, _ = family_case
    configs = [seeded(i) for i in range(len(prompts))]
    reference_llm = LLM(str(path), dtype="float32")
    reference = [r.token_ids for r in reference_llm.generate(prompts, configs)]
    assert len({tuple(t) for t in reference}) > 1
    one_by_one = [
        reference_llm.generate([p], [c])[0].token_ids for p, c in zip(prompts, configs, strict=True)
    ]
    assert one_by_one == reference
    reversed_order = reference_llm.generate(prompts[::-1], configs[::-1])
    assert [r.token_ids for r in reversed_order][::-1] == reference
    for options in COMPOSITIONS.values():
        llm = LLM(str(path), dtype="float32", **options)
        assert [r.token_ids for r in llm.generate(prompts, configs)] == reference


# --- blocks, prefix cache, n > 1, aborts: llama only -----------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama-engine"), family="llama")


def test_shared_prefix_reuses_cached_blocks_with_unchanged_output(llama):
    llm = LLM(str(llama), dtype="float32", block_size=4)
    rng = random.Random(5)
    prefix = [rng.randrange(3, 300) for _ in range(33)]
    first, second = prefix + [11, 12], prefix + [13]
    expected = hf_greedy(llama, [first, second], MAX_TOKENS)
    out_first = llm.generate([first], greedy())[0]
    assert out_first.usage.num_cached_tokens == 0
    hits_before = llm.engine.block_manager.num_prefix_hit_blocks
    out_second = llm.generate([second], greedy())[0]
    assert out_second.usage.num_cached_tokens == 32  # 8 full blocks of the shared prefix
    assert llm.engine.block_manager.num_prefix_hit_blocks - hits_before == 8
    assert [out_first.token_ids, out_second.token_ids] == expected
    assert_all_blocks_free(llm.engine)


def test_n_samples_share_prompt_blocks_and_sample_zero_matches_n1(llama):
    llm = LLM(str(llama), dtype="float32", block_size=4)
    prompt = list(range(5, 30))
    config = GenerationConfig(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True, n=3)
    result = llm.generate([prompt], config)[0]
    assert len(result.outputs) == 3
    assert len({tuple(o.token_ids) for o in result.outputs}) == 3  # distinct samples
    # Siblings reuse the 6 full prompt blocks that sample 0 computed.
    assert llm.engine.block_manager.num_prefix_hit_blocks == 2 * 6
    assert result.usage.num_generated_tokens == 24
    single = llm.generate([prompt], GenerationConfig(max_tokens=8, seed=7, ignore_eos=True))[0]
    assert single.token_ids == result.outputs[0].token_ids
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("overlap_steps", [False, True])
def test_abort_mid_run_frees_every_block_and_others_finish(llama, overlap_steps):
    """With overlapped steps an aborted request may be in a step the device is running."""
    engine = Engine(
        EngineConfig(
            str(llama), dtype="float32", max_num_batched_tokens=16, overlap_steps=overlap_steps
        )
    )
    prompts = make_prompts(engine.vocab_size, seed=3)
    expected = hf_greedy(llama, prompts, MAX_TOKENS)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(3):
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
    victims = ["r1", "r4"]
    if overlap_steps:  # one request of the step in flight, one of the others
        in_flight = sorted({c.seq.request_id for s in engine._in_flight for c in s.step.chunks})
        others = [f"r{i}" for i in range(len(prompts)) if f"r{i}" not in in_flight]
        assert in_flight and others
        victims = [in_flight[0], others[0]]
    before = {request_id: list(tokens.get(request_id, [])) for request_id in victims}
    for request_id in victims:
        aborted = engine.abort_request(request_id)
        assert aborted is not None and aborted.finished
        finish[request_id] = aborted.samples[0].finish_reason
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
    assert finish == dict.fromkeys(victims, "abort")
    assert {request_id: tokens.get(request_id, []) for request_id in victims} == before
    for i in range(len(prompts)):
        if f"r{i}" not in victims:
            assert tokens[f"r{i}"] == expected[i]
    assert_all_blocks_free(engine)


# --- kernel backends -------------------------------------------------------------------------


def test_kernel_backend_is_validated_before_loading(monkeypatch):
    with pytest.raises(InvalidArgumentError) as info:
        EngineConfig("unused", kernel_backend="flash")
    assert info.value.field == "kernel_backend"
    assert "auto, triton, cpu, reference" in str(info.value)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InvalidArgumentError) as info:
        EngineConfig("unused", device="cpu", kernel_backend="triton")
    assert info.value.field == "kernel_backend"
    assert "CUDA" in str(info.value)
    with pytest.raises(InvalidArgumentError) as info:
        EngineConfig("unused", device="meta", kernel_backend="cpu")
    assert info.value.field == "kernel_backend"
    assert "run on the CPU" in str(info.value)


def test_attention_backend_still_chooses_the_kernels_with_a_deprecation_warning(oracle):
    with pytest.warns(DeprecationWarning, match="use kernel_backend"):
        assert EngineConfig("unused", attention_backend="reference").kernel_backend == "reference"
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError) as info:
        EngineConfig("unused", attention_backend="flash")
    assert info.value.field == "kernel_backend"
    with pytest.warns(DeprecationWarning), pytest.raises(InvalidArgumentError) as info:
        EngineConfig("unused", kernel_backend="cpu", attention_backend="reference")
    assert info.value.field == "attention_backend"
    path, prompts, expected = oracle("llama")
    with pytest.warns(DeprecationWarning, match="use kernel_backend"):
        llm = LLM(str(path), dtype="float32", attention_backend="reference")
    assert llm.engine.kernels.NAME == "reference"
    assert [r.token_ids for r in llm.generate(prompts, greedy())] == expected


@pytest.mark.parametrize("backend", ["cpu", "reference", "triton"])
def test_warm_up_leaves_outputs_and_blocks_untouched(oracle, backend):
    """Warm-up (its kernel variants run at start on CUDA, a budget-sized prefill on a CPU)
    writes garbage into block 0 only; requests after it, block 0 among their blocks, still
    equal the oracle."""
    path, prompts, expected = oracle("llama")
    llm = LLM(str(path), dtype="float32", kernel_backend=backend, block_size=4)
    llm.engine.runner.warm_up_kernels(llm.engine.max_model_len)
    llm.engine.runner.warm_up_heap(llm.engine.max_model_len, 96)
    assert_all_blocks_free(llm.engine)
    assert [r.token_ids for r in llm.generate(prompts, greedy())] == expected


def test_reused_logits_buffers_never_hold_two_steps_at_once(llama):
    """On a CPU a step's logits land in a ring of reused buffers, one per step that can be in
    flight: two steps in flight on one rank (each over half the sequences) sample from their
    own logits, so seeded tokens equal those of one step at a time."""
    prompts = make_prompts(LLM(str(llama), dtype="float32").engine.vocab_size, seed=11)
    configs = [seeded(i) for i in range(len(prompts))]
    one = LLM(str(llama), dtype="float32")
    assert one.engine.runner.num_logits_buffers == 1
    expected = [r.token_ids for r in one.generate(prompts, configs)]
    two = LLM(str(llama), dtype="float32", pipeline_steps_in_flight=2)
    assert two.engine.runner.num_logits_buffers == 2
    assert [r.token_ids for r in two.generate(prompts, configs)] == expected
    assert len(two.engine.runner._logits_buffers) == 2
