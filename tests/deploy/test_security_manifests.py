"""deploy/ keeps the security promises: every listener and the router's links to workers
speak TLS with keys (or, in the mesh overlay, leave TLS to Istio's STRICT mTLS and keep the
keys), every file the servers read is a Secret mounted whole (so rotation reaches it), only
the router reaches the workers, and deploy/README.md says how to make each Secret."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from tests.deploy.lws import leaderworkerset, multinode_manifests, pod_template
from tests.deploy.manifests import DEPLOY, OVERLAYS, container, flag, objects, render

DEPLOYMENTS = ("headrace-router", "headrace-worker")
#: What each server must be given outside the mesh, beyond its keys.
TLS_FLAGS = {
    "headrace-router": (
        "--tls-cert", "--tls-key", "--worker-tls-ca", "--worker-tls-cert", "--worker-tls-key",
        "--worker-tls-server-name",
    ),
    "headrace-worker": ("--tls-cert", "--tls-key", "--tls-client-ca"),
}  # fmt: skip
KEY_FLAGS = {
    "headrace-router": ("--api-key-file", "--worker-api-key-file"),
    "headrace-worker": ("--api-key-file",),
}
#: The overlay where Istio's sidecars do the TLS.
MESH = "mesh"


def _manifests(overlay: str) -> dict[tuple[str, str], dict[str, Any]]:
    folder = DEPLOY / "k8s" / ("base" if overlay == "base" else f"overlays/{overlay}")
    return objects(render(folder))


def _pod(manifests: dict[tuple[str, str], dict[str, Any]], name: str) -> dict[str, Any]:
    return dict(manifests[("Deployment", name)]["spec"]["template"])


def _file_flags(server: dict[str, Any]) -> dict[str, str]:
    """--flag → path, for every flag whose value is a file under /etc/headrace."""
    pairs = (arg.split("=", 1) for arg in server.get("args", []) if "=" in arg)
    return {name: value for name, value in pairs if value.startswith("/etc/headrace/")}


def _assert_every_file_is_a_secret_mounted_whole(pod: dict[str, Any]) -> None:
    """Every --flag=/etc/headrace/... file of the pod's server is in a Secret volume."""
    server = container({"spec": {"template": pod}})
    mounts = {mount["mountPath"]: mount for mount in server.get("volumeMounts", [])}
    volumes = {volume["name"]: volume for volume in pod["spec"]["volumes"]}
    assert _file_flags(server), "no key or certificate file at all"
    for name, path in _file_flags(server).items():
        folder, file_name = str(PurePosixPath(path).parent), PurePosixPath(path).name
        mount = mounts[folder]
        # A subPath mount never sees the Secret change: rotation would need a restart.
        assert "subPath" not in mount and mount.get("readOnly") is True, name
        secret = volumes[mount["name"]]["secret"]
        items = secret.get("items")
        assert items is None or file_name in {item["path"] for item in items}, name
        # Readable by the server's group alone (fsGroup), not by the world.
        assert secret["defaultMode"] == 0o440, name
    assert pod["spec"]["securityContext"]["fsGroup"] == pod["spec"]["securityContext"]["runAsUser"]


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_file_a_server_reads_is_a_secret_mounted_whole(overlay: str, deployment: str) -> None:
    _assert_every_file_is_a_secret_mounted_whole(_pod(_manifests(overlay), deployment))


@pytest.mark.parametrize("overlay", ["base", *(o for o in OVERLAYS if o != MESH)])
@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_every_listener_and_link_speaks_tls_and_asks_for_keys(
    overlay: str, deployment: str
) -> None:
    manifests = _manifests(overlay)
    server = container(manifests[("Deployment", deployment)])
    for name in (*TLS_FLAGS[deployment], *KEY_FLAGS[deployment]):
        assert flag(server, name), name
    if deployment == "headrace-router":  # the name the workers' certificate must carry
        workers_dns = flag(server, "--workers-dns") or ""
        assert flag(server, "--worker-tls-server-name") == workers_dns.split(":")[0]


