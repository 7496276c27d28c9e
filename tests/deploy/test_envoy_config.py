"""deploy/envoy/envoy.yaml: Envoy itself accepts it, its timeouts leave deadlines to the
client, and it checks the router's TLS certificate."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.certs import CertificateAuthority
from tests.deploy.manifests import (
    DEPLOY,
    SAFE_RETRY_ON,
    envoy_binary,
    envoy_config,
    envoy_config_with_ca,
    router_tls,
)


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.fixture
def router_ca(tmp_path: Path) -> Path:
    """A real CA file where the shipped config expects the router's (validation reads it)."""
    return CertificateAuthority(tmp_path / "pki", "router-ca").cert


def test_envoy_validates_the_config_as_shipped_and_as_tested(
    tmp_path: Path, router_ca: Path
) -> None:
    shipped = tmp_path / "shipped.yaml"
    shipped.write_text(yaml.safe_dump(envoy_config_with_ca(router_ca)))
    result = _validate(shipped)
    assert result.returncode == 0, result.stdout + result.stderr
    loopback = tmp_path / "envoy.yaml"
    loopback.write_text(yaml.safe_dump(envoy_config(18080, 50051, 19901, router_ca)))
    tested = _validate(loopback)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_envoy_rejects_a_broken_config(tmp_path: Path, router_ca: Path) -> None:
    config = envoy_config(18080, 50051, 19901, router_ca)
    config["static_resources"]["clusters"][0]["lb_policy"] = "FASTEST"
    broken = tmp_path / "envoy.yaml"
    broken.write_text(yaml.safe_dump(config))
    assert _validate(broken).returncode != 0


def test_envoy_checks_the_routers_certificate_against_the_service_name() -> None:
    config = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    (cluster,) = config["static_resources"]["clusters"]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    service = endpoint["address"]["socket_address"]["address"]
    tls = router_tls(config)
    assert tls["@type"].endswith("UpstreamTlsContext") and tls["sni"] == service
    validation = tls["common_tls_context"]["validation_context"]
    assert validation["trusted_ca"]["filename"]
    (san,) = validation["match_typed_subject_alt_names"]
    assert san == {"san_type": "DNS", "matcher": {"exact": service}}
    assert tls["common_tls_context"]["alpn_protocols"] == ["h2"]


def test_deadlines_stay_the_clients_and_retries_cannot_run_a_generation_twice(
    router_ca: Path,
) -> None:
    config = envoy_config(18080, 50051, 19901, router_ca)
    (manager,) = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    assert manager["typed_config"]["codec_type"] == "HTTP2"
    (route,) = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"  # not Envoy's 15 s default
    # Envoy does not run the client's grpc-timeout as its own timer: mid-stream it could only
    # reset the stream (INTERNAL), so the client and the router keep the deadline.
    assert "max_stream_duration" not in route["route"]
    assert "max_grpc_timeout" not in route["route"]
    assert set(route["route"]["retry_policy"]["retry_on"].split(",")) <= SAFE_RETRY_ON
    # Idle multiplexed streams survive Envoy's 5-minute default.
    idle_s = float(manager["typed_config"]["stream_idle_timeout"].removesuffix("s"))
    assert idle_s == 0 or idle_s >= 1800
    (cluster,) = config["static_resources"]["clusters"]
    assert cluster["health_checks"][0]["grpc_health_check"] == {}
    options = cluster["typed_extension_protocol_options"]
    http = options["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert "http2_protocol_options" in http["explicit_http_config"]
