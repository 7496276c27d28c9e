"""``headrace bench serve --baseline vllm|llama.cpp``: headrace served against a peer's server.

    headrace bench serve --model smollm2-135m-instruct --dtype bfloat16 --baseline vllm \\
        --num-requests 64 --prompt-lens 128 --output-lens 64 --peer-cpus 0-1

What a user compares: the same load through headrace's OpenAI door and through the peer's
own OpenAI server, each a server of its own on this machine. headrace runs as ``headrace up``
runs it (a worker, and a router with its OpenAI door; or the door at ``--http-target`` of one
already running, with ``--target``), the peer as its own command, from its venv
(`PeerServer`):

- **vLLM**: ``python -m vllm.entrypoints.openai.api_server`` on the same checkpoint folder,
  ``--dtype`` as headrace's, ``--max-num-seqs`` and ``--max-num-batched-tokens`` as the
  worker's (`worker_limits`), ``VLLM_CPU_OMP_THREADS_BIND`` the CPUs of ``--peer-cpus``;
- **llama.cpp**: its ``llama-server`` (`make bench-peers` builds it from the sources
  llama-cpp-python vendors; ``--peer-server PATH`` names another) on the GGUF of ``--dtype``,
  with as many parallel slots as the worker's sequences, continuous batching, a thread per CPU
  of ``--peer-cpus``, and the worker's step budget as its batch.

Both servers stay up; the loads take turns (headrace, then the peer, ``--rounds`` times),
each round with prompts of its own (seed ``--seed`` + round), so no round's prompts hit a
prefix either server cached from an earlier one, and within a round both get the same ones.
The load is `serve_http`'s client: streamed ``/v1/completions`` with token-id prompts,
greedy, ``ignore_eos``. Printed per pair and as medians: tok/s (headrace's over the peer's)
and TTFT p50 (headrace's over the peer's: below 1 is faster), and the share of requests
whose completion text is identical in both (greedy agreement). After each load, what the
servers' metrics say of it (`serve_metrics`): the worker's steps by kind and how busy its
engine was, and each server's mean TTFT as queue plus prefill (vLLM's too).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from headrace.sdk.launch import start_router, start_worker
from headrace.worker.bench.common import Report, Summary, make_workload, quantile
from headrace.worker.bench.peer_driver import cpu_ranges
from headrace.worker.bench.peers import (
    QUIET_CORES,
    PeerError,
    PeerSetup,
    Quiet,
    agreement,
    default_peer_python,
    peer_model,
    peers_dir,
    require_peer_python,
    wait_until_quiet,
)
from headrace.worker.bench.serve import describe_workload, door_target, worker_flags
from headrace.worker.bench.serve_http import run_http_load
from headrace.worker.bench.serve_metrics import VLLM, WORKER, LoadMetrics, ServerSplit
from headrace.worker.config import EngineConfig
from headrace.worker.models.store import DEFAULT_MODEL, resolve_model

#: How long a peer's server may take to answer its first /v1/models (vLLM compiles its model
#: at start: 1.5-3 minutes on two busy cores).
PEER_START_TIMEOUT_S = 900.0


def default_peer_server() -> Path:
    """Where `make bench-peers` puts llama.cpp's ``llama-server``."""
    return peers_dir() / "llamacpp" / "bin" / "llama-server"


