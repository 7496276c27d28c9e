"""Live weight updates over gRPC, with real worker and router processes.

Two random-weight checkpoints A and B of one shape. A worker serving A (one rank, and one
split TP=2 x PP=2) is updated from disk, from streamed tensors and from a separate trainer
process's gloo broadcast, and then serves exactly the offline `LLM(B)` tokens with the
version on every chunk. Pause modes act on requests in flight; a rejected update leaves A
serving; through a router one call updates every worker, and a failover never resumes a
request on other weights.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from headrace.protos import control_pb2
from headrace.sdk import Client, GenerationConfig, InvalidArgumentError, UnavailableError
from headrace.sdk.outputs import FinishReason, StreamChunk
from headrace.sdk.weights import GenerationState
from headrace.worker.engine.llm import LLM
from safetensors.torch import load_file

from tests.e2e.processes import (
    ServerProcess,
    load_report,
    start_router,
    start_worker,
    wait_all_blocks_free,
    wait_serving,
)
from tests.factories import cached_checkpoint

PROMPTS = ["the quick brown fox", "a story about the sea"]
GREEDY = GenerationConfig(max_tokens=16, temperature=0.0, ignore_eos=True)
LONG = GenerationConfig(max_tokens=400, temperature=0.0, ignore_eos=True)

#: A trainer process: joins the weights group of the server at argv[1] as rank 0, then
#: broadcasts the checkpoint at argv[3] as version argv[4].
TRAINER = textwrap.dedent(
    """
    import socket, sys
    from headrace.sdk import Client
    from headrace.worker.distributed.trainer import TrainerGroup
    from safetensors.torch import load_file

    target, port, checkpoint, version = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with Client(target) as client, TrainerGroup.connect(client, "127.0.0.1", port) as group:
        report = group.update(client, load_file(checkpoint).items(), version)
    print("versions", *sorted({w.weight_version for w in report.workers}), flush=True)
    """
)


@pytest.fixture(scope="module")
def checkpoint_b() -> Path:
    return cached_checkpoint("llama", max_position_embeddings=512, seed=1)


@pytest.fixture(scope="module")
def offline_b(checkpoint_b: Path) -> LLM:
    return LLM(str(checkpoint_b))


def greedy_tokens(llm: LLM) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(PROMPTS, GREEDY)]  # type: ignore[arg-type]


def served(client: Client) -> tuple[list[list[int]], set[str]]:
    """The tokens the server generates for PROMPTS, and the versions on their chunks."""
    tokens, versions = [], set()
    for prompt in PROMPTS:
        chunks = list(client.stream(prompt, GREEDY))
        tokens.append([t for c in chunks for t in c.token_ids])
        versions |= {c.weight_version for c in chunks}
    return tokens, versions


def safetensors_of(checkpoint: Path) -> Path:
    return checkpoint / "model.safetensors"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_trainer(target: str, checkpoint: Path, version: str) -> str:
    """A separate trainer process broadcasts ``checkpoint``; what it printed."""
    args = [target, str(free_port()), str(safetensors_of(checkpoint)), version]
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.parametrize("sizes", [(), ("-tp", "2", "-pp", "2")], ids=["one-rank", "tp2-pp2"])
def test_a_worker_updated_three_ways_serves_exactly_the_new_weights(
    tiny_model: Path,
    checkpoint_b: Path,
    offline: LLM,
    offline_b: LLM,
    tmp_path: Path,
    sizes: tuple[str, ...],
) -> None:
    want_a, want_b = greedy_tokens(offline), greedy_tokens(offline_b)
    assert want_a != want_b
    with start_worker(tiny_model, tmp_path, *sizes) as worker, Client(worker.target) as client:
        assert served(client) == (want_a, {"default"})
        report = client.update_weights(str(checkpoint_b), version="b-disk")
        assert report.weight_version == "b-disk" and report.num_ranks == (4 if sizes else 1)
        assert served(client) == (want_b, {"b-disk"})
        client.update_weights_from_tensors(
            load_file(str(safetensors_of(tiny_model))).items(), "a-streamed", chunk_bytes=50_000
        )
        assert served(client) == (want_a, {"a-streamed"})
        assert "versions b-group" in run_trainer(worker.target, checkpoint_b, "b-group")
        assert served(client) == (want_b, {"b-group"})
        assert load_report(worker.target).weight_version == "b-group"


@pytest.fixture(scope="module")
def own_worker(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A worker serving A that these tests may pause, update and put to sleep."""
    with start_worker(tiny_model, tmp_path_factory.mktemp("own-worker")) as worker:
        yield worker


