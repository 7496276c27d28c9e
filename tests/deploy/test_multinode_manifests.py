"""deploy/k8s/multinode: the LeaderWorkerSet passes its CRD's schema and its pods pass
Kubernetes', each node gets its group from LWS's environment, a follower is the leader minus
serving, the router dials leaders only, and the group reaches itself on every TCP port."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.lws import (
    WORKER_INDEX_LABEL,
    Role,
    kubelet_expand,
    leaderworkerset,
    lws_node_command,
    multinode_manifests,
    pod_labels,
    pod_template,
    schema_errors,
)
from tests.deploy.manifests import DEPLOY, container, flag, objects, render, validate_strict

ROLES: tuple[Role, Role] = ("leader", "worker")
#: The group's own flags, which every node must be given alike.
GROUP_FLAGS = {
    "--nnodes": "$(LWS_GROUP_SIZE)",
    "--node-rank": "$(LWS_WORKER_INDEX)",
    "--dist-init-addr": "$(LWS_LEADER_ADDRESS):29500",
}
#: What only the leader runs: the gRPC service, its TLS and keys, its drain, and metrics.
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-client-ca")
SERVING_FLAGS = ("--port", "--api-key-file", "--grace-period", "--metrics-port", *TLS_FLAGS)
#: What LWS puts in the env of a group's pods (group 0; the follower is worker 1).
LWS_ENV = {
    "LWS_LEADER_ADDRESS": "headrace-worker-0.headrace-worker.default",
    "LWS_GROUP_SIZE": "2",
}


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    return multinode_manifests()


@pytest.fixture(scope="module")
def lws(manifests: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return leaderworkerset(manifests)


def _container(lws: dict[str, Any], role: Role) -> dict[str, Any]:
    return container({"spec": {"template": pod_template(lws, role)}})


def _ports(server: dict[str, Any]) -> dict[str, int]:
    return {port["name"]: port["containerPort"] for port in server.get("ports", [])}


# -- schemas -------------------------------------------------------------------------------


def test_the_leaderworkerset_passes_its_crds_schema(lws: dict[str, Any]) -> None:
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert schema_errors(lws) == []


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A breakage: the field at the /-separated ``path`` set to ``value``."""

    def apply(lws: dict[str, Any]) -> None:
        *parents, last = path.split("/")
        node = lws
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = value

    return apply


def _drop_worker_template(lws: dict[str, Any]) -> None:
    del lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]


def _misspell_a_probe(lws: dict[str, Any]) -> None:
    (follower,) = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"]
    follower["livenesProbe"] = follower.pop("livenessProbe")


BREAKAGES = {
    "replicas-a-string": (_set("spec/replicas", "two"), "'two' is not of type 'integer'"),
    "no-worker-template": (_drop_worker_template, "'workerTemplate' is a required property"),
    "restart-policy-unknown": (
        _set("spec/leaderWorkerTemplate/restartPolicy", "Always"),
        "'Always' is not one of",
    ),
    "size-misspelt": (_set("spec/leaderWorkerTemplate/sise", 2), "'sise' was unexpected"),
    "probe-misspelt-in-a-pod": (_misspell_a_probe, "'livenesProbe' was unexpected"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_crds_schema_refuses_a_broken_leaderworkerset(
    lws: dict[str, Any], breakage: str
) -> None:
    """The check above can fail: a wrong type, a missing required field, a value outside an
    enum, an unknown field (as kubectl's strict field validation refuses), in the set or in
    its pods."""
    break_it, message = BREAKAGES[breakage]
    broken = copy.deepcopy(lws)
    break_it(broken)
    errors = schema_errors(broken)
    assert any(message in error for error in errors), errors


def _as_pod_templates(lws: dict[str, Any]) -> list[dict[str, Any]]:
    """The set's pod templates as core/v1 PodTemplates, which kubernetes-validate knows."""
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{lws['metadata']['name']}-{role}"},
            "template": pod_template(lws, role),
        }
        for role in ROLES
    ]


