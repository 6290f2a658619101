"""deploy/kubernetes/monitoring: the Prometheus Operator objects and the Grafana dashboard
are well formed and point at what the daemon serves (no cluster here: files only).

The PodMonitor and ServiceMonitor are custom resources, which no Kubernetes OpenAPI schema
covers: checked here against the fields of the Prometheus Operator's monitoring.coreos.com/v1
API that they use. The dashboard's ConfigMap, as the kustomization makes it, is validated
against the Kubernetes schema. That the dashboard's PromQL names only served series is
checked against a running job in tests/t4_metrics_series_test.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import yaml

MON = Path(__file__).resolve().parent.parent / "deploy" / "kubernetes" / "monitoring"
#: what the DaemonSet's pods carry and the port its container names for metrics=
POD_LABELS = {"app.kubernetes.io/name": "mtcfs"}
#: a scrape waits this long for the daemon's status (mtcfs/daemon.py), then mtcfs_up 0
STATUS_WAIT_S = 5

#: the monitoring.coreos.com/v1 fields these manifests may use, per object
ENDPOINT_FIELDS = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings"}
RELABEL_FIELDS = {"sourceLabels", "targetLabel", "regex", "replacement", "action",
                  "separator"}


def _seconds(text: str) -> float:
    return float(text[:-1]) * {"s": 1, "m": 60}[text[-1]]


def _check_monitor(path: str, kind: str, endpoints_key: str) -> None:
    (obj,) = [d for d in yaml.safe_load_all((MON / path).read_text()) if d]
    assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == kind
    assert set(obj) == {"apiVersion", "kind", "metadata", "spec"}
    spec = obj["spec"]
    assert set(spec) == {"selector", "namespaceSelector", endpoints_key}
    assert spec["selector"] == {"matchLabels": POD_LABELS}
    (ep,) = spec[endpoints_key]
    assert set(ep) <= ENDPOINT_FIELDS, set(ep) - ENDPOINT_FIELDS
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    assert ep["honorLabels"] is True  # mtcfs's job label, not exported_job
    assert _seconds(ep["scrapeTimeout"]) > STATUS_WAIT_S
    assert _seconds(ep["scrapeTimeout"]) <= _seconds(ep["interval"])
    for r in ep["relabelings"]:
        assert set(r) <= RELABEL_FIELDS, r


def test_the_pod_and_service_monitors_select_the_daemons_metrics_port():
    _check_monitor("podmonitor.yaml", "PodMonitor", "podMetricsEndpoints")
    _check_monitor("servicemonitor.yaml", "ServiceMonitor", "endpoints")


def test_the_kustomization_ships_the_dashboard_as_a_valid_configmap():
    k = yaml.safe_load((MON / "kustomization.yaml").read_text())
    for r in k["resources"]:
        assert (MON / r).is_file(), r
    (gen,) = k["configMapGenerator"]
    (item,) = gen["files"]
    key, _, src = item.partition("=")
    dashboard = json.loads((MON / src).read_text())
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": gen["name"], "namespace": k["namespace"],
                       "labels": gen["options"]["labels"]},
          "data": {key: (MON / src).read_text()}}
    kubernetes_validate.validate(cm, kubernetes_validate.utils.latest_version(), strict=True)
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    # every panel reads the Prometheus chosen in the dashboard's datasource variable
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "job", "node"} <= names
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12 and len({p["id"] for p in dashboard["panels"]}) == \
        len(dashboard["panels"])
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        for t in p["targets"]:
            assert 'job=~"$job"' in t["expr"] or t["expr"] == "mtcfs_up", t["expr"]
