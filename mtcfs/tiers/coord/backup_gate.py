"""The backup tier's sweep gate on etcd (:class:`mtcfs.tiers.backup.gate.SweepGate`).

Keys under the gate's prefix (the daemon's: ``<coord_prefix>backup/``, by default
``/mtcfs/<job>/backup/``):

* ``sweep-lock/read-<token>``, ``sweep-lock/write-<token>``: the readers-writer lock
  (:mod:`mtcfs.tiers.coord.rwlock`); uploads hold it shared, chunk sweeps exclusive, each
  key on the holder's lease;
* ``sweep-generation``: put by a sweeper (fenced on its lock key) before it deletes chunks;
  the generation is the key's mod revision (0 while absent), its value names the sweeper.

Every etcd failure comes out as a :class:`~mtcfs.tiers.backup.errors.GateError` (a
BackupError), so the backup tier treats it as a failed upload (retried by the scheduler) or
a skipped sweep. See :mod:`mtcfs.tiers.backup.gate` for the protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

from mtcfs.tiers.backup.errors import GateError, GateLost, GateTimeout
from mtcfs.tiers.backup.gate import GateHold
from mtcfs.tiers.coord.etcd import Etcd, EtcdError, get_op, put_op
from mtcfs.tiers.coord.rwlock import (
    EXCLUSIVE,
    SHARED,
    EtcdRWLock,
    RWHold,
    RWLockLost,
    RWLockTimeout,
)

#: Lease TTL of a hold, seconds: how long a dead uploader or sweeper blocks the others.
TTL_S = 30
#: An upload waits this long for a sweep to end (then fails; the scheduler retries later).
SHARED_WAIT_S = 900.0
#: A sweep waits this long for uploads in progress to end (then it is skipped).
EXCLUSIVE_WAIT_S = 900.0


def _gate_error(exc: EtcdError) -> GateError:
    if isinstance(exc, RWLockTimeout):
        return GateTimeout(f"sweep gate: {exc}")
    if isinstance(exc, RWLockLost):
        return GateLost(f"sweep gate: {exc}")
    return GateError(f"sweep gate: {exc}")


class _Hold:
    """A :class:`GateHold` over an :class:`RWHold`: ``check`` wants the lease alive for a
    third of its TTL more."""

    def __init__(self, hold: RWHold) -> None:
        self.rw = hold
        self.margin_s = hold.ttl_s / 3.0

    def check(self) -> None:
        try:
            self.rw.check(self.margin_s)
        except RWLockLost as exc:
            raise GateLost(f"sweep gate: {exc}") from None


class EtcdSweepGate:
    """The sweep gate of one job's bucket, in etcd.

    Args:
        etcd: the job's client.
        prefix: the gate's key prefix (ends with ``/``).
        owner: names this node in the keys' values (and so in others' timeout messages).
        ttl_s: lease TTL of a hold.
        shared_wait_s: an upload's wait for the gate.
        exclusive_wait_s: a sweep's wait for the gate.
    """

    def __init__(self, etcd: Etcd, prefix: str, owner: str = "", *, ttl_s: int = TTL_S,
                 shared_wait_s: float = SHARED_WAIT_S,
                 exclusive_wait_s: float = EXCLUSIVE_WAIT_S) -> None:
        if not prefix.endswith("/"):
            raise ValueError(f"an etcd key prefix ends with '/', got {prefix!r}")
        self.etcd = etcd
        self.prefix = prefix
        self.owner = owner or "holder"
        self.lock = EtcdRWLock(etcd, prefix + "sweep-lock/", self.owner, ttl_s)
        self.generation_key = (prefix + "sweep-generation").encode()
        self.shared_wait_s = shared_wait_s
        self.exclusive_wait_s = exclusive_wait_s

    def describe(self) -> str:
        return f"etcd {','.join(self.etcd.endpoints)} {self.prefix}"

    @contextmanager
    def _hold(self, mode: str, wait_s: float) -> Iterator[GateHold]:
        try:
            rw = self.lock.acquire(mode, wait_s)
        except EtcdError as exc:
            raise _gate_error(exc) from None
        try:
            yield _Hold(rw)
        finally:
            rw.release()

    def shared(self) -> AbstractContextManager[GateHold]:
        return self._hold(SHARED, self.shared_wait_s)

    def exclusive(self) -> AbstractContextManager[GateHold]:
        return self._hold(EXCLUSIVE, self.exclusive_wait_s)

    def generation(self) -> int:
        try:
            kv, _rev = self.etcd.get(self.generation_key)
        except EtcdError as exc:
            raise _gate_error(exc) from None
        return int(kv.mod_revision) if kv is not None else 0

    def bump(self, hold: GateHold) -> tuple[int, int]:
        if not isinstance(hold, _Hold) or hold.rw.mode != EXCLUSIVE:
            raise GateError("sweep gate: the generation is bumped only under exclusive()")
        hold.check()
        try:
            # a retry of a put that went through bumps once more: harmless (it only has to
            # change); fenced, so a sweeper whose key is gone cannot bump any more
            r = self.etcd.txn([hold.rw.fence()],
                              [get_op(self.generation_key),
                               put_op(self.generation_key, self.owner.encode())],
                              retry=True)
        except EtcdError as exc:
            raise _gate_error(exc) from None
        if not r.succeeded:
            raise GateLost(f"sweep gate: exclusive lock key {hold.rw.key.decode()} is gone: "
                           "not deleting anything")
        kvs = r.responses[0].response_range.kvs
        before = int(kvs[0].mod_revision) if kvs else 0
        return before, int(r.revision)
