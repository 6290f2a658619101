"""Which checkpoint steps each rank can restore, and the job's restore decision, in etcd.

Keys, under ``<prefix>`` = ``/mtcfs/<job>/``:

* ``steps/<rank:06d>``: ``{"rank", "boot", "steps": [...], "at"}``: the steps this rank
  completed (the newest ``keep`` of them, ascending; a step evicted from its RAM since
  stays: whether a rank can still restore it is checked at the restore). One key per
  rank, replaced on every change (a put). Not leased: the record must outlive the daemon
  that wrote it, since the restore decision is taken after a restart.
* ``restore/<incarnation>``: ``{"incarnation", "step", "ranks_recorded", "missing",
  "decided_by", "at"}``: the step the job restarts from. Written once, by whichever member
  comes first, with a create-if-absent transaction; every other member reads it. No vote
  protocol of ours: etcd's order picks the one write that counts.
* ``restore/current`` (:meth:`StepRecords.decide_current`, scope=node restores): the same
  decision, kept while it is current. It stands as long as no rank's record changed after
  it was written (its mod revision is above every record's); the first restoring node that
  finds it stale (the job trained on since) replaces it with a compare-and-set on its mod
  revision, and every other node then reads that one.

The decision (:meth:`StepRecords.decide_restore`): the newest step present in the record
of every rank in ``0..nodes-1``. **Ranks that have not recorded**: the first members to
decide wait up to ``wait_s`` for every rank's record (polling one read-only transaction
that also reads the decision key, so a decision taken meanwhile ends the wait). When the
wait ends with ranks still missing, the decision is taken from the ranks that did record:
a missing rank constrains nothing (it lowers nothing), and the decision lists it under
``missing`` (that rank restores the chosen step from its peers or the backup tier). With
no record at all the decision is ``step: null`` (start from scratch, or from the backup
tier's own newest step). An empty record (a rank that holds nothing) does constrain: the
intersection is then empty and the decision is ``null``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Iterable

import trio

from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdError, absent, get_op, mod_is, prefix_end, put_op,
)

#: Steps a rank's record keeps (the newest).
KEEP = 16
#: Seconds decide_restore waits for every rank's record before deciding from those it has.
WAIT_S = 5.0


class StepRecords:
    """One rank's step record and the job's restore decision.

    Args:
        etcd: the job's etcd client.
        prefix: the job's key prefix.
        rank: this rank (the key it writes); boot: this daemon's boot id.
        keep: how many of the newest steps a record holds.
    """

    def __init__(self, etcd: Etcd, prefix: str, rank: int, boot: str = "",
                 keep: int = KEEP) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.rank = rank
        self.boot = boot
        self.keep = keep
        self.steps_prefix = f"{prefix}steps/".encode()
        self.key = self.steps_prefix + f"{rank:06d}".encode()
        self._steps: set[int] = set()

    # ------------------------------------------------------------------ this rank's record

    def record(self, steps: Iterable[int]) -> int:
        """Replace this rank's record with ``steps`` (the newest ``keep``); the revision."""
        self._steps = set(sorted(set(int(s) for s in steps))[-self.keep:])
        body = json.dumps({"rank": self.rank, "boot": self.boot,
                           "steps": sorted(self._steps), "at": round(time.time(), 3)},
                          separators=(",", ":")).encode()
        return self.etcd.put(self.key, body, retry=True)

    def add(self, step: int) -> int:
        """Record one more step complete here."""
        return self.record(self._steps | {int(step)})

    def drop(self, step: int) -> int:
        """Record that a step is no longer restorable here (evicted)."""
        return self.record(self._steps - {int(step)})

    # ------------------------------------------------------------------ reading

    def records(self, nodes: int | None = None) -> dict[int, set[int]]:
        """Every rank's recorded steps (one range over the prefix), ranks < ``nodes``."""
        kvs, _rev, _more, _n = self.etcd.range(self.steps_prefix, prefix_end(self.steps_prefix))
        return _parse(kvs, self.steps_prefix, nodes)

    def newest_complete_everywhere(self, nodes: int) -> int | None:
        """The newest step every rank in ``0..nodes-1`` recorded (None: no such step, or a
        rank has no record)."""
        recs = self.records(nodes)
        if len(recs) < nodes:
            return None
        return _newest_common(recs.values())

    # ------------------------------------------------------------------ the decision

    def decision_key(self, incarnation: int | str) -> bytes:
        return f"{self.prefix}restore/{incarnation}".encode()

    def decide_restore(self, nodes: int, incarnation: int | str, *, wait_s: float = WAIT_S,
                       timeout: float = 30.0) -> dict[str, Any]:
        """The job's restore decision for ``incarnation`` (the same for every caller).

        Reads ``restore/<incarnation>``; when absent, waits (up to ``wait_s``) for every
        rank's record, computes the newest step common to the ranks that recorded, and
        writes it with create-if-absent; returns the decision that won (its own or an
        earlier one).

        Raises:
            EtcdError: etcd did not answer within ``timeout`` (one line).
        """
        deadline = time.monotonic() + timeout
        dkey = self.decision_key(incarnation)
        wait_until = time.monotonic() + wait_s
        count_req = pb.RequestOp(request_range=pb.RangeRequest(
            key=self.steps_prefix, range_end=prefix_end(self.steps_prefix), count_only=True))
        last: Exception | None = None
        pause = 0.1
        while True:
            try:
                # one linearizable read: the decision, and how many ranks recorded
                r = self.etcd.txn([], [get_op(dkey), count_req], retry=True)
                got = r.responses[0].response_range.kvs
                if got:
                    decided: dict[str, Any] = json.loads(got[0].value)
                    return decided
                count = int(r.responses[1].response_range.count)
                if count >= nodes or time.monotonic() >= wait_until:
                    recs = self.records(nodes)
                    if len(recs) >= nodes or time.monotonic() >= wait_until:
                        return self._write_decision(dkey, nodes, incarnation, recs)
            except EtcdError as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise EtcdError(f"no restore decision for incarnation {incarnation} within "
                                f"{timeout:g} s ({last or 'ranks still recording'})")
            time.sleep(min(pause, max(0.0, min(wait_until, deadline) - time.monotonic()))
                       or 0.01)
            pause = min(pause * 1.5, 0.5)

    def _write_decision(self, dkey: bytes, nodes: int, incarnation: int | str,
                        recs: dict[int, set[int]]) -> dict[str, Any]:
        decision = {"incarnation": incarnation,
                    "step": _newest_common(recs.values()) if recs else None,
                    "ranks_recorded": len(recs),
                    "missing": [r for r in range(nodes) if r not in recs],
                    "decided_by": self.rank, "at": round(time.time(), 3)}
        body = json.dumps(decision, separators=(",", ":")).encode()
        r = self.etcd.txn([absent(dkey)], [put_op(dkey, body)], [get_op(dkey)], retry=True)
        if r.succeeded:
            return decision
        got = r.responses[0].response_range.kvs
        if not got:
            raise EtcdError(f"the restore decision {dkey.decode()} vanished while read")
        stored: dict[str, Any] = json.loads(got[0].value)
        return stored

    def decide_current(self, nodes: int, *, timeout: float = 30.0) -> dict[str, Any]:
        """The step a restoring node brings back, the same for every node restoring now.

        One read (at one revision) of ``restore/current`` and of every rank's record. The
        decision stands while its mod revision is above every record's mod revision: no
        rank recorded anything since, so the newest step common to the records is still
        what it says. Otherwise the newest common step is computed and written with a
        compare-and-set on the decision's mod revision (absent: create-if-absent); the
        loser of a race reads the winner's. A rank with no record lists under
        ``missing`` and constrains nothing, as in :meth:`decide_restore` after its wait;
        with no record at all the step is None.

        Why this is safe without a round protocol: a restoring node's own record is its
        previous life's, and no record of a rank that is down can gain a step, so the
        newest step complete on every rank cannot move while some rank restores (a step
        needs every rank to complete it), and nodes restoring together read the same one.

        Raises:
            EtcdError: etcd did not answer within ``timeout`` (one line).
        """
        dkey = f"{self.prefix}restore/current".encode()
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                # First the cheap question: does a decision exist that no record changed
                # after? The range returns only the keys (no values) of records changed
                # since, none while it stands (etcd 3.4 filters the keys by mod revision
                # but not a count_only count). Most of the N nodes of a whole-job restart
                # get their answer here instead of reading N records each.
                kv, _rev = self.etcd.get(dkey)
                if kv is not None:
                    r = self.etcd.txn([], [get_op(dkey), pb.RequestOp(
                        request_range=pb.RangeRequest(
                            key=self.steps_prefix, range_end=prefix_end(self.steps_prefix),
                            keys_only=True, min_mod_revision=kv.mod_revision + 1))],
                        retry=True)
                    now = r.responses[0].response_range.kvs
                    if now and now[0].mod_revision == kv.mod_revision and \
                            not r.responses[1].response_range.kvs:
                        recorded: dict[str, Any] = json.loads(now[0].value)
                        return recorded
                r = self.etcd.txn([], [get_op(dkey), pb.RequestOp(
                    request_range=pb.RangeRequest(key=self.steps_prefix,
                                                  range_end=prefix_end(self.steps_prefix)))],
                    retry=True)
                got = r.responses[0].response_range.kvs
                kvs = r.responses[1].response_range.kvs
                newest_record = max((kv.mod_revision for kv in kvs), default=0)
                if got and got[0].mod_revision > newest_record:
                    newer: dict[str, Any] = json.loads(got[0].value)
                    return newer
                recs = _parse(kvs, self.steps_prefix, nodes)
                decision = {"step": _newest_common(recs.values()) if recs else None,
                            "ranks_recorded": len(recs),
                            "missing": [x for x in range(nodes) if x not in recs],
                            "decided_by": self.rank, "at": round(time.time(), 3)}
                body = json.dumps(decision, separators=(",", ":")).encode()
                guard = mod_is(dkey, got[0].mod_revision) if got else absent(dkey)
                if self.etcd.txn([guard], [put_op(dkey, body)], retry=True).succeeded:
                    return decision
                continue  # another node decided meanwhile: read its decision
            except EtcdError as exc:
                last = exc
            time.sleep(0.2)
        raise EtcdError(f"no restore decision within {timeout:g} s ({last or 'contention'})")

    def load(self) -> set[int]:
        """This rank's record as etcd holds it (a previous life's), which later
        :meth:`record` calls extend; empty when absent."""
        kv, _rev = self.etcd.get(self.key)
        steps: set[int] = set()
        if kv is not None:
            try:
                steps = {int(s) for s in json.loads(kv.value).get("steps", [])}
            except (ValueError, TypeError, AttributeError):
                steps = set()
        self._steps = steps
        return set(steps)

    @property
    def recorded(self) -> set[int]:
        """The steps of this rank's record as last written or loaded."""
        return set(self._steps)

    # ------------------------------------------------------------------ trio adapters

    async def arecord(self, steps: Iterable[int]) -> int:
        steps = list(steps)
        return await trio.to_thread.run_sync(lambda: self.record(steps),
                                             abandon_on_cancel=True)

    async def adecide_restore(self, nodes: int, incarnation: int | str, *,
                              wait_s: float = WAIT_S, timeout: float = 30.0) -> dict[str, Any]:
        return await trio.to_thread.run_sync(
            lambda: self.decide_restore(nodes, incarnation, wait_s=wait_s, timeout=timeout),
            abandon_on_cancel=True)


def _parse(kvs: Any, steps_prefix: bytes, nodes: int | None) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for kv in kvs:
        try:
            rank = int(kv.key[len(steps_prefix):])
            steps = {int(s) for s in json.loads(kv.value).get("steps", [])}
        except (ValueError, TypeError, AttributeError):
            continue
        if nodes is None or 0 <= rank < nodes:
            out[rank] = steps
    return out


def _newest_common(sets: Iterable[set[int]]) -> int | None:
    it = iter(sets)
    try:
        common = set(next(it))
    except StopIteration:
        return None
    for s in it:
        common &= s
    return max(common) if common else None
