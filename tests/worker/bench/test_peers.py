"""Peer baselines of `headrace bench engine`: the driver's JSON, the paired rounds' arithmetic,
and the process plumbing, with a fake peer (a stdlib script run by this python) standing in
for vLLM and llama.cpp, so none of this needs them installed. No wall-clock time is asserted:
the fake peer states its run times, and headrace's reports are made by hand."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from headrace.worker.bench.cli import engine_arguments, parse_cpus
from headrace.worker.bench.common import Report, Workload
from headrace.worker.bench.engine import _peer_setup, _workload_shape
from headrace.worker.bench.peer_driver import _prefill_chunks, cpu_ranges
from headrace.worker.bench.peers import (
    QUIET_CORES,
    QUIET_WINDOW_S,
    PairedRounds,
    PeerError,
    PeerProcess,
    PeerSetup,
    Quiet,
    agreement,
    compare_with_peer,
    parse_run,
    peer_model,
    start_peer,
    wait_until_quiet,
)
from headrace.worker.config import CPU_STEP_TOKENS, EngineConfig
from headrace.worker.execution.cpu_threads import CpuSample
from headrace.worker.models.store import CACHE_ENV

from tests.worker.bench.processes import cpu_seconds, no_wait

#: Answers like the real driver: each request's tokens are its prompt's last token + 1, + 2, ...
#: and a run's "seconds" is its number (the warm-up is run 1). FAKE_MODE in the setup's model
#: field makes it fail at setup, exit without answering, or answer short token lists.
FAKE_PEER = textwrap.dedent(
    """
    import json, sys

    setup = json.loads(sys.stdin.readline())
    mode = setup["model"]
    if mode == "fail-setup":
        print("boom: no such model", file=sys.stderr)
        print(json.dumps({"error": "OSError: no such model"}), flush=True)
        sys.exit(1)
    if mode == "exit":
        sys.exit(3)
    print(json.dumps({"ready": True, "version": "fake 1.0", "mode": "fake", "load_s": 0.5}),
          flush=True)
    for number, line in enumerate(sys.stdin, start=1):
        job = json.loads(line)
        if len(job["prompts"]) > setup["max_num_seqs"]:  # as llama.cpp's context
            print(json.dumps({"error": "RuntimeError: llama_decode returned -1"}), flush=True)
            sys.exit(1)
        cut = 1 if mode == "short" else 0
        tokens = [[p[-1] + k + 1 for k in range(n - cut)]
                  for p, n in zip(job["prompts"], job["max_tokens"])]
        ttft = [0.25] * len(tokens)
        print(json.dumps({"seconds": float(number), "token_ids": tokens, "ttft_s": ttft}),
              flush=True)
    """
)


@pytest.fixture
def fake_driver(tmp_path: Path) -> Path:
    path = tmp_path / "fake_peer.py"
    path.write_text(FAKE_PEER)
    return path


def setup(model: str = "ok", max_num_seqs: int = 8) -> PeerSetup:
    return PeerSetup("vllm", model, "float32", (0,), max_num_seqs, 2048, 64)


def workload(*prompts: list[int], max_tokens: int = 3) -> Workload:
    return Workload([list(p) for p in prompts], [max_tokens] * len(prompts))


def fake_tokens(work: Workload) -> list[list[int]]:
    """What the fake peer generates for ``work``."""
    return [
        [p[-1] + k + 1 for k in range(n)]
        for p, n in zip(work.prompts, work.max_tokens, strict=True)
    ]


def ours(seconds: float, token_ids: list[list[int]]) -> Report:
    return Report("headrace", seconds, sum(map(len, token_ids)), token_ids=token_ids)


def no_more_runs(work: Workload) -> Report:
    raise AssertionError("one round: headrace's first run is the only one")


# --- the driver's answers --------------------------------------------------------------------


def test_parse_run_reads_tokens_seconds_and_ttfts():
    work = workload([5, 6], [7], max_tokens=2)
    line = json.dumps({"seconds": 1.5, "token_ids": [[1, 2], [3, 4]], "ttft_s": [0.1, 0.2]})
    run = parse_run(line, work)
    assert run.seconds == 1.5 and run.token_ids == [[1, 2], [3, 4]]
    report = run.report("peer")
    assert report.num_tokens == 4 and report.ttft_s == [0.1, 0.2]
    assert report.tokens_per_s == 4 / 1.5


def test_parse_run_takes_a_peer_without_ttfts():
    line = json.dumps({"seconds": 2.0, "token_ids": [[1, 2, 3]], "ttft_s": None})
    assert parse_run(line, workload([9])).report("peer").ttft_s == []


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ({"error": "RuntimeError: llama_decode returned 1"}, "llama_decode returned 1"),
        ({"seconds": 1.0, "token_ids": [[1, 2, 3]]}, "answered 1 requests, asked 2"),
        ({"seconds": 1.0, "token_ids": [[1, 2, 3], [4]]}, "generated 1 tokens for request 1"),
        ({"token_ids": [[1, 2, 3], [4, 5, 6]]}, "lacks 'seconds'"),
        (
            {"seconds": 1.0, "token_ids": [[1, 2, 3], [4, 5, 6]], "ttft_s": [0.1]},
            "1 TTFTs for 2 requests",
        ),
    ],
)
def test_parse_run_rejects_what_was_not_asked(answer: dict, message: str):
    with pytest.raises(PeerError, match=message):
        parse_run(json.dumps(answer), workload([1], [2]))


def test_parse_run_rejects_a_line_that_is_not_json():
    with pytest.raises(PeerError, match="other than JSON"):
        parse_run("INFO loading weights", workload([1]))


# --- agreement and paired rounds -------------------------------------------------------------


def test_agreement_is_the_fraction_of_requests_with_identical_tokens():
    assert agreement([[1, 2], [3, 4]], [[1, 2], [3, 4]]) == 1.0
    assert agreement([[1, 2], [3, 4], [5], [6]], [[1, 2], [3, 5], [5], [6]]) == 0.75
    # A request that only starts the same does not agree.
    assert agreement([[1, 2, 3]], [[1, 2]]) == 0.0
    with pytest.raises(ValueError):
        agreement([[1]], [[1], [2]])


def test_paired_rounds_report_each_pairs_ratio_and_the_upper_median():
    tokens = [[1] * 10, [2] * 10]  # 20 tokens per run
    paired = PairedRounds("vllm")
    # headrace 20, 10, 40 tok/s against the peer's 10, 10, 10: ratios 2, 1, 4.
    for our_s in (1.0, 2.0, 0.5):
        paired.add(ours(our_s, tokens), ours(2.0, tokens))
    assert paired.ratios == [2.0, 1.0, 4.0]
    summary = paired.summary()
    assert summary["ratio_vllm"] == 2.0
    assert summary["ratio_vllm_rounds"] == [2.0, 1.0, 4.0]
    assert summary["vllm_tok_s"] == 10.0
    assert summary["vllm_agreement"] == 1.0
    assert "ms_per_token" not in summary  # two requests: not a single stream
    paired.add(ours(1.0, tokens), ours(1.0, tokens))  # an even count: the upper middle
    assert paired.summary()["ratio_vllm"] == 2.0


def test_paired_rounds_report_the_worst_rounds_agreement():
    paired = PairedRounds("llama_cpp")
    paired.add(ours(1.0, [[1, 2], [3, 4]]), ours(1.0, [[1, 2], [3, 4]]))
    paired.add(ours(1.0, [[1, 2], [3, 4]]), ours(1.0, [[1, 2], [3, 9]]))
    assert paired.agreements == [1.0, 0.5]
    assert paired.summary()["llama_cpp_agreement"] == 0.5


def test_a_single_stream_also_reports_ms_per_token():
    paired = PairedRounds("vllm")
    headrace = ours(2.0, [[1] * 101])
    headrace.ttft_s = [0.5]  # then 100 tokens in 1.5 s
    paired.add(headrace, ours(4.04, [[1] * 101]))  # a peer without TTFTs
    summary = paired.summary()
    assert summary["ms_per_token"] == pytest.approx(2000 / 101)
    assert summary["vllm_ms_per_token"] == pytest.approx(40.0)
    assert summary["decode_ms_per_token"] == pytest.approx(15.0)
    assert "vllm_decode_ms_per_token" not in summary
    assert "ms per token" in paired.describe()


# --- the peer process ------------------------------------------------------------------------


def test_runs_alternate_after_the_peers_warm_up_each_round_on_its_own_prompts(fake_driver: Path):
    rounds = [workload([100, 101], [200 + r], max_tokens=4) for r in range(3)]
    our_workloads: list[Workload] = []
    our_runs: list[Report] = []
    events: list[str] = []

    def run_ours(work: Workload) -> Report:
        events.append("ours")
        our_workloads.append(work)
        our_runs.append(ours(1.0, fake_tokens(work)))
        return our_runs[-1]

    def settle() -> Quiet:
        events.append("quiet")
        return Quiet(0.5, 0.0)

    with start_peer(Path(sys.executable), setup(), fake_driver) as peer:
        assert peer.describe() == "fake 1.0 (fake)"
        peer_run = peer.run
        peer.run = lambda work: (events.append("peer"), peer_run(work))[1]  # type: ignore[method-assign]
        first = ours(1.0, fake_tokens(rounds[0]))
        paired = compare_with_peer(peer, "vllm", rounds, first, run_ours, settle)
    assert our_workloads == rounds[1:] and paired.ours == [first, *our_runs]
    # The peer's warm-up, then every run after the first once the CPUs are quiet.
    assert events == ["peer"] + ["quiet", "peer"] + ["quiet", "ours", "quiet", "peer"] * 2
    assert paired.waits == [0.5] * 5
    # The peer ran each round's prompts (its tokens follow each prompt's last).
    assert [r.token_ids for r in paired.theirs] == [fake_tokens(w) for w in rounds]
    # Run 1 was the peer's warm-up; each pair then got the next run (its seconds: 2, 3, 4).
    assert [r.seconds for r in paired.theirs] == [2.0, 3.0, 4.0]
    # headrace's 8 tokens in 1 s against the peer's in 2, 3 and 4 s.
    assert paired.ratios == pytest.approx([2.0, 3.0, 4.0])
    assert paired.summary()["ratio_vllm"] == 3.0
    assert paired.agreements == [1.0, 1.0, 1.0]
    assert paired.theirs[0].token_ids == [[102, 103, 104, 105], [201, 202, 203, 204]]
    assert paired.theirs[0].ttft_s == [0.25, 0.25]


class ScriptedCpus:
    """Others' busy cores over time as a test scripts it (``busy(t)``), read by
    `wait_until_quiet` through its clock-advancing sleep."""

    def __init__(self, busy: Callable[[float], float]) -> None:
        self.busy_cores, self.now, self.busy_s = busy, 0.0, 0.0

    def read(self, cpus: list[int]) -> CpuSample:
        return CpuSample(self.now, self.busy_s, 0.0)

    def sleep(self, seconds: float) -> None:
        self.busy_s += self.busy_cores(self.now) * seconds
        self.now += seconds


def test_a_run_waits_until_the_last_engines_process_goes_quiet() -> None:
    # A core busy for 1.2 s after the last run answered (vLLM's process did), then quiet.
    cpus = ScriptedCpus(lambda t: 1.0 if t < 1.2 else 0.05)
    quiet = wait_until_quiet(read=cpus.read, sleep=cpus.sleep)
    assert 1.2 <= quiet.waited_s <= 1.2 + 2 * QUIET_WINDOW_S and quiet.others < QUIET_CORES
    calm = ScriptedCpus(lambda t: 0.0)
    assert wait_until_quiet(read=calm.read, sleep=calm.sleep) == Quiet(QUIET_WINDOW_S, 0.0)


def test_the_wait_for_quiet_cpus_gives_up_after_its_limit() -> None:
    cpus = ScriptedCpus(lambda t: 1.0)  # a neighbour that never stops
    quiet = wait_until_quiet(timeout_s=2.0, read=cpus.read, sleep=cpus.sleep)
    assert quiet.waited_s == pytest.approx(2.0) and quiet.others == pytest.approx(1.0)


def _cpu_time_of(pid: int) -> Callable[[list[int]], CpuSample]:
    """A `wait_until_quiet` reader that sees one process's CPU time and nothing else (the
    machine's other work, such as a test running beside this one, would never go quiet)."""
    seen = [0.0]

    def read(cpus: list[int]) -> CpuSample:
        seconds = cpu_seconds(pid)
        if seconds is not None:  # (gone: its last time stands)
            seen[0] = seconds
        return CpuSample(time.monotonic(), seen[0], 0.0)

    return read


