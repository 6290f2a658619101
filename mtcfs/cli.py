"""Command line: ``mtcfs SOURCE MOUNTPOINT [-f] [-o opt=val,...]`` and the subcommands.

The mount form is what ``mount -t fuse.mtcfs SOURCE MOUNTPOINT -o ...`` and fstab run
through mount.fuse3. It validates every option first (a bad one: a one-line error naming
it, exit code 2, nothing mounted), then daemonizes and returns once the mount is ready
(unless ``-f``).

Subcommands talk to the daemon over its control socket:
``status``, ``checkpoints``, ``restore``, ``seal``, ``gc``, ``verify``, ``backup``, ``umount``.
Only root and the user who mounted may use it, for every subcommand (the daemon checks the
caller's uid; docs/security-local.md): anyone else gets a one-line refusal and exit 1.
The other way round, a subcommand talks only to the daemon of a real ``fuse.mtcfs`` mount
(its line in /proc/self/mountinfo), through a socket of the user who mounted it, served by
that user or root (:func:`find_control_socket`); else, and for an answer it cannot read,
one line and exit 1. ``umount`` acts only on a ``fuse.mtcfs`` mount.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import stat
import sys
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, NoReturn

from tqdm import tqdm

from mtcfs import control
from mtcfs.base import mountinfo
from mtcfs.base.failpoints import failpoint
from mtcfs.options import OptionError, parse_mount_options

SUBCOMMANDS = ("status", "metrics", "checkpoints", "restore", "seal", "gc", "verify", "backup",
               "umount", "mount", "certs", "plan")
EXIT_USAGE = 2


def _die(msg: str, code: int = 1) -> NoReturn:
    print(f"mtcfs: {msg}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------------- mount

def _mount_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mtcfs", usage="mtcfs SOURCE MOUNTPOINT [-f] [-o opt=val,...]\n"
        "       mtcfs {status,checkpoints,restore,seal,gc,verify,backup,umount} ...",
        description="Mount a multi-tier checkpoint filesystem for job SOURCE at MOUNTPOINT.")
    p.add_argument("source", metavar="SOURCE", help="job name")
    p.add_argument("mountpoint", metavar="MOUNTPOINT")
    p.add_argument("-o", dest="options", action="append", default=[],
                   help="comma-separated mount options (see docs/usage.md)")
    p.add_argument("-f", "--foreground", action="store_true", help="do not daemonize")
    p.add_argument("-n", dest="no_mtab", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-s", dest="single", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", dest="verbose", action="store_true", help=argparse.SUPPRESS)
    return p


class _OwnLogFile(logging.FileHandler):
    """The daemon's log file in its store: opened without following a symbolic link,
    without blocking (a FIFO), and used only if it is a regular file of this process's
    user with one name (another user may have put a link there, in a store directory
    others could write, before the store is checked and closed).

    Raises:
        OSError: at construction, it is not (ELOOP for a link, EPERM else).
    """

    def _open(self) -> Any:
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            raise OSError(errno.EPERM, f"{self.baseFilename} is not the daemon's own log file "
                          f"(a {stat.filemode(st.st_mode)} of uid {st.st_uid} with "
                          f"{st.st_nlink} names): refusing to write to it")
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)


def _setup_logging(debug: bool, path: str | None) -> None:
    """Log to ``path``, else to stderr. On stderr under systemd (``$JOURNAL_STREAM`` set:
    stderr is the journal), no timestamp (journald stamps each line) and each line starts
    with its syslog priority (``<3>`` error, ``<4>`` warning, ...: sd-daemon(3)), so
    ``journalctl -p warning`` filters it."""
    handlers: list[logging.Handler] = []
    if path:
        handlers.append(_OwnLogFile(path))
        fmt: logging.Formatter = logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s")
    else:
        handlers.append(logging.StreamHandler(sys.stderr))
        fmt = _JournalFormatter() if os.environ.get("JOURNAL_STREAM") else logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s")
    for h in handlers:
        h.setFormatter(fmt)
    logging.basicConfig(level=logging.DEBUG if debug else logging.INFO,
                        handlers=handlers, force=True)
    for noisy in ("urllib3", "google", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


class _JournalFormatter(logging.Formatter):
    """``<priority>LEVEL name: message``, one journal entry per line (sd-daemon(3))."""

    _PRIORITY = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4,
                 logging.INFO: 6, logging.DEBUG: 7}

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        prio = self._PRIORITY.get(record.levelno, 6)
        return "\n".join(f"<{prio}>{line}" for line in super().format(record).splitlines())


def cmd_mount(argv: list[str]) -> None:
    args = _mount_parser().parse_args(argv)
    try:
        opts = parse_mount_options(args.source, args.mountpoint, args.options, args.foreground)
    except OptionError as exc:
        _die(str(exc), EXIT_USAGE)
    if not os.path.isdir(opts.mountpoint):
        _die(f"mount point {opts.mountpoint} is not a directory", EXIT_USAGE)
    if os.path.ismount(opts.mountpoint):
        _die(f"{opts.mountpoint} is already a mount point", 1)
    opts.mountpoint = os.path.abspath(opts.mountpoint)
    from mtcfs.core.store import (StoreError, check_size, check_store_dir, datafs,
                                  filesystem_warning)
    try:  # before anything is created: a foreign directory is never touched
        check_store_dir(opts.store, opts.mountpoint, opts.job)
        check_size(opts.store, opts.size, opts.given.get("size"))
        if os.path.isdir(opts.store):  # a data tmpfs never shrinks below what it holds
            from mtcfs.daemon import default_capacity
            datafs.check_resize(opts.store, datafs.tmpfs_size(
                opts.size or default_capacity(opts.store), opts.chunk_size))
    except (StoreError, datafs.DataMountError) as exc:
        _die(str(exc), EXIT_USAGE)
    except OSError as exc:
        _die(f"bad option store={opts.store}: {exc.strerror or exc}", EXIT_USAGE)
    if opts.tls_ca:
        from mtcfs.tiers.peer.tls import TlsError, TlsFiles
        try:  # a certificate that would be refused by every peer is an option error
            assert opts.tls_cert and opts.tls_key
            TlsFiles(opts.tls_ca, opts.tls_cert, opts.tls_key).check_for(opts.job, opts.rank)
        except TlsError as exc:
            _die(f"bad option {exc}", EXIT_USAGE)
    warning = filesystem_warning(opts.store)["warning"]
    if warning:
        print(f"mtcfs: {warning}", file=sys.stderr)

    from mtcfs.daemon import Daemon
    if opts.foreground:
        _setup_logging(opts.debug, None)
        daemon = Daemon(opts)
        try:
            daemon.build()
        except (StoreError, ValueError, OSError) as exc:
            _die(str(exc))
        import trio
        trio.run(daemon.run, lambda: None)
        return

    # The signals that would end this command while it waits are held until the daemon is
    # forked and the handlers that stop it are in place: no moment leaves a daemon alone.
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    rfd, wfd = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        os.close(wfd)
        _wait_for_daemon(pid, rfd, opts)  # exits
    for sig in _STOP_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    _end_with(parent)
    # Child: a daemon in its own session, logging into the store directory.
    os.close(rfd)
    os.setsid()
    status = os.fdopen(wfd, "wb", buffering=0)
    code = 0
    try:
        daemon = Daemon(opts)
        try:
            os.makedirs(opts.store, mode=0o700, exist_ok=True)
            _setup_logging(opts.debug, os.path.join(opts.store, "mtcfs.log"))
            daemon.build()
        except (StoreError, ValueError, OSError) as exc:
            status.write(str(exc).encode())
            status.close()
            os._exit(1)
        except Exception as exc:  # a bug: say so rather than exit silently
            logging.getLogger("mtcfs").exception("daemon failed to start")
            status.write(f"mount failed: {type(exc).__name__}: {exc}".encode())
            status.close()
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)

        def ready() -> None:
            # Mounted: the daemon now outlives the command. Said to the kernel BEFORE the
            # command hears OK: the command exits at once, and its death would send this
            # process the SIGTERM asked for at start (it did, under load: the mount the
            # command had just reported up was unmounted at once).
            _end_with(None)
            failpoint("cli.ready")  # tests: the command may exit from here on
            status.write(b"OK")
            status.close()
        import trio
        try:
            trio.run(daemon.run, ready)
        except BaseException as exc:
            logging.getLogger("mtcfs").exception("daemon failed")
            if not status.closed:
                status.write(f"mount failed: {exc}".encode())
            code = 1
    finally:
        logging.shutdown()
        os._exit(code)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1


def _end_with(parent: int | None) -> None:
    """In the daemon before its mount is ready: get SIGTERM when the ``mtcfs`` command that
    started it dies (even by SIGKILL), so it never lives on alone; ``None``: no longer."""
    import ctypes
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, 0 if parent is None else signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the command's own handlers still stop it
        return
    if parent is not None and os.getppid() != parent:  # it died before prctl
        os._exit(1)


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _reap(pid: int, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for child ``pid`` to exit; True once it has."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return True
        if done:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def _stop_daemon(pid: int, mountpoint: str) -> None:
    """Stop a daemon whose mount did not come up: SIGTERM to it and its session, SIGKILL
    after 5 s, each waited for at most 5 s; then clear the mount should it have been made
    at the last moment."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for kill in (os.killpg, os.kill):  # the group once it has called setsid()
            try:
                kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if _reap(pid, 5.0):
            break
    if mountinfo.is_mounted(mountpoint):
        mountinfo.force_unmount(mountpoint)


