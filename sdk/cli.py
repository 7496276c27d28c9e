"""The ``headrace`` command line (its commands: `USAGE`).

Each command group is one ``_add_*`` function in `COMMAND_GROUPS` that adds its subparser
and sets ``handler`` on its leaf commands; `worker`, `router`, `generate` and `up` are added
the same way. Handlers import worker or router modules themselves, so importing this module
(and the SDK) never loads torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from headrace.sdk import launch
from headrace.sdk.cli_help import DeprecatedAlias, HelpFormatter
from headrace.sdk.errors import HeadraceError
from headrace.sdk.generate import add_generate_command
from headrace.sdk.security import add_server_security_arguments, server_security
from headrace.sdk.streams import FlowLimits
from headrace.sdk.tool_formats import TOOL_CALL_FORMATS

USAGE = """headrace: serve LLMs over gRPC.

    headrace up                       a router and a worker on this machine (the default model)
    headrace generate "question"      stream an answer from a server to the terminal
    headrace worker --model M         serve a model over gRPC (needs headrace[worker])
    headrace router --workers A,B     schedule requests across workers (headrace[router])
    headrace up --num-workers N       a router and N workers on this machine
    headrace models list              known model names, whether prepared, and where
    headrace models prepare [NAME]    convert a known model into the cache (once)
    headrace bench BENCH              benchmarks: engine, parallel, serve, kernels

