"""Mount / unmount mtcfs through its CLI for the examples, with a teardown that always works.

If a clean ``mtcfs umount`` fails (a file still open, a dead or stuck daemon), the teardown
falls back to :func:`mtcfs.base.mountinfo.force_unmount` (abort the FUSE connection, lazy unmount)
and kills the daemon.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(REPO))


from mtcfs.base.mountinfo import force_unmount, is_mounted, mounts  # noqa: E402,F401 (used by demo.py)
from mtcfs.core.store.datafs import unmount_data  # noqa: E402


def remove_store(store: str | os.PathLike[str], ignore_errors: bool = False) -> None:
    """Delete a store directory (a node lost, the end of a run): its data tmpfs first, which
    outlives the daemon (docs/operations.md, "Removing a store"), then the tree."""
    if os.path.isdir(store):
        unmount_data(str(store))
    shutil.rmtree(store, ignore_errors=ignore_errors)

T = TypeVar("T")


_etcd: dict[str, str] = {}
_etcd_stop: list[Callable[[], None]] = []


def stop_local_etcd() -> None:
    """Stop :func:`local_etcd`'s etcd now (for a process that leaves with os._exit)."""
    while _etcd_stop:
        _etcd_stop.pop()()
    _etcd.clear()


def local_etcd(tag: str) -> dict[str, str]:
    """The ``coord=``, ``coord_prefix=`` and etcd TLS options (``coord_ca=``,
    ``coord_cert=``, ``coord_key=``) for a demo's nodes: a one-member etcd on loopback that
    speaks only TLS and asks for a client certificate (tests/support/etcd.py; data and
    certificates on tmpfs), started once per process and stopped when it exits. A real job
    points ``coord=`` at its own etcd cluster (docs/security-etcd.md)."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import atexit

    from mtcfs.base.pki import JobCa
    from support.etcd import EtcdCluster, EtcdServerTls
    if not _etcd:
        root = Path(tempfile.mkdtemp(prefix="mtcfs-demo-etcd-", dir="/dev/shm"))
        ca = JobCa(root / "pki", "etcd")
        server = ca.issue("server", cn="etcd", ips=("127.0.0.1",))
        cluster = EtcdCluster(root / "etcd", 1, tls=EtcdServerTls(
            server=server, admin=ca.issue("root", cn="root"))).start()

        def stop() -> None:
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
        atexit.register(stop_local_etcd)
        _etcd_stop.append(stop)
        client = ca.issue("mtcfs", cn="mtcfs")
        _etcd.update(coord=cluster.url, coord_ca=str(ca.ca), coord_cert=str(client.cert),
                     coord_key=str(client.key))
    return {**_etcd, "coord_prefix": f"/mtcfs-demo/{tag}-{os.getpid()}"}


def job_tls(work: Path, job: str, nodes: int) -> Callable[[int], dict[str, str]]:
    """A job CA and a peer certificate per rank in ``work/pki`` (what ``mtcfs certs`` makes);
    returns rank -> its ``tls_ca=``, ``tls_cert=``, ``tls_key=`` options (docs/security.md)."""
    from mtcfs.base.pki import JobCa
    ca = JobCa(work / "pki", job)
    issued = [ca.issue_rank(job, r) for r in range(nodes)]
    return lambda r: {"tls_ca": str(issued[r].ca), "tls_cert": str(issued[r].cert),
                      "tls_key": str(issued[r].key)}


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def mtcfs(*args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run ``python -m mtcfs ARGS`` (the same CLI as ``mtcfs`` / ``mount -t fuse.mtcfs``)."""
    r = subprocess.run([sys.executable, "-m", "mtcfs", *args], capture_output=True, text=True,
                       timeout=timeout, env=_env())
    if check and r.returncode != 0:
        raise RuntimeError(f"mtcfs {' '.join(args)} failed ({r.returncode}): "
                           f"{(r.stderr or r.stdout).strip()}")
    return r


