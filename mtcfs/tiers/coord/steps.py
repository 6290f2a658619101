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

Records read back are decoded strictly (:func:`decode_step_record`,
:func:`decode_decision`). A step record that does not decode counts as no record (refused:
``untrusted.REJECTED``, kind ``steps``); a decision that does not decode counts as no
decision (kind ``restore``): it is decided again and replaced with a compare-and-set on
its mod revision, so every member reads the same replacement.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Iterable

import trio

from mtcfs.base import untrusted
from mtcfs.base.limits import MAX_NODES, MAX_STEP
from mtcfs.base.untrusted import BadRecord
from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdError, absent, get_op, mod_is, prefix_end, put_op,
)
from mtcfs.tiers.coord.keys import rank_key, rank_of_key

#: Steps a rank's record keeps (the newest).
KEEP = 16
#: Seconds decide_restore waits for every rank's record before deciding from those it has.
WAIT_S = 5.0
#: Most steps a step record may list when read back (this code writes at most ``keep``).
MAX_RECORD_STEPS = 1024
#: Largest step record accepted, bytes.
MAX_RECORD_BYTES = 64 * 1024
#: Largest restore decision accepted, bytes (its ``missing`` list may name every rank).
MAX_DECISION_BYTES = 1 << 20
#: Longest ``boot`` a step record may carry, and an ``incarnation`` given as a string.
MAX_ID_LEN = 64


@dataclass(frozen=True)
class StepRecord:
    """One rank's step record as etcd holds it (``steps/<rank:06d>``)."""

    rank: int
    steps: frozenset[int]
    boot: str = ""
    at: float = 0.0

    def encode(self) -> bytes:
        """The JSON :func:`decode_step_record` reads (steps ascending)."""
        return json.dumps({"rank": self.rank, "boot": self.boot, "steps": sorted(self.steps),
                           "at": self.at}, separators=(",", ":")).encode()


def decode_step_record(body: bytes | str, rank: int | None = None) -> StepRecord:
    """The step record in ``body`` (``{"rank", "boot", "steps", "at"}``; other fields are
    ignored).

    Args:
        body: the value read from etcd; rank: the rank its key names (the body must name
            the same), None: not checked.

    Raises:
        BadRecord: not a JSON object of at most :data:`MAX_RECORD_BYTES`; ``rank`` missing,
            not an integer in ``0..MAX_NODES-1`` or not ``rank``; ``steps`` missing, not an
            array of at most :data:`MAX_RECORD_STEPS` integers in ``0..MAX_STEP``;
            ``boot`` not a string of at most 64 characters; ``at`` not a finite number
            >= 0 (one line).
    """
    d = untrusted.json_object(body, MAX_RECORD_BYTES)
    got = untrusted.field_int(d, "rank", 0, MAX_NODES - 1)
    if rank is not None and got != rank:
        raise BadRecord(f"the record names rank {got}, its key rank {rank}")
    return StepRecord(rank=got,
                      steps=frozenset(untrusted.field_int_list(d, "steps", 0, MAX_STEP,
                                                               MAX_RECORD_STEPS)),
                      boot=untrusted.field_str(d, "boot", MAX_ID_LEN, default=""),
                      at=untrusted.field_float(d, "at", default=0.0))