def peer_server_command(
    setup: PeerSetup, served_name: str, port: int, python: Path, server: Path
) -> tuple[list[str], dict[str, str]]:
    """The peer's server command line on ``port``, serving the model as ``served_name``,
    and the environment variables it adds. ``setup.max_model_len`` is the workload's longest
    sequence (llama.cpp's slots share a context of that many each)."""
    host = ["--host", "127.0.0.1", "--port", str(port)]
    if setup.peer == "vllm":
        command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", setup.model]
        command += ["--served-model-name", served_name, "--dtype", setup.dtype, *host]
        command += ["--max-num-seqs", str(setup.max_num_seqs)]
        command += ["--max-num-batched-tokens", str(setup.max_num_batched_tokens)]
        command += ["--max-model-len", str(setup.max_model_len)]
        environment = {
            "VLLM_CPU_KVCACHE_SPACE": str(setup.kv_cache_gib),
            "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(setup.cpus),
        }
        return command, environment
    if setup.peer == "llama.cpp":
        threads = str(len(setup.cpus))
        command = [str(server), "--model", setup.model, "--alias", served_name, *host]
        command += ["--threads", threads, "--threads-batch", threads, "--cont-batching"]
        # A slot per sequence, and an HTTP thread per connection (its HTTP library holds a
        # thread for each open keep-alive connection; the load opens one per request).
        command += ["--parallel", str(setup.max_num_seqs)]
        command += ["--threads-http", str(setup.max_num_seqs)]
        # The context is shared by the slots: each gets a whole sequence.
        command += ["--ctx-size", str(setup.max_num_seqs * setup.max_model_len)]
        command += ["--batch-size", str(setup.max_num_batched_tokens)]
        command += ["--ubatch-size", str(setup.max_num_batched_tokens)]
        return command, {}
    raise PeerError(f"no server for the peer {setup.peer!r}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class PeerServer:
    """The peer's OpenAI server as a child process (a process group of its own: vLLM starts
    its engine in another process), up once it answers ``/v1/models``. Its log goes to a
    file, shown when it fails to start. It runs in a folder of its own: vLLM imports a
    module named ``kernels``, which this checkout's folder of that name would shadow."""

    def __init__(
        self,
        command: list[str],
        environment: dict[str, str],
        port: int,
        cpus: tuple[int, ...],
        workdir: Path,
        timeout_s: float = PEER_START_TIMEOUT_S,
    ) -> None:
        self.port, self.log_path = port, workdir / "peer-server.log"
        self._log = self.log_path.open("wb")
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        try:
            self.process = subprocess.Popen(
                command,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                cwd=workdir,
                env={**env, **environment},
                start_new_session=True,
            )
        except OSError as error:
            self._log.close()
            raise PeerError(f"could not start the peer's server {command[0]}: {error}") from None
        # Its threads start after it has loaded: they inherit the CPUs set here.
        with contextlib.suppress(OSError):
            os.sched_setaffinity(self.process.pid, cpus)
        try:
            self._wait(timeout_s)
        except PeerError:
            self.close()
            raise

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (code := self.process.poll()) is not None:
                raise PeerError(f"the peer's server exited with code {code}{self._tail()}")
            try:
                with urllib.request.urlopen(f"http://{self.target}/v1/models", timeout=5):
                    return
            except (urllib.error.URLError, OSError):
                time.sleep(1.0)
        raise PeerError(f"the peer's server did not answer in {timeout_s:.0f} s{self._tail()}")

    def _tail(self) -> str:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return f"\n--- the end of its log ({self.log_path}):\n{tail}"

    def close(self) -> None:
        """SIGTERM its process group, SIGKILL what is left after 30 s."""
        for sig, wait_s in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)
        self._log.close()


@contextlib.contextmanager
def start_peer_server(
    setup: PeerSetup,
    served_name: str,
    python: Path,
    server: Path,
    timeout_s: float = PEER_START_TIMEOUT_S,
) -> Iterator[PeerServer]:
    if setup.peer == "vllm":
        require_peer_python(python, setup.peer)
    elif not server.exists():
        raise PeerError(
            f"{server} not found: run `make bench-peers` (it builds llama.cpp's llama-server), "
            f"or give --peer-server PATH"
        )
    port = free_port()
    command, environment = peer_server_command(setup, served_name, port, python, server)
    with tempfile.TemporaryDirectory(prefix="headrace-peer-server-") as workdir:
        peer = PeerServer(command, environment, port, setup.cpus, Path(workdir), timeout_s)
        try:
            yield peer
        finally:
            peer.close()


