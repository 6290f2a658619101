"""The sweep journal: how uploaders on other nodes learn what a chunk sweep deleted.

Why it exists
-------------
In a multi-node job every rank may run retention, and a sweep on one node can overlap an
upload on another. Two things can then go wrong for the uploader, whose in-memory
:class:`~replication.backup.chunk_index.ChunkIndex` says which chunks the bucket holds:

* **A stale index.** The uploader believes chunk X is stored (it uploaded X weeks ago), but a
  sweep elsewhere deleted X since, when no kept manifest referenced it. A new step that
  contains X again would skip it and be marked COMPLETE without it.
* **A sweep in flight.** The sweeper read the manifests before the uploader wrote its intent
  manifest, so it does not know the new step needs X, and deletes X after the uploader
  decided to skip it.

The intent manifest alone (see :mod:`replication.backup.retention`) narrows the second case
but cannot close it, and does nothing for the first. There is no grace period on
unreferenced chunks that would help: X may have been unreferenced for a long time.

The protocol (multi-node stores, ``rank`` set)
----------------------------------------------
A **sweeper**:

1. writes its record ``sweeps/<started_ns>-<rank>-<token>.json`` with ``done: false`` and a
   ``deadline_ns`` (start + :data:`SWEEP_DEADLINE_S`), *before* it lists or reads any
   manifest;
2. reads every manifest, lists ``chunks/`` and deletes the unreferenced chunks, but only
   while its own clock is before the deadline;
3. rewrites the record with ``done: true`` and the list of digests it deleted;
4. deletes records that started more than :data:`JOURNAL_KEEP_S` ago.

An **uploader** (:class:`SweepTracker`) remembers which records it has applied. Each
:meth:`SweepTracker.sync` lists ``sweeps/``, reads the records it has not applied yet, drops
every digest a finished sweep deleted from its index, and returns the sweeps still running.
:meth:`~replication.backup.chunk_store.BackupStore.put_step` writes its intent manifest,
syncs, uploads what its index lacks, then syncs again until no sweep is running and its
index lacks none of the step's chunks (uploading the ones sweeps deleted meanwhile) and only
then writes ``COMPLETE``.

Why this is enough: a sweep that deletes X without having seen the uploader's manifest read
the manifests before that manifest was written, so its record was written before it too, and
the uploader's final sync (after its manifest) lists that record. The uploader then waits
for that sweep to finish and learns from its record that X is gone. A sweep whose record
appears only after the uploader's final sync reads the manifests after it, sees the
uploader's manifest and keeps X.

Crashed sweepers and old records: a record still ``done: false`` when the uploader's clock
is :data:`DEADLINE_SLACK_S` past its deadline is taken as a crashed sweep whose deletions are
unknown, and the uploader lists ``chunks/`` again. So does an uploader that has not synced
for ``JOURNAL_KEEP_S / 2`` (records it never saw may have been pruned), and one whose open
record vanished. Clocks of the nodes must agree to within :data:`DEADLINE_SLACK_S`.
A sweeper that could not record its end (the bucket failed just then) keeps the finished
record and writes it again at each of its own syncs until that succeeds, so the others wait
until its next upload after the outage, not until the deadline.

The residual window: a sweeper whose delete request is stuck in retries past its deadline
plus the slack. Keep the retry deadline of the backend below :data:`DEADLINE_SLACK_S`.

Costs: a sweep writes two small records (plus 64 bytes per deleted chunk); an upload lists
``sweeps/`` (a handful of records: they live one day and only sweeps that found garbage
write one) at least twice, and reads each record once.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from replication.backup.backend import Backend
from replication.backup.chunk_index import ChunkIndex
from replication.backup.errors import BackupError, NotFound
from replication.backup.layout import SWEEPS_PREFIX, check_hash, parse_sweep_key, sweep_key

log = logging.getLogger(__name__)

#: Format of a sweep record's JSON.
RECORD_FORMAT = 1
#: A sweeper deletes chunks only during this many seconds after it started.
SWEEP_DEADLINE_S = 900.0
#: An unfinished record counts as a crashed sweep this many seconds after its deadline.
DEADLINE_SLACK_S = 300.0
#: Records are pruned this many seconds after their sweep started.
JOURNAL_KEEP_S = 24 * 3600.0


@dataclass(frozen=True)
class SweepRecord:
    """One sweep, as its journal record describes it.

    Attributes:
        key: the record's object name.
        rank: the rank that swept.
        started_ns: when it began, ns since the epoch (the sweeper's clock).
        deadline_ns: after this (sweeper's clock) it deleted nothing more.
        done: whether it finished and listed its deletions.
        finished_ns: when it finished, ns since the epoch (0 while running).
        deleted: hex digests of the chunks it deleted (empty while running).
    """

    key: str
    rank: int
    started_ns: int
    deadline_ns: int
    done: bool = False
    finished_ns: int = 0
    deleted: tuple[str, ...] = field(default=(), repr=False)

    def to_bytes(self) -> bytes:
        return json.dumps({
            "format": RECORD_FORMAT, "rank": self.rank, "started_ns": self.started_ns,
            "deadline_ns": self.deadline_ns, "done": self.done,
            "finished_ns": self.finished_ns, "deleted": list(self.deleted),
        }, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, key: str, raw: bytes) -> "SweepRecord":
        """Parse a record.

        Raises:
            ValueError: if it is not a record of this format (bad JSON, a missing field, a
                bad digest).
        """
        try:
            d = json.loads(raw)
            if d.get("format") != RECORD_FORMAT:
                raise ValueError(f"format {d.get('format')!r}")
            return cls(key=key, rank=int(d["rank"]), started_ns=int(d["started_ns"]),
                       deadline_ns=int(d["deadline_ns"]), done=bool(d["done"]),
                       finished_ns=int(d.get("finished_ns", 0)),
                       deleted=tuple(check_hash(h) for h in d.get("deleted", ())))
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad sweep record {key}: {exc}") from exc


class SweepJournal:
    """Reads and writes the records under ``sweeps/``.

    Args:
        backend: where they are.
    """

    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()
        #: This process's sweeps whose end could not be recorded (the backend failed):
        #: key -> the finished record, written again by :meth:`finish_pending`.
        self._unrecorded: dict[str, SweepRecord] = {}

    def keys(self) -> set[str]:
        """Names of the records there now (one listing). Raises BackupError on failure."""
        return {k for k in self._backend.list(SWEEPS_PREFIX) if parse_sweep_key(k) is not None}

    def read(self, key: str) -> SweepRecord | None:
        """Read one record; None if it is gone.

        An unreadable record is returned as an unfinished one whose deadline has long passed
        (so a reader treats its deletions as unknown), and logged.

        Raises:
            BackupError: if the backend fails.
        """
        try:
            raw = self._backend.get(key)
        except NotFound:
            return None
        try:
            return SweepRecord.from_bytes(key, raw)
        except ValueError as exc:
            log.warning("unreadable sweep record in %s: %s", self._backend.describe(), exc)
            return SweepRecord(key=key, rank=0, started_ns=0, deadline_ns=0)

    def begin(self, rank: int, now_ns: int, deadline_s: float = SWEEP_DEADLINE_S
              ) -> SweepRecord:
        """Write the record of a sweep starting now; return it.

        Args:
            rank: the sweeping rank.
            now_ns: now, ns since the epoch.
            deadline_s: seconds the sweep may delete chunks.

        Raises:
            BackupError: if the backend fails (then the sweep must not delete anything).
        """
        rec = SweepRecord(key=sweep_key(now_ns, rank, secrets.token_hex(6)), rank=rank,
                          started_ns=now_ns, deadline_ns=now_ns + int(deadline_s * 1e9))
        self._backend.put(rec.key, rec.to_bytes())
        return rec

    def finish(self, rec: SweepRecord, deleted: Iterable[str], now_ns: int) -> SweepRecord:
        """Rewrite a sweep's record as finished, listing the hex digests it deleted.

        Raises:
            BackupError: if the backend fails (readers then take the sweep for a crashed
                one once its deadline is past).
        """
        done = SweepRecord(key=rec.key, rank=rec.rank, started_ns=rec.started_ns,
                           deadline_ns=rec.deadline_ns, done=True, finished_ns=now_ns,
                           deleted=tuple(deleted))
        try:
            self._backend.put(done.key, done.to_bytes())
        except BackupError:
            with self._lock:  # written again by finish_pending(), at this node's next sync
                self._unrecorded[done.key] = done
            raise
        return done

    def finish_pending(self) -> int:
        """Record again the ends of this process's sweeps that :meth:`finish` could not
        record (a backend outage at the end of a sweep). Until then every other node's
        uploader waits for the sweep (up to its deadline plus the slack, 20 minutes by
        default); this runs at every :meth:`SweepTracker.sync` of this node, so the wait
        ends with this node's next upload after the outage. Returns how many are still
        unrecorded; backend errors are logged, not raised.
        """
        with self._lock:
            todo = list(self._unrecorded.values())
        for done in todo:
            try:
                self._backend.put(done.key, done.to_bytes())
            except BackupError as exc:
                log.warning("still cannot record the end of sweep %s in %s: %s", done.key,
                            self._backend.describe(), exc)
                continue
            log.info("recorded the end of sweep %s in %s after all", done.key,
                     self._backend.describe())
            with self._lock:
                self._unrecorded.pop(done.key, None)
        with self._lock:
            return len(self._unrecorded)

    def prune(self, now_ns: int, keep_s: float = JOURNAL_KEEP_S) -> int:
        """Delete records of sweeps that started more than ``keep_s`` ago; return how many.

        Raises:
            BackupError: if the backend fails.
        """
        limit = now_ns - int(keep_s * 1e9)
        old = [k for k in self.keys() if (parse_sweep_key(k) or 0) < limit]
        for k in old:
            self._backend.delete(k)
        return len(old)


class SweepTracker:
    """The uploader's side: keeps a :class:`ChunkIndex` true to sweeps run elsewhere.

    Thread-safe; :meth:`sync` calls are serialized.

    Args:
        journal: the journal of the bucket.
        index: the index to correct.
        clock_ns: wall clock, ns since the epoch (compared with sweepers' deadlines).
        monotonic: seconds, for the age of the last sync.
    """

    def __init__(self, journal: SweepJournal, index: ChunkIndex, *,
                 clock_ns: Callable[[], int] = time.time_ns,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._journal = journal
        self._index = index
        self._clock_ns = clock_ns
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._applied: set[str] = set()          # finished (or written off) records
        self._running: dict[str, SweepRecord] = {}  # records seen unfinished
        self._last_sync: float | None = None
        self.reloads = 0                         # full listings of chunks/ (for stats)

    def applied(self, key: str) -> None:
        """Record that this process's own sweep ``key`` is already reflected in the index."""
        with self._lock:
            self._applied.add(key)
            self._running.pop(key, None)

    def _expired(self, rec: SweepRecord) -> bool:
        return self._clock_ns() > rec.deadline_ns + int(DEADLINE_SLACK_S * 1e9)

    def _restart(self) -> list[SweepRecord]:
        """Read the whole journal, then list ``chunks/`` again: every sweep finished before
        the listing is reflected in it."""
        applied: set[str] = set()
        running: dict[str, SweepRecord] = {}
        for key in self._journal.keys():
            rec = self._journal.read(key)
            if rec is None:
                continue
            if rec.done or self._expired(rec):
                applied.add(key)
            else:
                running[key] = rec
        self._index.reset()
        self._index.load()
        self.reloads += 1
        self._applied, self._running = applied, running
        self._last_sync = self._monotonic()
        return list(running.values())

    def sync(self) -> list[SweepRecord]:
        """Apply the sweeps that finished since the last call; return those still running.

        The first call (and one after more than ``JOURNAL_KEEP_S / 2`` s without a call, or
        after a crashed sweep) lists ``chunks/`` again instead.

        Raises:
            BackupError: if the backend fails.
        """
        self._journal.finish_pending()  # our own sweeps others may be waiting for
        with self._lock:
            if self._last_sync is None or \
                    self._monotonic() - self._last_sync > JOURNAL_KEEP_S / 2:
                return self._restart()
            keys = self._journal.keys()
            if any(k not in keys for k in self._running):
                log.info("a running sweep's record vanished; listing chunks again")
                return self._restart()
            forgot = 0
            for key in sorted(keys - self._applied):
                rec = self._journal.read(key)
                if rec is None:
                    if key in self._running:
                        return self._restart()
                    continue
                if rec.done:
                    for h in rec.deleted:
                        self._index.forget(bytes.fromhex(h))
                    forgot += len(rec.deleted)
                    self._applied.add(key)
                    self._running.pop(key, None)
                elif self._expired(rec):
                    log.warning("sweep %s never finished; its deletions are unknown, listing "
                                "chunks again", key)
                    return self._restart()
                else:
                    self._running[key] = rec
            if forgot:
                log.debug("applied sweeps of other nodes: %d chunks are gone", forgot)
            self._last_sync = self._monotonic()
            return list(self._running.values())
