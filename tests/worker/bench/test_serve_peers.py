"""`headrace bench serve --baseline`: the peer's server command, the paired arithmetic, and a
whole run against a fake peer server (a stdlib HTTP server run by this python, standing in
for `vllm serve`), so none of this needs vLLM or llama.cpp installed. No wall-clock time is
asserted: ratios are checked against the reports they came from."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from headrace.sdk.errors import InvalidArgumentError
from headrace.worker.bench import serve
from headrace.worker.bench.cli import serve_arguments
from headrace.worker.bench.common import Report, build_tiny_checkpoint, make_workload
from headrace.worker.bench.peer_driver import cpu_ranges
from headrace.worker.bench.peers import PeerError, PeerSetup
from headrace.worker.bench.serve import worker_flags
from headrace.worker.bench.serve_peers import (
    ServedPairs,
    peer_server_command,
    run_against_peer,
    start_peer_server,
    vocab_size,
)
from headrace.worker.config import CPU_STEP_TOKENS

from tests.worker.bench.processes import no_wait

#: An OpenAI-style server: /v1/models, and streamed /v1/completions whose text is the prompt's
#: last id + 1, + 2, ... as " <id>" pieces, then a usage event, then [DONE], and then it closes
#: the connection (so the load client must open another for its next request); /metrics has
#: vLLM's TTFT, queue and prefill histograms' sums and counts, as if every request it answered
#: had waited 10 ms and prefilled for 20 of a 50 ms TTFT. It records its
#: command line, the environment the bench gave it and every request's body in RECORD (a
#: JSON line each); MODE "exit" leaves at once, as a server that cannot load its model.
FAKE_SERVER = textwrap.dedent(
    """
    import json, os, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    record = open(os.environ["FAKE_RECORD"], "a")
    def note(entry):
        record.write(json.dumps(entry) + "\\n")
        record.flush()

    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    note({"argv": sys.argv[1:], "env": env, "pid": os.getpid(), "pgid": os.getpgid(0)})
    if os.environ.get("FAKE_MODE") == "exit":
        print("cannot load the model: no such file", flush=True)
        sys.exit(2)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    answered, lock = [0], threading.Lock()
    TIMES = {"time_to_first_token": 0.05, "request_queue_time": 0.01, "request_prefill_time": 0.02}

    def metrics():
        lines = []
        for name, each in TIMES.items():
            series = f'vllm:{name}_seconds_%s{{model_name="fake"}} %r'
            lines += [series % ("count", answered[0]), series % ("sum", each * answered[0])]
        return ("\\n".join(lines) + "\\n").encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"data": [{"id": "fake"}]}).encode()
            if self.path == "/metrics":
                body = metrics()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def chunk(self, event):
            data = b"data: " + event + b"\\n\\n"
            self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            note({"request": body})
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            last = body["prompt"][-1]
            for k in range(body["max_tokens"]):
                choice = {"index": 0, "text": f" {last + k + 1}"}
                self.chunk(json.dumps({"choices": [choice]}, separators=(",", ":")).encode())
            usage = {"completion_tokens": body["max_tokens"]}
            self.chunk(json.dumps({"choices": [], "usage": usage}, separators=(",", ":")).encode())
            with lock:  # before the client can see the end
                answered[0] += 1
            self.chunk(b"[DONE]")
            self.wfile.write(b"0\\r\\n\\r\\n")
            self.close_connection = True  # as llama-server does, keep-alive header or not

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the peer venv's python: whatever it is asked to run (``-m
    vllm.entrypoints...``), it runs the fake server with the same arguments."""
    server = tmp_path / "fake_server.py"
    server.write_text(FAKE_SERVER)
    python = tmp_path / "peer-venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {server} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("FAKE_RECORD", str(tmp_path / "record.jsonl"))
    return python


def records(tmp_path: Path) -> list[dict[str, object]]:
    lines = (tmp_path / "record.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def setup(peer: str = "vllm", cpus: tuple[int, ...] = (0, 1)) -> PeerSetup:
    return PeerSetup(peer, "/models/m", "bfloat16", cpus, 256, 1024, 192, 3)


def test_vllm_serves_the_same_model_limits_and_cpus() -> None:
    command, env = peer_server_command(setup(), "m", 8123, Path("/venv/bin/python"), Path("/none"))
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert (flag("--model"), flag("--served-model-name"), flag("--dtype")) == (
        "/models/m",
        "m",
        "bfloat16",
    )
    assert (flag("--port"), flag("--max-num-seqs"), flag("--max-num-batched-tokens")) == (
        "8123",
        "256",
        "1024",
    )
    assert flag("--max-model-len") == "192"
    assert env == {"VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}


def test_llama_server_gets_a_slot_per_sequence_and_a_thread_per_cpu() -> None:
    server = Path("/peers/llamacpp/bin/llama-server")
    command, env = peer_server_command(setup("llama.cpp", (0, 1, 2)), "m", 8124, Path("/p"), server)
    assert command[0] == str(server) and env == {}

    def flag(name: str) -> str:
        return command[command.index(name) + 1]

    assert (flag("--threads"), flag("--threads-batch")) == ("3", "3")
    assert flag("--parallel") == flag("--threads-http") == "256"
    assert flag("--ctx-size") == str(256 * 192)  # every slot a whole sequence
    assert (flag("--batch-size"), flag("--ubatch-size")) == ("1024", "1024")
    assert "--cont-batching" in command


def report(name: str, seconds: float, ttfts: list[float], texts: list[str]) -> Report:
    return Report(name, seconds, 100, ttft_s=ttfts, texts=texts)


def test_served_pairs_ratio_each_pair_and_take_the_medians() -> None:
    ours = [
        report("headrace", 2.0, [0.1, 0.2, 0.3], ["a", "b", "c"]),
        report("headrace", 4.0, [0.4, 0.5, 0.6], ["a", "b", "c"]),
        report("headrace", 1.0, [0.2, 0.2, 0.2], ["a", "b", "c"]),
    ]
    theirs = [
        report("vllm", 1.0, [0.2, 0.4, 0.6], ["a", "x", "c"]),
        report("vllm", 2.0, [1.0, 1.0, 1.0], ["a", "b", "c"]),
        report("vllm", 4.0, [0.1, 0.1, 0.1], ["x", "y", "z"]),
    ]
    pairs = ServedPairs("vllm", ours, theirs)
    assert pairs.ratios == pytest.approx([0.5, 0.5, 4.0])  # tok/s: 50/100, 25/50, 100/25
    assert pairs.ttft_ratios == pytest.approx([0.5, 0.5, 2.0])
    assert pairs.agreements == pytest.approx([2 / 3, 1.0, 0.0])
    summary = pairs.summary()
    assert summary["ratio_vllm"] == 0.5 and summary["ratio_vllm_rounds"] == [0.5, 0.5, 4.0]
    assert summary["ratio_vllm_ttft_p50"] == 0.5
    assert summary["vllm_tok_s"] == 50.0  # the peer's median round
    assert summary["vllm_ttft_p50_ms"] == 400.0  # the median of its rounds' TTFT p50s
    assert summary["vllm_agreement"] == 0.0  # the worst pair
    assert summary["tok_s"] == 50.0  # headrace's median round
    assert "0.50x" in pairs.describe() and "67%, 100%, 0%" in pairs.describe()


def test_a_peer_server_that_exits_is_an_error_with_its_log(
    fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_MODE", "exit")
    server = start_peer_server(setup(cpus=(0,)), "m", fake_python, Path("/none"), timeout_s=60)
    with pytest.raises(PeerError, match="exited with code 2") as error, server:
        pass
    assert "cannot load the model: no such file" in str(error.value)


def test_a_missing_peer_is_an_error_naming_how_to_make_it(tmp_path: Path) -> None:
    vllm = start_peer_server(setup(), "m", tmp_path / "no" / "python", Path("/none"))
    with pytest.raises(PeerError, match="make bench-peers"), vllm:
        pass
    llama = start_peer_server(setup("llama.cpp"), "m", Path("/p"), tmp_path / "llama-server")
    with pytest.raises(PeerError, match="llama-server"), llama:
        pass


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_arguments(parser)
    return parser.parse_args(list(argv))


def test_served_against_a_peer_same_prompts_each_pair_new_ones_each_round(
    fake_python: Path, tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """headrace's own servers (a tiny model) and the fake peer take turns; each round's
    prompts reach the peer as the workload of that round's seed made them."""
    model = build_tiny_checkpoint(tmp_path / "tiny", smollm2_dir)
    args = serve_args(
        "--model", str(model), "--baseline", "vllm", "--peer-python", str(fake_python),
        "--num-requests", "4", "--prompt-lens", "8-12", "--output-lens", "5", "--rounds", "2",
        "--seed", "7",
    )  # fmt: skip
    summary = run_against_peer(args, no_wait)

    log = records(tmp_path)
    started, requests = log[0], [entry["request"] for entry in log[1:]]
    assert isinstance(started, dict)
    argv = started["argv"]
    assert isinstance(argv, list)
    assert argv[argv.index("--model") + 1] == str(model)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == str(CPU_STEP_TOKENS)
    assert started["env"] == {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_ranges(tuple(sorted(os.sched_getaffinity(0)))),
    }
    # The load client's warm-up (one per connection), then the round's four prompts.
    vocab = vocab_size(model)
    for round_no in range(2):
        workload = make_workload(vocab, 4, (8, 12), (5, 5), 7 + round_no)
        sent = requests[round_no * 8 + 4 : round_no * 8 + 8]
        assert sorted(r["prompt"] for r in sent) == sorted(workload.prompts)
        assert all(r["ignore_eos"] and r["temperature"] == 0 and r["stream"] for r in sent)
    assert make_workload(vocab, 4, (8, 12), (5, 5), 7).prompts != (
        make_workload(vocab, 4, (8, 12), (5, 5), 8).prompts
    )
    # Gone with its process group.
    pgid = started["pgid"]
    assert isinstance(pgid, int)
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)

    assert summary["baseline"] == "vllm" and summary["num_tokens"] == 4 * 5
    assert len(summary["ratio_vllm_rounds"]) == 2
    # Each side's metrics, read around its load: its four requests, not the warm-up's.
    assert summary["vllm_server_requests"] == summary["worker_server_requests"] == 4
    assert (summary["vllm_queue_mean_ms"], summary["vllm_prefill_mean_ms"]) == (10.0, 20.0)
    assert summary["vllm_server_ttft_mean_ms"] == 50.0
    queue, prefill = summary["worker_queue_mean_ms"], summary["worker_prefill_mean_ms"]
    assert 0 < queue + prefill <= summary["worker_server_ttft_mean_ms"]
    # Four 5-token requests: a prompt step for each at most, and 4 decode steps at least.
    assert 1 <= summary["worker_prompt_steps"] <= 4 and summary["worker_decode_steps"] >= 4
    assert 0 < summary["worker_busy"] <= 1
    assert summary["vllm_agreement"] == 0.0  # a tiny random model's text is not the fake's
    out = capsys.readouterr().out
    assert "headrace / vllm tok/s" in out and "headrace / vllm TTFT p50" in out


