"""Throughput benchmark: headrace against transformers on the same workload, in one run.

    python -m headrace.worker.bench.engine                      # headrace only
    python -m headrace.worker.bench.engine --baseline hf        # plus transformers' two modes
    python -m headrace.worker.bench.engine --tiny               # engine overhead with a tiny model

Default workload: SmolLM2-135M in bfloat16, 64 requests, prompt lengths uniform in 32-512
tokens, 128 new tokens each, greedy, ignore_eos. Numbers are this machine's and this run's:
read the ratios, not the absolute values.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from headrace.sdk.config import GenerationConfig
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    max_tokens: int

    @property
    def num_output_tokens(self) -> int:
        return len(self.prompts) * self.max_tokens


@dataclass(slots=True)
class Report:
    name: str
    seconds: float
    num_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    decode_step_s: list[float] = field(default_factory=list)
    host_overhead_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    def describe(self) -> str:
        parts = [f"{self.name:<24} {self.tokens_per_s:8.1f} tok/s  ({self.seconds:.1f} s)"]
        if self.ttft_s:
            p50, p99 = statistics.median(self.ttft_s), quantile(self.ttft_s, 0.99)
            parts.append(f"TTFT p50 {_ms(p50)} p99 {_ms(p99)}")
        if self.decode_step_s:
            parts.append(f"decode step p50 {_ms(statistics.median(self.decode_step_s))}")
        if self.host_overhead_s:
            parts.append(f"host overhead/step p50 {_ms(statistics.median(self.host_overhead_s))}")
        return "  ".join(parts)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of values, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def make_workload(
    vocab_size: int, num_requests: int, min_len: int, max_len: int, max_tokens: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    # Skip the lowest ids, where tokenizers keep their special tokens.
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(min_len, max_len))]
        for _ in range(num_requests)
    ]
    return Workload(prompts, max_tokens)


# --- headrace -------------------------------------------------------------------------------


class _TimedModel:
    """Wraps the model to add up time spent in forward and the LM head during a step."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self._model = model
        self._device = device
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def _timed(self, fn: Any, *args: Any) -> Any:
        start = time.perf_counter()
        out = fn(*args)
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        self.seconds += time.perf_counter() - start
        return out

    def __call__(self, *args: Any) -> Any:
        return self._timed(self._model, *args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._timed(self._model.compute_logits, hidden)


def run_headrace(engine: Engine, workload: Workload, name: str = "headrace") -> Report:
    timed = _TimedModel(engine.runner.model, engine.device)
    engine.runner.model = timed  # type: ignore[assignment]
    config = GenerationConfig(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, prompt in enumerate(workload.prompts):
        engine.add_request(f"bench-{i}", prompt, config)
    report = Report(name, 0.0, 0)
    first_token: dict[str, float] = {}
    while engine.has_unfinished_requests():
        timed.seconds = 0.0
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        step = now - step_start
        num_new = sum(len(d.token_ids) for o in outputs for d in o.samples)
        report.num_tokens += num_new
        for output in outputs:
            first_token.setdefault(output.request_id, now - start)
        plan = engine.last_step
        if plan is not None and plan.chunks and plan.num_decode_seqs == len(plan.chunks):
            # Every scheduled sequence decoded one token: a pure decode step.
            report.decode_step_s.append(step)
            report.host_overhead_s.append(step - timed.seconds)
    report.seconds = time.perf_counter() - start
    report.ttft_s = list(first_token.values())
    engine.runner.model = timed._model
    return report


# --- transformers baselines ----------------------------------------------------------------


def run_hf_generate(model: Any, workload: Workload, pad_id: int) -> Report:
    """transformers' padded batch generate: all prompts left-padded into one batch."""
    width = max(len(p) for p in workload.prompts)
    input_ids = torch.full((len(workload.prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, prompt in enumerate(workload.prompts):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt)
        mask[i, width - len(prompt) :] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=workload.max_tokens,
            min_new_tokens=workload.max_tokens,
            pad_token_id=pad_id,
        )
    seconds = time.perf_counter() - start
    num_tokens = (out.shape[1] - width) * out.shape[0]
    return Report("hf generate (padded)", seconds, num_tokens)


def run_hf_generate_batch(model: Any, workload: Workload) -> Report:
    """transformers' continuous batching: generate_batch."""
    from transformers import GenerationConfig as HFGenerationConfig

    config = HFGenerationConfig(
        max_new_tokens=workload.max_tokens,
        do_sample=False,
        eos_token_id=None,
        use_cuda_graph=False,
    )
    start = time.perf_counter()
    # No inference_mode here: generate_batch runs its own thread and updates its cache in place.
    results = model.generate_batch(inputs=workload.prompts, generation_config=config)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(r.generated_tokens) for r in results.values())
    return Report("hf generate_batch", seconds, num_tokens)


# --- tiny model -----------------------------------------------------------------------------


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


def build_random_checkpoint(directory: Path, tokenizer_source: Path, **shape: Any) -> Path:
    """A Llama of the given shape (LlamaConfig fields) with random weights, and the
    tokenizer of ``tokenizer_source``: for timing shapes no real checkpoint has."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **shape,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m headrace.worker.bench.engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument(
        "--attention-backend", choices=["auto", "triton", "reference"], default="auto"
    )
    parser.add_argument("--tiny", action="store_true", help="2-layer hidden-64 model: overhead")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())

    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_path = build_tiny_checkpoint(Path(tmp), resolve_model(DEFAULT_MODEL))
            num_requests, max_tokens = args.num_requests or 256, args.max_tokens or 64
            min_len, max_len = 16, 64
        else:
            model_path = resolve_model(args.model)
            num_requests, max_tokens = args.num_requests or 64, args.max_tokens or 128
            min_len, max_len = args.min_prompt_len, args.max_prompt_len
        engine = Engine(
            EngineConfig(
                model=str(model_path),
                dtype=args.dtype,
                max_num_seqs=max(256, num_requests),
                max_num_batched_tokens=args.max_num_batched_tokens,
                attention_backend=args.attention_backend,
            )
        )
        workload = make_workload(
            engine.vocab_size, num_requests, min_len, max_len, max_tokens, args.seed
        )
        print(
            f"workload: {num_requests} requests, prompts {min_len}-{max_len} tokens, "
            f"{max_tokens} new tokens, model {model_path.name}, dtype {args.dtype}, "
            f"device {engine.device}, kernels {engine.kernels.NAME}, "
            f"threads {torch.get_num_threads()}"
        )
        run_headrace(engine, make_workload(engine.vocab_size, 4, 8, 16, 4, 1), "warm-up")
        ours = run_headrace(engine, workload)
        print(ours.describe())
        if args.baseline == "hf":
            _run_baselines(model_path, args.dtype, workload, ours, engine)


def _run_baselines(
    model_path: Path, dtype: str, workload: Workload, ours: Report, engine: Engine
) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model.eval()
    # transformers fills a None eos_token_id back in from the model's own config: clear it
    # there so both baselines run every request to max_tokens, like ignore_eos does here.
    model.generation_config.eos_token_id = None
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
    warm = make_workload(engine.vocab_size, 2, 8, 16, 4, 1)
    run_hf_generate(model, warm, pad_id)
    reports = [run_hf_generate(model, workload, pad_id), run_hf_generate_batch(model, workload)]
    for report in reports:
        print(report.describe())
        print(f"  headrace / {report.name}: {ours.tokens_per_s / report.tokens_per_s:.2f}x")
    best = max(reports, key=lambda r: r.tokens_per_s)
    print(
        f"headrace vs the better baseline ({best.name}): "
        f"{ours.tokens_per_s / best.tokens_per_s:.2f}x"
    )


if __name__ == "__main__":
    main()
