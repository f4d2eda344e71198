from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FailureKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_KIND_UNSPECIFIED: _ClassVar[FailureKind]
    FAILURE_KIND_BUSY: _ClassVar[FailureKind]
    FAILURE_KIND_PREFIX_GONE: _ClassVar[FailureKind]
    FAILURE_KIND_LOST: _ClassVar[FailureKind]
    FAILURE_KIND_REFUSED: _ClassVar[FailureKind]
    FAILURE_KIND_ERROR: _ClassVar[FailureKind]
FAILURE_KIND_UNSPECIFIED: FailureKind
FAILURE_KIND_BUSY: FailureKind
FAILURE_KIND_PREFIX_GONE: FailureKind
FAILURE_KIND_LOST: FailureKind
FAILURE_KIND_REFUSED: FailureKind
FAILURE_KIND_ERROR: FailureKind

class Tensor(_message.Message):
    __slots__ = ("data", "shape", "dtype")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ShardRange(_message.Message):
    __slots__ = ("model_id", "start_layer", "end_layer", "n_layers")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    START_LAYER_FIELD_NUMBER: _ClassVar[int]
    END_LAYER_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    start_layer: int
    end_layer: int
    n_layers: int
    def __init__(self, model_id: _Optional[str] = ..., start_layer: _Optional[int] = ..., end_layer: _Optional[int] = ..., n_layers: _Optional[int] = ...) -> None: ...

