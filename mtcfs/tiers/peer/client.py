"""The client side of the Peer service: one :class:`PeerClient` per peer address.

Every call is synchronous (call it from a worker thread, never from the trio loop). What it
guarantees:

* **Only missing chunks travel.** :meth:`PeerClient.put_chunks` asks HasChunks first and
  streams only what the peer lacks; chunk bytes given as callables are not even read for
  chunks the peer holds. Between data-parallel replicas, which hold identical chunks, a put
  moves hashes and no payload (``PutResult.bytes_sent == 0``).
* **Nothing unverified comes back.** :meth:`PeerClient.get_chunks` hashes every chunk it
  receives and raises :class:`PeerChunkCorrupt`, naming the peer, on a mismatch.
* **One retry rule.** UNAVAILABLE and DEADLINE_EXCEEDED are retried with full-jitter
  exponential backoff, the policy of :class:`mtcfs.base.retry.RetryPolicy`; other
  statuses surface at once as :class:`PeerError`, the last transient one as
  :class:`PeerUnavailable`. Retrying is safe because every RPC is idempotent (chunks and
  manifests are content-addressed or replace themselves).

Timeouts: unary calls get ``timeout`` seconds; each streaming call gets ``stream_timeout``
seconds and carries at most :data:`STREAM_BYTES` of payload and
:data:`~mtcfs.tiers.peer.limits.MAX_CHUNKS_PER_PUT` chunks (puts) or :data:`GET_BATCH`
chunks (gets), so a slow but live peer finishes within it and a retry repeats little.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Self, TypeVar

import grpc

from mtcfs.base.chunking import chunk_hash
from mtcfs.base.manifest import StepManifest
from mtcfs.base.counters import Counters
from mtcfs.tiers.backup.layout import check_hash
from mtcfs.base.retry import RetryPolicy
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from mtcfs.tiers.peer.chunk_stream import (
    IO_TIMEOUT_S, client_context, read_stream, write_stream,
)
from mtcfs.tiers.peer.errors import PeerChunkCorrupt, PeerError, PeerUnavailable
from mtcfs.tiers.peer.limits import (
    KEEPALIVE_CLIENT, MAX_CHUNKS_PER_PUT, MAX_DIGESTS_PER_CALL, MAX_MANIFEST_BYTES,
    MAX_MESSAGE_BYTES, RECONNECT_CLIENT,
)
from mtcfs.tiers.peer.records import ManifestInfo, PublishResult, PutResult
from mtcfs.tiers.peer.tls import TlsFiles, server_name
from mtcfs.tiers.peer.wire import code_of, decode_bitmap, put_requests

log = logging.getLogger(__name__)

T = TypeVar("T")

#: A chunk's bytes, or a function that reads them (called only if the peer lacks the chunk).
ChunkData = bytes | memoryview | Callable[[], bytes | memoryview]

#: Default retry policy: 5 attempts, waits drawn from [0, 0.1 s], [0, 0.2 s], ... up to 2 s.
DEFAULT_RETRY = RetryPolicy(max_attempts=5, base_delay=0.1, max_delay=2.0)
#: Payload bytes after which a PutChunks stream is closed and the next one started.
STREAM_BYTES = 256 * 1024 * 1024
#: Chunks asked for in one GetChunks call (or one chunk stream of a bulk read).
GET_BATCH = 16
#: Chunks sent in one put over a chunk stream (at 4 MiB, 256 MiB: as a PutChunks stream).
PUT_BATCH = 64

_TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def is_transient(exc: BaseException) -> bool:
    """Return whether ``exc`` is a gRPC error the client retries: status UNAVAILABLE or
    DEADLINE_EXCEEDED. Every other status, and every other exception, is not."""
    if not isinstance(exc, grpc.RpcError):
        return False
    code = getattr(exc, "code", None)
    return callable(code) and code() in _TRANSIENT


class PeerClient:
    """Calls the Peer service of one other node.

    Args:
        address: the peer's ``host:port``.
        job: the job; every request carries it.
        rank: this node's rank; every request carries it.
        timeout: seconds allowed for each unary call.
        stream_timeout: seconds allowed for each streaming call (one batch of a put or get).
        retry: retry policy for UNAVAILABLE / DEADLINE_EXCEEDED (default
            :data:`DEFAULT_RETRY`).
        stop: when set (daemon shutdown), retries stop and the last error is raised.
        rng: random source for the jitter (reproducible tests).
        max_message_bytes: grpc's send and receive limit; must match the server's.
        tls: the job CA and this rank's certificate: the channel then speaks TLS, presents
            the certificate and accepts only a server whose certificate the job CA signed
            for this job (:func:`~mtcfs.tiers.peer.tls.server_name`). None: plaintext.

    The channel connects lazily; a peer that is down shows up as :class:`PeerUnavailable`
    on the first call, after the retries.
    """

    def __init__(self, address: str, job: str, rank: int, timeout: float = 30.0, *,
                 stream_timeout: float = 600.0, retry: RetryPolicy | None = None,
                 stop: threading.Event | None = None, rng: random.Random | None = None,
                 max_message_bytes: int = MAX_MESSAGE_BYTES,
                 tls: TlsFiles | None = None) -> None:
        if timeout <= 0 or stream_timeout <= 0:
            raise ValueError("timeouts must be > 0 seconds")
        self.address = address
        self.job = job
        self.rank = rank
        self._timeout = timeout
        self._stream_timeout = stream_timeout
        self._retry = retry or DEFAULT_RETRY
        self._stop = stop
        self._rng = rng
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # A peer that hangs (stopped, or its host gone without a reset) fails a call in
            # progress by keepalive (measured: 60 s for a SIGSTOPped server) instead of
            # holding it to the 600 s stream timeout, retries included.
            *KEEPALIVE_CLIENT,
            *RECONNECT_CLIENT,
        ]
        #: the TLS files' generation this channel was built with (None: plaintext)
        self.tls_generation = None if tls is None else tls.generation
        if tls is None:
            self._channel = grpc.insecure_channel(address, options=options)
        else:
            self._channel = grpc.secure_channel(
                address, tls.channel_credentials(),
                options=[*options, ("grpc.ssl_target_name_override", server_name(job))])
        self._stub = pb_grpc.PeerStub(self._channel)
        self._tls = tls
        self._tls_ctx: ssl.SSLContext | None = None
        #: False once the peer answered OpenChunkStream with UNIMPLEMENTED
        self._has_stream = True
        self._counters = Counters((
            "calls", "retries", "failures", "bytes_sent", "bytes_received", "chunks_sent",
            "chunks_skipped", "chunks_received", "chunks_unavailable", "chunks_corrupt",
            "streams",
        ))

    @property
    def channel(self) -> grpc.Channel:
        """The channel, for other services of the same server (scope=job's namespace)."""
        return self._channel

    def close(self) -> None:
        """Close the channel; calls in progress are cancelled."""
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Return counters: ``calls`` (attempts), ``retries``, ``failures`` (calls that raised
        after retries), ``bytes_sent`` / ``bytes_received`` (chunk payload), ``chunks_sent``,
        ``chunks_skipped`` (the peer had them), ``chunks_received``, ``chunks_unavailable``
        (the peer did not have them or found its copy corrupt), ``chunks_corrupt`` (the peer
        sent bad bytes)."""
        return self._counters.snapshot()

    # -- retries ----------------------------------------------------------------------------

    def _error(self, exc: grpc.RpcError, what: str) -> PeerError:
        code = exc.code()
        message = f"{what}: {code.name}: {exc.details()}"
        if code in _TRANSIENT:
            return PeerUnavailable(self.address, message, code)
        return PeerError(self.address, message, code)

    def _retry_after(self, exc: grpc.RpcError, attempt: int, started: float,
                     what: str) -> bool:
        """After failed attempt number ``attempt``: wait and return True to try again, or
        return False to give up (the policy's rule, with :func:`is_transient`)."""
        return self._retry.retry_after(
            exc, attempt, started, retryable=is_transient, what=f"{what} to {self.address}",
            stop=self._stop, rng=self._rng,
            on_retry=lambda *_: self._counters.add("retries"), quiet=True)

    def _call(self, fn: Callable[[], T], what: str,
              answers: tuple[grpc.StatusCode, ...] = ()) -> T:
        """Run ``fn`` (one RPC) with retries; translate its errors. A status in ``answers``
        is an answer (raised as PeerError all the same), not counted as a failure."""
        def attempt() -> T:
            self._counters.add("calls")
            return fn()
        try:
            return self._retry.call(
                attempt, retryable=is_transient, what=f"{what} to {self.address}",
                stop=self._stop, rng=self._rng,
                on_retry=lambda *_: self._counters.add("retries"), quiet=True)
        except grpc.RpcError as exc:
            if exc.code() not in answers:
                self._counters.add("failures")
            raise self._error(exc, what) from None

    def _open_stream(self, digests: list[str], *, put: bool
                     ) -> pb.OpenChunkStreamReply | None:
        """OpenChunkStream for ``digests``; None when the peer has no chunk stream
        (UNIMPLEMENTED: remembered, the caller uses GetChunks or PutChunks)."""
        req = pb.OpenChunkStreamRequest(job=self.job, rank=self.rank, digests=digests,
                                        put=put)
        try:
            reply: pb.OpenChunkStreamReply = self._call(lambda: self._stub.OpenChunkStream(
                req, timeout=self._timeout), "OpenChunkStream",
                answers=(grpc.StatusCode.UNIMPLEMENTED,))  # an older peer: not a failure
        except PeerError as exc:
            if exc.code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            log.info("peer %s has no chunk stream; using %s", self.address,
                     "PutChunks" if put else "GetChunks")
            self._has_stream = False
            return None
        if reply.tls != (self._tls is not None):
            raise PeerError(self.address, "OpenChunkStream: the stream's TLS setting differs "
                                          "from the peer port's")
        self._counters.add("streams")
        return reply

    # -- chunks -----------------------------------------------------------------------------

    def has_chunks(self, digests: Sequence[str]) -> list[bool]:
        """Ask which chunks the peer holds (as a replica or in its own RAM tier).

        Returns:
            One flag per digest, in order.

        Raises:
            ValueError: if a digest is malformed.
            PeerUnavailable: if the peer cannot be reached after the retries.
            PeerError: if the peer refuses the call (wrong job, rank out of range).
        """
        for h in digests:
            check_hash(h)
        out: list[bool] = []
        for i in range(0, len(digests), MAX_DIGESTS_PER_CALL):
            batch = list(digests[i:i + MAX_DIGESTS_PER_CALL])
            req = pb.HasChunksRequest(job=self.job, rank=self.rank, digests=batch)
            reply = self._call(lambda: self._stub.HasChunks(req, timeout=self._timeout),
                               "HasChunks")
            try:
                out.extend(decode_bitmap(reply.present, len(batch)))
            except ValueError as exc:
                raise PeerError(self.address, f"HasChunks: {exc}") from None
        return out

    def put_chunks(self, chunks: Iterable[tuple[str, ChunkData]]) -> PutResult:
        """Give the peer the chunks it lacks.

        HasChunks first, then the chunks the peer said it lacks: over chunk streams of
        :data:`PUT_BATCH` chunks where the peer has them (chunk_stream.py, raw bytes; not
        retried: a failed one raises, and a later put skips what arrived), else in
        PutChunks streams of at most :data:`STREAM_BYTES` each. The peer verifies each
        chunk before it acknowledges it.

        Args:
            chunks: ``(digest, data)`` pairs; ``data`` is the bytes or a function returning
                them, called only if the chunk is sent. A digest given twice is sent once.
                A function that raises marks its chunk rejected ("LOCAL_READ_ERROR") and the
                put goes on.

        Returns:
            What happened to each chunk (:class:`PutResult`); ``bytes_sent`` counts the
            payload streamed, retries included.

        Raises:
            ValueError: if a digest is malformed.
            PeerUnavailable: if the peer cannot be reached after the retries (chunks of
                earlier streams may be stored; a later put skips them).
            PeerError: if the peer refuses a whole call.
        """
        items: dict[str, ChunkData] = {}
        for h, data in chunks:
            items.setdefault(check_hash(h), data)
        digests = list(items)
        held = self.has_chunks(digests)
        skipped = [h for h, f in zip(digests, held) if f]
        todo = [(h, items[h]) for h, f in zip(digests, held) if not f]
        self._counters.add("chunks_skipped", len(skipped))
        accepted: list[str] = []
        rejected: dict[str, str] = {}
        sent_chunks = sent_bytes = 0
        start = 0
        while start < len(todo) and self._has_stream:
            batch = todo[start:start + PUT_BATCH]
            done = self._put_by_stream(batch)
            if done is None:
                break  # the peer has no chunk stream: PutChunks from here on
            refused, n, nbytes = done
            sent_chunks += n
            sent_bytes += nbytes
            for h, _data in batch:
                if h in refused:
                    rejected[h] = refused[h]
                else:
                    accepted.append(h)
            start += len(batch)
        while start < len(todo):
            stream = _PutBatch(self, todo, start, rejected)
            reply = self._call(lambda: self._stub.PutChunks(
                stream.requests(), timeout=self._stream_timeout), "PutChunks")
            sent_chunks += stream.chunks
            sent_bytes += stream.bytes
            accepted.extend(reply.accepted)
            for st in reply.rejected:
                rejected[st.digest] = f"{code_of(st.code).name}: {st.message}"
            start = stream.end
        return PutResult(accepted=tuple(accepted), skipped=tuple(skipped), rejected=rejected,
                         chunks_sent=sent_chunks, bytes_sent=sent_bytes)

    def get_chunks(self, digests: Iterable[str]) -> Iterator[tuple[str, bytes]]:
        """Fetch chunks from the peer, verified.

        Yields ``(digest, bytes)`` in request order for each chunk the peer holds; a chunk
        the peer does not hold, or found corrupt in its store, is left out (compare with what
        was asked for, and fetch those from the next source). Asks for :data:`GET_BATCH`
        chunks per call; a call that fails transiently is retried for the chunks not
        received yet.

        Raises:
            ValueError: if a digest is malformed.
            PeerChunkCorrupt: if bytes arrive that do not hash to their digest (the bytes
                are dropped; the rest of the call is abandoned: the peer is suspect).
            PeerUnavailable: if the peer cannot be reached after the retries.
            PeerError: if the peer refuses the call or breaks the protocol.
        """
        todo = list(dict.fromkeys(check_hash(h) for h in digests))
        for i in range(0, len(todo), GET_BATCH):
            remaining = todo[i:i + GET_BATCH]
            started = time.monotonic()
            attempt = 0
            while remaining:
                attempt += 1
                self._counters.add("calls")
                req = pb.GetChunksRequest(job=self.job, rank=self.rank, digests=remaining)
                done: set[str] = set()
                try:
                    yield from self._get_stream(req, done)
                    remaining = []
                except grpc.RpcError as exc:
                    remaining = [h for h in remaining if h not in done]
                    if not self._retry_after(exc, attempt, started, "GetChunks"):
                        self._counters.add("failures")
                        raise self._error(exc, "GetChunks") from None

    def _put_by_stream(self, batch: list[tuple[str, ChunkData]]
                       ) -> tuple[dict[str, str], int, int] | None:
        """One put over a chunk stream (chunk_stream.py): what :func:`write_stream`
        returns, or None when the peer has none (UNIMPLEMENTED; remembered)."""
        reply = self._open_stream([h for h, _ in batch], put=True)
        if reply is None:
            return None
        return write_stream(self.address, self.address.rsplit(":", 1)[0], reply.port,
                            reply.ticket, batch, job=self.job, tls=self._stream_tls(),
                            timeout=min(self._stream_timeout, IO_TIMEOUT_S),
                            counters=self._counters)

    def stream_chunks(self, digests: Sequence[str], *, buffers: int = 1
                      ) -> Iterator[tuple[str, bytes | memoryview | None]]:
        """Fetch chunks in bulk, verified: by the chunk stream where the peer has one
        (chunk_stream.py: raw bytes, no protobuf), else by :meth:`get_chunks`.

        Yields ``(digest, data)`` in request order for every digest asked for (each at most
        once): ``data`` is the chunk's verified bytes, **valid only until the next item is
        asked for** by default (copy it to keep it), or None when the peer does not hold the
        chunk or found its copy corrupt; with ``buffers=k`` a view stays valid until k more
        items have been asked for (k receive buffers in turn). One OpenChunkStream call
        (with the client's retries) per :data:`GET_BATCH` chunks; the stream itself is not
        retried: a caller asks the next holder for what is left.

        Raises:
            ValueError: if a digest is malformed.
            PeerChunkCorrupt, PeerUnavailable, PeerError: as :meth:`get_chunks` (a stream
                that stalls for :data:`~mtcfs.tiers.peer.chunk_stream.IO_TIMEOUT_S` seconds
                is PeerUnavailable).
        """
        todo = list(dict.fromkeys(check_hash(h) for h in digests))
        for i in range(0, len(todo), GET_BATCH):
            batch = todo[i:i + GET_BATCH]
            reply = self._open_stream(batch, put=False) if self._has_stream else None
            if reply is None:  # the peer has no chunk stream
                got = dict(self.get_chunks(batch))
                for h in batch:
                    yield h, got.get(h)
                continue
            host = self.address.rsplit(":", 1)[0]
            yield from read_stream(self.address, host, reply.port, reply.ticket, batch,
                                   job=self.job, tls=self._stream_tls(),
                                   timeout=min(self._stream_timeout, IO_TIMEOUT_S),
                                   buffers=buffers, counters=self._counters)

    def _stream_tls(self) -> ssl.SSLContext | None:
        """The TLS context of chunk streams (None: plaintext), made once per client."""
        if self._tls is None:
            return None
        if self._tls_ctx is None:
            self._tls_ctx = client_context(self._tls)
        return self._tls_ctx

    def _get_stream(self, req: pb.GetChunksRequest,
                    done: set[str]) -> Iterator[tuple[str, bytes]]:
        """One GetChunks call: reassemble, verify, yield; record finished digests in
        ``done``."""
        expect = iter(req.digests)
        current: str | None = None
        total = 0
        parts: list[bytes] = []
        got = 0
        call = self._stub.GetChunks(req, timeout=self._stream_timeout)
        try:
            for item in call:
                kind = item.WhichOneof("item")
                if current is None:
                    want = next(expect, None)
                    h = item.piece.digest if kind == "piece" else item.unavailable.digest
                    if h != want:
                        raise PeerError(self.address, f"GetChunks: got {h!r} where {want!r} "
                                                      f"was due")
                    if kind == "unavailable":
                        done.add(h)
                        self._counters.add("chunks_unavailable")
                        log.debug("peer %s has no usable chunk %s: %s", self.address, h,
                                  item.unavailable.message)
                        continue
                    current, total, parts, got = h, item.piece.total_size, [], 0
                p = item.piece
                if kind != "piece" or p.digest != current or p.offset != got \
                        or p.total_size != total or got + len(p.data) > total:
                    raise PeerError(self.address, f"GetChunks: pieces of chunk {current} "
                                                  f"out of order")
                parts.append(p.data)
                got += len(p.data)
                self._counters.add("bytes_received", len(p.data))
                if got == total:
                    data = parts[0] if len(parts) == 1 else b"".join(parts)
                    h, current = current, None
                    actual = chunk_hash(data)
                    if actual != h:
                        self._counters.add("chunks_corrupt")
                        log.error("peer %s sent chunk %s with bytes hashing to %s",
                                  self.address, h, actual)
                        raise PeerChunkCorrupt(self.address, h,
                                               f"{len(data)} bytes hash to {actual}")
                    done.add(h)
                    self._counters.add("chunks_received")
                    yield h, data
            if current is not None or next(expect, None) is not None:
                raise PeerError(self.address, "GetChunks: the stream ended early")
        finally:
            call.cancel()

    # -- manifests --------------------------------------------------------------------------

    def publish_manifest(self, manifest: StepManifest) -> PublishResult:
        """Give the peer this rank's manifest of one step.

        Publish after the step's chunks are put; the result's ``missing`` lists chunks the
        peer still lacks (put them and publish again). The replica of the step is complete
        when ``missing`` is empty.

        Raises:
            ValueError: if the manifest is of another job or rank, or larger than
                :data:`~mtcfs.tiers.peer.limits.MAX_MANIFEST_BYTES`.
            PeerUnavailable: if the peer cannot be reached after the retries.
            PeerError: if the peer refuses it (INVALID_ARGUMENT: bad or escaping manifest;
                RESOURCE_EXHAUSTED: its store is full).
        """
        if manifest.job != self.job or manifest.rank != self.rank:
            raise ValueError(f"manifest of job {manifest.job!r} rank {manifest.rank} cannot be "
                             f"published by job {self.job!r} rank {self.rank}")
        raw = manifest.to_bytes()
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(f"manifest of step {manifest.step!r} is {len(raw)} bytes; the "
                             f"protocol allows {MAX_MANIFEST_BYTES}")
        req = pb.PublishManifestRequest(job=self.job, rank=self.rank, step=manifest.step,
                                        step_number=manifest.step_number, manifest=raw)
        reply = self._call(lambda: self._stub.PublishManifest(req, timeout=self._timeout),
                           "PublishManifest")
        return PublishResult(chunks_total=reply.chunks_total, missing=tuple(reply.missing),
                             replaced=reply.replaced)

    def list_manifests(self, of_rank: int | None = None, *, step: str | None = None,
                       with_manifest: bool = True) -> list[ManifestInfo]:
        """The manifests the peer holds for ``of_rank`` (default: this rank), oldest first.

        Parse ``ManifestInfo.manifest`` with :meth:`StepManifest.from_bytes`, which rejects
        paths escaping the job. ``chunks_missing == 0`` means the peer holds the whole step.

        Raises:
            PeerUnavailable: if the peer cannot be reached after the retries.
            PeerError: if the peer refuses the call.
        """
        req = pb.ListManifestsRequest(job=self.job, rank=self.rank,
                                      of_rank=self.rank if of_rank is None else of_rank,
                                      step=step or "", without_manifest=not with_manifest)

        def call() -> list[ManifestInfo]:
            return [ManifestInfo(rank=m.rank, step=m.step, step_number=m.step_number,
                                 created_ns=m.created_ns, total_bytes=m.total_bytes,
                                 chunks_total=m.chunks_total, chunks_missing=m.chunks_missing,
                                 manifest_bytes=len(m.manifest), manifest=m.manifest)
                    for m in self._stub.ListManifests(req, timeout=self._stream_timeout)]

        return self._call(call, "ListManifests")


class _PutBatch:
    """The request stream of one PutChunks call: chunks ``todo[start:]`` until
    :data:`STREAM_BYTES` of payload have gone or :data:`MAX_CHUNKS_PER_PUT` chunks.
    Re-iterable, so a retry resends the same batch."""

    def __init__(self, client: PeerClient, todo: list[tuple[str, ChunkData]], start: int,
                 rejected: dict[str, str]) -> None:
        self._client = client
        self._todo = todo
        self._start = start
        self._rejected = rejected
        self.end = start      # index after the last chunk streamed
        self.chunks = 0       # chunks streamed, all attempts
        self.bytes = 0        # payload bytes streamed, all attempts

    def requests(self) -> Iterator[pb.PutChunksRequest]:
        c = self._client
        sent = 0
        j = self._start
        while j < len(self._todo) and (j == self._start or sent < STREAM_BYTES
                                       and j - self._start < MAX_CHUNKS_PER_PUT):
            h, data = self._todo[j]
            j += 1
            self.end = j
            if callable(data):
                try:
                    data = data()
                except Exception as exc:  # noqa: BLE001 (a local read failed: skip the chunk)
                    log.warning("put to %s: cannot read chunk %s: %s", c.address, h, exc)
                    self._rejected[h] = f"LOCAL_READ_ERROR: {exc}"
                    continue
            self._rejected.pop(h, None)
            for req, n in put_requests(c.job, c.rank, h, data):
                yield req
                sent += n
                self.bytes += n
                c._counters.add("bytes_sent", n)
            self.chunks += 1
            c._counters.add("chunks_sent")
