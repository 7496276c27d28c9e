"""``headrace router`` and ``headrace up`` (added to the `headrace` command in sdk/cli.py)."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import signal
import sys
import threading
from pathlib import Path

from headrace.router.config import POLICIES, RouterConfig
from headrace.sdk.cli import add_server_arguments, listen_options, setup_logging
from headrace.sdk.cli_help import HelpFormatter
from headrace.sdk.credentials import ClientSecurity, read_api_key
from headrace.sdk.security import add_server_security_arguments
from headrace.sdk.tls import ClientTls


def add_router_command(subparsers: argparse._SubParsersAction) -> None:
    router = subparsers.add_parser(
        "router",
        help="serve Generation in front of workers",
        description="Schedule requests by priority across workers, with failover.",
        formatter_class=HelpFormatter,
    )
    workers = router.add_mutually_exclusive_group(required=True)
    workers.add_argument("--workers", help="comma-separated HOST:PORT of the workers")
    workers.add_argument("--workers-dns", help="NAME:PORT whose addresses are the workers")
    add_router_options(router)
    add_server_security_arguments(router)
    add_worker_link_arguments(router)
    router.set_defaults(handler=_router)


def add_worker_link_arguments(parser: argparse.ArgumentParser) -> None:
    """How the router reaches workers that serve TLS or want a key (`worker_security`)."""
    add = parser.add_argument
    add("--worker-tls-ca", metavar="PEM", help="talk TLS to workers; trust this CA")
    add("--worker-tls-cert", metavar="PEM", help="mTLS: the certificate to show workers")
    add("--worker-tls-key", metavar="PEM", help="the private key of --worker-tls-cert")
    add(
        "--worker-tls-server-name",
        metavar="NAME",
        help="the name on the workers' certificates (the router dials their IPs)",
    )
    add("--worker-api-key-file", metavar="FILE", help="send workers the key in this file")


def worker_security(args: argparse.Namespace) -> ClientSecurity:
    """TLS to workers if any --worker-tls-* flag is given (no CA: the system's); key files
    are read now, once."""
    files = (args.worker_tls_ca, args.worker_tls_cert, args.worker_tls_key)
    tls = None
    if any(files) or args.worker_tls_server_name:
        ca, cert, key = (Path(path) if path else None for path in files)
        tls = ClientTls(ca, cert, key, args.worker_tls_server_name)
    api_key = None
    if args.worker_api_key_file:
        api_key = read_api_key(args.worker_api_key_file, "worker_api_key_file")
    return ClientSecurity(tls, api_key)


def add_router_options(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser)
    add = parser.add_argument
    add("--policy", choices=POLICIES, default="least-loaded", help="how to pick a worker")
    add("--max-inflight-per-worker", type=int, default=256, help="requests a worker holds at once")
    add("--max-queued-requests", type=int, default=4096, help="then RESOURCE_EXHAUSTED")
    add("--max-queued-tokens", type=int, default=4_000_000, help="then RESOURCE_EXHAUSTED")
    add("--aging", type=float, default=1.0, help="priority a waiting request gains per second")
    add(
        "--http-port",
        type=int,
        metavar="PORT",
        help="also serve the OpenAI-compatible HTTP API here (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health; 0: a free port)",
    )


def router_config(args: argparse.Namespace, workers: list[str] | None = None) -> RouterConfig:
    if workers is None and args.workers:
        workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    return RouterConfig(
        workers=tuple(workers or ()),
        workers_dns=getattr(args, "workers_dns", None),
        policy=args.policy,
        max_inflight_per_worker=args.max_inflight_per_worker,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        aging_per_s=args.aging,
        worker_security=worker_security(args),
    )


def _router(args: argparse.Namespace) -> int:
    from headrace.router.http.server import HttpOptions
    from headrace.router.server import RouterOptions, run

    setup_logging(args.log_level)
    options = RouterOptions(**listen_options(args))
    return run(router_config(args), options, HttpOptions(port=args.http_port))


def add_up_command(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up",
        help="start a router and N workers on this machine",
        description=UP_DESCRIPTION,
        formatter_class=HelpFormatter,
    )
    add = up.add_argument
    add("--num-workers", type=int, default=1, help="how many worker processes to start")
    add(
        "--workers",
        type=int,
        dest="deprecated_workers",
        metavar="N",
        help="deprecated: --num-workers",
    )
    add(
        "--model",
        default=None,
        help="a local HF checkpoint folder or known name "
        "(default: the default model, prepared once)",
    )
    add(
        "--dtype",
        default="auto",
        help="the workers' dtype: auto, float32/fp32, bfloat16/bf16 or float16/fp16",
    )
    add(
        "--worker-args",
        default="",
        help='more flags for each worker, e.g. "--max-num-seqs 64" (split as a shell splits them)',
    )
    add_router_options(up)
    up.set_defaults(handler=_up)


UP_DESCRIPTION = """Start N workers (child processes on free loopback ports) and a router in front
of them on --host:--port; Ctrl-C (or SIGTERM) drains and stops them all. Children die with
this process, however it ends.

    headrace up                                      # the default model, one worker
    headrace up --num-workers 2 --model PATH --port 50051
    headrace up --http-port 8000                     # and the OpenAI API on :8000/v1
"""


def _router_args(args: argparse.Namespace) -> list[str]:
    """`headrace router` flags for ``up``'s router: every router option ``up`` was given."""
    values = {
        "--policy": args.policy,
        "--max-inflight-per-worker": args.max_inflight_per_worker,
        "--max-queued-requests": args.max_queued_requests,
        "--max-queued-tokens": args.max_queued_tokens,
        "--aging": args.aging,
        "--grace-period": args.grace_period,
        "--log-level": args.log_level,
        "--max-stream-backlog": args.max_stream_backlog,
        "--slow-reader-timeout": args.slow_reader_timeout,
        "--metrics-port": args.metrics_port,  # the router's; workers report through it
        "--http-port": args.http_port,
    }
    return [
        item for flag, value in values.items() if value is not None for item in (flag, str(value))
    ]


def _up(args: argparse.Namespace) -> int:
    from headrace.sdk.launch import ServerProcess, ServerStartError, start_router, start_worker
    from headrace.sdk.serving import wait_serving
    from headrace.worker.models.store import DEFAULT_MODEL

    setup_logging(args.log_level)
    model = args.model or DEFAULT_MODEL
    num_workers = args.num_workers
    if args.deprecated_workers is not None:
        print("headrace up: --workers N is deprecated; use --num-workers N", file=sys.stderr)
        num_workers = args.deprecated_workers
    worker_args = [
        "--dtype",
        args.dtype,
        "--log-level",
        args.log_level,
        *shlex.split(args.worker_args),
    ]
    children: list[ServerProcess] = []
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        for _ in range(num_workers):
            children.append(start_worker(model, *worker_args))
        targets = [child.target for child in children]
        router = start_router(targets, *_router_args(args), host=args.host, port=args.port)
        children.insert(0, router)
        probe_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "[::]") else args.host
        if not wait_serving(f"{probe_host}:{router.port}"):
            print("headrace up: the router found no healthy worker", file=sys.stderr)
            return 1
        http = (
            f", OpenAI API on http://{args.host}:{router.http_port}/v1" if router.http_port else ""
        )
        print(
            f"headrace up: router on {args.host}:{router.port}{http}, workers {', '.join(targets)}",
            flush=True,
        )
        while not stop.wait(0.5):
            if any(child.proc.poll() is not None for child in children):
                print("headrace up: a child process exited; stopping", file=sys.stderr)
                return 1
        return 0
    except ServerStartError as error:  # the child printed its own error above
        print(f"headrace up: {error}", file=sys.stderr)
        return error.exit_code or 1
    finally:
        for child in children:  # the router first: it drains while workers still serve
            with contextlib.suppress(Exception):
                child.terminate(timeout_s=args.grace_period + 10)
