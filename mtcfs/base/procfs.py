"""What /proc says about the processes using the mount (Linux), read without ever calling
into the mount itself (no stat of a path below it: that would wait on this daemon)."""

from __future__ import annotations

import os


def tgid(pid: int) -> int:
    """The thread group (process) of thread ``pid``, as FUSE requests carry thread ids;
    ``pid`` itself if /proc does not say."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pid


def mount_id(mountpoint: str) -> int:
    """The mount id (``/proc/self/mountinfo``, field 1) of the mount at ``mountpoint``;
    -1 if it is not mounted."""
    found = -1
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 4 and fields[4] == mountpoint:
                found = int(fields[0])  # the last one: mounts stack
    return found


def holds(pid: int, mnt_id: int, inos: set[int]) -> bool:
    """Whether process ``pid`` has a descriptor open on one of inode numbers ``inos`` of
    mount ``mnt_id`` (from ``/proc/PID/fdinfo``: its ``mnt_id`` and ``ino`` lines)."""
    try:
        names = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return False
    for n in names:
        try:
            with open(f"/proc/{pid}/fdinfo/{n}") as f:
                text = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        try:
            if int(fields.get("mnt_id", -2)) == mnt_id and int(fields.get("ino", -1)) in inos:
                return True
        except ValueError:
            continue
    return False
