"""The job's namespace log for scope=job, kept in etcd (``coord=etcd://...``).

etcd orders every namespace op; each node applies the ops in etcd's order to its own copy
(the same deterministic ``fs.ns_apply`` on every node), so every copy goes through the same
states. Nothing of the agreement is ours: no leader, no epochs, no quorum, no takeover.
etcd's Raft (Ongaro and Ousterhout, USENIX ATC 2014) decides the order and keeps it through
member failures; a node cut off from etcd cannot change the namespace (its calls wait, then
fail with EIO) and serves no read it cannot prove current. This is state-machine replication
over a shared log (Schneider, ACM Computing Surveys 1990), with etcd as the log.

Keys, under ``<prefix>`` (``/mtcfs/<job>/`` unless ``coord_prefix=``):

* ``ns/op/<rank>/<id>``: one op (JSON: the wire form of mtcfs/core/ns_ops.py), written once by
  the node that submits it in a transaction that also sets ``ns/last``: create-if-absent,
  so a retried submit never adds an op twice. Its create revision is its place in the order.
* ``ns/last``: the key of the newest op; its mod revision is the newest op's revision (the
  read barrier reads this one key). The watch covers it too, so a write to it by anyone
  else (a revision with no op) reaches every node like an op and never holds a read up.
* ``ns/base``: ``{"incarnation", "rev", "parts", "tag"}``: the namespace as it was after
  the op at revision ``rev``, a snapshot in ``parts`` keys ``ns/snap/<tag>/<i>``. Created
  once per keyspace by the first node that joins (``rev`` 0: its own namespace, or what it
  restored from the backup tier), then replaced every :data:`TRIM_OPS` ops by rank 0 (or
  any node when the log grew past four times that), which then deletes the ops up to
  ``rev``: the log in etcd stays bounded.

Position: a node's ``(epoch, seq)`` is ``(incarnation, revision of the last op applied)``.
A node whose epoch is not the keyspace's incarnation, or whose seq is older than the base
(it was away while the log was trimmed), installs the base; otherwise it applies the ops
after its seq.

Reads (``fresh``): before a lookup or open answers, the node reads ``ns/last`` from etcd
(linearizably; one read shared by the reads that wait at the same time) and waits until it
applied that op: close-to-open holds job-wide (docs/consistency.md), at the cost of one
round trip to etcd per read that the kernel does not answer from its cache. The wait is
for this node's watch to pass that revision (``_current``), whatever was written there.

Records read back are decoded strictly (mtcfs/tiers/namespace/records.py): a malformed op
is skipped by every node alike (its place in the order changes nothing) and reported
(untrusted.REJECTED, ``mtcfs status``); a malformed base or snapshot is refused with a
clear error (the node does not join, or keeps what it has); a malformed seeding candidate
is left out of the election.

etcd losing its data under a running job (a member restored from an old snapshot, a wiped
data directory) shows as its revision going below this node's: the node stops serving
(EIO, status says why) and joins again.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import itertools
import json
import logging
import os
import random
import threading
import time
from typing import Any

import trio

from mtcfs.base import pools, untrusted
from mtcfs.base.errors import FsError, StoreFull
from mtcfs.base.ns_ops import NsOp
from mtcfs.base.untrusted import BadRecord
from mtcfs.core.ports import NamespacePort
from mtcfs.tiers.coord.messages import pb
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdCompacted, EtcdError, EtcdPermissionDenied, EtcdUnavailable, WatchBatch, absent,
    delete_op, get_op, mod_is, prefix_end, put_op,
)
from mtcfs.tiers.namespace import records

log = logging.getLogger(__name__)

#: How long a submit keeps trying (etcd unreachable, or its op not yet applied here), and
#: a read waits for this node's copy to be current, before EIO (``coord_timeout=``).
DEADLINE_S = 60.0
#: Seconds a node may spend copying an open file's data another node removed.
KEEP_S = 4.0
#: Largest snapshot part (etcd refuses requests above 1.5 MiB by default).
PART_BYTES = 1024 * 1024
#: Results of ops applied here kept for their submitters.
RESULTS_KEPT = 50_000
#: Ops after which the log is folded into a new base and trimmed (the environment variable
#: is for tests, which trim after a few ops).
TRIM_OPS = int(os.environ.get("MTCFS_NS_TRIM_OPS", "20000"))
#: Ops read per request when catching up (a page of the log).
PAGE_OPS = 500
#: Seconds the nodes that join an empty keyspace wait for each other before the best of
#: those that came seeds it (all ``nodes`` there: no wait; a restarted job's nodes boot in
#: any order, and the one that lost its RAM tier must not impose an empty namespace).
SEED_WAIT_S = 10.0
#: Seconds between an idle node's checks that etcd did not lose data.
CHECK_S = 2.0
#: Seconds between tries of an op this node has no room for (its store's filesystem full)
ROOM_RETRY_S = 1.0
#: Seconds the best candidate to seed may take (its restore from the backup tier included)
#: before another node seeds instead, and the lease of a candidate record.
SEED_TAKEOVER_S = 150.0
CANDIDATE_TTL_S = 10
#: etcd calls of the namespace at once (their own thread pool: a slow etcd never takes the
#: threads the data path hashes and fetches with).
ETCD_THREADS = pools.POOLS["etcd"].size


class EtcdLost(EtcdError):
    """etcd's revision went below one this node already saw: etcd lost its data."""


class DamagedKeyspace(EtcdError):
    """A record of the namespace in etcd does not decode (a base, a snapshot): refused."""