def test_the_other_objects_and_the_pod_templates_pass_strict_validation(
    manifests: dict[tuple[str, str], dict[str, Any]], lws: dict[str, Any], tmp_path: Path
) -> None:
    """kubernetes-validate has no schema for a LeaderWorkerSet (it only warns): the pods
    inside it are checked against Kubernetes' own as PodTemplates, beside the rest."""
    others = [obj for (kind, _), obj in manifests.items() if kind != "LeaderWorkerSet"]
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(yaml.safe_dump_all([*others, *_as_pod_templates(lws)]))
    result = validate_strict(rendered)
    assert result.returncode == 0, result.stdout + result.stderr


def test_strict_validation_of_the_pod_templates_can_fail(
    lws: dict[str, Any], tmp_path: Path
) -> None:
    broken = copy.deepcopy(lws)
    _misspell_a_probe(broken)
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump_all(_as_pod_templates(broken)))
    result = validate_strict(tmp_path / "bad.yaml")
    assert result.returncode != 0
    assert "'livenesProbe' was unexpected" in result.stdout + result.stderr


# -- the group ------------------------------------------------------------------------------


def test_groups_start_and_restart_together(lws: dict[str, Any]) -> None:
    spec = lws["spec"]
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    # The leader is ready only once its followers are up: they must not wait for that.
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["leaderWorkerTemplate"]["size"] == 2


@pytest.mark.parametrize("role", ROLES)
def test_every_node_gets_its_group_from_the_lws_environment(
    lws: dict[str, Any], role: Role
) -> None:
    server = _container(lws, role)
    for name, value in GROUP_FLAGS.items():
        assert flag(server, name) == value, name
    # The rendezvous is dialled on the leader's declared port.
    leader_ports = _ports(_container(lws, "leader"))
    dist_port = int(GROUP_FLAGS["--dist-init-addr"].rsplit(":", 1)[1])
    assert leader_ports["rendezvous"] == dist_port


def test_a_node_has_a_gpu_per_rank_and_the_group_every_rank(lws: dict[str, Any]) -> None:
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    for role in ROLES:
        server = _container(lws, role)
        ranks_per_node = int(flag(server, "--ranks-per-node") or 0)
        for amounts in (server["resources"]["requests"], server["resources"]["limits"]):
            assert amounts["nvidia.com/gpu"] == ranks_per_node, role
        tensor_parallel = int(flag(server, "--tensor-parallel-size") or 1)
        pipeline_parallel = int(flag(server, "--pipeline-parallel-size") or 1)
        assert tensor_parallel * pipeline_parallel == size * ranks_per_node, role
        assert flag(server, "--device") == "cuda", role
        mounts = {mount["name"]: mount["mountPath"] for mount in server["volumeMounts"]}
        volumes = {v["name"]: v for v in pod_template(lws, role)["spec"]["volumes"]}
        assert mounts["dshm"] == "/dev/shm" and volumes["dshm"]["emptyDir"]["medium"] == "Memory"


def test_a_follower_is_the_leader_without_serving(lws: dict[str, Any]) -> None:
    """Same image, model, parallel sizes, group flags, probes, resources, security and grace:
    the follower's pod equals the leader's once the gRPC service, its TLS and keys, and
    metrics are taken out."""
    expected = copy.deepcopy(pod_template(lws, "leader"))
    expected["metadata"].pop("annotations")  # Prometheus scrapes the leader alone
    (server,) = expected["spec"]["containers"]
    server["args"] = [arg for arg in server["args"] if arg.split("=")[0] not in SERVING_FLAGS]
    server["ports"] = [port for port in server["ports"] if port["name"] == "health"]
    secret_volumes = {v["name"] for v in expected["spec"]["volumes"] if "secret" in v}
    server["volumeMounts"] = [m for m in server["volumeMounts"] if m["name"] not in secret_volumes]
    expected["spec"]["volumes"] = [
        volume for volume in expected["spec"]["volumes"] if volume["name"] not in secret_volumes
    ]
    assert pod_template(lws, "worker") == expected


