"""A small synchronous client of etcd's v3 gRPC API: KV, transactions, watches, leases.

Every call blocks (run it in a worker thread, never on the trio loop) and has a deadline:
a call that cannot be served by any endpoint within ``timeout_s`` raises
:class:`EtcdUnavailable` with one line naming the endpoints and the last error. What it
guarantees:

* **Failover.** Endpoints are tried in turn; UNAVAILABLE and DEADLINE_EXCEEDED move to the
  next one (an etcd member without a leader answers UNAVAILABLE). A call is retried only
  where that is safe: reads always; writes only when the caller says the write is
  idempotent (``retry=True``: a create-if-absent transaction, a put of the same value).
* **Linearizable reads by default** (etcd's own default): a read returns at least every
  write acknowledged before it began.
* **Watches resume.** :meth:`Etcd.watch` returns an iterator of event batches, in revision
  order, that reconnects (from the revision after the last one delivered) when a member
  goes away, and raises :class:`EtcdCompacted` when etcd no longer holds that history.
* **TLS and etcd's roles** (optional, :class:`EtcdTls`): the channels check etcd's server
  certificate against a CA bundle and the endpoint's host, and present a client
  certificate, whose CN is the etcd user when etcd runs with ``--client-cert-auth``. A
  request etcd's auth refuses raises :class:`EtcdPermissionDenied` at once (never retried),
  naming the keys; a TLS handshake that fails (an unknown CA, an expired certificate) is
  retried like an unreachable member until the deadline, then raises
  :class:`EtcdUnavailable` with the handshake's reason. The PEM files are read again when
  they change on disk (checked at most every :data:`TLS_CHECK_S` s): new connections use
  the new files, connections already open keep theirs for ``timeout_s`` more.

The wire messages are etcd's (proto/etcd_v3_subset.proto); docs/coordination.md says why
mtcfs generates its own stubs instead of using a client library.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2 as pb
from mtcfs.tiers.coord._pb import etcd_v3_subset_pb2_grpc as pb_grpc

#: Seconds one call may take, over every endpoint and retry, before it fails.
CALL_TIMEOUT_S = 10.0
#: Seconds one attempt on one endpoint may take: a member that lost its leader holds a
#: request until etcd's own timeout (seconds), another member may already serve it.
ATTEMPT_S = 2.0
#: Seconds a lease revoke may take: always best effort (a lease not revoked expires on its
#: own within its TTL), and made on the way out, where a dead etcd must not hold a stop for
#: the whole call deadline once per lease (it held an unmount 12 s).
REVOKE_TIMEOUT_S = 3.0
#: Largest message this client accepts (a range of many namespace keys).
MAX_RECEIVE_BYTES = 256 * 1024 * 1024
_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
#: Seconds between checks whether the TLS files changed on disk (a certificate rotated).
TLS_CHECK_S = 1.0

log = logging.getLogger(__name__)

KeyValue = pb.KeyValue
Event = pb.Event


class EtcdError(Exception):
    """etcd refused a request (a permanent error: bad request, too large, ...)."""


class EtcdUnavailable(EtcdError):
    """No endpoint served the request within its deadline."""


class EtcdPermissionDenied(EtcdError):
    """etcd's authentication refused a request: the etcd user of this client (the CN of its
    certificate) has no role granting it these keys, or this client presented no user at
    all to an etcd with auth enabled. Permanent: never retried.

    Attributes:
        keys: the keys the request named, as text (``prefix '/mtcfs/b/'``, ``key '...'``).
    """

    def __init__(self, message: str, keys: str = "") -> None:
        super().__init__(message)
        self.keys = keys


class EtcdCompacted(EtcdError):
    """A watch or read asked for history etcd compacted away.

    Attributes:
        compact_revision: the oldest revision etcd still holds.
    """

    def __init__(self, message: str, compact_revision: int) -> None:
        super().__init__(message)
        self.compact_revision = compact_revision


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range or watch cover every key starting with
    ``prefix`` (etcd's convention: the prefix with its last byte below 0xff incremented)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


# ------------------------------------------------------------------ building transactions

def put_op(key: bytes, value: bytes, lease: int = 0) -> pb.RequestOp:
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease))


def delete_op(key: bytes, range_end: bytes = b"") -> pb.RequestOp:
    return pb.RequestOp(request_delete_range=pb.DeleteRangeRequest(key=key,
                                                                   range_end=range_end))


def get_op(key: bytes, range_end: bytes = b"") -> pb.RequestOp:
    return pb.RequestOp(request_range=pb.RangeRequest(key=key, range_end=range_end))


def count_op(key: bytes, range_end: bytes) -> pb.RequestOp:
    """A range that returns only how many keys ``[key, range_end)`` holds (``count``)."""
    return pb.RequestOp(request_range=pb.RangeRequest(key=key, range_end=range_end,
                                                      count_only=True))


def absent(key: bytes) -> pb.Compare:
    """Holds when ``key`` does not exist (its create revision is 0)."""
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.CREATE, key=key,
                      create_revision=0)


def mod_is(key: bytes, revision: int) -> pb.Compare:
    """Holds when ``key`` was last changed at ``revision`` (0: it does not exist)."""
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.MOD, key=key,
                      mod_revision=revision)


def create_is(key: bytes, revision: int) -> pb.Compare:
    """Holds when ``key`` exists and was created at ``revision`` (the very key a holder put:
    deleted and put again, it has a later create revision)."""
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.CREATE, key=key,
                      create_revision=revision)


def value_is(key: bytes, value: bytes) -> pb.Compare:
    return pb.Compare(result=pb.Compare.EQUAL, target=pb.Compare.VALUE, key=key, value=value)


@dataclass
class TxnResult:
    """What a transaction did: whether its compares held, the store's revision after it
    (the revision of its writes when it wrote), and the responses of the branch it ran."""

    succeeded: bool
    revision: int
    responses: Sequence[pb.ResponseOp]


@dataclass
class WatchBatch:
    """Events of one or more revisions, in order; ``revision``: the store's revision when
    etcd sent them (every later event has a higher one). An empty batch is progress."""

    events: Sequence[pb.Event]
    revision: int


@dataclass(frozen=True)
class EtcdTls:
    """TLS to etcd: paths of PEM files (the ``coord_ca``, ``coord_cert`` and ``coord_key``
    mount options).

    Attributes:
        ca: the CA bundle that signed etcd's server certificates. Each endpoint's host (an
            IP address or a DNS name, as written in the endpoint) must be in the server
            certificate's subject alternative names.
        cert, key: this client's certificate and private key (both or neither). With
            etcd's ``--client-cert-auth`` the certificate's CN is the etcd user name.
    """

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("an etcd client certificate needs its key, and a key its "
                             "certificate")

    def files(self) -> list[str]:
        return [p for p in (self.ca, self.cert, self.key) if p]

    def fingerprint(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when a file is rewritten or replaced (a rotation): the inode,
        size and modification time of each file; (0, 0, 0) for one that cannot be read.
        """
        out = []
        for p in self.files():
            try:
                st = os.stat(p)
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                out.append((0, 0, 0))
        return tuple(out)

    def credentials(self) -> grpc.ChannelCredentials:
        """The files, read now, as gRPC channel credentials.

        Raises:
            OSError: a file cannot be read (the message names it).
        """
        def read(p: str | None) -> bytes | None:
            if p is None:
                return None
            with open(p, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))


