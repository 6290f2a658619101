"""The chunk stream: chunks as raw bytes on a TCP connection beside the gRPC port.

GetChunks moves each chunk through Python-level copies on both sides (the reply message is
encoded, grpcio's threads copy it, the client parses it and joins the pieces): measured on
loopback (benchmarks/bench_recovery.py, docs/benchmarks.md) a restore ran at 0.10-0.13 of a
plain TCP copy, with the receiver at 3.8 CPU seconds per GiB. The chunk stream carries the
same chunks with no framing but a fixed header per chunk, so no byte passes through Python
code: the server hashes each chunk from a read-only mapping of its file (blake3 releases the
GIL) and sends it with ``sendfile(2)``, the client ``recv_into``\\ s one reused buffer and
hashes it there.

Who may read is decided on the gRPC port, as for every other call: ``OpenChunkStream``
(proto/mtcfs_peer.proto) checks the job, the caller's rank and, with TLS, the caller's
certificate, and answers with this server's port and a **ticket**: 16 random bytes that
name the caller and the digests, good for one connection within :data:`TICKET_S` seconds.
The connection speaks TLS with the same certificates when the peer port does (the client
checks the server's job name, the server requires a certificate of the job CA naming the
ticket's rank); without TLS (mount option ``insecure``) it is plaintext, as gRPC then is.

Wire format (all integers big-endian), docs/peer-protocol.md "The chunk stream":

* client -> server: :data:`MAGIC` (8 bytes), then the ticket (16 bytes).
* server -> client, for each digest of the ticket in order: a :data:`HEADER` (status 1
  byte, digest 32 bytes, length 8 bytes), then ``length`` payload bytes. Status
  :data:`OK`: the chunk, verified by the server just before it is sent; :data:`NOT_FOUND`
  and :data:`CORRUPT` (the server's copy failed its check and was deleted): no payload.
  :data:`REFUSED` (unknown, used or expired ticket; wrong certificate): ``length`` bytes of
  a one-line UTF-8 reason, then the server closes the connection.

The client verifies every chunk again (blake3) before it yields it: a peer never gets to
hand over bytes that do not hash to their name.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import secrets
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mtcfs.base import pools
from mtcfs.base.ahead import ahead
from mtcfs.base.chunking import chunk_hash
from mtcfs.base.counters import Counters
from mtcfs.base.failpoints import failpoint
from mtcfs.base.scratch import scratch
from mtcfs.tiers.peer.errors import (
    ChunkMismatch, ChunkNotFound, PeerChunkCorrupt, PeerError, PeerUnavailable,
    ReplicaChunkCorrupt, ReplicaError, ReplicaFull,
)
from mtcfs.tiers.peer.replica_store import ChunkWriter, OpenedChunk
from mtcfs.tiers.peer.tls import TlsFiles, identity_uri, server_name

log = logging.getLogger(__name__)

#: What a client sends first: the protocol and its version.
MAGIC = b"MTCFSCS1"
#: Bytes of a ticket.
TICKET_BYTES = 16
#: Per chunk: status, raw 32-byte digest, payload length in bytes.
HEADER = struct.Struct("!B32sQ")
OK, NOT_FOUND, CORRUPT, REFUSED, FULL = 0, 1, 2, 3, 4
#: Bytes a put stream's receiver hashes and writes at a time.
PIECE = 1 << 20
#: Seconds a ticket stays good.
TICKET_S = 60
#: Tickets outstanding at once; the oldest are dropped past it.
MAX_TICKETS = 4096
#: Seconds one send or receive on a stream may stall before the connection is given up.
IO_TIMEOUT_S = 30.0
#: Longest reason a refusal or a put's verdict carries, bytes.
MAX_REASON = 512
#: Chunks the server opens and verifies ahead of the one it sends.
AHEAD = 2
#: Largest payload a client accepts for one chunk (the largest chunk mtcfs allows).
MAX_PAYLOAD = 256 * 1024 * 1024


@dataclass(frozen=True)
class Ticket:
    """What a ticket allows: ``rank`` reads (or with ``put``, sends) ``digests``, in order,
    on one connection opened before ``expires`` (monotonic seconds)."""

    rank: int
    digests: tuple[str, ...]
    expires: float
    put: bool = False


class ChunkFiles(Protocol):
    """What the stream server reads chunks from and puts them into (the replica store,
    :class:`~mtcfs.tiers.peer.replica_store.ReplicaStore`)."""

    def open_chunk(self, h: str) -> contextlib.AbstractContextManager[OpenedChunk]:
        """Chunk ``h``, verified, open for as long as the context lasts. Raises
        ChunkNotFound, ReplicaChunkCorrupt, OSError."""
        ...

    def chunk_writer(self, h: str, size: int, rank: int | None = None) -> ChunkWriter:
        """Start storing chunk ``h`` of ``size`` bytes sent by ``rank``. Raises ReplicaFull
        (capacity or the rank's quota), OSError."""
        ...


class ChunkStreamServer:
    """Serves chunk streams on a TCP port of its own; tickets are issued by the Peer service.

    Args:
        store: where the chunks are (``open_chunk(h)``, a context manager yielding the
            verified bytes; the replica store).
        host: the address to listen on (the peer port's host).
        port: the TCP port; 0 picks a free one.
        job: the job served (the TLS identities name it).
        tls: the peer port's certificates; None: plaintext (mount option ``insecure``).
        counters: the Peer service's counters (``chunks_sent``, ``bytes_sent``,
            ``chunks_unavailable``, ``streams``, ``streams_refused``).
        clock: monotonic seconds (tests).

    Raises:
        OSError: if the port cannot be bound.
    """

    def __init__(self, store: ChunkFiles, host: str, job: str, *, tls: TlsFiles | None = None,
                 counters: Counters | None = None, port: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self._job = job
        self._tls = tls
        self._clock = clock
        self._counters = counters or Counters(("chunks_sent", "bytes_sent",
                                               "chunks_unavailable", "streams",
                                               "streams_refused"))
        self._tickets: dict[bytes, Ticket] = {}
        self._lock = threading.Lock()
        self._ctx: tuple[int, ssl.SSLContext] | None = None
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host.strip("[]"), port))
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._stopped = threading.Event()
        self._pool = pools.new_executor("chunk-stream")
        self._put_pool = pools.new_executor("chunk-stream-put")
        self._thread = threading.Thread(target=self._accept, name="mtcfs-chunk-stream-accept",
                                        daemon=True)
        self._thread.start()

    @property
    def tls(self) -> bool:
        return self._tls is not None

    def issue(self, rank: int, digests: Sequence[str], *, put: bool = False) -> bytes:
        """A new ticket for ``rank`` to read ``digests`` (with ``put``: to send them), the
        request already checked by the Peer service."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = self._clock()
        with self._lock:
            for t, tk in list(self._tickets.items()):
                if tk.expires <= now:
                    del self._tickets[t]
            while len(self._tickets) >= MAX_TICKETS:
                del self._tickets[next(iter(self._tickets))]
            self._tickets[ticket] = Ticket(rank, tuple(digests), now + TICKET_S, put)
        return ticket

    def stop(self) -> None:
        """Stop accepting; streams in progress end at their next send (socket closed)."""
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._put_pool.shutdown(wait=False, cancel_futures=True)

    # -- serving ----------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            try:
                self._pool.submit(self._serve, conn, addr)
            except RuntimeError:  # shut down meanwhile
                conn.close()
                return

    def _context(self) -> ssl.SSLContext:
        assert self._tls is not None
        gen = self._tls.generation
        if self._ctx is None or self._ctx[0] != gen:
            p = self._tls.paths
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=p["tls_ca"])
            ctx.load_cert_chain(p["tls_cert"], p["tls_key"])
            self._ctx = (gen, ctx)
        return self._ctx[1]

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        """One connection, in a thread of the ``chunk-stream`` pool: check its hello, then
        send the chunks of a get ticket here (a restore may be waiting for them), or hand
        a put ticket's to a thread of the ``chunk-stream-put`` pool (a peer's replication:
        background work, base/background.py)."""
        socks = [conn]
        self._closing(socks, addr, self._open, conn, addr, socks)

    def _closing(self, socks: list[socket.socket], addr: Any,
                 fn: Callable[..., None], *args: Any) -> None:
        """``fn(*args)``, its errors logged (the stream ends; the other side asks again or
        elsewhere), then every socket left in ``socks`` closed (``fn`` empties the list
        when it hands the connection on)."""
        try:
            fn(*args)
        except (OSError, ssl.SSLError, EOFError) as exc:
            log.info("chunk stream with %s ended: %s", addr, exc)
        except Exception:  # a bug: the stream ends, logged
            log.exception("chunk stream with %s failed", addr)
        finally:
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()

    def _open(self, conn: socket.socket, addr: Any, socks: list[socket.socket]) -> None:
        """:meth:`_serve`'s work: the hello, the ticket, then the chunks (``socks``: the
        connection's sockets, the TLS one added; emptied when a put is handed on)."""
        conn.settimeout(IO_TIMEOUT_S)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock: socket.socket = conn
        if self._tls is not None:
            sock = self._context().wrap_socket(conn, server_side=True)
            socks.append(sock)
        hello = _recv_exact(sock, len(MAGIC) + TICKET_BYTES)
        if hello[:len(MAGIC)] != MAGIC:
            return self._refuse(sock, addr, "not an mtcfs chunk stream")
        with self._lock:
            ticket = self._tickets.pop(hello[len(MAGIC):], None)
        if ticket is None or ticket.expires <= self._clock():
            return self._refuse(sock, addr, "unknown, used or expired ticket")
        if self._tls is not None and not _names(sock, identity_uri(self._job, ticket.rank)):
            return self._refuse(sock, addr, f"the certificate is not rank {ticket.rank}'s"
                                            f" of job {self._job}")
        self._counters.add("streams")
        if not ticket.put:
            return self._send_chunks(sock, ticket.digests)
        try:
            self._put_pool.submit(self._closing, list(socks), addr, self._receive_chunks,
                                  sock, ticket, addr)
        except RuntimeError:  # the put pool was shut down: the server stops
            return
        socks.clear()  # closed by the put thread

    def _refuse(self, sock: socket.socket, addr: Any, why: str) -> None:
        self._counters.add("streams_refused")
        log.warning("refused a chunk stream from %s: %s", addr, why)
        reason = why.encode()[:MAX_REASON]
        sock.sendall(HEADER.pack(REFUSED, bytes(32), len(reason)) + reason)

    def _receive_chunks(self, sock: socket.socket, ticket: Ticket, addr: Any) -> None:
        """Take each chunk of a put ticket into the store, verified, then answer one
        verdict per chunk. Each chunk is received in :data:`PIECE` pieces, each hashed and
        written as it comes (the kernel receives the next meanwhile)."""
        view = memoryview(scratch(PIECE))
        verdicts: list[tuple[int, str, str]] = []
        for want in ticket.digests:
            status, raw, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
            h = raw.hex()
            if h != want:
                return self._refuse(sock, addr, f"got chunk {h} where {want} was due")
            if status != OK:  # the sender could not read it: nothing follows
                verdicts.append((NOT_FOUND, h, "not sent"))
                continue
            if length > MAX_PAYLOAD:
                return self._refuse(sock, addr, f"a chunk of {length} bytes; at most "
                                                f"{MAX_PAYLOAD}")
            try:
                writer = self._store.chunk_writer(h, length, ticket.rank)
            except ReplicaFull as exc:
                _discard(sock, view, length)
                self._counters.add("bytes_received", length)
                self._counters.add("chunks_rejected")
                verdicts.append((FULL, h, str(exc)))
                continue
            with writer:
                left = length
                while left:
                    n = min(left, PIECE)
                    _recv_into(sock, view[:n])
                    writer.write(view[:n])
                    left -= n
                self._counters.add("bytes_received", length)
                failpoint("peer.put_chunk")  # tests: a slow store, a writer dying mid-stream
                try:
                    new = writer.commit()
                except ChunkMismatch as exc:
                    self._counters.add("chunks_rejected")
                    log.warning("chunk stream from %s: %s", addr, exc)
                    verdicts.append((CORRUPT, h, str(exc)))
                    continue
                except ReplicaError as exc:
                    self._counters.add("chunks_rejected")
                    verdicts.append((FULL if isinstance(exc, ReplicaFull) else CORRUPT, h,
                                     str(exc)))
                    continue
            self._counters.add("chunks_received" if new else "chunks_already_present")
            verdicts.append((OK, h, ""))
        out = bytearray()
        for status, h, why in verdicts:
            reason = why.encode()[:MAX_REASON]
            out += HEADER.pack(status, bytes.fromhex(h), len(reason)) + reason
        sock.sendall(out)

    def _send_chunks(self, sock: socket.socket, digests: Sequence[str]) -> None:
        """Send each chunk (or why not) in order. A second thread opens and verifies up to
        :data:`AHEAD` chunks ahead of the one being sent, so hashing and sending overlap."""
        def opened(h: str) -> tuple[str, int, OpenedChunk | None, contextlib.ExitStack]:
            stack = contextlib.ExitStack()
            try:
                return h, OK, stack.enter_context(self._store.open_chunk(h)), stack
            except ChunkNotFound:
                return h, NOT_FOUND, None, stack
            except ReplicaChunkCorrupt:
                return h, CORRUPT, None, stack

        for h, status, chunk, stack in ahead(digests, opened, depth=AHEAD,
                                             name="mtcfs-chunk-stream-read",
                                             discard=lambda item: item[3].close()):
            with stack:
                raw = bytes.fromhex(h)
                if chunk is None:
                    self._counters.add("chunks_unavailable")
                    sock.sendall(HEADER.pack(status, raw, 0))
                    continue
                n = len(chunk.view)
                sock.sendall(HEADER.pack(OK, raw, n))
                _send_all(sock, chunk)
                self._counters.add("chunks_sent")
                self._counters.add("bytes_sent", n)