def test_a_turn_waits_for_a_busy_process_to_finish() -> None:
    """A process that keeps a core busy for a while: the wait returns only once it is gone
    (what the turn after a server's last token waits for), and reports the quiet it found."""
    busy = subprocess.Popen(
        [sys.executable, "-c", BUSY_FOR_A_WHILE], stdout=subprocess.PIPE, text=True
    )
    assert busy.stdout is not None and busy.stdout.readline() == "busy\n"
    read = _cpu_time_of(busy.pid)
    quiet = wait_until_quiet(limit_cores=0.1, window_s=0.3, timeout_s=120, read=read)
    # Its two CPU-seconds were spent before the wait ended (its exit may come a moment later;
    # /proc counts whole ticks of 10 ms, sampled, so it may read a tick or two short).
    spent = cpu_seconds(busy.pid)
    assert spent is not None and spent >= 1.95
    assert busy.wait(timeout=30) == 0
    assert quiet.others < 0.1 and quiet.waited_s < 120


#: Busy for two seconds of its own CPU time, saying so when it starts.
BUSY_FOR_A_WHILE = textwrap.dedent(
    """
    import time
    print("busy", flush=True)
    while time.process_time() < 2.0:
        pass
    """
)


def test_a_single_stream_peer_warms_up_on_no_more_sequences_than_it_holds(fake_driver: Path):
    work = workload([100] * 8)
    first = ours(1.0, fake_tokens(work))
    with start_peer(Path(sys.executable), setup(max_num_seqs=1), fake_driver) as peer:
        paired = compare_with_peer(peer, "llama_cpp", [work], first, no_more_runs, no_wait)
    assert paired.is_single_stream and paired.agreements == [1.0]


