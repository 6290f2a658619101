"""A mutual exclusion kept in etcd, bound to a lease (for the backup retention sweep).

The lock is the key ``<prefix>locks/<name>``, created with a create-if-absent transaction
and attached to the holder's lease. The holder renews the lease every TTL/3; when it dies
(or is cut off from etcd for the TTL) etcd expires the lease and deletes the key, and the
next waiter's transaction succeeds. No clock of ours is trusted: only etcd's lease.

A holder that was paused past its TTL no longer holds the lock even if it does not know
it yet. :attr:`EtcdLock.held` turns False as soon as a renewal fails or reports the lease
gone, and :meth:`EtcdLock.fence` gives a compare for the holder's own etcd writes (they
apply only while the key is still its own); writes outside etcd (deleting objects in a
bucket) should check :attr:`held` between steps and stop when it turns False.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import trio

from mtcfs.base import untrusted
from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord.etcd import Etcd, EtcdError, absent, get_op, put_op, value_is

log = logging.getLogger(__name__)

TTL_S = 10
#: Longest holder name shown (a lock key's value, written by whoever holds it).
MAX_HOLDER_LEN = 200


def holder_name(value: bytes) -> str:
    """A lock key's value as a one-line name for logs and messages: undecodable bytes and
    control characters replaced, at most :data:`MAX_HOLDER_LEN` characters."""
    text = value[:4 * MAX_HOLDER_LEN].decode(errors="replace")
    return "".join(c if c.isprintable() else "?" for c in text)[:MAX_HOLDER_LEN]


class LockTimeout(EtcdError):
    """The lock stayed held by another owner for the whole wait."""


class EtcdLock:
    """``name``'s lock under ``prefix``.

    Args:
        etcd: the client; prefix: the job's key prefix; name: the lock's name.
        owner: written as the key's value, with a random suffix (who holds it, for logs).
        ttl_s: the lease's TTL (how long a dead holder blocks the others at most).
    """

    def __init__(self, etcd: Etcd, prefix: str, name: str, owner: str = "",
                 ttl_s: int = TTL_S) -> None:
        self.etcd = etcd
        self.key = f"{prefix}locks/{name}".encode()
        self.ttl_s = int(ttl_s)
        self.token = f"{owner or 'holder'}/{uuid.uuid4().hex[:12]}".encode()
        self.lease = 0
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        """Whether this holder still holds the lock, as far as it knows."""
        return bool(self.lease) and not self._lost.is_set()

    def holder(self) -> str | None:
        """The current holder's token (None: free)."""
        kv, _rev = self.etcd.get(self.key)
        return holder_name(kv.value) if kv is not None else None

    def fence(self) -> pb.Compare:
        """A compare that holds only while this holder owns the key (for its txns)."""
        return value_is(self.key, self.token)

    def acquire(self, timeout: float) -> None:
        """Take the lock, waiting up to ``timeout`` seconds for its holder to release it or
        to die (its lease to expire).

        Raises:
            LockTimeout: another owner held it for the whole wait (one line, naming it).
            EtcdError: etcd did not answer.
        """
        if self.held:
            raise EtcdError(f"lock {self.key.decode()} already held by this holder")
        deadline = time.monotonic() + timeout
        lease, _ttl = self.etcd.grant(self.ttl_s)
        pause = 0.05
        try:
            while True:
                r = self.etcd.txn([absent(self.key)], [put_op(self.key, self.token, lease)],
                                  [get_op(self.key)], retry=True)
                if r.succeeded:
                    break
                kvs = r.responses[0].response_range.kvs
                if kvs and kvs[0].value == self.token:
                    break  # an earlier attempt got through
                left = deadline - time.monotonic()
                if left <= 0:
                    who = holder_name(kvs[0].value) if kvs else "?"
                    raise LockTimeout(f"lock {self.key.decode()} held by {who} for the "
                                      f"whole {timeout:g} s wait")
                # keep our own lease alive while we wait (a long wait outlives the TTL)
                self.etcd.keepalive(lease)
                time.sleep(min(pause, left))
                pause = min(pause * 2, 0.5)
        except BaseException:
            try:
                self.etcd.revoke(lease)
            except EtcdError:
                pass
            raise
        self.lease = lease
        self._lost.clear()
        self._stop.clear()
        self._thread = threading.Thread(
            target=untrusted.supervise, daemon=True,
            args=(f"lock {self.key.decode(errors='replace')} keepalive", self._keepalive_run,
                  self._stop),
            name=f"lock-{self.key.decode(errors='replace')}")
        self._thread.start()

    def _keepalive_run(self) -> None:
        """:meth:`_keepalive` under :func:`untrusted.supervise` (an error restarts it);
        once the lock is lost it stays parked until :meth:`release`."""
        self._keepalive()
        self._stop.wait()

    def _keepalive(self) -> None:
        every = max(self.ttl_s / 3.0, 0.2)
        last_ok = time.monotonic()
        while not self._stop.wait(every):
            try:
                if self.etcd.keepalive(self.lease) <= 0:
                    log.warning("lock %s: its lease expired: lost", self.key.decode())
                    self._lost.set()
                    return
                last_ok = time.monotonic()
            except EtcdError as exc:
                if time.monotonic() - last_ok >= self.ttl_s:
                    log.warning("lock %s: not renewed for %d s: lost (%s)",
                                self.key.decode(), self.ttl_s, exc)
                    self._lost.set()
                    return

    def release(self) -> None:
        """Give the lock up (revoking the lease deletes the key). Safe to call twice."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl_s)
        self._thread = None
        if self.lease:
            try:
                self.etcd.revoke(self.lease)
            except EtcdError as exc:
                log.warning("lock %s: cannot revoke (it expires in %d s): %s",
                            self.key.decode(), self.ttl_s, exc)
        self.lease = 0

    def __enter__(self) -> "EtcdLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    # ------------------------------------------------------------------ trio adapters

    async def aacquire(self, timeout: float) -> None:
        await trio.to_thread.run_sync(lambda: self.acquire(timeout), abandon_on_cancel=True)

    async def arelease(self) -> None:
        await trio.to_thread.run_sync(self.release, abandon_on_cancel=True)