def _names(sock: Any, uri: str) -> bool:
    cert = sock.getpeercert() or {}
    return ("URI", uri) in cert.get("subjectAltName", ())


def _send_all(sock: socket.socket, chunk: OpenedChunk) -> None:
    """Send the chunk's bytes: from its file by ``sendfile(2)`` on a plaintext socket (no
    copy through this process), else from its mapping."""
    if chunk.file is not None and not isinstance(sock, ssl.SSLSocket):
        sent = sock.sendfile(chunk.file, 0, len(chunk.view))
        if sent != len(chunk.view):
            raise EOFError(f"sendfile sent {sent} of {len(chunk.view)} bytes (the file shrank)")
    else:
        sock.sendall(chunk.view)


def _discard(sock: socket.socket, view: memoryview, n: int) -> None:
    """Receive and drop ``n`` bytes (a chunk refused before its bytes came)."""
    while n:
        k = min(n, len(view))
        _recv_into(sock, view[:k])
        n -= k


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


# ---------------------------------------------------------------------- the client side

def client_context(tls: TlsFiles) -> ssl.SSLContext:
    """The TLS context a client opens a stream with: this rank's certificate, the job CA as
    the only root (the server's name is checked against the job's, as on the gRPC port)."""
    p = tls.paths
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(cafile=p["tls_ca"])
    ctx.load_cert_chain(p["tls_cert"], p["tls_key"])
    return ctx