def decode_decision(body: bytes | str) -> dict[str, Any]:
    """A restore decision (``restore/<incarnation>`` or ``restore/current``) as a dict of
    the fields :class:`StepRecords` writes: ``step`` (int or None), ``ranks_recorded``,
    ``missing`` (ranks), ``decided_by``, ``at`` and, when present, ``incarnation`` (int or
    str). Other fields are dropped.

    Raises:
        BadRecord: not a JSON object of at most :data:`MAX_DECISION_BYTES`; ``step``
            missing, or neither null nor an integer in ``0..MAX_STEP``; ``ranks_recorded``
            not in ``0..MAX_NODES``; ``missing`` not an array of ranks; ``decided_by`` not
            a rank; ``at`` not a finite number >= 0; ``incarnation`` neither an integer
            >= 0 nor a string of at most 64 characters (one line).
    """
    d = untrusted.json_object(body, MAX_DECISION_BYTES)
    if "step" not in d:
        raise BadRecord("step is missing")
    step = None if d["step"] is None else untrusted.field_int(d, "step", 0, MAX_STEP)
    out: dict[str, Any] = {}
    if "incarnation" in d:
        inc = d["incarnation"]
        out["incarnation"] = untrusted.field_str(d, "incarnation", MAX_ID_LEN) \
            if isinstance(inc, str) else untrusted.field_int(d, "incarnation")
    out.update({
        "step": step,
        "ranks_recorded": untrusted.field_int(d, "ranks_recorded", 0, MAX_NODES, default=0),
        "missing": untrusted.field_int_list(d, "missing", 0, MAX_NODES - 1, MAX_NODES,
                                            default=[]),
        "decided_by": untrusted.field_int(d, "decided_by", 0, MAX_NODES - 1, default=0),
        "at": untrusted.field_float(d, "at", default=0.0)})
    return out


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
        self.key = self.steps_prefix + rank_key(rank)
        self._steps: set[int] = set()

    # ------------------------------------------------------------------ this rank's record

    def record(self, steps: Iterable[int]) -> int:
        """Replace this rank's record with ``steps`` (the newest ``keep``); the revision."""
        self._steps = set(sorted(set(int(s) for s in steps))[-self.keep:])
        body = StepRecord(self.rank, frozenset(self._steps), self.boot,
                          round(time.time(), 3)).encode()
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
                bad = 0  # mod revision of a decision that does not decode (replaced)
                if got:
                    try:
                        return decode_decision(got[0].value)
                    except BadRecord as exc:
                        untrusted.REJECTED.reject("restore", got[0].key, str(exc))
                        bad = int(got[0].mod_revision)
                count = int(r.responses[1].response_range.count)
                if count >= nodes or time.monotonic() >= wait_until:
                    recs = self.records(nodes)
                    if len(recs) >= nodes or time.monotonic() >= wait_until:
                        won = self._write_decision(dkey, nodes, incarnation, recs, bad)
                        if won is not None:
                            return won
                        continue  # the one that won does not decode: decide again
            except EtcdError as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise EtcdError(f"no restore decision for incarnation {incarnation} within "
                                f"{timeout:g} s ({last or 'ranks still recording'})")
            time.sleep(min(pause, max(0.0, min(wait_until, deadline) - time.monotonic()))
                       or 0.01)
            pause = min(pause * 1.5, 0.5)

    def _write_decision(self, dkey: bytes, nodes: int, incarnation: int | str,
                        recs: dict[int, set[int]], replace: int = 0) -> dict[str, Any] | None:
        """Write this member's decision unless one exists (``replace``: the mod revision
        of one that does not decode, replaced by a compare-and-set); the decision that
        counts, or None when it does not decode (refused)."""
        decision = {"incarnation": incarnation,
                    "step": _newest_common(recs.values()) if recs else None,
                    "ranks_recorded": len(recs),
                    "missing": [r for r in range(nodes) if r not in recs],
                    "decided_by": self.rank, "at": round(time.time(), 3)}
        body = json.dumps(decision, separators=(",", ":")).encode()
        guard = mod_is(dkey, replace) if replace else absent(dkey)
        r = self.etcd.txn([guard], [put_op(dkey, body)], [get_op(dkey)], retry=True)
        if r.succeeded:
            return decision
        got = r.responses[0].response_range.kvs
        if not got:
            raise EtcdError(f"the restore decision {dkey.decode()} vanished while read")
        try:
            return decode_decision(got[0].value)
        except BadRecord as exc:
            untrusted.REJECTED.reject("restore", got[0].key, str(exc))
            return None

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
                        recorded = self._decision_or_none(now[0])
                        if recorded is not None:
                            return recorded
                r = self.etcd.txn([], [get_op(dkey), pb.RequestOp(
                    request_range=pb.RangeRequest(key=self.steps_prefix,
                                                  range_end=prefix_end(self.steps_prefix)))],
                    retry=True)
                got = r.responses[0].response_range.kvs
                kvs = r.responses[1].response_range.kvs
                newest_record = max((kv.mod_revision for kv in kvs), default=0)
                if got and got[0].mod_revision > newest_record:
                    # (one that does not decode is taken for stale: replaced below)
                    newer = self._decision_or_none(got[0])
                    if newer is not None:
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

    @staticmethod
    def _decision_or_none(kv: Any) -> dict[str, Any] | None:
        """The decision ``kv`` holds, or None when it does not decode (refused)."""
        try:
            return decode_decision(kv.value)
        except BadRecord as exc:
            untrusted.REJECTED.reject("restore", kv.key, str(exc))
            return None

    def load(self) -> set[int]:
        """This rank's record as etcd holds it (a previous life's), which later
        :meth:`record` calls extend; empty when absent, or when it does not decode
        (refused: the next :meth:`record` replaces it)."""
        kv, _rev = self.etcd.get(self.key)
        steps: set[int] = set()
        if kv is not None:
            try:
                steps = set(decode_step_record(kv.value, self.rank).steps)
            except BadRecord as exc:
                untrusted.REJECTED.reject("steps", kv.key, str(exc))
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
    """rank -> steps of the records in ``kvs`` (ranks < ``nodes``); a key or record that
    does not decode is left out (the rank counts as without a record) and refused."""
    out: dict[int, set[int]] = {}
    for kv in kvs:
        try:
            rank = rank_of_key(kv.key, steps_prefix)
            steps = set(decode_step_record(kv.value, rank).steps)
        except BadRecord as exc:
            untrusted.REJECTED.reject("steps", kv.key, str(exc))
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
