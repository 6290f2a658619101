"""The data directory's own tmpfs: ``size=`` enforced by the kernel (issue 40).

With FUSE passthrough the kernel writes an open file's bytes straight into
``<store>/data/<vid>``: the daemon's per-write check (core/budget.py, ``reserve``) is never
reached. So when the store is on tmpfs (the RAM tier) and the daemon runs as root, it gives
``<store>/data`` a tmpfs of its own whose size is the RAM tier's capacity
(:func:`tmpfs_size`): a write past it gets ENOSPC from the kernel, at that write(2).

The mount is recognised as mtcfs's by all of: filesystem type ``tmpfs``, mount source
:data:`SOURCE` (only root can mount, and mtcfs names its mounts so), its root directory
owned by root with mode 0700 (:func:`mount_of_data`, used by the store checks). It outlives
the daemon (a restart, a ``kill -9``, a clean unmount of the mtcfs mount keep the RAM tier):
the next daemon reuses it and resizes it when ``size=`` changed (:func:`prepare`). An
operator removes a store with ``umount <store>/data`` and then ``rm -r <store>``
(docs/operations.md).

Upgrade: a ``data/`` that holds files and is no mount (a store of an earlier version) is
moved into a new tmpfs in this order, so that a crash at any point loses nothing:

1. mount the new tmpfs at ``<store>/data.new`` (the staging mount);
2. copy every file of ``data/`` into it (holes kept);
3. rename ``data/`` to ``data.old/`` and make an empty ``data/``;
4. move the staging mount onto ``data/`` (``MS_MOVE``; a bind mount then a detach of the
   staging mount where the parent mount is shared and a move is refused);
5. delete ``data.old/`` and ``data.new``.

A start that finds ``data.old/`` or ``data.new`` first finishes or undoes what a crash
interrupted (:func:`_recover`): before step 4 it puts ``data.old/`` back as ``data/`` and
drops the staging mount (then starts over); after it, it deletes ``data.old/`` (every file
was copied before step 3).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import shutil
import stat

from mtcfs.base import mountinfo
from mtcfs.base.failpoints import failpoint
from mtcfs.base.fileio import pwrite_all

__all__ = ["SOURCE", "DataMountError", "check_resize", "mount_of_data", "prepare", "resize",
           "unmount_data",
           "tmpfs_size", "usage", "wanted"]

log = logging.getLogger("mtcfs.core.store")

#: The mount source mtcfs gives its data tmpfs (the ``source`` field of mountinfo).
SOURCE = "mtcfs-data"
#: Names in the store directory of an upgrade under way (see the module's docstring).
STAGING, OLD = "data.new", "data.old"
PAGE = 4096

_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_MOVE = 32, 4096, 8192
_MNT_DETACH = 2
_FLAGS = _MS_NOSUID | _MS_NODEV | _MS_NOEXEC


class DataMountError(Exception):
    """The data tmpfs cannot be made, reused or resized; one line. (The store turns it into
    a :class:`~mtcfs.core.store.StoreError`.)"""


def tmpfs_size(capacity: int, chunk_size: int) -> int:
    """The data tmpfs's size for a RAM tier of ``capacity`` bytes: the capacity, rounded up
    to a page. Nothing above it: a write past ``size=`` gets ENOSPC at that write(2),
    whoever writes it (the kernel for a passthrough handle, the daemon else). What the
    daemon's budget lets go past ``size=`` on purpose (chunks a read faults in when nothing
    can be evicted, docs/usage.md, "Capacity and eviction") grows the tmpfs for those
    bytes only (``Store.grow_data``), set back at the next reservation that fits
    (``Store.shrink_data``). (A first version kept ``max(4 chunks, size/32)`` above
    ``size=`` for them: a passthrough writer could then pass ``size=`` by that much.)
    ``chunk_size`` is not used (kept for callers)."""
    del chunk_size
    return -(-capacity // PAGE) * PAGE


def wanted(store: str) -> bool:
    """Whether the daemon gives ``store``'s ``data/`` a tmpfs of its own: it runs as root
    and the store directory is on tmpfs (the RAM tier). A store on disk keeps the daemon's
    per-write check alone (and no passthrough writes)."""
    if os.geteuid() != 0:
        return False
    return mountinfo.mount_of(store)[1] == "tmpfs"


def mount_of_data(data: str) -> mountinfo.MountEntry | None:
    """The mount on top at directory ``data`` (by mountinfo, its path resolved), or None
    when none is (a plain directory, or missing)."""
    return mountinfo.entry_at(os.path.realpath(data))


def is_ours(data: str, e: mountinfo.MountEntry | None) -> bool:
    """Whether mount ``e`` at ``data`` is an mtcfs data tmpfs: type tmpfs, source
    :data:`SOURCE`, its root a directory of root's with mode 0700."""
    if e is None or e.fstype != "tmpfs" or e.source != SOURCE:
        return False
    try:
        st = os.lstat(data)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o700


