"""Real mounts for tests: start ``mtcfs`` in a subprocess, wait, unmount, kill, remount.

Every mount a test makes is torn down by the fixture, even when the daemon hangs or was
SIGKILLed (the FUSE connection is aborted through fusectl, then lazily unmounted). Every
started Mount is also registered with the test watchdog (support/watchdog.py), which ends
it if the test overruns its deadline, so a daemon that never answers cannot hang the suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mtcfs.base.mountinfo import force_unmount, is_mounted  # noqa: F401 (re-exported to tests)

from .watchdog import WATCHDOG

VENV_BIN = Path(sys.executable).parent
MTCFS = [sys.executable, "-m", "mtcfs"]

#: Directories the tests made stores in (shm_dir, every Mount's store): the session-end
#: check (conftest.py) finds there any data tmpfs of mtcfs's left mounted.
TEST_ROOTS: set[str] = set()


def track(root: str | os.PathLike[str]) -> None:
    """Have the session-end check look for leaked mounts below ``root``."""
    TEST_ROOTS.add(os.path.realpath(root))


def _below(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def unmount_below(root: str | os.PathLike[str]) -> list[str]:
    """Detach every mount at or below ``root`` (a store's ``data/`` tmpfs, a tmpfs a test
    mounted for a store, a FUSE mount left behind), deepest first; FUSE ones are aborted
    first (force_unmount). Returns their mount points. Nothing without root."""
    from mtcfs.base import mountinfo
    r = os.path.realpath(root)
    points = sorted({e.mount_point for e in mountinfo.entries() if _below(e.mount_point, r)},
                    key=len, reverse=True)
    for mp in points:
        e = mountinfo.entry_at(mp)
        if e is not None and e.fstype.startswith("fuse"):
            force_unmount(mp)
        else:
            subprocess.run(["umount", "-l", mp], capture_output=True, check=False)
    return points


def remove_tree(root: str | os.PathLike[str]) -> None:
    """Remove a test directory that held stores: its mounts first (:func:`unmount_below`;
    a store's data tmpfs outlives its daemon), then the tree (errors ignored)."""
    import shutil
    unmount_below(root)
    shutil.rmtree(root, ignore_errors=True)


def leaked_data_mounts() -> list[str]:
    """Mount points of mtcfs data tmpfs mounts (source ``mtcfs-data``) below the tracked
    test roots."""
    from mtcfs.base import mountinfo
    from mtcfs.core.store.datafs import SOURCE
    return [e.mount_point for e in mountinfo.entries()
            if e.source == SOURCE and any(_below(e.mount_point, r) for r in TEST_ROOTS)]


def drop_page_cache(path) -> None:
    """Forget the kernel's cached pages of one file of a mount, so that the next read of it
    reaches the daemon."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)

class Mount:
    """One mtcfs mount for a test.

    Args:
        root: a per-test directory; the store, mount point and log go below it.
        job: job name.
        options: extra ``-o`` options (``store=`` is set from ``root`` unless given).
    """

    def __init__(self, root: Path, job: str = "testjob", options: dict[str, str] | None = None,
                 store: Path | None = None, mnt: Path | None = None,
                 prefix: list[str] | None = None) -> None:
        self.root = Path(root)
        #: prepended to the mount command (``nsenter --net=...``: a node of a Fabric)
        self.prefix = list(prefix or [])
        self.job = job
        self.store = Path(store or self.root / "store")
        self.mnt = Path(mnt or self.root / "mnt")
        self.options = dict(options or {})
        self.pid: int | None = None
        track(self.store)

    def option_string(self) -> str:
        opts = {"store": str(self.store), "size": "2G", **self.options}
        if os.environ.get("MTCFS_TEST_FUSE_PATH") == "daemon":
            opts.setdefault("passthrough", "no")  # (conftest.py: fuse_path)
        if os.environ.get("MTCFS_TEST_BG_SCHED"):
            opts.setdefault("bg_sched", os.environ["MTCFS_TEST_BG_SCHED"])
        return ",".join(k if v is None else f"{k}={v}" for k, v in opts.items())

    def start(self, timeout: float = 60.0) -> "Mount":
        self.mnt.mkdir(parents=True, exist_ok=True)
        WATCHDOG.register(self)  # until cleanup(); refused once the test's watchdog fired
        r = subprocess.run([*self.prefix, *MTCFS, self.job, str(self.mnt),
                            "-o", self.option_string()],
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"mount failed ({r.returncode}): {r.stderr.strip()}\n{self.log()}")
        try:
            self.pid = self.status()["pid"]
        except RuntimeError as exc:  # mounted (rc 0), then gone: say what the daemon said
            with open("/proc/self/mountinfo") as f:
                here = [line.strip() for line in f if str(self.root) in line]
            raise RuntimeError(f"{exc}\nmounts below {self.root}: {here}\n"
                               f"the daemon's log:\n{self.log()[-4000:]}") from None
        WATCHDOG.after_start(self)
        return self

    def path(self, *parts: str) -> Path:
        return self.mnt.joinpath(*parts)

    def cli(self, *args: str, check: bool = True, timeout: float = 120.0) -> subprocess.CompletedProcess:
        r = subprocess.run(MTCFS + list(args), capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"mtcfs {' '.join(args)} failed ({r.returncode}): {r.stderr}")
        return r

    def status(self) -> dict:
        return json.loads(self.cli("status", str(self.mnt), "--json").stdout)

    def checkpoints(self) -> list[dict]:
        return json.loads(self.cli("checkpoints", str(self.mnt), "--json").stdout)

    def wait_for(self, pred, timeout: float = 60.0, what: str = "condition"):
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}\n{self.log()[-4000:]}")
            time.sleep(0.05)

    def state(self, rel: str) -> str:
        return os.getxattr(self.path(rel), "user.mtcfs.state").decode()

    def wait_state(self, rel: str, want: str, timeout: float = 60.0) -> None:
        self.wait_for(lambda: self.state(rel) == want, timeout, f"{rel} to be {want}")

    def stop(self, timeout: float = 60.0) -> None:
        """Clean unmount; waits for the daemon to exit."""
        if is_mounted(str(self.mnt)):
            self.cli("umount", str(self.mnt), "--timeout", str(timeout), timeout=timeout + 10)
        self.pid = None

    def kill9(self) -> None:
        """SIGKILL the daemon (a crash), then clear the dead mount."""
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.02)
        force_unmount(str(self.mnt))
        self.pid = None

    def cleanup(self) -> None:
        try:
            if self.pid and is_mounted(str(self.mnt)):
                self.stop(timeout=20)
        except Exception:
            pass
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        force_unmount(str(self.mnt))
        WATCHDOG.unregister(self)

    def log(self) -> str:
        try:
            return (self.store / "mtcfs.log").read_text()
        except OSError:
            return ""


def one_line_error(r: "subprocess.CompletedProcess[str]", code: int, *words: str) -> str:
    """The one line of ``r``'s stderr, after asserting that ``r`` (a command run with
    ``text=True``) exited ``code`` with exactly one line on stderr holding every word of
    ``words``."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]
