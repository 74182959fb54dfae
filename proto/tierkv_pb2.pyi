from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Namespace(_message.Message):
    __slots__ = ("model_id", "kv_dtype", "num_layers", "kv_heads", "head_dim", "block_tokens", "model_revision", "tp_rank", "tp_world", "codec", "tenant_salt")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_WORLD_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    kv_dtype: str
    num_layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int
    model_revision: str
    tp_rank: int
    tp_world: int
    codec: str
    tenant_salt: str
    def __init__(self, model_id: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., model_revision: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_world: _Optional[int] = ..., codec: _Optional[str] = ..., tenant_salt: _Optional[str] = ...) -> None: ...

class HelloRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HelloReply(_message.Message):
    __slots__ = ("version", "host_id", "auth_required", "tenant", "max_message_bytes", "chunk_bytes", "max_request_bytes", "max_blocks", "data_port", "data_batch_bytes")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_BATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    version: str
    host_id: str
    auth_required: bool
    tenant: str
    max_message_bytes: int
    chunk_bytes: int
    max_request_bytes: int
    max_blocks: int
    data_port: int
    data_batch_bytes: int
    def __init__(self, version: _Optional[str] = ..., host_id: _Optional[str] = ..., auth_required: _Optional[bool] = ..., tenant: _Optional[str] = ..., max_message_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., max_request_bytes: _Optional[int] = ..., max_blocks: _Optional[int] = ..., data_port: _Optional[int] = ..., data_batch_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("ns", "hashes")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupReply(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("ns", "hashes")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LoadChunk(_message.Message):
    __slots__ = ("sizes", "data")
    SIZES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, sizes: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StoreChunk(_message.Message):
    __slots__ = ("ns", "hashes", "data")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    data: bytes
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., data: _Optional[bytes] = ...) -> None: ...

class StoreReply(_message.Message):
    __slots__ = ("stored",)
    STORED_FIELD_NUMBER: _ClassVar[int]
    stored: int
    def __init__(self, stored: _Optional[int] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("name", "nonce")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    nonce: bytes
    def __init__(self, name: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class AttachReply(_message.Message):
    __slots__ = ("attachment", "data_offset", "size", "socket_path")
    ATTACHMENT_FIELD_NUMBER: _ClassVar[int]
    DATA_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SOCKET_PATH_FIELD_NUMBER: _ClassVar[int]
    attachment: str
    data_offset: int
    size: int
    socket_path: str
    def __init__(self, attachment: _Optional[str] = ..., data_offset: _Optional[int] = ..., size: _Optional[int] = ..., socket_path: _Optional[str] = ...) -> None: ...

class DetachRequest(_message.Message):
    __slots__ = ("attachment",)
    ATTACHMENT_FIELD_NUMBER: _ClassVar[int]
    attachment: str
    def __init__(self, attachment: _Optional[str] = ...) -> None: ...

class DetachReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShmRequest(_message.Message):
    __slots__ = ("ns", "hashes", "attachment", "offset")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ATTACHMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    attachment: str
    offset: int
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., attachment: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class LoadShmReply(_message.Message):
    __slots__ = ("sizes",)
    SIZES_FIELD_NUMBER: _ClassVar[int]
    sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolRequest(_message.Message):
    __slots__ = ("ns",)
    NS_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class PoolReply(_message.Message):
    __slots__ = ("slot_bytes", "slot_stride", "num_slots")
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    slot_bytes: int
    slot_stride: int
    num_slots: int
    def __init__(self, slot_bytes: _Optional[int] = ..., slot_stride: _Optional[int] = ..., num_slots: _Optional[int] = ...) -> None: ...

class HoldReply(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class LetGoRequest(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class LetGoReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReserveReply(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, slots: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("ns", "hashes", "slots", "spare")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    slots: _containers.RepeatedScalarFieldContainer[int]
    spare: int
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., slots: _Optional[_Iterable[int]] = ..., spare: _Optional[int] = ...) -> None: ...

class CommitReply(_message.Message):
    __slots__ = ("stored", "spare")
    STORED_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    spare: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, stored: _Optional[int] = ..., spare: _Optional[_Iterable[int]] = ...) -> None: ...

class BlocksRequest(_message.Message):
    __slots__ = ("ns", "hashes")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: int
    def __init__(self, removed: _Optional[int] = ...) -> None: ...

class PinRequest(_message.Message):
    __slots__ = ("ns", "hashes", "ttl_s")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class PinReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PinSessionRequest(_message.Message):
    __slots__ = ("ns", "session_id", "hashes", "ttl_s", "release", "tenant")
    NS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    session_id: str
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    ttl_s: float
    release: bool
    tenant: str
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., session_id: _Optional[str] = ..., hashes: _Optional[_Iterable[bytes]] = ..., ttl_s: _Optional[float] = ..., release: _Optional[bool] = ..., tenant: _Optional[str] = ...) -> None: ...

class PinSessionReply(_message.Message):
    __slots__ = ("yielded", "released")
    YIELDED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    yielded: _containers.RepeatedScalarFieldContainer[str]
    released: bool
    def __init__(self, yielded: _Optional[_Iterable[str]] = ..., released: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("ns", "hashes")
    NS_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    ns: Namespace
    hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, ns: _Optional[_Union[Namespace, _Mapping]] = ..., hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class PrefetchReply(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "tenant", "model_id", "namespace", "messages_json", "token_ids", "updated_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    UPDATED_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    model_id: str
    namespace: str
    messages_json: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    updated_s: float
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., model_id: _Optional[str] = ..., namespace: _Optional[str] = ..., messages_json: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., updated_s: _Optional[float] = ...) -> None: ...

class SaveSessionRequest(_message.Message):
    __slots__ = ("session", "ns", "pin", "pin_ttl_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    PIN_FIELD_NUMBER: _ClassVar[int]
    PIN_TTL_S_FIELD_NUMBER: _ClassVar[int]
    session: Session
    ns: Namespace
    pin: bool
    pin_ttl_s: float
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., ns: _Optional[_Union[Namespace, _Mapping]] = ..., pin: _Optional[bool] = ..., pin_ttl_s: _Optional[float] = ...) -> None: ...

class SessionReply(_message.Message):
    __slots__ = ("session", "found", "cached_blocks")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session: Session
    found: bool
    cached_blocks: int
    def __init__(self, session: _Optional[_Union[Session, _Mapping]] = ..., found: _Optional[bool] = ..., cached_blocks: _Optional[int] = ...) -> None: ...

class ResumeSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    ns: Namespace
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., ns: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class ListSessionsReply(_message.Message):
    __slots__ = ("session_ids",)
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteSessionRequest(_message.Message):
    __slots__ = ("session_id", "tenant", "ns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tenant: str
    ns: Namespace
    def __init__(self, session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., ns: _Optional[_Union[Namespace, _Mapping]] = ...) -> None: ...

class DeleteSessionReply(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierCounters(_message.Message):
    __slots__ = ("counters",)
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    counters: _containers.ScalarMap[str, int]
    def __init__(self, counters: _Optional[_Mapping[str, int]] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("tier_order", "tiers", "daemon")
    class TiersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: TierCounters
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[TierCounters, _Mapping]] = ...) -> None: ...
    class DaemonEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIER_ORDER_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    tier_order: _containers.RepeatedScalarFieldContainer[str]
    tiers: _containers.MessageMap[str, TierCounters]
    daemon: _containers.ScalarMap[str, int]
    def __init__(self, tier_order: _Optional[_Iterable[str]] = ..., tiers: _Optional[_Mapping[str, TierCounters]] = ..., daemon: _Optional[_Mapping[str, int]] = ...) -> None: ...
