"""deploy/k8s renders offline, validates strictly against the Kubernetes schemas, and keeps
the promises the design makes: gRPC probes, drain-aware grace periods, discovery through a
headless Service, GPUs where they belong."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    DEPLOY,
    OVERLAYS,
    SAFE_RETRY_ON,
    objects,
    render,
    validate_strict,
)
from tests.deploy.manifests import container as _container
from tests.deploy.manifests import flag as _flag


def test_there_are_the_dev_and_tp2_overlays() -> None:
    assert {"dev", "tp2"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_rendered_manifests_pass_strict_validation(overlay: str, tmp_path: Path) -> None:
    folder = DEPLOY / "k8s" / ("base" if overlay == "base" else f"overlays/{overlay}")
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render(folder))
    result = validate_strict(rendered)
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The check above can fail: a misspelt field is an error."""
    rendered = render(DEPLOY / "k8s" / "base").replace("replicas:", "replica:", 1)
    (tmp_path / "bad.yaml").write_text(rendered)
    result = validate_strict(tmp_path / "bad.yaml")
    assert result.returncode != 0
    assert "'replica' was unexpected" in result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_probe_grpc_health_and_outlive_their_drain(overlay: str) -> None:
    manifests = objects(render(DEPLOY / "k8s" / "overlays" / overlay))
    worker = manifests[("Deployment", "headrace-worker")]
    container = _container(worker)
    # Kubelet's gRPC probes speak no TLS: they ask the plaintext health port (--health-port).
    health_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "health")
    assert health_port == int(_flag(container, "--health-port") or 0)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == health_port, probe
    drain_s = float(_flag(container, "--grace-period") or 30)
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    router = manifests[("Deployment", "headrace-router")]
    router_drain_s = float(_flag(_container(router), "--grace-period") or 30)
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > router_drain_s


