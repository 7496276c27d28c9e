"""``headrace bench structured``: what output constraints cost.

    headrace bench structured                  # SmolLM2-135M: mask cost, then throughput

Two figures, both measured in this process:

- mask cost per step: the token bitmasks of ``--mask-rows`` JSON-schema rows (each at another
  place in its output), filled by xgrammar and applied to [rows, vocab] float32 logits; the
  median of ``--mask-iters`` steps, fill and apply apart;
- throughput: one batch of ``--num-requests`` greedy requests run without constraints, then
  with every other request under a JSON schema (an array long enough that no request finishes
  before ``--max-tokens``, so both runs generate the same tokens); ``--rounds`` of each,
  back to back. ``ratio_constrained`` is the median of the rounds' constrained tok/s over
  plain (a pair run back to back shares the machine's load best); the best of each too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from headrace.sdk.config import GenerationConfig
from headrace.worker.bench.common import Summary, make_workload
from headrace.worker.bench.engine import run_headrace
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.models.store import resolve_model
from headrace.worker.sampling.constraints import GrammarState, apply_grammar_masks

#: Records of a few shapes: strings, integers, an enum, a nested array; many of them.
SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "id": {"type": "integer"},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "id", "kind", "tags"],
    },
}
#: A valid output to cut at many places, so the mask rows sit at many grammar states.
SAMPLE = json.dumps(
    [
        {"name": f"item number {i}", "id": i * 37, "kind": "beta", "tags": ["x", "yz"]}
        for i in range(8)
    ],
)  # xgrammar's compact JSON (any_whitespace=False) is json.dumps' default spacing


def run(args: argparse.Namespace) -> Summary:
    model_path = resolve_model(args.model)
    engine = Engine(
        EngineConfig(
            model=str(model_path),
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=max(256, args.num_requests),
        )
    )
    print(
        f"model {model_path.name}, dtype {args.dtype}, device {engine.device}, vocab "
        f"{engine.vocab_size}, threads {torch.get_num_threads()}"
    )
    summary: Summary = {"bench": "structured", "model": model_path.name}
    summary.update(_mask_cost(engine, args.mask_rows, args.mask_iters))
    summary.update(_throughput(engine, args))
    engine.close()
    return summary


def _mask_cost(engine: Engine, num_rows: int, num_iters: int) -> Summary:
    config = GenerationConfig(json_schema=json.dumps(SCHEMA))
    start = time.perf_counter()
    grammar = engine.intake.controls.compiler.compile(config)
    compile_ms = (time.perf_counter() - start) * 1e3
    assert grammar is not None
    sample_ids = engine.tokenizer.encode(SAMPLE, add_special_tokens=False)
    states = []
    for row in range(num_rows):
        state = GrammarState(grammar)
        for token_id in sample_ids[: (row * 7) % len(sample_ids)]:
            assert state.accept(token_id), "the sample must satisfy the schema"
        states.append(state)
    rows = list(range(num_rows))
    logits = torch.randn(num_rows, engine.vocab_size)
    fill_s, total_s = [], []
    for _ in range(num_iters):
        x = logits.clone()
        start = time.perf_counter()
        bitmask = torch.empty(num_rows, (engine.vocab_size + 31) // 32, dtype=torch.int32)
        for i, state in enumerate(states):
            state.fill_mask(bitmask, i)
        fill_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        apply_grammar_masks(x, states, rows, engine.kernels)
        total_s.append(time.perf_counter() - start)
    fill_ms, total_ms = statistics.median(fill_s) * 1e3, statistics.median(total_s) * 1e3
    print(
        f"mask cost, {num_rows} JSON-schema rows x {engine.vocab_size} tokens: "
        f"{total_ms:.2f} ms per step (fill {fill_ms:.2f} ms, apply {total_ms - fill_ms:.2f} ms); "
        f"schema compiled in {compile_ms:.1f} ms"
    )
    return {
        "mask_rows": num_rows,
        "mask_ms_per_step": round(total_ms, 3),
        "mask_fill_ms": round(fill_ms, 3),
        "compile_ms": round(compile_ms, 1),
    }


def _throughput(engine: Engine, args: argparse.Namespace) -> Summary:
    n, max_tokens = args.num_requests, args.max_tokens
    workload = make_workload(engine.vocab_size, n, (32, 128), (max_tokens, max_tokens), args.seed)
    plain = GenerationConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    constrained = GenerationConfig(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, json_schema=json.dumps(SCHEMA)
    )
    mixed = [constrained if i % 2 == 0 else plain for i in range(n)]
    warm = make_workload(engine.vocab_size, 4, (8, 16), (4, 4), 1)
    run_headrace(engine, warm, "warm-up", configs=[constrained, plain] * 2)
    # The first full-size batch pays one-off costs (measured 4x slower): run it untimed.
    run_headrace(engine, workload, "warm-up", configs=[plain] * n)
    best: dict[str, float] = {"plain": 0.0, "constrained": 0.0}
    pair_ratios = []
    for _ in range(args.rounds):
        tok_s = {}
        for name, configs in (("plain", [plain] * n), ("constrained", mixed)):
            report = run_headrace(engine, workload, name, configs=configs)
            assert report.num_tokens == n * max_tokens, "a request finished early"
            print(report.describe())
            tok_s[name] = report.tokens_per_s
            best[name] = max(best[name], report.tokens_per_s)
        pair_ratios.append(tok_s["constrained"] / tok_s["plain"])
    ratio = statistics.median(pair_ratios)
    print(
        f"half JSON-constrained / unconstrained throughput: {ratio:.3f}x (median of the rounds' "
        f"back-to-back ratios {', '.join(f'{r:.2f}' for r in pair_ratios)}; best of each "
        f"{best['constrained'] / best['plain']:.3f}x)"
    )
    return {
        "plain_tok_s": round(best["plain"], 2),
        "constrained_tok_s": round(best["constrained"], 2),
        "ratio_constrained": round(ratio, 3),
        "ratio_constrained_best": round(best["constrained"] / best["plain"], 3),
    }
