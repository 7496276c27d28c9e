"""Multi-LoRA against transformers + PEFT on the same random checkpoint and adapters.

Two random PEFT adapters (a: rank 8 on every target; b: rank 4, rsLoRA, attention only) are
served in one batch with the base model; greedy tokens must equal PEFT's with each adapter
applied (and with it merged into the weights), under chunked prefill and under preemption,
with fewer device slots and host-pool places than adapters, and with TP=2.
"""

from __future__ import annotations

import pytest
from headrace.sdk import GenerationConfig, InvalidArgumentError
from headrace.sdk.errors import FailedPreconditionError, NotFoundError
from headrace.worker import LLM, Engine, EngineConfig

from tests.factories import build_checkpoint, hf_greedy
from tests.lora_factories import build_adapter, hf_lora_greedy
from tests.worker.test_engine_oracle import make_prompts

MAX_TOKENS = 8
COMPOSITIONS = {
    "chunked-8": dict(max_num_batched_tokens=8),
    "preempting": dict(block_size=4, num_kv_blocks=30, max_num_batched_tokens=16),
}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(base, {adapter: path}, prompts, {adapter or None: oracle tokens})."""
    root = tmp_path_factory.mktemp("lora")
    base = build_checkpoint(root / "base")
    adapters = {
        "a": build_adapter(base, root / "a", seed=1, rank=8, alpha=16),
        "b": build_adapter(
            base,
            root / "b",
            seed=2,
            rank=4,
            alpha=8,
            use_rslora=True,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        ),
    }
    prompts = make_prompts(256, seed=3)
    expected: dict[str | None, list[list[int]]] = {None: hf_greedy(base, prompts, MAX_TOKENS)}
    for name, path in adapters.items():
        expected[name] = hf_lora_greedy(base, path, prompts, MAX_TOKENS)
    return base, adapters, prompts, expected


def greedy() -> GenerationConfig:
    return GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def lora_llm(case, **options) -> LLM:
    base, adapters, _, _ = case
    modules = tuple(adapters.items())
    return LLM(str(base), dtype="float32", lora_modules=modules, **options)


def run_mixed(llm: LLM, prompts: list[list[int]]) -> dict[str | None, list[list[int]]]:
    """Every prompt under a, b and the base model, interleaved in one batch."""
    names: list[str | None] = ["a", "b", None]
    batch = [(prompt, names[(i + j) % 3]) for i, prompt in enumerate(prompts) for j in range(3)]
    results = llm.generate([p for p, _ in batch], greedy(), adapter=[n for _, n in batch])
    tokens: dict[str | None, list[list[int]]] = {name: [] for name in names}
    for (_, name), result in zip(batch, results, strict=True):
        tokens[name].append(result.token_ids)
    return tokens


def test_adapters_change_the_tokens(case):
    """The oracle is not vacuous: each adapter's tokens differ from the base and each other."""
    _, _, _, expected = case
    assert expected["a"] != expected[None]
    assert expected["b"] != expected[None]
    assert expected["a"] != expected["b"]


def test_merged_adapter_gives_the_same_tokens(case):
    base, adapters, prompts, expected = case
    assert hf_lora_greedy(base, adapters["a"], prompts, MAX_TOKENS, merged=True) == expected["a"]


@pytest.mark.parametrize("composition", sorted(COMPOSITIONS))
def test_mixed_batch_equals_peft(case, composition):
    _, _, prompts, expected = case
    llm = lora_llm(case, max_loras=2, **COMPOSITIONS[composition])
    assert run_mixed(llm, prompts) == expected
    if composition == "preempting":
        assert llm.engine.scheduler.num_preemptions > 0


def test_triton_kernels_in_the_engine(case):
    """Every layer on the Triton kernels (LoRA shrink / expand included; the CPU interpreter
    here): the mixed batch still equals PEFT."""
    _, _, prompts, expected = case
    llm = lora_llm(case, kernel_backend="triton", max_num_batched_tokens=16)
    assert llm.engine.kernels.NAME == "triton"
    few = prompts[:3]
    assert run_mixed(llm, few) == {name: tokens[:3] for name, tokens in expected.items()}