def _wait_for_daemon(pid: int, rfd: int, opts: Any) -> None:
    """In the command after fork(): wait, at most ``mount_timeout`` seconds, for the daemon
    to report its mount ready, and exit 0. Exits 1 with the daemon's error when it failed;
    when the time is up (exit 1) or the command gets SIGINT, SIGTERM or SIGHUP (exit 128 +
    the signal), stops the daemon and leaves nothing mounted."""
    def interrupted(signum: int, _frame: Any) -> None:
        raise _Interrupted(signum)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, interrupted)
    msg = b""
    why: int | str | None = None
    deadline = time.monotonic() + opts.mount_timeout
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = "timeout"
                break
            if select.select([rfd], [], [], min(left, 1.0))[0]:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    break
                msg += chunk
    except _Interrupted as exc:
        why = exc.signum
    for sig in _STOP_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    text = msg.decode(errors="replace")
    if text.startswith("OK"):
        sys.exit(0)
    log_path = os.path.join(opts.store, "mtcfs.log")
    if why is None:  # the daemon failed and says why; it exits by itself
        if not _reap(pid, 10.0):
            _stop_daemon(pid, opts.mountpoint)
        _die(text.strip() or f"the daemon exited before the mount was ready (see {log_path})")
    _stop_daemon(pid, opts.mountpoint)
    if why == "timeout":
        given = opts.given.get("mount_timeout", f"{opts.mount_timeout:g}s")
        _die(f"the mount did not come up within mount_timeout={given}: its daemon was "
             f"stopped and nothing is mounted (see {log_path})")
    assert isinstance(why, int)
    _die(f"interrupted by {signal.Signals(why).name} while waiting for the mount: its daemon "
         "was stopped and nothing is mounted", 128 + why)


# ---------------------------------------------------------------------- client side

class NoDaemon(Exception):
    """No mtcfs daemon answers for a path (the message is the one-line error)."""


#: The filesystem type of an mtcfs mount in /proc/self/mountinfo.
FSTYPE = "fuse.mtcfs"
#: The mount root's virtual xattr naming the control socket (core/xattrs.py).
CONTROL_XATTR = "user.mtcfs.control"
#: How long the mount's root may take to answer that xattr (a stopped or stuck daemon
#: never does; the wait is in a thread, so the command ends anyway).
XATTR_TIMEOUT_S = 30.0


class ControlEndpoint(NamedTuple):
    """The daemon of one mtcfs mount, as :func:`find_control_socket` found and checked it.

    Attributes:
        sock: its control socket's path.
        root: the mount point.
        uids: the uids the process serving ``sock`` may run as (the mount's user, root).
        owner: the uid of the user who mounted (mountinfo's ``user_id=``).
        path: the path asked about, absolute, as a path below ``root``.
    """

    sock: str
    root: str
    uids: frozenset[int]
    owner: int
    path: str