def read_stream(address: str, host: str, port: int, ticket: bytes, digests: Sequence[str],
                *, job: str, tls: ssl.SSLContext | None = None,
                timeout: float = IO_TIMEOUT_S, buffers: int = 1,
                counters: Counters | None = None) -> Iterator[tuple[str, memoryview | None]]:
    """Read one chunk stream: connect to ``host:port``, present ``ticket``, receive.

    Args:
        address: the peer's gRPC address (for error messages).
        host, port: where the stream is (the peer's host, the port OpenChunkStream named).
        ticket: the ticket OpenChunkStream returned.
        digests: the digests the ticket was issued for, in the same order.
        job: the job (the server's TLS name).
        tls: the client's TLS context (:func:`client_context`), or None for plaintext.
        timeout: seconds any one send, receive or the connect may stall.
        buffers: receive buffers used in turn (each as large as the largest chunk so far).
        counters: ``bytes_received``, ``chunks_received``, ``chunks_unavailable``,
            ``chunks_corrupt`` are counted here.

    Yields:
        ``(digest, bytes)`` in ticket order: a view of the chunk's verified bytes, or None
        when the server does not hold the chunk or found its copy corrupt. A view is valid
        until ``buffers`` more chunks have been asked for (with ``buffers=1``: until the
        next item is asked for); copy it to keep it longer.

    Raises:
        PeerUnavailable: the connection could not be made, stalled past ``timeout``, or
            ended early.
        PeerChunkCorrupt: bytes arrived that do not hash to their digest (the rest of the
            stream is abandoned).
        PeerError: the server refused the stream (its reason in the message) or broke the
            protocol.
    """
    sock = _connect(address, host, port, ticket, job, tls, timeout)
    bufs: list[mmap.mmap | bytearray] = [bytearray() for _ in range(max(1, buffers))]
    turn = 0
    try:
        for want in digests:
            try:
                status, digest, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
            except (OSError, EOFError) as exc:
                raise PeerUnavailable(address, f"chunk stream: {exc}") from None
            if status == REFUSED:
                raise PeerError(address, f"chunk stream refused: {_reason(sock, length)}")
            h = digest.hex()
            if h != want:
                raise PeerError(address, f"chunk stream: got {h} where {want} was due")
            if status != OK:
                if counters is not None:
                    counters.add("chunks_unavailable")
                yield h, None
                continue
            if length > MAX_PAYLOAD:
                raise PeerError(address, f"chunk stream: a {length}-byte chunk is larger than"
                                         f" any chunk size allows")
            slot = turn % len(bufs)
            turn += 1
            if len(bufs[slot]) < length:
                bufs[slot] = scratch(length)  # (its views may outlive it here)
            view = memoryview(bufs[slot])[:length]
            try:
                _recv_into(sock, view)
            except (OSError, EOFError) as exc:
                raise PeerUnavailable(address, f"chunk stream: {exc}") from None
            actual = chunk_hash(view)
            if actual != h:
                if counters is not None:
                    counters.add("chunks_corrupt")
                log.error("peer %s sent chunk %s with bytes hashing to %s", address, h, actual)
                raise PeerChunkCorrupt(address, h, f"{length} bytes hash to {actual}")
            if counters is not None:
                counters.add("chunks_received")
                counters.add("bytes_received", length)
            yield h, view
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def _reason(sock: socket.socket, length: int) -> str:
    """The reason of a refusal (at most :data:`MAX_REASON` bytes of it are read)."""
    try:
        return _recv_exact(sock, min(length, MAX_REASON)).decode(errors="replace")
    except (OSError, EOFError):
        return "(no reason given)"


