"""The server side of one PutChunks call: check the piece sequence, then verify and store
each chunk, overlapping the store work with receiving.

Pieces of a chunk must come in order and back to back (offsets 0, len0, len0+len1, ...),
each repeating the digest and total size; a piece at offset 0 starts the next chunk.
Breaking that refuses the whole call (:class:`Refused`, INVALID_ARGUMENT), as do a piece
above 16 MiB (:data:`~mtcfs.tiers.peer.limits.PIECE_BYTES`) and more than 65,536 chunks in
one stream (:data:`~mtcfs.tiers.peer.limits.MAX_CHUNKS_PER_PUT`). A chunk whose
bytes do not hash to its digest (DATA_LOSS), that does not fit (RESOURCE_EXHAUSTED) or that
the stream leaves unfinished (INVALID_ARGUMENT) is refused alone, in the reply, and the stream
goes on.

The call's thread only reads and checks messages. Hashing and writing run in a second thread
fed through a short queue (:data:`QUEUE_PIECES` pieces), so chunk N is hashed and written while
chunk N+1 arrives; on a loopback stream that overlap is most of the throughput. Memory per call
stays below ``QUEUE_PIECES`` pieces (16 MiB each at most; 4 MiB with default chunks).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from mtcfs.base.counters import Counters
from mtcfs.base.failpoints import failpoint
from mtcfs.tiers.backup.layout import check_hash
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer.errors import ChunkMismatch, ReplicaError, ReplicaFull
from mtcfs.tiers.peer.limits import MAX_CHUNK_BYTES, MAX_CHUNKS_PER_PUT, PIECE_BYTES
from mtcfs.tiers.peer.replica_store import ChunkWriter, ReplicaStore
from mtcfs.tiers.peer.wire import status

log = logging.getLogger(__name__)

#: Pieces received but not yet stored, per call.
QUEUE_PIECES = 4


class Refused(Exception):
    """A request refused as a whole, with the gRPC status to answer.

    Attributes:
        code: the status code.
    """

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class PutStream:
    """Handles one PutChunks call.

    Args:
        store: where chunks go.
        counters: the service's counters (``bytes_received``, ``chunks_received``,
            ``chunks_already_present``, ``chunks_rejected``).
        check: ``check(job, rank)`` raises :class:`Refused` for a request the service does
            not take; applied to the first message.
        peer: the caller, for log lines.
    """

    def __init__(self, store: ReplicaStore, counters: Counters,
                 check: Callable[[str, int], None], peer: str) -> None:
        self._store = store
        self._counters = counters
        self._check = check
        self._peer = peer
        self._received = 0
        self._digest: str | None = None   # the chunk being received
        self._total = 0
        self._next = 0
        self._chunks = 0                  # chunks started in this stream

    def run(self, requests: Iterator[pb.PutChunksRequest]) -> pb.PutChunksReply:
        """Consume the request stream and return the reply.

        Raises:
            Refused: on a request the service does not take or a broken piece sequence
                (nothing of the unfinished chunk is stored).
            OSError: if the store cannot be written.
        """
        sink = _Sink(self._store, self._counters, self._peer)
        job: str | None = None
        rank = -1
        try:
            for req in requests:
                if job is None:
                    self._check(req.job, req.rank)
                    job, rank = req.job, req.rank
                    sink.rank = rank  # before its first piece is queued
                elif req.job != job or req.rank != rank:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                  "job or rank changed in the middle of a PutChunks stream")
                self._piece(req.piece, sink)
            if self._digest is not None:
                sink.abandon(grpc.StatusCode.INVALID_ARGUMENT,
                             f"stream ended after {self._next} of {self._total} bytes")
        except BaseException:
            sink.close(abort=True)
            raise
        finally:
            self._counters.add("bytes_received", self._received)
        accepted, rejected, already = sink.close()
        return pb.PutChunksReply(accepted=accepted, rejected=rejected,
                                 bytes_received=self._received, already_present=already)

    def _piece(self, p: pb.ChunkPiece, sink: _Sink) -> None:
        data = p.data  # one copy out of the message
        n = len(data)
        self._received += n
        if n > PIECE_BYTES:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"a piece of {n} bytes; at most {PIECE_BYTES}")
        if p.offset == 0:
            if self._digest is not None:
                sink.abandon(grpc.StatusCode.INVALID_ARGUMENT,
                             f"next chunk started after {self._next} of {self._total} bytes")
            self._chunks += 1
            if self._chunks > MAX_CHUNKS_PER_PUT:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"more than {MAX_CHUNKS_PER_PUT} chunks in one PutChunks stream")
            try:
                check_hash(p.digest)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            if p.total_size > MAX_CHUNK_BYTES:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"chunk {p.digest} of {p.total_size} bytes; at most "
                              f"{MAX_CHUNK_BYTES}")
            self._digest, self._total, self._next = p.digest, p.total_size, 0
        elif p.digest != self._digest or p.offset != self._next or p.total_size != self._total:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"piece of {p.digest[:16]!r} at offset {p.offset} does not continue "
                          f"chunk {str(self._digest)[:16]!r} at offset {self._next}")
        if self._next + n > self._total:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                          f"pieces of chunk {p.digest} exceed its {self._total} bytes")
        last = self._next + n == self._total
        sink.piece(p.digest, self._total, self._next == 0, data, last)
        self._next += n
        if last:
            self._digest = None


class _Sink:
    """The store side of one call, in its own thread, fed in order through a short queue.

    Operations: a piece (``first`` opens a writer, ``last`` commits), ``abandon`` (the
    current chunk will not be finished), and the end. Results are read after :meth:`close`.
    """

    def __init__(self, store: ReplicaStore, counters: Counters, peer: str) -> None:
        self._store = store
        self._counters = counters
        self._peer = peer
        self._queue: queue.Queue[tuple[Any, ...]] = queue.Queue(maxsize=QUEUE_PIECES)
        self._accepted: list[str] = []
        self._rejected: list[pb.ChunkStatus] = []
        self._already = 0
        #: the sender, whose per-rank quota the chunks count against (set once checked)
        self.rank: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="mtcfs-peer-put", daemon=True)
        self._thread.start()

    # -- the call's thread ------------------------------------------------------------------

    def piece(self, digest: str, total: int, first: bool, data: bytes, last: bool) -> None:
        self._put(("piece", digest, total, first, data, last))

    def abandon(self, code: grpc.StatusCode, message: str) -> None:
        self._put(("abandon", code, message))

    def _put(self, op: tuple[Any, ...]) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(op)

    def close(self, abort: bool = False) -> tuple[list[str], list[pb.ChunkStatus], int]:
        """End the stream (``abort``: drop an unfinished chunk without a verdict), wait for
        the thread, and return ``(accepted, rejected, already_present)``.

        Raises:
            Exception: what the store raised unexpectedly (OSError: disk trouble), unless
                ``abort``.
        """
        if not self._closed:
            self._closed = True
            self._queue.put(("end",))
            self._thread.join()
        if self._error is not None and not abort:
            raise self._error
        return self._accepted, self._rejected, self._already

    # -- the store thread -------------------------------------------------------------------

    def _loop(self) -> None:
        writer: ChunkWriter | None = None
        digest = ""
        while True:
            op = self._queue.get()
            if op[0] == "end":
                if writer is not None:
                    writer.abort()
                return
            if self._error is not None:
                continue  # drain until the end
            try:
                if op[0] == "abandon":
                    if writer is not None:
                        writer.abort()
                        writer = None
                        self._reject(digest, op[1], op[2])
                    continue
                _, digest, total, first, data, last = op
                if first:
                    writer = self._open(digest, total)
                if writer is not None:
                    writer.write(data)
                    if last:
                        self._commit(writer)
                        writer = None
                        failpoint("peer.put_chunk")  # tests: a writer dies mid-stream
            except BaseException as exc:  # noqa: BLE001 (close() re-raises it in the call's thread)
                self._error = exc
                if writer is not None:
                    writer.abort()
                    writer = None

    def _open(self, digest: str, total: int) -> ChunkWriter | None:
        try:
            return self._store.chunk_writer(digest, total, rank=self.rank)
        except ReplicaFull as exc:
            # refuse this chunk and skip its pieces; a later, smaller one may still fit
            self._reject(digest, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            return None

    def _commit(self, writer: ChunkWriter) -> None:
        try:
            new = writer.commit()
        except ChunkMismatch as exc:
            log.warning("PutChunks from %s: %s", self._peer, exc)
            self._reject(writer.digest, grpc.StatusCode.DATA_LOSS, str(exc))
            return
        except ReplicaError as exc:
            self._reject(writer.digest, grpc.StatusCode.ABORTED, str(exc))
            return
        finally:
            writer.abort()
        self._accepted.append(writer.digest)
        if new:
            self._counters.add("chunks_received")
        else:
            self._already += 1
            self._counters.add("chunks_already_present")

    def _reject(self, digest: str, code: grpc.StatusCode, message: str) -> None:
        self._rejected.append(status(digest, code, message))
        self._counters.add("chunks_rejected")
