"""The pyfuse3 adapter: FUSE requests in, core calls, errno out.

A thin, mechanical layer: it converts pyfuse3's types to the core's and
:class:`mtcfs.base.errors.FsError` to ``pyfuse3.FUSEError``. Only ``FUSEError`` may escape a
handler; an unexpected exception is logged and reported as EIO so the mount stays up.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import stat
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pyfuse3
import trio

from mtcfs.base import procfs
from mtcfs.base.errors import ENOATTR, FsError
from mtcfs.core.core import Filesystem
from mtcfs.core.model import Attr
from mtcfs.core.passthrough import Passthrough
from mtcfs.direct_writes import CACHED, DIRECT, DirectWrites

log = logging.getLogger(__name__)

#: Seconds the kernel may cache names and attributes. Only this mount changes the
#: namespace in scope=node, and changes the core makes on its own (restore, eviction) keep
#: names and sizes stable, so a long timeout is safe.
ENTRY_TIMEOUT = 60.0
ATTR_TIMEOUT = 60.0

T = TypeVar("T")


def _errno_out(fn: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> T:
        try:
            return await fn(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except FsError as exc:
            raise pyfuse3.FUSEError(exc.errno) from None
        except OSError as exc:
            log.warning("%s: %s", fn.__name__, exc)
            raise pyfuse3.FUSEError(exc.errno or errno.EIO) from None
        except Exception:
            log.exception("unexpected error in %s", fn.__name__)
            raise pyfuse3.FUSEError(errno.EIO) from None
    return wrapper


def entry(a: Attr, timeout: float | None = None) -> pyfuse3.EntryAttributes:
    e = pyfuse3.EntryAttributes()
    e.st_ino = a.ino
    e.generation = 0
    e.entry_timeout = ENTRY_TIMEOUT if timeout is None else timeout
    e.attr_timeout = ATTR_TIMEOUT if timeout is None else timeout
    e.st_mode = a.mode
    e.st_nlink = a.nlink
    e.st_uid = a.uid
    e.st_gid = a.gid
    e.st_rdev = a.rdev
    e.st_size = a.size
    e.st_blksize = a.blksize
    e.st_blocks = a.blocks
    e.st_atime_ns = a.atime_ns
    e.st_mtime_ns = a.mtime_ns
    e.st_ctime_ns = a.ctime_ns
    return e


def direct_io_allow_mmap() -> bool:
    """Whether this process's FUSE connection negotiated ``FUSE_DIRECT_IO_ALLOW_MMAP`` (only
    mtcfs's pyfuse3 can; false before INIT and with the stock pyfuse3): a file opened with
    FOPEN_DIRECT_IO can then still be mapped ``MAP_SHARED`` (else mmap fails with ENODEV)."""
    return bool(getattr(pyfuse3, "direct_io_allow_mmap", False))


def killpriv_v2() -> bool:
    """Whether this process's FUSE connection negotiated ``FUSE_HANDLE_KILLPRIV_V2`` (only
    mtcfs's pyfuse3 can; false before INIT and with the stock pyfuse3)."""
    return bool(getattr(pyfuse3, "handle_killpriv_v2", False))


