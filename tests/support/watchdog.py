"""The test suite can never hang: a per-test watchdog that ends the test's FUSE mounts.

A read through a FUSE mount whose daemon never answers puts the reader in uninterruptible
sleep (``request_wait_answer``, ``folio_wait_bit_common``). pytest-timeout's signal then
never runs, because a signal handler runs only when the system call returns, and the run
waits for ever. So a watchdog *thread* (not a signal) watches each test:

* Every :class:`support.mount.Mount` registers itself here when it starts and unregisters
  at the end of its ``cleanup()``; so does every mount of a ``Cluster``.
* At the test's deadline (:func:`deadline_for`: by default 10 % before pytest-timeout's
  timeout, between 5 and 60 s before it, so 540 s for the ini's 600 s), the watchdog, for
  every mount still registered (the test's own, and those of module or session fixtures
  that it may be blocked on):

  1. aborts its FUSE connection (``/sys/fs/fuse/connections/<minor of st_dev>/abort``)
     and detaches it lazily, with :func:`mtcfs.base.mountinfo.force_unmount`: every request
     in flight fails (ENOTCONN, ECONNABORTED or EIO) and the reader returns;
  2. SIGKILLs the daemon, the mtcfs processes of that mount point, and every process in
     the daemon's session (the children it started);
  3. prints ``watchdog: test exceeded N s; aborted FUSE connections of mounts X, Y;
     daemon logs tail: ...`` on the terminal at once, and adds it to the failing report.

  The test then fails (a passing phase after a fire is turned into a failure) and the run
  goes on with the next test. Mounts started after the fire are refused.
* If pytest-timeout's signal cannot end the test either (something else is stuck),
  the watchdog dumps every thread's stack and exits the process 60 s after pytest-timeout's
  deadline (status 1), so the run still ends. This happens only after the watchdog fired.
* The session guard: pytest-timeout's ``session_timeout`` (pyproject.toml) stops the run
  after the test in progress when the session is over time; the watchdog makes that test
  end too, by firing at the session deadline if it comes before the test's own.

Changing it: ``@pytest.mark.watchdog(N)`` gives a test its own deadline of N seconds (never
later than the default: pytest-timeout must come after), ``@pytest.mark.watchdog(0)``
switches the per-test watchdog off for that test; the environment variable
``MTCFS_TEST_WATCHDOG=N`` sets the deadline of every test without a marker (0: off, e.g.
in a debugger; the watchdog also never fires while the main thread is in pdb).
``--timeout`` / ``@pytest.mark.timeout`` move the default with pytest-timeout's.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from mtcfs.base import mountinfo
from mtcfs.base.mountinfo import force_unmount, fuse_connection_dir, is_mounted

if TYPE_CHECKING:
    from .mount import Mount

ENV = "MTCFS_TEST_WATCHDOG"
MARKER = "watchdog"
#: how long after pytest-timeout's deadline a test that the watchdog fired on may still run
#: before the process exits (pytest-timeout's signal could not end it either).
HARD_EXIT_GRACE = 60.0
LOG_TAIL = 3000


class WatchdogFired(RuntimeError):
    """A mount was started after the test's watchdog had fired."""


def margin(timeout: float) -> float:
    """How long before pytest-timeout's ``timeout`` the watchdog fires: 10 %, at least 5 s,
    at most 60 s, and never more than half of it."""
    return min(max(5.0, timeout / 10), 60.0, timeout / 2)


def _pytest_timeout(item: pytest.Item) -> float | None:
    """pytest-timeout's timeout for ``item`` (marker, --timeout, PYTEST_TIMEOUT, ini), or
    None when there is none."""
    try:
        from pytest_timeout import _get_item_settings
        t = _get_item_settings(item).timeout
    except Exception:  # noqa: BLE001 (not installed, or its internals moved)
        t = getattr(item.config, "_env_timeout", None)
    return float(t) if t else None