def _root_xattr(root: str, device: str) -> bytes:
    """The control xattr of mount point ``root``, read from the filesystem of device
    ``device`` (``"major:minor"``, its mountinfo line) only, waited for at most
    :data:`XATTR_TIMEOUT_S` seconds (the open and getxattr run in a daemon thread, which a
    stuck FUSE mount may hold until the process ends).

    Raises:
        NoDaemon: no answer in time, the getxattr failed (the message names the errno), or
            ``root`` now leads to another filesystem (a mount above it covers it).
    """
    box: dict[str, Any] = {}
    done = threading.Event()

    def get() -> None:
        try:
            # One descriptor for both: what is checked is what is read. O_PATH: no OPENDIR
            # reaches the daemon (a scope=job node waiting for etcd or for room answers
            # GETATTR and GETXATTR of its root from its own copy, but not an OPENDIR);
            # the xattr is read through the descriptor's /proc/self/fd link.
            fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                st = os.fstat(fd)
                box["device"] = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
                if box["device"] == device:
                    box["value"] = os.getxattr(f"/proc/self/fd/{fd}", CONTROL_XATTR)
            finally:
                os.close(fd)
        except OSError as exc:
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=get, name="getxattr", daemon=True).start()
    if not done.wait(XATTR_TIMEOUT_S):
        raise NoDaemon(f"the mtcfs mount at {root} does not answer (nothing in "
                       f"{XATTR_TIMEOUT_S:g} s): its daemon is stopped or stuck; "
                       f"`mtcfs umount --force {root}` clears it")
    if "error" in box:
        exc = box["error"]
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        raise NoDaemon(f"cannot read the mtcfs mount at {root}: {exc.strerror} ({name})")
    if "value" not in box:
        raise NoDaemon(f"the mtcfs mount at {root} is covered by another mount (the path "
                       f"leads to device {box['device']}, not to the mount's {device}): "
                       "refusing to ask what answers there")
    value: bytes = box["value"]
    return value


def _checked_socket(raw: bytes, root: str, owner: int) -> str:
    """The socket path ``raw`` (mount ``root``'s xattr), if it may be the socket of the
    daemon of a mount by uid ``owner``: an absolute path outside the mount, of a socket
    (not a symlink) that ``owner`` owns, in a directory that ``owner`` or root owns and no
    one else may write.

    Raises:
        NoDaemon: it is not; the message says why.
    """
    sock = os.fsdecode(raw)

    def refuse(why: str) -> NoDaemon:
        return NoDaemon(f"refusing {sock}, the control socket the mtcfs mount at {root} "
                        f"names: {why}")
    if not sock.startswith("/") or "\0" in sock or len(raw) > 4096:
        raise refuse("not an absolute path")
    sock = os.path.normpath(sock)
    if sock == root or sock.startswith(root.rstrip("/") + "/"):
        raise refuse("it is inside the mount itself")
    try:
        st = os.lstat(sock)
        parent = os.path.dirname(sock)
        dst = os.stat(parent)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise NoDaemon(str(control.denied(sock))) from None
        raise NoDaemon(f"cannot reach the mtcfs daemon at {sock}: {exc.strerror}") from None
    if not stat.S_ISSOCK(st.st_mode):
        raise refuse("it is not a socket")
    if st.st_uid != owner:
        raise refuse(f"it is owned by uid {st.st_uid}, not by uid {owner}, the user who "
                     "mounted it")
    if dst.st_uid not in (owner, 0):
        raise refuse(f"its directory {parent} is owned by uid {dst.st_uid}, not by uid "
                     f"{owner}, the user who mounted it, or root")
    if dst.st_mode & 0o022:
        raise refuse(f"its directory {parent} may be written by other users (mode "
                     f"{stat.S_IMODE(dst.st_mode):04o})")
    return sock


def find_control_socket(path: str) -> ControlEndpoint:
    """Find the daemon serving ``path`` and check that it is that mount's.

    ``path`` must be, or be below, the mount point of a ``fuse.mtcfs`` mount in
    /proc/self/mountinfo (by its text first, so a stuck mount is not touched; through its
    symlinks resolved only when its text is on no mtcfs mount), the deepest mount that
    holds it. The socket is the one the mount root's ``user.mtcfs.control`` names, and only
    if it passes :func:`_checked_socket` for the mount's user (``user_id=``, which the
    kernel takes from the process that mounted). The connection then checks the serving
    process's uid (:attr:`ControlEndpoint.uids`).

    Raises:
        NoDaemon: ``path`` is not on an mtcfs mount; its mount's root cannot be read or
            does not answer (the message names the errno: EACCES for another user on a
            mount without ``allow_other``, ENOTCONN for a daemon that is gone, ...); or the
            socket it names fails a check.
    """
    p = os.path.abspath(path)
    entry = mountinfo.entry_of(p)
    if entry is None or entry.fstype != FSTYPE:
        real = os.path.realpath(p)
        if real != p:
            p, entry = real, mountinfo.entry_of(real)
    if entry is None or entry.fstype != FSTYPE:
        raise NoDaemon(f"{path} is not on an mtcfs mount")
    root, owner = entry.mount_point, entry.owner
    if owner is None:
        raise NoDaemon(f"the mtcfs mount at {root} has no user_id= in /proc/self/mountinfo: "
                       "not a FUSE mount")
    sock = _checked_socket(_root_xattr(root, entry.device), root, owner)
    return ControlEndpoint(sock, root, frozenset({owner, 0}), owner, p)


def control_socket(path: str) -> ControlEndpoint:
    """:func:`find_control_socket`, or exit 1 with its one-line error."""
    try:
        return find_control_socket(path)
    except NoDaemon as exc:
        _die(control.printable(str(exc)))


def _passthrough_line(fuse: dict[str, Any]) -> str:
    """The ``data:`` line of ``mtcfs status``: who moves file bytes (docs/passthrough.md)."""
    if not fuse.get("passthrough"):
        return (f"passthrough off ({fuse.get('passthrough_off') or 'unknown why'}): every "
                "byte through the daemon")
    line = "passthrough on: the kernel reads and writes the store's files"
    opens = fuse.get("daemon_path_opens") or {}
    line += (f" ({fuse.get('passthrough_opens_read', 0)} reads, "
             f"{fuse.get('passthrough_opens_write', 0)} writes opened so far")
    if opens:
        line += "; on the daemon's path: " + ", ".join(f"{n} {why}" for why, n in
                                                       sorted(opens.items()))
    return line + ")"


