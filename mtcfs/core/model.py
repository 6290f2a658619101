"""In-memory objects of the filesystem core: inodes, file versions, attributes.

The namespace is small (thousands of entries for even large checkpoints) so the core keeps
all of it in memory and writes every change through to SQLite (:mod:`mtcfs.core.store.meta`).
File *data* is never held here: it lives in the store's data files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import trio

ROOT_INO = 1

#: st_blksize reported for files: Python's buffered I/O sizes its buffer from it, and a
#: large buffer means fewer, larger FUSE requests (see library-fs-ops.md).
BLKSIZE = 1024 * 1024


@dataclass(eq=False)
class Version:
    """One version of a file's content, stored in data file ``<store>/data/<vid>``.

    A version is open (mutable) until the last writable handle is released, then sealed:
    hashed into ``chunks`` (hex blake3 per ``chunk_size`` bytes) and ``blake3`` (the whole
    file). Opening a sealed version for writing makes a new version (copy-on-write).

    Attributes:
        missing: indices of chunks whose bytes are not yet in the data file (restored from
            another tier, or evicted); reads of them wait for a fault-in.
        writers: open writable handles; handles: all open handles.
        pins: holders other than handles that need the data file to stay (a backup upload).
        gen: bumped on every modification; a seal whose hash ran while ``gen`` moved is
            discarded.
    """

    vid: int
    ino: int
    size: int
    chunk_size: int
    sealed: bool = False
    chunks: tuple[str, ...] = ()
    blake3: str = ""
    missing: set[int] = field(default_factory=set)
    backed_up: bool = False
    writers: int = 0
    handles: int = 0
    pins: int = 0
    gen: int = 0
    fd: int = -1
    current: bool = True
    sealing: trio.Event | None = None
    seal_error: str = ""
    #: the errno a close(2) reports for ``seal_error`` (0: EIO): ENOSPC when the store's
    #: filesystem had no room for the seal's rows or its publish
    seal_errno: int = 0
    #: scope=job: the rank that wrote this version (-1: this node); its data is faulted in
    #: from that rank and its replicas.
    origin: int = -1
    #: scope=job: its publish op is on its way (sealed, not yet known job-wide).
    publishing: bool = False
    #: Fetches of its missing chunks under way (core/fetcher.py: ``store_chunk``): one may
    #: still write a chunk that another already filled (the same bytes). Its data file is
    #: not taken over or copied for a writer until they end (``fill_done`` is set then).
    filling: int = 0
    fill_done: trio.Event | None = None
    #: Bytes its data file really holds in the store (st_blocks x 512, as last measured):
    #: what counts against size= (holes cost nothing). See ``RamBudget.account`` (core/budget.py).
    alloc: int = 0
    #: Freed while its seal was hashing (its pages given back at once); the seal drops its
    #: result.
    dropped: bool = False
    #: Open versions: the chunk digests of the sealed version whose data this one started
    #: with (same ``chunk_size``); None when unknown (a new or truncated file, or a row
    #: from before they were recorded): then its seal hashes every chunk.
    base_chunks: tuple[str, ...] | None = None
    #: With ``base_chunks``: indices of the chunks written or resized since; only these
    #: (and those past the end of ``base_chunks``) are hashed again at the seal
    #: (core/files.py, base/chunking.py: rehash_fd).
    dirty: set[int] = field(default_factory=set)
    #: The row holds ``base_chunks`` and table ``rewrite_dirty`` every index of ``dirty``
    #: below ``len(base_chunks)``, each committed before its bytes changed
    #: (core/versions.py: ``note_dirty``): a crash's reseal hashes only those. False once
    #: the base is dropped.
    base_logged: bool = False
    #: Set by a reopen for writing that waits for this closed version's seal: the hash
    #: stops at its next chunk and the chunks it finished become ``base_chunks`` (core/files.py:
    #: ``writable_version``); read by the hashing thread.
    stop_seal: bool = False
    #: The data file this version shares with others (a rewrite took it over while this
    #: or an older version was pinned; core/versions.py, "Shared data files"), or None.
    shared: SharedData | None = None
    #: A pinned, replaced version whose data file a newer version writes on: its chunks
    #: the writer changed since, each copied here (index -> bytes) before the change. Set
    #: (to a dict) before the writer changes a byte; read by reader threads after their
    #: ``pread`` (core/versions.py: ``read_data``). None for any other version.
    preserved: dict[int, bytes] | None = None
    #: Writable handles open in FUSE passthrough mode (core/passthrough.py): the kernel
    #: writes the data file itself, so its size and times are read from the data file
    #: while any is open (OpenFiles.sync_from_store), and nothing tracks dirty chunks.
    pt_writers: int = 0
    #: The data file's st_mtime_ns when last read by OpenFiles.sync_from_store (a change
    #: means the kernel wrote it since).
    pt_mtime: int = 0

    def touched(self, off: int, end: int) -> range:
        """The chunks that bytes ``[off, end)`` about to change (a write, or a resize from
        ``off`` to ``end`` or back; ``size`` not yet updated) touch, the gap between the
        old end and ``off`` included; empty without ``base_chunks``."""
        if self.base_chunks is None or off == end:
            return range(0)
        lo, hi = min(off, end), max(off, end)
        lo = min(lo, self.size) if hi > self.size else lo
        cs = self.chunk_size
        return range(lo // cs, (hi - 1) // cs + 1)

    def missing_bytes(self) -> int:
        cs = self.chunk_size
        return sum(max(0, min(cs, self.size - i * cs)) for i in self.missing)

    def local_bytes(self) -> int:
        """Bytes of this version held in the RAM tier."""
        return self.size - self.missing_bytes() if self.missing else self.size


@dataclass(eq=False)
class SharedData:
    """One data file that several versions of a file read (core/versions.py, "Shared
    data files"): ``writer``, the version whose bytes may still change (None once it
    left: freed, evicted or truncated to a file of its own), and ``readers``, older
    versions still pinned, oldest first, which read the file for every chunk not in their
    ``preserved`` copies. The writer copies a chunk into every reader that lacks it before
    it changes a byte of it: copy-before-write, as LVM's snapshots do per extent."""

    writer: Version | None
    readers: list[Version] = field(default_factory=list)


