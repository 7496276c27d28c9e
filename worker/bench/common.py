"""What the benchmarks share: workloads, reports with percentiles, random-weight checkpoints.

Every bench prints human lines and returns a flat summary (`Summary`) that ``--json`` prints
as one JSON object on the last line: ``tok_s``, ``ttft_p50_ms``, ``ttft_p99_ms``, step and
overhead figures where the bench measures them, and one ``ratio_*`` key per baseline run in
the same command, in this process or a peer engine's beside it (these machines are noisy:
read the ratios, not the absolute values).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: One bench's figures, as ``--json`` prints them.
Summary = dict[str, Any]

#: How the tiny model is named in reports (its folder is a temporary one).
TINY_MODEL = "tiny (Llama, 2 layers, hidden 64, SmolLM2's tokenizer, random weights)"


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    #: New tokens per request (each runs to it: ignore_eos).
    max_tokens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.max_tokens)


@dataclass(slots=True)
class Report:
    """One measured run: its wall time, tokens, and per-request / per-step latencies."""

    name: str
    seconds: float
    num_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    #: Time between successive streamed chunks of a request.
    itl_s: list[float] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)
    #: Step time minus the time in the model's forward and LM head (or its one call for
    #: both: `decode_greedy_runs`): what the engine's own Python costs each step
    #: (scheduling, batch building, sampling, detokenizing, outputs).
    host_overhead_s: list[float] = field(default_factory=list)
    #: Generated tokens of each request, in the workload's order, where the run keeps them
    #: (to compare greedy outputs with a peer's).
    token_ids: list[list[int]] = field(default_factory=list)
    #: Each request's completion text, where a served load keeps it (`serve_http`).
    texts: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    def _series(self) -> list[tuple[str, str, list[float]]]:
        """(label, summary key, values) of each latency this report measured."""
        series = [
            ("TTFT", "ttft", self.ttft_s),
            ("ITL", "itl", self.itl_s),
            ("decode step", "step", self.decode_step_s),
            ("host overhead/step", "host_overhead", self.host_overhead_s),
        ]
        return [(label, key, values) for label, key, values in series if values]

    def describe(self) -> str:
        parts = [f"{self.name:<28} {self.tokens_per_s:8.1f} tok/s  ({self.seconds:.1f} s)"]
        for label, _, values in self._series():
            p50, p99 = quantile(values, 0.5), quantile(values, 0.99)
            parts.append(f"{label} p50 {ms(p50)} p99 {ms(p99)}")
        return "  ".join(parts)

    def summary(self) -> Summary:
        out: Summary = {"tok_s": round(self.tokens_per_s, 2), "num_tokens": self.num_tokens}
        for _, key, values in self._series():
            out[f"{key}_p50_ms"] = round(quantile(values, 0.5) * 1e3, 3)
            out[f"{key}_p99_ms"] = round(quantile(values, 0.99) * 1e3, 3)
        return out


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest rank; the median of an even count is the
    upper middle value."""
    if q == 0.5:
        return statistics.median_high(values)
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_workload(
    vocab_size: int,
    num_requests: int,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    seed: int,
) -> Workload:
    """Random prompts with lengths uniform in ``prompt_lens`` and output lengths uniform in
    ``output_lens`` (both inclusive)."""
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(*prompt_lens))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_lens) for _ in range(num_requests)])


def build_tiny_checkpoint(directory: Path, tokenizer_source: Path) -> Path:
    """A 2-layer, hidden-64 Llama with random weights and the default model's tokenizer."""
    return build_random_checkpoint(
        directory,
        tokenizer_source,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def build_random_checkpoint(
    directory: Path, tokenizer_source: Path, model_type: str = "llama", **shape: Any
) -> Path:
    """A model of ``model_type`` and the given shape (its config class's fields) with
    random weights, and the tokenizer of ``tokenizer_source``: for timing shapes no real
    checkpoint has."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        max_position_embeddings=shape.pop("max_position_embeddings", 2048),
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **shape,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