def _human(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class ProgressBar:
    """A one-line progress bar on stderr (only when it is a terminal), drawn by tqdm: the
    label, the bar, the percentage, bytes done of the total and the rate (binary units)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.enabled = sys.stderr.isatty()
        self._bar: tqdm | None = None

    def update(self, done: int, total: int) -> None:
        """Show ``done`` of ``total`` bytes."""
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = tqdm(total=total, desc=self.label, file=sys.stderr, unit="B",
                             unit_scale=True, unit_divisor=1024, dynamic_ncols=True,
                             leave=True)
        self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


#: Seconds the daemon has to answer the commands that only read its state (for each read
#: of the socket): a daemon that accepts and never answers (a stuck one, or a user's own
#: FUSE filesystem calling itself fuse.mtcfs) ends the command with one line, not never.
#: The others (seal, restore, gc, verify, backup) may rightly take long: no limit.
QUICK_ANSWER_S: dict[str, float] = {"status": 60.0, "checkpoints": 60.0}


def _request(daemon: ControlEndpoint | str, cmd: str, label: str | None = None,
             expect: type | None = None, **args: Any) -> Any:
    """Send ``cmd`` with ``args`` to ``daemon`` (or a socket path: then served by root or
    this uid only) and return its result, showing progress under ``label``.

    Exits 1 with one line on stderr when the daemon cannot be reached, is refused
    (control.request's checks), reports an error, does not answer ``status`` or
    ``checkpoints`` within :data:`QUICK_ANSWER_S`, or answers a result that is not an
    ``expect`` (dict or list).
    """
    sock, uids = (daemon, None) if isinstance(daemon, str) else (daemon.sock, daemon.uids)
    bar = ProgressBar(label) if label else None
    result = None
    try:
        for msg in control.request(sock, cmd, timeout=QUICK_ANSWER_S.get(cmd),
                                   peer_uids=uids, **args):
            if "progress" in msg and bar:
                bar.update(*msg["progress"])
            elif "result" in msg:
                result = msg["result"]
    except control.ControlError as exc:
        if bar:
            bar.close()
        _die(control.printable(str(exc)))
    if bar:
        bar.close()
    if expect is not None and not isinstance(result, expect):
        _die(f"the daemon's answer to '{cmd}' is malformed: "
             f"{type(result).__name__} where {_KIND[expect]} belongs")
    return result


_KIND: dict[type, str] = {dict: "a JSON object", list: "a JSON array"}


@contextlib.contextmanager
def _answer_of(cmd: str) -> Iterator[None]:
    """Around the reading of a daemon's answer to ``cmd``: a field missing or of the wrong
    type exits 1 with one line naming it, not with a traceback."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError,
            RecursionError) as exc:
        _die(control.printable(f"the daemon's answer to '{cmd}' is malformed "
                               f"({type(exc).__name__}: {exc})", 300))


def _field(res: dict[str, Any], key: str, kind: type) -> Any:
    """``res[key]`` if it is a ``kind`` (a float may be an int; a bool is no number).

    Raises:
        KeyError: it is missing. TypeError: it is of another type.
    """
    v = res[key]
    ok = (isinstance(v, (int, float)) if kind is float else isinstance(v, kind)) and not (
        isinstance(v, bool) and kind in (int, float))
    if not ok:
        raise TypeError(f"{key} is {type(v).__name__}, not {kind.__name__}")
    return v


def _emit(lines: list[str]) -> None:
    """Print ``lines`` (built in full first: a malformed answer prints nothing), each made
    printable (the daemon's strings reach a terminal)."""
    for line in lines:
        print(control.printable(line, 1 << 20))


def _print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True)
    sys.stdout.write("\n")


_INDENT = " " * 12  # continuation lines of a status section, under its text


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Left-aligned columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows)]
    return [_INDENT + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
            for row in [headers, *rows]]


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _ranks(ranks: Any) -> str:
    """``[1]`` -> "rank 1", ``[1, 2]`` -> "ranks 1, 2", empty or missing -> "no rank"."""
    if not ranks:
        return "no rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def format_namespace_status(ns: dict[str, Any]) -> str:
    """One line on the job-wide namespace of a scope=job mount."""
    if ns.get("engine") == "etcd":
        out = (f"  namespace: scope=job, ordered by etcd at {','.join(ns.get('endpoints', []))};"
               f" last op applied at revision {ns.get('seq', 0)}")
        if ns.get("unavailable_s") is not None:
            if ns.get("denied"):
                out += (f"; UNAVAILABLE for {ns['unavailable_s']} s: etcd REFUSES this "
                        f"node's keys ({ns.get('last_error')}), namespace calls here fail")
            else:
                out += (f"; UNAVAILABLE for {ns['unavailable_s']} s: etcd does not answer "
                        f"({ns.get('last_error') or 'no answer'}), namespace calls here wait")
        if ns.get("waiting_for_room"):
            out += (f"; WAITING: the store's filesystem is full, the {ns['waiting_for_room']}"
                    " (free room there; reads here wait, changes get ENOSPC)")
        if ns.get("diverged"):
            out += f"; DIVERGED from the job's namespace: {ns['diverged']}"
        return out
    role = "this node leads" if ns.get("leading") else f"leader rank {ns.get('leader')}"
    out = (f"  namespace: scope=job, {role}; {ns.get('seq', 0)} ops applied (epoch "
           f"{ns.get('epoch', 0)}); lease {ns.get('lease_s', 0)} s")
    if ns.get("quorum", 1) > 1:
        out += f"; quorum {ns['quorum']} of {ns.get('nodes')}"
    if ns.get("unavailable_s") is not None:
        out += (f"; UNAVAILABLE for {ns['unavailable_s']} s: no leader with a quorum answers, "
                "namespace calls here wait")
    if ns.get("out_of_broadcast"):
        out += f"; not answering: ranks {', '.join(map(str, ns['out_of_broadcast']))}"
    if ns.get("diverged"):
        out += "; DIVERGED from the leader (see errors)"
    return out


def format_mtc_status(m: dict[str, Any]) -> str:
    """One line on the Orbax replicator protocol of an ``mtc`` mount."""
    out = f"  orbax mtc: {m.get('state', '-')}; JAX coordinator {m.get('jax_coordinator', '-')}"
    c = m.get("config")
    if c:
        out += (f"; job {c.get('job_name') or '-'}, peers {c.get('peer_ranks')}, backup every "
                + (f"{c['backup_interval_steps']} steps" if c.get("backup_interval_steps")
                   else f"{c.get('backup_interval_minutes')} min"))
    r = m.get("last_restore")
    if r:
        out += (f"; last restore: {r.get('marker')} in {r.get('seconds')} s"
                f" ({r.get('source')})")
    if m.get("last_error"):
        out += f"; FAILED: {m['last_error']}"
    return out


