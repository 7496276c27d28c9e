"""Tensor- and pipeline-parallel engines (real rank processes over gloo) against TP=1.

Every parallel engine runs the same workload as a single-rank engine: requests admitted in
two waves so later prompts prefill in chunks while earlier ones decode, greedy and seeded
samples, n = 2, and logprobs. Tokens must be identical; logprobs equal to float tolerance
(a row-parallel sum adds its partials in a different order). The single-rank tokens are
themselves checked against transformers, so the chain ends at the oracle.
"""

from __future__ import annotations

import random
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine

from tests.factories import build_checkpoint, hf_greedy

MAX_TOKENS = 8
#: Per-rank KV budget small enough that the block count is set by memory, not by the cap.
KV_GIB = 64 * 12288 / 2**30


@dataclass
class Run:
    """What one engine produced for the workload."""

    #: request id -> each sample's generated tokens.
    tokens: dict[str, list[list[int]]] = field(default_factory=dict)
    #: request id -> sample 0's generated-token logprobs.
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)
    num_mixed_steps: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0


def workload(vocab_size: int) -> list[tuple[str, list[int], GenerationConfig]]:
    rng = random.Random(0)
    requests = []
    for i, length in enumerate([1, 5, 17, 30, 9, 41]):
        prompt = [rng.randrange(3, vocab_size) for _ in range(length)]
        if i % 2 == 0:
            config = GenerationConfig(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        else:
            config = GenerationConfig(
                max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True
            )
        requests.append((f"r{i}", prompt, config))
    prompt = [rng.randrange(3, vocab_size) for _ in range(23)]
    sampled = GenerationConfig(
        max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=2, logprobs=2, prompt_logprobs=1
    )
    requests.append(("n2", prompt, sampled))
    return requests


def run(path: Path, **options: object) -> Run:
    """Two waves of requests through one engine, which is always closed afterwards."""
    engine = Engine(EngineConfig(str(path), dtype="float32", **options))  # type: ignore[arg-type]
    result = Run(num_total_blocks=engine.block_manager.num_blocks)
    try:
        requests = workload(engine.vocab_size)
        for request_id, prompt, config in requests[:3]:
            engine.add_request(request_id, prompt, config)
        for step in range(1000):
            if step == 3:  # the first wave is decoding: the rest prefill beside it
                for request_id, prompt, config in requests[3:]:
                    engine.add_request(request_id, prompt, config)
            if step > 3 and not engine.has_unfinished_requests():
                break
            for output in engine.step():
                collect(result, output)
            last = engine.last_step
            if last is not None and 0 < last.num_decode_seqs < len(last.chunks):
                result.num_mixed_steps += 1
        result.num_preemptions = engine.scheduler.num_preemptions
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
    return result


def collect(result: Run, output) -> None:  # type: ignore[no-untyped-def]
    samples = result.tokens.setdefault(output.request_id, [])
    for delta in output.samples:
        while len(samples) <= delta.index:
            samples.append([])
        samples[delta.index].extend(delta.token_ids)
        if delta.index == 0:
            result.logprobs.setdefault(output.request_id, []).extend(
                lp.logprob for lp in delta.logprobs
            )
    if output.prompt_logprobs is not None:
        result.prompt_logprobs[output.request_id] = [lp.logprob for lp in output.prompt_logprobs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """3 layers (so 2 stages split them unevenly), 4 heads, 2 KV heads, untied head."""
    path = build_checkpoint(tmp_path_factory.mktemp("llama"), "llama", num_layers=3)
    reference = run(path, max_num_batched_tokens=16, cpu_kv_cache_gib=KV_GIB)
    greedy = {rid: p for rid, p, c in workload(512) if c.temperature == 0}
    oracle = hf_greedy(path, list(greedy.values()), MAX_TOKENS)
    assert [reference.tokens[rid][0] for rid in greedy] == oracle
    assert reference.num_mixed_steps > 0
    return path, reference


@pytest.fixture(scope="module")
def qwen3_one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run]:
    """One KV head (replicated across TP ranks), q/k norms, tied embeddings."""
    path = build_checkpoint(
        tmp_path_factory.mktemp("qwen3"), "qwen3", num_kv_heads=1, tie_word_embeddings=True
    )
    return path, run(path, max_num_batched_tokens=16)


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "mixtral"])
def mixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A mixture of experts: Qwen2-MoE (a shared expert), Qwen3-MoE (a dense layer among
    the sparse ones) or Mixtral (its own checkpoint names), 3 layers; the single-rank tokens
    checked against transformers."""
    path = build_checkpoint(tmp_path_factory.mktemp(request.param), request.param, num_layers=3)
    reference = run(path, max_num_batched_tokens=16)
    greedy = {rid: p for rid, p, c in workload(512) if c.temperature == 0}
    oracle = hf_greedy(path, list(greedy.values()), MAX_TOKENS)
    assert [reference.tokens[rid][0] for rid in greedy] == oracle
    return path, reference


@pytest.fixture(
    scope="module", params=["mistral", "qwen2", "gemma2", "gemma3_text", "gpt_oss", "phi3"]
)
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A sliding window of 8 on every layer (Mistral: blocks behind it given back as it
    decodes; Phi-3, its fused checkpoint tensors cut per rank), every layer but the first
    (Qwen2), or every other one (Gemma, with its own norms, scalings, caps and ropes;
    GPT-OSS, with sinks split by head over the ranks and biased experts), 3 layers; checked
    against transformers."""
    path = build_checkpoint(
        tmp_path_factory.mktemp(request.param), request.param, num_layers=3, sliding_window=8
    )
    reference = run(path, max_num_batched_tokens=16, block_size=4)
    greedy = {rid: p for rid, p, c in workload(512) if c.temperature == 0}
    oracle = hf_greedy(path, list(greedy.values()), MAX_TOKENS)
    assert [reference.tokens[rid][0] for rid in greedy] == oracle
    return path, reference