def deadline_for(item: pytest.Item) -> float | None:
    """Seconds from the start of ``item`` (setup, call and teardown together) to its watchdog
    deadline; None: no per-test watchdog.

    The ``watchdog(N)`` marker, else ``$MTCFS_TEST_WATCHDOG``, else pytest-timeout's timeout
    less :func:`margin`; an explicit N is capped at that too, and 0 switches it off.
    """
    timeout = _pytest_timeout(item)
    default = timeout - margin(timeout) if timeout else None
    marker = item.get_closest_marker(MARKER)
    explicit: float | None = None
    if marker is not None:
        explicit = float(marker.args[0] if marker.args else marker.kwargs["seconds"])
    elif os.environ.get(ENV, "").strip():
        explicit = float(os.environ[ENV])
    if explicit is None:
        return default
    if explicit <= 0:
        return None
    return explicit if default is None else min(explicit, default)


# ---------------------------------------------------------------------- killing a mount

def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _session(pid: int) -> int | None:
    """The session id of ``pid`` (/proc/PID/stat), None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        return int(stat.rsplit(")", 1)[1].split()[3])
    except (OSError, ValueError, IndexError):
        return None


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _is_mtcfs(argv: list[str]) -> bool:
    return any(a == "mtcfs" or a.endswith("/mtcfs") for a in argv[:3])


def processes_of(mount: Mount) -> list[int]:
    """The daemon of ``mount``, every mtcfs process naming its mount point (the daemon
    before its pid is known, the ``mtcfs`` command still waiting for it, a stuck
    ``mtcfs umount``), and every process in the session of those that lead one (the
    daemon calls setsid(), so its children are there). Never this process."""
    mnt = os.path.abspath(mount.mnt)
    everyone = _pids()
    found = {p for p in everyone
             if (argv := _cmdline(p)) and _is_mtcfs(argv) and mnt in argv}
    if mount.pid:
        found.add(mount.pid)
    leaders = {p for p in found if _session(p) == p}
    if leaders:
        found |= {p for p in everyone if _session(p) in leaders}
    found.discard(os.getpid())
    return sorted(found)


def abort_connection(mount: Mount) -> None:
    """Abort the FUSE connection of ``mount`` through fusectl, and nothing else: no
    subprocess (a child forked while the test holds a file open on a mount whose daemon
    does not answer blocks in its close of that file, before exec, and its parent with it)."""
    mountinfo.abort_connection(mount.mnt)


def end_mount(mount: Mount) -> str:
    """Abort the FUSE connection of ``mount``, detach it, SIGKILL its processes. Never
    touches the mount itself (that would block). Returns a description for the report."""
    mnt = str(mount.mnt)
    conn = fuse_connection_dir(mnt) if is_mounted(mnt) else None
    try:
        force_unmount(mnt)  # abort through fusectl, then umount -l
    except Exception as exc:  # noqa: BLE001 (go on with the kill)
        conn = f"{conn} (force_unmount failed: {exc})"
    killed = []
    for pid in processes_of(mount):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except (ProcessLookupError, PermissionError):
            pass
    if mount.pid in killed:
        mount.pid = None
    what = f"{mnt} (fuse connection {os.path.basename(conn)})" if conn else f"{mnt} (not mounted)"
    return what + (f", killed pids {killed}" if killed else "")


# ---------------------------------------------------------------------- the watchdog

@dataclass
class _Run:
    nodeid: str
    started: float
    deadline: float | None          # monotonic; None: never fires
    reason: str                     # what the deadline stands for, for the message
    hard_exit: float | None = None  # monotonic; set when it fires
    session: bool = False           # the deadline is the session's
    fired: bool = False
    reported: bool = False
    message: str = ""
    mounts: list[str] = field(default_factory=list)


class Watchdog:
    """The process-wide registry of live mounts and the thread that ends them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()       # the registry and the current run
        self._cond = threading.Condition(self._lock)
        self._fire_lock = threading.Lock()  # one fire at a time; a run ends after its fire
        self._mounts: dict[int, tuple[Mount, str]] = {}
        self._run: _Run | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.console_fd = 2
        self.session_deadline: float | None = None  # monotonic
        self.session_timeout: float | None = None

    # -- the registry (called by Mount) ---------------------------------------------------

    def register(self, mount: Mount) -> None:
        with self._lock:
            run = self._run
            if run is not None and run.fired:
                raise WatchdogFired(f"{run.message}\n(no new mount after the watchdog fired: "
                                    f"{mount.mnt})")
            self._mounts[id(mount)] = (mount, run.nodeid if run else "<no test>")

    def after_start(self, mount: Mount) -> None:
        """A mount that came up while the watchdog fired is ended too (it may have missed
        it), and the start fails."""
        with self._lock:
            run = self._run
            fired = run is not None and run.fired
        if fired:
            end_mount(mount)
            raise WatchdogFired(f"{run.message}\n(mount {mount.mnt} came up after the fire "
                                "and was ended too)")

    def unregister(self, mount: Mount) -> None:
        with self._lock:
            self._mounts.pop(id(mount), None)

    def mounts(self) -> list[Mount]:
        with self._lock:
            return [m for m, _ in self._mounts.values()]

    # -- runs (called by the plugin) ------------------------------------------------------

    def begin(self, nodeid: str, seconds: float | None, timeout: float | None) -> _Run:
        now = time.monotonic()
        deadline = now + seconds if seconds is not None else None
        reason = f"test exceeded {seconds:g} s" if seconds is not None else ""
        if self.session_deadline is not None and (deadline is None
                                                  or self.session_deadline < deadline):
            deadline = self.session_deadline
            reason = f"session exceeded {self.session_timeout:g} s (session_timeout)"
        run = _Run(nodeid, now, deadline, reason, session=reason.startswith("session"))
        run.hard_exit = (now + timeout + HARD_EXIT_GRACE) if timeout else None
        with self._cond:
            self._run = run
            self._ensure_thread()
            self._cond.notify_all()
        return run

    def end(self) -> _Run | None:
        with self._fire_lock, self._cond:
            run, self._run = self._run, None
            self._cond.notify_all()
        return run

    def current(self) -> _Run | None:
        with self._lock:
            return self._run

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    # -- the thread -----------------------------------------------------------------------

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="mtcfs-test-watchdog",
                                            daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                run = self._run
                now = time.monotonic()
                if run is None:
                    self._cond.wait()
                    continue
                if not run.fired:
                    due = run.deadline
                elif run.hard_exit is not None:
                    due = run.hard_exit
                else:
                    due = None
                if due is None:
                    self._cond.wait()
                    continue
                if now < due:
                    self._cond.wait(due - now)
                    continue
            if not run.fired:
                if _main_thread_in_debugger():
                    run.deadline = None  # someone is debugging this test: leave it alone
                    continue
                self.fire(run)
            else:
                self._hard_exit(run)

    def fire(self, run: _Run) -> str:
        """End every registered mount; record and print the message."""
        with self._fire_lock:
            with self._lock:
                if self._run is not run or run.fired:
                    return run.message
                run.fired = True
                mounts = list(self._mounts.values())
            ended = []
            tails = []
            # every connection first: end_mount runs umount, and the fork for it would
            # block on a file the test holds open on a mount not yet aborted
            for m, _ in mounts:
                try:
                    abort_connection(m)
                except Exception:  # noqa: BLE001, S110 (end_mount tries again)
                    pass
            for m, owner in mounts:
                whose = "" if owner == run.nodeid else f" [started by {owner}]"
                try:
                    ended.append(end_mount(m) + whose)
                except Exception as exc:  # noqa: BLE001 (end the others)
                    ended.append(f"{m.mnt} (failed to end: {exc!r}){whose}")
            for m, _ in mounts:
                try:
                    tail = m.log()[-LOG_TAIL:]
                except Exception as exc:  # noqa: BLE001
                    tail = f"<log unreadable: {exc!r}>"
                tails.append(f"--- {m.store / 'mtcfs.log'} (last {LOG_TAIL} chars) ---\n"
                             f"{tail.rstrip() or '<empty>'}")
            run.mounts = ended
            if run.hard_exit is None:  # no pytest-timeout: give the test 2 grace periods
                run.hard_exit = time.monotonic() + 2 * HARD_EXIT_GRACE
            head = (f"watchdog: {run.reason}; aborted FUSE connections of mounts "
                    f"{', '.join(ended) if ended else '(none registered)'}")
            run.message = head + ("; daemon logs tail:\n" + "\n".join(tails) if tails else "")
            self._say(f"\n{'+' * 30} mtcfs watchdog: {run.nodeid} {'+' * 30}\n"
                      f"{run.message}\n{'+' * 80}\n")
            return run.message

    def _hard_exit(self, run: _Run) -> None:
        with self._lock:
            if self._run is not run:
                return
        self._say(f"\nwatchdog: {run.nodeid} still runs {HARD_EXIT_GRACE:g} s after "
                  "pytest-timeout's deadline, after its mounts were ended; exiting. "
                  "Stacks:\n")
        try:
            faulthandler.dump_traceback(file=self.console_fd, all_threads=True)
        finally:
            os._exit(1)

    def _say(self, text: str) -> None:
        try:
            os.write(self.console_fd, text.encode(errors="replace"))
        except OSError:
            pass