def format_peer_status(p: dict[str, Any] | None) -> list[str]:
    """The peer tier section of ``mtcfs status``: lines to print, from the status dict's
    ``"peers"`` entry (None on a single node). Missing keys show as ``-``, never fail."""
    if not p:
        return ["  peer tier: none (single node)"]
    ms = p.get("membership") if isinstance(p.get("membership"), dict) else {}
    lines = [f"  peer tier: rank {p.get('rank', '-')} of {p.get('nodes', '-')}, listening on "
             f"{p.get('listen') or '-'}, "
             + ("registered in etcd" if ms.get("registered") else
                f"NOT REGISTERED in etcd ({ms.get('error') or 'not yet'})")]
    lines.append(f"{_INDENT}{p.get('placement', '-')} placement, "
                 f"{_plural(p.get('replicas', '-'), 'replica')}: sends to "
                 f"{_ranks(p.get('peers'))}; holds replicas of {_ranks(p.get('holds_for'))}")
    latest = p.get("latest_complete")
    step = latest.get("step") if isinstance(latest, dict) else latest
    lines.append(f"{_INDENT}newest step complete on every rank: {step or 'none yet'}")
    members = p.get("members") or []
    if members:
        rows = []
        for m in members:
            age = m.get("member_for_s")
            rows.append([str(m.get("rank", "-")), str(m.get("address") or "-"),
                         "alive" if m.get("alive") else "DEAD",
                         "-" if age is None else f"{age:.0f}s"])
        lines += _table(["RANK", "ADDRESS", "STATE", "MEMBER FOR"], rows)
    repl = p.get("replication") or []
    if repl:
        lines.append(f"{_INDENT}replication:")
        rows, errors = [], []
        for r in repl:
            lag = r.get("lag_steps")
            rows.append([str(r.get("peer", "-")), str(r.get("address") or "-"),
                         str(r.get("state") or "-"),
                         (f"{_plural('-' if lag is None else lag, 'step')}, "
                          f"{_human(r.get('lag_bytes'))}"),
                         str(r.get("last_replicated") or "-"),
                         (f"{_human(r.get('bytes_sent'))} sent, "
                          f"{r.get('chunks_skipped', '-')} chunks skipped")])
            if r.get("last_error"):
                errors.append(f"{_INDENT}  rank {r.get('peer', '-')} last error: "
                              f"{r['last_error']}")
        lines += _table(["PEER", "ADDRESS", "STATE", "LAG", "LAST REPLICATED", "TRAFFIC"],
                        rows)
        lines += errors
    store = p.get("replica_store")
    if isinstance(store, dict):
        shown = ("chunks", "bytes", "used_bytes", "capacity_bytes", "manifests")
        extra = ", ".join(f"{k} {v}" for k, v in sorted(store.items())
                          if k not in shown and k.startswith(("corrupt", "full"))
                          and isinstance(v, int) and v)
        lines.append(f"{_INDENT}replica store: {store.get('chunks', '-')} chunks, "
                     f"{store.get('manifests', '-')} manifests, "
                     f"{_human(store.get('used_bytes', store.get('bytes')))}"
                     + (f" ({extra})" if extra else ""))
    bad = p.get("bad_peers")
    if bad:
        lines.append(f"{_INDENT}bad peers (chunks that failed verification): "
                     + ", ".join(f"rank {r}: {n}" for r, n in sorted(
                         bad.items(), key=lambda kv: str(kv[0]).zfill(12))))
    restore = p.get("restore")
    if isinstance(restore, dict) and restore:
        lines.append(f"{_INDENT}restore from peers: " + ", ".join(
            f"{k} {v}" for k, v in sorted(restore.items()) if not isinstance(v, (dict, list))))
    return lines


def cmd_metrics(a: argparse.Namespace) -> None:
    from mtcfs.metrics import prometheus_text
    st = _request(control_socket(a.mountpoint), "status", expect=dict)
    with _answer_of("status"):
        text = prometheus_text(st)
    sys.stdout.write(text)


def format_scrub_status(sc: dict) -> str:
    """The ``scrub:`` line of ``mtcfs status`` (core/verifier.py)."""
    if not sc.get("interval_s"):
        when = "off (scrub_interval=0)"
    else:
        when = f"every {sc['interval_s']:g} s at {_human(sc['rate'])}/s"
    if sc.get("running"):
        pct = 100 * sc["done_bytes"] / sc["total_bytes"] if sc["total_bytes"] else 100
        now = f"running, {pct:.0f}% of {_human(sc['total_bytes'])}"
    elif sc.get("last_finished"):
        now = (f"last pass {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(sc['last_finished']))}"
               f" ({sc['last_chunks']} chunks in {sc['last_seconds']:g} s, "
               f"{sc['last_corrupt']} corrupt)")
    else:
        now = "no pass yet"
    if sc.get("start_running"):
        total = sc.get("start_total_bytes") or 0
        pct = 100 * (sc.get("start_done_bytes") or 0) / total if total else 100
        at_start = f"verification at start running, {pct:.0f}% of {_human(total)}"
    elif sc.get("start_seconds") is not None:
        at_start = (f"verified at start: {sc.get('start_chunks', 0)} chunks in "
                    f"{sc['start_seconds']:g} s")
    else:
        at_start = "verification at start not begun"
    return (f"  scrub:    {when}; {now}; {at_start}; {sc['corrupt_chunks']} corrupt chunks "
            f"found since start; {sc['unverified_chunks']} chunks not yet verified since start")


def format_budget_status(bu: dict[str, Any]) -> str:
    """The ``budget:`` line of ``mtcfs status``: how background work runs and what the
    budget held back (base/background.py, base/token_bucket.py)."""
    cpu = bu.get("cpu") or {}
    how = cpu.get("sched", "-")
    if cpu.get("nice"):
        how += f" nice {cpu['nice']}"
    where = "all CPUs" if cpu.get("cpus") == "all" else f"CPUs {cpu.get('cpus', '-')}"
    parts = [f"background work {how} on {where} ({cpu.get('cpu_s', 0):g} CPU s, "
             f"{cpu.get('runqueue_wait_s', 0):g} s waiting for a CPU)",
             f"{bu.get('hash_threads', '-')} hashing threads"]
    if bu.get("backup_threads"):
        parts.append(f"{bu['backup_threads']} backup threads")
    for tier, name in (("peers", "replication"), ("backup", "backup")):
        t = bu.get(tier)
        if isinstance(t, dict):
            rate = f"at most {_human(t['rate'])}/s" if t.get("rate") else "unbounded"
            parts.append(f"{name} {rate} ({_human(t.get('bytes'))} sent, "
                         f"{t.get('waited_s', 0):g} s waited)")
    if bu.get("daemon_group"):
        parts.append(f"the daemon: {bu['daemon_group']}")
    line = "  budget:   " + "; ".join(parts)
    if cpu.get("error"):
        line += f"; NOT APPLIED: {cpu['error']}"
    return line


