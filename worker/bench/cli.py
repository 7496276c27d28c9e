"""``headrace bench``: one subcommand per benchmark, each printing its figures and, with
``--json``, one JSON object as its last line.

The flags of every bench are defined here, torch-free, so ``headrace --help`` (and a
router-only install) never loads torch; each bench module's ``run(args) -> Summary`` is
imported only when its command runs.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass

from headrace.sdk.cli import (
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    add_kernel_backend_argument,
    add_scheduling_arguments,
)
from headrace.sdk.cli_help import HelpFormatter
from headrace.worker.models.store import DEFAULT_MODEL

ArgumentAdder = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True, slots=True)
class ParallelShape:
    """One config to measure: how the worker splits the model."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    #: Pipeline micro-batches per step; None takes the engine's default (1).
    micro_batches: int | None = None
    #: Pipeline steps in flight; None lets the engine pick (one per stage).
    steps_in_flight: int | None = None
    #: Nodes the ranks run on (each other node a process tree of its own, on loopback).
    nnodes: int = 1
    #: Mixture-of-experts layers spread whole experts over the TP ranks ("+ep").
    expert_parallel: bool = False

    @property
    def label(self) -> str:
        label = f"{self.tensor_parallel_size}x{self.pipeline_parallel_size}"
        label += "" if self.micro_batches is None else f":{self.micro_batches}"
        label += "" if self.steps_in_flight is None else f"/{self.steps_in_flight}"
        label += "" if self.nnodes == 1 else f"@{self.nnodes}"
        return label + ("+ep" if self.expert_parallel else "")


def parse_shape(text: str) -> ParallelShape:
    """``"2x1"``, ``"1x2:2"``, ``"1x2/1"``, ``"1x2:2/1"``, ``"2x2@2"`` or ``"2x1+ep"``
    (TPxPP[:M][/S][@N][+ep]) as a shape."""
    text, expert_parallel = text.strip().removesuffix("+ep"), text.strip().endswith("+ep")
    rest, _, nodes = text.partition("@")
    rest, _, in_flight = rest.partition("/")
    sizes, _, micro = rest.partition(":")
    tp, _, pp = sizes.partition("x")
    try:
        return ParallelShape(
            int(tp),
            int(pp),
            int(micro) if micro else None,
            int(in_flight) if in_flight else None,
            int(nodes) if nodes else 1,
            expert_parallel,
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"config {text!r} is not TPxPP[:M][/S][@N][+ep], "
            "e.g. 2x1, 1x2:2, 1x2:2/1, 2x2@2 or 2x1+ep"
        ) from None


def parse_shapes(text: str) -> list[ParallelShape]:
    return [parse_shape(part) for part in text.split(",") if part.strip()]


def parse_heads(text: str) -> tuple[int, int]:
    try:
        num_heads, num_kv_heads = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads {text!r} is not H,KV e.g. 8,4") from None
    return num_heads, num_kv_heads


def parse_lengths(text: str) -> tuple[int, int]:
    """``"16-64"`` (inclusive) or ``"64"`` as (low, high)."""
    low, _, high = text.partition("-")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not N or MIN-MAX") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return bounds


def parse_cpus(text: str) -> list[int]:
    """``"0-3"``, ``"0,2"`` or ``"0-1,4"`` as a list of CPU numbers."""
    from headrace.worker.execution.cpu_threads import parse_cpu_list  # torch: only when used

    try:
        return sorted(parse_cpu_list(text))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


