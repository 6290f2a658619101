"""The job's namespace log for scope=job, kept in etcd (``coord=etcd://...``).

etcd orders every namespace op; each node applies the ops in etcd's order to its own copy
(the same deterministic ``fs.ns_apply`` on every node), so every copy goes through the same
states. Nothing of the agreement is ours: no leader, no epochs, no quorum, no takeover.
etcd's Raft (Ongaro and Ousterhout, USENIX ATC 2014) decides the order and keeps it through
member failures; a node cut off from etcd cannot change the namespace (its calls wait, then
fail with EIO) and serves no read it cannot prove current. This is state-machine replication
over a shared log (Schneider, ACM Computing Surveys 1990), with etcd as the log.

Keys, under ``<prefix>`` = ``/mtcfs/<job>/``:

* ``ns/op/<rank>/<id>``: one op (JSON, the kinds of mtcfs/fs/jobns.py). Written once by
  the node that submits it, with a create-if-absent transaction, so a retried submit never
  adds an op twice. Its create revision is its place in the order.
* ``ns/base``: ``{"incarnation", "rev", "parts"}``: the namespace as it was at revision
  ``rev`` (a snapshot in ``parts`` keys ``ns/snap/<rev>/<i>``), from which a node with no
  usable copy starts. Created once per etcd keyspace, by the first node that joins (with
  the namespace it holds: its RAM tier's, or what it restored from the backup tier).

Position: a node's ``(epoch, seq)`` is ``(incarnation, revision of the last op applied)``.
A node whose epoch is not the keyspace's incarnation (etcd was wiped and seeded anew)
installs the base; otherwise it applies the ops after its seq.

Reads (``fresh``): before a lookup or open answers, the node reads from etcd the newest
op's revision (one linearizable range, shared by the reads that wait at the same time) and
waits until it applied that op: close-to-open holds job-wide (docs/consistency.md), at the
cost of one round trip to etcd per read that the kernel does not answer from its cache.
"""

from __future__ import annotations

import collections
import errno
import itertools
import json
import logging
import random
import threading
import time
from typing import Any

import trio

from mtcfs.errors import FsError
from replication.coord.etcd import (
    Etcd, EtcdCompacted, EtcdError, WatchBatch, absent, get_op, prefix_end, put_op,
)

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