def status_lines(st: dict[str, Any]) -> list[str]:
    """The lines of ``mtcfs status`` from the daemon's status dict.

    Raises:
        KeyError, TypeError, ValueError, ...: a field is missing or of the wrong type.
    """
    out: list[str] = []
    ram = st["ram"]
    out.append(f"job {st['job']} at {st['mountpoint']} (pid {st['pid']}, store {st['store']})")
    fuse = st.get("fuse") or {}
    if fuse:
        out.append(f"  FUSE:     libfuse {fuse.get('libfuse') or 'unknown'}, "
                   + ("FUSE_HANDLE_KILLPRIV_V2 (no GETXATTR before each write)"
                      if fuse.get("killpriv_v2") else
                      "no FUSE_HANDLE_KILLPRIV_V2: a GETXATTR before each write "
                      "(scripts/build_fuse.sh, docs/fuse-build.md)")
                   + (", direct writes" if fuse.get("direct_writes") else ", no direct writes")
                   + (f" ({fuse['small_writer_threads']} threads writing small pieces use the page "
                      "cache)" if fuse.get("small_writer_threads") else ""))
        if "passthrough" in fuse:
            out.append("  data:     " + _passthrough_line(fuse))
    if (st.get("store_fs") or {}).get("warning"):
        out.append(f"  store:    {st['store_fs']['warning']}")
    dt = (st.get("store_fs") or {}).get("data_tmpfs")
    if dt:
        out.append(f"  data:     tmpfs of its own at {dt['path']}: {_human(dt['used'])} used of "
                   f"{_human(dt['size'])} (a write past it gets ENOSPC)")
    out.append(f"  RAM tier: {_human(ram['used'])} used of {_human(ram['capacity'])} "
               f"({_human(ram['free'])} free), {ram['checkpoints']} checkpoints, keep={st['keep']}")
    if ram.get("deleted_unsaved"):
        out.append(f"  WARNING: {len(ram['deleted_unsaved'])} checkpoint(s) no other tier held were"
                   f" deleted under memory pressure (evict_unsaved=yes), last: "
                   f"{', '.join(ram['deleted_unsaved'][-5:])}")
    b = st.get("backup")
    if b:
        last = "never" if not b["last_finished"] else time.strftime(
            "%H:%M:%S", time.localtime(b["last_finished"]))
        out.append(f"  backup:   {b['url']} every {b['interval']}; last {b['last_step'] or '-'} at "
                   f"{last}; uploading {b['uploading'] or '-'}; pending "
                   f"{', '.join(b['pending']) or '-'}; failures {b['failures']}")
        if b.get("last_error"):
            out.append(f"            last error: {b['last_error']}")
        if b.get("behind"):
            out.append(f"            BEHIND its interval: {b['behind']}")
    else:
        out.append("  backup:   none configured")
    reads = st.get("reads") or {}
    if reads.get("failed"):
        out.append(f"  reads:    {reads['failed']} chunk fetches failed with EIO (no source within "
                   f"{reads['deadline_s']:g} s); last: {reads['last_failure']}")
    if reads.get("suspect_peers"):
        out.append(f"  reads:    asked last (failed a fetch lately): ranks "
                   f"{', '.join(map(str, reads['suspect_peers']))}")
    if st.get("scrub"):
        out.append(format_scrub_status(st["scrub"]))
    if st.get("budget"):
        out.append(format_budget_status(st["budget"]))
    sf = st.get("stop_flush") or {}
    now, last = sf.get("now"), sf.get("last_stop")
    if now and now.get("running"):
        out.append(f"  stopping: flushing the newest step to the other tiers (at most "
                   f"{now['deadline_s']:g} s)")
    elif last and not last.get("complete"):
        out.append(f"  last stop: {last.get('step')} was NOT flushed to the other tiers "
                   f"({'; '.join(map(str, last.get('missing') or []))})")
    r = st.get("restore")
    if r and (r.get("step") or r["pending_chunks"]):
        out.append(f"  restore:  {r.get('step', '-')}: {r['pending_chunks']} chunks "
                   f"({_human(r['pending_bytes'])}) still to fetch, {r['corrupt_chunks']} corrupt")
    if "peers" in st:
        for line in format_peer_status(st["peers"]):
            out.append(line)
    if st.get("namespace"):
        out.append(format_namespace_status(st["namespace"]))
    if st.get("mtc"):
        out.append(format_mtc_status(st["mtc"]))
    rej = st.get("rejected_records") or {}
    if rej.get("total"):
        last = rej["last"][-1]
        out.append(f"  etcd:     {rej['total']} records refused and skipped (bad form); last: "
                   f"{last['key']} ({last['kind']}): {last['why']}")
    for name, row in sorted((st.get("restarted_loops") or {}).items()):
        out.append(f"  restarts: {name} failed and was restarted {row['restarts']} times; "
                   f"last: {row.get('last_error', '?')}")
    if st["errors"]:
        out.append("  errors:")
        for e in st["errors"][-10:]:
            out.append(f"    {e}")
    return out


def cmd_status(a: argparse.Namespace) -> None:
    daemon = control_socket(a.mountpoint)
    st = _request(daemon, "status", expect=dict)
    if a.json:
        _print_json(st)
        return
    with _answer_of("status"):
        lines = status_lines(st)
    _emit(lines)