def assert_same(parallel: Run, reference: Run) -> None:
    assert parallel.tokens == reference.tokens
    assert parallel.num_mixed_steps > 0
    for request_id, values in reference.logprobs.items():
        assert parallel.logprobs[request_id] == pytest.approx(values, abs=1e-4)
    for request_id, values in reference.prompt_logprobs.items():
        assert parallel.prompt_logprobs[request_id] == pytest.approx(values, abs=1e-4)


@pytest.mark.parametrize(
    ("tp", "pp", "expected_blocks"),
    [
        # KV bytes per block and rank: TP halves the heads, PP splits the 3 layers 2 + 1, and
        # the pool is what the tightest rank holds.
        (2, 1, 128),
        (1, 2, 96),
        (2, 2, 192),
    ],
)
def test_parallel_llama_equals_single_rank(llama, tp: int, pp: int, expected_blocks: int):
    path, reference = llama
    assert reference.num_total_blocks == 64
    parallel = run(
        path,
        max_num_batched_tokens=16,
        cpu_kv_cache_gib=KV_GIB,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    assert_same(parallel, reference)
    assert parallel.num_total_blocks == expected_blocks


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_replicated_kv_head_and_tied_head_equal_single_rank(qwen3_one_kv_head, tp, pp):
    path, reference = qwen3_one_kv_head
    parallel = run(
        path, max_num_batched_tokens=16, tensor_parallel_size=tp, pipeline_parallel_size=pp
    )
    assert_same(parallel, reference)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["sliced", "ep"])
def test_mixture_of_experts_split_over_ranks_equals_single_rank(mixture, tp, pp, expert_parallel):
    """Each rank holds every expert's slice of the intermediate dimension, or (expert
    parallel) half the experts whole; one all-reduce per block adds the ranks' partials (and
    the shared expert's)."""
    path, reference = mixture
    parallel = run(
        path,
        max_num_batched_tokens=16,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        enable_expert_parallel=expert_parallel,
    )
    assert_same(parallel, reference)


@pytest.mark.parametrize(("family", "fragment"), [("qwen3_moe", "8 experts"), ("llama", "no ")])
def test_experts_that_do_not_share_out_are_refused(tmp_path: Path, no_spawn, family, fragment):
    """8 experts over 3 ranks (6 heads, a 96-wide MLP: the rest splits), or none at all."""
    shape = dict(hidden_size=96, num_heads=6, num_kv_heads=3, intermediate_size=96)
    path = build_checkpoint(tmp_path, family, **shape)  # type: ignore[arg-type]
    config = EngineConfig(
        str(path), tensor_parallel_size=3, enable_expert_parallel=True, kernel_backend="reference"
    )
    with pytest.raises(InvalidArgumentError, match=f"enable_expert_parallel.*{fragment}"):
        Engine(config)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)])
