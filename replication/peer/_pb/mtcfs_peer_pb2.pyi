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

class StepRef(_message.Message):
    __slots__ = ("step", "step_number")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_NUMBER_FIELD_NUMBER: _ClassVar[int]
    step: str
    step_number: int
    def __init__(self, step: _Optional[str] = ..., step_number: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job", "rank", "address", "labels", "steps_complete", "capacity_bytes", "used_bytes", "known_version", "has_job_complete", "job_complete")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    STEPS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_JOB_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    JOB_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    address: str
    labels: _containers.ScalarMap[str, str]
    steps_complete: _containers.RepeatedCompositeFieldContainer[StepRef]
    capacity_bytes: int
    used_bytes: int
    known_version: int
    has_job_complete: bool
    job_complete: StepRef
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., address: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., steps_complete: _Optional[_Iterable[_Union[StepRef, _Mapping]]] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., known_version: _Optional[int] = ..., has_job_complete: _Optional[bool] = ..., job_complete: _Optional[_Union[StepRef, _Mapping]] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("rank", "address", "labels", "alive", "age_ms", "capacity_bytes", "used_bytes")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    address: str
    labels: _containers.ScalarMap[str, str]
    alive: bool
    age_ms: int
    capacity_bytes: int
    used_bytes: int
    def __init__(self, rank: _Optional[int] = ..., address: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., alive: _Optional[bool] = ..., age_ms: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("membership_version", "members", "coordinator_rank", "has_latest_complete", "latest_complete", "nodes")
    MEMBERSHIP_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_RANK_FIELD_NUMBER: _ClassVar[int]
    HAS_LATEST_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    LATEST_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    membership_version: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    coordinator_rank: int
    has_latest_complete: bool
    latest_complete: StepRef
    nodes: int
    def __init__(self, membership_version: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., coordinator_rank: _Optional[int] = ..., has_latest_complete: _Optional[bool] = ..., latest_complete: _Optional[_Union[StepRef, _Mapping]] = ..., nodes: _Optional[int] = ...) -> None: ...

class VoteRequest(_message.Message):
    __slots__ = ("job", "rank", "vote_id", "restorable")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    VOTE_ID_FIELD_NUMBER: _ClassVar[int]
    RESTORABLE_FIELD_NUMBER: _ClassVar[int]
    job: str
    rank: int
    vote_id: str
    restorable: _containers.RepeatedCompositeFieldContainer[StepRef]
    def __init__(self, job: _Optional[str] = ..., rank: _Optional[int] = ..., vote_id: _Optional[str] = ..., restorable: _Optional[_Iterable[_Union[StepRef, _Mapping]]] = ...) -> None: ...

class VoteReply(_message.Message):
    __slots__ = ("not_coordinator", "coordinator_rank", "decided", "step", "waiting_for")
    NOT_COORDINATOR_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_RANK_FIELD_NUMBER: _ClassVar[int]
    DECIDED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    not_coordinator: bool
    coordinator_rank: int
    decided: bool
    step: StepRef
    waiting_for: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, not_coordinator: _Optional[bool] = ..., coordinator_rank: _Optional[int] = ..., decided: _Optional[bool] = ..., step: _Optional[_Union[StepRef, _Mapping]] = ..., waiting_for: _Optional[_Iterable[int]] = ...) -> None: ...
