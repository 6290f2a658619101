"""The test suite can never hang (tests/support/watchdog.py).

An inner pytest run mounts mtcfs, SIGSTOPs the daemon and reads through the mount: the
reader sleeps uninterruptibly in the kernel, where pytest-timeout's signal cannot reach it.
The watchdog must abort the FUSE connection at the test's deadline, so that the inner test
fails with the watchdog's message, the next inner test still runs, and nothing stays
mounted or running. Without the watchdog the inner run is still blocked when this test
gives up on it (BOUND seconds), and this test fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from support.mount import is_mounted  # noqa: E402
from support.watchdog import deadline_for, margin  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WATCHDOG_S = 5
BOUND = 60  # the inner run must end well within this

INNER = textwrap.dedent(f"""
    import json
    import os
    import signal

    import pytest


    @pytest.mark.watchdog({WATCHDOG_S})
    def test_read_from_a_stopped_daemon(make_mount):
        m = make_mount()
        p = m.path("f.bin")
        p.write_bytes(os.urandom(4 << 20))
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read goes to the daemon
        with open(os.environ["WATCHDOG_PROBE"], "w") as f:
            json.dump({{"mnt": str(m.mnt), "pid": m.pid, "store": str(m.store)}}, f)
        os.kill(m.pid, signal.SIGSTOP)
        os.pread(fd, 1 << 20, 0)              # READ: the reader waits in D state
        os.stat(m.path("never-looked-up"))   # LOOKUP: waits too, were the data still cached
        pytest.fail("reads through a stopped daemon returned")


    def test_the_next_test_runs(make_mount):
        m = make_mount()
        m.path("x").write_bytes(b"ok")
        assert m.path("x").read_bytes() == b"ok"
""")


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _mtcfs_processes_naming(path: str) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if path.encode() in argv and _alive(int(p)):
            out.append(int(p))
    return out


def _end_leftovers(probe: Path) -> str:
    """What the watchdog should have done, done from here: the inner run cannot be ended
    while its reader is blocked on the stopped daemon."""
    if not probe.exists():
        return "no probe file"
    info = json.loads(probe.read_text())
    from support.mount import force_unmount
    force_unmount(info["mnt"])
    for pid in [info["pid"], *_mtcfs_processes_naming(info["mnt"])]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"ended {info['mnt']} from the outer test"


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="/dev/fuse is missing")
def test_a_daemon_that_never_answers_fails_the_test_instead_of_hanging(tmp_path):
    inner = tmp_path / "hang_test.py"
    inner.write_text(INNER)
    probe = tmp_path / "probe.json"
    env = {k: v for k, v in os.environ.items()
           if k not in ("MTCFS_TEST_WATCHDOG", "PYTEST_ADDOPTS", "PYTEST_TIMEOUT")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS), env.get("PYTHONPATH")]))
    env["WATCHDOG_PROBE"] = str(probe)
    # -p conftest: the suite's own conftest (fixtures, watchdog) as a plugin; -c: its ini
    # (timeout = 600, so the marker's 5 s is what counts).
    # -n 0: in this process, not in xdist workers (the ini's addopts say -n 2)
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
           "-p", "conftest", "-c", str(REPO / "pyproject.toml"), "--rootdir", str(tmp_path),
           "--basetemp", str(tmp_path / "basetemp"), str(inner)]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        ended = _end_leftovers(probe)
        proc.kill()
        out, _ = proc.communicate(timeout=30)
        pytest.fail(f"the inner run still ran after {BOUND} s: the reader of a stopped daemon "
                    f"was never released ({ended})\n{out}")
    elapsed = time.monotonic() - t0
    print(f"inner run: {elapsed:.1f} s, rc {proc.returncode}\n{out}")

    assert proc.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert f"watchdog: test exceeded {WATCHDOG_S} s; aborted FUSE connections of mounts" in out
    info = json.loads(probe.read_text())
    assert f"{info['mnt']} (fuse connection " in out, out  # it was aborted, not just gone
    assert "daemon logs tail:" in out and f"--- {info['store']}/mtcfs.log" in out, out
    assert "reads through a stopped daemon returned" not in out, out
    assert elapsed < BOUND
    # Nothing left behind: not mounted, the daemon and its mtcfs processes gone.
    assert not is_mounted(info["mnt"])
    assert not _alive(info["pid"]), f"daemon {info['pid']} still runs"
    assert _mtcfs_processes_naming(info["mnt"]) == []


def test_the_deadline_comes_before_pytest_timeout(monkeypatch):
    """The default deadline leaves pytest-timeout a margin; N from a marker never goes past
    it; 0 switches the per-test watchdog off."""
    assert margin(600) == 60 and margin(100) == 10 and margin(20) == 5 and margin(6) == 3

    class Item:
        def __init__(self, marker_args=None, timeout=600.0):
            self._m = marker_args
            self.config = type("C", (), {"_env_timeout": timeout})()

        def get_closest_marker(self, name):
            if name == "watchdog" and self._m is not None:
                return type("M", (), {"args": self._m, "kwargs": {}})()
            return None

    monkeypatch.delenv("MTCFS_TEST_WATCHDOG", raising=False)
    assert deadline_for(Item()) == 540
    assert deadline_for(Item((5,))) == 5
    assert deadline_for(Item((1000,))) == 540
    assert deadline_for(Item((0,))) is None
    assert deadline_for(Item(timeout=None)) is None
    assert deadline_for(Item((7,), timeout=None)) == 7
    monkeypatch.setenv("MTCFS_TEST_WATCHDOG", "30")
    assert deadline_for(Item()) == 30
    assert deadline_for(Item((5,))) == 5
