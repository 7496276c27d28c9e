"""``headrace bench quality``: what quantization costs in accuracy.

    headrace bench quality            # SmolLM2-135M: none, int8, int4, gguf; int8 KV too
    headrace bench quality --quantization none,int8 --max-windows 4
    headrace bench quality --quantization none,none:bfloat16 # a dtype per configuration
    headrace bench quality --quantization none,none/int8     # the KV cache in int8
    headrace bench quality --quantization none,gguf+a8       # int8 activations

Each configuration (``QUANT[+a8][:DTYPE][/KV]``: ``+a8`` for int8 activations, ``--dtype``
where no dtype is given, the KV cache in the model's dtype where no KV is given) loads the
model in an `LLM` of its own, one after the other, each released before the next loads.
Figures:

- perplexity: the text cut into non-overlapping windows of ``--window`` tokens (the tail that
  fills no window dropped), every window one prompt scored by the engine's prompt logprobs;
  each token after a window's first is scored given the tokens before it in its window, and
  perplexity = exp(mean negative log-likelihood over every scored token);
- greedy agreement with the first configuration (the baseline): ``--prompts`` prompts of 32
  tokens cut from the text at even steps, each run greedy to ``--new-tokens`` (ignore_eos);
  ``agreement`` is the share of new tokens equal to the baseline's before the first that
  differs, averaged over prompts, ``identical`` the share of prompts whose tokens all equal.

The bars quantization is held to, against a ``none`` baseline: int8's perplexity at most 1%
over it, int4's at most 5% (`THRESHOLDS`), and an int8 KV cache at most 0.5% on top of its
weights' bar (`KV_THRESHOLD`: none/int8 0.5%, int4/int8 5.5%); other configurations have
none.

The text (`TEXT_FILE`, shipped in ``data/``) is chapters I-IV of Lewis Carroll's *Alice's
Adventures in Wonderland* (1865), verbatim: lines 30-923 of ``11-0.txt`` in Project
Gutenberg's repository for eBook #11 (github.com/gutenbergbooks/11, commit 5e5120e), whose
LICENSE.txt states the eBook is in the public domain in the United States (Carroll died in
1898).
"""

from __future__ import annotations

import argparse
import gc
import math
from dataclasses import asdict, dataclass
from importlib import resources
from typing import Any

import torch
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import InvalidArgumentError
from headrace.sdk.outputs import GenerationResult
from headrace.sdk.prompts import Prompt
from headrace.worker.bench.common import Summary
from headrace.worker.bench.peers import agreement as identical_share
from headrace.worker.config import EngineConfig
from headrace.worker.engine.llm import LLM
from headrace.worker.models.store import resolve_model
from transformers import AutoTokenizer

#: The shipped text, in this package's ``data/`` folder.
TEXT_FILE = "alice_chapters_1_4.txt"
#: Tokens per greedy-agreement prompt.
PROMPT_LEN = 32
#: The bars quantization is held to: its perplexity at most this share over a ``none``
#: baseline's.
THRESHOLDS = {"none": 0.0, "int8": 0.01, "int4": 0.05}
#: ... and what an int8 KV cache may add on top (a share of the weights' perplexity).
KV_THRESHOLD = 0.005


