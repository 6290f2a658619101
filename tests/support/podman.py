"""The DaemonSet's pod run by podman on this machine as the kubelet would run it.

What the kubelet takes from deploy/kubernetes/daemonset.yaml is read from the manifest
itself (support/kube.py), so the pod runs what the manifest says: the image's entrypoint,
``privileged``, the environment (the ConfigMap's values, the downward API's node name and
pod IP, the literals), every volumeMount with its propagation (``Bidirectional`` is
``rshared``, ``HostToContainer`` ``rslave``), the probes' and preStop's commands run in
the container with their timeouts. Host paths are directories of the test's own, each a
shared bind mount of itself (a node's ``/`` is shared under systemd; here it is not).

Not applied, and why: the memory request and limit (cgroup limits are beside the point of
these tests), the pod network (one pod has none; two pods share the host's, on ports of
their own), the service account (the rank is given in ``MTCFS_RANK``, as a StatefulSet
or a node label would; tests/t4_kubernetes_test.py covers the label lookup).

Two things of this machine are worked around and said here once: crun refuses its cgroup
layout (v1 controllers beside a v2 mount), so the runtime is runc; and podman's default
limits of open files and processes are above this machine's hard limits, which a
container cannot raise, so the pod gets the machine's own.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from pathlib import Path

from .kube import CONTAINER, DS, ROOT, container_env

IMAGE = "localhost/mtcfs:0.1.0"
PROPAGATION = {"Bidirectional": "rshared", "HostToContainer": "rslave", None: "rprivate"}


def available() -> str | None:
    """None when podman, runc and mmdebstrap are installed and this is root; else why not."""
    if os.geteuid() != 0:
        return "podman pods with FUSE need root"
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/setup.sh installs it)"
    return None


def podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``podman ARGS`` with runc as the runtime; raises on a non-zero exit when ``check``."""
    r = subprocess.run(["podman", "--runtime", "runc", *args], capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"podman {' '.join(args[:3])}... exited {r.returncode}: "
                             f"{r.stderr.strip()[-2000:]}")
    return r


def build_image(tag: str = IMAGE, timeout: float = 1500) -> subprocess.CompletedProcess[str]:
    """scripts/build-image.sh, the documented build (mmdebstrap base, podman build)."""
    return subprocess.run(["bash", str(ROOT / "scripts" / "build-image.sh"), tag],
                          capture_output=True, text=True, timeout=timeout)


def limits() -> list[str]:
    """``--ulimit`` arguments: this machine's hard limits of open files and processes
    (processes capped at 32768, the most a container's runc could set here)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = 32768 if nproc == resource.RLIM_INFINITY else min(nproc, 32768)
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def shared_dir(path: Path) -> Path:
    """``path`` created and made a shared mount (a bind mount of itself), as a host path
    under a systemd node's shared ``/`` is: Bidirectional propagation needs it."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    subprocess.run(["mount", "--make-rshared", str(path)], check=True)
    return path


def unmount_all(root: Path) -> None:
    """Detach every mount under ``root`` (FUSE mounts aborted first), deepest first."""
    from mtcfs.base.mountinfo import force_unmount, mounts
    under = sorted({mp for mp, _fs in mounts() if mp == str(root) or mp.startswith(f"{root}/")},
                   key=len, reverse=True)
    for mp in under:
        try:
            force_unmount(Path(mp))
        except Exception:  # noqa: BLE001 (then lazily, below)
            pass
        subprocess.run(["umount", "-l", mp], capture_output=True)