@dataclass(eq=False)
class Inode:
    """A file, directory, symlink or special file.

    ``kind`` is "file", "dir", "symlink" or "special": a FIFO, socket, character or block
    device node (the type is in ``mode``'s S_IFMT bits, the device number in ``rdev``). A
    special file is metadata only: the kernel serves its I/O (a pipe, a socket, a driver)
    and never sends it to the filesystem, so it has no version, no data and no chunks.

    Attributes:
        children: name -> ino, for directories only.
        parent, name: for directories the one parent entry; for files the latest link
            (to give a sealed version a path); 0/b"" when unlinked.
        lookups: the kernel's lookup count (FUSE nlookup); the inode is freed when it,
            ``nlink`` and its open handles all reach zero.
    """

    ino: int
    kind: str
    mode: int
    uid: int
    gid: int
    nlink: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    target: bytes = b""
    #: device number of a character or block device node (0 otherwise)
    rdev: int = 0
    vid: int | None = None
    parent: int = 0
    name: bytes = b""
    children: dict[bytes, int] | None = None
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    lookups: int = 0
    opens: int = 0
    #: of ``opens``, the handles the kernel serves itself (FUSE passthrough)
    pt_opens: int = 0
    #: the version served at the last open on this node (runtime; decides keep_cache)
    last_open_vid: int | None = None
    #: scope=job: the number the kernel knows this file by, when not ``ino`` (runtime). A
    #: file whose content another node replaced gets a new one, because with writeback
    #: cache the kernel never takes a cached inode's size from the filesystem again.
    kid: int = 0
    #: scope=job: the version last published job-wide (size, chunk_size, chunks, blake3,
    #: rank), which a snapshot carries while this node writes a newer one (runtime).
    published: dict | None = None

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"

    @property
    def is_file(self) -> bool:
        return self.kind == "file"


class Attr(NamedTuple):
    """Attributes the adapter reports (the fields of struct stat the kernel uses).

    Immutable. A named tuple, not a frozen dataclass: one is made for every lookup,
    getattr and directory entry, and a frozen dataclass's ``__init__`` costs about five
    times as much (docs/benchmarks.md, issue 18)."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blksize: int = BLKSIZE
    rdev: int = 0

    @property
    def blocks(self) -> int:
        return (self.size + 511) // 512


@dataclass
class Handle:
    """An open file handle (what FUSE calls fh)."""

    fh: int
    ino: int
    version: Version
    writable: bool
    append: bool = False
    #: close(2) of its last descriptor was seen (final FLUSH): its RELEASE is on its way.
    closed: bool = False
    #: The backing id the kernel reads and writes the data file by (FUSE passthrough,
    #: core/passthrough.py); 0: served by the daemon.
    backing_id: int = 0
    #: Opened FOPEN_DIRECT_IO (direct writes, mtcfs/direct_writes.py): its writes are not
    #: time-stamped (docs/usage.md, "Direct writes").
    direct: bool = False


@dataclass
class DirHandle:
    """An open directory: a snapshot of its entries taken at opendir, so that entries added
    or removed during a listing never make others skip or repeat."""

    fh: int
    ino: int
    entries: list[tuple[bytes, int]]
