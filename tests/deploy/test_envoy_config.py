"""deploy/envoy/envoy.yaml: Envoy itself accepts it, and its timeouts leave deadlines to the
client."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from tests.deploy.manifests import DEPLOY, envoy_binary, envoy_config


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_envoy_validates_the_config_as_shipped_and_as_tested(tmp_path: Path) -> None:
    shipped = _validate(DEPLOY / "envoy" / "envoy.yaml")
    assert shipped.returncode == 0, shipped.stdout + shipped.stderr
    loopback = tmp_path / "envoy.yaml"
    loopback.write_text(yaml.safe_dump(envoy_config(18080, 50051, 19901)))
    tested = _validate(loopback)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_envoy_rejects_a_broken_config(tmp_path: Path) -> None:
    config = envoy_config(18080, 50051, 19901)
    config["static_resources"]["clusters"][0]["lb_policy"] = "FASTEST"
    broken = tmp_path / "envoy.yaml"
    broken.write_text(yaml.safe_dump(config))
    assert _validate(broken).returncode != 0


def test_routes_have_no_timeout_and_retry_only_connection_failures() -> None:
    config = envoy_config(18080, 50051, 19901)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (route,) = manager["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["timeout"] == "0s"
    assert "max_stream_duration" not in route["route"]  # the client's grpc-timeout rules
    assert set(route["route"]["retry_policy"]["retry_on"].split(",")) <= {
        "connect-failure",
        "refused-stream",
    }
    cluster = config["static_resources"]["clusters"][0]
    assert cluster["health_checks"][0]["grpc_health_check"] == {}
