"""The Kubernetes manifests of deploy/kubernetes/ as the API server would get them: the
Kustomize base rendered (the features our kustomizations use), the DaemonSet's container
and the ConfigMap's values. Used by tests/t4_kubernetes_test.py (schemas, the entrypoint)
and tests/t9_container_test.py (the pod run by podman)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent.parent
K8S = ROOT / "deploy" / "kubernetes"
CLUSTER_SCOPED = {"Namespace", "PriorityClass", "ClusterRole", "ClusterRoleBinding"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(kdir: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize kdir`` gives, for the features our kustomizations
    use (resources, namespace, images, configMapGenerator literals without a name hash,
    JSON 6902 patches of replace/add). Anything else fails, so the renderer cannot drift
    silently from what the files ask for."""
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "namespace", "resources", "images", "generatorOptions",
             "configMapGenerator", "patches"}
    assert set(k) <= known, f"renderer does not know {set(k) - known}"
    objs: list[dict[str, Any]] = []
    for res in k.get("resources", []):
        objs += _docs(kdir / res)
    if k.get("configMapGenerator"):
        assert k.get("generatorOptions", {}).get("disableNameSuffixHash") is True
        for g in k["configMapGenerator"]:
            assert set(g) == {"name", "literals"}, g
            data = dict(lit.split("=", 1) for lit in g["literals"])
            objs.append({"apiVersion": "v1", "kind": "ConfigMap",
                         "metadata": {"name": g["name"]}, "data": data})
    for o in objs:
        if "namespace" in k and o["kind"] not in CLUSTER_SCOPED:
            o["metadata"]["namespace"] = k["namespace"]
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in k.get("images", [])}
    for o in objs:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            c["image"] = images.get(c["image"], c["image"])
    for p in k.get("patches", []):
        t = p["target"]
        [o] = [o for o in objs if o["kind"] == t["kind"] and o["metadata"]["name"] == t["name"]]
        for op in yaml.safe_load(p["patch"]):
            assert op["op"] in ("replace", "add"), op
            *parents, last = [s for s in op["path"].split("/") if s]
            node: Any = o
            for s in parents:
                node = node[int(s)] if isinstance(node, list) else node[s]
            if op["op"] == "replace":
                assert last in node, op
            node[last] = op["value"]
    return objs


def _key(o: dict[str, Any]) -> tuple[str, str]:
    return o["kind"], o["metadata"]["name"]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, [_key(o) for o in objs])
    return found[0]


BASE = render(K8S)
EXAMPLE = render(K8S / "example")
DEV = _docs(K8S / "dev" / "etcd.yaml")
JOBSET = _docs(K8S / "example" / "jobset.yaml")
DS = one(BASE, "DaemonSet", "mtcfs")
CONTAINER = DS["spec"]["template"]["spec"]["containers"][0]
CONFIG = one(BASE, "ConfigMap", "mtcfs-config")["data"]


def container_env(node: str, pod_ip: str) -> dict[str, str]:
    """The DaemonSet container's environment as the kubelet makes it: the literal values,
    the ConfigMap's, and the downward API's (``spec.nodeName`` is ``node``,
    ``status.podIP`` is ``pod_ip``)."""
    out: dict[str, str] = {}
    for e in CONTAINER["env"]:
        if "value" in e:
            out[e["name"]] = e["value"]
        elif "configMapKeyRef" in e["valueFrom"]:
            out[e["name"]] = CONFIG[e["valueFrom"]["configMapKeyRef"]["key"]]
        else:
            field = e["valueFrom"]["fieldRef"]["fieldPath"]
            out[e["name"]] = {"spec.nodeName": node, "status.podIP": pod_ip}[field]
    return out
