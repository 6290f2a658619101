"""The in-memory :class:`~mtcfs.tiers.peer.transport.Transport`: another node's Peer service
called in process, with no sockets, for fast tests.

Nothing of the protocol is re-implemented. :class:`MemoryPeer` is a node's server side: a
:class:`~mtcfs.tiers.peer.service.PeerService` over its
:class:`~mtcfs.tiers.peer.replica_store.ReplicaStore`, called through the very handlers
the gRPC server registers (:func:`~mtcfs.tiers.peer.service.method_handlers`), so every
request is serialized, parsed and checked as on the wire (job, rank, digests, pieces, the
manifest rules, the quota, the caller's identity) and every refusal is the same status.
:class:`MemoryTransport` is the client side: a
:class:`~mtcfs.tiers.peer.client.PeerClient` whose stub is a loopback into a
``MemoryPeer``, so batching, "only missing chunks travel", verification of what comes back,
retries and the errors raised are the gRPC client's own.

What differs from gRPC: no TLS handshake (the caller's certificate identity is given as
``identity``), no timeouts (a call cannot hang), and a message above the size limit is
refused by the loopback (RESOURCE_EXHAUSTED) where grpc would refuse it itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

import grpc
from google.protobuf.message import Message

from mtcfs.tiers.peer._pb import mtcfs_peer_pb2 as pb
from mtcfs.tiers.peer.client import PeerClient
from mtcfs.tiers.peer.limits import MAX_MESSAGE_BYTES
from mtcfs.tiers.peer.replica_store import ReplicaStore
from mtcfs.tiers.peer.service import PeerService, method_handlers
from mtcfs.tiers.peer.tls import identity_uri
from mtcfs.tiers.peer.transport import Transport

__all__ = ["MemoryPeer", "MemoryRpcError", "MemoryTransport"]

_names = itertools.count(1)

#: ``identity`` left out: the caller presents the certificate of the rank it calls as.
_OWN = ("", -1)


class MemoryRpcError(grpc.RpcError):  # type: ignore[misc]  # grpc ships no types
    """A call's failure status, as :class:`grpc.RpcError` carries it from a real channel.

    Args:
        code: the status code.
        details: the reason.
    """

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    """What the Peer service asks of a :class:`grpc.ServicerContext`."""

    def __init__(self, caller: str, identity: tuple[str, int] | None) -> None:
        self._caller = caller
        self._identity = identity
        self._active = True

    def peer(self) -> str:
        return self._caller

    def is_active(self) -> bool:
        return self._active

    def cancel(self) -> None:
        self._active = False

    def auth_context(self) -> dict[str, list[bytes]]:
        if self._identity is None:
            return {}
        return {"peer_uri": [identity_uri(*self._identity).encode()]}

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise MemoryRpcError(code, details)


class MemoryPeer:
    """One node's Peer service, reachable in process.

    Args:
        store: the node's replica store.
        job: the job served.
        nodes: ranks in the job.
        authenticate: check the caller's identity as a mutual-TLS server does (a
            :class:`MemoryTransport` presents one, see its ``identity``).
        name: how the node is addressed in messages (``memory:<name>``).
        max_message_bytes: the largest message, request or reply, as grpc's limit.

    Attributes:
        service: the servicer (``stats()``, ``partitioned`` for injected faults).
        address: ``memory:<name>``.
        up: set it False and every call fails UNAVAILABLE, as to a server that is down.

    Raises:
        ValueError: if ``job`` is empty or ``nodes < 1``.
    """

    def __init__(self, store: ReplicaStore, job: str, nodes: int, *,
                 authenticate: bool = False, name: str = "",
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.service = PeerService(store, job, nodes, authenticate=authenticate)
        self._handlers: dict[str, Any] = method_handlers(self.service)
        self.address = f"memory:{name or next(_names)}"
        self.max_message_bytes = max_message_bytes
        self.up = True

    @property
    def store(self) -> ReplicaStore:
        return self.service.store

    def connect(self, job: str, rank: int, **kwargs: Any) -> MemoryTransport:
        """A :class:`MemoryTransport` to this node (keyword arguments as its own)."""
        return MemoryTransport(self, job, rank, **kwargs)

    # -- the loopback: what a grpc channel and the server do between stub and handler -----

    def _bytes(self, raw: bytes, what: str) -> bytes:
        if len(raw) > self.max_message_bytes:
            raise MemoryRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"{what} larger than max ({len(raw)} vs. "
                                 f"{self.max_message_bytes})")
        return raw

    def _handler(self, name: str) -> Any:
        if not self.up:
            raise MemoryRpcError(grpc.StatusCode.UNAVAILABLE, f"{self.address} is down")
        return self._handlers[name]

    def call_unary(self, name: str, request: Message, reply: type[Message],
                   context: _Context) -> Message:
        """One unary call: serialize, handle, serialize the reply, parse it."""
        handler = self._handler(name)
        raw = self._bytes(request.SerializeToString(), "Sent message")
        try:
            out = handler.unary_unary(raw, context)
        except grpc.RpcError:
            raise
        except Exception as exc:  # grpc answers UNKNOWN for what a handler raises
            raise MemoryRpcError(grpc.StatusCode.UNKNOWN,
                                 f"Exception calling application: {exc}") from exc
        return reply.FromString(self._bytes(handler.response_serializer(out),
                                            "Received message"))

    def call_stream_in(self, name: str, requests: Iterable[Message], reply: type[Message],
                       context: _Context) -> Message:
        """One client-streaming call."""
        handler = self._handler(name)
        raws = (self._bytes(r.SerializeToString(), "Sent message") for r in requests)
        try:
            out = handler.stream_unary(raws, context)
        except grpc.RpcError:
            raise
        except Exception as exc:
            raise MemoryRpcError(grpc.StatusCode.UNKNOWN,
                                 f"Exception calling application: {exc}") from exc
        return reply.FromString(self._bytes(handler.response_serializer(out),
                                            "Received message"))

    def call_stream_out(self, name: str, request: Message, reply: type[Message],
                        context: _Context) -> Iterator[Message]:
        """One server-streaming call; nothing runs until the first reply is asked for."""
        handler = self._handler(name)
        raw = self._bytes(request.SerializeToString(), "Sent message")
        replies = None
        try:
            replies = handler.unary_stream(raw, context)
            for out in replies:
                if not context.is_active():
                    raise MemoryRpcError(grpc.StatusCode.CANCELLED, "Locally cancelled")
                yield reply.FromString(self._bytes(handler.response_serializer(out),
                                                   "Received message"))
        except grpc.RpcError:
            raise
        except Exception as exc:
            raise MemoryRpcError(grpc.StatusCode.UNKNOWN,
                                 f"Exception iterating responses: {exc}") from exc
        finally:
            context.cancel()
            close = getattr(replies, "close", None)
            if close is not None:
                close()


class _StreamCall:
    """A server-streaming call's reply iterator with ``cancel()``, as grpc returns it."""

    def __init__(self, replies: Iterator[Message], context: _Context) -> None:
        self._replies = replies
        self._context = context

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        return next(self._replies)

    def cancel(self) -> bool:
        self._context.cancel()
        close: Callable[[], None] | None = getattr(self._replies, "close", None)
        if close is not None:
            close()
        return True


