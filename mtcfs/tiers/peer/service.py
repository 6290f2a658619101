"""The Peer gRPC service over a :class:`~mtcfs.tiers.peer.replica_store.ReplicaStore`.

It runs grpcio's *synchronous* server: each call is served in a thread of the server's own
pool, and touches only thread-safe objects (the replica store and the counters). It never
runs on, or waits for, the trio loop that serves FUSE. Later calls into
the filesystem core (which is trio-side) go through ``trio.from_thread.run``; see
docs/peer-protocol.md for why grpcio's asyncio API is not used.

Input is checked before anything is stored; every refusal is a gRPC status the sender can act
on, and the server keeps serving:

=========================================  ===========================================
request                                    status
=========================================  ===========================================
bytes that are not the request message     INVALID_ARGUMENT (whole call)
(TLS) the caller's certificate names another PERMISSION_DENIED (whole call); a caller
job, or another rank than the request         without a certificate of the job CA fails
                                           the TLS handshake (UNAVAILABLE at the client)
another job                                FAILED_PRECONDITION (whole call)
rank (or of_rank) outside [0, nodes)       INVALID_ARGUMENT (whole call)
malformed digest, too many digests,        INVALID_ARGUMENT (whole call)
pieces out of order, chunk > 256 MiB,
piece > 16 MiB, > 65,536 chunks in a put,
negative step_number, step name > 250 bytes
message above the size limit               RESOURCE_EXHAUSTED (grpc itself)
bytes that do not hash to their digest     DATA_LOSS in PutChunksReply.rejected (chunk)
replica store full                         RESOURCE_EXHAUSTED in .rejected (chunk), or
                                           for a manifest, of the whole call
bad manifest, path escaping the job or     INVALID_ARGUMENT (whole call)
step, manifest of another job/rank/step
chunk not held / corrupt on disk           NOT_FOUND / DATA_LOSS in GetChunksReply
OpenChunkStream on a server without the    UNIMPLEMENTED (whole call; the client uses
chunk stream (in-memory transport)            GetChunks)
=========================================  ===========================================

A refusal's reason is one line of at most :data:`MAX_REASON_CHARS` characters, and names
neither this job nor its size.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError, Message

from mtcfs.base import pools
from mtcfs.base.manifest import ManifestError, StepManifest
from mtcfs.base.counters import Counters
from mtcfs.tiers.backup.layout import check_hash, check_step
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer._pb import mtcfs_peer_pb2_grpc as pb_grpc
from mtcfs.tiers.peer.chunk_stream import TICKET_S, ChunkStreamServer
from mtcfs.tiers.peer.errors import ReplicaFull
from mtcfs.tiers.peer.get_stream import encode_reply, stream_chunks
from mtcfs.tiers.peer.limits import (
    KEEPALIVE_SERVER,
    MAX_DIGESTS_PER_CALL,
    MAX_MANIFEST_BYTES,
    MAX_MESSAGE_BYTES,
)
from mtcfs.tiers.peer.put_stream import PutStream, Refused
from mtcfs.tiers.peer.replica_store import ReplicaStore
from mtcfs.tiers.peer.tls import TlsFiles, caller_identities
from mtcfs.tiers.peer.wire import encode_bitmap

log = logging.getLogger(__name__)

#: Default threads of the server's pool (concurrent calls; more wait in line).
DEFAULT_WORKERS = 8
#: Longest reason a refused call carries, characters (what it quotes is cut).
MAX_REASON_CHARS = 512


class PeerService(pb_grpc.PeerServicer):
    """Serves the Peer RPCs of one job from one replica store.

    Args:
        store: where replicas live.
        job: the job served; requests for any other are FAILED_PRECONDITION.
        nodes: ranks in the job; a rank outside [0, nodes) is INVALID_ARGUMENT.
        authenticate: serve a call only when the caller's verified TLS certificate names
            this job and the rank the request says it comes from (docs/security.md). False
            only for a server without TLS (mount option ``insecure``, and unit tests).

    Raises:
        ValueError: if ``job`` is empty or ``nodes < 1``.
    """

    def __init__(self, store: ReplicaStore, job: str, nodes: int, *,
                 authenticate: bool = False) -> None:
        if not job:
            raise ValueError("job must not be empty")
        if nodes < 1:
            raise ValueError(f"nodes must be >= 1, got {nodes}")
        self._store = store
        self._job = job
        self._nodes = nodes
        self._authenticate = authenticate
        #: Fault injection for tests (``mtcfs`` control ``fault``): calls from these ranks are
        #: refused with UNAVAILABLE, as if the network between them were cut.
        self.partitioned: set[int] = set()
        self._counters = Counters((
            "calls", "calls_refused", "bytes_received", "bytes_sent", "chunks_received",
            "chunks_already_present", "chunks_rejected", "chunks_sent", "chunks_unavailable",
            "manifests_published", "calls_denied", "streams", "streams_refused",
        ))
        #: The raw chunk stream beside the gRPC port (chunk_stream.py); set by :func:`serve`.
        self.chunk_stream: ChunkStreamServer | None = None

    @property
    def store(self) -> ReplicaStore:
        return self._store

    def stats(self) -> dict[str, int]:
        """Return counters.

        ``calls``, ``calls_refused`` (whole calls refused with a status), ``bytes_received``
        and ``bytes_sent`` (chunk payload bytes), ``chunks_received`` (stored now),
        ``chunks_already_present`` (sent although held), ``chunks_rejected`` (refused in a
        PutChunks reply), ``chunks_sent``, ``chunks_unavailable`` (asked for, not served),
        ``manifests_published``.
        """
        return self._counters.snapshot()

    # -- common checks ----------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, context: grpc.ServicerContext, what: str) -> Iterator[None]:
        """Count the call; turn refusals and store errors into a status for the caller."""
        self._counters.add("calls")
        try:
            yield
        except Refused as exc:
            code, message = exc.code, str(exc)
        except ReplicaFull as exc:
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except OSError as exc:
            log.exception("%s from %s failed", what, context.peer())
            code, message = grpc.StatusCode.INTERNAL, f"{what} failed on the server: {exc}"
        else:
            return
        self._counters.add("calls_refused")
        message = _one_line(message)
        log.warning("refused %s from %s: %s %s", what, context.peer(), code.name, message)
        context.abort(code, message)

    def _check(self, job: str, rank: int, context: grpc.ServicerContext) -> None:
        if self._authenticate:
            self._check_caller(rank, context)
        if job != self._job:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           "the request names another job than the one this peer serves")
        self._check_rank(rank, "rank")
        if rank in self.partitioned:
            raise Refused(grpc.StatusCode.UNAVAILABLE,
                          f"rank {rank} is cut off from this node (injected fault)")

    def _check_caller(self, rank: int, context: grpc.ServicerContext) -> None:
        """Refuse a caller whose certificate is not rank ``rank`` of this job."""
        ids = caller_identities(context)
        if (self._job, rank) in ids:
            return
        self._counters.add("calls_denied")
        mine = [r for j, r in ids if j == self._job]
        if mine:
            why = (f"the caller's certificate is for rank {mine[0]}, the request says rank "
                   f"{rank}: a rank calls only as itself")
        else:
            why = "the caller's certificate does not name a member of this job"
        raise Refused(grpc.StatusCode.PERMISSION_DENIED, why)

    def _check_rank(self, rank: int, field: str) -> None:
        if not 0 <= rank < self._nodes:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{field} {rank} is not a rank of this job")

    @staticmethod
    def _check_digests(digests: list[str]) -> None:
        if len(digests) > MAX_DIGESTS_PER_CALL:
            raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                           f"{len(digests)} digests in one call; at most "
                           f"{MAX_DIGESTS_PER_CALL}")
        for h in digests:
            try:
                check_hash(h)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None

    # -- RPCs -------------------------------------------------------------------------------

    def HasChunks(self, request: pb.HasChunksRequest,
                  context: grpc.ServicerContext) -> pb.HasChunksReply:
        with self._call(context, "HasChunks"):
            self._check(request.job, request.rank, context)
            digests = list(request.digests)
            self._check_digests(digests)
            flags = self._store.has_many(digests)
            return pb.HasChunksReply(present=encode_bitmap(flags), count=len(flags))

    def PutChunks(self, request_iterator: Iterator[pb.PutChunksRequest],
                  context: grpc.ServicerContext) -> pb.PutChunksReply:
        with self._call(context, "PutChunks"):
            def check(job: str, rank: int) -> None:
                self._check(job, rank, context)
            return PutStream(self._store, self._counters, check,
                             context.peer()).run(request_iterator)

    def GetChunks(self, request: pb.GetChunksRequest,
                  context: grpc.ServicerContext) -> Iterator[bytes]:
        # Replies go out already serialized (GetChunksReply bytes; see _register).
        with self._call(context, "GetChunks"):
            self._check(request.job, request.rank, context)
            digests = list(request.digests)
            self._check_digests(digests)
            yield from stream_chunks(self._store, digests, context, self._counters)

    def OpenChunkStream(self, request: pb.OpenChunkStreamRequest,
                        context: grpc.ServicerContext) -> pb.OpenChunkStreamReply:
        with self._call(context, "OpenChunkStream"):
            self._check(request.job, request.rank, context)
            digests = list(request.digests)
            self._check_digests(digests)
            cs = self.chunk_stream
            if cs is None:
                raise Refused(grpc.StatusCode.UNIMPLEMENTED,
                              "this server has no chunk stream; use GetChunks")
            ticket = cs.issue(request.rank, digests, put=request.put)
            return pb.OpenChunkStreamReply(port=cs.port, ticket=ticket, expires_s=TICKET_S,
                                           tls=cs.tls)

    def PublishManifest(self, request: pb.PublishManifestRequest,
                        context: grpc.ServicerContext) -> pb.PublishManifestReply:
        with self._call(context, "PublishManifest"):
            self._check(request.job, request.rank, context)
            raw = request.manifest
            if len(raw) > MAX_MANIFEST_BYTES:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                               f"manifest of {len(raw)} bytes; at most {MAX_MANIFEST_BYTES}")
            if request.step_number < 0:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                              f"step_number {request.step_number} is negative; at least 0")
            try:
                check_step(request.step)
                m = StepManifest.from_bytes(raw)
            except (ValueError, ManifestError) as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            fields = {"job": (m.job, self._job), "rank": (m.rank, request.rank),
                      "step": (m.step, request.step),
                      "step_number": (m.step_number, request.step_number)}
            for name, (have, want) in fields.items():
                if have != want:
                    raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"manifest has {name} {have!r} but the request says "
                                   f"{want!r}")
            try:
                result = self._store.put_manifest(m, raw)
            except ValueError as exc:
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
            self._counters.add("manifests_published")
            return pb.PublishManifestReply(chunks_total=result.chunks_total,
                                           missing=list(result.missing),
                                           replaced=result.replaced)

    def ListManifests(self, request: pb.ListManifestsRequest,
                      context: grpc.ServicerContext) -> Iterator[pb.StoredManifest]:
        with self._call(context, "ListManifests"):
            self._check(request.job, request.rank, context)
            self._check_rank(request.of_rank, "of_rank")
            infos = self._store.list_manifests(request.of_rank, step=request.step or None)
            for info in infos:
                raw = b""
                if not request.without_manifest:
                    try:
                        raw = self._store.get_manifest(info.rank, info.step)
                    except KeyError:
                        continue  # dropped by a gc meanwhile
                yield pb.StoredManifest(
                    rank=info.rank, step=info.step, step_number=info.step_number,
                    created_ns=info.created_ns, total_bytes=info.total_bytes,
                    chunks_total=info.chunks_total, chunks_missing=info.chunks_missing,
                    manifest=raw)


@dataclass
class PeerServer:
    """A running Peer service.

    Attributes:
        server: the grpc server.
        service: the servicer (for ``stats()``).
        address: the address it listens on, with the real port when 0 was asked for.
        port: the bound TCP port.
    """

    server: grpc.Server
    service: PeerService
    address: str
    port: int

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving; calls in progress get ``grace`` seconds (None: cancelled now).
        Returns an event set when the server has stopped. The chunk stream stops accepting
        at once; a stream in progress ends at its next send."""
        if self.service.chunk_stream is not None:
            self.service.chunk_stream.stop()
        stopped: threading.Event = self.server.stop(grace)
        return stopped

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        ended: bool = self.server.wait_for_termination(timeout)
        return ended


