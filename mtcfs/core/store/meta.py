"""Crash-safe metadata of the RAM tier: one SQLite database in the store directory.

Every namespace change is one transaction, so a ``kill -9`` of the daemon at any moment
leaves a consistent namespace (SQLite WAL; the store is on tmpfs, so durability against a
process crash is what matters, not against power loss). File sizes of versions still being
written are recorded only on seal and fsync; recovery takes the data file's length instead
(see :meth:`mtcfs.core.store.Store.recover`). So are the times the kernel's writeback cache
sends for a file being written (a SETATTR of times only, at every close): the seal's
transaction writes them with the inode's row; a crash before it keeps the times of the
inode's last committed row. Which chunks a rewrite of a sealed file changed is the exception:
each is committed (table ``rewrite_dirty``) before its bytes change, so that a crash's reseal
hashes only those. A row written several times in one transaction is written once,
at its commit (:meth:`MetaDB.defer`).

The schema below is the canonical description of the on-disk metadata; every column's
meaning and sentinel values are commented there.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from collections.abc import Callable, Hashable
from typing import Any

from mtcfs.base.errors import StoreFull

#: 2: inodes.rdev and kind 'special' (FIFOs, sockets, device nodes); a version-1 store
#: gains the column at open (migrated in place, every existing inode rdev 0).
SCHEMA_VERSION = 2

#: Bytes of the store's filesystem kept for the metadata (SQLite's WAL frames and the pages
#: a checkpoint adds): an op that adds to the namespace is refused (ENOSPC, before anything
#: changes) when less is free, so that its commit does not fail half way (docs/reliability.md,
#: "The store's filesystem full"); ops that only remove or change (unlink, rmdir, setattr)
#: may use the reserve, so room can always be freed.
META_RESERVE_BYTES = 2 << 20
#: Bytes an op that may use the reserve still needs free to be tried: below it (a
#: filesystem another process filled to its last byte) its commit can fail with SQLITE_FULL
#: after the namespace in memory changed, so it is refused (ENOSPC) like the others.
META_FLOOR_BYTES = 256 << 10

SCHEMA = """
-- One row per inode. kind: 'file' | 'dir' | 'symlink' | 'special' (a FIFO, socket or
--   device node: metadata only, the type in mode's S_IFMT bits; schema 2).
-- vid: current version of a file (NULL for dirs, symlinks and special files).
-- parent/name: for dirs, THE parent dentry; for files, the most recent link (used only to
--   compute a path for manifests and step detection; hard links live in dentries).
CREATE TABLE IF NOT EXISTS inodes (
    ino       INTEGER PRIMARY KEY,
    kind      TEXT NOT NULL,
    mode      INTEGER NOT NULL,          -- full st_mode incl. S_IFMT bits
    uid       INTEGER NOT NULL,
    gid       INTEGER NOT NULL,
    nlink     INTEGER NOT NULL,
    atime_ns  INTEGER NOT NULL,
    mtime_ns  INTEGER NOT NULL,
    ctime_ns  INTEGER NOT NULL,
    target    BLOB,                      -- symlink target, NULL otherwise
    vid       INTEGER,
    parent    INTEGER,                   -- 0 for the root and for unlinked inodes
    name      BLOB,
    rdev      INTEGER NOT NULL DEFAULT 0 -- device number of a device node (schema 2)
);
-- Directory entries. The root is ino 1 and has no entry.
CREATE TABLE IF NOT EXISTS dentries (
    parent INTEGER NOT NULL,
    name   BLOB NOT NULL,
    ino    INTEGER NOT NULL,
    PRIMARY KEY (parent, name)
);
CREATE INDEX IF NOT EXISTS dentries_ino ON dentries(ino);
-- File versions. A version is 'open' (sealed=0) while written, then sealed: chunks is the
-- space-separated list of hex blake3 chunk digests, blake3 the whole-file digest.
-- missing: space-separated chunk indices whose bytes are not in the data file yet
--   (a restored or evicted version); '' when the data file is complete.
-- backed_up: 1 once a backup containing this version completed.
-- origin: scope=job, the rank that wrote it (-1: this node; added in place).
-- base_chunks: an open version rewriting a sealed one (no O_TRUNC, scope=node): the
--   space-separated chunk digests of the sealed content its data file started with (same
--   chunk_size); NULL otherwise (a new, truncated or sealed version, or a row from before
--   the column). With rewrite_dirty it lets a crash's reseal hash only the chunks changed
--   (core/versions.py: VersionStore.note_dirty; docs/architecture.md, issue 18). Added
--   in place, NULL in rows from before; an older mtcfs ignores it and its first write of
--   the row (at its load) sets it back to NULL.
CREATE TABLE IF NOT EXISTS versions (
    vid        INTEGER PRIMARY KEY,
    ino        INTEGER NOT NULL,
    size       INTEGER NOT NULL,
    chunk_size INTEGER NOT NULL,
    sealed     INTEGER NOT NULL DEFAULT 0,
    chunks     TEXT NOT NULL DEFAULT '',
    blake3     TEXT NOT NULL DEFAULT '',
    missing    TEXT NOT NULL DEFAULT '',
    backed_up  INTEGER NOT NULL DEFAULT 0
);
-- Chunks a rewrite changed: (vid, idx) for every chunk idx < the number of base_chunks
--   of open version vid that a write or resize touched, committed BEFORE any byte of that
--   chunk in the data file changes (so a crash never leaves a changed chunk that is not
--   listed: its base digest would be stale). Read at load only for a row whose
--   base_chunks is not NULL; rows of any other vid are leftovers (removed at load): an
--   extra row only makes a chunk hashed again. Deleted when the version is sealed.
CREATE TABLE IF NOT EXISTS rewrite_dirty (
    vid INTEGER NOT NULL,
    idx INTEGER NOT NULL,
    PRIMARY KEY (vid, idx)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS xattrs (
    ino   INTEGER NOT NULL,
    name  BLOB NOT NULL,
    value BLOB NOT NULL,
    PRIMARY KEY (ino, name)
);
-- Checkpoints (steps): top-level directories the libraries committed.
-- state: 'committed' (complete on this node). backed_up_ns: NULL until a backup of this
-- step completed. source: what committed it ('orbax-rename', 'commit_success.txt',
-- '.metadata', 'mtcfs seal', 'restore').
CREATE TABLE IF NOT EXISTS steps (
    name         TEXT PRIMARY KEY,
    number       INTEGER NOT NULL,
    ino          INTEGER NOT NULL,
    committed_ns INTEGER NOT NULL,
    backed_up_ns INTEGER,
    source       TEXT NOT NULL
);
-- Small settings: schema_version, next_ino, next_vid, job, chunk_size.
CREATE TABLE IF NOT EXISTS kv (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def _raise_if_full(exc: sqlite3.Error) -> None:
    """Raise SQLITE_FULL (the store's filesystem has no room for the database or its WAL)
    as the writer should see it: OSError ENOSPC, which the FUSE adapter passes on. Returns
    for any other error (the caller re-raises it)."""
    if getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        raise OSError(errno.ENOSPC, f"store metadata: {exc}") from exc


class NewerSchemaError(Exception):
    """The metadata was written by a newer mtcfs (its ``schema_version`` is above
    :data:`SCHEMA_VERSION`); nothing in the file was changed."""


def _stored_schema_version(conn: sqlite3.Connection) -> int | None:
    """The ``schema_version`` a store's metadata records, or None (a new or empty file)."""
    has_kv = conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='kv'"
                          ).fetchone()
    if not has_kv:
        return None
    row = conn.execute("SELECT value FROM kv WHERE key='schema_version'").fetchone()
    return int(row[0]) if row else None


class _Transaction:
    """:meth:`MetaDB.transaction`'s context manager (one per connection, reentrant)."""

    __slots__ = ("_db",)

    def __init__(self, db: MetaDB) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db._enter()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: Any) -> bool:
        self._db._exit(exc_type is not None)
        return False


class MetaDB:
    """Thin wrapper around the SQLite connection; used only from the FUSE loop's thread.

    Args:
        path: database file, created if missing.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        #: the directory whose filesystem :meth:`ensure_room` measures (once, not per op)
        self._dir = os.path.dirname(os.path.abspath(path))
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        stored = _stored_schema_version(self.conn)
        if stored is not None and stored > SCHEMA_VERSION:
            # Before any statement that writes: a downgrade must leave the store as it was.
            self.conn.close()
            raise NewerSchemaError(
                f"its metadata is schema {stored}, written by a newer mtcfs (this one reads "
                f"schema {SCHEMA_VERSION} and older); nothing was changed: run the newer "
                "mtcfs, or give another store=")
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.executescript(SCHEMA)
        cols = {r[1] for r in self.conn.execute("PRAGMA table_info(versions)")}
        if "origin" not in cols:  # scope=job: the rank that wrote a version (-1: this node)
            self.conn.execute("ALTER TABLE versions ADD COLUMN origin INTEGER NOT NULL DEFAULT -1")
        if "base_chunks" not in cols:  # rewrites: the base a crash's reseal starts from
            self.conn.execute("ALTER TABLE versions ADD COLUMN base_chunks TEXT")
        cols = {r[1] for r in self.conn.execute("PRAGMA table_info(inodes)")}
        if "rdev" not in cols:  # schema 1 -> 2: special files
            self.conn.execute("ALTER TABLE inodes ADD COLUMN rdev INTEGER NOT NULL DEFAULT 0")
        self._depth = 0
        self._begun = False  # BEGIN sent in the transaction in progress
        self._deferred: dict[Hashable, Callable[[], None]] = {}
        self._after_commit: list[Callable[[], None]] = []
        self._txn = _Transaction(self)
        version = self.get_kv("schema_version")
        if version is None or int(version) < SCHEMA_VERSION:
            self.set_kv("schema_version", str(SCHEMA_VERSION))

    def close(self) -> None:
        self.conn.close()

    def transaction(self) -> _Transaction:
        """Group statements into one atomic transaction (nests: only the outer one commits).

        ``BEGIN`` is sent with the first statement, so a transaction in which nothing is
        written costs no round of SQLite (one connection, used from one thread: a read
        before that statement sees the same rows it would inside). Writes given to
        :meth:`defer` run at the outer commit, before ``COMMIT``.

        A context manager object of this connection's (reused, no state of its own: the
        depth is the connection's), not a generator: every namespace op enters two or three
        of them, nested (docs/benchmarks.md, issue 18).
        """
        return self._txn

    def _enter(self) -> None:
        self._depth += 1

    def _exit(self, failed: bool) -> None:
        if not failed and self._depth == 1 and self._deferred:
            try:
                self._run_deferred()
            except BaseException:
                self._abort()
                raise
        if failed:
            self._abort()
            return
        self._depth -= 1
        if self._depth == 0:
            if self._begun:
                self._begun = False
                try:
                    self.conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    # Nothing of the transaction is written (SQLite rolls back by itself on
                    # SQLITE_FULL or an I/O error; else here): what waits for its commit
                    # must not happen either. Kept, it ran at the next commit: a data file
                    # unlinked while the row that names it, never deleted, still did.
                    self._after_commit.clear()
                    self._deferred.clear()
                    self._rollback_if_open()
                    _raise_if_full(exc)
                    raise
            todo, self._after_commit = self._after_commit, []
            for fn in todo:
                fn()

    def _rollback_if_open(self) -> None:
        if self.conn.in_transaction:
            try:
                self.conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass  # (already rolled back by SQLite)

    def _abort(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._deferred.clear()
            self._after_commit.clear()  # what the rows still name stays
            if self._begun:
                self._begun = False
                # SQLite may have rolled back by itself (a statement that failed with
                # SQLITE_FULL): a ROLLBACK then fails and would hide the first error.
                self._rollback_if_open()

    @property
    def in_transaction(self) -> bool:
        """Whether a :meth:`transaction` is in progress (what is written now commits at
        its end, not before)."""
        return self._depth > 0

    def _begin(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")
        self._begun = True

    def _run_deferred(self) -> None:
        while self._deferred:
            todo, self._deferred = self._deferred, {}
            for fn in todo.values():
                fn()

    def defer(self, key: Hashable, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a row write) once at the outer commit of the transaction in
        progress, before ``COMMIT``; a later ``defer`` of the same ``key`` in the same
        transaction replaces it (a row written several times in one op is written once,
        as it is at the commit). Outside a transaction ``fn`` runs at once. Discarded on
        rollback."""
        if self._depth == 0:
            fn()
        else:
            self._deferred[key] = fn

    def cancel(self, key: Hashable) -> None:
        """Drop the deferred write ``key`` (its row is deleted in this transaction)."""
        self._deferred.pop(key, None)

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the transaction in progress has committed (at once outside one).

        For what must not happen before the rows that name it are gone: a data file is
        unlinked only after its version's row is deleted for good, so a crash between the
        two leaves an orphan file (removed at the next load), never a row without its file.
        """
        if self._depth == 0:
            fn()
        else:
            self._after_commit.append(fn)

    def execute(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> sqlite3.Cursor:
        """Run ``sql`` (in the transaction in progress, begun with its first statement).

        Raises:
            OSError: ENOSPC when the store's filesystem has no room for it (SQLITE_FULL).
            sqlite3.Error: any other failure.
        """
        if self._depth and not self._begun:
            self._begin()
        try:
            return self.conn.execute(sql, params)
        except sqlite3.Error as exc:
            _raise_if_full(exc)
            raise

    def ensure_room(self, what: str, need: int = META_RESERVE_BYTES) -> None:
        """Raise unless the filesystem of the database has ``need`` bytes free.

        Args:
            what: the operation, for the message.
            need: bytes: :data:`META_RESERVE_BYTES`, or :data:`META_FLOOR_BYTES` for an op
                that may use the reserve.

        Raises:
            StoreFull: (an OSError, ENOSPC) one line naming ``what`` and the bytes free.
        """
        try:
            st = os.statvfs(self._dir)
        except OSError:
            return  # (cannot be measured: the commit will say)
        free = st.f_bavail * st.f_frsize
        if free < need:
            raise StoreFull(f"the store's filesystem has {free} bytes free, under the "
                            f"{need} kept for its metadata: {what} refused, "
                            "nothing changed")

    def get_kv(self, key: str) -> str | None:
        row = self.conn.execute("SELECT value FROM kv WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def set_kv(self, key: str, value: str) -> None:
        if self._depth and not self._begun:
            self._begin()
        self.conn.execute("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, value))