def cmd_checkpoints(a: argparse.Namespace) -> None:
    rows = _request(control_socket(a.mountpoint), "checkpoints", expect=list)
    if a.json:
        _print_json(rows)
        return
    if not rows:
        print("no checkpoints")
        return
    with _answer_of("checkpoints"):
        out = [f"{'STEP':<24} {'SIZE':>10} {'FILES':>6}  {'RAM':<9} {'PEERS':<6} "
               f"{'BACKUP':<9} COMMITTED BY"]
        for r in rows:
            files = "-" if r["files"] is None else str(r["files"])
            out.append(f"{r['step']:<24} {_human(r['bytes']):>10} {files:>6}  {r['ram']:<9} "
                       f"{r.get('peers', '-'):<6} {r['backup']:<9} {r['committed_by']}")
    _emit(out)


def cmd_restore(a: argparse.Namespace) -> None:
    daemon = control_socket(a.mountpoint)
    t0 = time.monotonic()
    res = _request(daemon, "restore", label="restore", expect=dict, step=a.step,
                   wait=not a.no_wait)
    res["seconds"] = round(time.monotonic() - t0, 3)
    if a.json:
        _print_json(res)
        return
    with _answer_of("restore"):
        step = _field(res, "step", str)
        line = (f"restored {step} ({_human(_field(res, 'bytes', int))}) in "
                f"{res['seconds']:.2f}s" if res.get("imported") else f"{step} is already here")
    _emit([line])


def cmd_seal(a: argparse.Namespace) -> None:
    daemon = control_socket(a.path)
    res = _request(daemon, "seal", expect=dict,
                   path=os.path.relpath(daemon.path, daemon.root))
    if a.json:
        _print_json(res)
        return
    with _answer_of("seal"):
        line = f"checkpoint {_field(res, 'step', str)} sealed"
    _emit([line])


def cmd_gc(a: argparse.Namespace) -> None:
    res = _request(control_socket(a.mountpoint), "gc", expect=dict)
    if a.json:
        _print_json(res)
        return
    with _answer_of("gc"):
        evicted = _field(res, "evicted", list)
        if not all(isinstance(e, str) for e in evicted):
            raise TypeError("evicted holds what is not a step name")
        out = [f"evicted from RAM: {', '.join(evicted) or 'nothing'}"]
        if res.get("backup_retention"):
            out.append(f"backup retention: {res['backup_retention']}")
    _emit(out)


def cmd_verify(a: argparse.Namespace) -> None:
    res = _request(control_socket(a.mountpoint), "verify", label="verify", expect=dict)
    with _answer_of("verify"):
        bad = _field(res, "mismatches", list)
        out = [f"MISMATCH {m}" for m in bad] or ["all chunks match their hashes"]
    if a.json:
        _print_json(res)
    else:
        _emit(out)
    if bad:
        sys.exit(1)


def cmd_backup(a: argparse.Namespace) -> None:
    res = _request(control_socket(a.mountpoint), "backup", expect=dict, step=a.step)
    if a.json:
        _print_json(res)
        return
    with _answer_of("backup"):
        line = (f"backed up {_field(res, 'last_step', str)}: "
                f"{_human(_field(res, 'last_bytes_logical', int))}, "
                f"{_human(_field(res, 'last_bytes_uploaded', int))} uploaded in "
                f"{_field(res, 'last_seconds', float):.2f}s")
    _emit([line])


def _daemon_pid(mnt: str) -> int | None:
    """The pid of the daemon of mtcfs mount ``mnt`` (from its status, through every check
    of :func:`find_control_socket`), or None when it cannot be had in 10 s."""
    try:
        daemon = find_control_socket(mnt)
        st = control.call(daemon.sock, "status", timeout=10, peer_uids=daemon.uids)
    except (NoDaemon, control.ControlError, OSError):
        return None
    pid = st.get("pid") if isinstance(st, dict) else None
    return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 1 else None


def cmd_umount(a: argparse.Namespace) -> None:
    mnt = os.path.abspath(a.mountpoint)
    entry = mountinfo.entry_at(mnt)  # by text: a stuck mount is not touched
    if entry is None and os.path.realpath(mnt) != mnt:  # named through a symlink
        mnt = os.path.realpath(mnt)
        entry = mountinfo.entry_at(mnt)
    if entry is None:
        _die(f"{mnt} is not mounted")
    if entry.fstype != FSTYPE:
        _die(control.printable(f"{mnt} is not an mtcfs mount (it is {entry.fstype}): mtcfs "
                               "umount leaves it alone"))
    if a.force:
        # The daemon is dead or stuck: abort its FUSE connection, detach the mount.
        mountinfo.force_unmount(mnt)  # a live daemon sees its session end and exits
        return
    pid = _daemon_pid(mnt)  # not with --force: asking a stuck daemon would hang
    if a.flush:
        # What a SIGTERM does first: the newest step to the peers and the backup tier
        # (mtcfs/flush.py), within the daemon's stop_flush= unless --flush-timeout says.
        args_: dict[str, Any] = ({} if a.flush_timeout is None
                                 else {"deadline_s": a.flush_timeout})
        rep = _request(control_socket(mnt), "flush", expect=dict, **args_)
        line = rep.get("step") and (
            f"flushed {rep['step']}" if rep.get("complete") else
            f"NOT flushed {rep['step']}: {'; '.join(map(str, rep.get('missing') or []))}")
        if line:
            print(f"mtcfs: {line} ({rep.get('seconds', 0):.1f} s)", file=sys.stderr)
    tool = shutil.which("fusermount3") or shutil.which("fusermount") or "umount"
    args = [tool, "-u", mnt] if "fusermount" in tool else [tool, mnt]
    if a.lazy:
        args.insert(1, "-z")
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        _die(control.printable(
            f"cannot unmount {mnt}: {r.stderr.strip() or r.stdout.strip()} (files still "
            "open? `mtcfs umount --force` aborts a dead or stuck daemon)"))
    if pid:
        deadline = time.monotonic() + a.timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            _die(f"unmounted, but daemon {pid} did not exit within {a.timeout}s")