@dataclass(slots=True)
class ServedPairs:
    """Alternating served loads: headrace's, then the peer's, one pair per round."""

    key: str
    ours: list[Report]
    theirs: list[Report]
    #: What the worker's metrics said of each of headrace's loads (where the bench started
    #: the worker), and the peer's of each of its loads (where it exports them: vLLM).
    our_servers: list[ServerSplit] = field(default_factory=list)
    their_servers: list[ServerSplit] = field(default_factory=list)

    @property
    def ratios(self) -> list[float]:
        """Each pair's headrace tok/s over the peer's."""
        return [a.tokens_per_s / b.tokens_per_s for a, b in self._pairs()]

    @property
    def ttft_ratios(self) -> list[float]:
        """Each pair's headrace TTFT p50 over the peer's."""
        return [quantile(a.ttft_s, 0.5) / quantile(b.ttft_s, 0.5) for a, b in self._pairs()]

    @property
    def agreements(self) -> list[float]:
        return [agreement(a.texts, b.texts) for a, b in self._pairs()]

    def _pairs(self) -> list[tuple[Report, Report]]:
        return list(zip(self.ours, self.theirs, strict=True))

    def summary(self) -> Summary:
        """headrace's median round (by tok/s) with its worker's split, the pairs' ratios, and
        the peer's figures (its split from the same round)."""
        median = self._median_round()
        key = self.key
        out: Summary = dict(self.ours[median].summary())
        if self.our_servers:
            out.update(self.our_servers[median].summary("worker"))
        if self.their_servers:
            out.update(self.their_servers[median].summary(key))
        out.update(
            {
                f"ratio_{key}": round(quantile(self.ratios, 0.5), 3),
                f"ratio_{key}_rounds": [round(r, 3) for r in self.ratios],
                f"ratio_{key}_ttft_p50": round(quantile(self.ttft_ratios, 0.5), 3),
                f"ratio_{key}_ttft_p50_rounds": [round(r, 3) for r in self.ttft_ratios],
                f"{key}_tok_s": round(quantile([r.tokens_per_s for r in self.theirs], 0.5), 2),
                f"{key}_ttft_p50_ms": round(
                    quantile([quantile(r.ttft_s, 0.5) for r in self.theirs], 0.5) * 1e3, 3
                ),
                f"{key}_agreement": min(self.agreements),
            }
        )
        return out

    def _median_round(self) -> int:
        """headrace's median round by tok/s."""
        order = sorted(range(len(self.ours)), key=lambda i: self.ours[i].tokens_per_s)
        return order[len(order) // 2]

    def describe(self) -> str:
        name = self.theirs[0].name
        tok_s = ", ".join(f"{a.tokens_per_s:.1f}/{b.tokens_per_s:.1f}" for a, b in self._pairs())
        ttft = ", ".join(
            f"{quantile(a.ttft_s, 0.5) * 1e3:.0f}/{quantile(b.ttft_s, 0.5) * 1e3:.0f}"
            for a, b in self._pairs()
        )
        return "\n".join(
            [
                f"  headrace / {name} tok/s: {quantile(self.ratios, 0.5):.2f}x (median of "
                f"{len(self.ratios)} alternating pairs: {tok_s}; {_ratios(self.ratios)})",
                f"  headrace / {name} TTFT p50: {quantile(self.ttft_ratios, 0.5):.2f}x "
                f"(ms: {ttft}; {_ratios(self.ttft_ratios)})",
                "  greedy agreement (requests with identical text): "
                + ", ".join(f"{a:.0%}" for a in self.agreements),
            ]
        )


def _ratios(values: list[float]) -> str:
    return ", ".join(f"{r:.2f}" for r in values)


def worker_limits(model: str, dtype: str, num_requests: int) -> tuple[int, int]:
    """The worker's sequences and step budget, as the peer is given them: room for every
    request at once (as `serve_local`'s worker), and the worker's default budget."""
    config = EngineConfig(model=model, dtype=dtype)
    return max(config.max_num_seqs, num_requests), config.max_num_batched_tokens


def run_against_peer(
    args: argparse.Namespace, settle: Callable[[], Quiet] = wait_until_quiet
) -> Summary:
    """The load, headrace's servers and the peer's taking turns, each turn started once
    ``settle`` has waited for the CPUs to go quiet (tests give their own)."""
    model = Path(resolve_model(args.model or DEFAULT_MODEL))
    max_num_seqs, budget = worker_limits(str(model), args.dtype, args.num_requests)
    flags: list[str] = []
    if not args.target:  # our worker, whose flags (--worker-args too) set the peer's limits
        flags, config = worker_flags(args, str(model), max_num_seqs)
        max_num_seqs, budget = config.max_num_seqs, config.max_num_batched_tokens
    # The workload's longest sequence: llama.cpp's slots share a context of this many each.
    max_model_len = args.prompt_lens[1] + args.output_lens[1]
    name = model.name
    setup = PeerSetup(
        args.baseline,
        peer_model(args.baseline, model, name, args.dtype, args.peer_gguf),
        args.dtype,
        tuple(args.peer_cpus or sorted(os.sched_getaffinity(0))),
        max_num_seqs,
        budget,
        max_model_len,
        args.peer_kv_cache_gib,
    )
    python = Path(args.peer_python or default_peer_python(args.baseline))
    server = Path(args.peer_server or default_peer_server())
    print(describe_workload(args, name) + f", dtype {args.dtype}")
    if flags:
        print(f"headrace's worker flags: {shlex.join(flags)}")
    print(
        f"{args.baseline}: {setup.max_num_seqs} sequences, {setup.max_num_batched_tokens}-token "
        f"steps, CPUs {cpu_ranges(setup.cpus)}"
    )
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        door = door_target(args) if args.target else None
        ours = None
        if door is None:
            worker = stack.enter_context(
                start_worker(
                    model, *flags, "--metrics-port", "0", log_path=Path(tmp) / "worker.log"
                )
            )
            router = stack.enter_context(
                start_router([worker.target], "--http-port", "0", log_path=Path(tmp) / "router.log")
            )
            door = f"127.0.0.1:{router.http_port}"
            ours = LoadMetrics(f"http://127.0.0.1:{worker.metrics_port}/metrics", WORKER)
        started = time.perf_counter()
        peer = stack.enter_context(
            start_peer_server(setup, name, python, server, args.peer_start_timeout)
        )
        print(f"{args.baseline} server up in {time.perf_counter() - started:.0f} s")
        metrics = (ours, _peer_metrics(peer, setup))
        pairs = _alternate(args, door, peer.target, vocab_size(model), metrics, settle)
    print(pairs.describe())
    summary: Summary = {"bench": "serve", "model": name, "baseline": args.baseline}
    summary.update(pairs.summary())
    return summary


@dataclass(frozen=True, slots=True)
class _Side:
    """One side of the pairs: its name, its OpenAI door, its metrics (if read), and where
    its figures go."""

    name: str
    door: str
    metrics: LoadMetrics | None
    reports: list[Report]
    servers: list[ServerSplit]


def _peer_metrics(peer: PeerServer, setup: PeerSetup) -> LoadMetrics | None:
    """vLLM's OpenAI server exports its metrics on its own port (llama-server only when
    started with ``--metrics``, and under names of its own)."""
    if setup.peer != "vllm":
        return None
    return LoadMetrics(f"http://{peer.target}/metrics", VLLM)


def _alternate(
    args: argparse.Namespace,
    door: str,
    peer_door: str,
    vocab: int,
    metrics: tuple[LoadMetrics | None, LoadMetrics | None],
    settle: Callable[[], Quiet],
) -> ServedPairs:
    pairs = ServedPairs(args.baseline.replace(".", "_"), [], [])
    sides = (
        _Side("headrace", door, metrics[0], pairs.ours, pairs.our_servers),
        _Side(args.baseline, peer_door, metrics[1], pairs.theirs, pairs.their_servers),
    )
    for round_no in range(args.rounds):
        seed = args.seed + round_no
        workload = make_workload(vocab, args.num_requests, args.prompt_lens, args.output_lens, seed)
        round_args = argparse.Namespace(**{**vars(args), "seed": seed})
        for side in sides:
            if (quiet := settle()).others >= QUIET_CORES:
                print(
                    f"(other processes kept {quiet.others:.2f} cores busy before "
                    f"{side.name}'s turn)"
                )
            start = None if side.metrics is None else side.metrics.start
            report = asyncio.run(
                run_http_load(side.door, workload, round_args, side.name, True, start)
            )
            print(report.describe())
            side.reports.append(report)
            if side.metrics is not None:
                side.servers.append(side.metrics.finish(report.seconds))
                print(side.servers[-1].describe())
    return pairs


def vocab_size(model: Path) -> int:
    """The token ids prompts draw from: the tokenizer's (headrace's and the peer's alike)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model))