class MtcfsMount:
    """One mtcfs mount made with the CLI.

    Args:
        job: the job name (mount source).
        mountpoint: an existing empty directory.
        options: ``-o`` options, e.g. ``{"store": ..., "backup": "file:///..."}``; a value
            of None makes a bare flag (``{"mtc": None}``).
    """

    def __init__(self, job: str, mountpoint: str | os.PathLike,
                 options: dict[str, str | None]) -> None:
        self.job = job
        self.mnt = Path(mountpoint)
        self.options = dict(options)
        self.pid: int | None = None
        self._sock: str | None = None

    def mount(self) -> "MtcfsMount":
        opts = ",".join(k if v is None else f"{k}={v}" for k, v in self.options.items())
        mtcfs(self.job, str(self.mnt), "-o", opts, timeout=180)
        self._sock = os.getxattr(self.mnt, "user.mtcfs.control").decode()
        self.pid = self.status()["pid"]
        return self

    def call(self, cmd: str, **args):
        """One control request to the daemon (what ``mtcfs status --json`` etc. send)."""
        from mtcfs import control
        assert self._sock is not None
        return control.call(self._sock, cmd, timeout=60, **args)

    def status(self) -> dict:
        return self.call("status")

    def checkpoints(self) -> list[dict]:
        return json.loads(mtcfs("checkpoints", str(self.mnt), "--json").stdout)

    def state(self, rel: str) -> str:
        return os.getxattr(self.mnt / rel, "user.mtcfs.state").decode()

    def unmount(self, timeout: float = 60.0) -> None:
        """Clean unmount (waits for the daemon to exit); falls back to a forced one."""
        try:
            if is_mounted(self.mnt):
                mtcfs("umount", str(self.mnt), "--timeout", str(timeout), timeout=timeout + 10)
        except (RuntimeError, subprocess.TimeoutExpired):
            force_unmount(self.mnt)
        finally:
            self._reap()

    def force(self) -> None:
        """Tear down whatever state the mount is in (exceptions, Ctrl-C)."""
        try:
            if is_mounted(self.mnt):
                r = subprocess.run([sys.executable, "-m", "mtcfs", "umount", str(self.mnt),
                                    "--timeout", "10"], capture_output=True, timeout=20,
                                   env=_env())
                if r.returncode != 0:
                    force_unmount(self.mnt)
        except (OSError, subprocess.TimeoutExpired):
            force_unmount(self.mnt)
        force_unmount(self.mnt)
        self._reap()

    def _reap(self) -> None:
        pid, self.pid = self.pid, None
        if not pid:
            return
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        force_unmount(self.mnt)


def run_in_scratch(prefix: str, nodes: int, body: Callable[[Path], T],
                   on_error: Callable[[Path], None]) -> T | None:
    """Run ``body(work)`` in a new scratch directory under /dev/shm whose nodes mount at
    ``work/n<r>/mnt``; whatever happens, every such mount is torn down and the directory
    removed. Ctrl-C (even if the shell started us with SIGINT ignored) and SIGTERM end the
    run through that cleanup.

    Returns:
        ``body``'s result, or None when interrupted (after printing so on stderr).

    Raises:
        whatever ``body`` raises, after ``on_error(work)`` (e.g. printing the daemons' logs).
    """
    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, on_term)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    try:
        return body(work)
    except KeyboardInterrupt:
        print("interrupted; cleaning up", file=sys.stderr, flush=True)
        return None
    except Exception:
        on_error(work)
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup finish
        for r in range(nodes):
            mnt = work / f"n{r}" / "mnt"
            if is_mounted(mnt):
                force_unmount(mnt)
        # Every mount left below ``work``, deepest first: the mtcfs mounts of stores kept
        # elsewhere in it (goodput's calibration nodes) and the stores' data tmpfs mounts,
        # which outlive their daemons (docs/operations.md, "Removing a store").
        below = str(work).rstrip("/") + "/"
        for mp, fstype in sorted(mounts(), key=lambda e: len(e[0]), reverse=True):
            if not mp.startswith(below):
                continue
            if fstype.startswith("fuse"):
                force_unmount(mp)
            elif fstype == "tmpfs" and os.path.basename(mp) == "data":
                unmount_data(os.path.dirname(mp))
        shutil.rmtree(work, ignore_errors=True)
        signal.signal(signal.SIGINT, signal.default_int_handler)


def print_node_logs(work: Path, nodes: int, lines: int = 25) -> None:
    """The end of every node's daemon log (``work/n<r>/store/mtcfs.log``), to stderr."""
    for r in range(nodes):
        try:
            text = (work / f"n{r}" / "store" / "mtcfs.log").read_text(errors="replace")
        except OSError:
            continue
        tail = "\n".join(text.splitlines()[-lines:])
        print(f"--- node {r}: end of {work}/n{r}/store/mtcfs.log ---\n{tail}", file=sys.stderr)