def _one_line(message: str) -> str:
    """A refusal's reason as the caller gets it: one line of at most
    :data:`MAX_REASON_CHARS` characters (a reason may quote hostile input)."""
    message = " ".join(message.split())
    if len(message) > MAX_REASON_CHARS:
        message = message[:MAX_REASON_CHARS - 3] + "..."
    return message


def _parse(cls: type[Message], raw: bytes) -> Message:
    """Parse one request message from its bytes.

    Raises:
        Refused: INVALID_ARGUMENT if the bytes are not a ``cls`` message.
    """
    try:
        return cls.FromString(raw)
    except DecodeError as exc:
        why = str(exc).rpartition(": ")[2] or "malformed"
        raise Refused(grpc.StatusCode.INVALID_ARGUMENT,
                      f"the request is not a valid {cls.DESCRIPTOR.full_name} message "
                      f"({why[:1].lower()}{why[1:]})") from None


def _unary_in(service: PeerService, what: str, cls: type[Message],
              method: Callable[[Message, grpc.ServicerContext], object]
              ) -> Callable[[bytes, grpc.ServicerContext], object]:
    """A handler for one request message that arrives as bytes (no deserializer): it parses
    them itself, so bytes that are not the message are refused with INVALID_ARGUMENT
    instead of grpc's INTERNAL ("Exception deserializing request")."""
    def handle(raw: bytes, context: grpc.ServicerContext) -> object:
        try:
            request = _parse(cls, raw)
        except Refused as exc:
            with service._call(context, what):
                raise exc
        return method(request, context)
    return handle