def usage(data: str) -> tuple[int, int]:
    """(size, used) of the filesystem of ``data``, bytes (statfs)."""
    st = os.statvfs(data)
    return st.f_blocks * st.f_frsize, (st.f_blocks - st.f_bfree) * st.f_frsize


def check_resize(store: str, size: int) -> None:
    """Refuse a ``size`` (bytes, :func:`tmpfs_size`) for ``store``'s data tmpfs that is
    smaller than what it holds now and than the size it was given (nothing when it has
    none; a tmpfs grown for reads past ``size=`` keeps its size until the budget sets it
    back). Read only.

    Raises:
        DataMountError: one line, with the smallest ``size=`` that fits.
    """
    data = os.path.join(store, "data")
    if not is_ours(data, mount_of_data(data)):
        return
    total, used = usage(data)
    if used > size and size < _sized(data, total):
        raise DataMountError(
            f"size= too small for store {store}: its data tmpfs ({data}) holds "
            f"{used / 2 ** 20:.1f} MiB, more than the {size / 2 ** 20:.1f} MiB that size= "
            f"allows it; nothing was changed: give a larger size= (at least about "
            f"{-(-used // 2 ** 20)}M), or evict checkpoints first (mtcfs gc)")


# ---------------------------------------------------------------------- mount(2)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _mount(source: str, target: str, fstype: str | None, flags: int, data: str | None
           ) -> None:
    rc = _libc.mount(source.encode(), target.encode(),
                     fstype.encode() if fstype else None, ctypes.c_ulong(flags),
                     data.encode() if data else None)
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


def _umount(target: str) -> None:
    """Detach the mount at ``target`` (lazily: it goes once nothing uses it)."""
    if _libc.umount2(target.encode(), _MNT_DETACH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"umount {target}: {os.strerror(e)}")


def resize(data: str, size: int) -> None:
    """Set the data tmpfs at ``data`` to ``size`` bytes (rounded up to a page; a remount:
    what it holds stays).

    Raises:
        OSError: the remount failed (EINVAL: smaller than what it holds).
    """
    _mount(SOURCE, data, None, _MS_REMOUNT | _FLAGS, f"size={-(-size // PAGE) * PAGE}")


#: The size the daemon gave the tmpfs (size=), on its root directory: tells a
#: tmpfs grown for reads past size= (the budget's exception) from a size= made smaller.
_SIZED_XATTR = "trusted.mtcfs.sized"


def _set_sized(data: str, size: int) -> None:
    try:
        os.setxattr(data, _SIZED_XATTR, str(size).encode())
    except OSError as exc:  # (a kernel without tmpfs xattrs: a grown tmpfs is then refused)
        log.debug("cannot record the size of %s: %s", data, exc)


def _sized(data: str, default: int) -> int:
    """The size recorded by :func:`_set_sized` on ``data``, else ``default``."""
    try:
        v = os.getxattr(data, _SIZED_XATTR).decode()
        return int(v) if v.isascii() and v.isdigit() else default
    except (OSError, ValueError):
        return default


def _mount_tmpfs(target: str, size: int) -> None:
    _mount(SOURCE, target, "tmpfs", _FLAGS, f"size={size},mode=0700,uid=0,gid=0")


def unmount_data(store: str) -> bool:
    """Detach ``store``'s data tmpfs if it has one of mtcfs's (lazily: its pages go once no
    process holds a file of it); what an operator does with ``umount <store>/data`` before
    ``rm -r <store>`` (docs/operations.md). Returns whether there was one.

    Raises:
        OSError: the unmount failed (EPERM: not root).
    """
    data = os.path.join(store, "data")
    if not is_ours(data, mount_of_data(data)):
        return False
    _umount(os.path.realpath(data))
    return True


# ---------------------------------------------------------------------- making it

def prepare(store: str, size: int) -> int | None:
    """Give ``<store>/data`` its tmpfs of ``size`` bytes (:func:`tmpfs_size`), reuse the
    one a daemon before made (resized to ``size`` if it differs), or move an earlier
    version's ``data/`` into a new one (the module's docstring). The caller holds the
    store's lock.

    Returns:
        ``size``, or None when the store gets none (:func:`wanted` is false, or mount(2)
        is not permitted: root without CAP_SYS_ADMIN; logged).

    Raises:
        DataMountError: another mount is on ``data/``; ``size`` is smaller than what the
            tmpfs (or the ``data/`` to move) holds; a mount failed. One line; nothing lost.
    """
    if not wanted(store):
        return None
    data = os.path.join(store, "data")
    _recover(store)
    e = mount_of_data(data)
    if e is not None:
        if not is_ours(data, e):
            raise DataMountError(f"store {store} refused: {data} is a mount not of mtcfs's "
                                 f"({e.fstype} {e.source}); nothing was touched: unmount it")
        total, used = usage(data)
        if total != size:
            if used > size and size >= _sized(data, total):
                # size= as before (or larger): a daemon grew it for reads past size= and
                # did not live to set it back; the budget does (Store.shrink_data)
                log.warning("data tmpfs %s holds %d bytes, more than its size %d: kept at "
                            "%d bytes until evictions make room", data, used, size, total)
                _set_sized(data, size)
                return size
            check_resize(store, size)
            try:
                resize(data, size)
            except OSError as exc:
                raise DataMountError(f"cannot resize the data tmpfs {data} to {size} bytes: "
                                     f"{exc.strerror}") from None
            log.info("data tmpfs %s resized from %d to %d bytes", data, total, size)
        _set_sized(data, size)
        return size
    if not os.path.lexists(data):
        os.mkdir(data, 0o700)
    os.chmod(data, 0o700)  # (a directory of root's, the store checked it)
    names = sorted(os.listdir(data))
    try:
        if not names:
            _mount_tmpfs(data, size)
            _set_sized(data, size)
            return size
        _migrate(store, data, names, size)
    except PermissionError as exc:  # root without CAP_SYS_ADMIN (a container): as before
        log.warning("no tmpfs of its own for %s (%s): size= is held by the daemon's check "
                    "of each write only, so no write may bypass the daemon", data, exc)
        return None
    except OSError as exc:
        raise DataMountError(f"cannot give {data} a tmpfs of its own: "
                             f"{exc.strerror or exc}") from None
    return size


