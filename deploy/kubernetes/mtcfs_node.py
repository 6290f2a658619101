#!/usr/bin/env python3
"""The container side of mtcfs on Kubernetes: entrypoint, probes, preStop, trainer wait.

One script, four subcommands, each run by a field of the manifests in this directory:

``run``
    The DaemonSet container's command. Builds the mount options from the environment
    (the names in :data:`ENV`, set by ``daemonset.yaml`` from the ``mtcfs-config``
    ConfigMap and the downward API), clears a dead mount a crashed container left at the
    mount point, and runs ``mtcfs JOB MNT -f -o ...`` as its child: every signal the
    container gets (the kubelet's SIGTERM) is passed on to the daemon, the daemon dies with
    it (``PR_SET_PDEATHSIG``), and it exits with the daemon's status. It does not ``exec``
    the daemon, so that the container outlives the daemon while a ``prestop`` is still
    running: when the container's main process ends, the runtime kills every process in
    it, the hook's too, which a kubelet records as a failed hook (exit 137) for a stop that
    went well. After the daemon's exit ``run`` waits, at most :data:`PRESTOP_WAIT_S`, for a
    live ``prestop`` (its pid file in ``--run-dir``) to end. ``run --dry-run`` prints the
    command instead.
``probe``
    Readiness and liveness. Passes when (1) /proc/self/mountinfo holds a ``fuse.mtcfs``
    mount at the mount point, (2) a ``stat`` through FUSE of the root and of a name that
    does not exist (never in the kernel's cache, so the daemon itself must answer)
    returns within ``--timeout``, and (3) ``mtcfs status`` answers within ``--timeout``.
    Every access to the mount runs in a child process that is SIGKILLed and *not waited
    for* on timeout: a request the stopped daemon already read leaves its caller in
    uninterruptible sleep, and the probe must still end.
``prestop``
    The container's ``preStop``: ``mtcfs umount --flush`` (the newest step to the peers
    and the bucket first, at most ``stop_flush=``; then clean: the daemon finishes, sealed
    files stay in the store); if that fails or does not end in time (files held open by
    a trainer, a stuck daemon), ``mtcfs umount --force``.
``wait``
    The example training pod's init container: waits (bounded) until the mount is served.

Exit status: 0 when it worked, 1 with one line on stderr when not, 2 for a bad
environment (a missing or malformed variable).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NoReturn

from mtcfs.base import mountinfo

#: Every environment variable ``run`` reads, set by the DaemonSet (``daemonset.yaml``);
#: tests/t4_kubernetes_test.py checks the two lists are the same. An empty value counts
#: as unset.
ENV: dict[str, str] = {
    "MTCFS_JOB": "the job name (mtcfs SOURCE); the mount is MOUNT_ROOT/JOB",
    "MTCFS_SIZE": "size= of the RAM tier (mtcfs plan)",
    "MTCFS_BACKUP": "backup= URL (gs://bucket/prefix or file:///path); empty: none",
    "MTCFS_BACKUP_INTERVAL": "backup_interval=",
    "MTCFS_NODES": "nodes=: how many nodes the job has",
    "MTCFS_REPLICAS": "replicas=: peers that hold a copy of each checkpoint",
    "MTCFS_COORD": "the job's etcd client addresses, HOST:PORT,HOST:PORT (coord=)",
    "MTCFS_EXTRA_OPTIONS": "more mount options, appended as given (keep=2,scope=job,...)",
    "MTCFS_INSECURE": "yes: plaintext peers/etcd where no TLS files are mounted (insecure)",
    "MTCFS_RANK": "rank=; empty: the node's label MTCFS_RANK_LABEL, read from the API",
    "MTCFS_RANK_LABEL": "the node label that holds the rank (mtcfs.io/rank)",
    "MTCFS_NODE_NAME": "this pod's node (downward API spec.nodeName)",
    "MTCFS_POD_IP": "this pod's IP (downward API status.podIP): listen= and metrics=",
    "MTCFS_PEER_PORT": "the peer service's port (listen=POD_IP:PORT)",
    "MTCFS_METRICS_PORT": "metrics=POD_IP:PORT; empty: no HTTP endpoint",
    "MTCFS_STORE_ROOT": "the host tmpfs (hostPath); the store is STORE_ROOT/JOB",
    "MTCFS_MOUNT_ROOT": "the host directory (hostPath, Bidirectional); the mount is MOUNT_ROOT/JOB",
    "MTCFS_TLS_DIR": "the peer TLS Secret: ca.crt, rank-R.crt, rank-R.key",
    "MTCFS_ETCD_TLS_DIR": "the etcd client TLS Secret: ca.crt, tls.crt, tls.key",
    "MTCFS_SA_DIR": "the service account's token and CA (to read the node's rank label)",
}

#: Set by the kubelet in every container, not by the manifests.
KUBELET_ENV = ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")

#: How long ``run`` keeps asking the API server for the node's label.
API_DEADLINE_S = 60.0

#: Where ``prestop`` says it is running (``prestop.pid``): a directory of the container's
#: own (a new container starts with a new one), never a host path.
RUN_DIR = "/run/mtcfs-node"

#: After the daemon's exit, how long ``run`` waits for a running ``prestop`` to finish: it
#: has only its last line to print by then.
PRESTOP_WAIT_S = 30.0

#: The signals ``run`` passes on to the daemon (SIGKILL and SIGSTOP cannot be caught: the
#: first ends ``run`` and so, by PR_SET_PDEATHSIG, the daemon).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2)


class ConfigError(Exception):
    """The environment is missing a variable or holds a malformed one."""


def env(name: str, default: str = "") -> str:
    """The value of one of :data:`ENV` (or :data:`KUBELET_ENV`); ``default`` if unset/empty."""
    if name not in ENV and name not in KUBELET_ENV:
        raise KeyError(f"{name} is not a documented variable of mtcfs_node.ENV")
    return os.environ.get(name, "").strip() or default


def _need(name: str) -> str:
    v = env(name)
    if not v:
        raise ConfigError(f"{name} is not set ({ENV[name]})")
    return v


def _int(name: str, default: str, lo: int) -> int:
    v = env(name, default)
    if not v.isdigit() or int(v) < lo:
        raise ConfigError(f"{name}={v!r}: expected an integer >= {lo}")
    return int(v)


def _die(msg: str, code: int = 1) -> NoReturn:
    print(f"mtcfs-node: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def paths() -> tuple[str, Path, Path]:
    """(job, store directory, mount point) from the environment."""
    job = _need("MTCFS_JOB")
    return (job, Path(env("MTCFS_STORE_ROOT", "/var/lib/mtcfs/store")) / job,
            Path(env("MTCFS_MOUNT_ROOT", "/var/lib/mtcfs/mnt")) / job)


def node_rank_label(node: str, label: str, deadline_s: float = API_DEADLINE_S) -> int:
    """The rank in node ``node``'s label ``label``, read from the API server with this
    pod's service account (RBAC: ``get`` on ``nodes``, rbac.yaml).

    Transient failures (connection refused, 5xx, 429) are retried until ``deadline_s``;
    a node without the label, or one whose label is not a number, fails at once.

    Raises:
        ConfigError: the label is missing or malformed, or the API cannot be read.
    """
    host, port = env("KUBERNETES_SERVICE_HOST"), env("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ConfigError("MTCFS_RANK is empty and KUBERNETES_SERVICE_HOST is not set: "
                          "no API server to read the node's rank label from")
    sa = Path(env("MTCFS_SA_DIR", "/var/run/secrets/kubernetes.io/serviceaccount"))
    try:
        token = (sa / "token").read_text().strip()
    except OSError as e:
        raise ConfigError(f"cannot read the service account token: {e}") from e
    ctx = ssl.create_default_context(cafile=str(sa / "ca.crt"))
    url = f"https://{host if ':' not in host else f'[{host}]'}:{port}/api/v1/nodes/{node}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}",
                                               "Accept": "application/json"})
    end = time.monotonic() + deadline_s
    while True:
        try:
            with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
                obj = json.load(r)
            break
        except urllib.error.HTTPError as e:
            if e.code not in (429, 500, 502, 503, 504) or time.monotonic() > end:
                raise ConfigError(f"GET {url}: HTTP {e.code} {e.reason}"
                                  " (the DaemonSet's ServiceAccount needs get on nodes,"
                                  " rbac.yaml)") from e
        except (OSError, ValueError) as e:
            if time.monotonic() > end:
                raise ConfigError(f"GET {url}: {e}") from e
        time.sleep(2)
    labels = obj.get("metadata", {}).get("labels", {}) or {}
    value = labels.get(label)
    if value is None:
        raise ConfigError(f"node {node} has no label {label}: "
                          f"kubectl label node {node} {label}=R (R = 0..nodes-1)")
    if not str(value).isdigit():
        raise ConfigError(f"node {node}: label {label}={value!r} is not a rank number")
    return int(value)


def mount_options() -> str:
    """The ``-o`` option string for this pod, from the environment.

    Raises:
        ConfigError: see :func:`node_rank_label` and the checks here.
    """
    _, store, _ = paths()
    opts = [f"store={store}", f"size={_need('MTCFS_SIZE')}"]
    if env("MTCFS_BACKUP"):
        opts.append(f"backup={env('MTCFS_BACKUP')}")
    if env("MTCFS_BACKUP_INTERVAL"):
        opts.append(f"backup_interval={env('MTCFS_BACKUP_INTERVAL')}")
    nodes = _int("MTCFS_NODES", "1", 1)
    pod_ip = env("MTCFS_POD_IP", "127.0.0.1")
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip
    if nodes > 1:
        if env("MTCFS_RANK"):
            rank = _int("MTCFS_RANK", "", 0)
        else:
            rank = node_rank_label(_need("MTCFS_NODE_NAME"),
                                   env("MTCFS_RANK_LABEL", "mtcfs.io/rank"))
        if rank >= nodes:
            raise ConfigError(f"rank {rank} is not below MTCFS_NODES={nodes}")
        # ';' separates list items unambiguously (docs/usage.md, "Commas").
        coord = ";".join(a.strip() for a in _need("MTCFS_COORD").split(",") if a.strip())
        coord = coord if coord.startswith("etcd://") else f"etcd://{coord}"
        opts += [f"rank={rank}", f"nodes={nodes}", f"coord={coord}",
                 f"listen={host}:{_int('MTCFS_PEER_PORT', '7470', 1)}"]
        if env("MTCFS_REPLICAS"):
            opts.append(f"replicas={_int('MTCFS_REPLICAS', '', 0)}")
        tls = Path(env("MTCFS_TLS_DIR", "/etc/mtcfs/tls"))
        if (tls / "ca.crt").exists():
            cert, key = tls / f"rank-{rank}.crt", tls / f"rank-{rank}.key"
            if not (cert.exists() and key.exists()):
                raise ConfigError(f"{tls} has ca.crt but no rank-{rank}.crt/.key for rank {rank}")
            opts += [f"tls_ca={tls / 'ca.crt'}", f"tls_cert={cert}", f"tls_key={key}"]
        etls = Path(env("MTCFS_ETCD_TLS_DIR", "/etc/mtcfs/etcd-tls"))
        if (etls / "ca.crt").exists():
            opts.append(f"coord_ca={etls / 'ca.crt'}")
            if (etls / "tls.crt").exists():
                opts += [f"coord_cert={etls / 'tls.crt'}", f"coord_key={etls / 'tls.key'}"]
        if env("MTCFS_INSECURE").lower() in ("yes", "true", "1"):
            opts.append("insecure")
    if env("MTCFS_METRICS_PORT"):
        opts.append(f"metrics={host}:{_int('MTCFS_METRICS_PORT', '', 1)}")
    if env("MTCFS_EXTRA_OPTIONS"):
        opts.append(env("MTCFS_EXTRA_OPTIONS").strip(","))
    return ",".join(opts)


def _die_with(parent: int) -> None:
    """In the daemon's child process before exec: SIGKILL it when ``run`` (pid ``parent``)
    dies, as an exec'd daemon would die with the container; prctl(2) PR_SET_PDEATHSIG."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
        os._exit(127)
    if os.getppid() != parent:  # run died before the prctl
        os._exit(127)


