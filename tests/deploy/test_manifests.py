"""deploy/k8s renders offline, validates strictly against the Kubernetes schemas, and keeps
the promises the design makes: gRPC probes, drain-aware grace periods, discovery through a
headless Service, GPUs where they belong."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import DEPLOY, OVERLAYS, objects, render

#: The newest Kubernetes whose schemas kubernetes-validate ships.
KUBERNETES_VERSION = "1.37.0"


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
            "--kubernetes-version", KUBERNETES_VERSION, str(path),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _flag(container: dict[str, Any], name: str) -> str | None:
    for arg in container.get("args", []):
        if arg.startswith(f"{name}="):
            return str(arg.split("=", 1)[1])
    return None


def test_there_are_the_dev_and_tp2_overlays() -> None:
    assert {"dev", "tp2"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_rendered_manifests_pass_strict_validation(overlay: str, tmp_path: Path) -> None:
    folder = DEPLOY / "k8s" / ("base" if overlay == "base" else f"overlays/{overlay}")
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(render(folder))
    result = _validate(rendered)
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The check above can fail: a misspelt field is an error."""
    rendered = render(DEPLOY / "k8s" / "base").replace("replicas:", "replica:", 1)
    (tmp_path / "bad.yaml").write_text(rendered)
    result = _validate(tmp_path / "bad.yaml")
    assert result.returncode != 0
    assert "'replica' was unexpected" in result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_probe_grpc_health_and_outlive_their_drain(overlay: str) -> None:
    manifests = objects(render(DEPLOY / "k8s" / "overlays" / overlay))
    worker = manifests[("Deployment", "headrace-worker")]
    container = _container(worker)
    grpc_port = next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port, probe
    drain_s = float(_flag(container, "--grace-period") or 30)
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain_s
    router = manifests[("Deployment", "headrace-router")]
    router_drain_s = float(_flag(_container(router), "--grace-period") or 30)
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > router_drain_s
    assert _container(router)["readinessProbe"]["grpc"]["port"] == 50051


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
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    worker = manifests[("Deployment", "headrace-worker")]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


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


@pytest.mark.parametrize("name", ["destination-rule.yaml", "virtual-service.yaml"])
def test_istio_resources_target_the_router_service(name: str) -> None:
    """kubernetes-validate has no Istio schemas; check the shape that matters."""
    resource = yaml.safe_load((DEPLOY / "istio" / name).read_text())
    assert resource["apiVersion"] == "networking.istio.io/v1"
    router_service = objects(render(DEPLOY / "k8s" / "base"))[("Service", "headrace-router")]
    host = router_service["metadata"]["name"]
    if resource["kind"] == "DestinationRule":
        assert resource["spec"]["host"] == host
        assert resource["spec"]["trafficPolicy"]["connectionPool"]["http"]
    else:
        assert resource["kind"] == "VirtualService"
        assert resource["spec"]["hosts"] == [host]
        for route in resource["spec"]["http"]:
            assert all(d["destination"]["host"] == host for d in route["route"])
        generation = resource["spec"]["http"][0]
        assert generation["timeout"] == "0s"
        # Never on 5xx / unavailable: that could run a started generation twice.
        assert set(generation["retries"]["retryOn"].split(",")) <= {
            "connect-failure",
            "refused-stream",
        }