class _LoopbackStub:
    """The generated ``PeerStub``'s methods, into a :class:`MemoryPeer`. Its service has no
    chunk stream (no sockets): OpenChunkStream is UNIMPLEMENTED, so
    :meth:`PeerClient.stream_chunks` falls back to GetChunks, as with a server without it."""

    def __init__(self, peer: MemoryPeer, caller: str,
                 identity: tuple[str, int] | None) -> None:
        self._peer = peer
        self._caller = caller
        self._identity = identity

    def _context(self) -> _Context:
        return _Context(self._caller, self._identity)

    def HasChunks(self, request: Message, timeout: float | None = None) -> Message:
        return self._peer.call_unary("HasChunks", request, pb.HasChunksReply, self._context())

    def PutChunks(self, requests: Iterable[Message], timeout: float | None = None) -> Message:
        return self._peer.call_stream_in("PutChunks", requests, pb.PutChunksReply,
                                         self._context())

    def GetChunks(self, request: Message, timeout: float | None = None) -> _StreamCall:
        ctx = self._context()
        return _StreamCall(self._peer.call_stream_out("GetChunks", request, pb.GetChunksReply,
                                                      ctx), ctx)

    def OpenChunkStream(self, request: Message, timeout: float | None = None) -> Message:
        return self._peer.call_unary("OpenChunkStream", request, pb.OpenChunkStreamReply,
                                     self._context())

    def PublishManifest(self, request: Message, timeout: float | None = None) -> Message:
        return self._peer.call_unary("PublishManifest", request, pb.PublishManifestReply,
                                     self._context())

    def ListManifests(self, request: Message, timeout: float | None = None) -> _StreamCall:
        ctx = self._context()
        return _StreamCall(self._peer.call_stream_out("ListManifests", request,
                                                      pb.StoredManifest, ctx), ctx)


class MemoryTransport(PeerClient):
    """A :class:`~mtcfs.tiers.peer.client.PeerClient` to a :class:`MemoryPeer`, in process.

    Args:
        peer: the node called.
        job: the job every request names.
        rank: the rank every request names.
        identity: the ``(job, rank)`` the caller's certificate names, which a peer with
            ``authenticate`` checks; default this transport's own ``(job, rank)``; None:
            no certificate.
        **kwargs: as :class:`PeerClient` (``timeout``, ``stream_timeout``, ``retry``,
            ``stop``, ``rng``); ``tls`` is not taken.

    The methods, results, counters and errors are :class:`PeerClient`'s; the grpc status of
    a refusal is the one a gRPC server answers (a :class:`MemoryRpcError` inside).
    """

    def __init__(self, peer: MemoryPeer, job: str, rank: int, *,
                 identity: tuple[str, int] | None = _OWN, **kwargs: Any) -> None:
        if "tls" in kwargs or "max_message_bytes" in kwargs:
            raise TypeError("a MemoryTransport takes neither tls nor max_message_bytes "
                            "(the MemoryPeer sets the limit)")
        super().__init__(peer.address, job, rank, max_message_bytes=peer.max_message_bytes,
                         **kwargs)
        self._channel.close()  # made by PeerClient and never used: calls go to the stub
        self.peer = peer
        # The loopback has the generated PeerStub's five methods, duck-typed.
        self._stub = _LoopbackStub(  # type: ignore[assignment]
            peer, f"memory:rank-{rank}", (job, rank) if identity == _OWN else identity)

    @property
    def channel(self) -> grpc.Channel:
        raise TypeError("an in-memory transport has no grpc channel")


def _implements(grpc_client: PeerClient, memory: MemoryTransport) -> tuple[Transport, ...]:
    """Never called: mypy checks here that both classes satisfy :class:`Transport`."""
    return grpc_client, memory