def _migrate(store: str, data: str, names: list[str], size: int) -> None:
    """Steps 1 to 5 of the module's docstring for an earlier version's ``data/``."""
    held = 0
    for n in names:
        st = os.lstat(os.path.join(data, n))
        if not stat.S_ISREG(st.st_mode):
            raise DataMountError(f"cannot move {data} into a tmpfs of its own: {n} is not a "
                                 "regular file; nothing was changed: move it out")
        held += st.st_blocks * 512
    if held > size:
        raise DataMountError(
            f"size= too small for store {store}: {data} holds {held / 2 ** 20:.1f} MiB, "
            f"more than the {size / 2 ** 20:.1f} MiB its data tmpfs may hold; nothing was "
            f"changed: give a larger size= (at least about {-(-held // 2 ** 20)}M)")
    staging, old = os.path.join(store, STAGING), os.path.join(store, OLD)
    os.makedirs(staging, mode=0o700, exist_ok=True)
    _mount_tmpfs(staging, size)  # 1
    _set_sized(staging, size)
    for n in names:  # 2
        _copy_sparse(os.path.join(data, n), os.path.join(staging, n))
    failpoint("datafs.copied")
    os.rename(data, old)  # 3
    os.mkdir(data, 0o700)
    failpoint("datafs.renamed")
    try:  # 4
        _mount(staging, data, None, _MS_MOVE, None)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # (EINVAL: the parent mount is shared)
            raise
        _mount(staging, data, None, _MS_BIND, None)
        _umount(staging)
    failpoint("datafs.moved")
    shutil.rmtree(old)  # 5
    os.rmdir(staging)
    log.warning("moved %d data file(s) (%d bytes) of %s into a tmpfs of its own (%d bytes)",
                len(names), held, data, size)


def _copy_sparse(src: str, dst: str) -> None:
    """Copy regular file ``src`` to new file ``dst``, its holes kept, its mode and times."""
    fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fi)
        fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        try:
            off = 0
            while off < st.st_size:
                try:
                    start = os.lseek(fi, off, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break  # only a hole is left
                    raise
                end = os.lseek(fi, start, os.SEEK_HOLE)
                pos = start
                while pos < end:
                    buf = os.pread(fi, min(end - pos, 1 << 20), pos)
                    if not buf:
                        break
                    pwrite_all(fo, buf, pos)
                    pos += len(buf)
                off = end
            os.ftruncate(fo, st.st_size)
            os.fchmod(fo, stat.S_IMODE(st.st_mode))
            os.utime(fo, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fo)
    finally:
        os.close(fi)


def _recover(store: str) -> None:
    """Finish or undo an upgrade a crash interrupted (the module's docstring)."""
    data = os.path.join(store, "data")
    staging, old = os.path.join(store, STAGING), os.path.join(store, OLD)
    staged = is_ours(staging, mount_of_data(staging))
    if is_ours(data, mount_of_data(data)):
        # after step 4: every file was copied before data/ was renamed
        if staged:
            _umount(staging)
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
            log.warning("deleted %s: an upgrade a crash interrupted had copied it", old)
    else:
        if staged:
            _umount(staging)  # a copy never moved: done again
        if os.path.isdir(old) and not os.path.islink(old):
            if os.path.isdir(data) and not os.path.islink(data) and not os.listdir(data):
                os.rmdir(data)
            if os.path.lexists(data):
                raise DataMountError(f"store {store} refused: both {data} and {old} (an "
                                     "upgrade a crash interrupted) hold files; nothing was "
                                     f"touched: keep the right one as {data}")
            os.rename(old, data)  # undo step 3
            log.warning("put %s back as %s: an upgrade a crash interrupted", old, data)
    if os.path.isdir(staging) and not os.path.islink(staging) and \
            mount_of_data(staging) is None:
        try:
            os.rmdir(staging)
        except OSError as exc:
            log.warning("cannot remove %s: %s", staging, exc)