def _connect(address: str, host: str, port: int, ticket: bytes, job: str,
             tls: ssl.SSLContext | None, timeout: float) -> socket.socket:
    """A connection to a chunk stream port that has presented ``ticket``.

    Raises:
        PeerUnavailable: it cannot be made or stalls past ``timeout``.
        PeerError: the TLS handshake fails (a certificate not of the job).
    """
    try:
        raw = socket.create_connection((host.strip("[]"), port), timeout=timeout)
    except OSError as exc:
        raise PeerUnavailable(address, f"chunk stream port {port}: {exc}") from None
    sock: socket.socket = raw
    try:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None:
            sock = tls.wrap_socket(raw, server_hostname=server_name(job))
        sock.sendall(MAGIC + ticket)
    except ssl.SSLError as exc:
        raw.close()
        raise PeerError(address, f"chunk stream TLS handshake: {exc}") from None
    except OSError as exc:
        raw.close()
        raise PeerUnavailable(address, f"chunk stream: {exc}") from None
    return sock


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError(f"the connection closed after {got} of {n} bytes of a chunk")
        got += k


#: Chunks a put stream's sender reads from its store ahead of the one it sends.
READ_AHEAD = 2

#: One chunk to put: its digest and its bytes, or a function that reads them (called once,
#: in the stream's read-ahead thread; one that raises marks the chunk not sent).
PutItem = tuple[str, "bytes | memoryview | Callable[[], bytes | memoryview]"]


