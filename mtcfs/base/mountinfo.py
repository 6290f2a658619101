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

FUSECTL = "/sys/fs/fuse/connections"


def _mount_fields(mountpoint: str | os.PathLike[str]) -> list[str] | None:
    mp = os.path.abspath(mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == mp:
                found = fields  # the last one is the top of a stack of mounts
    return found


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts() -> list[tuple[str, str]]:
    """Every mount as (mount point, filesystem type, e.g. ``"tmpfs"`` or ``"fuse.mtcfs"``),
    in /proc/self/mountinfo order (a later one may cover an earlier one)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            out.append((_unescape(fields[4]), fields[sep + 1]))
    return out


def mount_of(path: str | os.PathLike[str]) -> tuple[str, str]:
    """(mount point, filesystem type) of the mount that holds ``path``, found from the
    path's text without touching it (``path`` may not exist yet; symlinks of its existing
    part are resolved)."""
    p = os.path.realpath(path)
    best = ("/", "")
    for mp, fstype in mounts():
        if (p == mp or p.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[0]):
            best = (mp, fstype)
    return best


def is_mounted(mountpoint: str | os.PathLike[str]) -> bool:
    """True if something is mounted at ``mountpoint`` (without touching it)."""
    return _mount_fields(mountpoint) is not None


def device_of(mountpoint: str | os.PathLike[str]) -> str | None:
    """``"major:minor"`` of the mount at ``mountpoint``, read without a stat() of it (which
    would block on a FUSE mount whose daemon is not serving)."""
    fields = _mount_fields(mountpoint)
    return fields[2] if fields else None


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