@functools.cache
def libfuse_version() -> str | None:
    """The version of the libfuse this process runs on (``fuse_pkgversion()`` of the copy
    pyfuse3 loaded, e.g. ``"3.17.2"``), or None when it cannot be told. Read once: it
    cannot change while the process runs, and every status (each metrics scrape) asks."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libfuse3.so" in line}
        for path in sorted(paths):
            fn = ctypes.CDLL(path).fuse_pkgversion
            fn.restype = ctypes.c_char_p
            v = fn()
            return v.decode() if isinstance(v, bytes) else None
    except (OSError, AttributeError):
        pass
    return None


def file_info(fh: int, *, keep_cache: bool, direct_io: bool,
              backing_id: int) -> pyfuse3.FileInfo:
    """The reply to an open or create: a ``pyfuse3.FileInfo``.

    ``backing_id`` (FUSE passthrough, docs/passthrough.md) is passed only when it is not 0:
    PyPI's pyfuse3, which runs where mtcfs's patched one could not be built
    (scripts/build_fuse.sh falls back to it), has no such argument, and passthrough is
    then refused at mount, so the id is always 0 there. Passed always, every open and
    create failed EIO with a TypeError under that pyfuse3 (found building the container
    image, issue 44).
    """
    if backing_id:
        return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=direct_io,
                                backing_id=backing_id)
    return pyfuse3.FileInfo(fh=fh, keep_cache=keep_cache, direct_io=direct_io)


class Operations(pyfuse3.Operations):
    """pyfuse3 Operations over a :class:`~mtcfs.core.core.Filesystem`.

    Writeback cache is on: the kernel batches small writes into 1 MiB requests (about 4x
    the throughput without it, library-fs-ops.md) and owns mtime/size while a file is open
    for writing. Files are opened with keep_cache: all writes go through this mount, so
    the page cache never holds stale data (O_TRUNC opens drop it in the kernel).
    """

    enable_writeback_cache = True
    #: Ask for FUSE_HANDLE_KILLPRIV_V2 (mtcfs's pyfuse3 on libfuse >= 3.17, built by
    #: scripts/build_fuse.sh; the stock pyfuse3 ignores it): the kernel then sends no
    #: GETXATTR of security.capability before every write(2), and the core clears
    #: set-user-ID/set-group-ID bits itself (NamespaceOps.kills_suidgid, docs/fuse-build.md).
    enable_killpriv_v2 = True
    #: Ask for FUSE_DIRECT_IO_ALLOW_MMAP (mtcfs's pyfuse3, kernel >= 6.6): direct writes
    #: (below) are used only when the kernel granted it, so that mmap keeps working.
    enable_direct_io_allow_mmap = True
    supports_dot_lookup = True

    def __init__(self, fs: Filesystem, mountpoint: str = "", direct_writes: bool = False,
                 passthrough: Passthrough | None = None) -> None:
        super().__init__()
        self.fs = fs
        #: FUSE passthrough (core/passthrough.py, docs/passthrough.md): asked for at INIT
        #: only where nothing known rules it out, since the kernel then allows no writeback
        #: cache on the connection (pyfuse3 asks for it only when this is false).
        self.pt = passthrough or Passthrough(False)
        self.enable_passthrough = self.pt.wanted and not self.pt.why_off
        #: The writeback cache is in effect (set at INIT: not beside passthrough).
        self.writeback = self.enable_writeback_cache
        #: Mount option direct_writes: write-only handles that create or truncate a file are
        #: opened FOPEN_DIRECT_IO unless their thread writes small pieces (direct_writes.py;
        #: docs/usage.md, "Direct writes"). The kernel stamps no c/mtime for such a write,
        #: and neither does the core: the times a node shows stay the times it stores,
        #: across a restart too. In effect from INIT, when the kernel grants the flag.
        self.direct = DirectWrites(direct_writes)
        self.mountpoint = os.path.abspath(mountpoint) if mountpoint else ""
        self._owners: dict[int, int] = {}  # scope=job: fh -> thread group that opened it
        self._mnt_id: int | None = None
        self.initialized = False
        #: scope=job: names and attributes change on other nodes, so the kernel caches
        #: none (every path walk asks; close-to-open, docs/consistency.md).
        self.cache_timeout = 0.0 if fs.job_scope else None
        fs.subscribe(self._on_event)

    def _entry(self, a: Attr) -> pyfuse3.EntryAttributes:
        return entry(a, self.cache_timeout)

    def init(self) -> None:
        """FUSE INIT arrived: the kernel has negotiated the connection."""
        self.fs.kills_suidgid = killpriv_v2()
        self.direct.on = self.direct.wanted and direct_io_allow_mmap()
        granted = bool(getattr(pyfuse3, "passthrough", False))
        if self.enable_passthrough:
            self.pt.start(granted, pyfuse3.session_fileno() if granted else -1)
        self.writeback = self.enable_writeback_cache and not granted
        self.fs.adapter_ready(stamp_writes=not self.writeback)
        self.initialized = True

    def _on_event(self, event: str, obj: Any) -> None:
        if event == "invalidate_entry":
            if not self.initialized:  # the kernel has cached nothing yet
                return
            parent, name, child = obj
            try:
                pyfuse3.invalidate_entry_async(parent, name, deleted=child, ignore_enoent=True)
            except Exception:  # not mounted (in-process use of the core): nothing cached
                log.debug("invalidate_entry failed", exc_info=True)

    @_errno_out
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.lookup(parent_inode, name))

    async def forget(self, inode_list: Any) -> None:
        try:
            self.fs.forget(inode_list)
        except Exception:
            log.exception("forget failed")

    @_errno_out
    async def getattr(self, inode: int, ctx: Any = None) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.getattr(inode))

    @_errno_out
    async def setattr(self, inode: int, attr: Any, fields: Any, fh: int | None,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        # pyfuse3 fills in the time for UTIME_NOW; 0 is a real time (the epoch), kept as is.
        a = await self.fs.setattr(
            inode,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            size=attr.st_size if fields.update_size else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            fh=fh)
        return self._entry(a)

    @_errno_out
    async def readlink(self, inode: int, ctx: Any) -> bytes:
        return await self.fs.readlink(inode)

    @_errno_out
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        if not stat.S_ISREG(mode):  # a FIFO, socket or device node (metadata only)
            return self._entry(await self.fs.mknod(parent_inode, name, mode, rdev, ctx.uid,
                                                   ctx.gid))
        fh, a = await self.fs.create(parent_inode, name, mode, os.O_WRONLY | os.O_EXCL,
                                     ctx.uid, ctx.gid)
        await self.fs.release(fh)
        return self._entry(a)

    @_errno_out
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: Any) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.mkdir(parent_inode, name, mode, ctx.uid, ctx.gid))

    @_errno_out
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.unlink(parent_inode, name)

    @_errno_out
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.rmdir(parent_inode, name)

    @_errno_out
    async def symlink(self, parent_inode: int, name: bytes, target: bytes,
                      ctx: Any) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @_errno_out
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int,
                     name_new: bytes, flags: int, ctx: Any) -> None:
        await self.fs.rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)

    @_errno_out
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes,
                   ctx: Any) -> pyfuse3.EntryAttributes:
        return self._entry(await self.fs.link(inode, new_parent_inode, new_name))

    @_errno_out
    async def open(self, inode: int, flags: int, ctx: Any) -> pyfuse3.FileInfo:
        fh, keep = await self.fs.open(inode, self._flags(flags), kernel=True)
        backing = self.fs.backing_id(fh)
        choice = CACHED if backing else self.direct.choose(flags, bool(flags & os.O_TRUNC),
                                                            ctx.pid)
        self._opened(fh, flags, ctx, choice)
        # (a passthrough reply carries no other flag than direct I/O and noflush: the
        # kernel refuses the open with EIO otherwise)
        return file_info(fh, keep_cache=keep and not backing, direct_io=choice == DIRECT,
                         backing_id=backing)

    @_errno_out
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: Any) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        fh, a = await self.fs.create(parent_inode, name, mode, self._flags(flags), ctx.uid,
                                     ctx.gid, kernel=True)
        backing = self.fs.backing_id(fh)
        # (in scope=job another node may have created the name since the kernel's lookup:
        # the core then opened that file, which may have content)
        choice = CACHED if backing else self.direct.choose(flags, a.size == 0, ctx.pid)
        self._opened(fh, flags, ctx, choice)
        return (file_info(fh, keep_cache=not backing, direct_io=choice == DIRECT,
                          backing_id=backing),
                self._entry(a))

    def _opened(self, fh: int, flags: int, ctx: Any, choice: str) -> None:
        """Handle ``fh`` is open: tell direct writes what was chosen for it; in scope=job,
        remember which process opened a file for writing (see flush)."""
        self.direct.opened(fh, ctx.pid, choice)
        if choice == DIRECT:
            self.fs.mark_direct(fh)
        if self.fs.job_scope and flags & os.O_ACCMODE != os.O_RDONLY and ctx:
            self._owners[fh] = procfs.tgid(ctx.pid)

    def _flags(self, flags: int) -> int:
        # With writeback cache the kernel resolves O_APPEND itself (at its own i_size) and
        # flushes dirty pages at explicit offsets through any writable handle of the inode,
        # an O_APPEND one included: the core must write them where they are sent.
        # (Without it, as beside passthrough, the core resolves O_APPEND on the daemon's
        # path and the kernel on a passthrough handle.)
        return flags & ~os.O_APPEND if self.writeback else flags

    @_errno_out
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.fs.read(fh, off, size)

    @_errno_out
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        self.direct.wrote(fh, len(buf))
        return await self.fs.write(fh, off, buf)

    @_errno_out
    async def flush(self, fh: int) -> None:
        # The kernel sends FLUSH at every close(2) of a descriptor of the open file, also in
        # a child that inherited it (close-on-exec after fork). pyfuse3 does not say which
        # process closed; the close is the writer's last when the process that opened the
        # file no longer holds a descriptor of it (read in /proc, which never calls back
        # into this filesystem).
        owner = self._owners.get(fh)
        final = True
        if owner is not None and self.mountpoint:
            inos = self.fs.kernel_inos(fh)
            final = not await trio.to_thread.run_sync(procfs.holds, owner, self._mount_id(),
                                                      inos)
        await self.fs.flush(fh, final=final)

    def _mount_id(self) -> int:
        if self._mnt_id is None:
            self._mnt_id = procfs.mount_id(self.mountpoint)
        return self._mnt_id

    @_errno_out
    async def release(self, fh: int) -> None:
        self._owners.pop(fh, None)
        self.direct.released(fh)
        await self.fs.release(fh)

    @_errno_out
    async def fallocate(self, fh: int, mode: int, offset: int, length: int) -> None:
        # (called by mtcfs's pyfuse3, third_party/pyfuse3/fallocate.patch; the stock one
        # answers ENOSYS itself, and the kernel then says EOPNOTSUPP)
        await self.fs.fallocate(fh, mode, offset, length)

    @_errno_out
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.fs.fsync(fh, datasync)

    @_errno_out
    async def opendir(self, inode: int, ctx: Any) -> int:
        return await self.fs.opendir(inode)

    @_errno_out
    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        for name, a, next_id, counts in self.fs.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, self._entry(a), next_id):
                break
            if counts:
                self.fs.count_lookup(a.ino)

    @_errno_out
    async def releasedir(self, fh: int) -> None:
        await self.fs.releasedir(fh)

    @_errno_out
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None  # every namespace change is already committed to the store's database

    @_errno_out
    async def statfs(self, ctx: Any) -> pyfuse3.StatvfsData:
        await self.fs.open_files.settle_releases()  # an unlinked file just closed: its space is back
        s = self.fs.statfs()
        out = pyfuse3.StatvfsData()
        bs = 4096
        out.f_bsize = bs
        out.f_frsize = bs
        out.f_blocks = s["capacity"] // bs
        out.f_bfree = s["free"] // bs
        out.f_bavail = s["free"] // bs
        out.f_files = s["files"] + 1_000_000
        out.f_ffree = 1_000_000
        out.f_favail = 1_000_000
        out.f_namemax = 255
        return out

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        # Only user.* attributes exist (setxattr refuses the other namespaces). Without
        # FUSE_HANDLE_KILLPRIV_V2 (libfuse 3.14, the stock pyfuse3) the kernel asks for
        # security.capability before every write(2) (file_remove_privs: a FUSE superblock
        # is SB_NOSEC only with that flag), so that answer does not go through the core
        # (docs/benchmarks.md, "The GETXATTR before every write"; docs/fuse-build.md).
        if not name.startswith(b"user."):
            self.fs.counters.foreign_getxattrs += 1
            raise pyfuse3.FUSEError(ENOATTR)
        return await self._getxattr(inode, name)

    @_errno_out
    async def _getxattr(self, inode: int, name: bytes) -> bytes:
        return await self.fs.getxattr(inode, name)

    @_errno_out
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        await self.fs.setxattr(inode, name, value)

    @_errno_out
    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        return await self.fs.listxattr(inode)

    @_errno_out
    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        await self.fs.removexattr(inode, name)

    @_errno_out
    async def access(self, inode: int, mode: int, ctx: Any) -> bool:
        await self.fs.getattr(inode)  # the kernel checks permissions (default_permissions)
        return True