def test_worker_args_come_after_the_bench_flags_and_make_its_engine(tmp_path: Path) -> None:
    """`bench serve --worker-args`: the worker's flags, later ones winning as the worker's
    parser takes them, and the in-process engine those flags make."""
    model = str(tmp_path / "model")  # only named: no engine is built
    args = serve_args(
        "--dtype", "bfloat16", "--worker-args", "--scheduling-policy fcfs --max-num-seqs 7"
    )
    flags, config = worker_flags(args, model, 256)
    assert flags == [
        "--dtype", "bfloat16", "--max-num-seqs", "256", "--scheduling-policy", "fcfs",
        "--max-num-seqs", "7",
    ]  # fmt: skip
    assert (config.model, config.dtype) == (model, "bfloat16")
    assert (config.scheduling_policy, config.max_num_seqs) == ("fcfs", 7)
    # None given: the worker's defaults, as `headrace worker` alone would run.
    _, plain = worker_flags(serve_args(), model, 300)
    assert (plain.scheduling_policy, plain.max_num_seqs) == ("shortest-first", 300)


def test_a_bad_worker_arg_is_refused_by_name_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for flags, named in (("--no-such-flag", "--no-such-flag"), ("--max-num-seqs x", "x")):
        args = serve_args(f"--worker-args={flags}")  # (a lone flag needs the = form)
        with pytest.raises(SystemExit) as exit_:
            worker_flags(args, str(tmp_path), 256)
        assert exit_.value.code == 2
        assert named in capsys.readouterr().err