`headrace COMMAND --help` shows each command's options and their defaults.
"""

Handler = Callable[[argparse.Namespace], int]
# argparse's subparsers object; its class is private, so it is named once here.
SubParsers = argparse._SubParsersAction


#: The kernel sets ``--kernel-backend`` chooses: headrace.kernels.BACKEND_NAMES, spelled out
#: because this module never loads torch (tests/sdk/test_cli.py pins the two equal).
KERNEL_BACKENDS = ("auto", "triton", "cpu", "reference")
#: ``--quantization``'s choices: headrace.worker.config.QUANTIZATIONS, spelled out for the same
#: reason (and pinned equal by the same test).
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
#: ``--kv-cache-dtype``'s choices: headrace.kernels.kv_layout.KV_CACHE_DTYPES (pinned equal too).
KV_CACHE_DTYPES = ("auto", "int8")
#: ``--scheduling-policy``'s choices: headrace.worker.config.SCHEDULING_POLICIES (pinned equal).
SCHEDULING_POLICIES = ("fcfs", "shortest-first")


def add_kernel_backend_argument(parser: argparse.ArgumentParser) -> None:
    """``--kernel-backend`` (EngineConfig.kernel_backend), and its deprecated spelling
    ``--attention-backend``."""
    parser.add_argument(
        "--kernel-backend",
        default="auto",
        choices=KERNEL_BACKENDS,
        help="the kernels of the model and the sampler: auto = Triton on CUDA, C kernels built "
        "on this machine on CPU (torch's if no C compiler), reference = plain torch",
    )
    parser.add_argument(
        "--attention-backend",
        dest="kernel_backend",
        choices=KERNEL_BACKENDS,
        action=DeprecatedAlias,
        replaced_by="--kernel-backend",
    )


def add_scheduling_arguments(parser: argparse.ArgumentParser) -> None:
    """``--scheduling-policy`` and ``--shortest-first-window`` (EngineConfig's)."""
    parser.add_argument(
        "--scheduling-policy",
        default="shortest-first",
        choices=SCHEDULING_POLICIES,
        help="the order waiting requests of one priority start in: shortest-first = fewest "
        "tokens first, but none ahead of a request that arrived a window earlier; fcfs = by "
        "arrival",
    )
    parser.add_argument(
        "--shortest-first-window",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="shortest-first: a request goes ahead only of those that arrived less than this "
        "long before it (a request of n tokens counts as arriving window * n / "
        "max-model-len later)",
    )


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of every server (worker, router): where it listens, how it stops, and
    what it reports."""
    add = parser.add_argument
    add("--host", default="0.0.0.0", help="address to listen on")
    add("--port", type=int, default=50051, help="port to listen on; 0 picks a free one")
    add("--grace-period", type=float, default=30.0, help="seconds to finish requests on SIGTERM")
    add("--metrics-port", type=int, help="serve Prometheus /metrics on this port (0: a free one)")
    add(
        "--max-stream-backlog",
        type=int,
        default=64,
        help="unsent responses a stream may queue before its requests are held (flow control)",
    )
    add(
        "--slow-reader-timeout",
        type=float,
        default=60.0,
        help="seconds a held request waits for its reader before RESOURCE_EXHAUSTED",
    )
    add(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="info logs one line per finished request",
    )


def listen_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `ListenOptions` fields that `add_server_arguments`' and
    `add_server_security_arguments`' flags set (key and certificate files are read here)."""
    return {
        "host": args.host,
        "port": args.port,
        "grace_period_s": args.grace_period,
        "metrics_port": args.metrics_port,
        "flow": FlowLimits(args.max_stream_backlog, args.slow_reader_timeout),
        "security": server_security(args),
        "health_port": args.health_port,
    }


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _models_list(args: argparse.Namespace) -> int:
    from headrace.worker.models.families import FAMILIES, NOT_YET
    from headrace.worker.models.store import DEFAULT_MODEL, KNOWN_MODELS, is_prepared, model_dir

    rows = [("NAME", "PREPARED", "PATH")]
    for name in sorted(KNOWN_MODELS):
        path = model_dir(name)
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        rows.append((label, "yes" if is_prepared(path) else "no", str(path)))
    widths = [max(len(row[column]) for row in rows) for column in range(2)]
    for label, prepared, location in rows:
        print(f"{label:<{widths[0]}}  {prepared:<{widths[1]}}  {location}")
    print("\nMODEL_TYPE (a checkpoint's config.json)  RUNS")
    for model_type, runs in FAMILIES.items():
        print(f"{model_type:<40} {runs}")
    print(f"not yet: {NOT_YET}")
    return 0


def _models_prepare(args: argparse.Namespace) -> int:
    from headrace.worker.models.store import DEFAULT_MODEL, prepare_model

    print(prepare_model(args.name or DEFAULT_MODEL, force=args.force))
    return 0


def _add_models(subparsers: SubParsers) -> None:
    models = subparsers.add_parser(
        "models", help="list and prepare models", formatter_class=HelpFormatter
    )
    commands = models.add_subparsers(dest="models_command", metavar="COMMAND", required=True)
    listing = commands.add_parser("list", help="known model names, whether prepared, and where")
    listing.set_defaults(handler=_models_list)
    prepare = commands.add_parser("prepare", help="convert a known model into the cache, once")
    prepare.add_argument("name", nargs="?", help="a known model name (default: the default model)")
    prepare.add_argument("--force", action="store_true", help="prepare again even if done")
    prepare.set_defaults(handler=_models_prepare)


def _worker(args: argparse.Namespace) -> int:
    from headrace.worker.config import worker_engine_config
    from headrace.worker.serving.server import ServerOptions, run

    setup_logging(args.log_level)
    config = worker_engine_config(args)
    if config.nodes.node_rank > 0:  # runs only its ranks; node 0 serves
        from headrace.worker.serving.follower import run_follower

        return run_follower(config, args.host, args.health_port)
    options = ServerOptions(
        served_model_name=args.served_model_name,
        tool_call_parser=args.tool_call_parser,
        max_message_mib=args.max_message_mib,
        **listen_options(args),
    )
    return run(config, options)


WORKER_DESCRIPTION = """Load a model and serve the Generation, WorkerControl and GenerationControl
services (and gRPC health and reflection) on --host:--port.

    headrace worker                                   # the default model, prepared once
    headrace worker --model /path/to/hf-checkpoint --port 50051 --dtype bf16
    headrace worker --quantization gguf                # the default model's 4-bit GGUF as shipped
    headrace worker --model /path/model.gguf           # any Llama-family GGUF, as shipped
    headrace worker --model PATH -tp 2 -pp 2          # tensor x pipeline parallel ranks
    headrace worker --model PATH -tp 2 -pp 2 --nnodes 2 --node-rank 0 --dist-init-addr H:29500
    headrace worker --model PATH -tp 2 -pp 2 --nnodes 2 --node-rank 1 --dist-init-addr H:29500
    headrace worker --model PATH --lora sql=/adapters/sql --lora chat=/adapters/chat
"""


def _add_worker(subparsers: SubParsers) -> None:
    from headrace.worker.models.store import DEFAULT_MODEL

    worker = subparsers.add_parser(
        "worker",
        help="serve a model over gRPC",
        description=WORKER_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add = worker.add_argument
    add("--model", default=DEFAULT_MODEL, help="a local HF checkpoint folder or a known name")
    add("--served-model-name", help="the name clients use (default: --model as given)")
    add(
        "--dtype",
        default="auto",
        help="auto (the checkpoint's; float32 on CPUs without native bf16/fp16 math), "
        "float32/fp32, bfloat16/bf16 or float16/fp16",
    )
    add("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    add(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="how linear layers hold their weights: int8 (per output channel) or int4 (groups "
        "of 32) quantized as they load; gguf: a GGUF file's Q8_0/Q4_0/Q4_1 tensors as shipped "
        "(a .gguf --model, or a known model shipped as one); auto: gguf for a .gguf file, a "
        "compressed-tensors checkpoint's int4 / int8 layers as stored, else none",
    )
    add(
        "--int8-activations",
        action="store_true",
        help="quantized layers (and a quantized LM head) multiply activations quantized to "
        "int8 per block of 32, as llama.cpp does: faster on a CPU with VNNI, "
        "exact only to the activations' rounding (cpu and reference kernels)",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="how the KV cache stores K and V: auto (the model's dtype) or int8 (a float32 "
        "scale per token and head; about half of bf16's memory per token)",
    )
    add(
        "--tool-call-parser",
        choices=TOOL_CALL_FORMATS,
        help="the format the model writes tool calls in, for the router's OpenAI door "
        "(default: read from the chat template)",
    )
    add_server_arguments(worker)
    add_server_security_arguments(worker)
    _add_engine_arguments(worker)
    worker.set_defaults(handler=_worker)


def _add_engine_arguments(worker: argparse.ArgumentParser) -> None:
    """The engine's options: limits, KV cache, kernels, parallelism."""
    add = worker.add_argument
    add("--max-model-len", type=int, help="longest sequence (default: the model's context)")
    add("--max-num-seqs", type=int, default=256, help="most sequences running at once")
    add(
        "--max-num-batched-tokens",
        type=int,
        default=0,
        help="token budget of one step (default 0: 1024 on a CPU, 2048 on CUDA)",
    )
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
    add("--num-kv-blocks", type=int, help="KV-cache blocks (default: from the memory budget)")
    add("--kv-cache-gib", type=float, default=2.0, help="on CPU: GiB for the KV cache")
    add("--gpu-memory-utilization", type=float, default=0.9, help="on CUDA: fraction for KV")
    add("--no-prefix-caching", action="store_true", help="do not reuse cached prompt blocks")
    add_scheduling_arguments(worker)
    add("--seed", type=int, default=0, help="seed for requests that set none")
    add_kernel_backend_argument(worker)
    add(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks splitting every layer's heads and MLP (one process each)",
    )
    add(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="stages splitting the layers (tensor-parallel-size ranks each)",
    )
    add(
        "--enable-expert-parallel",
        action="store_true",
        help="mixture-of-experts layers give each tensor-parallel rank whole experts",
    )
    _add_node_arguments(worker)
    add(
        "--pipeline-micro-batches",
        type=int,
        default=1,
        help="micro-batches per step, so pipeline stages also overlap within a step",
    )
    add(
        "--overlap-steps",
        action="store_true",
        help="one rank: run steps on a device thread, two in flight over different sequences, "
        "so host work hides under device work (for GPUs; a loss on a small CPU)",
    )
    add(
        "--cpu-threads",
        type=int,
        default=0,
        help="on a CPU: threads per step (default 0: the CPUs the worker may use, within its "
        "cgroup quota, one fewer for each core other processes keep busy)",
    )
    add("--cpu-bind", default="", metavar="CPUS", help='on a CPU: pin the worker, e.g. "0-3,8"')
    add("--max-message-mib", type=int, default=16, help="largest gRPC message, in MiB")
    add(
        "--max-prompt-bytes",
        type=int,
        help="longest text prompt in UTF-8 bytes (default: the most that could fit the context)",
    )
    add("--weight-version", default="default", help="the version of the weights loaded at start")
    _add_speculative_arguments(worker)
    _add_lora_arguments(worker)


def _add_node_arguments(worker: argparse.ArgumentParser) -> None:
    """A worker whose ranks span nodes (SGLang's flag names; docs/parallelism.md)."""
    add = worker.add_argument
    add("--nnodes", type=int, default=1, help="nodes the worker's ranks run on")
    add(
        "--node-rank",
        type=int,
        default=0,
        help="this node: 0 serves gRPC and runs rank 0; others run only their ranks and "
        "serve health alone on --health-port",
    )
    add(
        "--dist-init-addr",
        metavar="HOST:PORT",
        help="where node 0 hosts the rendezvous (the same on every node; needed with --nnodes)",
    )
    add(
        "--ranks-per-node",
        type=int,
        help="ranks on each node (default: the worker's ranks split evenly over the nodes)",
    )
    add(
        "--node-timeout",
        type=float,
        default=5.0,
        help="seconds a node may go unheard before the worker ends (so the router fails over)",
    )


def _add_speculative_arguments(worker: argparse.ArgumentParser) -> None:
    add = worker.add_argument
    add(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding: tokens proposed per step by prompt lookup (the last "
        "n-gram matched earlier in the prompt and output), checked in one step; greedy and "
        "plain sampled requests speculate, their tokens unchanged (default 0: off)",
    )
    add(
        "--num-decode-steps",
        type=int,
        default=1,
        help="multi-step decode: tokens a step decodes per sequence when all running ones "
        "are plain greedy decodes and none waits, in one call to the model; tokens arrive "
        "that many at a time (default 1: off)",
    )
    add("--speculative-ngram-min", type=int, default=1, help="shortest n-gram matched")
    add("--speculative-ngram-max", type=int, default=4, help="longest n-gram matched")
    add(
        "--speculative-max-seqs",
        type=int,
        default=4,
        help="speculate only in steps with at most this many decoding sequences",
    )
    add(
        "--speculative-model",
        metavar="MODEL",
        help="a draft model proposes instead of prompt lookup: a checkpoint, known name or "
        ".gguf with the same tokenizer, run by this worker on a KV pool of its own",
    )
    add(
        "--speculative-quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="how the draft model holds its weights (as --quantization; gguf with this "
        "model's name: its shipped 4-bit file)",
    )


def _lora_module(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _add_lora_arguments(worker: argparse.ArgumentParser) -> None:
    add = worker.add_argument
    add(
        "--lora",
        type=_lora_module,
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter folder served as NAME (repeatable; turns LoRA on)",
    )
    add("--enable-lora", action="store_true", help="serve LoRA adapters loaded at run time")
    add("--max-loras", type=int, default=4, help="distinct LoRA adapters in one step")
    add("--max-lora-rank", type=int, default=16, help="highest LoRA rank accepted")
    add("--max-cpu-loras", type=int, help="adapters kept in host memory (default 4 x max-loras)")


def _add_router(subparsers: SubParsers) -> None:
    from headrace.router.cli import add_router_command

    add_router_command(subparsers)


def _add_up(subparsers: SubParsers) -> None:
    from headrace.router.cli import add_up_command

    add_up_command(subparsers)


def _add_bench(subparsers: SubParsers) -> None:
    from headrace.worker.bench.cli import add_bench_command

    add_bench_command(subparsers)


#: One entry per top-level command.
COMMAND_GROUPS: tuple[Callable[[SubParsers], None], ...] = (
    _add_models,
    _add_worker,
    _add_router,
    _add_up,
    add_generate_command,
    _add_bench,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headrace", description=USAGE, formatter_class=HelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add_group in COMMAND_GROUPS:
        add_group(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Started by `headrace up` (or a test): never outlive it.
    launch.die_with_parent(os.environ.get(launch.PARENT_ENV))
    args = build_parser().parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except HeadraceError as error:
        print(f"headrace: error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
