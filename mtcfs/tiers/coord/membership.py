"""Who is in the job, kept in etcd: one leased key per live member.

Each member holds an etcd lease and keeps it alive; its record (rank, address, topology
labels, boot id, incarnation) lives at ``<prefix>members/<rank:06d>`` attached to that
lease. A member is alive while its lease is: a daemon that dies stops renewing, etcd
expires the lease after its TTL and deletes the record, and every member's watch sees the
delete. Nothing of the liveness judgement is ours (no heartbeats between nodes, no
timeouts of our own beyond the TTL).

Registration is a create-if-absent transaction. When the key exists:

* with this member's boot id: it is this daemon's own record (a lease it lost and is
  re-attaching): the record moves to the new lease;
* with another boot id: another daemon holds the rank. A daemon that crashed and restarted
  within the TTL finds its previous life's record; registration waits (``wait_s``, by
  default 1.5 x TTL) for that lease to expire, then takes the rank; at once when the
  record names the address this daemon has bound (``address_is_mine``: the holder
  cannot be listening there, so it is dead). When the other holder's lease is still
  renewed after the wait, that proves little (etcd lets any authenticated user renew any
  lease: docs/security-etcd.md), so the holder is asked: registration writes its record
  over the holder's with ``takes_over`` naming it (:meth:`Membership._take_over`). A live
  holder's view sees the change and its keepalive writes its record back by
  compare-and-set (:meth:`Membership._defend`): two daemons were started as the same
  rank, and registration refuses with :class:`RankTaken` (one line naming the holder). A
  dead holder cannot: after :func:`defend_s` the newcomer commits by compare-and-set on
  its takeover's revision and the rank is its own. A holder that finds a committed
  takeover gives the rank up and says so (``error``). A holder whose record
  says it cannot answer (``defends`` false: no view, or a daemon from before the field)
  is refused at once after the wait, as before.

Load on etcd (docs/benchmarks.md, "Coordination at scale"): one key per member, one
keepalive request per member every TTL/3, and one watch per :class:`MemberView` over the
members' prefix, so a membership change is delivered once per view (N events per change
when each of N daemons keeps its own).

Records read back are decoded strictly (:meth:`MemberRecord.decode`, the key's rank the
body's): one that does not decode is no member's, left out of the view and reported
(``untrusted.REJECTED``, kind ``member``); at the registering rank's own key it holds the
rank for nobody, so registration takes it at once.

Threads: :meth:`Membership.join` blocks; the keepalive loop and the watch run in daemon
threads under :func:`mtcfs.base.untrusted.supervise` (any exception: logged, restarted
after a pause, bounded; the view is read again before the watch resumes); every wait is
bounded. Trio code calls the async wrappers (``ajoin``,
``await_for``, ``aleave``), which run the blocking calls in worker threads.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from collections.abc import Callable, Iterable
from typing import Any

import trio

from mtcfs.base import untrusted
from mtcfs.base.limits import MAX_LABEL_LEN, MAX_LABELS, MAX_NODES
from mtcfs.base.untrusted import BadRecord
from mtcfs.tiers.coord.etcd import (
    Etcd, EtcdCompacted, EtcdError, EtcdPermissionDenied, absent, count_op, get_op, mod_is,
    prefix_end, put_op,
)
from mtcfs.tiers.coord.keys import rank_key, rank_of_key

log = logging.getLogger(__name__)

#: Seconds a member's lease lives without a renewal (etcd's TTL), when the caller gives
#: none; the daemon gives the peer tier's liveness (5 s, mtcfs/tiers/peer/tier_membership.py).
TTL_S = 10
#: Seconds between watch progress requests (membership needs events, not progress).
PROGRESS_S = 30.0
#: A gathering view (:class:`MemberView`, ``expect``) counts the members at most this
#: often and at least this often (seconds; :func:`gather_poll_s`) ...
GATHER_POLL_MIN_S = 0.25
GATHER_POLL_MAX_S = 2.0
#: ... and stops gathering when the count has not changed for this long (seconds: a member
#: is not coming, the view watches the prefix and gets that member's join when it comes)
GATHER_SETTLE_S = 5.0
#: or after this long, whatever the count (seconds).
GATHER_MAX_S = 120.0
#: At most this many wanted ranks (:meth:`MemberView.want`) are read by one poll (etcd
#: refuses transactions of more than 128 operations by default).
WANTED_PER_POLL = 64
#: Seconds the member view waits before it watches again after etcd's auth refused it.
DENIED_PAUSE_S = 10.0
#: Largest member record accepted, bytes (one is ~200 bytes; labels are at most 64 x 256).
MAX_MEMBER_BYTES = 64 * 1024
#: Longest Peer address a record may name (``host:port``: a DNS name is at most 253).
MAX_ADDRESS_LEN = 300
#: Longest boot id a record may carry (this code writes 16 hex digits).
MAX_BOOT_LEN = 64
#: Latest ``since`` (Unix time, s) a record may carry: year 5138, a time the C library
#: can still format.
MAX_SINCE = 1e11


def defend_s(ttl_s: float) -> float:
    """Seconds a registration that took a rank over waits for its holder to write its
    record back: a TTL (a holder that cannot answer within it would have lost its lease
    anyway, were it not renewed by someone else), at least 3 s."""
    return max(3.0, float(ttl_s))


class RankTaken(EtcdError):
    """Another live member holds this rank (two daemons started as the same rank)."""


@dataclass
class MemberRecord:
    """One member as etcd holds it (JSON at ``<prefix>members/<rank:06d>``)."""

    rank: int
    address: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    boot: str = ""
    incarnation: int = 0
    since: float = 0.0
    #: its holder watches its own key and writes it back when another daemon takes it
    #: over (a member with a view); False in records of daemons from before the field
    defends: bool = False
    #: the boot id of the holder this record took the rank from ("" when it was free)
    takes_over: str = ""

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, body: bytes | str, rank: int | None = None) -> "MemberRecord":
        """The record in ``body`` (what :meth:`encode` writes; unknown fields are ignored).

        Args:
            body: the value read from etcd.
            rank: the rank the record's key names; the body must name the same.

        Raises:
            BadRecord: not a JSON object of at most :data:`MAX_MEMBER_BYTES`; ``rank``
                missing or not an integer in ``0..MAX_NODES-1`` (or not ``rank``);
                ``address`` or ``boot`` not a short printable string; ``labels`` not an
                object of short printable strings; ``incarnation`` not an integer >= 0;
                ``since`` not a finite number >= 0; ``defends`` not a boolean;
                ``takes_over`` not a short printable string (one line).
        """
        d = untrusted.json_object(body, MAX_MEMBER_BYTES)
        got = untrusted.field_int(d, "rank", 0, MAX_NODES - 1)
        if rank is not None and got != rank:
            raise BadRecord(f"the record names rank {got}, its key rank {rank}")
        rec = cls(rank=got,
                  address=_printable(untrusted.field_str(d, "address", MAX_ADDRESS_LEN,
                                                         default=""), "address"),
                  labels=dict(untrusted.field_str_map(d, "labels", MAX_LABELS, MAX_LABEL_LEN,
                                                     default=None) or {}),
                  boot=_printable(untrusted.field_str(d, "boot", MAX_BOOT_LEN, default=""),
                                  "boot"),
                  incarnation=untrusted.field_int(d, "incarnation", default=0),
                  since=untrusted.field_float(d, "since", 0.0, MAX_SINCE, default=0.0),
                  defends=_field_bool(d, "defends"),
                  takes_over=_printable(untrusted.field_str(d, "takes_over", MAX_BOOT_LEN,
                                                            default=""), "takes_over"))
        for k, v in rec.labels.items():
            _printable(k, "a label's name")
            _printable(v, f"label {k}")
        return rec


def _field_bool(d: dict[str, Any], key: str) -> bool:
    """``d[key]`` if it is a JSON boolean (False when absent)."""
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise BadRecord(f"{key} is a JSON {untrusted.json_type(v)}, not a boolean")
    return v


def _printable(s: str, what: str) -> str:
    """``s`` if it holds no control character (it is logged and shown in status)."""
    if not s.isprintable():
        raise BadRecord(f"{what} holds a control character")
    return s


def member_key(prefix: str, rank: int) -> bytes:
    return f"{prefix}members/".encode() + rank_key(rank)


class Membership:
    """This member's registration and a live view of every member.

    Args:
        etcd: the job's etcd client (may be shared by many members in one process).
        prefix: the job's key prefix (``/mtcfs/<job>/``).
        rank: this member's rank.
        address: where peers reach it (``host:port``); labels: topology (zone, rack, ...).
        ttl_s: the lease's TTL; the keepalive runs every ``ttl_s / 3``.
        boot_id: this daemon's life (a new one per start); incarnation: the job's.
        watch: keep a watch-fed view of the members (False: register and renew only).
        view: a :class:`MemberView` shared with other members of this process (not
            stopped by this member); None: its own when ``watch``.
        expect: the job's size (``nodes=``): its own view gathers the joins of a
            whole-job start instead of watching each (:class:`MemberView`); None: it
            watches from its start. Not used with ``view`` (that view's own ``expect``
            holds).
    """

    def __init__(self, etcd: Etcd, prefix: str, rank: int, address: str = "",
                 labels: dict[str, str] | None = None, *, ttl_s: int = TTL_S,
                 boot_id: str | None = None, incarnation: int = 0, watch: bool = True,
                 progress_s: float = PROGRESS_S, view: "MemberView | None" = None,
                 address_is_mine: bool = False, expect: int | None = None) -> None:
        self.etcd = etcd
        self.prefix = prefix
        self.rank = rank
        self.ttl_s = int(ttl_s)
        self.record = MemberRecord(rank=rank, address=address, labels=dict(labels or {}),
                                   boot=boot_id or uuid.uuid4().hex[:16],
                                   incarnation=incarnation)
        self.key = member_key(prefix, rank)
        self.members_prefix = f"{prefix}members/".encode()
        self.lease = 0
        #: this daemon has bound ``address`` (only one process can): a record of another
        #: life that names it is a dead daemon's, taken over at once instead of waiting for
        #: its lease (a replacement on the same host and port, its store wiped)
        self.address_is_mine = address_is_mine
        self.error = ""            # why this member lost its registration ("" while fine)
        #: the last call to etcd for this member (registration, keepalive) was answered
        self.connected = False
        self._renewed = time.monotonic()  # when the lease was last granted or renewed
        self.counters: dict[str, int] = {"keepalives": 0, "reregistrations": 0,
                                         "etcd_errors": 0}
        self._own_view = view is None and watch
        self.members_view: MemberView | None = (
            view if view is not None else MemberView(
                etcd, prefix, progress_s, expect,
                poll_max_s=min(GATHER_POLL_MAX_S, defend_s(ttl_s) / 3)) if watch else None)
        # only a member that sees its own key change can answer a takeover
        self.record.defends = self.members_view is not None
        self._stop = threading.Event()
        #: set to run the keepalive loop at once (the view saw this rank's key change)
        self._wake = threading.Event()
        #: when a gap of more than the TTL between two renewals last ended (monotonic)
        self._gap_ended = -math.inf
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ registration

    def join(self, wait_s: float | None = None) -> None:
        """Register (lease + record), then start the keepalive and the watch.

        Raises:
            RankTaken: another daemon still held this rank after ``wait_s``.
            EtcdError: etcd did not answer (one line).
        """
        self._register(1.5 * self.ttl_s if wait_s is None else wait_s)
        t = threading.Thread(target=untrusted.supervise, daemon=True,
                             args=(f"rank {self.rank}'s lease keepalive", self._keepalive_run,
                                   self._stop),
                             name=f"member-{self.rank}-keepalive")
        self._threads.append(t)
        if self.members_view is not None:
            self.members_view.listen(self.rank, self._wake.set)
        t.start()
        if self._own_view and self.members_view is not None:
            self.members_view.start()


    def _register(self, wait_s: float) -> None:
        deadline = time.monotonic() + wait_s
        lease, _ttl = self.etcd.grant(self.ttl_s)
        try:
            while True:
                self.record.since = time.time()
                body = self.record.encode()
                r = self.etcd.txn([absent(self.key)], [put_op(self.key, body, lease)],
                                  [get_op(self.key)], retry=True)
                if r.succeeded:
                    break
                kvs = r.responses[0].response_range.kvs
                if not kvs:
                    continue  # expired between the compare and the read
                kv = kvs[0]
                try:
                    holder: MemberRecord | None = MemberRecord.decode(kv.value, self.rank)
                except BadRecord as exc:
                    # not a member's record (no daemon of ours wrote it): nobody holds the
                    # rank through it, so it is replaced at once, as a dead holder's is
                    untrusted.REJECTED.reject("member", kv.key, str(exc))
                    holder = None
                if holder is None or holder.boot == self.record.boot or kv.lease == lease or (
                        self.address_is_mine and holder.address == self.record.address):
                    # (or the record names the address this daemon listens on now: its
                    # holder cannot be listening there any more, so it is dead)
                    # our own record (a lease lost and re-attached): move it to this lease
                    r2 = self.etcd.txn([mod_is(self.key, kv.mod_revision)],
                                       [put_op(self.key, body, lease)], retry=True)
                    if r2.succeeded:
                        break
                    continue
                if time.monotonic() >= deadline and holder.defends:
                    # Its lease outlived the wait. A lease can be kept alive by anyone
                    # etcd lets renew it (any authenticated user, whatever its roles:
                    # docs/security-etcd.md), so ask the holder itself: take the record
                    # over; a live holder writes it back at once, a dead one cannot.
                    taken = self._take_over(kv, holder, lease)
                    if taken:
                        break
                    if taken is None:  # the key changed meanwhile: look again
                        time.sleep(0.25)
                        if self.etcd.keepalive(lease) <= 0:
                            lease, _ttl = self.etcd.grant(self.ttl_s)
                        continue
                    raise RankTaken(
                        f"rank {self.rank} is held by another live member (boot "
                        f"{holder.boot}, address {holder.address or '?'}), which wrote its "
                        f"record back when this daemon took it over: two daemons started "
                        f"as the same rank?")
                if time.monotonic() >= deadline:
                    raise RankTaken(
                        f"rank {self.rank} is held by another live member (boot "
                        f"{holder.boot}, address {holder.address or '?'}, since "
                        f"{time.strftime('%H:%M:%S', time.localtime(holder.since))}): "
                        f"two daemons started as the same rank?")
                time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))
                # keep the lease we wait with alive (the wait may outlast its TTL)
                if self.etcd.keepalive(lease) <= 0:
                    lease, _ttl = self.etcd.grant(self.ttl_s)
        except BaseException:
            self.etcd.revoke(lease)
            raise
        old, self.lease = self.lease, lease
        self.error = ""
        self.connected = True
        self._renewed = time.monotonic()
        if old:
            try:
                self.etcd.revoke(old)
            except EtcdError:
                pass

    def _take_over(self, kv: Any, holder: MemberRecord, lease: int) -> bool | None:
        """Ask ``holder`` (the record ``kv``, whose lease outlived the registration's wait)
        whether it is alive: write this member's record over it with ``takes_over`` naming
        it, still on the holder's lease (so that if this daemon dies meanwhile, a live
        holder has lost nothing), and watch the key for :func:`defend_s`. A live holder
        (its view sees the change) writes its record back; a dead one cannot. Then commit
        by compare-and-set on the revision of the takeover: the record moves to this
        member's ``lease`` and the old lease, which holds no key any more, is revoked.

        Returns:
            True: the rank is this member's; False: the holder wrote its record back;
            None: the key changed before the takeover or to a third record meanwhile, or
            this member's lease ended (look again).

        Raises:
            EtcdError: etcd did not answer.
        """
        ask = MemberRecord(**{**asdict(self.record), "takes_over": holder.boot,
                              "since": time.time()})
        try:
            r = self.etcd.txn([mod_is(self.key, kv.mod_revision)],
                              [put_op(self.key, ask.encode(), kv.lease or lease)], retry=True)
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise
            return None  # the holder's lease ended meanwhile: the key is free
        if not r.succeeded:
            return None
        asked_at = r.revision  # the takeover put's revision: the key's while nobody answers
        log.warning("rank %d: its record's holder (boot %s, address %s) kept its lease past "
                    "the wait: taking the rank over, unless it answers within %.0f s",
                    self.rank, holder.boot, holder.address or "?", defend_s(self.ttl_s))

        def answered() -> bool | None:
            cur, _rev = self.etcd.get(self.key)
            if cur is not None and cur.mod_revision == asked_at:
                return None  # no answer yet
            try:
                now = MemberRecord.decode(cur.value, self.rank) if cur is not None else None
            except BadRecord:
                now = None
            return True if now is not None and now.boot == holder.boot else False

        end = time.monotonic() + defend_s(self.ttl_s)
        renew_at = time.monotonic()
        while time.monotonic() < end:
            time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            if time.monotonic() >= renew_at:  # the wait may outlast the lease's TTL
                if self.etcd.keepalive(lease) <= 0:
                    return None
                renew_at = time.monotonic() + self.ttl_s / 3
            got = answered()
            if got is not None:
                return False if got else None
        # committed without takes_over: a holder that answers only now finds a record that
        # does not ask it, and knows it lost the rank (_defend) instead of taking it back
        mine = MemberRecord(**{**asdict(self.record), "takes_over": "", "since": time.time()})
        r = self.etcd.txn([mod_is(self.key, asked_at)],
                          [put_op(self.key, mine.encode(), lease)], retry=True)
        if not r.succeeded:  # an answer in the last moment
            return False if answered() else None
        if kv.lease and kv.lease != lease:
            try:
                self.etcd.revoke(kv.lease)  # holds no key now: nobody need keep it alive
            except EtcdError:
                pass
        log.warning("rank %d: taken over from boot %s, which did not answer", self.rank,
                    holder.boot)
        return True

    def _defend(self) -> bool:
        """Answer a takeover of this rank (another daemon's registration outwaited this
        member's lease: :meth:`_take_over`) by writing this member's record back, by
        compare-and-set on what the key holds. Returns False when this member no longer
        holds the rank (``error`` says so): another daemon's record is there and does not
        ask this member (its takeover committed), or this member could not renew its lease
        for more than a TTL lately (the other daemon may rightly have taken it for dead).
        Reads only the view unless a takeover names this member.
        """
        view = self.members_view
        if view is None:
            return True
        rec = view.record(self.rank)
        if rec is None or rec.boot == self.record.boot:
            return True
        now = time.monotonic()
        lapsed = now - self._renewed > self.ttl_s or now - self._gap_ended < 3 * self.ttl_s
        if rec.takes_over == self.record.boot and not lapsed:
            cur, _rev = self.etcd.get(self.key)
            if cur is None:
                return True  # gone meanwhile: the keepalive registers again
            try:
                there = MemberRecord.decode(cur.value, self.rank)
            except BadRecord:
                return True
            if there.boot == self.record.boot:
                return True
            if there.takes_over == self.record.boot:
                self.record.since = time.time()
                r = self.etcd.txn([mod_is(self.key, cur.mod_revision)],
                                  [put_op(self.key, self.record.encode(), self.lease)],
                                  retry=True)
                if r.succeeded:
                    log.warning("rank %d: another daemon (boot %s, address %s) tried to take "
                                "this rank over; its record is written back", self.rank,
                                there.boot, there.address or "?")
                    return True
                return True  # changed meanwhile: the next wake looks again
            rec = there
        why = ("after this one could not renew its lease for more than "
               f"{self.ttl_s} s" if lapsed else "and this one did not answer in time")
        self.error = (f"rank {self.rank} was taken over by another daemon (boot {rec.boot}, "
                      f"address {rec.address or '?'}) {why}: this daemon no longer holds "
                      "it; unmount it")
        log.error("rank %d: %s", self.rank, self.error)
        return False

    def leave(self) -> None:
        """Stop renewing and revoke the lease (the record goes at once)."""
        self._stop.set()
        self._wake.set()
        self._join_threads()  # first: a renewal in flight must not see the revoke
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except EtcdError as exc:
                log.warning("rank %d: cannot revoke its lease (it expires in %d s): %s",
                            self.rank, self.ttl_s, exc)
        self.lease = 0

    def stop(self) -> None:
        """Stop renewing without revoking (as a killed daemon: the lease expires)."""
        self._stop.set()
        self._wake.set()
        self._join_threads()

    def _join_threads(self) -> None:
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=self.ttl_s + 2)
        self._threads = []
        if self.members_view is not None:
            self.members_view.unlisten(self.rank, self._wake.set)
            if self._own_view:
                self.members_view.stop()

    def renewed_ago_s(self) -> float:
        """Seconds since the lease was last granted or renewed (above its TTL: it expired)."""
        return time.monotonic() - self._renewed

    def renew(self) -> int:
        """One keepalive; returns the remaining TTL (<= 0: the lease is gone)."""
        ttl = self.etcd.keepalive(self.lease)
        self.counters["keepalives"] += 1
        return ttl

    def _keepalive_run(self) -> None:
        """The keepalive loop (under :func:`untrusted.supervise`: an error restarts it);
        after a :class:`RankTaken` it stays parked until :meth:`leave`."""
        self._keepalive_loop()
        self._stop.wait()

    def _record_missing(self) -> bool:
        """Whether this member's own view lacks this member's record while its lease
        lives: someone deleted the key or wrote what is no member's record over it (it left
        the view, as it does from every peer's). Registering again puts it back on this
        member's lease."""
        view = self.members_view
        # (only its own view, loaded right after it registered: a view shared by many
        # members of a process, as in the benchmark's harness, may lag their puts)
        return self._own_view and view is not None and not view.alive(self.rank)

    def _keepalive_loop(self) -> None:
        every = max(self.ttl_s / 3.0, 0.2)
        last_ok = time.monotonic()
        missing = 0  # renewals in a row that found this member's record gone from the view
        while True:
            self._wake.wait(every)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                if not self._defend():  # first: a takeover is answered at once
                    return
                ttl = self.renew()
                self.connected = True
                if ttl > 0:
                    now = time.monotonic()
                    if now - last_ok > self.ttl_s:
                        self._gap_ended = now
                    last_ok = self._renewed = now
                    missing = missing + 1 if self._record_missing() else 0
                    if missing < 2:
                        continue
                    # (two renewals in a row: not the moment between a put and its event)
                    log.warning("rank %d: its member record in etcd was deleted or is not a "
                                "member's any more (someone wrote the key): registering "
                                "again", self.rank)
                    missing = 0
                if self._stop.is_set():
                    return  # leaving: the lease was revoked on purpose
                if ttl <= 0:
                    if not self._defend():  # a takeover committed: not taken back
                        return
                    log.warning("rank %d: its etcd lease expired; registering again",
                                self.rank)
                self.counters["reregistrations"] += 1
                self._register(1.5 * self.ttl_s)
                last_ok = time.monotonic()
            except RankTaken as exc:
                self.error = str(exc)
                log.error("rank %d: %s", self.rank, exc)
                return
            except EtcdError as exc:
                self.counters["etcd_errors"] += 1
                self.connected = False
                if time.monotonic() - last_ok > self.ttl_s:
                    self.error = f"lease not renewed for {self.ttl_s} s: {exc}"
                log.warning("rank %d: keepalive failed: %s", self.rank, exc)

    # ------------------------------------------------------------------ the view

    def view(self) -> dict[int, MemberRecord]:
        """The live members (rank -> record), as the watch last saw them."""
        return self._need_view().view()

    def alive(self, rank: int) -> bool:
        return self._need_view().alive(rank)

    def address(self, rank: int) -> str | None:
        return self._need_view().address(rank)

    def wait_for(self, n: int, timeout: float) -> dict[int, MemberRecord]:
        """Block until at least ``n`` members are live (or ``timeout``); the view.

        Raises:
            TimeoutError: fewer than ``n`` after ``timeout`` (one line).
        """
        return self._need_view().wait_for(n, timeout)

    def want(self, ranks: Iterable[int]) -> None:
        """These ranks' records are needed now (:meth:`MemberView.want`); no-op without
        a view."""
        if self.members_view is not None:
            self.members_view.want(ranks)

    def _need_view(self) -> "MemberView":
        if self.members_view is None:
            raise RuntimeError(f"rank {self.rank} keeps no membership view (watch=False)")
        return self.members_view

    # ------------------------------------------------------------------ trio adapters

    async def ajoin(self, wait_s: float | None = None) -> None:
        await trio.to_thread.run_sync(lambda: self.join(wait_s), abandon_on_cancel=True)

    async def await_for(self, n: int, timeout: float) -> dict[int, MemberRecord]:
        return await trio.to_thread.run_sync(lambda: self.wait_for(n, timeout),
                                             abandon_on_cancel=True)

    async def aleave(self) -> None:
        await trio.to_thread.run_sync(self.leave, abandon_on_cancel=True)


def gather_poll_s(expect: int, max_s: float = GATHER_POLL_MAX_S) -> float:
    """Seconds between a gathering view's polls: ``expect / 500``, at least 0.25 s and at
    most ``max_s`` (2 s; a member's own view: a third of :func:`defend_s`, so a takeover is
    answered in time), so about 500 polls (one small transaction each) per second for the
    whole job from 125 to 1,000 members, ``expect / 2`` above (docs/coordination.md)."""
    return min(max_s, max(GATHER_POLL_MIN_S, expect / 500))


class MemberView:
    """A watch-fed view of the job's live members (rank -> record).

    One per member by default; members in one process may share one (``Membership(...,
    view=shared)``): etcd then sends each membership change once per view instead of once
    per member (the benchmark's harness does this; a daemon has one member anyway).

    **Gathering** (``expect``, the job's size): a view started while fewer than ``expect``
    members are registered does not watch the members' prefix yet; that would deliver
    every later join of a whole-job start to every view, N^2 / 2 events in all
    (docs/benchmarks.md, "The scale run"). Instead, every :func:`gather_poll_s`, one
    transaction reads its listeners' records (its own member's, so a takeover is answered
    within a poll, well inside :func:`defend_s`) and counts the members (a count-only
    range, no records); when the count reaches ``expect``, or has not changed for
    :data:`GATHER_SETTLE_S` (a member is not coming), or after :data:`GATHER_MAX_S`, it
    reads every record once and watches the prefix from that read's revision, as a view
    without ``expect`` does from its start. Meanwhile :meth:`view` holds what the first
    read found plus the listeners' records. A whole-job start then costs etcd about
    ``expect`` x (join window / poll) small transactions and one read of N records per
    view, and no watch event or watch response per join. A caller that needs a rank the
    gathering view lacks (an address to fetch from, rank 0 as JAX's coordinator) says so
    with :meth:`want`: the next poll, at once, reads that rank's record too.
    """

    def __init__(self, etcd: Etcd, prefix: str, progress_s: float = PROGRESS_S,
                 expect: int | None = None, *, poll_max_s: float = GATHER_POLL_MAX_S) -> None:
        self.etcd = etcd
        self.members_prefix = f"{prefix}members/".encode()
        self.counters: dict[str, int] = {"watch_events": 0, "etcd_errors": 0,
                                         "gather_polls": 0}
        self.expect = expect
        #: seconds the view gathered before it read every record (None: not done yet;
        #: 0.0: it did not gather)
        self.gathered_s: float | None = None
        self._poll_max_s = poll_max_s
        #: ranks a caller needs that the gathering view lacks (:meth:`want`)
        self._wanted: set[int] = set()
        self._poke = threading.Event()  # wakes a gathering poll (a want, a stop)
        self._progress_s = progress_s
        self._view: dict[int, MemberRecord] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._view_rev = 0
        self._runs = 0  # how many times the watch loop was started
        self._listeners: dict[int, list[Callable[[], None]]] = {}

    def start(self) -> None:
        """Load the members once, then follow them with a watch (a daemon thread)."""
        if self._thread is not None:
            return
        self._load_view()
        self._thread = threading.Thread(
            target=untrusted.supervise, args=("membership watch", self._watch_run, self._stop),
            daemon=True, name="member-view-watch")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._progress_s + 2)
        self._thread = None

    def _decode(self, kv: Any) -> MemberRecord | None:
        """The record of ``kv`` (a key under ``members/``), or None when the key or the
        value is not a member's (skipped, and reported as a refused record)."""
        try:
            return MemberRecord.decode(kv.value, rank_of_key(kv.key, self.members_prefix))
        except BadRecord as exc:
            untrusted.REJECTED.reject("member", kv.key, str(exc))
            return None

    def _load_view(self) -> None:
        kvs, rev, _more, _n = self.etcd.range(self.members_prefix,
                                              prefix_end(self.members_prefix))
        view = {}
        for kv in kvs:
            rec = self._decode(kv)
            if rec is not None:
                view[rec.rank] = rec
        with self._cond:
            # a listener's record that changed unseen (between two watches) is told too
            fns = [fn for r, rfns in self._listeners.items()
                   if self._view.get(r) != view.get(r) for fn in rfns]
            self._view, self._view_rev = view, rev
            self._cond.notify_all()
        for fn in fns:
            fn()

    def _watch_run(self) -> None:
        """:meth:`_watch_loop` under :func:`untrusted.supervise`: after a failure (events
        of the batch that failed may be lost) the view is read again before the watch."""
        if self._runs:
            try:
                self._load_view()
            except EtcdError as exc:
                self.counters["etcd_errors"] += 1
                log.warning("membership reload: %s", exc)
        self._runs += 1
        if self.gathered_s is None:
            self._gather()
        self._watch_loop()

    def _gather(self) -> None:
        """While fewer than ``expect`` members are registered: every :func:`gather_poll_s`
        (or at once after a :meth:`want`), one transaction reads the listeners' records and
        the wanted ranks' and counts the members; then read them all (the class's
        docstring). No watch meanwhile: a watch's progress answers are watch responses too,
        and etcd sends each to one view at a time. It gathers once in the view's life: an
        error ends it early (etcd's is logged; the watch loop then watches the prefix from
        the last read's revision, replaying what it missed)."""
        t0 = time.monotonic()
        if not self.expect or len(self._view) >= self.expect:
            self.gathered_s = 0.0
            return
        poll = gather_poll_s(self.expect, self._poll_max_s)
        count, changed_at = len(self._view), t0
        try:
            while True:
                self._poke.wait(poll)
                self._poke.clear()
                if self._stop.is_set():
                    return
                got = self._gather_poll()
                now = time.monotonic()
                if got != count:
                    count, changed_at = got, now
                if (got >= self.expect or now - changed_at >= GATHER_SETTLE_S
                        or now - t0 >= GATHER_MAX_S):
                    break
        except EtcdError as exc:
            self.counters["etcd_errors"] += 1
            log.warning("membership gathering: %s", exc)
        finally:
            self.gathered_s = round(time.monotonic() - t0, 3)
        if self._stop.is_set():
            return
        try:
            self._load_view()
        except EtcdError as exc:
            self.counters["etcd_errors"] += 1
            log.warning("membership read after gathering: %s", exc)

    def _gather_poll(self) -> int:
        """One gathering poll: the listeners' records (one range, from the lowest listened
        rank's key to the highest's), the wanted ranks' (one get each, at most
        :data:`WANTED_PER_POLL`) and the count of members, in one transaction; the records
        go into the view. Returns the count (keys under ``members/``)."""
        with self._cond:
            ranks = sorted(r for r, fns in self._listeners.items() if fns)
            wanted = sorted(self._wanted - set(ranks))[:WANTED_PER_POLL]
        ops = [count_op(self.members_prefix, prefix_end(self.members_prefix))]
        if ranks:
            ops.append(get_op(self.members_prefix + rank_key(ranks[0]),
                              self.members_prefix + rank_key(ranks[-1]) + b"\0"))
        ops += [get_op(self.members_prefix + rank_key(r)) for r in wanted]
        r = self.etcd.txn([], ops, retry=True)  # reads only: safe to repeat
        self.counters["gather_polls"] += 1
        if ranks:
            self._apply_read(ranks, r.responses[1].response_range.kvs)
        if wanted:
            kvs = [kv for resp in r.responses[2 if ranks else 1:]
                   for kv in resp.response_range.kvs]
            self._apply_read(wanted, kvs, absent_stays=True)
        return int(r.responses[0].response_range.count)

    def want(self, ranks: Iterable[int]) -> None:
        """Ask a gathering view to read these ranks' records at its next poll, at once
        (a rank already in the view, or a view that watches the prefix, needs nothing).
        Quick and thread-safe; the records arrive in :meth:`view` within a poll."""
        with self._cond:
            if self.gathered_s is not None:
                return
            new = {r for r in ranks if r not in self._view} - self._wanted
            self._wanted |= new
        if new:
            self._poke.set()

    def _apply_read(self, ranks: list[int], kvs: Any, absent_stays: bool = False) -> None:
        """Put the records of ``ranks`` as one read found them (``kvs``, possibly with
        other ranks' keys among them) into the view, and tell the listeners whose record
        changed. A rank the read did not find leaves the view, unless ``absent_stays``
        (a wanted rank not registered yet: still wanted)."""
        found: dict[int, MemberRecord | None] = {r: None for r in ranks}
        for kv in kvs:
            rec = self._decode(kv)
            if rec is not None and rec.rank in found:
                found[rec.rank] = rec
        with self._cond:
            changed = [r for r, rec in found.items() if self._view.get(r) != rec
                       and not (rec is None and absent_stays)]
            for r in changed:
                rec = found[r]
                if rec is None:
                    self._view.pop(r, None)
                else:
                    self._view[r] = rec
                    self._wanted.discard(r)
            fns = [fn for r in changed for fn in self._listeners.get(r, ())]
            if changed:
                self._cond.notify_all()
        for fn in fns:
            fn()

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            pause = 0.5
            try:
                for batch in self.etcd.watch(self.members_prefix,
                                             prefix_end(self.members_prefix),
                                             self._view_rev + 1, stop=self._stop,
                                             progress_s=self._progress_s):
                    self._apply(batch.events, batch.revision)
            except EtcdCompacted:
                pass
            except EtcdError as exc:
                self.counters["etcd_errors"] += 1
                self.connected = False
                log.warning("membership watch: %s", exc)
                if isinstance(exc, EtcdPermissionDenied):
                    pause = DENIED_PAUSE_S  # until a role is granted: not twice a second
            if self._stop.wait(pause):
                return
            try:
                self._load_view()
            except EtcdError as exc:
                self.counters["etcd_errors"] += 1
                self.connected = False
                log.warning("membership reload: %s", exc)

    def listen(self, rank: int, fn: Callable[[], None]) -> None:
        """Call ``fn()`` from the watch thread after each batch of events that changed
        ``rank``'s record (``fn`` must be quick and must not raise)."""
        with self._cond:
            self._listeners.setdefault(rank, []).append(fn)

    def unlisten(self, rank: int, fn: Callable[[], None]) -> None:
        """Stop calling ``fn`` (given to :meth:`listen`)."""
        with self._cond:
            fns = self._listeners.get(rank, [])
            if fn in fns:
                fns.remove(fn)

    def _apply(self, events: Any, revision: int) -> None:
        changed: set[int] = set()
        self._apply_events(events, changed)
        with self._cond:
            fns = [fn for r in changed for fn in self._listeners.get(r, ())]
        for fn in fns:
            fn()

    def _apply_events(self, events: Any, changed: set[int]) -> None:
        with self._cond:
            for ev in events:
                self.counters["watch_events"] += 1
                try:
                    rank = rank_of_key(ev.kv.key, self.members_prefix)
                except BadRecord as exc:
                    if ev.type != 1:
                        untrusted.REJECTED.reject("member", ev.kv.key, str(exc))
                    continue
                changed.add(rank)
                if ev.type == 1:  # DELETE (lease expired or revoked)
                    self._view.pop(rank, None)
                    continue
                rec = self._decode(ev.kv)
                if rec is None:
                    # what the key holds now is no member's record: the rank is not in
                    # the view (as a reload of every record would find)
                    self._view.pop(rank, None)
                else:
                    self._view[rank] = rec
            if events:
                self._view_rev = max(self._view_rev, events[-1].kv.mod_revision)
            self._cond.notify_all()

    def view(self) -> dict[int, MemberRecord]:
        """The live members (rank -> record), as the watch last saw them."""
        with self._cond:
            return dict(self._view)

    def alive(self, rank: int) -> bool:
        with self._cond:
            return rank in self._view

    def record(self, rank: int) -> MemberRecord | None:
        """``rank``'s record as the watch last saw it (None: not a live member)."""
        with self._cond:
            return self._view.get(rank)

    def address(self, rank: int) -> str | None:
        with self._cond:
            rec = self._view.get(rank)
            return rec.address if rec is not None else None

    def wait_for(self, n: int, timeout: float) -> dict[int, MemberRecord]:
        """Block until at least ``n`` members are live (or ``timeout``); the view.

        Raises:
            TimeoutError: fewer than ``n`` after ``timeout`` (one line: how many, which
                ranks are missing among 0..n-1).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._view) < n:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r in range(n) if r not in self._view]
                    raise TimeoutError(f"{len(self._view)} of {n} members live after "
                                       f"{timeout:g} s (missing ranks {missing[:10]}"
                                       f"{' ...' if len(missing) > 10 else ''})")
                self._cond.wait(min(left, 1.0))
            return dict(self._view)
