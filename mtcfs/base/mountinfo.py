"""Facts about mounts from /proc/self/mountinfo, and the forced teardown of a FUSE mount.

A FUSE mount whose daemon died or hangs cannot be unmounted cleanly: every access blocks
or fails with ENOTCONN. :func:`force_unmount` aborts the kernel's FUSE connection through
fusectl (so blocked requests fail at once) and detaches the mount lazily. It is what
``mtcfs umount --force`` runs, and what the tests and examples use in teardown.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass

FUSECTL = "/sys/fs/fuse/connections"

#: Where the mounts of this process's mount namespace are listed (proc(5)).
MOUNTINFO = "/proc/self/mountinfo"


@dataclass(frozen=True)
class MountEntry:
    """One line of /proc/self/mountinfo (proc(5)), its escapes (``\\040``) undone.

    Attributes:
        device: ``"major:minor"`` of the mounted filesystem.
        mount_point: the mount point, absolute, as this process sees it.
        fstype: the filesystem type, e.g. ``"tmpfs"`` or ``"fuse.mtcfs"``.
        source: the mount source (for mtcfs: the job name).
        super_options: the per-superblock options, in order; a flag maps to None. For
            FUSE: ``user_id`` and ``group_id``, the uid and gid of the user who mounted.
    """

    device: str
    mount_point: str
    fstype: str
    source: str
    super_options: dict[str, str | None]

    @property
    def owner(self) -> int | None:
        """The uid of the user who mounted a FUSE filesystem (``user_id=``: fusermount3,
        the setuid helper through which a user other than root mounts, writes that user's
        uid, whatever the filesystem asks; only root could write another), or None when
        the line has no decimal ``user_id=``."""
        v = self.super_options.get("user_id")
        ok = v is not None and v.isascii() and v.isdigit() and len(v) <= 10
        return int(v) if ok and v is not None else None


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _parse(line: str) -> MountEntry | None:
    """One mountinfo line, or None for a line not of its form."""
    fields = line.split()
    try:
        sep = fields.index("-", 6)
        fstype, source = fields[sep + 1], fields[sep + 2]
    except (ValueError, IndexError):
        return None
    opts: dict[str, str | None] = {}
    for opt in (fields[sep + 3] if len(fields) > sep + 3 else "").split(","):
        if opt:
            k, eq, v = opt.partition("=")
            opts[_unescape(k)] = _unescape(v) if eq else None
    return MountEntry(fields[2], _unescape(fields[4]), _unescape(fstype), _unescape(source),
                      opts)


def _read_whole(path: str) -> bytes:
    """``path`` (a seq_file of /proc), whole and consistent. A read(2) of a seq_file returns
    at most the kernel's buffer (one page, whatever was asked for), so the file is read to
    its end; read in pieces, mounts made or removed between two pieces (other processes'
    mounts, busy here while tests mount side by side) can make a line be skipped, a mount
    that exists missing. So it is read again until two whole reads agree (at most a few
    times; then the last is used)."""
    last = b""
    for _ in range(8):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            parts = []
            while piece := os.read(fd, 1 << 16):
                parts.append(piece)
        finally:
            os.close(fd)
        data = b"".join(parts)
        if data == last:
            break
        last = data
    return last


def entries() -> list[MountEntry]:
    """Every mount, in /proc/self/mountinfo order (a later one may cover an earlier one at
    the same mount point: the last is on top). Read as text, in one read(2): no mount is
    touched."""
    text = _read_whole(MOUNTINFO).decode("utf-8", errors="surrogateescape")
    return [e for e in map(_parse, text.splitlines()) if e is not None]


def entry_at(mountpoint: str | os.PathLike[str]) -> MountEntry | None:
    """The mount on top at ``mountpoint`` (made absolute by text, not resolved), or None
    when nothing is mounted there. Touches nothing but mountinfo."""
    mp = os.path.abspath(mountpoint)
    found = None
    for e in entries():
        if e.mount_point == mp:
            found = e  # the last one is the top of a stack of mounts
    return found


def entry_of(path: str | os.PathLike[str]) -> MountEntry | None:
    """The mount that holds ``path`` by its text alone: the deepest mount point that is
    ``path`` or one of its parents (``path`` made absolute and normalized, its symlinks NOT
    resolved, nothing touched, so a stuck FUSE mount cannot block it). None only when
    mountinfo lists no mount of ``/``."""
    p = os.path.abspath(path)
    best: MountEntry | None = None
    for e in entries():
        mp = e.mount_point
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and (
                best is None or len(mp) >= len(best.mount_point)):
            best = e
    return best


def mounts() -> list[tuple[str, str]]:
    """Every mount as (mount point, filesystem type, e.g. ``"tmpfs"`` or ``"fuse.mtcfs"``),
    in /proc/self/mountinfo order (a later one may cover an earlier one)."""
    return [(e.mount_point, e.fstype) for e in entries()]


def mount_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount that holds ``path``, found from the
    path's text without touching it (``path`` may not exist yet; symlinks of its existing
    part are resolved)."""
    e = entry_of(os.path.realpath(path))
    return (e.mount_point, e.fstype) if e is not None else ("/", "")


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """True if something is mounted at ``mountpoint`` (without touching it)."""
    return entry_at(mountpoint) is not None


def device_of(mountpoint: str | os.PathLike[str]) -> str | None:
    """``"major:minor"`` of the mount at ``mountpoint``, read without a stat() of it (which
    would block on a FUSE mount whose daemon is not serving)."""
    e = entry_at(mountpoint)
    return e.device if e else None


def fuse_connection_dir(mountpoint: str | os.PathLike[str]) -> str | None:
    """The fusectl directory of the FUSE connection behind ``mountpoint``, if any.

    Mounts fusectl on /sys/fs/fuse/connections first when it is not (needs root).
    """
    dev = device_of(mountpoint)
    if dev is None:
        return None
    if not os.path.ismount(FUSECTL):
        subprocess.run(["mount", "-t", "fusectl", "none", FUSECTL], capture_output=True)
    path = f"{FUSECTL}/{dev.split(':')[1]}"
    return path if os.path.isdir(path) else None


def abort_connection(mountpoint: str | os.PathLike[str]) -> None:
    """Abort the kernel's FUSE connection of ``mountpoint`` through fusectl (every request
    waiting on its daemon ends with ENOTCONN), and nothing else: no subprocess. Does
    nothing when it is not a mounted FUSE filesystem."""
    conn = fuse_connection_dir(mountpoint) if is_mounted(mountpoint) else None
    if conn:
        try:
            with open(os.path.join(conn, "abort"), "w") as f:
                f.write("1")
        except OSError:
            pass


def force_unmount(mountpoint: str | os.PathLike[str]) -> None:
    """Unmount even if the daemon is dead or stuck: abort the connection, lazy unmount."""
    if not is_mounted(mountpoint):
        return
    abort_connection(mountpoint)
    subprocess.run(["umount", "-l", os.path.abspath(mountpoint)], capture_output=True)