def test_a_peer_that_fails_at_setup_raises_with_its_log(fake_driver: Path):
    with (
        pytest.raises(PeerError, match="no such model") as raised,
        start_peer(Path(sys.executable), setup("fail-setup"), fake_driver),
    ):
        pass
    assert "boom: no such model" in str(raised.value)  # the log's tail


def test_a_peer_that_exits_without_answering_raises(fake_driver: Path):
    with (
        pytest.raises(PeerError, match=r"exited \(status 3\)"),
        start_peer(Path(sys.executable), setup("exit"), fake_driver),
    ):
        pass


def test_a_peer_that_stops_a_request_early_is_an_error(fake_driver: Path):
    with (
        start_peer(Path(sys.executable), setup("short"), fake_driver) as peer,
        pytest.raises(PeerError, match="generated 2 tokens for request 0, asked 3"),
    ):
        peer.run(workload([1]))


def test_a_missing_peer_venv_says_how_to_make_it(tmp_path: Path):
    with pytest.raises(PeerError, match="make bench-peers"):
        PeerProcess(tmp_path / "no-venv" / "bin" / "python", setup(), tmp_path)


def test_peers_load_the_checkpoint_or_the_gguf_of_the_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    folder = tmp_path / "models" / "m"
    assert peer_model("vllm", folder, "m", "float32", None) == str(folder)
    assert peer_model("llama.cpp", folder, "m", "float32", "/x/m.gguf") == "/x/m.gguf"
    with pytest.raises(PeerError, match="make bench-peers"):
        peer_model("llama.cpp", folder, "m", "float32", None)
    converted = tmp_path / "peers" / "gguf" / "m-bf16.gguf"
    converted.parent.mkdir(parents=True)
    converted.touch()
    assert peer_model("llama.cpp", folder, "m", "bfloat16", None) == str(converted)
    with pytest.raises(PeerError, match="not a known model"):
        peer_model("llama.cpp", folder, "m", "float32", "shipped")


