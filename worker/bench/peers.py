"""Peer engines as baselines of ``headrace bench engine``: vLLM's CPU backend and llama.cpp.

Users weigh headrace against these on their own machine, so the bench runs them on the same
token-id prompts, greedy, every request to the same number of new tokens (ignore_eos). Each
peer lives in a venv of its own (``make bench-peers``), so it runs in a process of its own:
`peer_driver.py`, started with the peer venv's python, loads the model once and answers one
JSON line per run (`PeerProcess`). headrace and the peer then take turns on the same CPUs
(headrace, peer, headrace, peer, ...: a shared host's speed drifts, and alternating spreads
the drift over both), and `PairedRounds` reports each pair's ratio of tok/s, their median,
and greedy agreement: the fraction of requests whose generated tokens are identical. Each run
starts once the CPUs are quiet (`wait_until_quiet`): an engine's process may keep computing,
or spinning, after its run has answered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from headrace.sdk.errors import HeadraceError
from headrace.worker.bench.common import Report, Summary, Workload, make_workload, quantile
from headrace.worker.execution.cpu_threads import CpuSample, allowed_cpus, others_cores, sample
from headrace.worker.models.store import KNOWN_MODELS, cache_dir, locate_gguf

#: The peers ``--baseline`` names, and the folder under ``peers_dir()`` of each one's venv.
PEER_VENVS = {"vllm": "vllm", "llama.cpp": "llamacpp"}
DRIVER = Path(__file__).with_name("peer_driver.py")
#: GGUF type of each headrace dtype, as the converted files made by `make bench-peers` name it.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
#: ``--peer-gguf shipped``: the quantized GGUF the known model's package ships.
SHIPPED_GGUF = "shipped"
#: Before a turn the peer benches wait (`wait_until_quiet`) until other processes keep less
#: than QUIET_CORES of the CPUs busy over a QUIET_WINDOW_S window, or QUIET_TIMEOUT_S: an
#: engine goes on working for a moment after its last token (vLLM 0.32's CPU process kept a
#: core busy for about a second after each run), and a turn started meanwhile meets it as a
#: neighbour (served, headrace's turns right after vLLM's had a TTFT p50 of 4.7-5.0 s
#: against 3.7 s for the first; offline, headrace's thread governor gave a thread up for its
#: first prefill).
QUIET_CORES = 0.1
QUIET_WINDOW_S = 0.5
QUIET_TIMEOUT_S = 30.0


class PeerError(HeadraceError):
    """The peer could not be started, failed, or answered what the bench did not ask for
    (a HeadraceError, so `headrace bench` prints it as one line of error, not a traceback)."""


def peers_dir() -> Path:
    """Where `make bench-peers` puts the peers' venvs and GGUF files."""
    return cache_dir() / "peers"


def default_peer_python(peer: str) -> Path:
    return peers_dir() / PEER_VENVS[peer] / "bin" / "python"


def peer_model(peer: str, model_path: Path, model_name: str, dtype: str, gguf: str | None) -> str:
    """What the peer loads: vLLM the same checkpoint folder as headrace; llama.cpp a GGUF of
    it (``gguf``, or the one `make bench-peers` converted for ``dtype``)."""
    if peer == "vllm":
        return str(model_path)
    if gguf == SHIPPED_GGUF:
        if model_name not in KNOWN_MODELS:
            raise PeerError(f"--peer-gguf shipped: {model_name!r} is not a known model name")
        return str(locate_gguf(KNOWN_MODELS[model_name]))
    if gguf is not None:
        return gguf
    path = peers_dir() / "gguf" / f"{model_name}-{GGUF_TYPES.get(dtype, dtype)}.gguf"
    if not path.is_file():
        raise PeerError(
            f"{path} not found: run `make bench-peers` (it converts {model_name} to GGUF), "
            f"or give --peer-gguf PATH (or 'shipped')"
        )
    return str(path)