@dataclass(frozen=True, slots=True)
class WorkloadPreset:
    """``bench engine --workload``: values for the workload flags (a flag given wins)."""

    num_requests: int
    prompt_lens: tuple[int, int]
    max_tokens: int
    #: What it is for, in --help.
    purpose: str

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(requests, shortest prompt, longest prompt, new tokens)."""
        return self.num_requests, *self.prompt_lens, self.max_tokens

    def describe(self) -> str:
        low, high = self.prompt_lens
        prompts = f"{low}" if low == high else f"{low}-{high}"
        requests = f"{self.num_requests} request" + ("s" if self.num_requests > 1 else "")
        return f"{requests}, prompts {prompts}, {self.max_tokens} new ({self.purpose})"


WORKLOADS = {
    "a": WorkloadPreset(24, (32, 256), 64, "a small mixed batch"),
    "b": WorkloadPreset(64, (32, 512), 128, "the default"),
    "c": WorkloadPreset(16, (128, 128), 128, "a batch for llama.cpp's parallel slots"),
    "d": WorkloadPreset(1, (128, 128), 256, "a single stream: also ms per token"),
}


# --- the flags of each bench -----------------------------------------------------------------


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="checkpoint folder or known name")
    add("--dtype", default="bfloat16", help="float32, bfloat16 or float16")
    add(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="how linear layers hold their weights (as the worker's flag)",
    )
    add(
        "--int8-activations",
        action="store_true",
        help="quantized layers multiply int8 activations (as the worker's flag)",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores K and V (as the worker's flag)",
    )
    add("--tiny", action="store_true", help="a 2-layer hidden-64 random model (overhead)")
    add("--num-requests", type=int, help="default: 64 (256 with --tiny)")
    add("--min-prompt-len", type=int, help="default: 32 (16 with --tiny)")
    add("--max-prompt-len", type=int, help="default: 512 (64 with --tiny)")
    add("--max-tokens", type=int, help="new tokens per request; default: 128 (64 with --tiny)")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="engine step token budget (default 0: the worker's, 1024 on a CPU, 2048 on CUDA)",
    )
    add(
        "--workload",
        choices=sorted(WORKLOADS),
        help="a preset of the four flags above (a flag given wins): "
        + "; ".join(f"{name} = {preset.describe()}" for name, preset in WORKLOADS.items()),
    )
    add(
        "--baseline",
        choices=["none", "hf", "vllm", "llama.cpp"],
        default="none",
        help="also run transformers (hf, in this process), or a peer engine in its own process "
        "and venv (vllm: vLLM's CPU backend; llama.cpp: llama-cpp-python; `make bench-peers` "
        "makes both): the same prompts, greedy, runs alternating with headrace's (--rounds, "
        "new prompts each round)",
    )
    peer_arguments(parser)
    add("--profile", action="store_true", help="split decode steps into phases")
    add(
        "--sampled",
        action="store_true",
        help="also run sampled (temperature 0.8, top_p 0.9, seeds): its step vs greedy's",
    )
    add(
        "--speculative",
        type=int,
        default=0,
        metavar="K",
        help="propose K tokens a step (n-gram speculation, the worker's "
        "--num-speculative-tokens) and also run the workload without it, rounds alternating "
        "(--rounds): tok/s ratio, proposals kept by position, same tokens",
    )
    add("--speculative-model", metavar="MODEL", help="with --speculative: a draft model proposes")
    add(
        "--speculative-max-seqs",
        type=int,
        default=4,
        help="with --speculative: speculate in steps of at most this many decoding sequences",
    )
    add(
        "--speculative-quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="the draft model's weights (as --quantization)",
    )
    add(
        "--num-decode-steps",
        type=int,
        default=1,
        metavar="K",
        help="multi-step decode (the worker's --num-decode-steps): K tokens a step per "
        "sequence when all running ones are plain greedy decodes; also runs the workload "
        "without it, rounds alternating (--rounds): tok/s ratio, step and host time per run",
    )
    add(
        "--prompts",
        choices=["random", "copy", "story"],
        default="random",
        help="random token ids; copy: a passage of the shipped text, then 'again, word for "
        "word' and its first words (the output copies it); story: a chat asking for a story "
        "(free text, little to copy); the last two set the prompt lengths",
    )
    add(
        "--overlap-steps",
        action="store_true",
        help="run the engine with overlap_steps (two steps in flight, a device thread)",
    )
    add(
        "--noisy-neighbour",
        action="store_true",
        help="also run beside a busy loop on one CPU: adaptive threads against quiet, one "
        "thread and a fixed count (median of --rounds)",
    )
    add(
        "--rounds",
        type=int,
        default=3,
        help="with --sampled: greedy and sampled runs alternate this many times; with a peer "
        "--baseline: headrace's and the peer's, each round on new prompts; with "
        "--noisy-neighbour: the quiet and noisy runs; each ratio is the median of the rounds' "
        "(a shared host's speed drifts between runs)",
    )
    add_kernel_backend_argument(parser)
    add_scheduling_arguments(parser)
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--seed", type=int, default=0, help="seed of the random prompts")


def parallel_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="checkpoint folder or known name")
    add("--dtype", default="float32", help="float32, bfloat16 or float16")
    add("--batch-size", type=int, default=16, help="concurrent decoding sequences")
    add("--prompt-len", type=int, default=64, help="tokens per prompt")
    add("--warmup-steps", type=int, default=3, help="decode steps not timed")
    add("--decode-steps", type=int, default=32, help="timed decode steps")
    add(
        "--quantization",
        default="none",
        choices=("none", "int8", "int4"),
        help="how linear layers hold their weights (as the worker's flag)",
    )
    configs_help = "TPxPP[:M][/S][@N][+ep],... first: base"
    add("--configs", type=parse_shapes, default="1x1,2x1", help=configs_help)
    add("--max-num-batched-tokens", type=int, default=2048, help="engine step token budget")
    add("--tiny", action="store_true", help="a 2-layer hidden-64 random model (overhead)")
    add(
        "--heads",
        type=parse_heads,
        help="H,KV: --model's (or --model-shape's) shape with these head counts and random "
        "weights (e.g. 8,4 so SmolLM2-135M's 9/3 heads split over TP=2)",
    )
    add(
        "--model-shape",
        choices=("qwen3-moe", "qwen3-dense"),
        help="a random-weight model instead of --model: Qwen3-MoE (8 experts, top 2) or the "
        "dense Qwen3 with its active parameters",
    )
    add("--seed", type=int, default=0, help="seed of the random prompts")


def peer_arguments(parser: argparse.ArgumentParser) -> None:
    """Where a peer baseline comes from and what it may use (engine and serve)."""
    add = parser.add_argument
    add(
        "--peer-python",
        metavar="PATH",
        help="the peer venv's python (default: the venv `make bench-peers` made under "
        "$HEADRACE_CACHE/peers, ~/.cache/headrace/peers)",
    )
    add(
        "--peer-cpus",
        type=parse_cpus,
        metavar="LIST",
        help="CPUs the peer's threads run on, e.g. 0-1 (default: all this process may use)",
    )
    add(
        "--peer-gguf",
        metavar="PATH",
        help="llama.cpp's model: a GGUF file, or 'shipped' for the quantized one the model's "
        "package ships (default: the GGUF of --dtype that `make bench-peers` converted)",
    )
    add("--peer-kv-cache-gib", type=int, default=4, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")


def serve_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--target", help="HOST:PORT of a running router or worker (default: start our own)")
    add("--num-requests", type=int, default=256, help="requests to send")
    add("--prompt-lens", type=parse_lengths, default=(16, 64), help="prompt tokens: N or MIN-MAX")
    add("--output-lens", type=parse_lengths, default=(64, 64), help="new tokens: N or MIN-MAX")
    add("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second")
    add("--max-concurrency", type=int, help="most requests in flight (default: no limit)")
    add("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")
    add(
        "--model",
        help="without --target: the worker's model (default: a tiny random one; with "
        f"--baseline, {DEFAULT_MODEL})",
    )
    add("--dtype", default="float32", help="without --target: the worker's dtype")
    add(
        "--worker-args",
        default="",
        metavar="FLAGS",
        help='without --target: more flags for the worker it starts, e.g. "--scheduling-policy '
        'fcfs" (after its own, so they win; the in-process engine takes them too, and a '
        "--baseline peer the limits they make)",
    )
    add("--rounds", type=int, default=3, help="without --target: rounds of each path")
    add(
        "--api",
        choices=("grpc", "openai"),
        default="grpc",
        help="openai: streamed /v1/completions through the router's OpenAI door (without "
        "--target, compared with the router's gRPC; with it, at --http-target)",
    )
    add(
        "--http-target",
        help="--api openai with --target: the door's HOST:PORT (default: --target's host, "
        "port 8000)",
    )
    add(
        "--priority-burst",
        type=int,
        default=0,
        metavar="N",
        help="with --target: N priority-10 requests mid-load, their TTFT reported apart",
    )
    add("--burst-delay", type=float, default=1.0, help="seconds into the load of the burst")
    add(
        "--baseline",
        choices=["none", "vllm", "llama.cpp"],
        default="none",
        help="also start a peer's OpenAI server (vllm: `vllm serve`; llama.cpp: llama-server; "
        "`make bench-peers` makes both) and load it and headrace's OpenAI door in turns, "
        "--rounds pairs, the same prompts in a pair and new ones each round (without --target "
        "headrace starts as `headrace up` does, the model --model or the default one; with it, "
        "the door at --http-target is loaded, and the peer gets a default worker's limits)",
    )
    peer_arguments(parser)
    add(
        "--peer-server",
        metavar="PATH",
        help="llama.cpp's llama-server (default: the one `make bench-peers` built under "
        "$HEADRACE_CACHE/peers)",
    )
    add(
        "--peer-start-timeout",
        type=float,
        default=900.0,
        help="seconds the peer's server may take to come up (vLLM compiles its model)",
    )


def weights_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="checkpoint folder or known name")
    add("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    add("--rounds", type=int, default=3, help="updates per path (the best one counts)")
    add("--chunk-mib", type=int, default=4, help="MiB per streamed message")


def lora_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="checkpoint folder or known name")
    add("--tiny", action="store_true", help="a 2-layer hidden-64 random model (overhead)")
    add("--dtype", default="float32", help="float32, bfloat16 or float16")
    add("--num-adapters", type=int, default=4, help="random adapters, all in every step")
    add("--rank", type=int, default=16, help="their rank")
    add("--num-requests", type=int, default=32, help="requests per run")
    add("--prompt-len", type=int, default=32, help="tokens per prompt")
    add("--max-tokens", type=int, default=64, help="new tokens per request")
    add("--max-num-batched-tokens", type=int, default=2048, help="engine step token budget")
    add("--rounds", type=int, default=2, help="alternating rounds of each run (best counts)")


def structured_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="checkpoint folder or known name")
    add("--dtype", default="float32", help="float32, bfloat16 or float16")
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add("--mask-rows", type=int, default=64, help="constrained rows of the mask-cost step")
    add("--mask-iters", type=int, default=20, help="mask-cost steps timed (the median counts)")
    add("--num-requests", type=int, default=64, help="requests of the throughput batch")
    add("--max-tokens", type=int, default=64, help="new tokens per request")
    add("--rounds", type=int, default=2, help="runs of each batch (the best counts)")
    add("--seed", type=int, default=0, help="seed of the random prompts")


def quality_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--model", default=DEFAULT_MODEL, help="checkpoint folder or known name")
    add(
        "--quantization",
        default="none,int8,int4,gguf,gguf+a8,none/int8,int4/int8",
        help="configurations, QUANT[+a8][:DTYPE][/KV] each (QUANT none, int8, int4, gguf; +a8: "
        "int8 activations; KV the KV cache's dtype, auto or int8); the first is the baseline",
    )
    add("--dtype", default="float32", help="dtype of the configurations without :DTYPE")
    add("--window", type=int, default=512, help="tokens per perplexity window (stride too)")
    add("--max-windows", type=int, help="score only the first N windows (default: all)")
    add("--prompts", type=int, default=64, help="greedy-agreement prompts (32 tokens each)")
    add("--new-tokens", type=int, default=64, help="greedy tokens per prompt")


def kernels_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--batch", type=int, default=64, help="sequences per decode batch")
    add("--contexts", type=int, nargs="+", default=[2048, 4096, 8192], help="context lengths")


#: What the figures mean, in every bench's --help.
FIGURES = """
Figures: tok/s = generated tokens over the run's wall time (prefill included); TTFT = a
request's arrival (or, for serve, its send) to its first token; ITL = the time between a
request's successive chunks; decode step = an engine step in which every scheduled sequence
decoded one token; host overhead = a decode step's time minus the time in the model's forward
and LM head (or its one call for both), i.e. the engine's own Python per step (scheduling,
building the batch, sampling, detokenizing). p50 / p99 are percentiles over requests or
steps. --json prints them as one JSON object on the last line, with one ratio_* key per
baseline run in the same command (in this process, or a peer engine's process taking turns
with it).
"""


#: What ``bench quality``'s figures mean.
QUALITY_FIGURES = """
Figures: perplexity = exp(mean negative log-likelihood) of the text's tokens, in windows of
--window tokens each scored by the engine's prompt logprobs; ratio = over the first
configuration's; agreement = the share of greedy tokens equal to the first configuration's
before the first that differs, averaged over prompts; identical = the share of prompts whose
greedy tokens all equal; threshold = pass or FAIL of int8 (+1%) and int4 (+5%) against a
none baseline. --json prints them as one JSON object on the last line.
"""


@dataclass(frozen=True, slots=True)
class BenchCommand:
    name: str
    help: str
    arguments: ArgumentAdder
    #: The module whose ``run(args) -> Summary`` runs the bench.
    module: str
    #: What its figures mean, after its help in --help.
    figures: str = FIGURES


BENCHES = (
    BenchCommand(
        "engine",
        "in-process engine: tok/s, TTFT, decode step and host overhead (--baseline hf, vllm, "
        "llama.cpp)",
        engine_arguments,
        "headrace.worker.bench.engine",
    ),
    BenchCommand(
        "parallel",
        "tensor/pipeline-parallel decode steps against the first config, comm share",
        parallel_arguments,
        "headrace.worker.bench.parallel",
    ),
    BenchCommand(
        "serve",
        "load against a router or worker (--target HOST:PORT), or what gRPC and the router cost",
        serve_arguments,
        "headrace.worker.bench.serve",
    ),
    BenchCommand(
        "weights",
        "a live weight update from disk and from streamed tensors, against loading the model",
        weights_arguments,
        "headrace.worker.bench.weights",
    ),
    BenchCommand(
        "lora",
        "a batch mixing LoRA adapters against the base model alone: tok/s and their ratio",
        lora_arguments,
        "headrace.worker.bench.lora",
    ),
    BenchCommand(
        "structured",
        "output constraints: JSON-schema mask cost per step, throughput against none",
        structured_arguments,
        "headrace.worker.bench.structured",
    ),
    BenchCommand(
        "quality",
        "quantization's accuracy: perplexity on a shipped text and greedy agreement against "
        "the first configuration",
        quality_arguments,
        "headrace.worker.bench.quality",
        QUALITY_FIGURES,
    ),
    BenchCommand(
        "kernels",
        "CUDA: each Triton kernel against SDPA or its torch reference, with bandwidth",
        kernels_arguments,
        "headrace.kernels.bench",
    ),
)


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: engine, parallel, serve, weights, lora, structured, quality, kernels",
        description="Benchmarks. Each prints its figures and ratios against a baseline run in "
        "the same process (read the ratios: these machines are noisy); --json adds one JSON "
        "object as the last line. See each bench's --help for what its figures mean.",
    )
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for spec in BENCHES:
        parser = commands.add_parser(
            spec.name,
            help=spec.help,
            description=spec.help + "\n" + spec.figures,
            formatter_class=HelpFormatter,
        )
        spec.arguments(parser)
        parser.add_argument("--json", action="store_true", help="print one JSON object last")
        parser.set_defaults(handler=_runner(spec.module))


def _runner(module_name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        summary = importlib.import_module(module_name).run(args)
        if args.json:
            print(json.dumps(summary), flush=True)
        return 0

    return run