# --- flags and the driver's pieces -----------------------------------------------------------


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_workload_presets_set_the_workload_flags_and_a_flag_given_wins():
    assert _workload_shape(engine_args("--workload", "a")) == (24, (32, 256), 64)
    assert _workload_shape(engine_args("--workload", "c")) == (16, (128, 128), 128)
    assert _workload_shape(engine_args("--workload", "d")) == (1, (128, 128), 256)
    assert _workload_shape(engine_args("--workload", "d", "--max-tokens", "16")) == (
        1,
        (128, 128),
        16,
    )
    assert _workload_shape(engine_args()) == (64, (32, 512), 128)
    assert _workload_shape(engine_args("--tiny")) == (256, (16, 64), 64)


def test_the_peer_steps_at_the_budget_headrace_resolved(tmp_path: Path):
    """With the budget flag left out (0: the device's), the peer gets headrace's budget, not 0."""
    args = engine_args("--baseline", "vllm", "--dtype", "float32", "--peer-python", sys.executable)
    budget = args.max_num_batched_tokens
    engine = SimpleNamespace(
        config=EngineConfig("unused", device="cpu", max_num_batched_tokens=budget)
    )
    _, setup = _peer_setup(args, tmp_path, "unused", engine, [Workload([[1, 2, 3]], [4])])  # type: ignore[arg-type]
    assert setup.max_num_batched_tokens == CPU_STEP_TOKENS


