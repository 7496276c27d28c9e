"""Security with real processes and real certificates: TLS refuses plaintext, mTLS refuses a
client without the CA's certificate, keys are checked (UNAUTHENTICATED, PERMISSION_DENIED for
a priority above the ceiling or a non-admin drain, RESOURCE_EXHAUSTED over a key's
concurrency), certificates rotate without a restart, and the router talks TLS + a key to its
workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from headrace.protos import generation_pb2 as pb
from headrace.protos import generation_pb2_grpc, worker_pb2, worker_pb2_grpc
from headrace.sdk.client import Client
from headrace.sdk.config import GenerationConfig
from headrace.sdk.credentials import API_KEY_ENV, bearer_metadata
from headrace.sdk.errors import (
    HeadraceError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
)
from headrace.sdk.launch import start_router
from headrace.sdk.outputs import GenerationResult
from headrace.sdk.status import duration
from headrace.worker.engine.llm import LLM

from tests.e2e.processes import ServerProcess, start_worker, wait_serving
from tests.e2e.security import (
    CEILING,
    CLIENT_KEY,
    MAX_CONCURRENCY,
    OPS_KEY,
    ROUTER_KEY,
    Pki,
    served_certificate_serial,
)

GREEDY = GenerationConfig(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = GenerationConfig(max_tokens=400, temperature=0.0, ignore_eos=True)


def _health_code(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    """What a model-info call without a key answers: proves the handshake got through."""
    channel = (
        grpc.insecure_channel(target)
        if credentials is None
        else grpc.secure_channel(target, credentials)
    )
    with channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        try:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_tls_servers_refuse_plaintext(
    secure_worker: ServerProcess, secure_router: ServerProcess, pki: Pki
) -> None:
    for server, cert in ((secure_worker, pki.tester), (secure_router, None)):
        assert _health_code(server.target, None) == grpc.StatusCode.UNAVAILABLE
        # Over TLS the same call reaches the server, which then asks for a key.
        tls = pki.channel_credentials(cert)
        assert _health_code(server.target, tls) == grpc.StatusCode.UNAUTHENTICATED
        # Probes that speak no TLS use the plaintext health port.
        assert wait_serving(f"127.0.0.1:{server.health_port}", timeout_s=10)


def test_mtls_refuses_a_client_without_a_certificate_from_its_ca(
    secure_worker: ServerProcess, pki: Pki
) -> None:
    for cert in (None, pki.stranger):
        code = _health_code(secure_worker.target, pki.channel_credentials(cert))
        assert code == grpc.StatusCode.UNAVAILABLE, cert
    with pki.client(secure_worker.target, ROUTER_KEY, cert=pki.tester) as client:
        assert len(client.generate("hello", GREEDY).token_ids) == 8


@pytest.mark.parametrize("api_key", [None, "wrong-key-0123456789abcdef"], ids=["none", "wrong"])
def test_a_missing_or_wrong_key_is_unauthenticated(
    secure_worker: ServerProcess, secure_router: ServerProcess, pki: Pki, api_key: str | None
) -> None:
    for target, cert in ((secure_worker.target, pki.tester), (secure_router.target, None)):
        with (
            pki.client(target, api_key, cert=cert) as client,
            pytest.raises(UnauthenticatedError),
        ):
            client.generate("hello", GREEDY)


def test_a_refused_stream_reports_its_status_not_a_write_race(
    secure_worker: ServerProcess, pki: Pki
) -> None:
    """The refusal must reach the client as UNAUTHENTICATED every time: an asyncio client
    whose first write is in flight when the status lands used to see INTERNAL "Internal error
    from Core" instead (grpc/grpc#36066; about 1 call in 100 here), until the refusal began
    to read the stream's first message before ending the call."""
    outcomes = []
    for _ in range(100):
        with pki.client(secure_worker.target, None, cert=pki.tester) as client:
            try:
                client.generate("hello", GREEDY)
            except HeadraceError as error:
                outcomes.append(type(error).__name__)
    assert outcomes == ["UnauthenticatedError"] * 100