def test_a_follower_serves_health_alone(lws: dict[str, Any]) -> None:
    follower = _container(lws, "worker")
    for name in SERVING_FLAGS:
        assert flag(follower, name) is None, name
    assert set(_ports(follower)) == {"health"}
    assert "annotations" not in pod_template(lws, "worker")["metadata"]
    assert not [v for v in pod_template(lws, "worker")["spec"]["volumes"] if "secret" in v]


@pytest.mark.parametrize("role", ROLES)
def test_probes_ask_the_health_port_the_args_set_and_grace_outlives_the_drain(
    lws: dict[str, Any], role: Role
) -> None:
    server = _container(lws, role)
    health_port = int(flag(server, "--health-port") or 0)
    assert _ports(server)["health"] == health_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe] == {**server[probe], "grpc": {"port": health_port}}, probe
    # The leader drains; a follower's ranks stay up until it has.
    drain_s = float(flag(_container(lws, "leader"), "--grace-period") or 30)
    assert pod_template(lws, role)["spec"]["terminationGracePeriodSeconds"] > drain_s


def test_the_leader_serves_grpc_and_metrics_on_the_ports_it_declares(lws: dict[str, Any]) -> None:
    leader = _container(lws, "leader")
    ports = _ports(leader)
    assert ports["grpc"] == int(flag(leader, "--port") or 0)
    assert ports["metrics"] == int(flag(leader, "--metrics-port") or 0) == 9400
    annotations = pod_template(lws, "leader")["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(ports["metrics"])


def test_the_worker_image_is_the_single_node_one(lws: dict[str, Any]) -> None:
    base = objects(render(DEPLOY / "k8s" / "base"))[("Deployment", "headrace-worker")]
    for role in ROLES:
        assert _container(lws, role)["image"] == container(base)["image"], role


# -- the router, Services, policies ---------------------------------------------------------


def test_the_router_dials_the_leaders_alone(
    manifests: dict[tuple[str, str], dict[str, Any]], lws: dict[str, Any]
) -> None:
    router = container(manifests[("Deployment", "headrace-router")])
    name, port = (flag(router, "--workers-dns") or "").rsplit(":", 1)
    service = manifests[("Service", name.split(".")[0])]["spec"]
    assert service["clusterIP"] == "None"
    assert service.get("publishNotReadyAddresses", False) is False
    selector = service["selector"]
    assert selector[WORKER_INDEX_LABEL] == "0"
    for group_index in (0, 1):
        assert selector.items() <= pod_labels(lws, "leader", group_index).items()
        assert not selector.items() <= pod_labels(lws, "worker", group_index).items()
    # Headless: the router dials the leader pods' own gRPC port.
    leader_ports = _ports(_container(lws, "leader"))
    assert leader_ports["grpc"] == int(port)
    (service_port,) = (p for p in service["ports"] if p["port"] == int(port))
    assert service_port["targetPort"] in ("grpc", leader_ports["grpc"])


def test_the_lws_controller_owns_the_service_named_after_the_set(
    manifests: dict[tuple[str, str], dict[str, Any]], lws: dict[str, Any]
) -> None:
    """LWS makes a headless Service named after the set, every pod in it ready or not, for
    LWS_LEADER_ADDRESS; one of that name in the manifests would stand in its way."""
    assert ("Service", lws["metadata"]["name"]) not in manifests
    assert ("Deployment", "headrace-worker") not in manifests  # nor single-node workers


def _selector(kind: str, spec: dict[str, Any]) -> dict[str, str] | None:
    """The labels an object picks its pods by, if it picks any."""
    if kind == "Service":
        return dict(spec["selector"])
    if kind == "NetworkPolicy":
        return dict(spec["podSelector"]["matchLabels"])
    if kind in ("PodDisruptionBudget", "Deployment"):
        return dict(spec["selector"]["matchLabels"])
    return None


def test_every_selector_matches_its_pods(
    manifests: dict[tuple[str, str], dict[str, Any]], lws: dict[str, Any]
) -> None:
    router = manifests[("Deployment", "headrace-router")]["spec"]["template"]
    pods = [router["metadata"]["labels"], *(pod_labels(lws, role) for role in ROLES)]
    for (kind, name), obj in manifests.items():
        selector = _selector(kind, obj["spec"])
        if selector is not None:
            assert any(selector.items() <= labels.items() for labels in pods), (kind, name)


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector["matchLabels"].items() <= labels.items())


