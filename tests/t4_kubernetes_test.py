"""Tier-4: mtcfs on Kubernetes (deploy/kubernetes/, docs/kubernetes.md).

No cluster runs here, so this checks what can be checked on one machine:

* every manifest (the Kustomize base as rendered, the example Job, the dev etcd, and the
  Job template inside the example JobSet) validates against the Kubernetes OpenAPI schema
  of a current release (``kubernetes-validate``, strict: unknown fields are errors); the
  JobSet object itself cannot be (its CRD schema is not in the package). The base is
  rendered by a small renderer of the Kustomize features it uses (so the test needs no
  kubectl); where kubectl is installed, its ``kubectl kustomize`` must give the same objects;
* the DaemonSet sets exactly the environment variables the entrypoint reads, and has what
  an operator checks (privileged, Bidirectional, host tmpfs, probes and preStop running the
  script, priority, grace period, memory from SIZE);
* the entrypoint (deploy/kubernetes/mtcfs_node.py, the image's ENTRYPOINT) runs for real
  with the DaemonSet's environment (host paths replaced by temp dirs, SIZE and the metrics
  port made to fit this machine): the probe passes once the mount is served, fails within
  its bound while the daemon is SIGSTOPped and after it was SIGKILLed, a restarted
  entrypoint clears the dead mount and serves the sealed files again, the trainer's ``wait``
  returns once the mount is served and gives up in its bound when it is not, preStop forces
  the unmount when a trainer holds a file open and unmounts cleanly otherwise; the rank comes from the node's label through a real HTTPS server speaking the
  API's ``GET /api/v1/nodes/NAME`` with the service account's token.
"""

from __future__ import annotations

import ast
import copy
import datetime
import http.server
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from mtcfs.base.mountinfo import force_unmount, is_mounted
from support.kube import (BASE, CONFIG, CONTAINER, DEV, DS, EXAMPLE, JOBSET, K8S, ROOT, _key,
                          container_env, one, render)
from support.mount import VENV_BIN
from support.poll import alive, wait_for

SCRIPT = K8S / "mtcfs_node.py"
#: The newest Kubernetes release whose schema the installed kubernetes-validate carries.
K8S_VERSION = kubernetes_validate.utils.latest_version()


def _jobset_jobs() -> list[dict[str, Any]]:
    """The Job templates inside the JobSet, as Jobs (what the JobSet controller makes)."""
    [js] = JOBSET
    return [{"apiVersion": "batch/v1", "kind": "Job",
             "metadata": {"name": f"{js['metadata']['name']}-{rj['name']}"},
             "spec": rj["template"]["spec"]} for rj in js["spec"]["replicatedJobs"]]


# --- schema -------------------------------------------------------------------------------

def test_every_manifest_validates_against_the_kubernetes_schema():
    objs = BASE + EXAMPLE + DEV + _jobset_jobs()
    kinds = sorted({o["kind"] for o in objs})
    assert {"DaemonSet", "Service", "PriorityClass", "Job", "StatefulSet"} <= set(kinds)
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    # The JobSet's own schema is a CRD's, not in the package: it is reported as such.
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(JOBSET[0], K8S_VERSION, strict=True)