@dataclass(frozen=True, slots=True)
class PeerSetup:
    """What the driver is started with (its first JSON line)."""

    #: A key of `PEER_VENVS`.
    peer: str
    #: A checkpoint folder (vLLM) or a GGUF file (llama.cpp).
    model: str
    dtype: str
    #: The CPUs the peer's threads run on (and how many threads it runs).
    cpus: tuple[int, ...]
    max_num_seqs: int
    #: Tokens per engine step (vLLM) or per ``llama_decode`` batch (llama.cpp).
    max_num_batched_tokens: int
    #: The longest sequence: prompt and new tokens.
    max_model_len: int
    #: vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE).
    kv_cache_gib: int = 4


@dataclass(slots=True)
class PeerRun:
    """One run's answer from the driver."""

    seconds: float
    #: Generated tokens of each request, in the order of the workload's prompts.
    token_ids: list[list[int]]
    #: Each request's first token from the run's start, where the peer tells it.
    ttft_s: list[float] | None = None

    def report(self, name: str) -> Report:
        return Report(
            name,
            self.seconds,
            sum(len(t) for t in self.token_ids),
            ttft_s=list(self.ttft_s or []),
            token_ids=self.token_ids,
        )


def parse_answer(line: str) -> dict[str, Any]:
    """One JSON line from the driver; an ``error`` answer raises `PeerError`."""
    try:
        answer = json.loads(line)
    except json.JSONDecodeError:
        raise PeerError(f"the peer answered something other than JSON: {line[:200]!r}") from None
    if not isinstance(answer, dict):
        raise PeerError(f"the peer answered {line[:200]!r}, not a JSON object")
    if "error" in answer:
        raise PeerError(f"the peer failed: {answer['error']}")
    return answer


def parse_run(line: str, workload: Workload) -> PeerRun:
    """A run's answer, checked against what was asked: one token list per prompt, each as
    long as its ``max_tokens`` (ignore_eos)."""
    answer = parse_answer(line)
    try:
        run = PeerRun(float(answer["seconds"]), answer["token_ids"], answer.get("ttft_s"))
    except (KeyError, TypeError, ValueError) as error:
        raise PeerError(f"the peer's answer lacks {error}: {line[:200]!r}") from None
    if len(run.token_ids) != len(workload.prompts):
        raise PeerError(
            f"the peer answered {len(run.token_ids)} requests, asked {len(workload.prompts)}"
        )
    for i, (tokens, wanted) in enumerate(zip(run.token_ids, workload.max_tokens, strict=True)):
        if len(tokens) != wanted:
            raise PeerError(
                f"the peer generated {len(tokens)} tokens for request {i}, asked {wanted}"
            )
    if run.ttft_s is not None and len(run.ttft_s) != len(run.token_ids):
        raise PeerError(f"the peer gave {len(run.ttft_s)} TTFTs for {len(run.token_ids)} requests")
    return run


def require_peer_python(python: Path, peer: str) -> None:
    if not python.exists():
        raise PeerError(
            f"{python} not found: run `make bench-peers` to make the {peer} venv, or give "
            f"--peer-python PATH"
        )