def test_the_group_reaches_itself_on_every_tcp_port_and_only_the_router_reaches_grpc(
    manifests: dict[tuple[str, str], dict[str, Any]], lws: dict[str, Any]
) -> None:
    router_pod = manifests[("Deployment", "headrace-router")]["spec"]["template"]
    router_labels = router_pod["metadata"]["labels"]
    nodes = [pod_labels(lws, role, group) for role in ROLES for group in (0, 1)]
    # The base's policy holds for every node: of the other pods, only the router's reach gRPC.
    base = manifests[("NetworkPolicy", "headrace-worker")]["spec"]
    assert all(_selects(base["podSelector"], labels) for labels in nodes)
    (grpc_rule,) = (r for r in base["ingress"] if any(p.get("port") == "grpc" for p in r["ports"]))
    (router_peer,) = grpc_rule["from"]
    assert set(router_peer) == {"podSelector"}
    assert _selects(router_peer["podSelector"], router_labels)
    # The group's: every node, every TCP port, from the set's own pods (any group) alone.
    group = manifests[("NetworkPolicy", "headrace-worker-group")]["spec"]
    assert all(_selects(group["podSelector"], labels) for labels in nodes)
    assert group["policyTypes"] == ["Ingress"]
    (rule,) = group["ingress"]
    assert rule["ports"] == [{"protocol": "TCP"}]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only, no IP blocks
    assert all(_selects(peer["podSelector"], labels) for labels in nodes)
    assert not _selects(peer["podSelector"], router_labels)


def test_the_deploy_readme_says_how_to_make_what_the_nodes_mount(lws: dict[str, Any]) -> None:
    readme = (DEPLOY / "README.md").read_text()
    assert "Multi-node workers (LeaderWorkerSet)" in readme
    for role in ROLES:
        for volume in pod_template(lws, role)["spec"]["volumes"]:
            made_outside = volume.get("secret", {}).get("secretName") or volume.get(
                "persistentVolumeClaim", {}
            ).get("claimName")
            assert made_outside is None or made_outside in readme, made_outside


# -- the nodes' commands ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expanded"),
    [
        ("--nnodes=$(N)", "--nnodes=2"),
        ("$(N)$(N)", "22"),
        ("$(UNSET)", "$(UNSET)"),  # an unknown variable stays as written
        ("$$(N)", "$(N)"),  # $$ escapes
        ("$$$(N)", "$2"),
        ("$$", "$"),
        ("cost: $5", "cost: $5"),  # a $ that starts no reference stays
        ("ends with $", "ends with $"),
        ("$(N", "$(N"),  # an unclosed reference stays
        ("$()", "$()"),  # the empty name, which no variable has
    ],
)
def test_kubelet_expand_follows_the_kubelet(text: str, expanded: str) -> None:
    assert kubelet_expand(text, {"N": "2"}) == expanded


def test_lws_node_command_is_what_each_node_runs() -> None:
    leader = lws_node_command("leader", {**LWS_ENV, "LWS_WORKER_INDEX": "0"})
    follower = lws_node_command("worker", {**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    for argv, rank in ((leader, "0"), (follower, "1")):
        assert argv[:2] == ["headrace", "worker"]  # the image's ENTRYPOINT
        assert not [arg for arg in argv if "$(" in arg], argv
        server = {"args": argv[2:]}
        assert flag(server, "--nnodes") == "2"
        assert flag(server, "--node-rank") == rank
        assert flag(server, "--dist-init-addr") == "headrace-worker-0.headrace-worker.default:29500"
    assert flag({"args": leader}, "--port") == "50051"
    assert flag({"args": follower}, "--port") is None


def test_lws_node_command_leaves_what_lws_did_not_give() -> None:
    argv = lws_node_command("worker", {})
    assert "--nnodes=$(LWS_GROUP_SIZE)" in argv
    assert "--dist-init-addr=$(LWS_LEADER_ADDRESS):29500" in argv