def test_a_priority_above_the_keys_ceiling_is_refused(
    secure_router: ServerProcess, pki: Pki
) -> None:
    with pki.client(secure_router.target, CLIENT_KEY) as client:
        with pytest.raises(PermissionDeniedError, match=f"above the ceiling .*\\({CEILING}\\)"):
            client.generate("hello", GREEDY, priority=CEILING + 1)
        assert len(client.generate("hello", GREEDY, priority=CEILING).token_ids) == 8
    with pki.client(secure_router.target, OPS_KEY) as client:  # no ceiling on this key
        assert len(client.generate("hello", GREEDY, priority=100).token_ids) == 8


def test_a_key_over_its_concurrency_gets_resource_exhausted_with_retry_info(
    secure_router: ServerProcess, pki: Pki
) -> None:
    with pki.client(secure_router.target, CLIENT_KEY) as client:
        streams = [client.stream(f"long {i}", LONG) for i in range(MAX_CONCURRENCY)]
        for stream in streams:
            next(stream)  # both are in flight
        with pytest.raises(ResourceExhaustedError) as caught:
            client.generate("one too many", GREEDY)
        assert caught.value.retry_after_s == 1.0
        for stream in streams:
            stream.close()  # cancels: their slots come back once their last chunks went out
        assert len(_generate_when_there_is_room(client).token_ids) == 8


def _generate_when_there_is_room(client: Client, timeout_s: float = 10.0) -> GenerationResult:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.generate("now there is room", GREEDY)
        except ResourceExhaustedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _drain(target: str, api_key: str | None) -> worker_pb2.DrainResponse:
    with grpc.insecure_channel(target) as channel:
        control = worker_pb2_grpc.WorkerControlStub(channel)
        grace = worker_pb2.DrainRequest(grace=duration(1.0))
        return control.Drain(grace, metadata=bearer_metadata(api_key), timeout=30)


@pytest.fixture
def keys_only_worker(tiny_model: Path, pki: Pki, tmp_path: Path) -> Iterator[ServerProcess]:
    """Plaintext with API keys (as behind a mesh's mTLS): drained by the test, so its own."""
    keys = pki.write("plain-keys.txt", f"{ROUTER_KEY} name=router\n{OPS_KEY} name=ops admin\n")
    with start_worker(tiny_model, tmp_path, "--api-key-file", str(keys)) as process:
        yield process


def test_drain_needs_an_admin_key(keys_only_worker: ServerProcess) -> None:
    target = keys_only_worker.target
    for api_key, code in ((None, "UNAUTHENTICATED"), (ROUTER_KEY, "PERMISSION_DENIED")):
        with pytest.raises(grpc.RpcError) as caught:
            _drain(target, api_key)
        assert caught.value.code().name == code
    with Client(target, api_key=ROUTER_KEY) as client:  # not drained by the refusals
        assert len(client.generate("hello", GREEDY).token_ids) == 8
    assert _drain(target, OPS_KEY).remaining_requests == 0
    assert not wait_serving(target, timeout_s=1)  # drained: NOT_SERVING


def test_a_rotated_certificate_is_served_without_a_restart(
    secure_worker: ServerProcess, secure_router: ServerProcess, pki: Pki
) -> None:
    port = secure_worker.port
    before = served_certificate_serial(port, pki, pki.tester)
    assert before == pki.worker.serial
    rotated = pki.rotate(pki.worker, "worker-rotated")
    assert served_certificate_serial(port, pki, pki.tester) == rotated.serial != before
    with pki.client(secure_worker.target, ROUTER_KEY, cert=pki.tester) as client:
        assert len(client.generate("after rotation", GREEDY).token_ids) == 8
    assert secure_worker.proc.poll() is None  # the same process
    with pki.client(secure_router.target, CLIENT_KEY) as client:  # the router's link too
        assert len(client.generate("after rotation", GREEDY).token_ids) == 8


def test_the_router_talks_tls_and_a_key_to_its_workers(
    secure_router: ServerProcess, pki: Pki, offline: LLM
) -> None:
    with pki.client(secure_router.target, CLIENT_KEY) as client:
        got = client.generate("the router's path", GREEDY)
        info = client.model_info()
    assert got.token_ids == offline.generate("the router's path", GREEDY)[0].token_ids
    assert info.max_model_len == 512  # GetModelInfo went through to the worker