def _stream_in(cls: type[Message],
               method: Callable[[Iterator[Message], grpc.ServicerContext], object]
               ) -> Callable[[Iterator[bytes], grpc.ServicerContext], object]:
    """:func:`_unary_in` for a request stream: each message is parsed when the method reads
    it, so :class:`Refused` reaches the method's own refusal handling."""
    def handle(raws: Iterator[bytes], context: grpc.ServicerContext) -> object:
        return method((_parse(cls, raw) for raw in raws), context)
    return handle


def method_handlers(service: PeerService) -> dict[str, grpc.RpcMethodHandler]:
    """The Peer methods' handlers by RPC name, as the server registers them: requests arrive
    as bytes and are parsed by the handler (:func:`_unary_in`); GetChunks replies arrive
    already serialized (see get_stream.py). The in-memory transport
    (:mod:`mtcfs.tiers.peer.memory`) calls the same handlers."""
    m = grpc
    return {
        "HasChunks": m.unary_unary_rpc_method_handler(
            _unary_in(service, "HasChunks", pb.HasChunksRequest, service.HasChunks),
            response_serializer=pb.HasChunksReply.SerializeToString),
        "PutChunks": m.stream_unary_rpc_method_handler(
            _stream_in(pb.PutChunksRequest, service.PutChunks),
            response_serializer=pb.PutChunksReply.SerializeToString),
        "GetChunks": m.unary_stream_rpc_method_handler(
            _unary_in(service, "GetChunks", pb.GetChunksRequest, service.GetChunks),
            response_serializer=encode_reply),
        "OpenChunkStream": m.unary_unary_rpc_method_handler(
            _unary_in(service, "OpenChunkStream", pb.OpenChunkStreamRequest,
                      service.OpenChunkStream),
            response_serializer=pb.OpenChunkStreamReply.SerializeToString),
        "PublishManifest": m.unary_unary_rpc_method_handler(
            _unary_in(service, "PublishManifest", pb.PublishManifestRequest,
                      service.PublishManifest),
            response_serializer=pb.PublishManifestReply.SerializeToString),
        "ListManifests": m.unary_stream_rpc_method_handler(
            _unary_in(service, "ListManifests", pb.ListManifestsRequest,
                      service.ListManifests),
            response_serializer=pb.StoredManifest.SerializeToString),
    }


