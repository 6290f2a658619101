"""A readers-writer lock kept in etcd, each hold bound to a lease (etcd's own recipe).

Every would-be holder puts one key under the lock's prefix, attached to a lease of its own:
``<prefix>read-<token>`` (shared) or ``<prefix>write-<token>`` (exclusive). etcd gives each
key a *create revision*, one total order of all attempts; the key's value names the holder.

* a **reader** holds the lock once no ``write-`` key with a lower create revision exists;
* a **writer** holds it once no key at all with a lower create revision exists.

So the lock is granted in arrival order (a writer is not starved by a stream of readers:
readers that come after it wait behind it), and a holder gives it up by deleting its key
(revoking its lease). A holder that dies, or is cut off from etcd, stops renewing its lease;
etcd deletes the key when the TTL runs out and the next waiter goes on. Waiting is bounded
polling of one range request (0.05 s doubling to :data:`POLL_MAX_S`): a wait for a sweep or
an upload lasts seconds to minutes, so a watch would save little and adds a stream per
waiter; every wait has a deadline and ends in :class:`RWLockTimeout`, one line naming whom
it waited for.

Losing the lock. Nothing of ours trusts a clock shared between nodes: only etcd's lease. A
holder's :class:`RWHold` renews the lease every TTL/3 and knows, from its own monotonic
clock, until when the lease is certainly alive (the send time of the last renewal that
succeeded plus the TTL etcd returned: etcd started its TTL later than we sent). The lease
ends early only if etcd says so at a renewal (then :attr:`RWHold.held` turns False).
:meth:`RWHold.check` raises :class:`RWLockLost` when the lease is gone or will be alive for
less than a margin from now: a holder calls it before each action that is safe only under
the lock (a sweep, before each chunk delete; an upload, before its COMPLETE marker).
:meth:`RWHold.fence` is a compare for the holder's own etcd transactions (they apply only
while its key is still the one it put).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from mtcfs.base import untrusted
from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord.etcd import (
    Etcd,
    EtcdError,
    absent,
    create_is,
    get_op,
    prefix_end,
    put_op,
)
from mtcfs.tiers.coord.lock import holder_name

log = logging.getLogger(__name__)

#: Default lease TTL of a hold, seconds (how long a dead holder blocks the others at most).
TTL_S = 10
#: Longest pause between two looks at the earlier keys while waiting, seconds.
POLL_MAX_S = 0.5

SHARED = "shared"
EXCLUSIVE = "exclusive"
_KIND = {SHARED: b"read-", EXCLUSIVE: b"write-"}


class RWLockTimeout(EtcdError):
    """A wait for the lock reached its deadline (the message names the earlier holder)."""


class RWLockLost(EtcdError):
    """The hold's lease is gone, or too close to its end to act under it."""