@pytest.mark.parametrize(
    ("worker_key", "client_cert", "logged"),
    [(None, True, "refused the router"), (ROUTER_KEY, False, "")],
    ids=["without-key", "without-client-certificate"],
)
def test_a_router_the_worker_does_not_accept_never_serves(
    secure_worker: ServerProcess,
    pki: Pki,
    tmp_path: Path,
    worker_key: str | None,
    client_cert: bool,
    logged: str,
) -> None:
    args = pki.router_args(worker_key=worker_key, client_cert=client_cert)
    log = tmp_path / "router.log"
    with start_router([secure_worker.target], *args, log_path=log) as router:
        assert not wait_serving(f"127.0.0.1:{router.health_port}", timeout_s=3)
    assert logged in log.read_text()


def test_headrace_generate_over_tls_with_the_key_from_the_environment(
    secure_router: ServerProcess, pki: Pki
) -> None:
    argv = [sys.executable, "-m", "headrace.sdk.cli", "generate", "hello", "--max-tokens", "4"]
    argv += ["--target", secure_router.target, "--tls-ca", str(pki.ca.cert), "--json"]
    env = {**os.environ, API_KEY_ENV: CLIENT_KEY}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert '"finished": true' in done.stdout.splitlines()[-1]
    env.pop(API_KEY_ENV)
    refused = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1 and "API key is required" in refused.stderr


def test_an_open_server_beyond_loopback_warns_and_a_guarded_one_does_not(
    worker: ServerProcess, pki: Pki, tmp_path: Path
) -> None:
    keys = pki.write("warn-keys.txt", f"{CLIENT_KEY}\n")
    for name, args, warned in (("open", [], True), ("keys", ["--api-key-file", str(keys)], False)):
        log = tmp_path / f"{name}.log"
        with start_router([worker.target], *args, log_path=log, host="0.0.0.0"):
            pass
        lines = [line for line in log.read_text().splitlines() if "without API keys" in line]
        assert len(lines) == int(warned), name


def test_refusals_are_logged_with_the_key_name_and_never_the_key(
    secure_router: ServerProcess, pki: Pki
) -> None:
    wrong = "wrong-but-logged-never-0123456789"
    with pki.client(secure_router.target, wrong) as client, pytest.raises(UnauthenticatedError):
        client.generate("hello", GREEDY)
    with (
        pki.client(secure_router.target, CLIENT_KEY) as client,
        pytest.raises(PermissionDeniedError),
    ):
        client.generate("hello", GREEDY, priority=CEILING + 1)
    assert secure_router.log_path is not None
    log = secure_router.log_path.read_text()
    assert "refused /headrace.v1.Generation/Generate" in log and "key 'client'" in log
    for secret in (wrong, CLIENT_KEY, OPS_KEY, ROUTER_KEY):
        assert secret not in log


def test_generation_control_needs_an_admin_key_on_worker_and_router(
    secure_worker: ServerProcess, secure_router: ServerProcess, pki: Pki
) -> None:
    """Pause, weight updates, sleep: admin only. The router forwards a control call with its
    own key at the workers, so that key must be admin there too: this router's is not."""
    with pki.client(secure_worker.target, ROUTER_KEY, cert=pki.tester) as client:
        with pytest.raises(PermissionDeniedError):
            client.pause("keep")
        with pytest.raises(PermissionDeniedError):
            client.weight_version()
    with pki.client(secure_worker.target, OPS_KEY, cert=pki.tester) as client:
        assert client.weight_version() == "default"
    with (
        pki.client(secure_router.target, CLIENT_KEY) as client,
        pytest.raises(PermissionDeniedError),
    ):
        client.sleep()
    with pki.client(secure_router.target, OPS_KEY) as client:
        with pytest.raises(PermissionDeniedError, match=secure_worker.target):
            client.sleep()  # admitted by the router; refused by the worker (router's key)
        assert len(client.generate("still serving", GREEDY).token_ids) == 8