def test_sliding_windows_split_over_ranks_equal_single_rank(windowed, tp, pp):
    """Every rank's layers keep their windows; the blocks rank 0's scheduler gives back
    stay in the other ranks' tables as stale ids that attention never reads."""
    path, reference = windowed
    parallel = run(
        path,
        max_num_batched_tokens=16,
        block_size=4,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    assert_same(parallel, reference)


def test_preempted_sequences_are_resent_whole(llama):
    """A tight pool preempts sequences; ranks must replace, not extend, their block tables."""
    path, reference = llama
    options = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    parallel = run(path, tensor_parallel_size=2, pipeline_parallel_size=2, **options)
    assert parallel.num_preemptions > 0
    assert parallel.tokens == reference.tokens


def test_micro_batches_give_the_same_tokens(llama):
    path, reference = llama
    parallel = run(
        path,
        max_num_batched_tokens=16,
        pipeline_parallel_size=2,
        pipeline_micro_batches=3,
    )
    assert parallel.tokens == reference.tokens


# --- start-up errors: before any process starts -------------------------------------------


@pytest.fixture
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a rank process was started")

    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize(
    ("options", "field_name", "fragment"),
    [
        (dict(tensor_parallel_size=3), "tensor_parallel_size", "num_attention_heads (4)"),
        (dict(pipeline_parallel_size=4), "pipeline_parallel_size", "3 layers"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size", ">= 1"),
        (dict(pipeline_parallel_size=-1), "pipeline_parallel_size", ">= 1"),
        (
            dict(pipeline_parallel_size=2, pipeline_micro_batches=0),
            "pipeline_micro_batches",
            ">= 1",
        ),
    ],
)
def test_bad_sizes_fail_before_any_rank_starts(llama, no_spawn, options, field_name, fragment):
    path, _ = llama
    with pytest.raises(InvalidArgumentError) as error:
        Engine(EngineConfig(str(path), dtype="float32", **options))  # type: ignore[arg-type]
    assert error.value.field == field_name
    assert fragment in str(error.value)


def test_kv_heads_that_do_not_split_fail_before_any_rank_starts(tmp_path: Path, no_spawn):
    path = build_checkpoint(tmp_path, "llama", hidden_size=96, num_heads=6, num_kv_heads=3)
    with pytest.raises(InvalidArgumentError, match=r"num_key_value_heads \(3\)") as error:
        Engine(EngineConfig(str(path), dtype="float32", tensor_parallel_size=2))
    assert error.value.field == "tensor_parallel_size"


def test_pipeline_keeps_one_step_per_stage_in_flight_and_survives_aborts(llama):
    """Two stages: stage 0 runs step k + 1 over other sequences while stage 1 runs step k. A
    request aborted while its step is in flight frees its blocks; the others are unchanged."""
    path, reference = llama
    engine = Engine(
        EngineConfig(
            str(path), dtype="float32", max_num_batched_tokens=16, pipeline_parallel_size=2
        )
    )
    try:
        requests = workload(engine.vocab_size)
        for request_id, prompt, config in requests:
            engine.add_request(request_id, prompt, config)
        tokens: dict[str, list[int]] = {}
        num_overlapped, aborted = 0, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.samples:
                    tokens.setdefault(output.request_id, []).extend(output.samples[0].token_ids)
            if not engine._in_flight:
                continue
            # A step is still in flight after this call returned another: two were in flight,
            # over disjoint sequences.
            (pending,) = engine._in_flight
            in_flight = {c.seq for c in pending.step.chunks}
            assert engine.last_step is not None
            assert in_flight.isdisjoint(c.seq for c in engine.last_step.chunks)
            num_overlapped += 1
            if aborted is None and "r3" in tokens and "r3" in {s.request_id for s in in_flight}:
                aborted = engine.abort_request("r3")
        assert num_overlapped > 10
        assert aborted is not None and aborted.finished
        for request_id in ("r0", "r1", "r2", "r4", "r5"):
            assert tokens[request_id] == reference.tokens[request_id][0]
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    finally:
        engine.close()
