"""A minimal FUSE server written directly on /dev/fuse, with kernel passthrough (issue 18).

A prototype for a measurement, not a product: one flat directory (the mount's root) backed
by a store directory on tmpfs. What it shows is the data path that pyfuse3 3.5.0 and
libfuse 3.14 cannot offer: FUSE passthrough (Linux >= 6.9, protocol 7.40).

- INIT asks for ``FUSE_PASSTHROUGH`` (``flags2`` bit 5) with ``max_stack_depth = 1`` (the
  backing files live on tmpfs, a filesystem of depth 0), and no writeback cache: the kernel
  refuses passthrough opens on a connection with the writeback cache.
- OPEN and CREATE open the store file themselves (the daemon, never the caller, chooses the
  backing file), register it with the ``FUSE_DEV_IOC_BACKING_OPEN`` ioctl on the /dev/fuse
  descriptor and answer ``FOPEN_PASSTHROUGH`` with that ``backing_id``. From then on the
  kernel reads and writes the tmpfs file itself; READ and WRITE requests never reach this
  process. One backing id per inode, shared by its opens, closed
  (``FUSE_DEV_IOC_BACKING_CLOSE``) at the last RELEASE.
- RELEASE of the last writer of a file seals it: blake3 of the store file in 4 MiB chunks
  (``mtcfs.base.chunking.hash_fd``, mtcfs's own function) in a worker thread. Each seal is
  appended as one JSON line to ``<state>/seals.jsonl``: name, size, file hash, and
  ``time.monotonic()`` at release and at the end of hashing (the benchmark, on the same
  clock, computes close -> sealed).
- ``--no-passthrough`` answers OPEN without it: READ and WRITE then come to this
  single-threaded Python loop (``pread``/``pwrite`` on the store file), for comparison.
- ``--xattrs`` answers GETXATTR "no such attribute" (ENODATA), as a filesystem with
  extended attributes must, instead of ENOSYS (after which the kernel asks no more); the
  kernel then asks for ``security.capability`` before every write(2).
  ``--killpriv-v2`` also asks for ``FUSE_HANDLE_KILLPRIV_V2`` at INIT, which makes the
  superblock ``SB_NOSEC``: that GETXATTR stops (a server with it must clear the set-user-ID
  and set-group-ID bits itself on a WRITE with ``FUSE_WRITE_KILL_SUIDGID``; this prototype
  has no such bits to clear). What libfuse >= 3.17 would let mtcfs ask for
  (docs/benchmarks.md, "The GETXATTR before every write").

Deadlines: the loop polls /dev/fuse every 0.5 s; SIGTERM/SIGINT or ``--max-seconds``
(default 1800) make it detach the mount (after aborting the connection through fusectl if
the kernel still holds requests) and exit. Needs root (mount(2) and the backing ioctl need
CAP_SYS_ADMIN).

Run ``python -m benchmarks.passthrough_fs STORE MOUNTPOINT STATE_DIR``: prints ``ready``
on stdout once INIT is answered, serves until unmounted or signalled.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import os
import select
import signal
import stat
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from mtcfs.base.chunking import hash_fd  # noqa: E402
from mtcfs.base.mountinfo import force_unmount, is_mounted  # noqa: E402

# ---------------------------------------------------------------- protocol (linux/fuse.h)
# Opcodes.
LOOKUP, FORGET, GETATTR, SETATTR = 1, 2, 3, 4
UNLINK = 10
OPEN, READ, WRITE, STATFS, RELEASE = 14, 15, 16, 17, 18
FSYNC, SETXATTR, GETXATTR, LISTXATTR, REMOVEXATTR, FLUSH, INIT = 20, 21, 22, 23, 24, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR = 27, 28, 29, 30
ACCESS, CREATE, INTERRUPT, DESTROY = 34, 35, 36, 38
BATCH_FORGET = 42
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}

# INIT flags (flags | flags2 << 32).
ASYNC_READ = 1 << 0
HANDLE_KILLPRIV_V2 = 1 << 28
ATOMIC_O_TRUNC = 1 << 3
BIG_WRITES = 1 << 5
WRITEBACK_CACHE = 1 << 16
MAX_PAGES = 1 << 22
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37

FOPEN_PASSTHROUGH = 1 << 7
# SETATTR valid bits.
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE = 1, 2, 4, 8
FATTR_ATIME, FATTR_MTIME, FATTR_ATIME_NOW, FATTR_MTIME_NOW = 16, 32, 128, 256


def _iow(magic: int, nr: int, size: int) -> int:
    """The Linux _IOW(magic, nr, size) ioctl number (x86-64/arm64 encoding)."""
    return (1 << 30) | (size << 16) | (magic << 8) | nr


FUSE_DEV_IOC_MAGIC = 229
BACKING_MAP = struct.Struct("<iIQ")  # struct fuse_backing_map: fd, flags, padding
IOC_BACKING_OPEN = _iow(FUSE_DEV_IOC_MAGIC, 1, BACKING_MAP.size)
IOC_BACKING_CLOSE = _iow(FUSE_DEV_IOC_MAGIC, 2, 4)

IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
INIT_IN = struct.Struct("<IIIII")  # major, minor, max_readahead, flags, flags2 (+ unused)
# major, minor, max_readahead, flags, max_background, congestion_threshold, max_write,
# time_gran, max_pages, map_alignment, flags2, max_stack_depth, 24 bytes unused: 64 bytes.
INIT_OUT = struct.Struct("<IIIIHHIIHHII24x")
# ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, nlink, uid,
# gid, rdev, blksize, flags: 88 bytes.
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
ENTRY_OUT_HEAD = struct.Struct("<QQQQII")  # nodeid, generation, entry_valid, attr_valid, nsecs
ATTR_OUT_HEAD = struct.Struct("<QII")  # attr_valid, attr_valid_nsec, dummy
OPEN_IN = struct.Struct("<II")  # flags, open_flags
CREATE_IN = struct.Struct("<IIII")  # flags, mode, umask, open_flags
OPEN_OUT = struct.Struct("<QIi")  # fh, open_flags, backing_id
RELEASE_IN = struct.Struct("<QIIQ")  # fh, flags, release_flags, lock_owner
RW_IN = struct.Struct("<QQIIQII")  # fh, offset, size, flags, lock_owner, flags, padding
WRITE_OUT = struct.Struct("<II")
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")
FORGET_ONE = struct.Struct("<QQ")
DIRENT_HEAD = struct.Struct("<QQII")  # ino, off, namelen, type

ROOT = 1
TTL = 1  # seconds the kernel may cache entries and attributes
BLKSIZE = 1 << 20
MAX_WRITE = 1 << 20
CHUNK = 4 << 20  # the seal's chunk size, mtcfs's default


class ReplyError(Exception):
    def __init__(self, err: int) -> None:
        super().__init__(os.strerror(err))
        self.errno = err


@dataclass
class Node:
    """One file of the store, as the kernel knows it."""

    name: str
    nlookup: int = 0
    fd: int = -1  # the daemon's own descriptor of the store file, while opened
    backing_id: int = 0
    opens: int = 0
    writers: int = 0
    written: bool = False  # opened for writing since the last seal


@dataclass
class Handle:
    ino: int
    writer: bool


@dataclass
class Server:
    store: Path
    mountpoint: Path
    state: Path
    passthrough: bool = True
    max_seconds: float = 1800.0
    writeback_cache: bool = False  # an experiment: the kernel then refuses passthrough opens
    xattrs: bool = False  # GETXATTR answers ENODATA, not ENOSYS
    killpriv_v2: bool = False  # ask for FUSE_HANDLE_KILLPRIV_V2
    dev: int = -1
    nodes: dict[int, Node] = field(default_factory=dict)
    handles: dict[int, Handle] = field(default_factory=dict)
    next_fh: int = 1
    stop: bool = False
    initialized: bool = False
    kernel_minor: int = 0
    seal_lock: threading.Lock = field(default_factory=threading.Lock)
    seal_threads: list[threading.Thread] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    # ------------------------------------------------------------ mount and loop

    def mount(self) -> None:
        self.dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        opts = (f"fd={self.dev},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()},"
                "allow_other,default_permissions")
        libc = ctypes.CDLL(None, use_errno=True)
        ms_nosuid, ms_nodev = 2, 4
        rc = libc.mount(b"ptfs", os.fsencode(self.mountpoint), b"fuse.ptfs",
                        ctypes.c_ulong(ms_nosuid | ms_nodev), opts.encode())
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"mount {self.mountpoint}: {os.strerror(e)}")

    def serve(self) -> None:
        deadline = time.monotonic() + self.max_seconds
        buf = bytearray(MAX_WRITE + 64 * 1024)
        poller = select.poll()
        poller.register(self.dev, select.POLLIN)
        while not self.stop:
            if time.monotonic() > deadline:
                print(f"passthrough_fs: --max-seconds {self.max_seconds:.0f} reached",
                      file=sys.stderr)
                break
            if not poller.poll(500):
                continue
            try:
                n = os.readv(self.dev, [buf])
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EAGAIN):  # request interrupted, retry
                    continue
                if e.errno == errno.ENODEV:  # unmounted
                    return
                raise
            self._dispatch(memoryview(buf)[:n])

    def shutdown(self) -> None:
        """Wait for seals, detach the mount if still there, close every descriptor."""
        for t in self.seal_threads:
            t.join(60)
        if is_mounted(str(self.mountpoint)):
            force_unmount(str(self.mountpoint))
        for node in self.nodes.values():
            if node.fd >= 0:
                os.close(node.fd)
        if self.dev >= 0:
            os.close(self.dev)

    # ------------------------------------------------------------ replies

    def _reply(self, unique: int, *parts: bytes) -> None:
        body = b"".join(parts)
        os.write(self.dev, OUT_HEADER.pack(OUT_HEADER.size + len(body), 0, unique) + body)

    def _error(self, unique: int, err: int) -> None:
        try:
            os.write(self.dev, OUT_HEADER.pack(OUT_HEADER.size, -err, unique))
        except FileNotFoundError:
            pass  # the request was interrupted meanwhile

    def _dispatch(self, req: memoryview) -> None:
        (_, op, unique, nodeid, _uid, _gid, _pid, _ext, _pad) = IN_HEADER.unpack_from(req)
        arg = req[IN_HEADER.size:]
        self.counts[str(op)] = self.counts.get(str(op), 0) + 1
        handler = self.HANDLERS.get(op)
        if handler is None:
            if op not in NO_REPLY:
                self._error(unique, errno.ENOSYS)
            return
        try:
            handler(self, unique, nodeid, arg)
        except ReplyError as e:
            self._error(unique, e.errno)
        except OSError as e:
            self._error(unique, e.errno or errno.EIO)

    # ------------------------------------------------------------ attributes

    def _path(self, ino: int) -> Path:
        if ino == ROOT:
            return self.store
        node = self.nodes.get(ino)
        if node is None:
            raise ReplyError(errno.ENOENT)
        return self.store / node.name

    def _attr(self, ino: int) -> bytes:
        node = self.nodes.get(ino)
        st = os.fstat(node.fd) if node and node.fd >= 0 else os.lstat(self._path(ino))
        return ATTR.pack(ino, st.st_size, st.st_blocks, int(st.st_atime), int(st.st_mtime),
                         int(st.st_ctime), st.st_atime_ns % 10**9, st.st_mtime_ns % 10**9,
                         st.st_ctime_ns % 10**9, st.st_mode, st.st_nlink, st.st_uid,
                         st.st_gid, 0, BLKSIZE, 0)

    def _entry(self, name: str) -> bytes:
        st = os.lstat(self.store / name)
        if not stat.S_ISREG(st.st_mode):
            raise ReplyError(errno.ENOENT)  # a flat store of regular files
        ino = st.st_ino
        if ino == ROOT:
            raise ReplyError(errno.EIO)
        node = self.nodes.get(ino)
        if node is None:
            node = self.nodes[ino] = Node(name)
        node.name = name
        node.nlookup += 1
        return ENTRY_OUT_HEAD.pack(ino, 0, TTL, TTL, 0, 0) + self._attr(ino)

    @staticmethod
    def _name(arg: memoryview) -> str:
        raw = bytes(arg).split(b"\0", 1)[0]
        name = os.fsdecode(raw)
        if not name or "/" in name or name in (".", ".."):
            raise ReplyError(errno.EINVAL)
        return name

    # ------------------------------------------------------------ handlers

    def op_init(self, unique: int, _nodeid: int, arg: memoryview) -> None:
        major, minor, max_readahead, flags, flags2 = INIT_IN.unpack_from(arg)
        offered = flags | (flags2 << 32 if flags & INIT_EXT else 0)
        self.kernel_minor = minor
        if major != 7 or minor < 40:
            raise ReplyError(errno.EPROTO)  # passthrough is protocol 7.40 (Linux 6.9)
        want = ASYNC_READ | ATOMIC_O_TRUNC | BIG_WRITES | MAX_PAGES | INIT_EXT
        if self.passthrough:
            if not offered & PASSTHROUGH:
                raise ReplyError(errno.EPROTO)  # kernel built without CONFIG_FUSE_PASSTHROUGH
            want |= PASSTHROUGH
        if self.writeback_cache:
            want |= WRITEBACK_CACHE
        if self.killpriv_v2:
            want |= HANDLE_KILLPRIV_V2
        got = want & offered
        self._reply(unique, INIT_OUT.pack(
            7, minor, max_readahead, got & 0xFFFFFFFF, 16, 12, MAX_WRITE, 1,
            MAX_WRITE // 4096, 0, got >> 32, 1 if self.passthrough else 0))
        self.initialized = True

    def op_destroy(self, unique: int, _nodeid: int, _arg: memoryview) -> None:
        self._reply(unique)
        self.stop = True

    def op_lookup(self, unique: int, nodeid: int, arg: memoryview) -> None:
        if nodeid != ROOT:
            raise ReplyError(errno.ENOTDIR)
        self._reply(unique, self._entry(self._name(arg)))

    def op_forget(self, _unique: int, nodeid: int, arg: memoryview) -> None:
        (n,) = struct.unpack_from("<Q", arg)
        self._forget(nodeid, n)

    def op_batch_forget(self, _unique: int, _nodeid: int, arg: memoryview) -> None:
        (count,) = struct.unpack_from("<I", arg)
        for i in range(count):
            ino, n = FORGET_ONE.unpack_from(arg, 8 + i * FORGET_ONE.size)
            self._forget(ino, n)

    def _forget(self, ino: int, n: int) -> None:
        node = self.nodes.get(ino)
        if node is None:
            return
        node.nlookup -= n
        if node.nlookup <= 0 and node.opens == 0:
            del self.nodes[ino]

    def op_getattr(self, unique: int, nodeid: int, _arg: memoryview) -> None:
        self._reply(unique, ATTR_OUT_HEAD.pack(TTL, 0, 0), self._attr(nodeid))

    def op_setattr(self, unique: int, nodeid: int, arg: memoryview) -> None:
        (valid, _, _fh, size, _lo, atime, mtime, _ctime, atimens, mtimens, _ctimens, mode,
         _, uid, gid, _) = SETATTR_IN.unpack_from(arg)
        path = self._path(nodeid)
        if valid & FATTR_SIZE:
            os.truncate(path, size)
            node = self.nodes.get(nodeid)
            if node is not None:
                node.written = True
        if valid & FATTR_MODE:
            os.chmod(path, stat.S_IMODE(mode))
        if valid & (FATTR_UID | FATTR_GID):
            os.chown(path, uid if valid & FATTR_UID else -1, gid if valid & FATTR_GID else -1)
        if valid & (FATTR_ATIME | FATTR_MTIME):
            st = os.lstat(path)
            now = time.time_ns()
            a = (now if valid & FATTR_ATIME_NOW else atime * 10**9 + atimens) \
                if valid & FATTR_ATIME else st.st_atime_ns
            m = (now if valid & FATTR_MTIME_NOW else mtime * 10**9 + mtimens) \
                if valid & FATTR_MTIME else st.st_mtime_ns
            os.utime(path, ns=(a, m))
        self._reply(unique, ATTR_OUT_HEAD.pack(TTL, 0, 0), self._attr(nodeid))

    def _open_node(self, ino: int, flags: int) -> bytes:
        """Open (and register) the backing file of ``ino``; returns the fuse_open_out."""
        node = self.nodes[ino]
        if node.fd < 0:
            # The daemon opens the backing file itself, read-write so that it can hash it;
            # the kernel opens its own backing file with the caller's flags from this one.
            node.fd = os.open(self.store / node.name, os.O_RDWR | os.O_CLOEXEC)
        writer = (flags & os.O_ACCMODE) != os.O_RDONLY
        if flags & os.O_TRUNC and writer:
            os.ftruncate(node.fd, 0)  # atomic_o_trunc: the kernel leaves it to us
        open_flags, backing_id = 0, 0
        if self.passthrough:
            if node.backing_id == 0:
                m = bytearray(BACKING_MAP.pack(node.fd, 0, 0))
                node.backing_id = fcntl.ioctl(self.dev, IOC_BACKING_OPEN, m, True)
            open_flags, backing_id = FOPEN_PASSTHROUGH, node.backing_id
        node.opens += 1
        if writer:
            node.writers += 1
            node.written = True
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = Handle(ino, writer)
        return OPEN_OUT.pack(fh, open_flags, backing_id)

    def op_open(self, unique: int, nodeid: int, arg: memoryview) -> None:
        flags, _ = OPEN_IN.unpack_from(arg)
        if nodeid not in self.nodes:
            raise ReplyError(errno.EISDIR if nodeid == ROOT else errno.ENOENT)
        self._reply(unique, self._open_node(nodeid, flags))

    def op_create(self, unique: int, nodeid: int, arg: memoryview) -> None:
        flags, mode, umask, _ = CREATE_IN.unpack_from(arg)
        if nodeid != ROOT:
            raise ReplyError(errno.ENOTDIR)
        name = self._name(arg[CREATE_IN.size:])
        cflags = os.O_CREAT | (flags & os.O_EXCL)
        fd = os.open(self.store / name, os.O_RDWR | cflags | os.O_CLOEXEC, mode & ~umask & 0o7777)
        os.close(fd)
        entry = self._entry(name)
        ino = ENTRY_OUT_HEAD.unpack_from(entry)[0]
        self._reply(unique, entry, self._open_node(ino, flags))

    def op_read(self, unique: int, _nodeid: int, arg: memoryview) -> None:
        fh, off, size, *_ = RW_IN.unpack_from(arg)  # only without passthrough
        self._reply(unique, os.pread(self.nodes[self.handles[fh].ino].fd, size, off))

    def op_write(self, unique: int, _nodeid: int, arg: memoryview) -> None:
        fh, off, size, *_ = RW_IN.unpack_from(arg)  # only without passthrough
        data = arg[RW_IN.size:RW_IN.size + size]
        n = os.pwrite(self.nodes[self.handles[fh].ino].fd, data, off)
        self._reply(unique, WRITE_OUT.pack(n, 0))

    def op_flush(self, unique: int, _nodeid: int, _arg: memoryview) -> None:
        self._reply(unique)

    def op_fsync(self, unique: int, _nodeid: int, arg: memoryview) -> None:
        (fh,) = struct.unpack_from("<Q", arg)
        h = self.handles.get(fh)
        if h is not None:
            os.fsync(self.nodes[h.ino].fd)
        self._reply(unique)

    def op_release(self, unique: int, _nodeid: int, arg: memoryview) -> None:
        t_release = time.monotonic()
        fh, *_ = RELEASE_IN.unpack_from(arg)
        self._reply(unique)  # close(2) does not wait for RELEASE anyway
        h = self.handles.pop(fh, None)
        if h is None:
            return
        node = self.nodes[h.ino]
        node.opens -= 1
        if h.writer:
            node.writers -= 1
        if node.writers == 0 and node.written:
            node.written = False
            self._start_seal(node, t_release)
        if node.opens == 0:
            if node.backing_id:
                fcntl.ioctl(self.dev, IOC_BACKING_CLOSE, struct.pack("<I", node.backing_id))
                node.backing_id = 0
            os.close(node.fd)  # the seal thread works on its own duplicate
            node.fd = -1
            if node.nlookup <= 0:
                del self.nodes[h.ino]

    def _start_seal(self, node: Node, t_release: float) -> None:
        """Hash the store file in a thread (the loop keeps answering); record the seal."""
        fd = os.dup(node.fd)
        name = node.name

        def seal() -> None:
            try:
                t0 = time.monotonic()
                size = os.fstat(fd).st_size
                res = hash_fd(fd, size, CHUNK, whole=True)
                t1 = time.monotonic()
                rec = {"name": name, "size": size, "blake3": res.file_hash,
                       "chunks": len(res.chunks), "released": t_release,
                       "hash_start": t0, "sealed": t1, "hash_s": t1 - t0}
            except OSError as e:
                rec = {"name": name, "error": str(e), "released": t_release}
            finally:
                os.close(fd)
            with self.seal_lock, open(self.state / "seals.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")

        t = threading.Thread(target=seal, name=f"seal-{name}", daemon=True)
        self.seal_threads = [x for x in self.seal_threads if x.is_alive()] + [t]
        t.start()

    def op_unlink(self, unique: int, nodeid: int, arg: memoryview) -> None:
        if nodeid != ROOT:
            raise ReplyError(errno.ENOTDIR)
        os.unlink(self.store / self._name(arg))
        self._reply(unique)

    def op_statfs(self, unique: int, _nodeid: int, _arg: memoryview) -> None:
        s = os.statvfs(self.store)
        self._reply(unique, STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files,
                                            s.f_ffree, s.f_bsize, s.f_namemax, s.f_frsize, 0))

    def op_opendir(self, unique: int, nodeid: int, _arg: memoryview) -> None:
        if nodeid != ROOT:
            raise ReplyError(errno.ENOTDIR)
        self._reply(unique, OPEN_OUT.pack(0, 0, 0))

    def op_readdir(self, unique: int, _nodeid: int, arg: memoryview) -> None:
        _fh, off, size, *_ = RW_IN.unpack_from(arg)
        out = bytearray()
        names = sorted(e.name for e in os.scandir(self.store) if e.is_file(follow_symlinks=False))
        for i, name in enumerate(names[off:], start=off + 1):
            raw = os.fsencode(name)
            rec = DIRENT_HEAD.pack(os.lstat(self.store / name).st_ino, i, len(raw), 8) + raw
            rec += b"\0" * (-len(rec) % 8)
            if len(out) + len(rec) > size:
                break
            out += rec
        self._reply(unique, bytes(out))

    def op_ok(self, unique: int, _nodeid: int, _arg: memoryview) -> None:
        self._reply(unique)  # RELEASEDIR, FSYNCDIR

    def op_enosys(self, unique: int, _nodeid: int, _arg: memoryview) -> None:
        raise ReplyError(errno.ENOSYS)  # xattrs, ACCESS: the kernel stops asking

    def op_getxattr(self, unique: int, nodeid: int, arg: memoryview) -> None:
        raise ReplyError(errno.ENODATA if self.xattrs else errno.ENOSYS)

    HANDLERS = {
        INIT: op_init, DESTROY: op_destroy, LOOKUP: op_lookup, FORGET: op_forget,
        BATCH_FORGET: op_batch_forget, GETATTR: op_getattr, SETATTR: op_setattr,
        OPEN: op_open, CREATE: op_create, READ: op_read, WRITE: op_write, FLUSH: op_flush,
        FSYNC: op_fsync, RELEASE: op_release, UNLINK: op_unlink, STATFS: op_statfs,
        OPENDIR: op_opendir, READDIR: op_readdir, RELEASEDIR: op_ok, FSYNCDIR: op_ok,
        GETXATTR: op_getxattr, SETXATTR: op_enosys, LISTXATTR: op_enosys,
        REMOVEXATTR: op_enosys, ACCESS: op_enosys,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.passthrough_fs")
    p.add_argument("store", type=Path, help="directory on tmpfs holding the files")
    p.add_argument("mountpoint", type=Path)
    p.add_argument("state", type=Path, help="directory for seals.jsonl")
    p.add_argument("--no-passthrough", action="store_true",
                   help="serve READ/WRITE in this process instead")
    p.add_argument("--max-seconds", type=float, default=1800.0)
    p.add_argument("--writeback-cache", action="store_true",
                   help="also ask for the writeback cache (to see what the kernel does)")
    p.add_argument("--xattrs", action="store_true",
                   help="answer GETXATTR with ENODATA (a filesystem with xattrs), not ENOSYS")
    p.add_argument("--killpriv-v2", action="store_true",
                   help="ask for FUSE_HANDLE_KILLPRIV_V2 at INIT (no GETXATTR before writes)")
    a = p.parse_args(argv)
    srv = Server(a.store.resolve(), a.mountpoint.resolve(), a.state.resolve(),
                 passthrough=not a.no_passthrough, max_seconds=a.max_seconds,
                 writeback_cache=a.writeback_cache, xattrs=a.xattrs,
                 killpriv_v2=a.killpriv_v2)

    def on_signal(_sig: int, _frame: object) -> None:
        srv.stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    srv.mount()
    try:
        ready = threading.Thread(target=_announce_ready, args=(srv,), daemon=True)
        ready.start()
        srv.serve()
    finally:
        srv.shutdown()
        (a.state / "counts.json").write_text(json.dumps(
            {"kernel_minor": srv.kernel_minor, "requests_by_opcode": srv.counts}))


def _announce_ready(srv: Server) -> None:
    """Print ``ready`` once INIT is answered (the mount then accepts I/O)."""
    deadline = time.monotonic() + 30
    while not srv.initialized and time.monotonic() < deadline and not srv.stop:
        # INIT is the kernel's first request; a stat from here makes sure it was sent.
        time.sleep(0.01)
    print("ready" if srv.initialized else "no INIT", flush=True)


if __name__ == "__main__":
    main()