def _register(service: PeerService, server: grpc.Server) -> None:
    """Register the Peer methods (:func:`method_handlers`) as the generated
    ``add_PeerServicer_to_server`` does."""
    handlers = method_handlers(service)
    name = pb.DESCRIPTOR.services_by_name["Peer"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def serve(store: ReplicaStore, listen: str, job: str, nodes: int, *,
          workers: int = DEFAULT_WORKERS,
          max_message_bytes: int = MAX_MESSAGE_BYTES,
          extra: Sequence[Callable[[grpc.Server], None]] = (),
          tls: TlsFiles | None = None, chunk_stream: bool = True,
          stream_port: int = 0) -> PeerServer:
    """Start the Peer service on ``listen`` and return at once.

    Args:
        store: the replica store to serve.
        listen: ``host:port``; port 0 picks a free one (see :attr:`PeerServer.port`).
        job: the job served.
        nodes: ranks in the job.
        workers: threads serving calls concurrently.
        max_message_bytes: grpc's send and receive limit per message; larger messages are
            refused with RESOURCE_EXHAUSTED. Keep the default except in tests: clients use it
            too.
        extra: registrations of other services on the same server and port (the job
            namespace of scope=job), called before it starts.
        tls: the job CA and this rank's certificate: the server then takes only TLS
            connections from clients with a certificate of the job CA, and serves a call
            only from the rank the certificate names (docs/security.md). None: plaintext,
            no authentication (mount option ``insecure``; unit tests).
        chunk_stream: also listen for chunk streams (chunk_stream.py) on another port of the
            same host; False: OpenChunkStream is UNIMPLEMENTED and clients use GetChunks.
        stream_port: the chunk stream's TCP port (mount option ``stream_port=``, for a
            firewall between the nodes); 0: one the kernel picks (clients learn it from
            OpenChunkStream either way).

    Returns:
        The running server; call ``stop()`` to end it.

    Raises:
        ValueError: on a bad ``job`` or ``nodes``.
        OSError: if the address cannot be bound (in use, bad host).
    """
    service = PeerService(store, job, nodes, authenticate=tls is not None)
    server = grpc.server(
        pools.new_executor("peer-server", workers),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),  # a second server on the same port must fail, loudly
            *KEEPALIVE_SERVER,
        ])
    _register(service, server)
    for add in extra:
        add(server)
    try:
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, tls.server_credentials())
    except RuntimeError as exc:  # grpcio raises when binding fails
        server.stop(None)
        raise OSError(f"cannot listen on {listen}: {exc}") from exc
    if port == 0:
        server.stop(None)
        raise OSError(f"cannot listen on {listen}")
    host = listen.rsplit(":", 1)[0]
    if chunk_stream:
        try:
            service.chunk_stream = ChunkStreamServer(store, host, job, tls=tls,
                                                     counters=service._counters,
                                                     port=stream_port)
        except OSError as exc:
            server.stop(None)
            raise OSError(f"cannot listen for chunk streams on {host}: {exc}") from exc
    server.start()
    address = f"{host}:{port}"
    log.info("peer service of job %r (%d nodes) listening on %s (%s)", job, nodes, address,
             "mutual TLS" if tls else "PLAINTEXT, no authentication")
    return PeerServer(server=server, service=service, address=address, port=port)