def _main_thread_in_debugger() -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if mod in ("pdb", "bdb") or mod.startswith("pydevd"):
            return True
        frame = frame.f_back
    return False


WATCHDOG = Watchdog()


# ---------------------------------------------------------------------- pytest plugin

def _console_fd(config: pytest.Config) -> int:
    """The terminal's stderr, which pytest's fd capture keeps a copy of; fd 2 without it."""
    capman = config.pluginmanager.getplugin("capturemanager")
    err = getattr(getattr(capman, "_global_capturing", None), "err", None)
    fd = getattr(err, "targetfd_save", None)
    return fd if isinstance(fd, int) else 2


def _session_timeout(config: pytest.Config) -> float | None:
    t = config.getoption("session_timeout", None)
    if t is None:
        try:
            ini = config.getini("session_timeout")
        except ValueError:
            ini = None
        t = float(ini) if ini else None
    return t or None


class WatchdogPlugin:
    """Registered by tests/conftest.py."""

    def __init__(self, config: pytest.Config, watchdog: Watchdog = WATCHDOG) -> None:
        self.wd = watchdog
        config.addinivalue_line(
            "markers", f"{MARKER}(seconds): the mtcfs test watchdog's deadline for this test "
            "(0: none); see tests/support/watchdog.py")
        st = _session_timeout(config)
        if st:
            self.wd.session_timeout = st
            self.wd.session_deadline = time.monotonic() + st

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem):
        self.wd.console_fd = _console_fd(item.config)
        self.wd.begin(item.nodeid, deadline_for(item), _pytest_timeout(item))
        try:
            return (yield)
        finally:
            run = self.wd.end()
            if run is not None and run.fired and run.session:
                item.session.shouldfail = run.message.split("; daemon logs tail:")[0]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        report = yield
        run = self.wd.current()
        if run is None or not run.fired or run.reported or run.nodeid != item.nodeid:
            return report
        run.reported = True
        headline = run.message.split("; daemon logs tail:")[0]
        if not report.failed:
            report.outcome = "failed"
            report.longrepr = run.message
            return report
        lr = report.longrepr
        if hasattr(lr, "addsection"):
            lr.addsection("mtcfs watchdog", run.message)
            crash = getattr(lr, "reprcrash", None)
            if crash is not None:
                crash.message = f"{headline} -> {crash.message}"
        else:
            report.longrepr = f"{run.message}\n\n{lr}"
        return report

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.wd.stop()