_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_RECEIVE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


class Etcd:
    """A connection to one etcd cluster (thread-safe).

    Args:
        endpoints: ``host:port`` of the cluster's members (client URLs without scheme).
        timeout_s: deadline of one call over all endpoints.
        tls: dial the endpoints with TLS (server certificate checked, client certificate
            presented); None: plaintext.

    Raises:
        ValueError: no endpoint.
        OSError: a TLS file cannot be read.
    """

    def __init__(self, endpoints: Sequence[str], timeout_s: float = CALL_TIMEOUT_S,
                 tls: EtcdTls | None = None) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self.tls = tls
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._current = 0
        self._closed = False
        #: TLS: the credentials new channels get, the files' fingerprint they were read
        #: at, when it was last checked, and channels made with older files, to close
        #: once no call can still use them: (channel, monotonic time to close it).
        self._creds = tls.credentials() if tls is not None else None
        self._tls_seen = tls.fingerprint() if tls is not None else ()
        self._tls_checked = time.monotonic()
        self._retired: list[tuple[grpc.Channel, float]] = []
        #: How many times the TLS files were read again after a change (for tests, status).
        self.tls_reloads = 0

    # ------------------------------------------------------------------ plumbing

    def _channel(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            if self._closed:
                raise EtcdUnavailable("the etcd client is closed")
            if self.tls is not None:
                self._check_tls_files()
            ch = self._channels.get(endpoint)
            if ch is None:
                if self._creds is None:
                    ch = grpc.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
                else:
                    ch = grpc.secure_channel(endpoint, self._creds, options=_CHANNEL_OPTIONS)
                self._channels[endpoint] = ch
            return ch

    def _check_tls_files(self) -> None:
        """(With the lock held.) At most every TLS_CHECK_S: when a TLS file changed on disk,
        read them again and retire every channel, so that new calls connect with the new
        files. A retired channel is closed ``timeout_s`` + 1 s later (no call made on it
        lasts longer; a watch on it then resumes on a new one). Files that cannot be read
        (half-way through a rotation) keep the old ones in use until the next check."""
        now = time.monotonic()
        if self._retired:
            done = [ch for ch, at in self._retired if at <= now]
            self._retired = [(ch, at) for ch, at in self._retired if at > now]
            for ch in done:
                ch.close()
        if now - self._tls_checked < TLS_CHECK_S:
            return
        self._tls_checked = now
        assert self.tls is not None
        seen = self.tls.fingerprint()
        if seen == self._tls_seen:
            return
        try:
            creds = self.tls.credentials()
        except OSError as exc:
            log.warning("etcd TLS files changed but cannot be read (%s): the old ones stay "
                        "in use", exc)
            return
        self._creds, self._tls_seen = creds, seen
        self.tls_reloads += 1
        close_at = now + self.timeout_s + 1.0
        self._retired += [(ch, close_at) for ch in self._channels.values()]
        self._channels = {}
        log.info("etcd TLS files changed on disk: new connections to etcd use them")

    def _order(self) -> list[str]:
        with self._lock:
            i = self._current
        return self.endpoints[i:] + self.endpoints[:i]

    def _moved_from(self, endpoint: str) -> None:
        with self._lock:
            if self.endpoints[self._current] == endpoint:
                self._current = (self._current + 1) % len(self.endpoints)

    def _call(self, service: str, method: str, request: Any, *, retry: bool = True,
              timeout_s: float | None = None) -> Any:
        """Call ``service.method`` on the first endpoint that answers, within the deadline.

        ``retry=False`` (a write that must not run twice): only a connection refused
        before the request was sent moves on; anything else raises at once.
        """
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        last: Exception | None = None
        pause = 0.05
        while True:
            for endpoint in self._order():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                stub = getattr(pb_grpc, f"{service}Stub")(self._channel(endpoint))
                try:
                    return getattr(stub, method)(request, timeout=min(left, ATTEMPT_S),
                                                 wait_for_ready=False)
                except grpc.RpcError as exc:
                    code = exc.code()
                    if _denied(exc):
                        keys = _keys_of(request)
                        raise EtcdPermissionDenied(
                            f"etcd {endpoint} denied {method} of {keys}: "
                            f"{code.name}: {exc.details()} ({self._who()})",
                            keys) from None
                    if code not in _TRANSIENT and not _server_deadline(exc):
                        raise EtcdError(f"etcd {endpoint} refused {method}: "
                                        f"{code.name}: {exc.details()}") from None
                    last = exc
                    self._moved_from(endpoint)
                    if not retry and not _never_sent(exc):
                        raise EtcdUnavailable(
                            f"etcd {endpoint}: {method} may or may not have been applied: "
                            f"{code.name}: {exc.details()}") from None
            if time.monotonic() >= deadline:
                break
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, 0.5)
        why = self._why(last) if last is not None else "no time left"
        raise EtcdUnavailable(f"etcd at {','.join(self.endpoints)} did not answer {method} "
                              f"within {timeout_s or self.timeout_s:g} s ({why})")

    def _who(self) -> str:
        """Which etcd user this client is, for a refusal."""
        if self.tls is None or self.tls.cert is None:
            return ("this client presents no certificate: with etcd's auth on, it needs a "
                    "client certificate whose CN is an etcd user")
        return (f"etcd user: the CN of {self.tls.cert}; its etcd role must grant "
                f"readwrite on these keys' prefix")

    def _why(self, exc: BaseException) -> str:
        """A failed attempt's reason, with what to check when it is a TLS failure."""
        why = _why(exc)
        if self.tls is not None and _tls_failed(why):
            why += (f"; TLS with etcd failed: check that {self.tls.ca} holds the CA of "
                    "etcd's certificate and that certificate names the endpoint's host"
                    + (f", and that etcd trusts the CA of {self.tls.cert} and it has not "
                       "expired" if self.tls.cert else
                       ", and whether etcd asks for a client certificate"))
        elif self.tls is None and "socket closed" in why.lower():
            why += "; an etcd that serves TLS closes plaintext connections so"
        return why

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
            channels += [ch for ch, _at in self._retired]
            self._retired = []
        for ch in channels:
            ch.close()

    # ------------------------------------------------------------------ KV

    def get(self, key: bytes, *, serializable: bool = False) -> tuple[KeyValue | None, int]:
        """The key's current value (None when absent) and the store's revision."""
        r = self._call("KV", "Range", pb.RangeRequest(key=key, serializable=serializable))
        return (r.kvs[0] if r.kvs else None), r.header.revision

    def range(self, key: bytes, range_end: bytes, *, revision: int = 0, limit: int = 0,
              keys_only: bool = False, count_only: bool = False,
              sort_create: bool = False, descending: bool = False,
              min_create_revision: int = 0, max_create_revision: int = 0,
              serializable: bool = False) -> tuple[list[KeyValue], int, bool, int]:
        """Keys in ``[key, range_end)``: (kvs, store revision, more, count).

        Raises:
            EtcdCompacted: ``revision`` is older than the oldest etcd holds.
        """
        req = pb.RangeRequest(key=key, range_end=range_end, revision=revision, limit=limit,
                              keys_only=keys_only, count_only=count_only,
                              serializable=serializable,
                              min_create_revision=min_create_revision,
                              max_create_revision=max_create_revision)
        if sort_create:
            req.sort_order = pb.RangeRequest.DESCEND if descending else pb.RangeRequest.ASCEND
            req.sort_target = pb.RangeRequest.CREATE
        try:
            r = self._call("KV", "Range", req)
        except EtcdError as exc:
            if "compacted" in str(exc):
                raise EtcdCompacted(str(exc), 0) from None
            raise
        return list(r.kvs), r.header.revision, r.more, r.count

    def revision(self) -> int:
        """The store's current revision, read linearizably (a read barrier: every write
        acknowledged before this call has a revision <= the one returned)."""
        r = self._call("KV", "Range", pb.RangeRequest(key=b"\0", count_only=True))
        return int(r.header.revision)

    def put(self, key: bytes, value: bytes, *, lease: int = 0, retry: bool = True) -> int:
        """Set ``key``; returns the revision of the write."""
        r = self._call("KV", "Put", pb.PutRequest(key=key, value=value, lease=lease),
                       retry=retry)
        return int(r.header.revision)

    def delete(self, key: bytes, range_end: bytes = b"") -> int:
        """Delete ``key`` (or ``[key, range_end)``); returns how many keys went."""
        r = self._call("KV", "DeleteRange", pb.DeleteRangeRequest(key=key, range_end=range_end))
        return int(r.deleted)

    def txn(self, compare: Sequence[pb.Compare], success: Sequence[pb.RequestOp],
            failure: Sequence[pb.RequestOp] = (), *, retry: bool = False) -> TxnResult:
        """Run ``success`` when every compare holds, else ``failure``, atomically."""
        r = self._call("KV", "Txn", pb.TxnRequest(compare=compare, success=success,
                                                  failure=failure), retry=retry)
        return TxnResult(bool(r.succeeded), int(r.header.revision), list(r.responses))

    def compact(self, revision: int) -> None:
        """Drop the history before ``revision`` (current keys stay)."""
        try:
            self._call("KV", "Compact", pb.CompactionRequest(revision=revision))
        except EtcdError as exc:
            if "compacted" not in str(exc):
                raise

    # ------------------------------------------------------------------ leases

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, granted TTL in seconds)."""
        r = self._call("Lease", "LeaseGrant", pb.LeaseGrantRequest(TTL=ttl_s))
        if r.error:
            raise EtcdError(f"etcd refused a lease: {r.error}")
        return int(r.ID), int(r.TTL)

    def revoke(self, lease: int) -> None:
        """End a lease now (its keys are deleted). A lease already gone is fine.

        Raises:
            EtcdUnavailable: no endpoint answered within ``min(timeout_s,
                REVOKE_TIMEOUT_S)`` (the lease then expires after its TTL).
        """
        try:
            self._call("Lease", "LeaseRevoke", pb.LeaseRevokeRequest(ID=lease),
                       timeout_s=min(self.timeout_s, REVOKE_TIMEOUT_S))
        except EtcdError as exc:
            if "not found" not in str(exc):
                raise

    def keepalive(self, lease: int) -> int:
        """Renew a lease once; returns its TTL in seconds (<= 0: it expired)."""
        deadline = time.monotonic() + self.timeout_s
        last: Exception | None = None
        for endpoint in self._order():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            stub = pb_grpc.LeaseStub(self._channel(endpoint))
            try:
                call = stub.LeaseKeepAlive(iter([pb.LeaseKeepAliveRequest(ID=lease)]),
                                           timeout=left)
                for r in call:
                    return int(r.TTL)
                return 0
            except grpc.RpcError as exc:
                last = exc
                self._moved_from(endpoint)
        raise EtcdUnavailable(f"etcd at {','.join(self.endpoints)} did not renew lease "
                              f"{lease:x} ({self._why(last) if last else 'no time left'})")

    # ------------------------------------------------------------------ status and watch

    def status(self, endpoint: str | None = None) -> pb.StatusResponse:
        """One member's status (version, db size, leader, raft index)."""
        if endpoint is None:
            resp: pb.StatusResponse = self._call("Maintenance", "Status", pb.StatusRequest())
            return resp
        stub = pb_grpc.MaintenanceStub(self._channel(endpoint))
        resp = stub.Status(pb.StatusRequest(), timeout=self.timeout_s)
        return resp

    def watch(self, key: bytes, range_end: bytes, start_revision: int,
              stop: threading.Event | None = None, progress_s: float = 1.0) -> Iterator[WatchBatch]:
        """Events of ``[key, range_end)`` from ``start_revision`` (inclusive), for ever.

        Yields batches in revision order; when no event came for ``progress_s`` it asks
        etcd for progress and yields an empty batch whose revision tells how far the
        stream is. Reconnects to the next endpoint when one goes away (resuming after the
        last revision delivered) and gives up after ``timeout_s`` without any endpoint.
        Ends when ``stop`` is set.

        Raises:
            EtcdCompacted: etcd no longer holds the history from the resume revision.
            EtcdUnavailable: no endpoint answered for ``timeout_s``.
        """
        stop = stop or threading.Event()
        nxt = start_revision
        down_since: float | None = None
        last_err = ""
        while not stop.is_set():
            for endpoint in self._order():
                if stop.is_set():
                    return
                requests: queue.Queue[Any] = queue.Queue()
                requests.put(pb.WatchRequest(create_request=pb.WatchCreateRequest(
                    key=key, range_end=range_end, start_revision=nxt, progress_notify=True)))

                def gen() -> Iterator[Any]:
                    while True:
                        item = requests.get()
                        if item is None:
                            return
                        yield item

                stub = pb_grpc.WatchStub(self._channel(endpoint))
                # hasleader: a member cut off from its leader ends the stream instead of
                # keeping it open with nothing to say (etcd's own clients ask the same)
                call = stub.Watch(gen(), metadata=(("hasleader", "true"),))
                heard = {"at": time.monotonic(), "stale": False}
                pinger = threading.Thread(target=_progress_pinger,
                                          args=(requests, stop, call, progress_s, heard),
                                          daemon=True, name="etcd-watch-progress")
                pinger.start()
                try:
                    for r in call:
                        heard["at"] = time.monotonic()
                        if r.canceled:
                            if "permission denied" in r.cancel_reason:
                                keys = _range_text(key, range_end)
                                raise EtcdPermissionDenied(
                                    f"etcd {endpoint} denied a watch of {keys}: "
                                    f"{r.cancel_reason} ({self._who()})", keys)
                            if r.compact_revision:
                                raise EtcdCompacted(
                                    f"etcd compacted the history before revision "
                                    f"{r.compact_revision} (watch from {nxt})",
                                    int(r.compact_revision))
                            raise EtcdError(f"etcd cancelled a watch: {r.cancel_reason}")
                        down_since = None
                        if r.created and not r.events:
                            continue
                        if r.events:
                            nxt = max(nxt, r.events[-1].kv.mod_revision + 1)
                        yield WatchBatch(list(r.events), int(r.header.revision))
                        if stop.is_set():
                            return
                except grpc.RpcError as exc:
                    if stop.is_set():
                        return
                    last_err = (f"no answer from {endpoint} for {3 * progress_s:g} s"
                                if heard["stale"] else self._why(exc))
                    self._moved_from(endpoint)
                finally:
                    requests.put(None)
                    call.cancel()
                if down_since is None:
                    down_since = time.monotonic()
                elif time.monotonic() - down_since > self.timeout_s:
                    raise EtcdUnavailable(f"etcd at {','.join(self.endpoints)}: watch lost "
                                          f"for {self.timeout_s:g} s ({last_err})")
                stop.wait(0.1)


