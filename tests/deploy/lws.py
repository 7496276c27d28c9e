"""The multi-node workers (deploy/k8s/multinode) offline: the LeaderWorkerSet's schema from
the vendored CRD, the labels the LWS controller gives its pods, and a node's command as the
kubelet runs it.

Kubernetes checks a custom resource against its CRD's openAPIV3Schema and, under kubectl's
default strict field validation, refuses fields the schema does not name. `schema_errors`
does both with jsonschema: the schema is OpenAPI 3.0's subset of draft 4, and every object
that lists its properties gets ``additionalProperties: false`` unless it says otherwise.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Literal

import jsonschema
import yaml

from tests.deploy.manifests import DEPLOY, objects, render

MULTINODE = DEPLOY / "k8s" / "multinode"
#: config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml of kubernetes-sigs/lws.
CRD = Path(__file__).parent / "schemas" / "leaderworkerset.x-k8s.io_leaderworkersets.yaml"
#: The image the LWS pods run; a container without `command` runs its ENTRYPOINT.
WORKER_DOCKERFILE = DEPLOY / "images" / "worker.Dockerfile"
#: Labels the LWS controller puts on every pod of a set (api/leaderworkerset/v1).
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

Role = Literal["leader", "worker"]
_TEMPLATE_FIELD: dict[Role, str] = {"leader": "leaderTemplate", "worker": "workerTemplate"}


def multinode_manifests() -> dict[tuple[str, str], dict[str, Any]]:
    """deploy/k8s/multinode rendered: (kind, name) → object."""
    return objects(render(MULTINODE))


def leaderworkerset(manifests: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    """The one LeaderWorkerSet among the manifests."""
    (only,) = (obj for (kind, _), obj in manifests.items() if kind == "LeaderWorkerSet")
    return only


def pod_template(lws: dict[str, Any], role: Role) -> dict[str, Any]:
    """The leader's or a follower's pod template (a PodTemplateSpec)."""
    template: dict[str, Any] = lws["spec"]["leaderWorkerTemplate"][_TEMPLATE_FIELD[role]]
    return template


def pod_labels(lws: dict[str, Any], role: Role, group_index: int = 0) -> dict[str, str]:
    """A running pod's labels: its template's and those the LWS controller adds (a follower's
    worker index is 1 here, the first follower's)."""
    return {
        **pod_template(lws, role)["metadata"].get("labels", {}),
        SET_NAME_LABEL: lws["metadata"]["name"],
        GROUP_INDEX_LABEL: str(group_index),
        WORKER_INDEX_LABEL: "0" if role == "leader" else "1",
    }


@functools.cache
def _crd_validator() -> jsonschema.Draft4Validator:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the C loader: 10x faster here
    crd = yaml.load(CRD.read_text(), Loader=loader)
    (v1,) = (version for version in crd["spec"]["versions"] if version["name"] == "v1")
    return jsonschema.Draft4Validator(_strict(v1["schema"]["openAPIV3Schema"]))


def _strict(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with unknown fields refused wherever it lists the known ones."""
    strict = dict(schema)
    if "properties" in schema:
        strict["properties"] = {name: _strict(sub) for name, sub in schema["properties"].items()}
        open_ended = schema.get("x-kubernetes-preserve-unknown-fields", False)
        if "additionalProperties" not in schema and not open_ended:
            strict["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            strict[key] = _strict(schema[key])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            strict[key] = [_strict(sub) for sub in schema[key]]
    return strict


def schema_errors(lws: dict[str, Any]) -> list[str]:
    """What the LeaderWorkerSet CRD refuses in ``lws``, one "path: message" each."""
    errors = _crd_validator().iter_errors(lws)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """``text`` with ``$(VAR)`` replaced as the kubelet does in command and args
    (k8s.io/kubernetes third_party/forked/golang/expansion): a variable ``env`` lacks stays
    ``$(VAR)``, ``$$`` is one ``$``, any other ``$`` (an unclosed ``$(`` too) stays."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "$" or i + 1 == len(text):
            out.append(text[i])
            i += 1
        elif text[i + 1] == "$":
            out.append("$")
            i += 2
        elif text[i + 1] == "(" and (close := text.find(")", i + 2)) != -1:
            name = text[i + 2 : close]
            out.append(env.get(name, f"$({name})"))
            i = close + 1
        else:  # "$x", or "$(" with no ")": both characters stay
            out.append(text[i : i + 2])
            i += 2
    return "".join(out)


def image_entrypoint_and_cmd(dockerfile: Path) -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD (both in their JSON form in deploy/images)."""

    def instruction(name: str) -> list[str]:
        match = re.search(rf"^{name}\s+(\[.*\])\s*$", dockerfile.read_text(), re.MULTILINE)
        assert match, f"no {name} [...] in {dockerfile}"
        return [str(part) for part in json.loads(match.group(1))]

    return instruction("ENTRYPOINT"), instruction("CMD")


def lws_node_command(role: Role, env: dict[str, str]) -> list[str]:
    """The argv a node of the multi-node worker runs: the leader's (``role="leader"``) or a
    follower's (``"worker"``) container command and args from the rendered LeaderWorkerSet,
    the image's ENTRYPOINT and CMD where the container gives none (as the runtime does), and
    every ``$(VAR)`` expanded as the kubelet does from ``env`` (LWS_LEADER_ADDRESS,
    LWS_WORKER_INDEX, LWS_GROUP_SIZE: what LWS injects) and the container's own literal
    ``env`` entries, which win as they do over LWS's."""
    (container,) = pod_template(leaderworkerset(multinode_manifests()), role)["spec"]["containers"]
    entrypoint, cmd = image_entrypoint_and_cmd(WORKER_DOCKERFILE)
    command = container.get("command", entrypoint)
    # A command of the pod's own replaces the image's CMD too, args or not.
    args = container.get("args", cmd if "command" not in container else [])
    literal = {var["name"]: var["value"] for var in container.get("env", []) if "value" in var}
    mapping = {**env, **literal}
    return [kubelet_expand(part, mapping) for part in [*command, *args]]