@pytest.mark.parametrize("overlay", OVERLAYS)
@pytest.mark.parametrize("deployment", ["headrace-router", "headrace-worker"])
def test_ports_probes_and_scrape_annotations_agree_with_the_flags(
    overlay: str, deployment: str
) -> None:
    pod = objects(render(DEPLOY / "k8s" / "overlays" / overlay))[("Deployment", deployment)][
        "spec"
    ]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports["grpc"] == int(_flag(container, "--port") or 0)
    assert ports["metrics"] == int(_flag(container, "--metrics-port") or 0) == 9400
    assert ports["health"] == int(_flag(container, "--health-port") or 0) != ports["grpc"]
    assert container["readinessProbe"]["grpc"]["port"] == ports["health"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(ports["metrics"])
    env = {variable["name"]: variable.get("value") for variable in container["env"]}
    assert env["OTEL_SERVICE_NAME"] == deployment


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_router_discovers_workers_through_the_headless_service(overlay: str) -> None:
    manifests = objects(render(DEPLOY / "k8s" / "overlays" / overlay))
    router = _container(manifests[("Deployment", "headrace-router")])
    workers_dns = _flag(router, "--workers-dns")
    assert workers_dns is not None
    name, port = workers_dns.rsplit(":", 1)
    service = manifests[("Service", name.split(".")[0])]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"].get("publishNotReadyAddresses", False) is False
    worker = manifests[("Deployment", "headrace-worker")]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    # A headless Service's DNS answers pod IPs: the port in --workers-dns is dialled on the
    # pod directly, so it must be the worker container's gRPC port.
    worker_ports = {p["name"]: p["containerPort"] for p in _container(worker)["ports"]}
    (service_port,) = (p for p in service["spec"]["ports"] if p["port"] == int(port))
    assert worker_ports["grpc"] == int(port)
    assert service_port["targetPort"] in ("grpc", worker_ports["grpc"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_selector_matches_its_pods(overlay: str) -> None:
    manifests = objects(render(DEPLOY / "k8s" / "overlays" / overlay))
    pod_labels = [
        obj["spec"]["template"]["metadata"]["labels"]
        for (kind, _), obj in manifests.items()
        if kind == "Deployment"
    ]
    for (kind, name), obj in manifests.items():
        if kind == "Service":
            selector = obj["spec"]["selector"]
        elif kind in ("PodDisruptionBudget", "Deployment"):
            selector = obj["spec"]["selector"]["matchLabels"]
        else:
            continue
        assert any(selector.items() <= labels.items() for labels in pod_labels), (kind, name)


def test_gpus_go_to_workers_only_and_match_the_tensor_parallel_size() -> None:
    for overlay in OVERLAYS:
        manifests = objects(render(DEPLOY / "k8s" / "overlays" / overlay))
        router = _container(manifests[("Deployment", "headrace-router")])
        assert "nvidia.com/gpu" not in router.get("resources", {}).get("limits", {})
        worker = _container(manifests[("Deployment", "headrace-worker")])
        limits = worker["resources"].get("limits", {})
        if _flag(worker, "--device") == "cpu":
            assert "nvidia.com/gpu" not in limits, overlay
            continue
        tensor_parallel = int(_flag(worker, "--tensor-parallel-size") or 1)
        assert limits["nvidia.com/gpu"] == tensor_parallel, overlay
        assert worker["resources"]["requests"]["nvidia.com/gpu"] == tensor_parallel, overlay
    tp2 = _container(
        objects(render(DEPLOY / "k8s/overlays/tp2"))[("Deployment", "headrace-worker")]
    )
    assert _flag(tp2, "--tensor-parallel-size") == "2"
    dev = _container(
        objects(render(DEPLOY / "k8s/overlays/dev"))[("Deployment", "headrace-worker")]
    )
    assert _flag(dev, "--device") == "cpu"


def test_router_image_installs_the_router_extra_only() -> None:
    dockerfile = (DEPLOY / "images" / "router.Dockerfile").read_text()
    installs = re.findall(r"pip install [^\n]*", dockerfile)
    assert installs and all("[router]" in line for line in installs), installs
    assert "worker" not in " ".join(installs) and "torch" not in " ".join(installs)
    assert "import torch" in dockerfile  # the build's own check that torch is absent
    # ... and the router extra itself brings no torch.
    extras = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    heavy = ("torch", "triton", "transformers", "headrace[worker]")
    assert not [req for req in extras["router"] if req.lower().startswith(heavy)]


ISTIO = sorted((DEPLOY / "istio").glob("*.yaml"))
#: The traffic rules (the mesh's security, PeerAuthentication, is checked in
#: test_security_manifests.py).
ISTIO_NETWORKING = [p for p in ISTIO if "networking.istio.io" in p.read_text()]


def _durations(node: Any) -> Iterator[tuple[str, str]]:
    """(key, value) of every string that looks like a duration ("30s", "0s", "10ms")."""
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and re.fullmatch(r"\d+(\.\d+)?(ms|s|m|h)", value):
                yield key, value
            else:
                yield from _durations(value)
    elif isinstance(node, list):
        for item in node:
            yield from _durations(item)


@pytest.mark.parametrize("path", ISTIO_NETWORKING, ids=lambda path: path.name)
def test_istio_resources_are_networking_v1_with_durations_istio_accepts(path: Path) -> None:
    """kubernetes-validate has no Istio schemas: check the kind, and that no duration is
    below Istio's 1 ms minimum (a zero timeout is refused; leaving it out means none)."""
    resource = yaml.safe_load(path.read_text())
    assert resource["apiVersion"] == "networking.istio.io/v1"
    assert resource["kind"] in ("DestinationRule", "VirtualService")
    for key, value in _durations(resource["spec"]):
        number = float(re.sub(r"[a-z]+$", "", value))
        assert number > 0, (key, value)


def test_istio_resources_target_the_router_service() -> None:
    router_service = objects(render(DEPLOY / "k8s" / "base"))[("Service", "headrace-router")]
    host = router_service["metadata"]["name"]
    grpc_port = next(p["port"] for p in router_service["spec"]["ports"] if p["name"] == "grpc")
    resources = {
        res["kind"]: res for res in (yaml.safe_load(p.read_text()) for p in ISTIO_NETWORKING)
    }
    assert resources.keys() == {"DestinationRule", "VirtualService"}
    rule = resources["DestinationRule"]["spec"]
    assert rule["host"] == host
    assert "consistentHash" not in rule["trafficPolicy"]["loadBalancer"]  # the router schedules
    # A replica is ejected for its connection's failures, not for the gRPC codes it answers.
    assert rule["trafficPolicy"]["outlierDetection"]["consecutive5xxErrors"] == 0
    service = resources["VirtualService"]["spec"]
    assert service["hosts"] == [host]
    for route in service["http"]:
        assert "timeout" not in route  # none: generations stream for minutes
        for destination in route["route"]:
            assert destination["destination"] == {"host": host, "port": {"number": grpc_port}}
        # Never on 5xx / cancelled / deadline: that could run a started generation twice.
        retry_on = route.get("retries", {}).get("retryOn", "")
        assert set(filter(None, retry_on.split(","))) <= SAFE_RETRY_ON