def _prestop_running(run_dir: Path) -> bool:
    """True while a ``prestop`` of this container has its pid file and is alive."""
    try:
        pid = int((run_dir / "prestop.pid").read_text().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return True


def supervise(argv: list[str], run_dir: Path, wait_s: float = PRESTOP_WAIT_S) -> int:
    """Run the daemon ``argv`` as a child until it exits; the exit status to end with.

    Signals in :data:`FORWARDED` are passed on to the daemon. After its exit, waits at most
    ``wait_s`` seconds for a running ``prestop`` (see :func:`_prestop_running`) to end.
    Returns the daemon's exit status, or 128 + N when a signal N ended it (as a shell
    reports it).
    """
    parent = os.getpid()
    child = subprocess.Popen(argv, preexec_fn=lambda: _die_with(parent))  # noqa: PLW1509 (one thread)

    def forward(signum: int, _frame: object) -> None:
        try:
            child.send_signal(signum)
        except OSError:  # already gone
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    rc = child.wait()
    end = time.monotonic() + wait_s
    if _prestop_running(run_dir):
        print("mtcfs-node: the daemon exited; waiting for preStop to finish", file=sys.stderr,
              flush=True)
        while _prestop_running(run_dir) and time.monotonic() < end:
            time.sleep(0.1)
    return rc if rc >= 0 else 128 - rc


def cmd_run(a: argparse.Namespace) -> None:
    """Build the options, clear a dead mount, run the daemon in the foreground."""
    job, store, mnt = paths()
    argv = ["mtcfs", job, str(mnt), "-f", "-o", mount_options()]
    if a.dry_run:
        print(" ".join(argv))
        return
    if mountinfo.is_mounted(mnt):
        # The container before this one died with the mount in place (a crash, OOM, a
        # liveness kill): its FUSE connection is dead and every access fails ENOTCONN.
        # Abort and detach it; the sealed files are in the store, the new daemon serves
        # them. Training pods see the new mount through HostToContainer propagation.
        print(f"mtcfs-node: clearing the dead mount at {mnt}", file=sys.stderr, flush=True)
        mountinfo.force_unmount(mnt)
    mnt.mkdir(parents=True, exist_ok=True)
    store.parent.mkdir(parents=True, exist_ok=True)
    print(f"mtcfs-node: {' '.join(argv)}", file=sys.stderr, flush=True)
    sys.exit(supervise(argv, Path(a.run_dir)))


_STAT = """\
import os, sys
os.stat(sys.argv[1])
try:
    os.stat(sys.argv[2])
except FileNotFoundError:
    pass
"""


def _bounded(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Run ``argv``; (exit status, output tail), or (None, "") after ``timeout`` seconds.

    On timeout the child is SIGKILLed and not waited for: a process blocked in a FUSE
    request that the daemon already read cannot die before the daemon answers.
    """
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        return None, ""
    return p.returncode, out.decode(errors="replace").strip()[-300:]


def fuse_mounted(mnt: Path) -> bool:
    """True if the top mount at ``mnt`` is an mtcfs FUSE mount (read from mountinfo,
    without touching the mount)."""
    found = [fs for mp, fs in mountinfo.mounts() if mp == os.path.abspath(mnt)]
    return bool(found) and found[-1] == "fuse.mtcfs"


def check(mnt: Path, timeout: float, status: bool) -> str | None:
    """None when the mount at ``mnt`` is served; else why not, in one line."""
    if not fuse_mounted(mnt):
        return f"{mnt} is not an mtcfs mount"
    probe_name = str(mnt / f".mtcfs-probe-{secrets.token_hex(6)}")
    rc, out = _bounded([sys.executable, "-c", _STAT, str(mnt), probe_name], timeout)
    if rc is None:
        return f"stat through {mnt} did not answer within {timeout:g}s (daemon stuck?)"
    if rc != 0:
        return f"stat through {mnt} failed: {out.splitlines()[-1] if out else rc}"
    if status:
        tool = shutil.which("mtcfs")
        argv = [tool] if tool else [sys.executable, "-m", "mtcfs"]
        rc, out = _bounded(argv + ["status", str(mnt), "--json"], timeout)
        if rc is None:
            return f"mtcfs status {mnt} did not answer within {timeout:g}s"
        if rc != 0:
            return f"mtcfs status {mnt} failed ({rc}): {out.splitlines()[-1] if out else ''}"
    return None


def cmd_probe(a: argparse.Namespace) -> None:
    _, _, mnt = paths()
    why = check(mnt, a.timeout, status=not a.no_status)
    if why:
        _die(why)
    print(f"mtcfs-node: {mnt} is served")


def cmd_wait(a: argparse.Namespace) -> None:
    mnt = Path(a.mountpoint) if a.mountpoint else paths()[2]
    end = time.monotonic() + a.timeout
    while True:
        why = check(mnt, min(5.0, a.timeout), status=False)
        if why is None:
            print(f"mtcfs-node: {mnt} is served")
            return
        if time.monotonic() > end:
            _die(f"gave up after {a.timeout:g}s: {why}")
        time.sleep(1)


def cmd_prestop(a: argparse.Namespace) -> None:
    _, _, mnt = paths()
    if not mountinfo.is_mounted(mnt):
        print(f"mtcfs-node: {mnt} is not mounted")
        return
    # While this file names a live process, the entrypoint (run) outlives the daemon it
    # supervises, so this hook is not killed with the container before it ends.
    mark = Path(a.run_dir) / "prestop.pid"
    mark.parent.mkdir(parents=True, exist_ok=True)
    mark.write_text(f"{os.getpid()}\n")
    try:
        _prestop(mnt, a.timeout)
    finally:
        try:
            mark.unlink()
        except FileNotFoundError:
            pass


def _prestop(mnt: Path, timeout: float) -> None:
    tool = shutil.which("mtcfs")
    argv = [tool] if tool else [sys.executable, "-m", "mtcfs"]
    # --flush: the newest step to the peers and the bucket first (stop_flush=, 25 s by
    # default), then the unmount: the pod's grace period (180 s) covers both.
    rc, out = _bounded(argv + ["umount", str(mnt), "--flush", "--timeout", str(timeout)],
                       timeout + 45)
    if rc == 0:
        print(f"mtcfs-node: unmounted {mnt} cleanly")
        return
    print(f"mtcfs-node: clean unmount failed ({out or 'no answer'}); forcing",
          file=sys.stderr, flush=True)
    rc, out = _bounded(argv + ["umount", str(mnt), "--force"], 30)
    if rc != 0:
        _die(f"forced unmount of {mnt} failed: {out or 'no answer'}")
    print(f"mtcfs-node: unmounted {mnt} by force (sealed files stay in the store)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mtcfs-node", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the DaemonSet's entrypoint: run the daemon")
    r.add_argument("--dry-run", action="store_true", help="print the mtcfs command")
    r.add_argument("--run-dir", default=RUN_DIR, help=f"where prestop says it runs ({RUN_DIR})")
    r.set_defaults(fn=cmd_run)
    pr = sub.add_parser("probe", help="readiness/liveness: is the mount served?")
    pr.add_argument("--timeout", type=float, default=5.0, help="seconds per check")
    pr.add_argument("--no-status", action="store_true", help="skip mtcfs status")
    pr.set_defaults(fn=cmd_probe)
    w = sub.add_parser("wait", help="wait until the mount is served (trainer init)")
    w.add_argument("mountpoint", nargs="?", help="default: MTCFS_MOUNT_ROOT/MTCFS_JOB")
    w.add_argument("--timeout", type=float, default=600.0)
    w.set_defaults(fn=cmd_wait)
    s = sub.add_parser("prestop", help="unmount cleanly (forced if that fails)")
    s.add_argument("--timeout", type=float, default=120.0)
    s.add_argument("--run-dir", default=RUN_DIR, help=f"as run's --run-dir ({RUN_DIR})")
    s.set_defaults(fn=cmd_prestop)
    a = p.parse_args(argv)
    try:
        a.fn(a)
    except ConfigError as e:
        _die(str(e), 2)


if __name__ == "__main__":
    main()
