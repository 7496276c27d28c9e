"""``headrace bench parallel``: decode-step time of tensor- and pipeline-parallel workers,
every config in one run.

    headrace bench parallel --heads 8,4                          # TP=1 vs TP=2
    headrace bench parallel --heads 8,4 --configs 1x2/1,1x2/2    # PP steps in flight
    headrace bench parallel --configs 1x1,1x2:1,1x2:2            # micro-batches
    headrace bench parallel --tiny                               # overhead only
    headrace bench parallel --heads 8,4 --configs 2x2,2x2@2      # one node vs two
    headrace bench parallel --model-shape qwen3-moe --configs 1x1 --batch-size 24
    headrace bench parallel --model-shape qwen3-moe --heads 8,4 --configs 2x1,2x1+ep

SmolLM2-135M (the default model) has 9 query / 3 KV heads, which TP=2 cannot split:
``--heads 8,4`` times a random-weight model of its exact shape with 8 / 4 heads instead.

A config is TPxPP, optionally :M pipeline micro-batches (default 1), /S steps in flight
(default one per stage), @N nodes (default 1; node 0 is this process, each other node a
``headrace worker --node-rank`` process tree of its own on loopback) and +ep (a mixture's
experts spread whole over the TP ranks). Each config builds its
own engine, prefills the same batch of prompts, runs a few warm-up decode steps, then times
pure decode steps (every scheduled sequence decodes one token). With S steps in flight each
step holds about batch/S sequences, so compare tok/s across such configs, not step time. The
first config is the baseline: the others report their step time and tok/s relative to it,
and their greedy tokens must equal its tokens (on the tokens both produced), or the
comparison is between different computations.

Communication share: rank 0's time inside collectives and stage-to-stage transfers over the
step's wall time. It includes waiting for a slower peer; with PP, rank 0 (stage 0) waits for
the last stage's logits, so there it is mostly pipeline idle time, not wire time. Numbers are
this machine's and this run's: read the ratios, not the absolute values.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from headrace.sdk.config import GenerationConfig
from headrace.sdk.errors import HeadraceError, InvalidArgumentError
from headrace.worker.bench.cli import ParallelShape
from headrace.worker.bench.common import (
    TINY_MODEL,
    Summary,
    build_random_checkpoint,
    build_tiny_checkpoint,
    make_workload,
    quantile,
)
from headrace.worker.config import EngineConfig
from headrace.worker.distributed.executor import check_model_splits
from headrace.worker.distributed.nodes import NodeConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.engine.outputs import RequestOutput
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model


@dataclass(slots=True)
class ConfigResult:
    shape: ParallelShape
    #: Wall time of each timed decode step, seconds.
    step_s: list[float] = field(default_factory=list)
    #: Sequences each timed step decoded (fewer than the batch with steps in flight).
    num_seqs: list[int] = field(default_factory=list)
    #: Rank 0's communication time within each timed step, seconds.
    comm_s: list[float] = field(default_factory=list)
    #: Every request's greedy tokens up to the end of the timed steps, in request order.
    token_ids: list[list[int]] = field(default_factory=list)
    #: From adding the batch to each request's first token, seconds.
    ttft_s: list[float] = field(default_factory=list)

    @property
    def step_p50_s(self) -> float:
        return statistics.median(self.step_s)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.num_seqs) / sum(self.step_s)

    @property
    def comm_share_p50(self) -> float:
        return statistics.median(c / s for c, s in zip(self.comm_s, self.step_s, strict=True))


@dataclass(frozen=True, slots=True)
class RunSettings:
    """What every config shares: the model, the batch, and how many steps to time."""

    model_path: Path
    dtype: str
    #: How the linear layers hold their weights ("none", "int8", "int4").
    quantization: str
    prompts: list[list[int]]
    num_warmup_steps: int
    num_decode_steps: int
    max_num_batched_tokens: int
    #: Torch intra-op threads the process starts each config with (see `run_config`).
    num_threads: int


# --- one config -----------------------------------------------------------------------------


def engine_config(
    shape: ParallelShape, settings: RunSettings, rendezvous_port: int = 0
) -> EngineConfig:
    nodes = NodeConfig()
    if shape.nnodes > 1:
        address = f"127.0.0.1:{rendezvous_port or 29500}"
        nodes = NodeConfig(nnodes=shape.nnodes, dist_init_addr=address)
    return EngineConfig(
        model=str(settings.model_path),
        dtype=settings.dtype,
        quantization=settings.quantization,
        max_num_seqs=max(256, len(settings.prompts)),
        max_num_batched_tokens=settings.max_num_batched_tokens,
        tensor_parallel_size=shape.tensor_parallel_size,
        pipeline_parallel_size=shape.pipeline_parallel_size,
        enable_expert_parallel=shape.expert_parallel,
        pipeline_micro_batches=shape.micro_batches or 1,
        pipeline_steps_in_flight=shape.steps_in_flight,
        nodes=nodes,
    )


def check_configs(shapes: list[ParallelShape], settings: RunSettings, hf_config: Any) -> None:
    """Refuse, before any config runs, a split the model cannot take (the engine's message)."""
    for shape in shapes:
        config = engine_config(shape, settings)
        try:
            check_model_splits(config, hf_config, config.torch_device())
        except HeadraceError as exc:
            raise InvalidArgumentError("configs", f"{shape.label}: {exc}") from None


def run_config(shape: ParallelShape, settings: RunSettings) -> ConfigResult:
    # Building a multi-rank worker sets this process's threads to its share of the cores;
    # restore them so each config starts from the same machine, whatever ran before it.
    torch.set_num_threads(settings.num_threads)
    port = _free_port()
    nodes = [_start_node(shape, settings, port, node) for node in range(1, shape.nnodes)]
    try:
        engine = Engine(engine_config(shape, settings, port))
        try:
            return _measure(engine, shape, settings)
        finally:
            engine.close()
            torch.set_num_threads(settings.num_threads)
    finally:
        for process in nodes:
            try:
                process.wait(30)  # its ranks leave on the engine's stop plan
            except subprocess.TimeoutExpired:
                process.kill()


def _start_node(
    shape: ParallelShape, settings: RunSettings, port: int, node_rank: int
) -> subprocess.Popen[bytes]:
    """Node ``node_rank`` of the config's worker: ``headrace worker --node-rank R``, a process
    tree of its own meeting this one (node 0) on loopback."""
    command = [sys.executable, "-m", "headrace.sdk.cli", "worker"]
    command += ["--model", str(settings.model_path), "--dtype", settings.dtype]
    command += ["--quantization", settings.quantization]
    command += ["-tp", str(shape.tensor_parallel_size), "-pp", str(shape.pipeline_parallel_size)]
    command += ["--enable-expert-parallel"] if shape.expert_parallel else []
    command += ["--nnodes", str(shape.nnodes), "--node-rank", str(node_rank)]
    command += ["--dist-init-addr", f"127.0.0.1:{port}", "--log-level", "warning"]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _measure(engine: Engine, shape: ParallelShape, settings: RunSettings) -> ConfigResult:
    # Room for the decode steps plus the tokens a sequence samples while others still
    # prefill (one per step; each step's budget is shared with the decodes). The engine is
    # closed after timing, so unfinished requests cost nothing.
    batch_size = len(settings.prompts)
    num_prompt_tokens = sum(map(len, settings.prompts))
    budget = max(1, settings.max_num_batched_tokens - batch_size)
    num_prefill_steps = -(-num_prompt_tokens // budget) + 1
    max_tokens = settings.num_warmup_steps + settings.num_decode_steps + num_prefill_steps
    config = GenerationConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    request_ids = [f"bench-{i}" for i in range(batch_size)]
    for request_id, prompt in zip(request_ids, settings.prompts, strict=True):
        engine.add_request(request_id, prompt, config)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    start, first_token_s = time.perf_counter(), dict[str, float]()
    while not all(tokens.values()):  # a request's first token ends its prefill
        _record(engine.step(), tokens)
        for request_id, ids in tokens.items():
            if ids:
                first_token_s.setdefault(request_id, time.perf_counter() - start)
    for _ in range(settings.num_warmup_steps):
        _record(engine.step(), tokens)
    result = ConfigResult(shape, ttft_s=list(first_token_s.values()))
    comm_timer = engine.runner.parallel.comm_timer
    for _ in range(settings.num_decode_steps):
        comm_start, step_start = comm_timer.seconds, time.perf_counter()
        outputs = engine.step()
        result.step_s.append(time.perf_counter() - step_start)
        result.comm_s.append(comm_timer.seconds - comm_start)
        result.num_seqs.append(_check_pure_decode(engine))
        _record(outputs, tokens)
    result.token_ids = [tokens[request_id] for request_id in request_ids]
    return result


def _record(outputs: list[RequestOutput], tokens: dict[str, list[int]]) -> None:
    for output in outputs:
        if output.error is not None:
            raise RuntimeError(f"request {output.request_id} failed: {output.error}")
        for sample in output.samples:
            tokens[output.request_id].extend(sample.token_ids)


def _check_pure_decode(engine: Engine) -> int:
    """The sequences the step that `step()` just returned decoded; refuses any other step."""
    step = engine.last_step
    assert step is not None
    if not step.chunks or step.num_decode_seqs != len(step.chunks) or step.preempted:
        raise RuntimeError(
            f"a timed step was not a pure decode ({step.num_decode_seqs} decodes of "
            f"{len(step.chunks)} chunks, {len(step.preempted)} preempted): a request finished "
            f"or the KV pool is too small"
        )
    return len(step.chunks)


# --- report ---------------------------------------------------------------------------------


def format_table(results: list[ConfigResult]) -> str:
    baseline = results[0]
    header = (
        f"{'config':<9} {'TP':>2} {'PP':>2} {'M':>2} {'S':>2} {'seqs':>4}  {'p50 ms':>7} "
        f"{'mean ms':>7} {'tok/s':>7} {'comm p50':>8}  {'step/base':>9} {'tok/s/base':>10}  tokens"
    )
    return "\n".join([header, "-" * len(header)] + [_row(r, baseline) for r in results])


def _row(result: ConfigResult, baseline: ConfigResult) -> str:
    shape = result.shape
    pp = shape.pipeline_parallel_size
    micro = "-" if pp == 1 else str(shape.micro_batches or 1)
    in_flight = "-" if pp == 1 else str(shape.steps_in_flight or pp)
    return (
        f"{shape.label:<9} {shape.tensor_parallel_size:>2} {pp:>2} {micro:>2} {in_flight:>2} "
        f"{statistics.mean(result.num_seqs):4.0f}  {result.step_p50_s * 1e3:7.1f} "
        f"{statistics.mean(result.step_s) * 1e3:7.1f} {result.tokens_per_s:7.1f} "
        f"{result.comm_share_p50:8.1%}  {result.step_p50_s / baseline.step_p50_s:8.2f}x "
        f"{result.tokens_per_s / baseline.tokens_per_s:9.2f}x  "
        f"{_compare_tokens(result, baseline)}"
    )


def _compare_tokens(result: ConfigResult, baseline: ConfigResult) -> str:
    """Whether each request's greedy tokens equal the baseline's, over the tokens both made."""
    if result is baseline:
        return "baseline"
    pairs = list(zip(result.token_ids, baseline.token_ids, strict=True))
    num_compared = sum(min(len(ours), len(theirs)) for ours, theirs in pairs)
    differ = [i for i, (ours, theirs) in enumerate(pairs) if _first_difference(ours, theirs) >= 0]
    if not differ:
        return f"equal ({num_compared} tokens)"
    first = differ[0]
    return (
        f"DIFFER in {len(differ)}/{len(pairs)} requests "
        f"(first: request {first} at token {_first_difference(*pairs[first])})"
    )


def _first_difference(ours: list[int], theirs: list[int]) -> int:
    """Index of the first differing token over the common length, or -1."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), -1)


# --- main -----------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> None:
    for name in ("batch_size", "prompt_len", "decode_steps"):
        if getattr(args, name) < 1:
            raise InvalidArgumentError(name, f"--{name.replace('_', '-')} must be >= 1")
    if not args.configs:
        raise InvalidArgumentError("configs", "--configs names no config")


def smollm2_shaped(directory: Path, heads: tuple[int, int], source: Path) -> Path:
    """``source``'s shape (SmolLM2-135M: 30 layers, hidden 576) with other head counts.

    SmolLM2-135M has 9 query and 3 KV heads, which 2 ranks cannot split; this model has the
    same layers, widths and vocabulary, so a step does the same work, split 2 ways."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(source)
    num_heads, num_kv_heads = heads
    return build_random_checkpoint(
        directory,
        source,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=config.hidden_size // num_heads,
        tie_word_embeddings=config.tie_word_embeddings,
        rms_norm_eps=config.rms_norm_eps,
    )


#: ``--model-shape``: random-weight models for timing a mixture of experts against the dense
#: model with the same active parameters (a token's MLP reads 2 of 8 experts of 768: 1536).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-moe": {
        "model_type": "qwen3_moe",
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
    },
    "qwen3-dense": {"model_type": "qwen3", "intermediate_size": 2 * 768},
}
#: What both shapes share: SmolLM2-135M's width and vocabulary, 12 layers.
_SHAPE_COMMON = {
    "hidden_size": 576,
    "num_hidden_layers": 12,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "tie_word_embeddings": True,
}