class EtcdNamespace:
    """The ``ns_log`` of a scope=job core, with etcd as the log.

    Args:
        fs: the filesystem core (``ns_apply``, ``ns_snapshot``, ``ns_install``,
            ``ns_position``, ``fault_in``).
        etcd: the job's etcd client.
        prefix: the job's key prefix (``/mtcfs/<job>/``).
        rank: this node's rank.
        seed: optional async callable run before this node seeds an empty keyspace with an
            empty namespace (the daemon restores the job's newest step from the backup
            tier there).
        timeout_s: how long a change or a read waits for etcd before EIO.
    """

    def __init__(self, fs: Any, etcd: Etcd, prefix: str, rank: int, seed: Any = None,
                 timeout_s: float = DEADLINE_S) -> None:
        self.fs = fs
        self.timeout_s = timeout_s
        self.etcd = etcd
        self.rank = rank
        self.seed = seed
        p = prefix.encode()
        self.op_prefix = p + b"ns/op/"
        self.base_key = p + b"ns/base"
        self.snap_prefix = p + b"ns/snap/"
        self.epoch, self.seq = fs.ns_position()
        self.results: collections.OrderedDict[tuple[int, str], tuple[int, str, dict]] = \
            collections.OrderedDict()
        self.applied = trio.Event()
        self._ids = itertools.count(1)
        self._boot = f"{time.time_ns():x}"
        self._watch_from = 0          # revision the watch resumes at
        self._stop = threading.Event()
        self._barrier_running: Any = None   # (event, box) of the barrier read in flight
        self._barrier_next: Any = None      # the one the reads that came later share
        self._unavailable_since: float | None = None
        self._last_error = ""
        self._nursery: Any = None
        self.counters = collections.Counter[str]()

    # ------------------------------------------------------------------ the core's side

    async def submit(self, op: dict[str, Any]) -> dict[str, Any]:
        """Have ``op`` ordered by etcd and applied here; its result.

        Raises:
            FsError: the errno that refused it (decided by its place in etcd's order), or
                EIO when etcd did not take it, or this node did not apply it, within
                ``timeout_s``.
        """
        op = dict(op, rank=self.rank, id=f"{self._boot}.{next(self._ids)}")
        body = json.dumps(op, separators=(",", ":")).encode()
        key = self.op_prefix + f"{self.rank:06d}/{op['id']}".encode()
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                r = await trio.to_thread.run_sync(
                    lambda: self.etcd.txn([absent(key)], [put_op(key, body)], [get_op(key)],
                                          retry=True), abandon_on_cancel=True)
                break
            except EtcdError as exc:
                self._failed(exc)
                if time.monotonic() > deadline:
                    raise FsError(errno.EIO, f"the job's namespace (etcd) did not take the "
                                  f"change: {exc}") from None
                await trio.sleep(0.2)
        if r.succeeded:
            rev = r.revision
        else:  # an earlier attempt got through
            rev = r.responses[0].response_range.kvs[0].create_revision
        await self._wait_applied(rev, deadline)
        err, message, res = self.results.pop((self.rank, op["id"]), (0, "", {}))
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
            try:
                newest = await self._barrier()
                break
            except EtcdError as exc:
                self._failed(exc)
                if time.monotonic() > deadline:
                    raise FsError(errno.EIO, f"the job's namespace (etcd) did not answer: "
                                  f"{exc}") from None
                await trio.sleep(0.2)
        await self._wait_applied(newest, deadline)

    async def _barrier(self) -> int:
        """The create revision of the newest op in etcd, read after this call began.

        Reads that wait at the same time share one etcd read: one is in flight; those that
        come while it is share the next one (a read started before them cannot answer for
        them)."""
        if self._nursery is None:  # not running yet (joining): no sharing
            return await trio.to_thread.run_sync(self._newest_unapplied,
                                                 abandon_on_cancel=True)
        if self._barrier_running is None:
            mine = self._barrier_running = (trio.Event(), [])
            self._nursery.start_soon(self._run_barriers)
        else:
            if self._barrier_next is None:
                self._barrier_next = (trio.Event(), [])
            mine = self._barrier_next
        await mine[0].wait()
        value = mine[1][0]
        if isinstance(value, Exception):
            raise value
        return value

    async def _run_barriers(self) -> None:
        while self._barrier_running is not None:
            ev, box = self._barrier_running
            try:
                box.append(await trio.to_thread.run_sync(self._newest_unapplied,
                                                         abandon_on_cancel=True))
            except Exception as exc:  # noqa: BLE001 (handed to every waiting read)
                box.append(exc if isinstance(exc, EtcdError) else EtcdError(str(exc)))
            ev.set()
            self._barrier_running, self._barrier_next = self._barrier_next, None

    def _newest_unapplied(self) -> int:
        """The create revision of the newest op this node has not applied (0: none), read
        linearizably: one key, keys only, the newest first."""
        kvs, _rev, _more, _n = self.etcd.range(
            self.op_prefix, prefix_end(self.op_prefix), limit=1, keys_only=True,
            sort_create=True, descending=True, min_create_revision=self.seq + 1)
        return max((kv.create_revision for kv in kvs), default=0)

    async def _wait_applied(self, rev: int, deadline: float) -> None:
        while self.seq < rev:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FsError(errno.EIO, f"namespace op at etcd revision {rev} never reached "
                              f"this node ({self._last_error or 'no watch event'})")
            with trio.move_on_after(min(left, 0.5)):
                await self.applied.wait()

    def _failed(self, exc: BaseException) -> None:
        self._last_error = str(exc)
        if self._unavailable_since is None:
            self._unavailable_since = time.monotonic()
            log.warning("the job's namespace cannot reach etcd: %s", exc)
        self.counters["etcd_errors"] += 1

    def _ok(self) -> None:
        if self._unavailable_since is not None:
            log.info("the job's namespace reaches etcd again")
        self._unavailable_since = None

    # ------------------------------------------------------------------ applying

    def _apply(self, rev: int, body: bytes) -> list[Any]:
        """Apply one op at revision ``rev``; returns the versions to keep (open here)."""
        try:
            op = json.loads(body)
        except ValueError:
            log.error("namespace op at revision %d is not JSON: skipped", rev)
            self.seq = rev
            return []
        try:
            res, keep = self.fs.ns_apply(op, rev, self.epoch)
            err, message = 0, ""
        except FsError as exc:
            res, keep, err, message = {}, [], exc.errno, exc.strerror or ""
            # refused ops change nothing, but the position moves past them
            self.fs.db.set_kv("ns_seq", str(rev))
        except Exception as exc:  # a bug or an I/O error must not stop the namespace
            log.exception("namespace op at revision %d failed", rev)
            res, keep, err, message = {}, [], errno.EIO, f"namespace op failed: {exc}"
            self.fs.db.set_kv("ns_seq", str(rev))
        self.seq = rev
        if op.get("rank") == self.rank:
            self.results[(self.rank, op.get("id", ""))] = (err, message, res)
            while len(self.results) > RESULTS_KEPT:
                self.results.popitem(last=False)
        self.counters["ops_applied"] += 1
        return keep

    def _apply_batch(self, batch: WatchBatch) -> list[Any]:
        keep: list[Any] = []
        for ev in batch.events:
            kv = ev.kv
            # a new op is a put that created its key; deletes are the trimming of old ops
            if ev.type == 0 and kv.version == 1 and kv.create_revision > self.seq:
                keep += self._apply(kv.create_revision, kv.value)
        self.applied.set()
        self.applied = trio.Event()
        return keep

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
            FsError: EIO when etcd did not answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self._catch_up()
                self._ok()
                return
            except EtcdError as exc:
                self._failed(exc)
                if time.monotonic() > deadline:
                    raise FsError(errno.EIO, f"cannot join the job's namespace: etcd at "
                                  f"{','.join(self.etcd.endpoints)} did not answer ({exc})"
                                  ) from None
                await trio.sleep(0.5)

    async def _catch_up(self) -> None:
        base = await self._base()
        if base is None:
            base = await self._seed()
        inc, brev = int(base["incarnation"]), int(base["rev"])
        if self.epoch != inc or self.seq < brev:
            await self._install(base)
        kvs, at, _more, _n = await trio.to_thread.run_sync(
            lambda: self.etcd.range(self.op_prefix, prefix_end(self.op_prefix),
                                    sort_create=True, min_create_revision=self.seq + 1),
            abandon_on_cancel=True)
        keep = []
        for kv in kvs:
            if kv.create_revision > self.seq:
                keep += self._apply(kv.create_revision, kv.value)
        self.applied.set()
        self.applied = trio.Event()
        self._watch_from = at + 1
        if keep and self._nursery is not None:
            self._nursery.start_soon(self._keep, keep)

    async def _base(self) -> dict[str, Any] | None:
        kv, _rev = await trio.to_thread.run_sync(lambda: self.etcd.get(self.base_key),
                                                 abandon_on_cancel=True)
        return json.loads(kv.value) if kv is not None else None

    async def _seed(self) -> dict[str, Any]:
        """Create the keyspace's base from this node's namespace (first node to join);
        returns the base that won (another node's when it came first)."""
        snap = self.fs.ns_snapshot()
        if self.seed is not None and not snap["entries"]:
            await self.seed()
            snap = self.fs.ns_snapshot()
        inc = random.randrange(1, 2**31)
        body = json.dumps(snap, separators=(",", ":")).encode()
        parts = [body[i:i + PART_BYTES] for i in range(0, len(body), PART_BYTES)] or [b""]
        tag = f"seed-{self.rank}-{inc}".encode()
        for i, part in enumerate(parts):
            await trio.to_thread.run_sync(
                lambda i=i, part=part: self.etcd.put(self.snap_prefix + tag + b"/%d" % i,
                                                     part), abandon_on_cancel=True)
        base = {"incarnation": inc, "rev": 0, "parts": len(parts), "tag": tag.decode(),
                "seeded_by": self.rank}
        r = await trio.to_thread.run_sync(
            lambda: self.etcd.txn([absent(self.base_key)],
                                  [put_op(self.base_key, json.dumps(base).encode())],
                                  [get_op(self.base_key)], retry=True),
            abandon_on_cancel=True)
        if not r.succeeded:
            await trio.to_thread.run_sync(
                lambda: self.etcd.delete(self.snap_prefix + tag + b"/",
                                         prefix_end(self.snap_prefix + tag + b"/")),
                abandon_on_cancel=True)
            kvs = r.responses[0].response_range.kvs
            if kvs:
                return json.loads(kvs[0].value)
            raise EtcdError("the namespace base vanished while it was created")
        # Our own namespace is the base: keep it, at this incarnation and revision 0.
        self.epoch, self.seq = inc, 0
        with self.fs.db.transaction():
            self.fs.db.set_kv("ns_epoch", str(inc))
            self.fs.db.set_kv("ns_seq", "0")
        log.info("seeded the job's namespace in etcd (incarnation %d, %d entries)", inc,
                 len(snap["entries"]))
        return dict(base)

    async def _install(self, base: dict[str, Any]) -> None:
        tag = base["tag"].encode()
        kvs, _at, _more, _n = await trio.to_thread.run_sync(
            lambda: self.etcd.range(self.snap_prefix + tag + b"/",
                                    prefix_end(self.snap_prefix + tag + b"/")),
            abandon_on_cancel=True)
        parts = sorted(kvs, key=lambda kv: int(kv.key.rsplit(b"/", 1)[1]))
        if len(parts) != int(base["parts"]):
            raise EtcdError(f"the namespace base has {len(parts)} of {base['parts']} parts")
        snap = json.loads(b"".join(kv.value for kv in parts))
        snap["epoch"], snap["seq"] = int(base["incarnation"]), int(base["rev"])
        self.fs.ns_install(snap)
        self.epoch, self.seq = self.fs.ns_position()
        self.counters["snapshots_installed"] += 1

    def reset_position(self) -> None:
        """Take (epoch, seq) from the core after its namespace was replaced."""
        self.epoch, self.seq = self.fs.ns_position()

    async def run(self) -> None:
        """Apply the job's ops as etcd delivers them, for ever."""
        async with trio.open_nursery() as n:
            self._nursery = n
            while True:
                try:
                    await self._follow()
                except EtcdCompacted as exc:
                    log.warning("namespace watch: %s; catching up from etcd's keys", exc)
                except EtcdError as exc:
                    self._failed(exc)
                except Exception as exc:  # a bug must not take the mount down: retried
                    log.exception("namespace watch failed")
                    self._failed(exc)
                await trio.sleep(0.5)
                try:
                    await self._catch_up()
                    self._ok()
                except Exception as exc:  # noqa: BLE001 (EtcdError, or a bug: retried)
                    self._failed(exc)

    async def _follow(self) -> None:
        send, recv = trio.open_memory_channel[Any](64)
        token = trio.lowlevel.current_trio_token()
        stop = threading.Event()
        start = self._watch_from or self.seq + 1

        def pump() -> None:
            try:
                for batch in self.etcd.watch(self.op_prefix, prefix_end(self.op_prefix),
                                             start, stop=stop):
                    trio.from_thread.run(send.send, batch, trio_token=token)
            except BaseException as exc:  # noqa: BLE001 (handed to the loop)
                try:
                    trio.from_thread.run(send.send, exc, trio_token=token)
                except Exception:  # the loop is gone
                    pass

        failure: BaseException | None = None
        async with trio.open_nursery() as n:
            n.start_soon(lambda: trio.to_thread.run_sync(pump, abandon_on_cancel=True))
            try:
                async for item in recv:
                    if isinstance(item, BaseException):
                        failure = item  # raised outside the nursery: no exception group
                        break
                    self._ok()
                    keep = self._apply_batch(item)
                    if item.events:
                        self._watch_from = item.events[-1].kv.mod_revision + 1
                    if keep and self._nursery is not None:
                        self._nursery.start_soon(self._keep, keep)
            finally:
                stop.set()
                n.cancel_scope.cancel()
        if failure is not None:
            raise failure

    def _unavailable_s(self) -> float | None:
        if self._unavailable_since is None:
            return None
        return round(time.monotonic() - self._unavailable_since, 1)

    def status(self) -> dict[str, Any]:
        """The namespace's part of ``mtcfs status``."""
        return {"engine": "etcd", "endpoints": self.etcd.endpoints, "seq": self.seq,
                "epoch": self.epoch, "unavailable_s": self._unavailable_s(),
                "last_error": self._last_error if self._unavailable_since else "",
                **dict(self.counters)}