@dataclass(frozen=True, slots=True)
class Configuration:
    """One way to load the model: how linear layers hold weights, the float dtype, and how the
    KV cache stores K and V."""

    quantization: str
    dtype: str
    kv_cache_dtype: str = "auto"
    int8_activations: bool = False

    @property
    def label(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f" kv-{self.kv_cache_dtype}"
        a8 = "+a8" if self.int8_activations else ""
        return f"{self.quantization}{a8} {self.dtype}{kv}"

    @property
    def key(self) -> str:
        """The label as ``--json`` keys carry it."""
        return self.label.replace(" ", "_").replace("-", "_").replace("+", "_")

    def engine_options(self) -> dict[str, Any]:
        """`EngineConfig`'s fields for this configuration (its own fields bear their names)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Agreement:
    """Greedy tokens of one configuration against the baseline's, prompt by prompt."""

    #: Mean over prompts of the share of new tokens equal to the baseline's before the first
    #: position where they differ.
    prefix: float
    #: Share of prompts whose new tokens all equal the baseline's.
    identical: float


@dataclass(frozen=True, slots=True)
class Measurement:
    configuration: Configuration
    perplexity: float
    #: Tokens whose logprob counted: (window - 1) per window.
    num_scored_tokens: int
    #: The greedy new tokens of each prompt.
    greedy_token_ids: list[list[int]]


def parse_configurations(text: str, default_dtype: str, model: str) -> list[Configuration]:
    """``"none,int8,int4:bfloat16,none/int8"`` as configurations, each checked as
    `EngineConfig` checks it (before any model loads, so a typo in the last one does not cost
    the others' runs)."""
    configurations = []
    for part in text.split(","):
        weights, _, kv_cache_dtype = part.strip().partition("/")
        quantization, _, dtype = weights.partition(":")
        quantization, a8, _ = quantization.partition("+a8")
        configuration = Configuration(
            quantization, dtype or default_dtype, kv_cache_dtype or "auto", bool(a8)
        )
        EngineConfig(model=model, **configuration.engine_options())
        configurations.append(configuration)
    return configurations


def load_text() -> str:
    return (resources.files("headrace.worker.bench") / "data" / TEXT_FILE).read_text("utf-8")


def cut_windows(token_ids: list[int], window: int, max_windows: int | None) -> list[list[int]]:
    """Non-overlapping windows of ``window`` tokens (stride = window), the partial tail
    dropped; the first ``max_windows`` of them if given."""
    num_windows = len(token_ids) // window
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    if num_windows < 1:
        raise InvalidArgumentError("window", f"{window} tokens: the text has {len(token_ids)}")
    return [token_ids[i * window : (i + 1) * window] for i in range(num_windows)]


def cut_prompts(token_ids: list[int], num_prompts: int, prompt_len: int) -> list[list[int]]:
    """``num_prompts`` snippets of ``prompt_len`` tokens, starting at even steps over the text."""
    span = len(token_ids) - prompt_len
    starts = [i * span // num_prompts for i in range(num_prompts)]
    return [token_ids[start : start + prompt_len] for start in starts]


def score_windows(llm: LLM, windows: list[list[int]]) -> tuple[float, int]:
    """(perplexity, scored tokens) of the windows: exp of the mean negative logprob of every
    token after a window's first, given the window's tokens before it."""
    config = GenerationConfig(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    prompts: list[Prompt] = list(windows)
    nll: list[float] = []
    for window, result in zip(windows, _checked(llm.generate(prompts, config)), strict=True):
        assert result.prompt_logprobs is not None
        assert len(result.prompt_logprobs) == len(window) - 1
        nll.extend(-scored.logprob for scored in result.prompt_logprobs)
    return math.exp(math.fsum(nll) / len(nll)), len(nll)


def greedy(llm: LLM, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    config = GenerationConfig(max_tokens=num_new_tokens, temperature=0.0, ignore_eos=True)
    batch: list[Prompt] = list(prompts)
    return [result.token_ids for result in _checked(llm.generate(batch, config))]


def _checked(results: list[GenerationResult]) -> list[GenerationResult]:
    for result in results:
        if result.error is not None:
            raise result.error
    return results


def agreement(ours: list[list[int]], baseline: list[list[int]]) -> Agreement:
    prefixes = [
        _common_prefix_len(tokens, expected) / len(expected)
        for tokens, expected in zip(ours, baseline, strict=True)
    ]
    return Agreement(sum(prefixes) / len(prefixes), identical_share(ours, baseline))


def _common_prefix_len(tokens: list[int], expected: list[int]) -> int:
    for i, (token, expected_token) in enumerate(zip(tokens, expected, strict=False)):
        if token != expected_token:
            return i
    return min(len(tokens), len(expected))


def measure(
    model: str,
    configuration: Configuration,
    windows: list[list[int]],
    prompts: list[list[int]],
    num_new_tokens: int,
) -> Measurement:
    """Load the model as ``configuration`` says, score the windows, generate greedy, release."""
    with LLM(model, **configuration.engine_options()) as llm:
        perplexity, num_scored = score_windows(llm, windows)
        token_ids = greedy(llm, prompts, num_new_tokens)
    return Measurement(configuration, perplexity, num_scored, token_ids)


def run(args: argparse.Namespace) -> Summary:
    configurations = parse_configurations(args.quantization, args.dtype, args.model)
    model_path = resolve_model(args.model)
    token_ids = AutoTokenizer.from_pretrained(model_path).encode(
        load_text(), add_special_tokens=False
    )
    windows = cut_windows(token_ids, args.window, args.max_windows)
    prompts = cut_prompts(token_ids, args.prompts, PROMPT_LEN)
    print(
        f"model {model_path.name}: perplexity over {len(windows)} windows of {args.window} "
        f"tokens of Alice's Adventures in Wonderland, ch. I-IV ({len(token_ids)} tokens); "
        f"greedy agreement: {len(prompts)} prompts of {PROMPT_LEN} tokens x {args.new_tokens} "
        f"new tokens against {configurations[0].label}",
        flush=True,
    )
    measurements = []
    for configuration in configurations:
        measurements.append(measure(args.model, configuration, windows, prompts, args.new_tokens))
        _release_memory()
        print(f"  {configuration.label}: perplexity {measurements[-1].perplexity:.4f}", flush=True)
    summary: Summary = {"bench": "quality", "model": model_path.name, "window": args.window}
    return summary | _report(measurements)


def _release_memory() -> None:
    """Free the last engine's weights and KV cache before the next loads: collect its
    reference cycles, and on CUDA hand the cached blocks back (the next KV cache is sized
    from the device's free memory)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _report(measurements: list[Measurement]) -> Summary:
    """Print the table; return its figures, keyed by each configuration's `Configuration.key`
    (``_2``, ``_3`` appended to a configuration measured again, as a determinism check)."""
    baseline = measurements[0]
    summary: Summary = {"num_scored_tokens": baseline.num_scored_tokens}
    print(
        f"{'configuration':<20} {'perplexity':>10} {'ratio':>7} {'agreement':>9} "
        f"{'identical':>9}  threshold"
    )
    for i, measured in enumerate(measurements):
        ratio = measured.perplexity / baseline.perplexity
        agreed = agreement(measured.greedy_token_ids, baseline.greedy_token_ids)
        limit = threshold(measured.configuration, baseline.configuration)
        print(
            f"{measured.configuration.label:<20} {measured.perplexity:10.4f} {ratio:7.4f} "
            f"{agreed.prefix:9.1%} {agreed.identical:9.1%}  {_verdict(ratio, limit)}"
        )
        repeats = [m.configuration for m in measurements[:i]].count(measured.configuration)
        key = measured.configuration.key + (f"_{repeats + 1}" if repeats else "")
        summary[f"ppl_{key}"] = round(measured.perplexity, 6)
        summary[f"ratio_ppl_{key}"] = round(ratio, 5)
        summary[f"agreement_{key}"] = round(agreed.prefix, 4)
        summary[f"identical_{key}"] = round(agreed.identical, 4)
        if limit is not None:
            summary[f"pass_{key}"] = ratio <= 1.0 + limit
    return summary


def threshold(configuration: Configuration, baseline: Configuration) -> float | None:
    """The most ``configuration``'s perplexity may exceed the baseline's, as a share, where
    `THRESHOLDS` sets a bar for it: only against a ``none`` baseline with a float KV cache (a
    float configuration has a bar only with an int8 KV cache, `KV_THRESHOLD`)."""
    if (baseline.quantization, baseline.kv_cache_dtype) != ("none", "auto"):
        return None
    limit = THRESHOLDS.get(configuration.quantization)
    if limit is None or configuration.kv_cache_dtype == "auto":
        return limit or None
    return (1.0 + limit) * (1.0 + KV_THRESHOLD) - 1.0


def _verdict(ratio: float, limit: float | None) -> str:
    if limit is None:
        return "-"
    return f"{'pass' if ratio <= 1.0 + limit else 'FAIL'} (<= +{limit:.1%})"
