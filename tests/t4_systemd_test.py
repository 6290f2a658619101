"""Tier-4: mtcfs under systemd (systemd/mtcfs@.service, ``Type=notify``).

A real daemon in the foreground (``-f``, as the unit starts it) with ``$NOTIFY_SOCKET``
pointing at a datagram socket this test reads, as systemd's would be: READY=1 comes once
the mount is visible and served, never before; STOPPING=1 on the way down; no socket or a
dead one never stops the mount. Under ``$JOURNAL_STREAM`` the log lines carry a syslog
priority and no second timestamp. The units pass ``systemd-analyze verify``.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtcfs.base.mountinfo import force_unmount, is_mounted
from support.mount import MTCFS

ROOT = Path(__file__).resolve().parent.parent


class NotifySocket:
    """A bound AF_UNIX datagram socket, as systemd's notification socket."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def next(self, timeout: float) -> dict[str, str] | None:
        """The next message as a dict of its fields; None after ``timeout`` seconds."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(4096)
        except TimeoutError:
            return None
        return dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)

    def close(self) -> None:
        self.sock.close()


def _start(shm_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], Path]:
    mnt = shm_dir / "mnt"
    mnt.mkdir()
    p = subprocess.Popen(MTCFS + ["sdjob", str(mnt), "-f", "-o",
                                  f"store={shm_dir / 'store'},size=64M"],
                         env={**os.environ, **env}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    return p, mnt


def _wait_mounted(p: subprocess.Popen[str], mnt: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not is_mounted(str(mnt)) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop(p: subprocess.Popen[str], mnt: Path) -> str:
    """SIGTERM (what systemctl stop sends), wait; then whatever is left is forced."""
    try:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
        return err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if is_mounted(str(mnt)):
            force_unmount(str(mnt))


def test_ready_comes_after_the_mount_is_served_and_stopping_on_sigterm(shm_dir):
    ns = NotifySocket(shm_dir / "notify")
    p, mnt = _start(shm_dir, {"NOTIFY_SOCKET": str(ns.path)})
    try:
        got: list[dict[str, str]] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            msg = ns.next(timeout=max(0.1, deadline - time.monotonic()))
            if msg is None:
                break
            # what systemd does at READY=1: start what is ordered after the unit. At that
            # moment the mount must be there and answer.
            msg["_mounted"] = str(is_mounted(str(mnt)))
            got.append(msg)
            if msg.get("READY") == "1":
                (mnt / "hello").write_bytes(b"served")
                assert (mnt / "hello").read_bytes() == b"served"
                break
        assert got and got[-1].get("READY") == "1", (got, p.poll())
        assert got[-1]["_mounted"] == "True", got
        assert got[-1]["MAINPID"] == str(p.pid)
        assert "serving job sdjob rank 0" in got[-1]["STATUS"]
        # what came before READY=1 said it was mounting and did not claim readiness
        assert all("READY" not in m for m in got[:-1]), got
        assert any(m.get("STATUS", "").startswith("mounting") for m in got[:-1]), got
        p.send_signal(signal.SIGTERM)
        msg = ns.next(timeout=30)
        assert msg is not None and msg.get("STOPPING") == "1", msg
        assert p.wait(timeout=60) == 0
        assert not is_mounted(str(mnt))
    finally:
        _stop(p, mnt)
        ns.close()


def test_a_dead_notify_socket_does_not_stop_the_mount(shm_dir):
    """``$NOTIFY_SOCKET`` naming nothing (systemd gone, a stale environment): the mount
    serves, a warning is logged once."""
    p, mnt = _start(shm_dir, {"NOTIFY_SOCKET": str(shm_dir / "nobody-listens")})
    try:
        _wait_mounted(p, mnt)
        (mnt / "f").write_bytes(b"x")
        assert (mnt / "f").read_bytes() == b"x"
    finally:
        err = _stop(p, mnt)
    assert p.returncode == 0, err
    assert err.count("cannot notify the service manager") == 1, err


def test_under_journald_lines_carry_a_priority_and_no_timestamp(shm_dir):
    p, mnt = _start(shm_dir, {"JOURNAL_STREAM": "8:12345"})
    try:
        _wait_mounted(p, mnt)
        assert is_mounted(str(mnt))
    finally:
        err = _stop(p, mnt)
    lines = [ln for ln in err.splitlines() if ln]
    assert lines, err
    for ln in lines:
        assert ln[:3] in ("<2>", "<3>", "<4>", "<6>", "<7>"), ln
        assert not ln[3:7].isdigit(), f"a timestamp journald adds again: {ln}"
    assert any(ln.startswith("<6>INFO ") for ln in lines), err


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
@pytest.mark.parametrize("unit", ["mtcfs@.service", "mnt-ckpt.mount"])
def test_units_pass_systemd_analyze_verify(tmp_path, unit):
    """The unit as shipped, its ExecStart pointed at this checkout's ``mtcfs`` when
    /usr/local/bin/mtcfs (scripts/setup.sh's link) is not there."""
    text = (ROOT / "systemd" / unit).read_text()
    if not os.access("/usr/local/bin/mtcfs", os.X_OK):
        text = text.replace("/usr/local/bin/mtcfs", str(Path(sys.executable).parent / "mtcfs"))
    name = unit.replace("@", "@sdjob") if "@" in unit else unit
    (tmp_path / name).write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(tmp_path / name)],
                       capture_output=True, text=True, timeout=60)
    out = "\n".join(ln for ln in (r.stdout + r.stderr).splitlines()
                    # this sandbox's own units, not ours
                    if name.split(".")[0] in ln or "mtcfs" in ln)
    assert r.returncode == 0 and not out, r.stdout + r.stderr
    assert "Type=notify" in text or unit.endswith(".mount")


def test_a_sigterm_as_soon_as_the_mount_appears_unmounts_it(shm_dir):
    """``systemctl stop`` right after start: SIGTERM the moment the mount is in
    /proc/self/mountinfo. The daemon unmounts and exits 0, as for any stop. Before, the
    signal came before the daemon listened for it: the default action killed it, silently,
    and left a dead mount behind (every access ENOTCONN). Three tries make the early
    moment likely."""
    for i in range(3):
        root = shm_dir / f"try{i}"
        root.mkdir()
        p, mnt = _start(root, {})
        try:
            deadline = time.monotonic() + 60
            while not is_mounted(str(mnt)) and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            assert is_mounted(str(mnt)), p.poll()
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=60)
            left = is_mounted(str(mnt))
        finally:
            err = _stop(p, mnt)
        assert (rc, left) == (0, False), err