def test_the_validation_catches_a_broken_manifest():
    """The check above can fail: a misspelt field, a string where a number goes."""
    bad = copy.deepcopy(DS)
    mounts = bad["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    mnt = next(m for m in mounts if m["name"] == "mnt")
    mnt["mountPropogation"] = mnt.pop("mountPropagation")
    with pytest.raises(kubernetes_validate.ValidationError, match="mountPropogation"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)
    bad = copy.deepcopy(DS)
    bad["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = "180"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
@pytest.mark.parametrize("kdir", [K8S, K8S / "example"], ids=["base", "example"])
def test_the_renderer_gives_what_kubectl_kustomize_gives(kdir):
    r = subprocess.run(["kubectl", "kustomize", str(kdir)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    theirs = {_key(o): o for o in yaml.safe_load_all(r.stdout) if o}
    ours = {_key(o): o for o in render(kdir)}
    assert theirs == ours


# --- what an operator checks ----------------------------------------------------------------

def _entrypoint_env_names() -> tuple[set[str], set[str]]:
    """(the names in mtcfs_node.ENV, the names its code passes to env())."""
    tree = ast.parse(SCRIPT.read_text())
    declared: set[str] = set()
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "ENV":
            assert isinstance(node.value, ast.Dict)
            declared = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("env", "_need", "_int")
                and node.args and isinstance(node.args[0], ast.Constant)):
            used.add(node.args[0].value)
    return declared, used


def test_the_daemonset_sets_exactly_the_variables_the_entrypoint_reads():
    declared, used = _entrypoint_env_names()
    assert declared and used
    kubelet = {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}
    assert used - kubelet == declared, "ENV lists a name the code does not read, or the reverse"
    names = [e["name"] for e in CONTAINER["env"]]
    assert len(names) == len(set(names))
    assert set(names) == declared
    for e in CONTAINER["env"]:  # every ConfigMap key the DaemonSet reads exists
        ref = e.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            assert ref["name"] == "mtcfs-config" and ref["key"] in CONFIG, e


def _gib(q: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 2**10, "M": 2**20,
             "G": 2**30, "T": 2**40}
    for u, f in units.items():
        if q.endswith(u):
            return float(q[: -len(u)]) * f / 2**30
    return float(q) / 2**30


def test_the_daemonset_has_what_an_operator_checks():
    pod = DS["spec"]["template"]["spec"]
    assert CONTAINER["securityContext"]["privileged"] is True
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m for m in CONTAINER["volumeMounts"]}
    assert mounts["mnt"]["mountPropagation"] == "Bidirectional"
    # the store's data tmpfs (issue 40) must be the host's, or it dies with the pod
    assert mounts["store"]["mountPropagation"] == "Bidirectional"
    assert vols["store"]["hostPath"]["path"].startswith("/dev/shm/")  # the host's tmpfs
    assert vols["fuse"]["hostPath"]["path"] == "/dev/fuse"
    env = {e["name"]: e for e in CONTAINER["env"]}
    assert env["MTCFS_MOUNT_ROOT"]["value"] == mounts["mnt"]["mountPath"]
    assert env["MTCFS_STORE_ROOT"]["value"] == mounts["store"]["mountPath"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = CONTAINER[probe]["exec"]["command"]
        assert cmd[:2] == ["mtcfs-node", "probe"], cmd
        bound = float(cmd[cmd.index("--timeout") + 1])
        # stat and status, each bounded, finish before the kubelet gives up on the probe
        assert 2 * bound + 5 <= CONTAINER[probe]["timeoutSeconds"], probe
    stop = CONTAINER["lifecycle"]["preStop"]["exec"]["command"]
    assert stop[:2] == ["mtcfs-node", "prestop"]
    # preStop: the flush and a clean umount (its --timeout, +45 s), then a forced one (30 s),
    # then SIGTERM
    assert pod["terminationGracePeriodSeconds"] >= float(stop[stop.index("--timeout") + 1]) + 75
    prio = one(BASE, "PriorityClass", pod["priorityClassName"])
    assert 0 < prio["value"] < 2000001000  # above workloads, below system-node-critical
    res = CONTAINER["resources"]
    assert res["requests"]["memory"] == res["limits"]["memory"]
    assert _gib(res["limits"]["memory"]) >= _gib(CONFIG["SIZE"]) + 1, "tmpfs pages + daemon"
    # the trainer sees the host directory the daemon mounts under, with HostToContainer
    train = one(EXAMPLE, "Job")["spec"]["template"]["spec"]
    [ckpt] = [v for v in train["volumes"] if v["name"] == "ckpt"]
    assert ckpt["hostPath"]["path"] == vols["mnt"]["hostPath"]["path"]
    for c in train["containers"] + train["initContainers"]:
        [m] = [m for m in c["volumeMounts"] if m["name"] == "ckpt"]
        assert m["mountPropagation"] == "HostToContainer"
    wait = train["initContainers"][0]["command"]
    assert wait[:2] == ["mtcfs-node", "wait"] and wait[2].endswith("/" + CONFIG["JOB"])
    # the image's entrypoint is this script
    cf = (K8S / "Containerfile").read_text()
    assert "COPY deploy/kubernetes/mtcfs_node.py /opt/mtcfs/bin/mtcfs-node" in cf
    assert 'ENTRYPOINT ["/usr/bin/tini", "--", "mtcfs-node", "run"]' in cf
    assert "command" not in CONTAINER and "args" not in CONTAINER


# --- the entrypoint for real ----------------------------------------------------------------

def _free_port() -> int:
    from support.ports import free_port
    return free_port()


def daemonset_env(**override: str) -> dict[str, str]:
    """The container's environment as the kubelet would make it from the DaemonSet: the
    ConfigMap's values, the downward API's (node ``testnode``, pod IP 127.0.0.1), the
    literal values; then ``override``; PATH holds this venv's mtcfs."""
    out = {**container_env("testnode", "127.0.0.1"), **override}
    return {**{k: v for k, v in os.environ.items() if not k.startswith("MTCFS_")},
            "PATH": f"{VENV_BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), **out}


def node_cmd(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def _only_child(pid: int, timeout: float = 10) -> int:
    """The one child process of ``pid`` (from /proc), waited for up to ``timeout`` s."""
    def one() -> int | None:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return int(kids[0]) if len(kids) == 1 else None
    return wait_for(one, timeout, f"process {pid} to have one child")


def _gone(pid: int, timeout: float) -> None:
    """Wait until process ``pid`` has ended (or is a zombie); TimeoutError after
    ``timeout`` seconds."""
    wait_for(lambda: not alive(pid), timeout, f"process {pid} to end")


def _wait_probe(env: dict[str, str], p: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = node_cmd(env, "probe", "--timeout", "5")
        if r.returncode == 0:
            return
        assert p.poll() is None, f"entrypoint exited {p.returncode}"
        assert time.monotonic() < deadline, r.stderr
        time.sleep(0.2)


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")
def test_entrypoint_probes_and_prestop_run_for_real(shm_dir):
    env = daemonset_env(MTCFS_STORE_ROOT=str(shm_dir / "host-tmpfs"),
                        MTCFS_MOUNT_ROOT=str(shm_dir / "host-mnt"),
                        MTCFS_SIZE="64M", MTCFS_METRICS_PORT=str(_free_port()))
    mnt = shm_dir / "host-mnt" / CONFIG["JOB"]
    procs: list[subprocess.Popen[str]] = []

    log = shm_dir / "container.log"  # the container's output, as `kubectl logs` shows it

    run_dir = str(shm_dir / "container-run")  # the container's own /run/mtcfs-node

    def start() -> subprocess.Popen[str]:
        with open(log, "a") as out:
            p = subprocess.Popen([sys.executable, str(SCRIPT), "run", "--run-dir", run_dir],
                                 env=env, text=True, stdout=out, stderr=subprocess.STDOUT)
        procs.append(p)
        # reap it the moment it exits, as tini (PID 1 of the image) does: `mtcfs umount`
        # waits for the daemon's pid to be gone, and a zombie would still be there
        threading.Thread(target=p.wait, daemon=True).start()
        return p

    try:
        p = start()
        _wait_probe(env, p)
        assert is_mounted(str(mnt))
        daemon = _only_child(p.pid)  # the entrypoint runs the daemon as its child
        (mnt / "step_1").mkdir()
        (mnt / "step_1" / "w.bin").write_bytes(b"x" * 100_000)
        r = node_cmd(env, "probe")
        assert r.returncode == 0 and "is served" in r.stdout, r

        # a stuck daemon: the probe fails within its bound instead of hanging
        os.kill(daemon, signal.SIGSTOP)
        t0 = time.monotonic()
        r = node_cmd(env, "probe", "--timeout", "2", timeout=30)
        took = time.monotonic() - t0
        assert r.returncode == 1 and "did not answer within 2s" in r.stderr, r
        assert took < 10, took
        os.kill(daemon, signal.SIGCONT)
        _wait_probe(env, p, timeout=30)

        # a crashed container (SIGKILL of its main process): the daemon dies with it; the
        # probe says so at once; the next container's entrypoint clears the dead mount and
        # serves the sealed files from the host tmpfs
        p.kill()
        p.wait(timeout=30)
        _gone(daemon, timeout=30)
        r = node_cmd(env, "probe", "--timeout", "2", timeout=30)
        assert r.returncode == 1, r
        assert is_mounted(str(mnt))  # the dead mount is still there, as on a real node
        p = start()
        _wait_probe(env, p)
        assert "clearing the dead mount" in log.read_text()
        assert (mnt / "step_1" / "w.bin").read_bytes() == b"x" * 100_000
        # the trainer's init container: returns at once when the mount is served
        r = node_cmd(env, "wait", str(mnt), "--timeout", "20")
        assert r.returncode == 0 and "is served" in r.stdout, r

        # preStop while a trainer holds a file open: the clean unmount is refused (busy),
        # the forced one detaches the mount, the daemon ends; the sealed files stay
        held = open(mnt / "step_1" / "w.bin", "rb")
        try:
            r = node_cmd(env, "prestop", "--timeout", "20", "--run-dir", run_dir,
                         timeout=120)
            assert r.returncode == 0 and "by force" in r.stdout, (r, log.read_text()[-3000:])
            assert not is_mounted(str(mnt))
            p.wait(timeout=30)
        finally:
            try:
                held.close()
            except OSError:  # ENOTCONN: the forced unmount ended the trainer's open files
                pass
        p = start()
        _wait_probe(env, p)
        assert (mnt / "step_1" / "w.bin").read_bytes() == b"x" * 100_000

        # SIGTERM (the kubelet's, after preStop or without one) reaches the daemon, which
        # unmounts cleanly. A preStop still running then (its pid in run-dir; here a
        # stand-in that the test ends) keeps the entrypoint, a container's main process,
        # alive after the daemon's exit: a runtime kills every process of a container whose
        # main process ended, and the hook would exit 137 (FailedPreStopHook).
        daemon = _only_child(p.pid)
        hook = subprocess.Popen(["sleep", "60"])
        procs.append(hook)
        (Path(run_dir) / "prestop.pid").write_text(f"{hook.pid}\n")
        p.send_signal(signal.SIGTERM)
        _gone(daemon, timeout=60)
        assert not is_mounted(str(mnt))
        time.sleep(0.5)
        assert p.poll() is None, log.read_text()[-3000:]  # waits for the hook
        hook.kill()
        hook.wait(timeout=10)
        assert p.wait(timeout=10) == 0, log.read_text()[-3000:]  # the daemon's status
        assert "waiting for preStop to finish" in log.read_text()

        # preStop: a clean unmount, the daemon exits by itself, the entrypoint with it
        p = start()
        _wait_probe(env, p)
        r = node_cmd(env, "prestop", "--timeout", "60", "--run-dir", run_dir, timeout=120)
        assert r.returncode == 0 and "cleanly" in r.stdout, (r, log.read_text()[-3000:])
        assert not is_mounted(str(mnt))
        assert p.wait(timeout=30) == 0
        assert not (Path(run_dir) / "prestop.pid").exists()
        r = node_cmd(env, "probe", "--timeout", "2")
        assert r.returncode == 1 and "not an mtcfs mount" in r.stderr, r
        r = node_cmd(env, "prestop")  # a second preStop has nothing to do
        assert r.returncode == 0 and "not mounted" in r.stdout, r
        t0 = time.monotonic()
        r = node_cmd(env, "wait", str(mnt), "--timeout", "2")
        assert r.returncode == 1 and "gave up after 2s" in r.stderr, r
        assert time.monotonic() - t0 < 15
    finally:
        for q in procs:
            if q.poll() is None:
                try:
                    os.kill(q.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                q.kill()
                q.wait(timeout=30)
        if is_mounted(str(mnt)):
            force_unmount(str(mnt))


class FakeApiServer:
    """An HTTPS server answering ``GET /api/v1/nodes/NAME`` as the API server does, for
    requests with the right bearer token (else 403)."""

    def __init__(self, tmp: Path, token: str, nodes: dict[str, dict[str, str]]) -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(hours=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                .sign(key, hashes.SHA256()))
        self.sa = tmp / "serviceaccount"
        self.sa.mkdir()
        (self.sa / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (self.sa / "token").write_text(token + "\n")
        (tmp / "api.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                if self.headers.get("Authorization") != f"Bearer {token}":
                    self.send_error(403, "Forbidden")
                    return
                node = self.path.removeprefix("/api/v1/nodes/")
                if node not in nodes:
                    self.send_error(404, "Not Found")
                    return
                body = json.dumps({"kind": "Node", "metadata": {
                    "name": node, "labels": nodes[node]}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.sa / "ca.crt", tmp / "api.key")
        self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_the_rank_comes_from_the_node_label_through_the_api(tmp_path):
    api = FakeApiServer(tmp_path, "sa-token", {
        "testnode": {"mtcfs.io/rank": "2", "kubernetes.io/hostname": "testnode"},
        "unlabelled": {"kubernetes.io/hostname": "unlabelled"}})
    tls = tmp_path / "tls"
    tls.mkdir()
    for f in ("ca.crt", "rank-2.crt", "rank-2.key"):
        (tls / f).write_text("pem\n")
    try:
        env = daemonset_env(MTCFS_NODES="3", MTCFS_COORD="etcd-0.etcd:2379,etcd-1.etcd:2379",
                            MTCFS_SA_DIR=str(api.sa), MTCFS_TLS_DIR=str(tls),
                            MTCFS_ETCD_TLS_DIR=str(tmp_path / "none"),
                            KUBERNETES_SERVICE_HOST="127.0.0.1",
                            KUBERNETES_SERVICE_PORT=str(api.port))
        r = node_cmd(env, "run", "--dry-run")
        assert r.returncode == 0, r.stderr
        argv = r.stdout.split()
        assert argv[:3] == ["mtcfs", "myjob", "/var/lib/mtcfs/mnt/myjob"] and argv[3:5] == ["-f", "-o"]
        opts = argv[5].split(",")
        for want in ("rank=2", "nodes=3", "replicas=1", "listen=127.0.0.1:7470",
                     "coord=etcd://etcd-0.etcd:2379;etcd-1.etcd:2379", "size=56G",
                     "store=/var/lib/mtcfs/store/myjob", f"tls_ca={tls}/ca.crt",
                     f"tls_cert={tls}/rank-2.crt", f"tls_key={tls}/rank-2.key",
                     "metrics=127.0.0.1:9470", "keep=2"):
            assert want in opts, (want, opts)
        assert "insecure" not in opts and not any(o.startswith("backup=") for o in opts)
        # a node without the label: one line that says what to do, exit 2, quickly
        r = node_cmd({**env, "MTCFS_NODE_NAME": "unlabelled"}, "run", "--dry-run", timeout=30)
        assert r.returncode == 2 and "kubectl label node unlabelled mtcfs.io/rank=R" in r.stderr, r
        # a service account the API refuses: named, not retried for a minute
        r = node_cmd({**env, "MTCFS_SA_DIR": str(tmp_path / "other-sa")}, "run", "--dry-run")
        assert r.returncode == 2 and "service account token" in r.stderr, r
        (tmp_path / "other-sa").mkdir()
        shutil.copy(api.sa / "ca.crt", tmp_path / "other-sa" / "ca.crt")
        (tmp_path / "other-sa" / "token").write_text("wrong")
        r = node_cmd({**env, "MTCFS_SA_DIR": str(tmp_path / "other-sa")}, "run", "--dry-run",
                     timeout=30)
        assert r.returncode == 2 and "HTTP 403" in r.stderr and "rbac.yaml" in r.stderr, r
        # MTCFS_RANK set (a per-job pod, a JobSet index) wins over the label
        r = node_cmd({**env, "MTCFS_RANK": "0", "MTCFS_TLS_DIR": str(tmp_path / "none")},
                     "run", "--dry-run")
        assert r.returncode == 0 and "rank=0," in r.stdout, r
        r = node_cmd({**env, "MTCFS_RANK": "3"}, "run", "--dry-run")
        assert r.returncode == 2 and "not below MTCFS_NODES=3" in r.stderr, r
    finally:
        api.close()
