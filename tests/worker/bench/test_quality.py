"""`headrace bench quality`: its perplexity against transformers' on the same windows, and its
greedy agreement, on a tiny random Llama and a few short windows of the shipped text."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.bench import quality
from headrace.worker.bench.cli import quality_arguments
from transformers import AutoTokenizer

from tests.factories import cached_checkpoint, load_hf_model

WINDOW = 64
NUM_WINDOWS = 3


def bench_args(model: str, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    quality_arguments(parser)
    return parser.parse_args(["--model", model, *flags])


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_checkpoint("llama"))


@pytest.fixture(scope="module")
def summary(model: str) -> quality.Summary:
    """The bench run twice on the same configuration: each in an LLM of its own."""
    args = bench_args(
        model, "--quantization", "none,none", "--window", str(WINDOW),
        "--max-windows", str(NUM_WINDOWS), "--prompts", "4", "--new-tokens", "8",
    )  # fmt: skip
    return quality.run(args)


def hf_perplexity(model: str, windows: list[list[int]]) -> float:
    """exp of the mean cross-entropy of each window's tokens after its first (transformers)."""
    hf = load_hf_model(model, torch.float32)
    total, count = 0.0, 0
    with torch.inference_mode():
        for window in windows:
            ids = torch.tensor([window])
            logits = hf(ids).logits[0, :-1].double()
            total += torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
            count += len(window) - 1
    return math.exp(total / count)


def test_perplexity_of_none_float32_equals_transformers(model: str, summary: quality.Summary):
    token_ids = AutoTokenizer.from_pretrained(model).encode(
        quality.load_text(), add_special_tokens=False
    )
    windows = quality.cut_windows(token_ids, WINDOW, NUM_WINDOWS)
    assert summary["num_scored_tokens"] == NUM_WINDOWS * (WINDOW - 1)
    expected = hf_perplexity(model, windows)
    assert summary["ppl_none_float32"] == pytest.approx(expected, rel=1e-4)


def test_a_configuration_agrees_with_itself_fully(summary: quality.Summary):
    """The second run of none float32 (its own LLM) against the first."""
    assert summary["agreement_none_float32_2"] == 1.0
    assert summary["identical_none_float32_2"] == 1.0
    assert summary["ppl_none_float32_2"] == summary["ppl_none_float32"]


def test_agreement_counts_tokens_only_up_to_the_first_difference():
    baseline = [[1, 2, 3, 4], [5, 6, 7, 8]]
    agreed = quality.agreement([[1, 2, 9, 4], [5, 6, 7, 8]], baseline)
    assert agreed.prefix == pytest.approx(
        (2 / 4 + 4 / 4) / 2
    )  # position 3 matches again: not counted
    assert agreed.identical == 0.5


def test_windows_do_not_overlap_and_drop_the_tail():
    windows = quality.cut_windows(list(range(10)), 4, None)
    assert windows == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quality.cut_windows(list(range(10)), 4, 1) == [[0, 1, 2, 3]]


def test_configurations_take_a_dtype_kv_cache_and_activations_and_refuse_unknown_values():
    text = "none,int8:bfloat16,int4/int8,none:bfloat16/int8,int4+a8:bfloat16/int8"
    configurations = quality.parse_configurations(text, "float32", "unused")
    assert [c.label for c in configurations] == [
        "none float32",
        "int8 bfloat16",
        "int4 float32 kv-int8",
        "none bfloat16 kv-int8",
        "int4+a8 bfloat16 kv-int8",
    ]
    assert configurations[2].key == "int4_float32_kv_int8"
    assert configurations[4].int8_activations and configurations[4].quantization == "int4"
    with pytest.raises(InvalidArgumentError, match="quantization"):
        quality.parse_configurations("none,int3", "float32", "unused")
    with pytest.raises(InvalidArgumentError, match="kv_cache_dtype"):
        quality.parse_configurations("none,none/fp8", "float32", "unused")


def test_the_thresholds_bind_int8_and_int4_against_a_none_baseline_only():
    none, int8, int4, gguf = (
        quality.Configuration(name, "float32") for name in ("none", "int8", "int4", "gguf")
    )
    assert quality.threshold(int8, none) == 0.01
    assert quality.threshold(int4, none) == 0.05
    assert quality.threshold(gguf, none) is None
    assert quality.threshold(none, none) is None
    assert quality.threshold(int8, int4) is None


def test_an_int8_kv_cache_may_add_half_a_percent_on_top_of_its_weights_bar():
    none = quality.Configuration("none", "float32")
    none_kv, int4_kv = (quality.Configuration(q, "float32", "int8") for q in ("none", "int4"))
    assert quality.threshold(none_kv, none) == pytest.approx(0.005)
    assert quality.threshold(int4_kv, none) == pytest.approx(1.05 * 1.005 - 1)
    assert quality.threshold(none, none_kv) is None  # bars hold against a float baseline only