class RWHold:
    """One hold of an :class:`EtcdRWLock` (or an attempt at one): its key and its lease,
    renewed by a daemon thread until :meth:`release`.

    Attributes:
        key: the holder's key; mode: ``"shared"`` or ``"exclusive"``; lease: its lease id;
        create_revision: the key's create revision (0 until it is put).
    """

    def __init__(self, etcd: Etcd, key: bytes, mode: str, lease: int, ttl_s: int,
                 granted_at: float) -> None:
        self.etcd = etcd
        self.key = key
        self.mode = mode
        self.lease = lease
        self.ttl_s = ttl_s
        self.create_revision = 0
        self._valid_until = granted_at + ttl_s
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._released = False
        self._thread = threading.Thread(
            target=untrusted.supervise, daemon=True,
            args=(f"{mode} lock key {key.decode(errors='replace')} keepalive",
                  self._keepalive_run, self._stop),
            name=f"rwlock-{key.decode(errors='replace')}")
        self._thread.start()

    @property
    def held(self) -> bool:
        """Whether the lease is still alive as far as this holder knows (it may already be
        past its end without a renewal having said so: :meth:`check` also looks at time)."""
        return not self._lost.is_set() and not self._released

    def remaining(self) -> float:
        """Seconds the lease is certainly still alive (<= 0: maybe not)."""
        return self._valid_until - time.monotonic()

    def check(self, margin_s: float = 0.0) -> None:
        """Raise :class:`RWLockLost` unless the lease is alive for ``margin_s`` more seconds.

        Costs no request: it uses the outcome of the renewals so far.
        """
        if self._released:
            raise RWLockLost(f"{self.mode} lock key {self.key.decode()} was released")
        if self._lost.is_set():
            raise RWLockLost(f"{self.mode} lock key {self.key.decode()} lost: etcd ended its "
                             f"lease {self.lease:x}")
        left = self.remaining()
        if left < margin_s:
            raise RWLockLost(f"{self.mode} lock key {self.key.decode()} not renewed in time: "
                             f"its lease {self.lease:x} is alive for {max(left, 0.0):.1f} s "
                             f"more at most (wanted {margin_s:g} s)")

    def fence(self) -> pb.Compare:
        """A compare that holds only while this hold's key exists (for its own txns)."""
        return create_is(self.key, self.create_revision)

    def _keepalive_run(self) -> None:
        """:meth:`_keepalive` under :func:`untrusted.supervise` (an error restarts it);
        once the hold is lost it stays parked until :meth:`release`."""
        self._keepalive()
        self._stop.wait()

    def _keepalive(self) -> None:
        every = max(self.ttl_s / 3.0, 0.2)
        while not self._stop.wait(every):
            sent = time.monotonic()
            try:
                ttl = self.etcd.keepalive(self.lease)
            except EtcdError as exc:
                if time.monotonic() >= self._valid_until:
                    log.warning("%s lock key %s: lease not renewed for its TTL: lost (%s)",
                                self.mode, self.key.decode(), exc)
                    self._lost.set()
                    return
                continue
            if ttl <= 0:
                log.warning("%s lock key %s: its lease expired: lost", self.mode,
                            self.key.decode())
                self._lost.set()
                return
            self._valid_until = sent + ttl

    def release(self) -> None:
        """Give the hold up: stop renewing and revoke the lease (etcd deletes the key). A
        revoke that fails is logged; the key then goes when the TTL runs out. Safe twice."""
        if self._released:
            return
        self._released = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl_s)
        try:
            self.etcd.revoke(self.lease)
        except EtcdError as exc:
            log.warning("%s lock key %s: cannot revoke its lease (it expires in %d s): %s",
                        self.mode, self.key.decode(), self.ttl_s, exc)

    def __enter__(self) -> "RWHold":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class EtcdRWLock:
    """The readers-writer lock whose keys live under ``prefix``.

    Args:
        etcd: the client.
        prefix: the lock's key prefix (ends with ``/``); nothing else may live under it.
        owner: written as the value of this process's keys (named in others' timeouts).
        ttl_s: lease TTL of each hold.
    """

    def __init__(self, etcd: Etcd, prefix: str, owner: str = "", ttl_s: int = TTL_S) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"an etcd lock prefix ends with '/', got {prefix!r}")
        self.etcd = etcd
        self.prefix = prefix.encode()
        self.owner = (owner or "holder").encode()
        self.ttl_s = int(ttl_s)

    def acquire(self, mode: str, timeout: float) -> RWHold:
        """Take the lock ``shared`` or ``exclusive``, waiting up to ``timeout`` seconds for
        the earlier conflicting holders to release it or to die.

        Returns:
            The hold; release it (or use it as a context manager).

        Raises:
            RWLockTimeout: earlier holders kept it for the whole wait.
            RWLockLost: our own lease ended while we waited.
            EtcdError: etcd did not answer (EtcdUnavailable) or refused.
        """
        kind = _KIND[mode]
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        lease, ttl = self.etcd.grant(self.ttl_s)
        key = self.prefix + kind + uuid.uuid4().hex.encode()
        hold = RWHold(self.etcd, key, mode, lease, ttl, t0)
        try:
            # create-if-absent and read back, retried safely: a second attempt finds the key
            r = self.etcd.txn([absent(key)], [put_op(key, self.owner, lease), get_op(key)],
                              [get_op(key)], retry=True)
            kvs = r.responses[-1].response_range.kvs
            if not kvs:
                raise RWLockLost(f"{mode} lock key {key.decode()} vanished as it was put "
                                 f"(lease {lease:x} ended)")
            hold.create_revision = int(kvs[0].create_revision)
            # a reader waits for earlier writers only; a writer for every earlier key
            lo = self.prefix + (b"write-" if mode == SHARED else b"")
            pause = 0.05
            while True:
                hold.check()
                earlier, _rev, _more, _n = self.etcd.range(
                    lo, prefix_end(lo), max_create_revision=hold.create_revision - 1)
                if not earlier:
                    return hold
                left = deadline - time.monotonic()
                if left <= 0:
                    first = min(earlier, key=lambda kv: kv.create_revision)
                    what = "exclusive" if first.key[len(self.prefix):].startswith(b"write-") \
                        else "shared"
                    raise RWLockTimeout(
                        f"{mode} lock {self.prefix.decode()} not granted within {timeout:g} s: "
                        f"{len(earlier)} earlier holder(s), the first {what} by "
                        f"{holder_name(first.value)}")
                time.sleep(min(pause, left))
                pause = min(pause * 2, POLL_MAX_S)
        except BaseException:
            hold.release()
            raise

    def holders(self) -> list[tuple[str, str]]:
        """(mode, owner) of every key there now, holders and waiters, in arrival order."""
        kvs, _rev, _more, _n = self.etcd.range(self.prefix, prefix_end(self.prefix),
                                               sort_create=True)
        return [("exclusive" if kv.key[len(self.prefix):].startswith(b"write-") else "shared",
                 holder_name(kv.value)) for kv in kvs]