class NodePod:
    """One node's mtcfs pod: the DaemonSet's container, run by podman.

    Args:
        name: the container's name (also the downward API's node name).
        host: this node's host paths live under it (``store``, ``mnt``, ``tls``, ...,
            named after the DaemonSet's volumes).
        env: values that replace the manifest's (``MTCFS_RANK``, ``MTCFS_SIZE``, ...).
        network: ``none`` (one pod) or ``host`` (pods that talk to each other and etcd).
        pod_ip: the downward API's ``status.podIP``.
    """

    def __init__(self, name: str, host: Path, env: dict[str, str], network: str = "none",
                 pod_ip: str = "127.0.0.1", image: str = IMAGE) -> None:
        self.name, self.host, self.network, self.image = name, host, network, image
        self.env = {**container_env(name, pod_ip), **env}
        self.grace_s = float(DS["spec"]["template"]["spec"]["terminationGracePeriodSeconds"])

    def host_path(self, volume: str) -> Path:
        """This node's directory standing for the DaemonSet's volume ``volume``."""
        return self.host / volume

    def _volume_args(self) -> list[str]:
        volumes = {v["name"]: v for v in DS["spec"]["template"]["spec"]["volumes"]}
        args: list[str] = []
        for vm in CONTAINER["volumeMounts"]:
            v = volumes[vm["name"]]
            if v.get("hostPath", {}).get("type") == "CharDevice":
                src = v["hostPath"]["path"]  # /dev/fuse: the host's own
            else:
                src = str(self.host_path(vm["name"]))
                if not os.path.ismount(src):
                    if "secret" in v:  # an optional Secret that is absent: an empty dir
                        Path(src).mkdir(parents=True, exist_ok=True)
                    else:
                        shared_dir(Path(src))
            opts = [PROPAGATION[vm.get("mountPropagation")]]
            if vm.get("readOnly"):
                opts.append("ro")
            args += ["-v", f"{src}:{vm['mountPath']}:{','.join(opts)}"]
        return args

    def start(self) -> None:
        """Create and start the container (``podman run -d``), as the kubelet does."""
        args = ["run", "-d", "--name", self.name, "--network", self.network, *limits()]
        if CONTAINER.get("securityContext", {}).get("privileged"):
            args.append("--privileged")
        for k, v in self.env.items():
            args += ["-e", f"{k}={v}"]
        podman(*args, *self._volume_args(), self.image)

    def restart(self) -> None:
        """The kubelet's restart of a crashed container: the same spec started again."""
        podman("start", self.name)

    def kill(self) -> None:
        """The container dies at once (an OOM kill, a crash): SIGKILL to all of it."""
        podman("kill", "--signal", "KILL", self.name)
        podman("wait", self.name, timeout=60, check=False)

    def running(self) -> bool:
        r = podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return r.stdout.strip() == "true"

    def exec(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """``argv`` in the container (``podman exec``), bounded by ``timeout`` seconds."""
        return podman("exec", self.name, *argv, timeout=timeout, check=False)

    def probe(self, kind: str) -> subprocess.CompletedProcess[str]:
        """The manifest's ``startupProbe``/``readinessProbe``/``livenessProbe`` command,
        with its ``timeoutSeconds``."""
        p = CONTAINER[f"{kind}Probe"]
        return self.exec(p["exec"]["command"], timeout=p["timeoutSeconds"] + 10)

    def wait_started(self, timeout: float = 180) -> None:
        """The startup probe run every ``periodSeconds`` (at most every second here) until
        it passes; raises with the container's log when ``timeout`` passes first or the
        container exits."""
        period = min(1.0, float(CONTAINER["startupProbe"]["periodSeconds"]))
        deadline = time.monotonic() + timeout
        while True:
            r = self.probe("startup")
            if r.returncode == 0:
                return
            if not self.running() or time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: the startup probe did not pass "
                                     f"({r.stdout.strip()} {r.stderr.strip()})\n"
                                     f"{self.logs()[-3000:]}")
            time.sleep(period)

    def prestop(self) -> subprocess.CompletedProcess[str]:
        """The manifest's preStop hook (bounded by the grace period), then the kubelet's
        SIGTERM; waits for the container to exit."""
        r = self.exec(CONTAINER["lifecycle"]["preStop"]["exec"]["command"],
                      timeout=self.grace_s)
        podman("stop", "--time", str(int(self.grace_s)), self.name, timeout=self.grace_s + 30,
               check=False)
        return r

    def exit_code(self) -> int:
        return int(podman("inspect", "--format", "{{.State.ExitCode}}", self.name).stdout)

    def logs(self) -> str:
        r = podman("logs", self.name, check=False)
        return r.stdout + r.stderr

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)


class Trainer:
    """A training pod's container on the same node: the image's python3, the node's mount
    directory mounted with ``HostToContainer`` (rslave) at ``/ckpt``, as deploy/kubernetes/
    example's Job mounts it. It runs as long as the test and sees each new mtcfs mount."""

    def __init__(self, name: str, mnt: Path, image: str = IMAGE) -> None:
        self.name = name
        podman("run", "-d", "--name", name, "--network", "none", *limits(),
               "-v", f"{mnt}:/ckpt:rslave", "--entrypoint", "sleep", image, "infinity")

    def python(self, code: str, *args: str, timeout: float = 60) -> str:
        """``python3 -c code args`` in the container; its stdout, or raises."""
        r = podman("exec", self.name, "python3", "-c", code, *args, timeout=timeout,
                   check=False)
        if r.returncode != 0:
            raise AssertionError(f"in {self.name}: {r.stderr.strip()[-2000:]}")
        return r.stdout

    def remove(self) -> None:
        podman("rm", "--force", "--time", "0", self.name, check=False)