def _server_deadline(exc: grpc.RpcError) -> bool:
    """etcd ran out of the request's deadline itself (a busy member): it answers UNKNOWN
    "context deadline exceeded" instead of DEADLINE_EXCEEDED; as transient as a timeout
    (seen at 1,000 members on 2 shared cores, docs/benchmarks.md)."""
    return exc.code() == grpc.StatusCode.UNKNOWN and \
        "deadline exceeded" in (exc.details() or "")


def _progress_pinger(requests: queue.Queue[Any], stop: threading.Event, call: Any,
                     every_s: float, heard: dict[str, Any]) -> None:
    """Ask for a progress notification every ``every_s`` while the watch runs; end the
    call when nothing at all came back for three of those (a hung or cut-off member), so
    the watch moves to the next endpoint."""
    while call.is_active() and not stop.wait(every_s):
        if time.monotonic() - heard["at"] > 3 * every_s:
            heard["stale"] = True
            break
        requests.put(pb.WatchRequest(progress_request=pb.WatchProgressRequest()))
    call.cancel()


def _denied(exc: grpc.RpcError) -> bool:
    """Whether etcd's auth refused the call: PERMISSION_DENIED (a user whose roles do not
    grant the keys), or no user at all where etcd's auth is on."""
    details = exc.details() or ""
    return exc.code() == grpc.StatusCode.PERMISSION_DENIED or (
        "user name is empty" in details or "invalid auth token" in details)


