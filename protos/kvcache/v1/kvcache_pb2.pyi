from google.protobuf import descriptor_pb2 as _descriptor_pb2
from google.rpc import status_pb2 as _status_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    SESSION_NOT_FOUND: _ClassVar[ErrorReason]
    ENGINE_NOT_FOUND: _ClassVar[ErrorReason]
    SESSION_EXISTS: _ClassVar[ErrorReason]
    SESSION_BUSY: _ClassVar[ErrorReason]
    NO_TURN_IN_FLIGHT: _ClassVar[ErrorReason]
    SESSION_CLOSING: _ClassVar[ErrorReason]
    LEASE_EXPIRED: _ClassVar[ErrorReason]
    INSTANCE_MISMATCH: _ClassVar[ErrorReason]
    POOL_EXHAUSTED: _ClassVar[ErrorReason]
    SESSION_TOKEN_LIMIT: _ClassVar[ErrorReason]
    SESSION_BUDGET: _ClassVar[ErrorReason]
    INVALID_TOKENS: _ClassVar[ErrorReason]
    INVALID_ARGUMENT: _ClassVar[ErrorReason]
    NOT_OWNER: _ClassVar[ErrorReason]
    BAD_TOKEN: _ClassVar[ErrorReason]
    SALT_NOT_ALLOWED: _ClassVar[ErrorReason]
    ROLE_REQUIRED: _ClassVar[ErrorReason]
    SESSION_LIMIT: _ClassVar[ErrorReason]

class AttentionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_KIND_UNSPECIFIED: _ClassVar[AttentionKind]
    ATTENTION_KIND_FULL: _ClassVar[AttentionKind]
    ATTENTION_KIND_MLA: _ClassVar[AttentionKind]
    ATTENTION_KIND_SLIDING_WINDOW: _ClassVar[AttentionKind]

class CloseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLOSE_MODE_UNSPECIFIED: _ClassVar[CloseMode]
    CLOSE_MODE_CACHE: _ClassVar[CloseMode]
    CLOSE_MODE_DROP: _ClassVar[CloseMode]
    CLOSE_MODE_KEEP_PREFIX: _ClassVar[CloseMode]

class StepFlag(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STEP_FLAG_UNSPECIFIED: _ClassVar[StepFlag]
    STEP_FLAG_SET: _ClassVar[StepFlag]
    STEP_FLAG_KV_TOKENS: _ClassVar[StepFlag]
    STEP_FLAG_TIMEOUT: _ClassVar[StepFlag]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_IDLE: _ClassVar[SessionState]
    SESSION_STATE_IN_TURN: _ClassVar[SessionState]
    SESSION_STATE_CLOSING: _ClassVar[SessionState]
    SESSION_STATE_PARKED: _ClassVar[SessionState]

class SessionCloseReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_CLOSE_REASON_UNSPECIFIED: _ClassVar[SessionCloseReason]
    SESSION_CLOSE_REASON_CLIENT: _ClassVar[SessionCloseReason]
    SESSION_CLOSE_REASON_TIMEOUT: _ClassVar[SessionCloseReason]
    SESSION_CLOSE_REASON_LEASE_ENDED: _ClassVar[SessionCloseReason]
    SESSION_CLOSE_REASON_PARKED_TIMEOUT: _ClassVar[SessionCloseReason]
ERROR_REASON_UNSPECIFIED: ErrorReason
SESSION_NOT_FOUND: ErrorReason
ENGINE_NOT_FOUND: ErrorReason
SESSION_EXISTS: ErrorReason
SESSION_BUSY: ErrorReason
NO_TURN_IN_FLIGHT: ErrorReason
SESSION_CLOSING: ErrorReason
LEASE_EXPIRED: ErrorReason
INSTANCE_MISMATCH: ErrorReason
POOL_EXHAUSTED: ErrorReason
SESSION_TOKEN_LIMIT: ErrorReason
SESSION_BUDGET: ErrorReason
INVALID_TOKENS: ErrorReason
INVALID_ARGUMENT: ErrorReason
NOT_OWNER: ErrorReason
BAD_TOKEN: ErrorReason
SALT_NOT_ALLOWED: ErrorReason
ROLE_REQUIRED: ErrorReason
SESSION_LIMIT: ErrorReason
ATTENTION_KIND_UNSPECIFIED: AttentionKind
ATTENTION_KIND_FULL: AttentionKind
ATTENTION_KIND_MLA: AttentionKind
ATTENTION_KIND_SLIDING_WINDOW: AttentionKind
CLOSE_MODE_UNSPECIFIED: CloseMode
CLOSE_MODE_CACHE: CloseMode
CLOSE_MODE_DROP: CloseMode
CLOSE_MODE_KEEP_PREFIX: CloseMode
STEP_FLAG_UNSPECIFIED: StepFlag
STEP_FLAG_SET: StepFlag
STEP_FLAG_KV_TOKENS: StepFlag
STEP_FLAG_TIMEOUT: StepFlag
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_IDLE: SessionState
SESSION_STATE_IN_TURN: SessionState
SESSION_STATE_CLOSING: SessionState
SESSION_STATE_PARKED: SessionState
SESSION_CLOSE_REASON_UNSPECIFIED: SessionCloseReason
SESSION_CLOSE_REASON_CLIENT: SessionCloseReason
SESSION_CLOSE_REASON_TIMEOUT: SessionCloseReason
SESSION_CLOSE_REASON_LEASE_ENDED: SessionCloseReason
SESSION_CLOSE_REASON_PARKED_TIMEOUT: SessionCloseReason
STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
status_code: _descriptor.FieldDescriptor

class PoolLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "num_pages", "groups", "window_pages")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    num_pages: int
    groups: _containers.RepeatedCompositeFieldContainer[LayerGroup]
    window_pages: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., groups: _Optional[_Iterable[_Union[LayerGroup, _Mapping]]] = ..., window_pages: _Optional[int] = ...) -> None: ...