#: Most seconds between restarts of the watch after failures that are not etcd's (a bug, a
#: record that made it raise): the first after 0.5 s, each next one after twice that.
RESTART_MAX_S = 10.0


class EtcdNamespace:
    """The ``ns_log`` of a scope=job core, with etcd as the log: a
    :class:`mtcfs.core.ns_log.NamespaceLog` whose ops are ordered job-wide.

    Args:
        fs: the filesystem core (``ns_apply``, ``ns_snapshot``, ``ns_install``,
            ``ns_position``, ``ns_set_position``, ``fault_in``).
        etcd: the job's etcd client.
        prefix: the job's key prefix (ends with ``/``).
        rank: this node's rank.
        seed: optional async callable run before this node seeds an empty keyspace with an
            empty namespace (the daemon restores the job's newest step from the backup
            tier there).
        timeout_s: how long a change or a read waits for etcd before EIO.
        nodes: the job's node count (who may seed an empty keyspace: :meth:`_seed`).
    """

    def __init__(self, fs: NamespacePort, etcd: Etcd, prefix: str, rank: int, seed: Any = None,
                 timeout_s: float = DEADLINE_S, nodes: int = 1) -> None:
        self.fs = fs
        self.nodes = nodes
        self.etcd = etcd
        self.rank = rank
        self.seed = seed
        self.timeout_s = timeout_s
        p = prefix.encode()
        self.op_prefix = p + b"ns/op/"
        self.last_key = p + b"ns/last"
        self.base_key = p + b"ns/base"
        self.snap_prefix = p + b"ns/snap/"
        self.cand_prefix = p + b"ns/seeders/"
        self.epoch, self.seq = fs.ns_position()
        # the etcd revision up to which this node applied every op (>= seq: revisions with
        # no op, such as a write to ns/last by someone else, count once the watch passed)
        self._current = self.seq
        self._refused: set[tuple[bytes, int]] = set()  # (key, mod revision) reported
        self.results: collections.OrderedDict[str, tuple[int | None, str, dict[str, Any]]] = \
            collections.OrderedDict()
        self.applied = trio.Event()
        self.limiter = pools.limiter("etcd")
        self._ids = itertools.count(1)
        self._boot = f"{time.time_ns():x}"
        self._watch_from = 0          # revision the watch resumes at
        self._seen_rev = 0            # highest store revision etcd reported
        self._base: dict[str, Any] = {}
        self._base_mod = 0            # mod revision of ns/base as last read
        self._base_create = 0         # its create revision: the keyspace's identity
        self._since_base = 0          # ops applied after the base this node knows
        self._barrier_running: Any = None   # (event, box) of the barrier read in flight
        self._barrier_next: Any = None      # the one the reads that came later share
        self._unavailable_since: float | None = None
        self._last_error = ""
        self._denied = False          # the last failure: etcd's auth refused a request
        self._lost = False            # etcd lost history: serve nothing until rejoined
        self.diverged = ""            # an op failed here for a local reason
        self.waiting_for_room = ""    # the op this node waits at: its store has no room
        self._nursery: Any = None
        self.counters = collections.Counter[str]()

    #: Other nodes change the same namespace (NamespaceLog.replicated).
    replicated = True

    async def _etcd(self, fn: Any) -> Any:
        """Run a blocking etcd call in the namespace's own threads."""
        return await trio.to_thread.run_sync(fn, abandon_on_cancel=True, limiter=self.limiter)

    # ------------------------------------------------------------------ the core's side

    async def submit(self, op: NsOp) -> dict[str, Any]:
        """Have ``op`` ordered by etcd and applied here; its result (``{"ino"}``,
        ``{"ino", "existed"}`` or ``{}``). It is stored in etcd in its wire form, with this
        node's rank and a fresh id as its envelope.

        Raises:
            FsError: the errno that refused it (decided by its place in etcd's order); EIO
                when etcd did not take it within ``timeout_s``, refused it (too large), or
                this node did not apply it within ``timeout_s`` after etcd took it; ENOSPC,
                before etcd has it, when this node's store has no room for its rows or
                this node waits for room for an op before it (it could not apply this one).
        """
        if self.waiting_for_room:
            raise FsError(errno.ENOSPC, f"this node's store is full: the job's namespace "
                          f"{self.waiting_for_room}")
        try:
            # refused here before etcd has it: committed job-wide, this node could not
            # apply it (nor anything after it) until there is room
            self.fs.ns_check_room(op)
        except StoreFull as exc:
            raise FsError(errno.ENOSPC, str(exc)) from None
        op = dataclasses.replace(op, rank=self.rank, id=f"{self._boot}.{next(self._ids)}")
        body = json.dumps(op.to_wire(), separators=(",", ":")).encode()
        key = self.op_prefix + f"{self.rank:06d}/{op.id}".encode()
        deadline = time.monotonic() + self.timeout_s
        while True:
            await self._check_serving(deadline)
            # Only into the keyspace this node joined: the base's create revision is its
            # identity (a wiped and reseeded etcd has another), so an op never lands in a
            # keyspace with no base, or one this node has not caught up with.
            same_base = pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.CREATE,
                                   key=self.base_key, create_revision=self._base_create)
            try:
                r = await self._etcd(lambda: self.etcd.txn(
                    [absent(key), same_base],
                    [put_op(key, body), put_op(self.last_key, key)],
                    [get_op(key)], retry=True))
                if r.succeeded or r.responses[0].response_range.kvs:
                    break
                self._lost = True  # the base is not the one this node joined: rejoin
                self._failed(EtcdLost("the job's namespace base in etcd changed identity "
                                      "(etcd was wiped or the prefix recreated)"))
                await trio.sleep(0.1)
                continue
            except EtcdUnavailable as exc:
                self._failed(exc)
                if time.monotonic() > deadline:
                    raise FsError(errno.EIO, f"the job's namespace (etcd) did not take the "
                                  f"change within {self.timeout_s:g} s: {exc}") from None
                await trio.sleep(0.2)
            except EtcdError as exc:  # permanent (a request too large): no retry
                raise FsError(errno.EIO, f"etcd refused a namespace change of "
                              f"{len(body)} bytes ({op.KIND}): {exc}") from None
        if r.succeeded:
            rev = r.revision
        else:  # an earlier attempt got through
            rev = r.responses[0].response_range.kvs[0].create_revision
        # Committed job-wide: its own deadline for this node to apply it.
        try:
            await self._wait_applied(rev, time.monotonic() + self.timeout_s)
        except FsError:
            self.results.pop(op.id, None)  # type: ignore[arg-type]
            raise FsError(errno.EIO, f"the namespace change ({op.KIND}) is committed in "
                          f"etcd at revision {rev} but not yet applied on this node") from None
        got = self.results.pop(op.id, None)  # type: ignore[arg-type]
        if got is None:  # applied by a path that did not record it (a base install)
            raise FsError(errno.EIO, f"the namespace change ({op.KIND}) at revision {rev} "
                          "was folded into a snapshot before this node applied it")
        err, message, res = got
        self.counters["ops_submitted"] += 1
        if err:
            raise FsError(err, message or None)
        return res

    async def fresh(self) -> None:
        """Return once this node applied every op etcd acknowledged before this call.

        Raises:
            FsError: EIO when etcd did not answer, or the ops did not arrive, within
                ``timeout_s``.
        """
        deadline = time.monotonic() + self.timeout_s
        while True:
            await self._check_serving(deadline)
            try:
                newest = await self._barrier(deadline)
                break
            except EtcdError as exc:
                self._failed(exc)
                if isinstance(exc, EtcdPermissionDenied):  # waiting would not change it
                    raise FsError(errno.EIO, f"etcd refuses the job's namespace: {exc}") \
                        from None
                if time.monotonic() > deadline:
                    raise FsError(errno.EIO, f"the job's namespace (etcd) did not answer "
                                  f"within {self.timeout_s:g} s: {exc}") from None
                await trio.sleep(0.2)
        await self._wait_applied(newest, deadline)

    async def _check_serving(self, deadline: float) -> None:
        """Wait (until ``deadline``) while this node rejoins an etcd that lost data."""
        while self._lost:
            if time.monotonic() > deadline:
                raise FsError(errno.EIO, "the job's namespace is rejoining etcd, which lost "
                              f"history ({self._last_error})")
            await trio.sleep(0.1)

    async def _barrier(self, deadline: float) -> int:
        """The revision of the newest op in etcd, read after this call began.

        Reads that wait at the same time share one etcd read: one is in flight; those that
        come while it is share the next one (a read started before them cannot answer for
        them). Raises EtcdUnavailable at ``deadline`` (a read that waits for the next one
        behind one etcd does not answer would otherwise wait two calls' timeouts)."""
        if self._nursery is None:  # not running yet (joining): no sharing
            floor = self._floor()
            return self._checked(await self._etcd(self._newest_op), floor)
        mine: tuple[trio.Event, list[Any]]
        if self._barrier_running is None:
            mine = self._barrier_running = (trio.Event(), [])
            self._nursery.start_soon(self._run_barriers)
        else:
            if self._barrier_next is None:
                self._barrier_next = (trio.Event(), [])
            mine = self._barrier_next
        with trio.move_on_after(max(0.0, deadline - time.monotonic())):
            await mine[0].wait()
        if not mine[0].is_set():
            raise EtcdUnavailable(f"etcd did not answer a read barrier within "
                                  f"{self.timeout_s:g} s ({self._last_error})")
        value: int | Exception = mine[1][0]
        if isinstance(value, Exception):
            raise value
        return value

    async def _run_barriers(self) -> None:
        while self._barrier_running is not None:
            ev, box = self._barrier_running
            try:
                floor = self._floor()
                box.append(self._checked(await self._etcd(self._newest_op), floor))
            except Exception as exc:  # noqa: BLE001 (handed to every waiting read)
                box.append(exc if isinstance(exc, EtcdError) else EtcdError(str(exc)))
            ev.set()
            self._barrier_running, self._barrier_next = self._barrier_next, None

    def _newest_op(self) -> tuple[int, int]:
        """(revision of the newest op: ``ns/last``'s mod revision; the store's revision),
        read linearizably (in a worker thread). Without ``ns/last`` (no op yet, or someone
        deleted it), the create revision of the newest key under ``ns/op/``, 0 when none.

        Whatever wrote ``ns/last``, its revision is one the watch delivers (it covers the
        key), so waiting for it never outlasts the watch."""
        kv, rev = self.etcd.get(self.last_key)
        if kv is not None:
            return kv.mod_revision, rev
        kvs, rev, _more, _n = self.etcd.range(
            self.op_prefix, prefix_end(self.op_prefix), keys_only=True, limit=1,
            sort_create=True, descending=True)
        return (kvs[0].create_revision if kvs else 0), rev

    def _checked(self, got: tuple[int, int], floor: int) -> int:
        newest, rev = got
        self._saw_revision(rev, floor)
        return newest

    def _floor(self) -> int:
        """The revision a linearizable read started now must reach (taken before it is
        sent: ops applied while it is on its way may be newer than what it saw)."""
        return max(self.seq, self._seen_rev)

    def _saw_revision(self, rev: int, floor: int) -> None:
        """``rev``: the store revision of a linearizable read started when this node had
        seen revision ``floor``; it is at least that of every write committed before the
        read, so below ``floor`` etcd lost data."""
        if rev < floor:
            self._lost = True
            raise EtcdLost(f"etcd's revision is {rev}, below {floor} seen before: etcd "
                           "lost data (restored or wiped)")
        self._seen_rev = max(self._seen_rev, rev)

    async def _wait_applied(self, rev: int, deadline: float) -> None:
        while self._current < rev:
            await self._check_serving(deadline)
            left = deadline - time.monotonic()
            if left <= 0:
                why = self.waiting_for_room or self._last_error or "no watch event"
                raise FsError(errno.EIO, f"namespace op at etcd revision {rev} never reached "
                              f"this node ({why})")
            with trio.move_on_after(min(left, 0.5)):
                await self.applied.wait()

    def _failed(self, exc: BaseException) -> None:
        self._last_error = str(exc)
        self._denied = isinstance(exc, EtcdPermissionDenied)
        if self._unavailable_since is None:
            self._unavailable_since = time.monotonic()
            log.warning("the job's namespace cannot reach etcd: %s", exc)
        self.counters["etcd_errors"] += 1

    def _ok(self) -> None:
        if self._unavailable_since is not None:
            log.info("the job's namespace reaches etcd again")
        self._unavailable_since = None

    # ------------------------------------------------------------------ applying

    def _reject(self, kind: str, key: bytes, mod_rev: int, why: str) -> None:
        """Report record ``key`` (as written at ``mod_rev``) as refused, once."""
        if (key, mod_rev) in self._refused:
            return
        if len(self._refused) >= 4096:
            self._refused.clear()
        self._refused.add((key, mod_rev))
        untrusted.REJECTED.reject(kind, key, f"{why} (revision {mod_rev})")

    def _decode_base(self, kv: Any) -> dict[str, Any]:
        """The base record ``kv`` (records.decode_base).

        Raises:
            DamagedKeyspace: it does not decode (reported).
        """
        try:
            return records.decode_base(kv.value, kv.mod_revision)
        except BadRecord as exc:
            self._reject("ns_base", kv.key, kv.mod_revision, str(exc))
            raise DamagedKeyspace(f"the job's namespace base {kv.key.decode(errors='replace')}"
                                  f" in etcd is malformed ({exc}): refused; fix or delete "
                                  "the job's prefix") from None

    def _ours(self, kvs: Any, tag: str) -> bool:
        """Whether the base read back (``kvs``: none or one) is the one with ``tag``."""
        try:
            return bool(kvs) and records.decode_base(kvs[0].value)["tag"] == tag
        except BadRecord:
            return False

    def _envelope(self, key: bytes, body: bytes) -> tuple[int | None, str | None]:
        """(rank, id) of the op at ``key`` when its body names them and they are the ones
        its key says (the key a submit writes: ``ns/op/<rank>/<id>``); else (None, None)."""
        try:
            wire = untrusted.json_value(body)
        except BadRecord:
            return None, None
        if not isinstance(wire, dict):
            return None, None
        rank, op_id = wire.get("rank"), wire.get("id")
        if isinstance(rank, int) and not isinstance(rank, bool) and 0 <= rank < 10**6 and \
                isinstance(op_id, str) and \
                key == self.op_prefix + f"{rank:06d}/{op_id}".encode(errors="replace"):
            return rank, op_id
        return None, None

    def _apply(self, rev: int, body: bytes, key: bytes = b"") -> list[Any]:
        """Apply one op at revision ``rev`` (stored at ``key``); returns the versions to
        keep (open here). An op that does not decode (records.decode_op) changes nothing,
        on every node alike: it is reported and this node's position moves past it (its
        submitter, if it is this node, gets EINVAL)."""
        rank, op_id = self._envelope(key, body)
        err: int | None
        try:
            try:
                op = records.decode_op(body)
            except BadRecord as exc:
                self._reject("ns_op", key, rev, str(exc))
                raise FsError(errno.EINVAL, f"malformed namespace op: {exc}") from None
            res, keep = self.fs.ns_apply(op, rev, self.epoch)
            err, message = 0, ""
        except StoreFull as exc:  # nothing changed: this node waits here, skips nothing
            self._wait_for_room(f"op at revision {rev}", exc)
            self.counters["room_waits"] += 1
            raise
        except FsError as exc:  # refused by the namespace's rules: the same on every node
            res, keep, err, message = {}, [], exc.errno, exc.strerror or ""
            self._moved_past(rev)
        except Exception as exc:  # a local failure (a bug, an I/O error): this node differs
            log.exception("namespace op at revision %d failed here", rev)
            res, keep, err, message = {}, [], errno.EIO, f"namespace op failed here: {exc}"
            self.diverged = f"op at revision {rev} failed here: {exc}"
            self.counters["ops_failed_locally"] += 1
            self._moved_past(rev)
        self.seq = rev
        self._current = max(self._current, rev)
        if self.waiting_for_room:
            log.info("the job's namespace goes on at revision %d: the store has room again",
                     rev)
            self.waiting_for_room = ""
        self._since_base += 1
        if rank == self.rank and isinstance(op_id, str) and op_id.startswith(self._boot + "."):
            self.results[op_id] = (err, message, res)
            while len(self.results) > RESULTS_KEPT:
                self.results.popitem(last=False)
        self.counters["ops_applied"] += 1
        return keep

    def _moved_past(self, rev: int) -> None:
        """An op that changed nothing still moves this node's position."""
        self.fs.ns_set_position(self.epoch, rev)

    def _wait_for_room(self, what: str, exc: StoreFull) -> None:
        """``what`` (the op or base this node stops at) could not be applied for lack of
        room: say so once in the log, and in status until it is applied."""
        if not self.waiting_for_room:
            log.warning("the job's namespace: %s waits for room in the store: %s", what, exc)
        self.waiting_for_room = f"{what} waits for room: {exc}"

    def _apply_batch(self, batch: WatchBatch) -> None:
        """Apply the batch's new ops in order, and keep what they removed of files open
        here (:meth:`_keep`). Raises StoreFull at the first op this node has no room for
        (those before it are applied)."""
        keep: list[Any] = []
        created: dict[int, bytes] = {}  # revision -> key of the op created there
        try:
            for ev in batch.events:
                kv = ev.kv
                if kv.key.startswith(self.op_prefix):
                    # a new op is a put that created its key; deletes are the trimming of
                    # old ops; a put over an op already ordered is no op (reported)
                    if ev.type == 0 and kv.version == 1:
                        created[kv.create_revision] = kv.key
                        if kv.create_revision > self.seq:
                            keep += self._apply(kv.create_revision, kv.value, kv.key)
                    elif ev.type == 0:
                        self._reject("ns_op", kv.key, kv.mod_revision,
                                     "an op written again after it was ordered: ignored")
                elif kv.key == self.last_key:
                    # a submit sets it to the key of its op, in the op's transaction
                    if ev.type != 0:
                        self._reject("ns_last", kv.key, kv.mod_revision, "deleted")
                    elif created.get(kv.mod_revision) != kv.value:
                        self._reject("ns_last", kv.key, kv.mod_revision,
                                     f"{kv.value[:60]!r} is not the key of the op written "
                                     "with it")
                # (other keys between ns/last and ns/op/ are no one's: only the revision)
                self._current = max(self._current, kv.mod_revision)
        finally:
            self.applied.set()
            self.applied = trio.Event()
            self._keep_soon(keep)

    def _keep_soon(self, keep: list[Any]) -> None:
        if keep and self._nursery is not None:
            self._nursery.start_soon(self._keep, keep)

    async def _keep(self, versions: list[Any]) -> None:
        """Copy what this node lacks of files it has open that another node removed or
        replaced (POSIX: an open file keeps its content); bounded, best effort."""
        with trio.move_on_after(KEEP_S):
            for v in versions:
                try:
                    await self.fs.fault_in(v, 0, v.size)
                except Exception as exc:  # noqa: BLE001 (best effort, never fatal)
                    log.warning("cannot keep an open file's content: %s", exc)

    # ------------------------------------------------------------------ start and run

    async def join(self, timeout: float = 60.0) -> None:
        """At mount, before FUSE serves: take the job's namespace from etcd (seed it when
        this node comes first), then apply every op after this node's position.

        Raises:
            FsError: EIO when etcd did not answer within ``timeout``, or its keyspace is
                damaged (ops without a base; at once: a base or snapshot that does not
                decode, or etcd's auth refusing); ENOSPC when this node's store had no room
                for the namespace's rows all that time.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._catch_up(initial=True)
                self._ok()
                return
            except StoreFull as exc:
                if time.monotonic() > deadline:
                    raise FsError(errno.ENOSPC, f"cannot join the job's namespace: {exc}") \
                        from None
                await trio.sleep(ROOM_RETRY_S)
            except EtcdError as exc:
                self._failed(exc)
                # (a malformed base does not mend itself: refused at once)
                if time.monotonic() > deadline or isinstance(exc, (EtcdPermissionDenied,
                                                                   DamagedKeyspace)):
                    raise FsError(errno.EIO, f"cannot join the job's namespace in etcd: "
                                  f"{exc}") from None
                await trio.sleep(0.5)

    async def _catch_up(self, initial: bool = False) -> None:
        """Read the base and every op after this node's position at ONE etcd revision (a
        fold deleting ops meanwhile cannot make a page skip some), install the base when
        this node is behind it, apply the ops, and have the watch go on after that
        revision."""
        floor = self._floor()
        kv, pin = await self._etcd(lambda: self.etcd.get(self.base_key))
        if self._lost:  # etcd lost history: start again from what it holds now
            self._seen_rev = 0
        else:
            self._saw_revision(pin, floor)  # EtcdLost (and rejoin) when it went back
        if kv is None:
            if not initial and not self._lost:
                raise EtcdError("the job's namespace base vanished from etcd while this "
                                "node was running (was the key prefix deleted?)")
            base = await self._seed()
            kv, pin = await self._etcd(lambda: self.etcd.get(self.base_key))
            if kv is None:
                raise EtcdError("the job's namespace base vanished right after it was seeded")
        base = self._decode_base(kv)
        self._base, self._base_mod, self._base_create = base, kv.mod_revision, \
            kv.create_revision
        inc, brev = base["incarnation"], base["rev"]
        if self.epoch != inc or self.seq < brev or self._lost:
            await self._install(base, at=pin)
            self._lost = False
            self._since_base = 0
        keep: list[Any] = []
        try:
            while True:  # the ops after this node's position, a page at a time, at ``pin``
                kvs, _at, more, _n = await self._etcd(lambda: self.etcd.range(
                    self.op_prefix, prefix_end(self.op_prefix), sort_create=True,
                    limit=PAGE_OPS, min_create_revision=self.seq + 1, revision=pin))
                for op_kv in kvs:
                    if op_kv.create_revision > self.seq:
                        keep += self._apply(op_kv.create_revision, op_kv.value, op_kv.key)
                if not more:
                    break
        finally:  # (StoreFull: what came before that op is applied)
            self.applied.set()
            self.applied = trio.Event()
            self._keep_soon(keep)
        self._current = pin  # every op up to ``pin`` is applied (nothing else counts)
        self._watch_from = pin + 1

    async def _seed(self) -> dict[str, Any]:
        """Create the keyspace's base from this node's namespace (first node to join);
        returns the base that won (another node's when it came first).

        A node with an empty namespace first waits up to SEED_WAIT_S for a node with files
        to seed (a restarted job's nodes boot in any order: the one that lost its RAM tier
        must not impose an empty or older namespace on those that kept theirs).

        Raises:
            EtcdError: ops exist without a base (a damaged keyspace: never seeded over).
        """
        snap = self.fs.ns_snapshot()
        won = await self._elect_seeder(snap)
        if won is not None:
            return won
        if not snap["entries"] and self.seed is not None:
            await self.seed()
            snap = self.fs.ns_snapshot()
        inc = random.randrange(1, 2**31)
        body = json.dumps(snap, separators=(",", ":")).encode()
        tag = f"seed-{self.rank}-{inc}"
        parts = await self._put_parts(tag, body)
        base = {"incarnation": inc, "rev": 0, "parts": parts, "tag": tag,
                "seeded_by": self.rank}
        no_ops = pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.CREATE,
                            key=self.op_prefix, range_end=prefix_end(self.op_prefix),
                            create_revision=0)
        r = await self._etcd(lambda: self.etcd.txn(
            [absent(self.base_key), no_ops],
            [put_op(self.base_key, json.dumps(base).encode())],
            [get_op(self.base_key)], retry=True))
        if not r.succeeded:
            kvs = r.responses[0].response_range.kvs
            # (a retried transaction whose first try committed finds its own base: ours)
            if not self._ours(kvs, tag):
                await self._delete_parts(tag)
                if kvs:
                    return self._decode_base(kvs[0])
                raise EtcdError(f"the job's namespace in etcd has ops but no base (under "
                                f"{self.op_prefix.decode()!r}): damaged keyspace, not "
                                "seeded over; delete the job's prefix to start afresh")
        await self._etcd(lambda: self.etcd.delete(self.cand_prefix,
                                                  prefix_end(self.cand_prefix)))
        # Our own namespace is the base: keep it, at this incarnation and revision 0.
        self.epoch, self.seq = inc, 0
        self.fs.ns_set_position(inc, 0)
        log.info("seeded the job's namespace in etcd (incarnation %d, %d entries)", inc,
                 len(snap["entries"]))
        return base

    async def _elect_seeder(self, snap: dict[str, Any]) -> dict[str, Any] | None:
        """Agree on the node that seeds an empty keyspace. Returns the base when another
        node seeded it meanwhile, None when this node is to seed.

        Each joining node puts a candidate record ``ns/seeders/<rank>`` (its newest step
        and entry count) on a lease it renews while it waits, so a node that dies drops
        out. The best candidate (newest step, then most entries, then lowest rank) seeds
        once every rank's record is there, or SEED_WAIT_S after it joined; the others wait
        for its base. Only the best runs the seed hook (the restore from the backup
        tier). A node takes over only when no better live candidate is left, or after
        SEED_TAKEOVER_S (the best is stuck): then, if it is empty, only when no candidate
        holds files, so an empty node never imposes an empty namespace on nodes that
        kept theirs while one of them is alive."""
        steps = [int(s["number"]) for s in snap.get("steps", [])]
        me = {"rank": self.rank, "newest_step": max(steps, default=-1),
              "entries": len(snap["entries"])}
        mine = self.cand_prefix + f"{self.rank:06d}".encode()
        lease, _ttl = await self._etcd(lambda: self.etcd.grant(CANDIDATE_TTL_S))
        await self._etcd(lambda: self.etcd.put(mine, json.dumps(me).encode(), lease=lease))
        start = time.monotonic()
        renewed = start
        try:
            while True:
                kv, _rev = await self._etcd(lambda: self.etcd.get(self.base_key))
                if kv is not None:
                    return self._decode_base(kv)
                kvs, _at, _more, _n = await self._etcd(lambda: self.etcd.range(
                    self.cand_prefix, prefix_end(self.cand_prefix)))
                cands = []
                for c in kvs:
                    try:
                        cand = records.decode_candidate(c.value, self.nodes)
                        if c.key != self.cand_prefix + f"{cand['rank']:06d}".encode():
                            raise BadRecord(f"its key is not that of its rank {cand['rank']}")
                        if not c.lease:  # a joining node's is on its lease: a live node's
                            raise BadRecord("on no lease: no live node's candidacy")
                        cands.append(cand)
                    except BadRecord as exc:  # left out of the election
                        self._reject("ns_seeder", c.key, c.mod_revision, str(exc))
                cands = cands or [me]
                best = max(cands, key=lambda c: (c["newest_step"], c["entries"], -c["rank"]))
                waited = time.monotonic() - start
                if best["rank"] == self.rank and (len(cands) >= self.nodes
                                                  or waited > SEED_WAIT_S):
                    return None
                if waited > SEED_WAIT_S + SEED_TAKEOVER_S and (
                        me["entries"] or not any(c["entries"] for c in cands)):
                    log.warning("rank %d, the best candidate to seed the job's namespace, "
                                "did not within %.0f s: this node seeds it", best["rank"],
                                waited)
                    return None
                if time.monotonic() - renewed > CANDIDATE_TTL_S / 3:
                    await self._etcd(lambda: self.etcd.keepalive(lease))
                    renewed = time.monotonic()
                await trio.sleep(0.2)
        finally:
            with trio.CancelScope(shield=True):
                try:
                    await self._etcd(lambda: self.etcd.revoke(lease))
                except EtcdError:
                    pass  # it expires on its own

    async def _put_parts(self, tag: str, body: bytes) -> int:
        parts = [body[i:i + PART_BYTES] for i in range(0, len(body), PART_BYTES)] or [b""]
        for i, part in enumerate(parts):
            key = self.snap_prefix + f"{tag}/{i}".encode()
            await self._etcd(lambda key=key, part=part: self.etcd.put(key, part))
        return len(parts)

    async def _delete_parts(self, tag: str) -> None:
        p = self.snap_prefix + f"{tag}/".encode()
        await self._etcd(lambda: self.etcd.delete(p, prefix_end(p)))

    async def _install(self, base: dict[str, Any], at: int = 0) -> None:
        p = self.snap_prefix + f"{base['tag']}/".encode()
        kvs, _at, _more, _n = await self._etcd(lambda: self.etcd.range(p, prefix_end(p),
                                                                        revision=at))
        try:
            parts = sorted(kvs, key=lambda kv: records.snap_part_index(kv.key, p,
                                                                       base["parts"]))
            if len(parts) != base["parts"]:
                raise BadRecord(f"{len(parts)} of its {base['parts']} parts")
            snap = records.decode_snapshot(b"".join(kv.value for kv in parts))
        except BadRecord as exc:
            self._reject("ns_snapshot", p, at, str(exc))
            raise DamagedKeyspace(f"the job's namespace snapshot {p.decode(errors='replace')}"
                                  f" in etcd is malformed ({exc}): not installed") from None
        snap["epoch"], snap["seq"] = base["incarnation"], base["rev"]
        try:
            self.fs.ns_install(snap)
        except StoreFull as exc:  # nothing changed: tried again after a pause
            self._wait_for_room(f"the namespace base at revision {base['rev']}", exc)
            raise
        self.epoch, self.seq = self.fs.ns_position()
        self._current = self.seq
        self.diverged = ""
        self.waiting_for_room = ""
        self.counters["snapshots_installed"] += 1

    def reset_position(self) -> None:
        """Take (epoch, seq) from the core after its namespace was replaced."""
        self.epoch, self.seq = self.fs.ns_position()
        self._current = self.seq

    # ------------------------------------------------------------------ trimming the log

    async def _maybe_trim(self) -> None:
        """Fold the log into a new base when it grew past TRIM_OPS (rank 0 does it; any
        node past four times that, rank 0 being away), and delete the ops the previous base
        already held: one fold behind, so that a submit retried after its first try
        committed still finds its op's key (create-if-absent) and never adds it twice."""
        if self._since_base < (TRIM_OPS if self.rank == 0 else 4 * TRIM_OPS) or self._lost:
            return
        kv, _rev = await self._etcd(lambda: self.etcd.get(self.base_key))
        if kv is None or kv.mod_revision != self._base_mod:  # another node folded it
            if kv is not None:
                try:
                    self._base = self._decode_base(kv)
                except DamagedKeyspace:
                    pass  # the next fold replaces it (compared with its mod revision)
                self._base_mod = kv.mod_revision
            self._since_base = 0
            return
        rev = self.seq
        snap = self.fs.ns_snapshot()  # no await since ``rev``: the namespace after op rev
        body = json.dumps(snap, separators=(",", ":")).encode()
        tag = f"{rev}-{self.rank}"
        parts = await self._put_parts(tag, body)
        base = {"incarnation": self.epoch, "rev": rev, "parts": parts, "tag": tag,
                "trimmed_by": self.rank}
        r = await self._etcd(lambda: self.etcd.txn(
            [mod_is(self.base_key, self._base_mod)],
            [put_op(self.base_key, json.dumps(base).encode())], [get_op(self.base_key)],
            retry=True))
        new_mod = r.revision
        if not r.succeeded:
            kvs = r.responses[0].response_range.kvs
            # (a retried transaction whose first try committed finds its own base: ours)
            if not self._ours(kvs, tag):
                await self._delete_parts(tag)
                if kvs:
                    try:
                        self._base = self._decode_base(kvs[0])
                    except DamagedKeyspace:
                        pass  # the next fold replaces it
                    self._base_mod = kvs[0].mod_revision
                self._since_base = 0
                return
            new_mod = kvs[0].mod_revision
        old = self._base
        self._base, self._base_mod, self._since_base = base, new_mod, 0
        if old.get("tag") and old.get("tag") != tag:
            # (a node installing it reads at a pinned revision, which still holds them)
            await self._delete_parts(old["tag"])
        old_rev = int(old.get("rev", 0))
        deleted = 0
        while old_rev > 0:  # the ops the previous base held, one transaction per batch
            kvs, _at, _more, _n = await self._etcd(lambda: self.etcd.range(
                self.op_prefix, prefix_end(self.op_prefix), keys_only=True, limit=100,
                max_create_revision=old_rev))
            if not kvs:
                break
            await self._etcd(lambda kvs=kvs: self.etcd.txn(
                [], [delete_op(kv.key) for kv in kvs], retry=True))
            deleted += len(kvs)
        self.counters["log_trims"] += 1
        log.info("folded the job's namespace log into a base at revision %d (%d ops up to "
                 "revision %d deleted, %d bytes of snapshot)", rev, deleted, old_rev, len(body))

    # ------------------------------------------------------------------ run

    async def run(self) -> None:
        """Apply the job's ops as etcd delivers them, for ever. The watch (its thread
        ``mtcfs-ns-watch``) is restarted after any failure, after a catch-up from etcd's
        keys; after failures that are not etcd's (a bug) at most once per ``pause`` seconds,
        doubling up to :data:`RESTART_MAX_S` while they go on, each logged."""
        pause = 0.5
        async with trio.open_nursery() as n:
            self._nursery = n
            n.start_soon(self._trim_loop)
            while True:
                bug = False
                try:
                    await self._follow()
                except EtcdCompacted as exc:
                    log.warning("namespace watch: %s; catching up from etcd's keys", exc)
                except StoreFull:
                    pass  # (said by _apply) tried again below, after a pause
                except Exception as exc:  # noqa: BLE001 (EtcdError, or a bug: retried)
                    if not isinstance(exc, EtcdError):
                        bug = True
                        log.exception("namespace watch failed; restarted in %.1f s", pause)
                    self._failed(exc)
                await trio.sleep(ROOM_RETRY_S if self.waiting_for_room else
                                 pause if bug else 0.5)
                pause = min(pause * 2, RESTART_MAX_S) if bug else 0.5
                try:
                    await self._catch_up()
                    self._ok()
                except StoreFull:
                    self._ok()  # etcd answered: the wait is this node's (status says)
                except Exception as exc:  # noqa: BLE001 (EtcdError, or a bug: retried)
                    if not isinstance(exc, EtcdError):
                        log.exception("catching up with the job's namespace failed")
                    self._failed(exc)

    async def _trim_loop(self) -> None:
        """Every few seconds: check that etcd did not lose data (an idle node makes no read
        that would notice), and fold the log when it grew."""
        while True:
            await trio.sleep(CHECK_S)
            try:
                if not self._lost:
                    floor = self._floor()
                    self._checked(await self._etcd(self._newest_op), floor)
                await self._maybe_trim()
            except EtcdError as exc:
                self._failed(exc)
            except Exception as exc:  # noqa: BLE001 (the next round tries again)
                log.warning("folding the namespace log failed: %s", exc)

    async def _follow(self) -> None:
        send, recv = trio.open_memory_channel[Any](4)
        token = trio.lowlevel.current_trio_token()
        stop = threading.Event()
        start = self._watch_from or self.seq + 1

        def pump() -> None:
            # (it only passes batches on: whatever they hold is decoded by the loop, and
            # any failure, its own included, is handed to it, which restarts the watch)
            try:
                # ns/last up to the ops' end: ns/last's writes reach this node too
                for batch in self.etcd.watch(self.last_key, prefix_end(self.op_prefix),
                                             start, stop=stop):
                    trio.from_thread.run(send.send, batch, trio_token=token)
            except BaseException as exc:  # noqa: BLE001 (handed to the loop)
                try:
                    trio.from_thread.run(send.send, exc, trio_token=token)
                except BaseException:  # noqa: BLE001 (the loop is gone)
                    pass

        # A plain thread, not one of trio's: it lives as long as the watch.
        threading.Thread(target=pump, daemon=True, name="mtcfs-ns-watch").start()
        failure: BaseException | None = None
        try:
            async for item in recv:
                if isinstance(item, BaseException):
                    failure = item  # raised below, outside any nursery
                    break
                if self._lost:  # a watch on what etcd lost delivers nothing: rejoin
                    failure = EtcdLost(self._last_error or "etcd lost data")
                    break
                # (no revision check here: a watch's header comes from whichever member
                # serves it, which may lag; only linearizable reads prove a loss)
                self._ok()
                self._apply_batch(item)
                if item.events:
                    self._watch_from = item.events[-1].kv.mod_revision + 1
        finally:
            stop.set()
            recv.close()
        if failure is not None:
            raise failure

    @property
    def unavailable(self) -> bool:
        """Whether this node's copy cannot be made current now: the last call to etcd
        failed (and none succeeded since), or the node waits for room for an op."""
        return self._unavailable_since is not None or bool(self.waiting_for_room)

    def _unavailable_s(self) -> float | None:
        if self._unavailable_since is None:
            return None
        return round(time.monotonic() - self._unavailable_since, 1)

    def status(self) -> dict[str, Any]:
        """The namespace's part of ``mtcfs status``."""
        return {"engine": "etcd", "endpoints": self.etcd.endpoints, "seq": self.seq,
                "epoch": self.epoch, "unavailable_s": self._unavailable_s(),
                "last_error": self._last_error if self._unavailable_since else "",
                "denied": bool(self._unavailable_since and self._denied),
                "base_rev": int(self._base.get("rev", 0)) if self._base else None,
                "ops_since_base": self._since_base, "diverged": self.diverged,
                "waiting_for_room": self.waiting_for_room,
                **dict(self.counters)}