def test_the_multinode_leader_speaks_tls_reads_secrets_whole_and_is_dialled_by_name() -> None:
    """The multi-node leader is the worker the router dials: the single-node worker's TLS,
    keys and Secrets, and the router checks the same name on its certificate."""
    manifests = multinode_manifests()
    leader_pod = pod_template(leaderworkerset(manifests), "leader")
    _assert_every_file_is_a_secret_mounted_whole(leader_pod)
    leader = container({"spec": {"template": leader_pod}})
    for name in (*TLS_FLAGS["headrace-worker"], *KEY_FLAGS["headrace-worker"]):
        assert flag(leader, name), name
    router = container(manifests[("Deployment", "headrace-router")])
    base_router = container(_manifests("base")[("Deployment", "headrace-router")])
    for name in (*TLS_FLAGS["headrace-router"], *KEY_FLAGS["headrace-router"]):
        assert flag(router, name) == flag(base_router, name), name


@pytest.mark.parametrize("deployment", DEPLOYMENTS)
def test_the_mesh_overlay_drops_only_the_servers_own_tls(deployment: str) -> None:
    """In the mesh the sidecars do mTLS (and must see plain HTTP/2 to route gRPC); the keys
    stay. Everything else equals the base, so the two cannot drift apart."""
    base = container(_manifests("base")[("Deployment", deployment)])
    mesh = container(_manifests(MESH)[("Deployment", deployment)])
    tls_args = {f"{name}={flag(base, name)}" for name in TLS_FLAGS[deployment]}
    assert mesh["args"] == [arg for arg in base["args"] if arg not in tls_args]
    for name in KEY_FLAGS[deployment]:
        assert flag(mesh, name) == flag(base, name), name
    tls_files = [path for name, path in _file_flags(base).items() if name in TLS_FLAGS[deployment]]
    tls_folders = {str(PurePosixPath(path).parent) for path in tls_files}
    assert tls_folders
    kept = [m for m in base["volumeMounts"] if m["mountPath"] not in tls_folders]
    assert mesh["volumeMounts"] == kept


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_only_the_router_reaches_the_workers_grpc_port(overlay: str) -> None:
    manifests = _manifests(overlay)
    policy = manifests[("NetworkPolicy", "headrace-worker")]["spec"]
    worker_pod, router_pod = (_pod(manifests, name) for name in reversed(DEPLOYMENTS))
    worker_labels = worker_pod["metadata"]["labels"]
    router_labels = router_pod["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= worker_labels.items()
    assert "Ingress" in policy["policyTypes"]
    ports = {p["name"] for p in container({"spec": {"template": worker_pod}})["ports"]}
    rules = policy["ingress"]
    assert all(rule.get("ports") for rule in rules)  # no rule opens every port
    grpc_rules = [rule for rule in rules if any(p["port"] == "grpc" for p in rule["ports"])]
    (grpc_rule,) = grpc_rules
    for peer in grpc_rule["from"]:
        assert set(peer) == {"podSelector"}  # no namespace or IP block: router pods only
        selector = peer["podSelector"]["matchLabels"]
        assert selector.items() <= router_labels.items()
        assert not selector.items() <= worker_labels.items()
    assert {p["port"] for rule in rules for p in rule["ports"]} <= ports
    assert any(p["port"] == "metrics" for rule in rules for p in rule["ports"])


def test_peer_authentication_makes_the_mesh_strict_mutual_tls() -> None:
    resource = yaml.safe_load((DEPLOY / "istio" / "peer-authentication.yaml").read_text())
    assert resource["apiVersion"] == "security.istio.io/v1"
    assert resource["kind"] == "PeerAuthentication"
    assert resource["spec"] == {"mtls": {"mode": "STRICT"}}  # no port left PERMISSIVE


def test_the_deploy_readme_says_how_to_make_every_secret_the_pods_mount() -> None:
    readme = (DEPLOY / "README.md").read_text()
    manifests = _manifests("base")
    for deployment in DEPLOYMENTS:
        pod = _pod(manifests, deployment)
        for volume in pod["spec"]["volumes"]:
            secret = volume.get("secret")
            if secret is None:
                continue
            assert secret["secretName"] in readme, secret["secretName"]
            for item in secret.get("items", []):
                assert item["key"] in readme, item["key"]