def test_one_slot_one_pool_place_still_serves_every_adapter(case):
    """max_loras=1: each step holds one adapter (others wait); the host pool holds one
    adapter, so the other is read from disk again when it is needed."""
    _, _, prompts, expected = case
    engine = lora_llm(case, max_loras=1, max_cpu_loras=1, max_num_batched_tokens=16).engine
    names = ["a", "b", None]
    for i, prompt in enumerate(prompts):
        for j, name in enumerate(names):
            engine.add_request(f"{name}-{i}-{j}", prompt, greedy(), adapter=name)
    tokens: dict[str, list[int]] = {}
    adapters_per_step = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            for delta in output.samples:
                tokens.setdefault(output.request_id, []).extend(delta.token_ids)
        step = engine.last_step
        assert step is not None
        adapters_per_step.append({c.seq.adapter for c in step.chunks} - {None})
    assert max(len(adapters) for adapters in adapters_per_step) == 1
    assert {"a"} in adapters_per_step and {"b"} in adapters_per_step
    for name in names:
        got = [tokens[f"{name}-{i}-{names.index(name)}"] for i in range(len(prompts))]
        assert got == expected[name]


def test_prefix_cache_never_shares_kv_between_adapters(case):
    _, _, prompts, expected = case
    llm = lora_llm(case, block_size=4)
    prompt = prompts[-1]  # 40 tokens: ten full blocks
    first = {n: llm.generate([prompt], greedy(), adapter=n)[0] for n in ("a", "b", None)}
    again = {n: llm.generate([prompt], greedy(), adapter=n)[0] for n in ("a", "b", None)}
    for name in ("a", "b", None):
        assert first[name].token_ids == expected[name][-1]
        assert again[name].token_ids == expected[name][-1]
        assert first[name].usage.num_cached_tokens == 0  # not another adapter's blocks
        assert again[name].usage.num_cached_tokens > 0  # its own blocks


def test_runtime_load_use_unload(case, tmp_path):
    base, adapters, prompts, expected = case
    llm = LLM(str(base), dtype="float32", enable_lora=True)
    assert llm.list_lora_adapters() == []
    info = llm.load_lora_adapter("late", adapters["b"])
    assert (info.name, info.rank) == ("late", 4)
    assert [a.name for a in llm.list_lora_adapters()] == ["late"]
    results = llm.generate(prompts, greedy(), adapter="late")
    assert [r.token_ids for r in results] == expected["b"]
    with pytest.raises(InvalidArgumentError, match="already loaded"):
        llm.load_lora_adapter("late", adapters["a"])
    llm.unload_lora_adapter("late")
    with pytest.raises(NotFoundError, match="'late'"):
        llm.generate(prompts[:1], greedy(), adapter="late")
    # The name loaded again with other weights: no KV of the old load is reused.
    llm.load_lora_adapter("late", adapters["a"])
    results = llm.generate(prompts, greedy(), adapter="late")
    assert [r.token_ids for r in results] == expected["a"]


def test_unload_in_use_is_refused(case):
    _, _, prompts, _ = case
    engine = lora_llm(case).engine
    engine.add_request("r", prompts[0], greedy(), adapter="a")
    engine.step()
    with pytest.raises(FailedPreconditionError, match="in use by 1"):
        engine.unload_lora_adapter("a")
    while engine.has_unfinished_requests():
        engine.step()
    engine.unload_lora_adapter("a")
    assert [a.name for a in engine.adapters.list()] == ["b"]


def test_unknown_adapter_fails_that_request_only(case):
    _, _, prompts, expected = case
    engine = lora_llm(case).engine
    engine.add_request("ok", prompts[0], greedy(), adapter="a")
    with pytest.raises(NotFoundError, match="'nope'"):
        engine.add_request("bad", prompts[0], greedy(), adapter="nope")
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.extend(t for d in output.samples for t in d.token_ids)
    assert tokens == expected["a"][0]