class PeerProcess:
    """One peer engine in a process of its own, its model loaded once, run on request.

    The driver's log (the peer's own output) goes to a file, shown when the peer fails. It
    runs in a folder of its own: a peer that imports a module by a common name (vLLM tries
    ``kernels``) must not find one of this checkout's folders.
    """

    def __init__(
        self, python: Path, setup: PeerSetup, workdir: Path, driver: Path = DRIVER
    ) -> None:
        require_peer_python(python, setup.peer)
        self.log_path = workdir / f"{setup.peer}.log"
        self._log = self.log_path.open("w")
        self._process = subprocess.Popen(
            [str(python), str(driver)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=workdir,
            env=_peer_environment(),
        )
        try:
            self.info = self._ask(json.dumps(dataclasses.asdict(setup)))
        except PeerError:
            self.close()
            raise

    def run(self, workload: Workload) -> PeerRun:
        job = {"prompts": workload.prompts, "max_tokens": workload.max_tokens}
        try:
            return parse_run(self._exchange(json.dumps(job)), workload)
        except PeerError as error:
            raise self._with_log(error) from None

    def describe(self) -> str:
        return f"{self.info.get('version', '?')} ({self.info.get('mode', '?')})"

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def _ask(self, line: str) -> dict[str, Any]:
        try:
            return parse_answer(self._exchange(line))
        except PeerError as error:
            raise self._with_log(error) from None

    def _exchange(self, line: str) -> str:
        stdin: IO[str] | None = self._process.stdin
        stdout: IO[str] | None = self._process.stdout
        assert stdin is not None and stdout is not None
        try:
            stdin.write(line + "\n")
            stdin.flush()
        except BrokenPipeError:
            raise PeerError("the peer exited") from None
        answer = stdout.readline()
        if not answer:
            raise PeerError(f"the peer exited (status {self._process.wait()})")
        return answer

    def _with_log(self, error: PeerError) -> PeerError:
        self._log.flush()
        tail = self.log_path.read_text(errors="replace")[-3000:]
        return PeerError(f"{error}\n--- the end of its log ({self.log_path}):\n{tail}")


def _peer_environment() -> dict[str, str]:
    """This process's environment less what points Python at this checkout's modules: the
    peer's venv has its own, and a PYTHONPATH of headrace's breaks its imports."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


@contextlib.contextmanager
def start_peer(python: Path, setup: PeerSetup, driver: Path = DRIVER) -> Iterator[PeerProcess]:
    with tempfile.TemporaryDirectory(prefix="headrace-peer-") as workdir:
        peer = PeerProcess(python, setup, Path(workdir), driver)
        try:
            yield peer
        finally:
            peer.close()


def agreement(ours: Sequence[object], theirs: Sequence[object]) -> float:
    """The fraction of requests whose generated tokens (or texts) are identical."""
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} requests against {len(theirs)}")
    return sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours)


@dataclass(slots=True)
class PairedRounds:
    """Alternating runs of one workload: headrace's, then the peer's, ``rounds`` times."""

    #: The peer's name in summary keys (``vllm``, ``llama_cpp``).
    key: str
    ours: list[Report] = field(default_factory=list)
    theirs: list[Report] = field(default_factory=list)
    #: Seconds each run after the first waited for the CPUs to go quiet, in run order.
    waits: list[float] = field(default_factory=list)

    def add(self, ours: Report, theirs: Report) -> None:
        self.ours.append(ours)
        self.theirs.append(theirs)

    @property
    def ratios(self) -> list[float]:
        """Each pair's headrace tok/s over the peer's."""
        return [
            a.tokens_per_s / b.tokens_per_s for a, b in zip(self.ours, self.theirs, strict=True)
        ]

    @property
    def agreements(self) -> list[float]:
        return [
            agreement(a.token_ids, b.token_ids) for a, b in zip(self.ours, self.theirs, strict=True)
        ]

    def summary(self) -> Summary:
        key = self.key
        out: Summary = {
            f"ratio_{key}": round(quantile(self.ratios, 0.5), 3),
            f"ratio_{key}_rounds": [round(r, 3) for r in self.ratios],
            f"{key}_tok_s": round(quantile([r.tokens_per_s for r in self.theirs], 0.5), 2),
            f"{key}_agreement": min(self.agreements),
        }
        if ttfts := [quantile(r.ttft_s, 0.5) for r in self.theirs if r.ttft_s]:
            out[f"{key}_ttft_p50_ms"] = round(quantile(ttfts, 0.5) * 1e3, 3)
        if self.is_single_stream:
            for prefix, reports in (("", self.ours), (f"{key}_", self.theirs)):
                out[f"{prefix}ms_per_token"] = round(_median_ms_per_token(reports), 3)
                if (decode := _median_decode_ms_per_token(reports)) is not None:
                    out[f"{prefix}decode_ms_per_token"] = round(decode, 3)
        return out

    @property
    def is_single_stream(self) -> bool:
        return len(self.ours[0].token_ids) == 1

    def describe(self) -> str:
        lines = [r.describe() for r in self.theirs]
        rounds = ", ".join(
            f"{a.tokens_per_s:.1f}/{b.tokens_per_s:.1f}={r:.2f}"
            for a, b, r in zip(self.ours, self.theirs, self.ratios, strict=True)
        )
        lines.append(
            f"  headrace / {self.theirs[0].name} tok/s: {quantile(self.ratios, 0.5):.2f}x "
            f"(median of {len(self.ratios)} alternating pairs: {rounds})"
        )
        agreements = ", ".join(f"{a:.0%}" for a in self.agreements)
        lines.append(f"  greedy agreement (requests with identical tokens): {agreements}")
        if self.waits:
            waits = ", ".join(f"{w:.1f}" for w in self.waits)
            lines.append(f"  waits for quiet CPUs before each run after the first (s): {waits}")
        if self.is_single_stream:
            lines.append(
                "  single stream, ms per token (the run's wall time / tokens; after the first "
                f"token): headrace {_per_token_text(self.ours)}, {self.theirs[0].name} "
                f"{_per_token_text(self.theirs)}"
            )
        return "\n".join(lines)


def _median_ms_per_token(reports: list[Report]) -> float:
    return quantile([r.seconds / r.num_tokens * 1e3 for r in reports], 0.5)


def _median_decode_ms_per_token(reports: list[Report]) -> float | None:
    """A single stream's time per token after its first (None where the TTFT is unknown)."""
    if any(not r.ttft_s or r.num_tokens < 2 for r in reports):
        return None
    return quantile([(r.seconds - r.ttft_s[0]) / (r.num_tokens - 1) * 1e3 for r in reports], 0.5)


def _per_token_text(reports: list[Report]) -> str:
    decode = _median_decode_ms_per_token(reports)
    return f"{_median_ms_per_token(reports):.1f}" + ("" if decode is None else f" ({decode:.1f})")


@dataclass(frozen=True, slots=True)
class Quiet:
    """What `wait_until_quiet` found: how long it waited, and the cores other processes used
    in its last window (below its limit unless it gave up)."""

    waited_s: float
    others: float


def wait_until_quiet(
    limit_cores: float = QUIET_CORES,
    window_s: float = QUIET_WINDOW_S,
    timeout_s: float = QUIET_TIMEOUT_S,
    read: Callable[[list[int]], CpuSample] = sample,
    sleep: Callable[[float], None] = time.sleep,
) -> Quiet:
    """Wait until other processes keep less than ``limit_cores`` of this process's CPUs busy
    over a ``window_s`` window, or ``timeout_s`` has passed (``read`` and ``sleep``: tests
    give their own)."""
    cpus = allowed_cpus()
    first = last = read(cpus)
    while True:
        sleep(window_s)
        now = read(cpus)
        others = others_cores(last, now)
        if others < limit_cores or now.at - first.at >= timeout_s:
            return Quiet(now.at - first.at, others)
        last = now


def compare_with_peer(
    peer: PeerProcess,
    key: str,
    workloads: list[Workload],
    first: Report,
    run_ours: Callable[[Workload], Report],
    settle: Callable[[], Quiet] = wait_until_quiet,
) -> PairedRounds:
    """``first`` (headrace's run of ``workloads[0]``, just made) against the peer's, then a
    (headrace, peer) pair on each further workload: one round each. A round's prompts are new
    (both engines keep a prefix cache, so a repeated prompt would skip its prefill). The peer
    warms up first on a small workload of its own. Each run starts once ``settle`` has
    waited for the CPUs to go quiet; `PairedRounds.waits` keeps how long it took."""
    # No more sequences than the workload's: llama.cpp's context holds that many.
    peer.run(make_workload(1000, min(2, len(workloads[0].prompts)), (8, 16), (4, 4), 1))
    name = peer.info.get("version") or key
    paired = PairedRounds(key)
    paired.waits.append(settle().waited_s)
    paired.add(first, peer.run(workloads[0]).report(name))
    for workload in workloads[1:]:
        paired.waits.append(settle().waited_s)
        ours = run_ours(workload)
        paired.waits.append(settle().waited_s)
        paired.add(ours, peer.run(workload).report(name))
    return paired
