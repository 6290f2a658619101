from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChunkPiece(_message.Message):
    __slots__ = ("digest", "offset", "total_size", "data")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    digest: str
    offset: int
    total_size: int
    data: bytes
    def __init__(self, digest: _Optional[str] = ..., offset: _Optional[int] = ..., total_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ChunkStatus(_message.Message):
    __slots__ = ("digest", "code", "message")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    digest: str
    code: int
    message: str
    def __init__(self, digest: _Optional[str] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class HasChunksRequest(_message.Message):
    __slots__ = ("job", "rank", "digests")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., digests: _Optional[_Iterable[str]] = ...) -> None: ...

class HasChunksReply(_message.Message):
    __slots__ = ("present", "count")
    PRESENT_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    present: bytes
    count: int
    def __init__(self, present: _Optional[bytes] = ..., count: _Optional[int] = ...) -> None: ...

class PutChunksRequest(_message.Message):
    __slots__ = ("job", "rank", "piece")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    piece: ChunkPiece
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., piece: _Optional[_Union[ChunkPiece, _Mapping]] = ...) -> None: ...

class PutChunksReply(_message.Message):
    __slots__ = ("accepted", "rejected", "bytes_received", "already_present")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    accepted: _containers.RepeatedScalarFieldContainer[str]
    rejected: _containers.RepeatedCompositeFieldContainer[ChunkStatus]
    bytes_received: int
    already_present: int
    def __init__(self, accepted: _Optional[_Iterable[str]] = ..., rejected: _Optional[_Iterable[_Union[ChunkStatus, _Mapping]]] = ..., bytes_received: _Optional[int] = ..., already_present: _Optional[int] = ...) -> None: ...

class GetChunksRequest(_message.Message):
    __slots__ = ("job", "rank", "digests")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., digests: _Optional[_Iterable[str]] = ...) -> None: ...

class GetChunksReply(_message.Message):
    __slots__ = ("piece", "unavailable")
    PIECE_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    piece: ChunkPiece
    unavailable: ChunkStatus
    def __init__(self, piece: _Optional[_Union[ChunkPiece, _Mapping]] = ..., unavailable: _Optional[_Union[ChunkStatus, _Mapping]] = ...) -> None: ...

class OpenChunkStreamRequest(_message.Message):
    __slots__ = ("job", "rank", "digests", "put")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    PUT_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    digests: _containers.RepeatedScalarFieldContainer[str]
    put: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., digests: _Optional[_Iterable[str]] = ..., put: _Optional[bool] = ...) -> None: ...

class OpenChunkStreamReply(_message.Message):
    __slots__ = ("port", "ticket", "expires_s", "tls")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_S_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    expires_s: int
    tls: bool
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ..., expires_s: _Optional[int] = ..., tls: _Optional[bool] = ...) -> None: ...

class PublishManifestRequest(_message.Message):
    __slots__ = ("job", "rank", "step", "step_number", "manifest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_NUMBER_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    step: str
    step_number: int
    manifest: bytes
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., step: _Optional[str] = ..., step_number: _Optional[int] = ..., manifest: _Optional[bytes] = ...) -> None: ...

class PublishManifestReply(_message.Message):
    __slots__ = ("chunks_total", "missing", "replaced")
    CHUNKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    chunks_total: int
    missing: _containers.RepeatedScalarFieldContainer[str]
    replaced: bool
    def __init__(self, chunks_total: _Optional[int] = ..., missing: _Optional[_Iterable[str]] = ..., replaced: _Optional[bool] = ...) -> None: ...

class ListManifestsRequest(_message.Message):
    __slots__ = ("job", "rank", "of_rank", "step", "without_manifest")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OF_RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    of_rank: int
    step: str
    without_manifest: bool
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., of_rank: _Optional[int] = ..., step: _Optional[str] = ..., without_manifest: _Optional[bool] = ...) -> None: ...

class StoredManifest(_message.Message):
    __slots__ = ("rank", "step", "step_number", "created_ns", "total_bytes", "chunks_total", "chunks_missing", "manifest")
    RANK_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_NUMBER_FIELD_NUMBER: _ClassVar[int]
    CREATED_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_MISSING_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    rank: int
    step: str
    step_number: int
    created_ns: int
    total_bytes: int
    chunks_total: int
    chunks_missing: int
    manifest: bytes
    def __init__(self, rank: _Optional[int] = ..., step: _Optional[str] = ..., step_number: _Optional[int] = ..., created_ns: _Optional[int] = ..., total_bytes: _Optional[int] = ..., chunks_total: _Optional[int] = ..., chunks_missing: _Optional[int] = ..., manifest: _Optional[bytes] = ...) -> None: ...