def test_worker_args_with_a_target_are_refused_by_name() -> None:
    args = serve_args("--target", "localhost:1", "--worker-args", "--max-num-seqs 1")
    with pytest.raises(InvalidArgumentError, match="--worker-args"):
        serve.run(args)


def test_served_with_worker_args_the_worker_runs_them_and_the_peer_gets_its_limits(
    fake_python: Path, tmp_path: Path, smollm2_dir: Path
) -> None:
    """--worker-args "--max-num-seqs 1": the worker runs the four requests one at a time (a
    prompt step and four decode steps each, read from its metrics), and the peer is given the
    same one sequence."""
    model = build_tiny_checkpoint(tmp_path / "tiny", smollm2_dir)
    args = serve_args(
        "--model", str(model), "--baseline", "vllm", "--peer-python", str(fake_python),
        "--num-requests", "4", "--prompt-lens", "8-12", "--output-lens", "5", "--rounds", "1",
        "--worker-args", "--max-num-seqs 1",
    )  # fmt: skip
    summary = run_against_peer(args, no_wait)
    argv = records(tmp_path)[0]["argv"]
    assert isinstance(argv, list)
    assert argv[argv.index("--max-num-seqs") + 1] == "1"
    assert summary["worker_prompt_steps"] == 4 and summary["worker_decode_steps"] == 4 * 4