def _tls_failed(why: str) -> bool:
    """Whether a connection failure's text is a TLS handshake's (gRPC reports those as
    UNAVAILABLE, like a member that is down)."""
    w = why.lower()
    return any(s in w for s in ("handshake", "ssl", "tsi_", "certificate"))


def _text(key: bytes) -> str:
    t = key.decode("utf-8", "backslashreplace")
    return t if len(t) <= 120 else t[:117] + "..."


def _range_text(key: bytes, range_end: bytes) -> str:
    """``key '/a/b'``, ``prefix '/a/'`` or ``keys '/a' to '/b'`` (etcd's range form)."""
    if not range_end:
        return f"key {_text(key)!r}"
    if range_end == prefix_end(key):
        return f"prefix {_text(key)!r}"
    return f"keys {_text(key)!r} to {_text(range_end)!r}"


def _keys_of(request: Any) -> str:
    """The keys a request names, as text for an error message."""
    if isinstance(request, pb.TxnRequest):
        parts: list[str] = []
        for c in request.compare:
            parts.append(_range_text(c.key, c.range_end))
        for op in [*request.success, *request.failure]:
            inner = getattr(op, op.WhichOneof("request") or "request_range")
            parts.append(_range_text(inner.key, getattr(inner, "range_end", b"")))
        uniq = list(dict.fromkeys(parts))
        return ", ".join(uniq[:4]) + (f" and {len(uniq) - 4} more" if len(uniq) > 4 else "")
    key = getattr(request, "key", None)
    if key is None:
        return "a request"
    return _range_text(key, getattr(request, "range_end", b""))


def _never_sent(exc: grpc.RpcError) -> bool:
    """Whether a failed call never reached a server (safe to send elsewhere)."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and (
        "connection refused" in details or "failed to connect" in details
        or "connect failed" in details or "no route" in details)


def _why(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            return f"{code().name}: {exc.details()}"  # type: ignore[attr-defined]
        except Exception:  # not a finished call
            pass
    return str(exc)