def run(args: argparse.Namespace) -> Summary:
    _check_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        return _run(args, Path(tmp))


def _run(args: argparse.Namespace, tmp: Path) -> Summary:
    from transformers import AutoConfig

    if args.tiny:
        model_path = build_tiny_checkpoint(tmp, resolve_model(DEFAULT_MODEL))
    elif args.model_shape:
        shape = {**_SHAPE_COMMON, **MODEL_SHAPES[args.model_shape]}
        if args.heads:  # (so TP = 2 can split the shape's 9 / 3 heads)
            shape["num_attention_heads"], shape["num_key_value_heads"] = args.heads
        model_path = build_random_checkpoint(tmp, resolve_model(DEFAULT_MODEL), **shape)
    elif args.heads:
        model_path = smollm2_shaped(tmp, args.heads, Path(resolve_model(args.model)))
    else:
        model_path = resolve_model(args.model)
    hf_config = AutoConfig.from_pretrained(model_path)
    prompt_lens = (args.prompt_len, args.prompt_len)
    prompts = make_workload(
        int(hf_config.vocab_size), args.batch_size, prompt_lens, (1, 1), args.seed
    ).prompts
    settings = RunSettings(
        model_path=model_path,
        dtype=args.dtype,
        quantization=args.quantization,
        prompts=prompts,
        num_warmup_steps=args.warmup_steps,
        num_decode_steps=args.decode_steps,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads=torch.get_num_threads(),
    )
    check_configs(args.configs, settings, hf_config)
    model_name = TINY_MODEL if args.tiny else model_path.name
    if args.model_shape:
        model_name = f"{args.model_shape} shape, random weights"
    if args.heads:
        model_name = f"{args.model} shape, {args.heads[0]}/{args.heads[1]} heads, random weights"
    print(
        f"model {model_name}, dtype {args.dtype}, quantization {args.quantization}, "
        f"batch {args.batch_size} x prompt {args.prompt_len} tokens, {args.warmup_steps} "
        f"warm-up + {args.decode_steps} timed decode steps; cores {os.cpu_count()} "
        f"(usable {len(os.sched_getaffinity(0))}), "
        f"torch threads {settings.num_threads} (each of W ranks gets threads // W)"
    )
    results = []
    for shape in args.configs:
        start = time.perf_counter()
        results.append(run_config(shape, settings))
        print(f"  {shape.label}: done in {time.perf_counter() - start:.1f} s", flush=True)
    print(format_table(results))
    return _summary(results, model_name)


def _summary(results: list[ConfigResult], model_name: str) -> Summary:
    """The baseline's figures at the top level, every config's under ``configs``."""
    baseline = results[0]
    summary: Summary = {"bench": "parallel", "model": model_name}
    summary.update(_config_summary(baseline, baseline))
    summary["configs"] = [_config_summary(result, baseline) for result in results]
    return summary


def _config_summary(result: ConfigResult, baseline: ConfigResult) -> Summary:
    return {
        "config": result.shape.label,
        "tok_s": round(result.tokens_per_s, 2),
        "step_p50_ms": round(result.step_p50_s * 1e3, 3),
        "ttft_p50_ms": round(quantile(result.ttft_s, 0.5) * 1e3, 3),
        "ttft_p99_ms": round(quantile(result.ttft_s, 0.99) * 1e3, 3),
        "comm_share_p50": round(result.comm_share_p50, 4),
        "ratio_baseline_tok_s": round(result.tokens_per_s / baseline.tokens_per_s, 3),
        "tokens": _compare_tokens(result, baseline),
    }