class PlanStep(_message.Message):
    __slots__ = ("node_id", "address", "shard")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    shard: ShardRange
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., shard: _Optional[_Union[ShardRange, _Mapping]] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "top_logprobs", "grammar", "grammar_prefix", "no_speculation", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "penalty_last_n", "penalty_context", "logit_bias")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_PREFIX_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PENALTY_LAST_N_FIELD_NUMBER: _ClassVar[int]
    PENALTY_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    top_logprobs: int
    grammar: str
    grammar_prefix: _containers.RepeatedScalarFieldContainer[int]
    no_speculation: bool
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    penalty_last_n: int
    penalty_context: _containers.RepeatedScalarFieldContainer[int]
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., top_logprobs: _Optional[int] = ..., grammar: _Optional[str] = ..., grammar_prefix: _Optional[_Iterable[int]] = ..., no_speculation: _Optional[bool] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., penalty_last_n: _Optional[int] = ..., penalty_context: _Optional[_Iterable[int]] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token", "bias")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token: int
    bias: float
    def __init__(self, token: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class RequestSpec(_message.Message):
    __slots__ = ("request_id", "plan", "sampling", "max_tokens", "stop_token_ids", "entry_node_id", "entry_address", "resumed_tokens", "prompt_tokens", "reuse_from", "reuse_positions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENTRY_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REUSE_FROM_FIELD_NUMBER: _ClassVar[int]
    REUSE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    plan: _containers.RepeatedCompositeFieldContainer[PlanStep]
    sampling: Sampling
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    entry_node_id: str
    entry_address: str
    resumed_tokens: int
    prompt_tokens: int
    reuse_from: str
    reuse_positions: int
    def __init__(self, request_id: _Optional[str] = ..., plan: _Optional[_Iterable[_Union[PlanStep, _Mapping]]] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., entry_node_id: _Optional[str] = ..., entry_address: _Optional[str] = ..., resumed_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., reuse_from: _Optional[str] = ..., reuse_positions: _Optional[int] = ...) -> None: ...

class SendPromptRequest(_message.Message):
    __slots__ = ("spec", "tokens")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    spec: RequestSpec
    tokens: Tensor
    def __init__(self, spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., tokens: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("request_id", "tensor", "spec", "partial", "proposals", "start")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tensor: Tensor
    spec: RequestSpec
    partial: bool
    proposals: _containers.RepeatedScalarFieldContainer[int]
    start: int
    def __init__(self, request_id: _Optional[str] = ..., tensor: _Optional[_Union[Tensor, _Mapping]] = ..., spec: _Optional[_Union[RequestSpec, _Mapping]] = ..., partial: _Optional[bool] = ..., proposals: _Optional[_Iterable[int]] = ..., start: _Optional[int] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("entries", "results")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    results: _containers.RepeatedCompositeFieldContainer[SendResultRequest]
    def __init__(self, entries: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., results: _Optional[_Iterable[_Union[SendResultRequest, _Mapping]]] = ...) -> None: ...

class Failure(_message.Message):
    __slots__ = ("kind", "detail", "node")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    kind: FailureKind
    detail: str
    node: str
    def __init__(self, kind: _Optional[_Union[FailureKind, str]] = ..., detail: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class Rejected(_message.Message):
    __slots__ = ("request_id", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    failure: Failure
    def __init__(self, request_id: _Optional[str] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class SendResponse(_message.Message):
    __slots__ = ("rejected",)
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    rejected: _containers.RepeatedCompositeFieldContainer[Rejected]
    def __init__(self, rejected: _Optional[_Iterable[_Union[Rejected, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "logprob")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenResult(_message.Message):
    __slots__ = ("token", "logprob", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class SendResultRequest(_message.Message):
    __slots__ = ("request_id", "tokens", "finished", "finish_reason", "failure")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[TokenResult]
    finished: bool
    finish_reason: str
    failure: Failure
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[TokenResult, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., failure: _Optional[_Union[Failure, _Mapping]] = ...) -> None: ...

class EndRequestRequest(_message.Message):
    __slots__ = ("request_id", "reason", "branch_of", "branch_at")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BRANCH_OF_FIELD_NUMBER: _ClassVar[int]
    BRANCH_AT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    branch_of: str
    branch_at: int
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., branch_of: _Optional[str] = ..., branch_at: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("memory_bytes", "engine", "model_id", "n_layers", "speed", "device", "host_memory_bytes", "head_weight")
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    SPEED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEAD_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    memory_bytes: int
    engine: str
    model_id: str
    n_layers: int
    speed: float
    device: str
    host_memory_bytes: int
    head_weight: float
    def __init__(self, memory_bytes: _Optional[int] = ..., engine: _Optional[str] = ..., model_id: _Optional[str] = ..., n_layers: _Optional[int] = ..., speed: _Optional[float] = ..., device: _Optional[str] = ..., host_memory_bytes: _Optional[int] = ..., head_weight: _Optional[float] = ...) -> None: ...

class LayerRun(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Availability(_message.Message):
    __slots__ = ("complete", "layers", "embed", "head", "note")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    HEAD_FIELD_NUMBER: _ClassVar[int]
    NOTE_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    layers: _containers.RepeatedCompositeFieldContainer[LayerRun]
    embed: bool
    head: bool
    note: str
    def __init__(self, complete: _Optional[bool] = ..., layers: _Optional[_Iterable[_Union[LayerRun, _Mapping]]] = ..., embed: _Optional[bool] = ..., head: _Optional[bool] = ..., note: _Optional[str] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("node_id", "address", "capabilities", "pinned", "loaded", "active_requests", "status", "draining", "availability", "link_port")
    class StatusEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    AVAILABILITY_FIELD_NUMBER: _ClassVar[int]
    LINK_PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    capabilities: Capabilities
    pinned: ShardRange
    loaded: _containers.RepeatedCompositeFieldContainer[ShardRange]
    active_requests: int
    status: _containers.ScalarMap[str, int]
    draining: bool
    availability: Availability
    link_port: int
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., pinned: _Optional[_Union[ShardRange, _Mapping]] = ..., loaded: _Optional[_Iterable[_Union[ShardRange, _Mapping]]] = ..., active_requests: _Optional[int] = ..., status: _Optional[_Mapping[str, int]] = ..., draining: _Optional[bool] = ..., availability: _Optional[_Union[Availability, _Mapping]] = ..., link_port: _Optional[int] = ...) -> None: ...

class HealthCheckRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class HealthCheckResponse(_message.Message):
    __slots__ = ("ok", "node")
    OK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    node: NodeInfo
    def __init__(self, ok: _Optional[bool] = ..., node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class ManifestRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class ModelFile(_message.Message):
    __slots__ = ("name", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("file", "offset", "length", "part", "layer")
    FILE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    file: int
    offset: int
    length: int
    part: str
    layer: int
    def __init__(self, file: _Optional[int] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., part: _Optional[str] = ..., layer: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("model_id", "format", "n_layers", "files", "pieces", "sha256", "signer", "signature")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    N_LAYERS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    SIGNER_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    format: str
    n_layers: int
    files: _containers.RepeatedCompositeFieldContainer[ModelFile]
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    sha256: _containers.RepeatedScalarFieldContainer[bytes]
    signer: str
    signature: bytes
    def __init__(self, model_id: _Optional[str] = ..., format: _Optional[str] = ..., n_layers: _Optional[int] = ..., files: _Optional[_Iterable[_Union[ModelFile, _Mapping]]] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., sha256: _Optional[_Iterable[bytes]] = ..., signer: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class PieceRequest(_message.Message):
    __slots__ = ("model_id", "piece")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PIECE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    piece: int
    def __init__(self, model_id: _Optional[str] = ..., piece: _Optional[int] = ...) -> None: ...

class PieceChunk(_message.Message):
    __slots__ = ("sha256", "length", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    length: int
    data: bytes
    def __init__(self, sha256: _Optional[bytes] = ..., length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