def test_bad_adapters_are_refused_at_load(case, tmp_path):
    base, _, _, _ = case
    llm = LLM(str(base), dtype="float32", enable_lora=True, max_lora_rank=8)
    big = build_adapter(base, tmp_path / "big", seed=4, rank=16, alpha=16)
    with pytest.raises(InvalidArgumentError, match=r"rank 16.*at most 8"):
        llm.load_lora_adapter("big", big)
    deeper = build_checkpoint(tmp_path / "deeper", num_layers=3)
    other = build_adapter(deeper, tmp_path / "other", seed=5, rank=4)
    with pytest.raises(InvalidArgumentError, match=r"layers\.2\.mlp\.down_proj, which"):
        llm.load_lora_adapter("other", other)
    with pytest.raises(InvalidArgumentError, match="cannot read"):
        llm.load_lora_adapter("missing", tmp_path / "nowhere")
    assert llm.list_lora_adapters() == []


def test_lora_calls_without_lora_enabled(case):
    base, adapters, prompts, _ = case
    llm = LLM(str(base), dtype="float32")
    with pytest.raises(FailedPreconditionError, match="not enabled"):
        llm.load_lora_adapter("a", adapters["a"])
    with pytest.raises(NotFoundError, match="'a'"):
        llm.generate(prompts[:1], greedy(), adapter="a")


def test_tensor_parallel_equals_single_rank(case):
    """TP=2 splits each adapter like its base layer; tokens equal PEFT's (so TP=1's)."""
    base, adapters, prompts, expected = case
    config = EngineConfig(
        str(base),
        dtype="float32",
        tensor_parallel_size=2,
        lora_modules=(("a", str(adapters["a"])),),
        max_num_batched_tokens=16,
        cpu_kv_cache_gib=0.01,
    )
    engine = Engine(config)
    try:
        info = engine.adapters.load("b", adapters["b"])  # at run time, on both ranks
        assert info.rank == 4
        for i, prompt in enumerate(prompts):
            for name in ("a", "b", None):
                engine.add_request(f"{name}-{i}", prompt, greedy(), adapter=name)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                for delta in output.samples:
                    tokens.setdefault(output.request_id, []).extend(delta.token_ids)
    finally:
        engine.close()
    for name in ("a", "b", None):
        assert [tokens[f"{name}-{i}"] for i in range(len(prompts))] == expected[name]


#: The projections an adapter targets where not all of ALL_TARGETS: Phi-3's fused ones,
#: GPT-OSS's attention (its MLP is experts, which take no adapters).
FAMILY_TARGETS = {
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "gpt_oss": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3_text", "phi3", "gpt_oss"])
def test_adapters_on_a_sliding_window_model_equal_peft(tmp_path, family):
    """Windowed attention (every layer, or alternating with full; Gemma's and GPT-OSS's
    layers) under an adapter on every projection: the mixed batch equals PEFT. Phi-3's
    adapters target its fused qkv_proj and gate_up_proj, cut into headrace's pieces as its
    weights are."""
    base = build_checkpoint(tmp_path / "base", family, sliding_window=8)
    targets = {"targets": FAMILY_TARGETS[family]} if family in FAMILY_TARGETS else {}
    adapter = build_adapter(base, tmp_path / "a", seed=1, rank=8, alpha=16, **targets)
    prompts = make_prompts(256, seed=3)
    expected = {
        None: hf_greedy(base, prompts, MAX_TOKENS),
        "a": hf_lora_greedy(base, adapter, prompts, MAX_TOKENS),
    }
    assert expected["a"] != expected[None]
    llm = LLM(str(base), dtype="float32", lora_modules=(("a", adapter),), max_num_batched_tokens=16)
    batch = [(prompt, name) for prompt in prompts for name in (None, "a")]
    results = llm.generate([p for p, _ in batch], greedy(), adapter=[n for _, n in batch])
    for name in (None, "a"):
        got = [r.token_ids for (_, n), r in zip(batch, results, strict=True) if n == name]
        assert got == expected[name]