def write_stream(address: str, host: str, port: int, ticket: bytes,
                 chunks: Sequence[PutItem], *, job: str,
                 tls: ssl.SSLContext | None = None, timeout: float = IO_TIMEOUT_S,
                 counters: Counters | None = None) -> tuple[dict[str, str], int, int]:
    """Send the chunks of a put ticket, in its order, and read the server's verdicts.

    Args:
        address, host, port, ticket, job, tls, timeout: as :func:`read_stream`.
        chunks: the ticket's chunks, in its order.
        counters: ``bytes_sent``, ``chunks_sent`` are counted here.

    Returns:
        ``(refused, chunks_sent, bytes_sent)``: ``refused`` maps each digest the server
        does not hold now to ``"STATUS: reason"`` (DATA_LOSS: its bytes did not hash to
        its name; RESOURCE_EXHAUSTED: no room; LOCAL_READ_ERROR: this side could not read
        it); every other chunk is verified and held by the server.

    Raises:
        PeerUnavailable, PeerError: as :func:`read_stream` (nothing is known of the chunks
            then: ask HasChunks, or send them again).
    """
    sock = _connect(address, host, port, ticket, job, tls, timeout)
    refused: dict[str, str] = {}
    sent = nbytes = 0
    try:
        try:
            for h, data in _read_ahead(chunks, refused, address):
                raw = bytes.fromhex(h)
                if data is None:
                    sock.sendall(HEADER.pack(NOT_FOUND, raw, 0))
                    continue
                n = len(data)
                sock.sendall(HEADER.pack(OK, raw, n))
                sock.sendall(data)
                sent += 1
                nbytes += n
                if counters is not None:
                    counters.add("chunks_sent")
                    counters.add("bytes_sent", n)
        except (OSError, EOFError) as exc:
            raise PeerUnavailable(address, f"chunk stream: {exc}") from None
        for h, _data in chunks:
            try:
                status, raw, length = HEADER.unpack(_recv_exact(sock, HEADER.size))
                if length > MAX_REASON:
                    raise PeerError(address, f"chunk stream: a {length}-byte reason")
                reason = _recv_exact(sock, length).decode(errors="replace") if length else ""
            except (OSError, EOFError) as exc:
                raise PeerUnavailable(address, f"chunk stream: {exc}") from None
            if status == REFUSED:
                raise PeerError(address, f"chunk stream refused: {reason}")
            if raw.hex() != h:
                raise PeerError(address, f"chunk stream: a verdict for {raw.hex()} where {h}"
                                         f" was due")
            if status == OK:
                continue
            if h not in refused:
                name = {CORRUPT: "DATA_LOSS", FULL: "RESOURCE_EXHAUSTED"}.get(status,
                                                                              "NOT_FOUND")
                refused[h] = f"{name}: {reason}"
    finally:
        with contextlib.suppress(OSError):
            sock.close()
    return refused, sent, nbytes


def _read_ahead(chunks: Sequence[PutItem], refused: dict[str, str],
                address: str) -> Iterator[tuple[str, bytes | memoryview | None]]:
    """``(digest, bytes)`` for each chunk, its reader called up to :data:`READ_AHEAD`
    chunks ahead in a thread of its own; None (and the reason in ``refused``) when the
    reader raised."""
    def read(c: PutItem) -> tuple[str, bytes | memoryview | None]:
        h, item = c
        if not callable(item):
            return h, item
        try:
            return h, item()
        except Exception as exc:  # noqa: BLE001 (a local read failed: skip the chunk)
            log.warning("put to %s: cannot read chunk %s: %s", address, h, exc)
            refused[h] = f"LOCAL_READ_ERROR: {exc}"
            return h, None

    return ahead(chunks, read, depth=READ_AHEAD, name="mtcfs-chunk-stream-read")