def _sub_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mtcfs")
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name: str, fn: Any, help: str, target: str = "mountpoint") -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help)
        sp.add_argument(target)
        sp.add_argument("--json", action="store_true", help="machine-readable output")
        sp.set_defaults(fn=fn)
        return sp

    add("status", cmd_status, "capacity, tiers, peer replication, pending backup work, errors")
    add("checkpoints", cmd_checkpoints, "each checkpoint, its size and its state per tier")
    add("metrics", cmd_metrics, "the status as Prometheus text (for a textfile collector)")
    r = add("restore", cmd_restore, "restore a checkpoint from the backup tier")
    r.add_argument("--step", type=int, help="step number (default: the newest complete)")
    r.add_argument("--no-wait", action="store_true", help="return once the files appear")
    add("seal", cmd_seal, "mark a top-level directory as a complete checkpoint", target="path")
    add("gc", cmd_gc, "evict old checkpoints from RAM and apply backup retention")
    add("verify", cmd_verify, "re-hash every chunk in RAM; exit 1 on any mismatch")
    b = add("backup", cmd_backup, "back up a checkpoint now and wait for it")
    b.add_argument("--step", help="step directory name (default: the newest committed)")
    u = sub.add_parser("umount", help="unmount and wait for the daemon to exit")
    u.add_argument("mountpoint")
    u.add_argument("-z", "--lazy", action="store_true", help="detach now, finish when unused")
    u.add_argument("--force", action="store_true",
                   help="abort the FUSE connection of a dead or stuck daemon (open files fail)")
    u.add_argument("--timeout", type=float, default=60.0)
    u.add_argument("--flush", action="store_true",
                   help="first wait (at most stop_flush=) until the newest step is on the "
                        "peers and in the backup tier, as a SIGTERM does")
    u.add_argument("--flush-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --flush: wait at most this long instead of stop_flush=")
    u.set_defaults(fn=cmd_umount)
    c = sub.add_parser("certs", help="make a job CA and one peer certificate per rank "
                                     "(tls_ca=, tls_cert=, tls_key=; docs/security.md)")
    c.add_argument("directory", help="where the PEM files go (created; must be empty)")
    c.add_argument("--job", required=True)
    c.add_argument("--nodes", type=int, required=True, help="ranks 0..nodes-1")
    c.add_argument("--days", type=int, default=365, help="validity of every certificate")
    c.set_defaults(fn=cmd_certs)
    pl = sub.add_parser("plan", help="RAM tier size per host (--params, --hosts) and checkpoint"
                                     " interval (--mtbf, --save-seconds); docs/operations.md")
    pl.add_argument("--params", help="model parameters, e.g. 70B or 350M")
    pl.add_argument("--hosts", type=int, help="hosts the checkpoint is sharded over")
    pl.add_argument("--replicas", type=int, default=0, help="mount option replicas= (peers)")
    pl.add_argument("--buffer", type=float, default=0.15, help="safety margin (0.15: 15 %%)")
    pl.add_argument("--mtbf", help="the job's mean time between failures, e.g. 3h")
    pl.add_argument("--save-seconds", type=float, help="training time each save blocks")
    pl.add_argument("--restart-seconds", type=float, default=0.0,
                    help="from a failure to training again")
    pl.set_defaults(fn=cmd_plan)
    return p


def cmd_plan(a: argparse.Namespace) -> None:
    """``mtcfs plan``: the sizing rule and Young/Daly's interval (mtcfs/plan.py)."""
    from mtcfs.options import parse_duration
    from mtcfs.plan import parse_params, plan_interval, plan_size
    sizing = a.params is not None or a.hosts is not None
    interval = a.mtbf is not None or a.save_seconds is not None
    if not sizing and not interval:
        _die("plan needs --params and --hosts, or --mtbf and --save-seconds (or both)",
             EXIT_USAGE)
    try:
        if sizing:
            if a.params is None or a.hosts is None:
                raise ValueError("--params and --hosts go together")
            sp = plan_size(parse_params(a.params), a.hosts, a.replicas, a.buffer)
        if interval:
            if a.mtbf is None or a.save_seconds is None:
                raise ValueError("--mtbf and --save-seconds go together")
            ip = plan_interval(parse_duration(a.mtbf), a.save_seconds, a.restart_seconds)
    except ValueError as exc:
        _die(str(exc), EXIT_USAGE)
    if sizing:
        print(f"checkpoint: {_human(sp.total)} in all ({a.params} parameters x 12 bytes), "
              f"{_human(sp.shard)} per host over {a.hosts} hosts")
        extra = f" + {a.replicas} replica(s) of a peer's shard {_human(sp.replicas)}" \
            if a.replicas else ""
        print(f"RAM tier per host: 2 x shard {_human(sp.own)}{extra} + {a.buffer:.0%} "
              f"buffer = {_human(sp.size)} ({sp.size / 1e9:.1f} GB)")
        print(f"mount option: size={math.ceil(sp.size / 2**30)}G (and a tmpfs at least as "
              f"large for store=)")
    if interval:
        print(f"checkpoint interval: {ip.daly_s / 60:.1f} min (Daly 2006; Young 1974: "
              f"{ip.young_s / 60:.1f} min) for an MTBF of {a.mtbf} and {a.save_seconds:g} s "
              f"per save")
        print(f"expected time lost to saves, redone work and restarts: {ip.waste:.1%} "
              f"(goodput about {1 - ip.waste:.1%})")


def cmd_certs(a: argparse.Namespace) -> None:
    """``mtcfs certs DIR --job J --nodes N``: ``J-ca.pem``/``.key`` and ``rank-R.pem``/``.key``
    for every rank. Keep the CA key off the nodes (docs/security.md)."""
    import datetime as dt
    from pathlib import Path

    from mtcfs.options import _JOB_RE
    from mtcfs.base.pki import JobCa
    if not _JOB_RE.match(a.job):
        _die(f"bad --job {a.job!r}: letters, digits, '.', '_', '-' (at most 128)", EXIT_USAGE)
    if not 1 <= a.nodes <= 65536 or not 1 <= a.days <= 36500:
        _die("--nodes must be in 1..65536 and --days in 1..36500", EXIT_USAGE)
    d = Path(a.directory).absolute()
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        _die(f"{d} exists and is not an empty directory: certificates are never overwritten",
             EXIT_USAGE)
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = JobCa(d, a.job, days=a.days + 1)
    for r in range(a.nodes):
        ca.issue_rank(a.job, r, valid_for=dt.timedelta(days=a.days))
    print(f"{d}: {ca.ca.name} (the job CA; {a.job}-ca.key stays off the nodes), "
          f"rank-0..{a.nodes - 1}.pem/.key; mount rank R with "
          f"-o tls_ca={ca.ca},tls_cert={d}/rank-R.pem,tls_key={d}/rank-R.key")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "mount":
        cmd_mount(argv[1:])
        return
    if argv and argv[0] in SUBCOMMANDS:
        a = _sub_parser().parse_args(argv)
        a.fn(a)
        return
    cmd_mount(argv)


if __name__ == "__main__":
    main()