class Streaming:
    """A long request streamed on a thread; its chunks so far, and how it ended."""

    def __init__(self, client: Client, prompt: str) -> None:
        self.chunks: list[StreamChunk] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, args=(client, prompt), daemon=True)
        self._thread.start()

    def _read(self, client: Client, prompt: str) -> None:
        try:
            for chunk in client.stream(prompt, LONG):
                self.chunks.append(chunk)
        except BaseException as error:
            self.error = error

    def wait_for_tokens(self, num_tokens: int = 3) -> None:
        deadline = time.monotonic() + 30
        while len(self.tokens) < num_tokens and time.monotonic() < deadline:
            time.sleep(0.005)
        assert len(self.tokens) >= num_tokens

    def join(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive()

    @property
    def tokens(self) -> list[int]:
        return [t for c in list(self.chunks) for t in c.token_ids]

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.chunks[-1].finish_reason if self.chunks else None


def a_prefix(offline: LLM, prompt: str, num_tokens: int) -> list[int]:
    config = GenerationConfig(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    return offline.generate(prompt, config)[0].token_ids


@pytest.fixture
def client(own_worker: ServerProcess, tiny_model: Path) -> Iterator[Client]:
    """A client of `own_worker`, which is left serving A ("default") whatever the test did."""
    with Client(own_worker.target) as client:
        yield client
        client.wake_up()
        client.resume()
        client.update_weights(str(tiny_model), "default")
        report = wait_all_blocks_free(own_worker.target)
        assert report.free_kv_blocks == report.total_kv_blocks


def test_keep_paused_requests_continue_after_an_update_and_abort_ends_them(
    client: Client, own_worker: ServerProcess, checkpoint_b: Path, offline: LLM, offline_b: LLM
) -> None:
    kept = Streaming(client, PROMPTS[0])
    kept.wait_for_tokens()
    assert client.pause("keep").workers[0].state == GenerationState.PAUSED
    time.sleep(0.2)  # chunks already on their way arrive
    frozen = len(kept.tokens)
    time.sleep(0.3)
    assert len(kept.tokens) == frozen  # frozen, not aborted
    assert load_report(own_worker.target).state == control_pb2.GENERATION_STATE_PAUSED
    client.update_weights(str(checkpoint_b), "b")
    client.resume()
    kept.join()
    assert kept.error is None and kept.finish_reason == FinishReason.LENGTH
    assert len(kept.tokens) == LONG.max_tokens
    assert kept.tokens[:frozen] == a_prefix(offline, PROMPTS[0], frozen)
    versions = [c.weight_version for c in kept.chunks]
    switch = versions.index("b")
    assert set(versions[:switch]) == {"default"} and set(versions[switch:]) == {"b"}

    aborted = Streaming(client, PROMPTS[1])
    aborted.wait_for_tokens()
    client.pause("abort")
    aborted.join()
    assert aborted.error is None and aborted.finish_reason == FinishReason.ABORT
    assert 3 <= len(aborted.tokens) < LONG.max_tokens
    assert aborted.tokens == a_prefix(offline_b, PROMPTS[1], len(aborted.tokens))  # B's now


def test_wait_drains_and_new_requests_queue_until_resume(
    client: Client, own_worker: ServerProcess
) -> None:
    running = Streaming(client, PROMPTS[0])
    running.wait_for_tokens()
    client.pause("wait")  # returns once the request has finished
    assert load_report(own_worker.target).running_requests == 0
    running.join()
    assert running.finish_reason == FinishReason.LENGTH and len(running.tokens) == 400
    queued = Streaming(client, PROMPTS[1])
    time.sleep(0.5)
    assert queued.chunks == [] and load_report(own_worker.target).waiting_requests == 1
    client.resume()
    queued.join()
    assert len(queued.tokens) == LONG.max_tokens


def test_a_rejected_update_leaves_the_worker_serving_a_unchanged(
    client: Client, tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    bad = load_file(str(safetensors_of(tiny_model)))
    bad["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 65)
    with pytest.raises(InvalidArgumentError, match=r"layers\.1\.self_attn\.o_proj\.weight") as no:
        client.update_weights_from_tensors(bad.items(), "bad")
    assert no.value.field == "weights"
    with pytest.raises(InvalidArgumentError, match="is not a directory"):
        client.update_weights(str(tmp_path / "missing"), "bad")
    assert served(client) == (greedy_tokens(offline), {"default"})


def test_grpc_36066_a_refusal_early_in_a_long_upload_answers_its_status_never_internal(
    client: Client, offline: LLM
) -> None:
    """A tensor refused at the start of a 16 MB upload: the worker reads the rest before it
    answers, so the SDK gets INVALID_ARGUMENT naming the tensor every time, never the
    INTERNAL grpcio's aio client reports when a write fails after the server answered."""
    upload = [
        ("model.layers.1.self_attn.o_proj.weight", torch.zeros(64, 65)),
        ("model.embed_tokens.weight", torch.zeros(1024, 4096)),
    ]
    for _ in range(40):
        with pytest.raises(InvalidArgumentError, match=r"layers\.1\.self_attn\.o_proj"):
            client.update_weights_from_tensors(upload, "bad")
    assert served(client) == (greedy_tokens(offline), {"default"})


def test_sleep_refuses_requests_until_wake_up(client: Client, offline: LLM) -> None:
    assert client.sleep().workers[0].state == GenerationState.ASLEEP
    with pytest.raises(UnavailableError, match="asleep") as refused:
        client.generate(PROMPTS[0], GREEDY)
    assert refused.value.retry_after_s == 1.0
    client.wake_up()
    assert served(client)[0] == greedy_tokens(offline)


# --- through a router --------------------------------------------------------------------


def _workers_and_router(
    model: Path, logs: Path, count: int = 2
) -> tuple[list[ServerProcess], ServerProcess]:
    workers = []
    for i in range(count):
        folder = logs / f"worker-{i}"
        folder.mkdir()
        workers.append(start_worker(model, folder))
    router = start_router([w.target for w in workers], log_path=logs / "router.log")
    assert wait_serving(router.target)
    return workers, router


def test_one_call_through_the_router_updates_every_worker_or_none(
    tiny_model: Path, checkpoint_b: Path, offline_b: LLM, tmp_path: Path
) -> None:
    workers, router = _workers_and_router(tiny_model, tmp_path)
    with workers[0], workers[1], router, Client(router.target) as client:
        report = client.update_weights(str(checkpoint_b), "b")
        assert sorted(w.worker for w in report.workers) == sorted(w.target for w in workers)
        assert {w.weight_version for w in report.workers} == {"b"}
        for worker in workers:  # each worker on its own serves B
            with Client(worker.target) as direct:
                assert served(direct) == (greedy_tokens(offline_b), {"b"})
        bad = load_file(str(safetensors_of(tiny_model)))
        del bad["model.norm.weight"]
        with pytest.raises(InvalidArgumentError, match=r"missing weights: model\.norm\.weight"):
            client.update_weights_from_tensors(bad.items(), "bad")
        assert client.weight_version() == "b"  # neither worker took it
        client.pause("keep")
        waiting = Streaming(client, PROMPTS[0])
        time.sleep(0.5)
        assert waiting.chunks == []  # held in the router's queue while the workers pause
        client.resume()
        waiting.join()
        assert {c.weight_version for c in waiting.chunks} == {"b"}
        client.sleep()
        with pytest.raises(UnavailableError):
            client.generate(PROMPTS[0], GREEDY)
        client.wake_up()
        assert served(client)[0] == greedy_tokens(offline_b)


def test_issue_30_the_readme_sequence_through_a_router_on_127_0_0_1_reached_as_localhost(
    tiny_model: Path, offline: LLM, tmp_path: Path
) -> None:
    """Issue 30 as reported: against a router bound to 127.0.0.1 and reached as localhost
    (gRPC tries ::1 first, is refused, and connects on 127.0.0.1), after a request, the
    README's sequence hung in `update_weights_from_tensors`. Here it runs three times, each
    upload in many small chunks, and the next request runs on the streamed weights. The hang
    needed a worker reading later than the client sent, which real processes give only by
    chance: tests/router/test_generation_control.py pins it."""
    workers, router = _workers_and_router(tiny_model, tmp_path, count=1)
    tensors = load_file(str(safetensors_of(tiny_model)))
    with workers[0], router, Client(f"localhost:{router.port}") as client:
        assert served(client)[0] == greedy_tokens(offline)
        for round_ in range(3):
            client.pause(mode="keep")
            client.update_weights(path=str(tiny_model), version=f"disk-{round_}")
            report = client.update_weights_from_tensors(
                tensors.items(), version=f"streamed-{round_}", chunk_bytes=20_000
            )
            assert report.weight_version == f"streamed-{round_}"
            client.resume()
        assert served(client) == (greedy_tokens(offline), {"streamed-2"})


def _worker_running_one_request(workers: list[ServerProcess]) -> ServerProcess:
    """The worker whose load report shows the one running request. Reports are sent on a
    cadence, so the first look may predate the request (regression: a CI run under load
    found no worker running it): look again until one does."""
    deadline = time.monotonic() + 10
    while True:
        running = [w for w in workers if load_report(w.target).running_requests == 1]
        if len(running) == 1 or time.monotonic() > deadline:
            (holder,) = running
            return holder
        time.sleep(0.02)


def test_a_failover_never_resumes_a_request_on_other_weights(
    tiny_model: Path, checkpoint_b: Path, offline: LLM, tmp_path: Path
) -> None:
    """A worker dies mid-stream while the only other one serves another version: the request
    fails with UNAVAILABLE after A's tokens, rather than going on with B's."""
    workers, router = _workers_and_router(tiny_model, tmp_path)
    with workers[0], workers[1], router, Client(router.target) as client:
        request = Streaming(client, PROMPTS[0])
        request.wait_for_tokens(5)
        holder = _worker_running_one_request(workers)
        (other,) = [w for w in workers if w is not holder]
        # Stopped, so the request cannot finish while B changes version (400 tokens of a tiny
        # model take about a second).
        holder.proc.send_signal(signal.SIGSTOP)
        with Client(other.target) as direct:
            direct.update_weights(str(checkpoint_b), "b")
        time.sleep(0.5)  # the router's load reports catch up
        holder.proc.send_signal(signal.SIGKILL)
        request.join()
        assert isinstance(request.error, UnavailableError)
        assert "weight version 'default'" in str(request.error)
        assert request.tokens == a_prefix(offline, PROMPTS[0], len(request.tokens))
        assert {c.weight_version for c in request.chunks} == {"default"}
        holder.kill()