def test_the_peers_context_holds_every_rounds_longest_prompt(tmp_path: Path):
    args = engine_args("--baseline", "vllm", "--dtype", "float32", "--peer-python", sys.executable)
    engine = SimpleNamespace(config=EngineConfig("unused", device="cpu"))
    rounds = [Workload([[1] * 5, [2] * 3], [4, 4]), Workload([[3] * 9, [4] * 2], [4, 4])]
    _, setup = _peer_setup(args, tmp_path, "unused", engine, rounds)  # type: ignore[arg-type]
    assert setup.max_model_len == 9 + 4


def test_peer_flags_parse():
    args = engine_args("--baseline", "llama.cpp", "--peer-cpus", "0-2,5", "--peer-gguf", "x.gguf")
    assert args.baseline == "llama.cpp" and args.peer_cpus == [0, 1, 2, 5]
    assert parse_cpus("3") == [3]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_cpus("0-x")


def test_the_driver_names_cpus_as_vllm_binds_them():
    assert cpu_ranges([0, 1]) == "0-1"
    assert cpu_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_llama_cpp_prefill_batches_want_logits_only_at_each_prompts_end():
    chunks = _prefill_chunks([[10, 11, 12], [20, 21]], n_batch=4)
    assert chunks == [
        [(0, 0, 10, False), (0, 1, 11, False), (0, 2, 12, True), (1, 0, 20, False)],
        [(1, 1, 21, True)],
    ]
