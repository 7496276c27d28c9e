"""``headrace bench engine``: the in-process engine's throughput, TTFT and per-step cost.

    headrace bench engine                      # SmolLM2-135M, 64 requests, 32-512 + 128 tokens
    headrace bench engine --baseline hf        # plus transformers' two modes, same workload
    headrace bench engine --tiny               # a tiny model: what the engine itself costs
    headrace bench engine --tiny --profile     # where a decode step's time goes, by phase
    headrace bench engine --tiny --sampled     # plus the same run sampled: its step vs greedy's
    headrace bench engine --workload d --dtype float32 --baseline vllm   # against vLLM's CPU
    headrace bench engine --workload c --dtype float32 --baseline llama.cpp

Every request runs to its output length (greedy, ignore_eos; with ``--sampled`` a second run
samples every request at temperature 0.8, top_p 0.9 with a seed of its own). Figures:

- tok/s: generated tokens over the run's wall time (prefill included);
- TTFT: from the run's start (all requests arrive at once) to each request's first token;
- decode step: wall time of steps in which every scheduled sequence decoded one token (with
  ``--num-decode-steps`` a step's time over its runs: per token of each sequence);
- host overhead: a decode step's time minus the time spent in the model's forward and LM head
  (or in its one call for both, `decode_greedy_runs`), i.e. what the engine's own Python costs
  per step (schedule, build the batch, sample, detokenize, outputs). The tiny model makes the
  forward cheap, so this is most of its step.

With ``--baseline hf`` each transformers mode runs the same prompts and output length, and
``ratio_hf_generate`` / ``ratio_hf_generate_batch`` are headrace's tok/s over theirs.
With ``--baseline vllm`` or ``llama.cpp`` the peer engine runs in a process and venv of its own
(`headrace.worker.bench.peers`), its runs alternating with headrace's, each started once the
CPUs are quiet (an engine's process may go on working after its run): ``ratio_vllm`` /
``ratio_llama_cpp`` is the median pair's headrace tok/s over the peer's, and ``*_agreement``
the fraction of requests whose greedy tokens are identical in every pair.
``ratio_sampled_greedy_step`` is the sampled run's decode step p50 over the greedy run's: the
median of ``--rounds`` alternating (greedy, sampled) pairs, as the host's speed drifts.
``--profile`` splits the decode steps into phases (`headrace.worker.bench.profile`).
``--noisy-neighbour`` runs it beside a busy loop on one CPU (`headrace.worker.bench.neighbour`).
``--speculative K`` and ``--num-decode-steps K`` also run the workload with the feature off,
rounds alternating (`headrace.worker.bench.speculative`, `headrace.worker.bench.multi_step`).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from headrace.sdk.config import GenerationConfig
from headrace.worker.bench.bandwidth import ReadsBeside, read_buffer, read_once, weight_bytes
from headrace.worker.bench.cli import WORKLOADS
from headrace.worker.bench.common import (
    TINY_MODEL,
    Report,
    Summary,
    Workload,
    build_tiny_checkpoint,
    make_workload,
    quantile,
)
from headrace.worker.bench.hf import load_hf_model, run_hf_generate, run_hf_generate_batch
from headrace.worker.bench.multi_step import compare_decode_steps
from headrace.worker.bench.neighbour import run_noisy_neighbour
from headrace.worker.bench.peers import (
    PEER_VENVS,
    PeerSetup,
    compare_with_peer,
    default_peer_python,
    peer_model,
    require_peer_python,
    start_peer,
)
from headrace.worker.bench.profile import StepProfile
from headrace.worker.bench.speculative import compare_speculation, text_workload
from headrace.worker.config import EngineConfig
from headrace.worker.engine.engine import Engine
from headrace.worker.execution.host_memory import quiet_collector
from headrace.worker.execution.kv_cache import kv_block_bytes
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model


class _TimedModel:
    """Wraps the model to add up time spent in forward and the LM head during a step (or in
    the one call that runs both)."""

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

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._timed(self._model.compute_logits, hidden, out)

    def compute_greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._timed(self._model.compute_greedy, hidden)

    def decode_greedy_runs(self, *args: Any) -> list[list[int]] | None:
        return self._timed(self._model.decode_greedy_runs, *args)


def request_config(max_tokens: int, sampled: bool, index: int) -> GenerationConfig:
    if sampled:
        return GenerationConfig(
            max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=index, ignore_eos=True
        )
    return GenerationConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_headrace(
    engine: Engine,
    workload: Workload,
    name: str = "headrace",
    sampled: bool = False,
    profile: StepProfile | None = None,
    configs: list[GenerationConfig] | None = None,
    after_step: Callable[[float, bool], None] | None = None,
) -> Report:
    """Run the workload to completion; ``configs``: one per request (default:
    `request_config`'s); ``after_step(seconds, is_decode)``: called after each step, outside
    its time and the run's."""
    timed = _TimedModel(engine.runner.model, engine.device)
    engine.runner.model = timed  # type: ignore[assignment]
    start = time.perf_counter()
    for i, (prompt, max_tokens) in enumerate(
        zip(workload.prompts, workload.max_tokens, strict=True)
    ):
        config = configs[i] if configs else request_config(max_tokens, sampled, i)
        engine.add_request(f"bench-{i}", prompt, config)
    report = Report(name, 0.0, 0)
    first_token: dict[str, float] = {}
    tokens: dict[str, list[int]] = {f"bench-{i}": [] for i in range(len(workload.prompts))}
    while engine.has_unfinished_requests():
        timed.seconds = 0.0
        if profile is not None:
            profile.start_step()
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        report.num_tokens += sum(len(d.token_ids) for o in outputs for d in o.samples)
        if failed := next((o for o in outputs if o.error is not None), None):
            raise RuntimeError(f"bench request {failed.request_id} failed: {failed.error}")
        for output in outputs:
            first_token.setdefault(output.request_id, now - start)
            tokens[output.request_id].extend(t for d in output.samples for t in d.token_ids)
        plan = engine.last_step
        # Every scheduled sequence decoded: a pure decode step, of num_runs one-row runs
        # (multi-step decode); its times count per run, a token of each sequence.
        is_decode = plan is not None and plan.chunks and plan.num_decode_seqs == len(plan.chunks)
        num_runs = plan.chunks[0].num_decode_steps if plan is not None and is_decode else 1
        step_s = (now - step_start) / num_runs
        if is_decode:
            report.decode_step_s.append(step_s)
            report.host_overhead_s.append(step_s - timed.seconds / num_runs)
        if profile is not None:
            profile.end_step(now - step_start, bool(is_decode))
        if after_step is not None:
            paused = time.perf_counter()
            after_step(step_s, bool(is_decode))
            start += time.perf_counter() - paused
    report.seconds = time.perf_counter() - start
    report.ttft_s = list(first_token.values())
    report.token_ids = list(tokens.values())
    engine.runner.model = timed._model
    return report


def run(args: argparse.Namespace) -> Summary:
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            model_path, model_name = (
                build_tiny_checkpoint(Path(tmp), resolve_model(DEFAULT_MODEL)),
                TINY_MODEL,
            )
        else:
            model_path = resolve_model(args.model)
            model_name = model_path.name
        return _run(args, model_path, model_name)


def _workload_shape(args: argparse.Namespace) -> tuple[int, tuple[int, int], int]:
    """(requests, prompt lengths, new tokens): each flag given, else ``--workload``'s preset,
    else the default (`--tiny`'s own)."""
    if args.workload is not None:
        defaults = WORKLOADS[args.workload].shape
    else:
        defaults = (256, 16, 64, 64) if args.tiny else WORKLOADS["b"].shape
    num_requests, min_len, max_len, max_tokens = (
        value if value is not None else default
        for value, default in zip(
            (args.num_requests, args.min_prompt_len, args.max_prompt_len, args.max_tokens),
            defaults,
            strict=True,
        )
    )
    return num_requests, (min_len, max_len), max_tokens


def _kv_cache_summary(engine: Engine, kv_cache_dtype: str) -> Summary:
    """The KV cache's dtype, size and what a token of context costs in it, and how often the
    run ran out of it (preemptions)."""
    runner = engine.runner
    block_bytes = kv_block_bytes(runner.model, runner.block_size, runner.kv_cache_dtype)
    summary: Summary = {
        "kv_cache_dtype": kv_cache_dtype,
        "kv_blocks": engine.block_manager.num_blocks,
        "kv_bytes_per_token": block_bytes // runner.block_size,
        "preemptions": engine.scheduler.num_preemptions,
    }
    print("  KV cache: " + ", ".join(f"{key} {value}" for key, value in summary.items()))
    return summary


def _run(args: argparse.Namespace, model_path: Path, model_name: str) -> Summary:
    num_requests, prompt_lens, max_tokens = _workload_shape(args)
    config = EngineConfig(
        # a GGUF as shipped is found by the model's name (the prepared folder holds floats)
        model=args.model if args.quantization == "gguf" else str(model_path),
        dtype=args.dtype,
        quantization=args.quantization,
        int8_activations=args.int8_activations,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_num_seqs=max(256, num_requests),
        max_num_batched_tokens=args.max_num_batched_tokens,
        kernel_backend=args.kernel_backend,
        overlap_steps=args.overlap_steps,
        scheduling_policy=args.scheduling_policy,
        shortest_first_window_s=args.shortest_first_window,
        num_speculative_tokens=args.speculative,
        speculative_model=args.speculative_model,
        speculative_max_seqs=args.speculative_max_seqs,
        speculative_quantization=args.speculative_quantization,
        num_decode_steps=args.num_decode_steps,
    )
    engine = Engine(config)

    def workload_of(seed: int) -> Workload:
        if args.prompts == "random":
            return make_workload(
                engine.vocab_size, num_requests, prompt_lens, (max_tokens, max_tokens), seed
            )
        return text_workload(args.prompts, engine.tokenizer, num_requests, max_tokens, seed)

    workload = workload_of(args.seed)
    if args.prompts != "random":
        lengths = [len(p) for p in workload.prompts]
        prompt_lens = (min(lengths), max(lengths))
    print(
        f"workload: {num_requests} {args.prompts} requests, prompts "
        f"{prompt_lens[0]}-{prompt_lens[1]} tokens, {max_tokens} new tokens; model "
        f"{model_name}, dtype {args.dtype}, device {engine.device}, kernels "
        f"{engine.kernels.NAME}, threads {torch.get_num_threads()}"
    )
    peer = None
    peer_rounds: list[Workload] = []
    if args.baseline in PEER_VENVS:
        # new prompts each round: both engines' prefix caches would skip a repeated prefill
        peer_rounds = [workload] + [workload_of(args.seed + r) for r in range(1, args.rounds)]
        peer = _peer_setup(args, model_path, model_name, engine, peer_rounds)
    warm_up = make_workload(engine.vocab_size, 4, (8, 16), (4, 4), 1)
    for sampled in {False, args.sampled}:
        run_headrace(engine, warm_up, "warm-up", sampled=sampled)
    quiet_collector()  # as a worker does
    profile = StepProfile() if args.profile else None
    if profile is not None:
        profile.attach(engine)
    ours = run_headrace(engine, workload, profile=profile)
    print(ours.describe())
    print("  (host overhead: a decode step's time minus the model's forward and LM head)")
    summary: Summary = {"bench": "engine", "model": model_name, "dtype": args.dtype}
    summary.update(ours.summary())
    summary.update(_kv_cache_summary(engine, args.kv_cache_dtype))
    if profile is not None:
        print(profile.describe())
        summary.update(profile.summary())
        profile.detach()
    if num_requests == 1 and ours.decode_step_s and engine.device.type == "cpu":
        summary.update(_read_beside_steps(engine, workload))
    if args.sampled:
        summary.update(_run_sampled(engine, workload, ours, args.profile, args.rounds))
    if args.speculative:
        summary.update(compare_speculation(config, engine, workload, args.rounds, run_headrace))
    if args.num_decode_steps > 1:
        summary.update(compare_decode_steps(engine, workload, args.rounds, run_headrace))
    if args.baseline == "hf":
        summary.update(_run_baselines(model_path, engine, workload, ours))
    elif peer is not None:
        summary.update(_run_peer(*peer, engine, peer_rounds, ours))
    engine.close()
    if args.noisy_neighbour:
        summary.update(run_noisy_neighbour(config, workload, args.rounds))
    return summary


def _read_beside_steps(engine: Engine, workload: Workload) -> Summary:
    """The single stream again, each decode step followed by a read of a buffer in memory
    (`ReadsBeside`): the step against the weights' read at the memory's rate of that moment."""
    buffer = read_buffer()
    reads = ReadsBeside(weight_bytes(engine.runner.model), lambda: read_once(buffer))
    run_headrace(engine, workload, "beside reads", after_step=reads.after_step)
    return reads.summary()


def _run_sampled(
    engine: Engine, workload: Workload, greedy: Report, profiled: bool, rounds: int
) -> Summary:
    """The workload again, sampled (profiled as the greedy run was, so their steps compare),
    then ``rounds - 1`` more (greedy, sampled) pairs: each round's ratio sets its sampled
    decode step p50 against the greedy run just before it, and the median round is reported."""
    profile = StepProfile() if profiled else None
    if profile is not None:
        profile.attach(engine)
    sampled = run_headrace(engine, workload, "headrace sampled", sampled=True, profile=profile)
    print(sampled.describe())
    out: Summary = {f"sampled_{key}": value for key, value in sampled.summary().items()}
    if profile is not None:
        print(profile.describe())
        out.update({f"sampled_{key}": value for key, value in profile.summary().items()})
        profile.detach()
    ratios = [_step_ratio(sampled, greedy)]
    for _ in range(rounds - 1):
        greedy = run_headrace(engine, workload)
        ratios.append(_step_ratio(run_headrace(engine, workload, sampled=True), greedy))
    ratio = quantile(ratios, 0.5)
    rounds_text = ", ".join(f"{r:.2f}" for r in ratios)
    print(f"  sampled decode step / greedy decode step (p50): {ratio:.2f}x (rounds: {rounds_text})")
    out["ratio_sampled_greedy_step"] = round(ratio, 3)
    out["ratio_sampled_greedy_step_rounds"] = [round(r, 3) for r in ratios]
    return out


def _step_ratio(sampled: Report, greedy: Report) -> float:
    return quantile(sampled.decode_step_s, 0.5) / quantile(greedy.decode_step_s, 0.5)


def _run_baselines(model_path: Path, engine: Engine, workload: Workload, ours: Report) -> Summary:
    model = load_hf_model(model_path, engine.spec.dtype)
    pad_id = engine.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else min(engine.eos_token_ids, default=0)
    run_hf_generate(model, make_workload(engine.vocab_size, 2, (8, 16), (4, 4), 1), pad_id)
    reports = {
        "ratio_hf_generate": run_hf_generate(model, workload, pad_id),
        "ratio_hf_generate_batch": run_hf_generate_batch(model, workload),
    }
    ratios: Summary = {}
    for key, report in reports.items():
        ratios[key] = round(ours.tokens_per_s / report.tokens_per_s, 3)
        print(report.describe())
        print(f"  headrace / {report.name}: {ratios[key]:.2f}x")
    best = max(reports.values(), key=lambda r: r.tokens_per_s)
    print(
        f"headrace vs the better baseline ({best.name}): "
        f"{ours.tokens_per_s / best.tokens_per_s:.2f}x"
    )
    return ratios


def _peer_setup(
    args: argparse.Namespace,
    model_path: Path,
    model_name: str,
    engine: Engine,
    workloads: list[Workload],
) -> tuple[Path, PeerSetup]:
    """The peer's python and setup, checked before headrace's runs (which may be long)."""
    prompts = [prompt for workload in workloads for prompt in workload.prompts]
    peer = args.baseline
    setup = PeerSetup(
        peer=peer,
        model=peer_model(peer, model_path, model_name, args.dtype, args.peer_gguf),
        dtype=args.dtype,
        cpus=tuple(args.peer_cpus or sorted(os.sched_getaffinity(0))),
        # llama.cpp keeps a KV sequence of max_model_len per slot: as many as requests.
        max_num_seqs=engine.config.max_num_seqs if peer == "vllm" else len(workloads[0].prompts),
        max_num_batched_tokens=engine.config.max_num_batched_tokens,
        max_model_len=max(map(len, prompts)) + max(workloads[0].max_tokens),
        kv_cache_gib=args.peer_kv_cache_gib,
    )
    python = Path(args.peer_python) if args.peer_python else default_peer_python(peer)
    require_peer_python(python, peer)
    return python, setup


def _run_peer(
    python: Path, setup: PeerSetup, engine: Engine, workloads: list[Workload], ours: Report
) -> Summary:
    """``ours`` (on ``workloads[0]``) and a headrace run on each further workload, each
    followed by the peer's on the same prompts."""
    with start_peer(python, setup) as process:
        print(
            f"peer: {process.describe()}, {setup.model}, CPUs {list(setup.cpus)}; loaded in "
            f"{process.info.get('load_s', 0):.1f} s (headrace: {torch.get_num_threads()} threads)"
        )
        key = setup.peer.replace(".", "_")
        paired = compare_with_peer(
            process, key, workloads, ours, lambda workload: run_headrace(engine, workload)
        )
    print(paired.describe())
    return paired.summary()