class LayerGroup(_message.Message):
    __slots__ = ("kind", "num_layers", "num_kv_heads", "head_dim", "sliding_window", "layers")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    kind: AttentionKind
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int
    layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, kind: _Optional[_Union[AttentionKind, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., sliding_window: _Optional[int] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...

class GetPoolInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolInfoResponse(_message.Message):
    __slots__ = ("layout", "backend", "shm_path", "cuda_ipc_handle", "device_uuid", "size_bytes", "instance_id", "offset_bytes", "page_bytes", "server_version", "pool_socket", "step_socket", "window_offset_bytes", "window_size_bytes")
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    POOL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    STEP_SOCKET_FIELD_NUMBER: _ClassVar[int]
    WINDOW_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    layout: PoolLayout
    backend: str
    shm_path: str
    cuda_ipc_handle: bytes
    device_uuid: str
    size_bytes: int
    instance_id: str
    offset_bytes: int
    page_bytes: int
    server_version: str
    pool_socket: str
    step_socket: str
    window_offset_bytes: int
    window_size_bytes: int
    def __init__(self, layout: _Optional[_Union[PoolLayout, _Mapping]] = ..., backend: _Optional[str] = ..., shm_path: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., size_bytes: _Optional[int] = ..., instance_id: _Optional[str] = ..., offset_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., server_version: _Optional[str] = ..., pool_socket: _Optional[str] = ..., step_socket: _Optional[str] = ..., window_offset_bytes: _Optional[int] = ..., window_size_bytes: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("engine_id", "ttl_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ttl_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id", "ttl_seconds", "instance_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ttl_seconds: float
    instance_id: str
    def __init__(self, engine_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., instance_id: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("ttl_seconds", "expires_in_seconds", "instance_id", "num_sessions")
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ttl_seconds: float
    expires_in_seconds: float
    instance_id: str
    num_sessions: int
    def __init__(self, ttl_seconds: _Optional[float] = ..., expires_in_seconds: _Optional[float] = ..., instance_id: _Optional[str] = ..., num_sessions: _Optional[int] = ...) -> None: ...

class HoldLeaseRequest(_message.Message):
    __slots__ = ("engine_id", "ttl_seconds")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ttl_seconds: float
    def __init__(self, engine_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ...) -> None: ...

class HoldLeaseResponse(_message.Message):
    __slots__ = ("engine_id", "ttl_seconds", "instance_id", "num_sessions", "keepalive")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    ttl_seconds: float
    instance_id: str
    num_sessions: int
    keepalive: int
    def __init__(self, engine_id: _Optional[str] = ..., ttl_seconds: _Optional[float] = ..., instance_id: _Optional[str] = ..., num_sessions: _Optional[int] = ..., keepalive: _Optional[int] = ...) -> None: ...

class UnregisterEngineRequest(_message.Message):
    __slots__ = ("engine_id",)
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    def __init__(self, engine_id: _Optional[str] = ...) -> None: ...

class UnregisterEngineResponse(_message.Message):
    __slots__ = ("closed_session_ids", "parked_session_ids")
    CLOSED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    PARKED_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    closed_session_ids: _containers.RepeatedScalarFieldContainer[str]
    parked_session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, closed_session_ids: _Optional[_Iterable[str]] = ..., parked_session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("token_ids", "packed_token_ids", "cache_salt", "packed_response")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PACKED_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    cache_salt: str
    packed_response: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., cache_salt: _Optional[str] = ..., packed_response: _Optional[bool] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("cached_tokens", "page_ids", "packed_page_ids", "tier_tokens", "window_page_ids", "packed_window_page_ids")
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    cached_tokens: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_page_ids: bytes
    tier_tokens: int
    window_page_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_window_page_ids: bytes
    def __init__(self, cached_tokens: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., packed_page_ids: _Optional[bytes] = ..., tier_tokens: _Optional[int] = ..., window_page_ids: _Optional[_Iterable[int]] = ..., packed_window_page_ids: _Optional[bytes] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "streaming", "timeout_seconds", "cache_salt", "engine_id", "parent_session_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    streaming: bool
    timeout_seconds: float
    cache_salt: str
    engine_id: str
    parent_session_id: str
    def __init__(self, session_id: _Optional[str] = ..., streaming: _Optional[bool] = ..., timeout_seconds: _Optional[float] = ..., cache_salt: _Optional[str] = ..., engine_id: _Optional[str] = ..., parent_session_id: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "epoch", "timeout_seconds", "instance_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    timeout_seconds: float
    instance_id: str
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., instance_id: _Optional[str] = ...) -> None: ...

class AppendSessionRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "packed_token_ids", "reserve_tokens", "epoch", "engine_id", "packed_response")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    reserve_tokens: int
    epoch: int
    engine_id: str
    packed_response: bool
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., reserve_tokens: _Optional[int] = ..., epoch: _Optional[int] = ..., engine_id: _Optional[str] = ..., packed_response: _Optional[bool] = ...) -> None: ...

class AppendSessionResponse(_message.Message):
    __slots__ = ("session_id", "epoch", "turn", "cached_tokens", "context_tokens", "capacity_tokens", "page_offset", "page_ids", "packed_page_ids", "num_pages", "prefix_hit_tokens", "tier_tokens", "window_page_ids", "packed_window_page_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    turn: int
    cached_tokens: int
    context_tokens: int
    capacity_tokens: int
    page_offset: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_page_ids: bytes
    num_pages: int
    prefix_hit_tokens: int
    tier_tokens: int
    window_page_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_window_page_ids: bytes
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., turn: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., context_tokens: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., page_offset: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., packed_page_ids: _Optional[bytes] = ..., num_pages: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., tier_tokens: _Optional[int] = ..., window_page_ids: _Optional[_Iterable[int]] = ..., packed_window_page_ids: _Optional[bytes] = ...) -> None: ...

class CommitSessionRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "packed_token_ids", "kv_tokens", "abort", "turn", "epoch", "engine_id", "reuse")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_token_ids: bytes
    kv_tokens: int
    abort: bool
    turn: int
    epoch: int
    engine_id: str
    reuse: ReuseReport
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., packed_token_ids: _Optional[bytes] = ..., kv_tokens: _Optional[int] = ..., abort: _Optional[bool] = ..., turn: _Optional[int] = ..., epoch: _Optional[int] = ..., engine_id: _Optional[str] = ..., reuse: _Optional[_Union[ReuseReport, _Mapping]] = ...) -> None: ...

class ReuseReport(_message.Message):
    __slots__ = ("engine_cached_tokens", "loaded_tokens", "computed_tokens")
    ENGINE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_cached_tokens: int
    loaded_tokens: int
    computed_tokens: int
    def __init__(self, engine_cached_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class CommitSessionResponse(_message.Message):
    __slots__ = ("session_id", "context_tokens", "kv_tokens", "num_pages", "closed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    context_tokens: int
    kv_tokens: int
    num_pages: int
    closed: bool
    def __init__(self, session_id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., num_pages: _Optional[int] = ..., closed: _Optional[bool] = ...) -> None: ...

class ExtendSessionRequest(_message.Message):
    __slots__ = ("session_id", "reserve_tokens", "epoch", "engine_id", "packed_response")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reserve_tokens: int
    epoch: int
    engine_id: str
    packed_response: bool
    def __init__(self, session_id: _Optional[str] = ..., reserve_tokens: _Optional[int] = ..., epoch: _Optional[int] = ..., engine_id: _Optional[str] = ..., packed_response: _Optional[bool] = ...) -> None: ...

class ExtendSessionResponse(_message.Message):
    __slots__ = ("session_id", "epoch", "turn", "capacity_tokens", "page_offset", "page_ids", "packed_page_ids", "num_pages", "window_page_ids", "packed_window_page_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PACKED_WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    turn: int
    capacity_tokens: int
    page_offset: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_page_ids: bytes
    num_pages: int
    window_page_ids: _containers.RepeatedScalarFieldContainer[int]
    packed_window_page_ids: bytes
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., turn: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., page_offset: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., packed_page_ids: _Optional[bytes] = ..., num_pages: _Optional[int] = ..., window_page_ids: _Optional[_Iterable[int]] = ..., packed_window_page_ids: _Optional[bytes] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "cache", "epoch", "engine_id", "mode")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    cache: bool
    epoch: int
    engine_id: str
    mode: CloseMode
    def __init__(self, session_id: _Optional[str] = ..., cache: _Optional[bool] = ..., epoch: _Optional[int] = ..., engine_id: _Optional[str] = ..., mode: _Optional[_Union[CloseMode, str]] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("session_id", "closed", "cached_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    closed: bool
    cached_tokens: int
    def __init__(self, session_id: _Optional[str] = ..., closed: _Optional[bool] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class ReapSessionsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReapSessionsResponse(_message.Message):
    __slots__ = ("session_ids", "engine_ids")
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ..., engine_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class StepOp(_message.Message):
    __slots__ = ("open", "append", "extend", "commit", "close", "match")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    open: OpenSessionRequest
    append: AppendSessionRequest
    extend: ExtendSessionRequest
    commit: CommitSessionRequest
    close: CloseSessionRequest
    match: MatchPrefixRequest
    def __init__(self, open: _Optional[_Union[OpenSessionRequest, _Mapping]] = ..., append: _Optional[_Union[AppendSessionRequest, _Mapping]] = ..., extend: _Optional[_Union[ExtendSessionRequest, _Mapping]] = ..., commit: _Optional[_Union[CommitSessionRequest, _Mapping]] = ..., close: _Optional[_Union[CloseSessionRequest, _Mapping]] = ..., match: _Optional[_Union[MatchPrefixRequest, _Mapping]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("ops", "engine_id", "columns")
    OPS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    ops: _containers.RepeatedCompositeFieldContainer[StepOp]
    engine_id: str
    columns: StepColumns
    def __init__(self, ops: _Optional[_Iterable[_Union[StepOp, _Mapping]]] = ..., engine_id: _Optional[str] = ..., columns: _Optional[_Union[StepColumns, _Mapping]] = ...) -> None: ...

class StepColumns(_message.Message):
    __slots__ = ("kinds", "session_ids", "epochs", "counts", "flags", "token_counts", "token_ids", "turns", "timeouts", "engine_ids", "cache_salts", "parent_session_ids", "reuse")
    KINDS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALTS_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    kinds: bytes
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    epochs: bytes
    counts: bytes
    flags: bytes
    token_counts: bytes
    token_ids: bytes
    turns: bytes
    timeouts: bytes
    engine_ids: _containers.RepeatedScalarFieldContainer[str]
    cache_salts: _containers.RepeatedScalarFieldContainer[str]
    parent_session_ids: _containers.RepeatedScalarFieldContainer[str]
    reuse: bytes
    def __init__(self, kinds: _Optional[bytes] = ..., session_ids: _Optional[_Iterable[str]] = ..., epochs: _Optional[bytes] = ..., counts: _Optional[bytes] = ..., flags: _Optional[bytes] = ..., token_counts: _Optional[bytes] = ..., token_ids: _Optional[bytes] = ..., turns: _Optional[bytes] = ..., timeouts: _Optional[bytes] = ..., engine_ids: _Optional[_Iterable[str]] = ..., cache_salts: _Optional[_Iterable[str]] = ..., parent_session_ids: _Optional[_Iterable[str]] = ..., reuse: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("status", "open", "append", "extend", "commit", "close", "match")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    OPEN_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    EXTEND_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    MATCH_FIELD_NUMBER: _ClassVar[int]
    status: _status_pb2.Status
    open: OpenSessionResponse
    append: AppendSessionResponse
    extend: ExtendSessionResponse
    commit: CommitSessionResponse
    close: CloseSessionResponse
    match: MatchPrefixResponse
    def __init__(self, status: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., open: _Optional[_Union[OpenSessionResponse, _Mapping]] = ..., append: _Optional[_Union[AppendSessionResponse, _Mapping]] = ..., extend: _Optional[_Union[ExtendSessionResponse, _Mapping]] = ..., commit: _Optional[_Union[CommitSessionResponse, _Mapping]] = ..., close: _Optional[_Union[CloseSessionResponse, _Mapping]] = ..., match: _Optional[_Union[MatchPrefixResponse, _Mapping]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("results", "columns")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[StepResult]
    columns: StepColumnResults
    def __init__(self, results: _Optional[_Iterable[_Union[StepResult, _Mapping]]] = ..., columns: _Optional[_Union[StepColumnResults, _Mapping]] = ...) -> None: ...

class StepColumnResults(_message.Message):
    __slots__ = ("codes", "errors", "epochs", "turns", "cached_tokens", "context_tokens", "capacity_tokens", "page_offsets", "num_pages", "prefix_hit_tokens", "kv_tokens", "closed", "page_counts", "page_ids", "opened_ids", "timeouts", "instance_id", "tier_tokens", "window_page_ids")
    CODES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAGE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    PAGE_COUNTS_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    OPENED_IDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    codes: bytes
    errors: _containers.RepeatedCompositeFieldContainer[_status_pb2.Status]
    epochs: bytes
    turns: bytes
    cached_tokens: bytes
    context_tokens: bytes
    capacity_tokens: bytes
    page_offsets: bytes
    num_pages: bytes
    prefix_hit_tokens: bytes
    kv_tokens: bytes
    closed: bytes
    page_counts: bytes
    page_ids: bytes
    opened_ids: _containers.RepeatedScalarFieldContainer[str]
    timeouts: bytes
    instance_id: str
    tier_tokens: bytes
    window_page_ids: bytes
    def __init__(self, codes: _Optional[bytes] = ..., errors: _Optional[_Iterable[_Union[_status_pb2.Status, _Mapping]]] = ..., epochs: _Optional[bytes] = ..., turns: _Optional[bytes] = ..., cached_tokens: _Optional[bytes] = ..., context_tokens: _Optional[bytes] = ..., capacity_tokens: _Optional[bytes] = ..., page_offsets: _Optional[bytes] = ..., num_pages: _Optional[bytes] = ..., prefix_hit_tokens: _Optional[bytes] = ..., kv_tokens: _Optional[bytes] = ..., closed: _Optional[bytes] = ..., page_counts: _Optional[bytes] = ..., page_ids: _Optional[bytes] = ..., opened_ids: _Optional[_Iterable[str]] = ..., timeouts: _Optional[bytes] = ..., instance_id: _Optional[str] = ..., tier_tokens: _Optional[bytes] = ..., window_page_ids: _Optional[bytes] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "epoch", "state", "streaming", "cache_salt", "engine_id", "context_tokens", "kv_tokens", "turns", "num_pages", "radix_pages", "held_pages", "in_flight_pages", "idle_seconds", "timeout_seconds", "demoted", "close_pending", "identity", "former_engine_id", "parked_seconds_left", "parent_session_id", "child_sessions")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    RADIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_PAGES_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    CLOSE_PENDING_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    FORMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PARKED_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    state: SessionState
    streaming: bool
    cache_salt: str
    engine_id: str
    context_tokens: int
    kv_tokens: int
    turns: int
    num_pages: int
    radix_pages: int
    held_pages: int
    in_flight_pages: int
    idle_seconds: float
    timeout_seconds: float
    demoted: bool
    close_pending: bool
    identity: str
    former_engine_id: str
    parked_seconds_left: float
    parent_session_id: str
    child_sessions: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., state: _Optional[_Union[SessionState, str]] = ..., streaming: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., engine_id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., kv_tokens: _Optional[int] = ..., turns: _Optional[int] = ..., num_pages: _Optional[int] = ..., radix_pages: _Optional[int] = ..., held_pages: _Optional[int] = ..., in_flight_pages: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., timeout_seconds: _Optional[float] = ..., demoted: _Optional[bool] = ..., close_pending: _Optional[bool] = ..., identity: _Optional[str] = ..., former_engine_id: _Optional[str] = ..., parked_seconds_left: _Optional[float] = ..., parent_session_id: _Optional[str] = ..., child_sessions: _Optional[int] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "include_tokens")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    include_tokens: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., include_tokens: _Optional[bool] = ...) -> None: ...

class GetSessionResponse(_message.Message):
    __slots__ = ("session", "token_ids")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session: SessionInfo
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[_Union[SessionInfo, _Mapping]] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("engine_id", "limit", "page_size", "page_token", "state", "former_engine_id")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FORMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    limit: int
    page_size: int
    page_token: str
    state: SessionState
    former_engine_id: str
    def __init__(self, engine_id: _Optional[str] = ..., limit: _Optional[int] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., former_engine_id: _Optional[str] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "total", "next_page_token")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    total: int
    next_page_token: str
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., total: _Optional[int] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("verify",)
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    verify: bool
    def __init__(self, verify: _Optional[bool] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("num_pages", "page_size", "free_pages", "evictable_pages", "radix_locked_pages", "session_held_pages", "in_flight_pages", "session_budget_pages", "radix_tokens", "session_tokens", "session_kv_tokens", "prefix_hit_tokens", "session_hit_tokens", "miss_tokens", "evicted_pages", "duplicate_pages", "demoted_sessions", "reaped_sessions", "expired_leases", "sessions_idle", "sessions_in_turn", "sessions_closing", "sessions_demoted", "engines", "instance_id", "uptime_seconds", "physical_usage", "verified", "quarantined_pages", "tier", "loading_pages", "offloading_pages", "tier_stored_pages", "evicted_unstored_pages", "sessions_parked", "parked_sessions", "adopted_sessions", "expired_parked_sessions", "evicted_closed_child_pages", "evicted_ordinary_pages", "evicted_parent_pages", "demoted_session_pages", "demoted_parent_pages", "reuse", "engine_reuse", "window_pages", "window_free_pages", "window_held_pages", "window_policy_dropped_pages", "window_pressure_dropped_pages", "window_evicted_pages", "window_cut_hit_tokens")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RADIX_LOCKED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SESSION_HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_PAGES_FIELD_NUMBER: _ClassVar[int]
    SESSION_BUDGET_PAGES_FIELD_NUMBER: _ClassVar[int]
    RADIX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MISS_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REAPED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_LEASES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_IDLE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_IN_TURN_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_CLOSING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PHYSICAL_USAGE_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    LOADING_PAGES_FIELD_NUMBER: _ClassVar[int]
    OFFLOADING_PAGES_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_UNSTORED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_PARKED_FIELD_NUMBER: _ClassVar[int]
    PARKED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_PARKED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CLOSED_CHILD_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ORDINARY_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PARENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_SESSION_PAGES_FIELD_NUMBER: _ClassVar[int]
    DEMOTED_PARENT_PAGES_FIELD_NUMBER: _ClassVar[int]
    REUSE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_REUSE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_HELD_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_POLICY_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_PRESSURE_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    WINDOW_CUT_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    page_size: int
    free_pages: int
    evictable_pages: int
    radix_locked_pages: int
    session_held_pages: int
    in_flight_pages: int
    session_budget_pages: int
    radix_tokens: int
    session_tokens: int
    session_kv_tokens: int
    prefix_hit_tokens: int
    session_hit_tokens: int
    miss_tokens: int
    evicted_pages: int
    duplicate_pages: int
    demoted_sessions: int
    reaped_sessions: int
    expired_leases: int
    sessions_idle: int
    sessions_in_turn: int
    sessions_closing: int
    sessions_demoted: int
    engines: int
    instance_id: str
    uptime_seconds: float
    physical_usage: float
    verified: bool
    quarantined_pages: int
    tier: TierStats
    loading_pages: int
    offloading_pages: int
    tier_stored_pages: int
    evicted_unstored_pages: int
    sessions_parked: int
    parked_sessions: int
    adopted_sessions: int
    expired_parked_sessions: int
    evicted_closed_child_pages: int
    evicted_ordinary_pages: int
    evicted_parent_pages: int
    demoted_session_pages: int
    demoted_parent_pages: int
    reuse: ReuseStats
    engine_reuse: _containers.RepeatedCompositeFieldContainer[ReuseStats]
    window_pages: int
    window_free_pages: int
    window_held_pages: int
    window_policy_dropped_pages: int
    window_pressure_dropped_pages: int
    window_evicted_pages: int
    window_cut_hit_tokens: int
    def __init__(self, num_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., free_pages: _Optional[int] = ..., evictable_pages: _Optional[int] = ..., radix_locked_pages: _Optional[int] = ..., session_held_pages: _Optional[int] = ..., in_flight_pages: _Optional[int] = ..., session_budget_pages: _Optional[int] = ..., radix_tokens: _Optional[int] = ..., session_tokens: _Optional[int] = ..., session_kv_tokens: _Optional[int] = ..., prefix_hit_tokens: _Optional[int] = ..., session_hit_tokens: _Optional[int] = ..., miss_tokens: _Optional[int] = ..., evicted_pages: _Optional[int] = ..., duplicate_pages: _Optional[int] = ..., demoted_sessions: _Optional[int] = ..., reaped_sessions: _Optional[int] = ..., expired_leases: _Optional[int] = ..., sessions_idle: _Optional[int] = ..., sessions_in_turn: _Optional[int] = ..., sessions_closing: _Optional[int] = ..., sessions_demoted: _Optional[int] = ..., engines: _Optional[int] = ..., instance_id: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., physical_usage: _Optional[float] = ..., verified: _Optional[bool] = ..., quarantined_pages: _Optional[int] = ..., tier: _Optional[_Union[TierStats, _Mapping]] = ..., loading_pages: _Optional[int] = ..., offloading_pages: _Optional[int] = ..., tier_stored_pages: _Optional[int] = ..., evicted_unstored_pages: _Optional[int] = ..., sessions_parked: _Optional[int] = ..., parked_sessions: _Optional[int] = ..., adopted_sessions: _Optional[int] = ..., expired_parked_sessions: _Optional[int] = ..., evicted_closed_child_pages: _Optional[int] = ..., evicted_ordinary_pages: _Optional[int] = ..., evicted_parent_pages: _Optional[int] = ..., demoted_session_pages: _Optional[int] = ..., demoted_parent_pages: _Optional[int] = ..., reuse: _Optional[_Union[ReuseStats, _Mapping]] = ..., engine_reuse: _Optional[_Iterable[_Union[ReuseStats, _Mapping]]] = ..., window_pages: _Optional[int] = ..., window_free_pages: _Optional[int] = ..., window_held_pages: _Optional[int] = ..., window_policy_dropped_pages: _Optional[int] = ..., window_pressure_dropped_pages: _Optional[int] = ..., window_evicted_pages: _Optional[int] = ..., window_cut_hit_tokens: _Optional[int] = ...) -> None: ...

class ReuseStats(_message.Message):
    __slots__ = ("engine_id", "turns", "matched_tokens", "engine_cached_tokens", "loaded_tokens", "computed_tokens")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOADED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    turns: int
    matched_tokens: int
    engine_cached_tokens: int
    loaded_tokens: int
    computed_tokens: int
    def __init__(self, engine_id: _Optional[str] = ..., turns: _Optional[int] = ..., matched_tokens: _Optional[int] = ..., engine_cached_tokens: _Optional[int] = ..., loaded_tokens: _Optional[int] = ..., computed_tokens: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("backend", "up", "hit_pages", "miss_pages", "lookup_pages", "load_pages", "load_bytes", "load_seconds", "load_timeouts", "offload_pages", "offload_bytes", "offload_seconds", "offload_dropped_pages", "queue_pages", "queue_capacity_pages", "load_queue_pages", "tainted_pages", "errors", "outages", "stored_values", "stored_bytes", "capacity_bytes", "staging_pages", "staging_capacity_pages", "staged_pages", "staging_written_pages", "staging_dropped_pages", "staging_lost_pages", "staging_hit_pages", "behind", "behind_episodes", "behind_seconds", "recovered_values", "torn_values", "staging_crashed_pages")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    MISS_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_PAGES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    LOAD_QUEUE_PAGES_FIELD_NUMBER: _ClassVar[int]
    TAINTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    OUTAGES_FIELD_NUMBER: _ClassVar[int]
    STORED_VALUES_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGING_PAGES_FIELD_NUMBER: _ClassVar[int]
    STAGING_CAPACITY_PAGES_FIELD_NUMBER: _ClassVar[int]
    STAGED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STAGING_WRITTEN_PAGES_FIELD_NUMBER: _ClassVar[int]
    STAGING_DROPPED_PAGES_FIELD_NUMBER: _ClassVar[int]
    STAGING_LOST_PAGES_FIELD_NUMBER: _ClassVar[int]
    STAGING_HIT_PAGES_FIELD_NUMBER: _ClassVar[int]
    BEHIND_FIELD_NUMBER: _ClassVar[int]
    BEHIND_EPISODES_FIELD_NUMBER: _ClassVar[int]
    BEHIND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_VALUES_FIELD_NUMBER: _ClassVar[int]
    TORN_VALUES_FIELD_NUMBER: _ClassVar[int]
    STAGING_CRASHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    backend: str
    up: bool
    hit_pages: int
    miss_pages: int
    lookup_pages: int
    load_pages: int
    load_bytes: int
    load_seconds: float
    load_timeouts: int
    offload_pages: int
    offload_bytes: int
    offload_seconds: float
    offload_dropped_pages: int
    queue_pages: int
    queue_capacity_pages: int
    load_queue_pages: int
    tainted_pages: int
    errors: _containers.RepeatedCompositeFieldContainer[TierErrorCount]
    outages: int
    stored_values: int
    stored_bytes: int
    capacity_bytes: int
    staging_pages: int
    staging_capacity_pages: int
    staged_pages: int
    staging_written_pages: int
    staging_dropped_pages: int
    staging_lost_pages: int
    staging_hit_pages: int
    behind: bool
    behind_episodes: int
    behind_seconds: float
    recovered_values: int
    torn_values: int
    staging_crashed_pages: int
    def __init__(self, backend: _Optional[str] = ..., up: _Optional[bool] = ..., hit_pages: _Optional[int] = ..., miss_pages: _Optional[int] = ..., lookup_pages: _Optional[int] = ..., load_pages: _Optional[int] = ..., load_bytes: _Optional[int] = ..., load_seconds: _Optional[float] = ..., load_timeouts: _Optional[int] = ..., offload_pages: _Optional[int] = ..., offload_bytes: _Optional[int] = ..., offload_seconds: _Optional[float] = ..., offload_dropped_pages: _Optional[int] = ..., queue_pages: _Optional[int] = ..., queue_capacity_pages: _Optional[int] = ..., load_queue_pages: _Optional[int] = ..., tainted_pages: _Optional[int] = ..., errors: _Optional[_Iterable[_Union[TierErrorCount, _Mapping]]] = ..., outages: _Optional[int] = ..., stored_values: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., staging_pages: _Optional[int] = ..., staging_capacity_pages: _Optional[int] = ..., staged_pages: _Optional[int] = ..., staging_written_pages: _Optional[int] = ..., staging_dropped_pages: _Optional[int] = ..., staging_lost_pages: _Optional[int] = ..., staging_hit_pages: _Optional[int] = ..., behind: _Optional[bool] = ..., behind_episodes: _Optional[int] = ..., behind_seconds: _Optional[float] = ..., recovered_values: _Optional[int] = ..., torn_values: _Optional[int] = ..., staging_crashed_pages: _Optional[int] = ...) -> None: ...

class TierErrorCount(_message.Message):
    __slots__ = ("operation", "reason", "count")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    operation: str
    reason: str
    count: int
    def __init__(self, operation: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("from_seq",)
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    from_seq: int
    def __init__(self, from_seq: _Optional[int] = ...) -> None: ...

class WatchEventsResponse(_message.Message):
    __slots__ = ("seq", "ts", "instance_id", "snapshot", "events")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    seq: int
    ts: float
    instance_id: str
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, seq: _Optional[int] = ..., ts: _Optional[float] = ..., instance_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("stored", "removed", "cleared", "session_opened", "session_closed", "session_demoted", "session_parked", "session_adopted")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    SESSION_OPENED_FIELD_NUMBER: _ClassVar[int]
    SESSION_CLOSED_FIELD_NUMBER: _ClassVar[int]
    SESSION_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    SESSION_PARKED_FIELD_NUMBER: _ClassVar[int]
    SESSION_ADOPTED_FIELD_NUMBER: _ClassVar[int]
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllBlocksCleared
    session_opened: SessionOpened
    session_closed: SessionClosed
    session_demoted: SessionDemoted
    session_parked: SessionParked
    session_adopted: SessionAdopted
    def __init__(self, stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ..., session_opened: _Optional[_Union[SessionOpened, _Mapping]] = ..., session_closed: _Optional[_Union[SessionClosed, _Mapping]] = ..., session_demoted: _Optional[_Union[SessionDemoted, _Mapping]] = ..., session_parked: _Optional[_Union[SessionParked, _Mapping]] = ..., session_adopted: _Optional[_Union[SessionAdopted, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "medium", "cache_salt", "window_rows_only")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ROWS_ONLY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    parent_block_hash: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    medium: str
    cache_salt: str
    window_rows_only: bool
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., parent_block_hash: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., medium: _Optional[str] = ..., cache_salt: _Optional[str] = ..., window_rows_only: _Optional[bool] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium", "cache_salt", "window_rows_only")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    WINDOW_ROWS_ONLY_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    medium: str
    cache_salt: str
    window_rows_only: bool
    def __init__(self, block_hashes: _Optional[_Iterable[int]] = ..., medium: _Optional[str] = ..., cache_salt: _Optional[str] = ..., window_rows_only: _Optional[bool] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionOpened(_message.Message):
    __slots__ = ("session_id", "epoch", "streaming", "cache_salt", "engine_id", "parent_session_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STREAMING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    streaming: bool
    cache_salt: str
    engine_id: str
    parent_session_id: str
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., streaming: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., engine_id: _Optional[str] = ..., parent_session_id: _Optional[str] = ...) -> None: ...

class SessionClosed(_message.Message):
    __slots__ = ("session_id", "epoch", "reason")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    reason: SessionCloseReason
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[_Union[SessionCloseReason, str]] = ...) -> None: ...

class SessionDemoted(_message.Message):
    __slots__ = ("session_id", "epoch")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class SessionParked(_message.Message):
    __slots__ = ("session_id", "epoch", "former_engine_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FORMER_ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    former_engine_id: str
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., former_engine_id: _Optional[str] = ...) -> None: ...

class SessionAdopted(_message.Message):
    __slots__ = ("session_id", "epoch", "engine_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    engine_id: str
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., engine_id: _Optional[str] = ...) -> None: ...
