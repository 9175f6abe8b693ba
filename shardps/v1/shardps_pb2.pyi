from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShardMap(_message.Message):
    __slots__ = ("shard_index", "num_shards", "map_epoch", "map_id")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    MAP_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MAP_ID_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    map_epoch: int
    map_id: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., map_epoch: _Optional[int] = ..., map_id: _Optional[str] = ...) -> None: ...

class SGDSpec(_message.Message):
    __slots__ = ("lr", "momentum", "dampening", "weight_decay", "nesterov")
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    DAMPENING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    NESTEROV_FIELD_NUMBER: _ClassVar[int]
    lr: float
    momentum: float
    dampening: float
    weight_decay: float
    nesterov: bool
    def __init__(self, lr: _Optional[float] = ..., momentum: _Optional[float] = ..., dampening: _Optional[float] = ..., weight_decay: _Optional[float] = ..., nesterov: _Optional[bool] = ...) -> None: ...

class AdagradSpec(_message.Message):
    __slots__ = ("lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")
    LR_FIELD_NUMBER: _ClassVar[int]
    LR_DECAY_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    INITIAL_ACCUMULATOR_VALUE_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    lr: float
    lr_decay: float
    weight_decay: float
    initial_accumulator_value: float
    eps: float
    def __init__(self, lr: _Optional[float] = ..., lr_decay: _Optional[float] = ..., weight_decay: _Optional[float] = ..., initial_accumulator_value: _Optional[float] = ..., eps: _Optional[float] = ...) -> None: ...

class AdamSpec(_message.Message):
    __slots__ = ("lr", "beta1", "beta2", "eps", "weight_decay")
    LR_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    def __init__(self, lr: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ...) -> None: ...

class OptimizerSpec(_message.Message):
    __slots__ = ("sgd", "adagrad", "adam")
    SGD_FIELD_NUMBER: _ClassVar[int]
    ADAGRAD_FIELD_NUMBER: _ClassVar[int]
    ADAM_FIELD_NUMBER: _ClassVar[int]
    sgd: SGDSpec
    adagrad: AdagradSpec
    adam: AdamSpec
    def __init__(self, sgd: _Optional[_Union[SGDSpec, _Mapping]] = ..., adagrad: _Optional[_Union[AdagradSpec, _Mapping]] = ..., adam: _Optional[_Union[AdamSpec, _Mapping]] = ...) -> None: ...

class InitializerSpec(_message.Message):
    __slots__ = ("kind", "mean", "std", "a", "seed")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ZEROS: _ClassVar[InitializerSpec.Kind]
        NORMAL: _ClassVar[InitializerSpec.Kind]
        UNIFORM: _ClassVar[InitializerSpec.Kind]
    ZEROS: InitializerSpec.Kind
    NORMAL: InitializerSpec.Kind
    UNIFORM: InitializerSpec.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEAN_FIELD_NUMBER: _ClassVar[int]
    STD_FIELD_NUMBER: _ClassVar[int]
    A_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    kind: InitializerSpec.Kind
    mean: float
    std: float
    a: float
    seed: int
    def __init__(self, kind: _Optional[_Union[InitializerSpec.Kind, str]] = ..., mean: _Optional[float] = ..., std: _Optional[float] = ..., a: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class StalenessPolicy(_message.Message):
    __slots__ = ("scaling", "alpha", "max_staleness", "per_row")
    class Scaling(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        NONE: _ClassVar[StalenessPolicy.Scaling]
        INVERSE: _ClassVar[StalenessPolicy.Scaling]
        LINEAR: _ClassVar[StalenessPolicy.Scaling]
    NONE: StalenessPolicy.Scaling
    INVERSE: StalenessPolicy.Scaling
    LINEAR: StalenessPolicy.Scaling
    SCALING_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    PER_ROW_FIELD_NUMBER: _ClassVar[int]
    scaling: StalenessPolicy.Scaling
    alpha: float
    max_staleness: int
    per_row: bool
    def __init__(self, scaling: _Optional[_Union[StalenessPolicy.Scaling, str]] = ..., alpha: _Optional[float] = ..., max_staleness: _Optional[int] = ..., per_row: _Optional[bool] = ...) -> None: ...

class AdmissionPolicy(_message.Message):
    __slots__ = ("min_count", "admit_probability", "sketch_width", "sketch_depth", "seed")
    MIN_COUNT_FIELD_NUMBER: _ClassVar[int]
    ADMIT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    SKETCH_WIDTH_FIELD_NUMBER: _ClassVar[int]
    SKETCH_DEPTH_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    min_count: int
    admit_probability: float
    sketch_width: int
    sketch_depth: int
    seed: int
    def __init__(self, min_count: _Optional[int] = ..., admit_probability: _Optional[float] = ..., sketch_width: _Optional[int] = ..., sketch_depth: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class EvictionPolicy(_message.Message):
    __slots__ = ("max_rows", "policy", "ttl_steps", "ttl_seconds", "sample")
    class Policy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        LRU: _ClassVar[EvictionPolicy.Policy]
        LFU: _ClassVar[EvictionPolicy.Policy]
        CLOCK: _ClassVar[EvictionPolicy.Policy]
    LRU: EvictionPolicy.Policy
    LFU: EvictionPolicy.Policy
    CLOCK: EvictionPolicy.Policy
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    TTL_STEPS_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    max_rows: int
    policy: EvictionPolicy.Policy
    ttl_steps: int
    ttl_seconds: float
    sample: int
    def __init__(self, max_rows: _Optional[int] = ..., policy: _Optional[_Union[EvictionPolicy.Policy, str]] = ..., ttl_steps: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., sample: _Optional[int] = ...) -> None: ...

class DiskTierPolicy(_message.Message):
    __slots__ = ("memory_mb", "policy", "sample")
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    memory_mb: float
    policy: EvictionPolicy.Policy
    sample: int
    def __init__(self, memory_mb: _Optional[float] = ..., policy: _Optional[_Union[EvictionPolicy.Policy, str]] = ..., sample: _Optional[int] = ...) -> None: ...

class SyncPolicy(_message.Message):
    __slots__ = ("workers", "aggregator", "trim_fraction", "timeout_s", "on_timeout")
    class Aggregator(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MEAN: _ClassVar[SyncPolicy.Aggregator]
        SUM: _ClassVar[SyncPolicy.Aggregator]
        MEDIAN: _ClassVar[SyncPolicy.Aggregator]
        TRIMMED_MEAN: _ClassVar[SyncPolicy.Aggregator]
    MEAN: SyncPolicy.Aggregator
    SUM: SyncPolicy.Aggregator
    MEDIAN: SyncPolicy.Aggregator
    TRIMMED_MEAN: SyncPolicy.Aggregator
    class OnTimeout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WAIT: _ClassVar[SyncPolicy.OnTimeout]
        PROCEED: _ClassVar[SyncPolicy.OnTimeout]
        FAIL: _ClassVar[SyncPolicy.OnTimeout]
    WAIT: SyncPolicy.OnTimeout
    PROCEED: SyncPolicy.OnTimeout
    FAIL: SyncPolicy.OnTimeout
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    AGGREGATOR_FIELD_NUMBER: _ClassVar[int]
    TRIM_FRACTION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    ON_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    workers: int
    aggregator: SyncPolicy.Aggregator
    trim_fraction: float
    timeout_s: float
    on_timeout: SyncPolicy.OnTimeout
    def __init__(self, workers: _Optional[int] = ..., aggregator: _Optional[_Union[SyncPolicy.Aggregator, str]] = ..., trim_fraction: _Optional[float] = ..., timeout_s: _Optional[float] = ..., on_timeout: _Optional[_Union[SyncPolicy.OnTimeout, str]] = ...) -> None: ...

class SyncPart(_message.Message):
    __slots__ = ("step", "rank", "part", "parts")
    STEP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    step: int
    rank: int
    part: int
    parts: int
    def __init__(self, step: _Optional[int] = ..., rank: _Optional[int] = ..., part: _Optional[int] = ..., parts: _Optional[int] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "num_embeddings", "dim", "optimizer", "initializer", "staleness", "allow_nonfinite", "sync", "admission", "eviction", "disk")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    ADMISSION_FIELD_NUMBER: _ClassVar[int]
    EVICTION_FIELD_NUMBER: _ClassVar[int]
    DISK_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_embeddings: int
    dim: int
    optimizer: OptimizerSpec
    initializer: InitializerSpec
    staleness: StalenessPolicy
    allow_nonfinite: bool
    sync: SyncPolicy
    admission: AdmissionPolicy
    eviction: EvictionPolicy
    disk: DiskTierPolicy
    def __init__(self, name: _Optional[str] = ..., num_embeddings: _Optional[int] = ..., dim: _Optional[int] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., initializer: _Optional[_Union[InitializerSpec, _Mapping]] = ..., staleness: _Optional[_Union[StalenessPolicy, _Mapping]] = ..., allow_nonfinite: _Optional[bool] = ..., sync: _Optional[_Union[SyncPolicy, _Mapping]] = ..., admission: _Optional[_Union[AdmissionPolicy, _Mapping]] = ..., eviction: _Optional[_Union[EvictionPolicy, _Mapping]] = ..., disk: _Optional[_Union[DiskTierPolicy, _Mapping]] = ...) -> None: ...

class DenseSpec(_message.Message):
    __slots__ = ("name", "shape", "optimizer", "staleness", "chunk_rows", "allow_nonfinite", "sync")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ROWS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NONFINITE_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    optimizer: OptimizerSpec
    staleness: StalenessPolicy
    chunk_rows: int
    allow_nonfinite: bool
    sync: SyncPolicy
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., optimizer: _Optional[_Union[OptimizerSpec, _Mapping]] = ..., staleness: _Optional[_Union[StalenessPolicy, _Mapping]] = ..., chunk_rows: _Optional[int] = ..., allow_nonfinite: _Optional[bool] = ..., sync: _Optional[_Union[SyncPolicy, _Mapping]] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec", "shard_map")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    shard_map: ShardMap
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class CreateTableResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("spec", "dense", "num_rows", "bytes", "bytes_per_row", "payload_bytes", "admitted", "rejected", "evicted_ttl", "evicted_capacity", "sketch_bytes", "hot_rows", "disk_rows", "disk_bytes", "tier_hits", "tier_misses", "promoted", "written_back")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_ROW_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_TTL_FIELD_NUMBER: _ClassVar[int]
    EVICTED_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    SKETCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOT_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_ROWS_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TIER_HITS_FIELD_NUMBER: _ClassVar[int]
    TIER_MISSES_FIELD_NUMBER: _ClassVar[int]
    PROMOTED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BACK_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    dense: DenseSpec
    num_rows: int
    bytes: int
    bytes_per_row: float
    payload_bytes: int
    admitted: int
    rejected: int
    evicted_ttl: int
    evicted_capacity: int
    sketch_bytes: int
    hot_rows: int
    disk_rows: int
    disk_bytes: int
    tier_hits: int
    tier_misses: int
    promoted: int
    written_back: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., dense: _Optional[_Union[DenseSpec, _Mapping]] = ..., num_rows: _Optional[int] = ..., bytes: _Optional[int] = ..., bytes_per_row: _Optional[float] = ..., payload_bytes: _Optional[int] = ..., admitted: _Optional[int] = ..., rejected: _Optional[int] = ..., evicted_ttl: _Optional[int] = ..., evicted_capacity: _Optional[int] = ..., sketch_bytes: _Optional[int] = ..., hot_rows: _Optional[int] = ..., disk_rows: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., tier_hits: _Optional[int] = ..., tier_misses: _Optional[int] = ..., promoted: _Optional[int] = ..., written_back: _Optional[int] = ...) -> None: ...

class DropTableRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DropTableResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    def __init__(self, dropped: _Optional[bool] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("table", "ids", "wire_dtype", "shard_map")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    wire_dtype: DType
    shard_map: ShardMap
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class PullResponse(_message.Message):
    __slots__ = ("rows", "version")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rows: Tensor
    version: int
    def __init__(self, rows: _Optional[_Union[Tensor, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("table", "ids", "grads", "pulled_version", "client_id", "seq", "shard_map", "sync", "origins")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    PULLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    ORIGINS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    grads: Tensor
    pulled_version: int
    client_id: str
    seq: int
    shard_map: ShardMap
    sync: SyncPart
    origins: _containers.RepeatedCompositeFieldContainer[PushOrigin]
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., grads: _Optional[_Union[Tensor, _Mapping]] = ..., pulled_version: _Optional[int] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ..., sync: _Optional[_Union[SyncPart, _Mapping]] = ..., origins: _Optional[_Iterable[_Union[PushOrigin, _Mapping]]] = ...) -> None: ...

class PushOrigin(_message.Message):
    __slots__ = ("shard", "seq")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    shard: int
    seq: int
    def __init__(self, shard: _Optional[int] = ..., seq: _Optional[int] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("version", "staleness", "duplicate", "late", "missing_ranks", "moved")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    MISSING_RANKS_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    version: int
    staleness: int
    duplicate: bool
    late: bool
    missing_ranks: _containers.RepeatedScalarFieldContainer[int]
    moved: bool
    def __init__(self, version: _Optional[int] = ..., staleness: _Optional[int] = ..., duplicate: _Optional[bool] = ..., late: _Optional[bool] = ..., missing_ranks: _Optional[_Iterable[int]] = ..., moved: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "world_size", "clock", "leaving", "wait_min_clock", "wait_s", "incarnation", "generation")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    WAIT_MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    rank: int
    world_size: int
    clock: int
    leaving: bool
    wait_min_clock: int
    wait_s: float
    incarnation: int
    generation: int
    def __init__(self, rank: _Optional[int] = ..., world_size: _Optional[int] = ..., clock: _Optional[int] = ..., leaving: _Optional[bool] = ..., wait_min_clock: _Optional[int] = ..., wait_s: _Optional[float] = ..., incarnation: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("min_clock", "live_ranks", "gone_ranks")
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_RANKS_FIELD_NUMBER: _ClassVar[int]
    GONE_RANKS_FIELD_NUMBER: _ClassVar[int]
    min_clock: int
    live_ranks: _containers.RepeatedScalarFieldContainer[int]
    gone_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, min_clock: _Optional[int] = ..., live_ranks: _Optional[_Iterable[int]] = ..., gone_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterDenseRequest(_message.Message):
    __slots__ = ("spec", "row_start", "values", "shard_map")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    spec: DenseSpec
    row_start: int
    values: Tensor
    shard_map: ShardMap
    def __init__(self, spec: _Optional[_Union[DenseSpec, _Mapping]] = ..., row_start: _Optional[int] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class RegisterDenseResponse(_message.Message):
    __slots__ = ("created", "initialized")
    CREATED_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    initialized: bool
    def __init__(self, created: _Optional[bool] = ..., initialized: _Optional[bool] = ...) -> None: ...

class PullDenseRequest(_message.Message):
    __slots__ = ("name", "row_start", "row_end", "wire_dtype", "shard_map")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_END_FIELD_NUMBER: _ClassVar[int]
    WIRE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    name: str
    row_start: int
    row_end: int
    wire_dtype: DType
    shard_map: ShardMap
    def __init__(self, name: _Optional[str] = ..., row_start: _Optional[int] = ..., row_end: _Optional[int] = ..., wire_dtype: _Optional[_Union[DType, str]] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class PushDenseRequest(_message.Message):
    __slots__ = ("name", "row_start", "grads", "pulled_version", "client_id", "seq", "shard_map", "sync", "origins")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    PULLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    SYNC_FIELD_NUMBER: _ClassVar[int]
    ORIGINS_FIELD_NUMBER: _ClassVar[int]
    name: str
    row_start: int
    grads: Tensor
    pulled_version: int
    client_id: str
    seq: int
    shard_map: ShardMap
    sync: SyncPart
    origins: _containers.RepeatedCompositeFieldContainer[PushOrigin]
    def __init__(self, name: _Optional[str] = ..., row_start: _Optional[int] = ..., grads: _Optional[_Union[Tensor, _Mapping]] = ..., pulled_version: _Optional[int] = ..., client_id: _Optional[str] = ..., seq: _Optional[int] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ..., sync: _Optional[_Union[SyncPart, _Mapping]] = ..., origins: _Optional[_Iterable[_Union[PushOrigin, _Mapping]]] = ...) -> None: ...

class PullBatchRequest(_message.Message):
    __slots__ = ("pulls", "dense")
    PULLS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    dense: _containers.RepeatedCompositeFieldContainer[PullDenseRequest]
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[PullDenseRequest, _Mapping]]] = ...) -> None: ...

class PullBatchResponse(_message.Message):
    __slots__ = ("pulls", "dense")
    PULLS_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    pulls: _containers.RepeatedCompositeFieldContainer[PullResponse]
    dense: _containers.RepeatedCompositeFieldContainer[PullResponse]
    def __init__(self, pulls: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ...) -> None: ...

class PushBatchRequest(_message.Message):
    __slots__ = ("pushes", "dense", "pull_dense", "pulls")
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    PULL_DENSE_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[PushRequest]
    dense: _containers.RepeatedCompositeFieldContainer[PushDenseRequest]
    pull_dense: _containers.RepeatedCompositeFieldContainer[PullDenseRequest]
    pulls: _containers.RepeatedCompositeFieldContainer[PullRequest]
    def __init__(self, pushes: _Optional[_Iterable[_Union[PushRequest, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[PushDenseRequest, _Mapping]]] = ..., pull_dense: _Optional[_Iterable[_Union[PullDenseRequest, _Mapping]]] = ..., pulls: _Optional[_Iterable[_Union[PullRequest, _Mapping]]] = ...) -> None: ...

class PushBatchResponse(_message.Message):
    __slots__ = ("pushes", "dense", "pulled_dense", "pulled")
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    PULLED_DENSE_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    pushes: _containers.RepeatedCompositeFieldContainer[PushResponse]
    dense: _containers.RepeatedCompositeFieldContainer[PushResponse]
    pulled_dense: _containers.RepeatedCompositeFieldContainer[PullResponse]
    pulled: _containers.RepeatedCompositeFieldContainer[PullResponse]
    def __init__(self, pushes: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ..., dense: _Optional[_Iterable[_Union[PushResponse, _Mapping]]] = ..., pulled_dense: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ..., pulled: _Optional[_Iterable[_Union[PullResponse, _Mapping]]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("push", "push_dense", "push_batch", "pull", "pull_dense", "pull_batch")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_DENSE_FIELD_NUMBER: _ClassVar[int]
    PUSH_BATCH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PULL_DENSE_FIELD_NUMBER: _ClassVar[int]
    PULL_BATCH_FIELD_NUMBER: _ClassVar[int]
    push: PushRequest
    push_dense: PushDenseRequest
    push_batch: PushBatchRequest
    pull: PullRequest
    pull_dense: PullDenseRequest
    pull_batch: PullBatchRequest
    def __init__(self, push: _Optional[_Union[PushRequest, _Mapping]] = ..., push_dense: _Optional[_Union[PushDenseRequest, _Mapping]] = ..., push_batch: _Optional[_Union[PushBatchRequest, _Mapping]] = ..., pull: _Optional[_Union[PullRequest, _Mapping]] = ..., pull_dense: _Optional[_Union[PullDenseRequest, _Mapping]] = ..., pull_batch: _Optional[_Union[PullBatchRequest, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message", "kind", "redirect")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    kind: str
    redirect: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., kind: _Optional[str] = ..., redirect: _Optional[str] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("push", "push_dense", "push_batch", "pull", "pull_dense", "pull_batch", "error")
    PUSH_FIELD_NUMBER: _ClassVar[int]
    PUSH_DENSE_FIELD_NUMBER: _ClassVar[int]
    PUSH_BATCH_FIELD_NUMBER: _ClassVar[int]
    PULL_FIELD_NUMBER: _ClassVar[int]
    PULL_DENSE_FIELD_NUMBER: _ClassVar[int]
    PULL_BATCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    push: PushResponse
    push_dense: PushResponse
    push_batch: PushBatchResponse
    pull: PullResponse
    pull_dense: PullResponse
    pull_batch: PullBatchResponse
    error: StreamError
    def __init__(self, push: _Optional[_Union[PushResponse, _Mapping]] = ..., push_dense: _Optional[_Union[PushResponse, _Mapping]] = ..., push_batch: _Optional[_Union[PushBatchResponse, _Mapping]] = ..., pull: _Optional[_Union[PullResponse, _Mapping]] = ..., pull_dense: _Optional[_Union[PullResponse, _Mapping]] = ..., pull_batch: _Optional[_Union[PullBatchResponse, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class ShardInfoRequest(_message.Message):
    __slots__ = ("data_session",)
    DATA_SESSION_FIELD_NUMBER: _ClassVar[int]
    data_session: bool
    def __init__(self, data_session: _Optional[bool] = ...) -> None: ...

class ShardStats(_message.Message):
    __slots__ = ("pulls", "pushes", "rows_pulled", "rows_pushed", "stale_rejected", "duplicates", "max_staleness", "mean_staleness", "errors")
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    STALE_REJECTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    MEAN_STALENESS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    pulls: int
    pushes: int
    rows_pulled: int
    rows_pushed: int
    stale_rejected: int
    duplicates: int
    max_staleness: int
    mean_staleness: float
    errors: int
    def __init__(self, pulls: _Optional[int] = ..., pushes: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., stale_rejected: _Optional[int] = ..., duplicates: _Optional[int] = ..., max_staleness: _Optional[int] = ..., mean_staleness: _Optional[float] = ..., errors: _Optional[int] = ...) -> None: ...

class ShardInfoResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "version", "tables", "uptime_s", "stats", "durability", "last_checkpoint", "server_version", "serving", "export_floor", "data_ports", "data_clients", "data_plane_handoffs", "replica", "slots", "data_session_id", "data_session_key", "local_scope", "data_ipc", "data_regions")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    DURABILITY_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    EXPORT_FLOOR_FIELD_NUMBER: _ClassVar[int]
    DATA_PORTS_FIELD_NUMBER: _ClassVar[int]
    DATA_CLIENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DATA_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SCOPE_FIELD_NUMBER: _ClassVar[int]
    DATA_IPC_FIELD_NUMBER: _ClassVar[int]
    DATA_REGIONS_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    version: int
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    uptime_s: float
    stats: ShardStats
    durability: str
    last_checkpoint: str
    server_version: str
    serving: ServingInfo
    export_floor: int
    data_ports: _containers.RepeatedScalarFieldContainer[int]
    data_clients: _containers.RepeatedCompositeFieldContainer[DataClient]
    data_plane_handoffs: int
    replica: ReplicaInfo
    slots: SlotsInfo
    data_session_id: bytes
    data_session_key: bytes
    local_scope: str
    data_ipc: _containers.RepeatedScalarFieldContainer[str]
    data_regions: bool
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., version: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., stats: _Optional[_Union[ShardStats, _Mapping]] = ..., durability: _Optional[str] = ..., last_checkpoint: _Optional[str] = ..., server_version: _Optional[str] = ..., serving: _Optional[_Union[ServingInfo, _Mapping]] = ..., export_floor: _Optional[int] = ..., data_ports: _Optional[_Iterable[int]] = ..., data_clients: _Optional[_Iterable[_Union[DataClient, _Mapping]]] = ..., data_plane_handoffs: _Optional[int] = ..., replica: _Optional[_Union[ReplicaInfo, _Mapping]] = ..., slots: _Optional[_Union[SlotsInfo, _Mapping]] = ..., data_session_id: _Optional[bytes] = ..., data_session_key: _Optional[bytes] = ..., local_scope: _Optional[str] = ..., data_ipc: _Optional[_Iterable[str]] = ..., data_regions: _Optional[bool] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("member", "role", "epoch", "lsn", "primary", "group", "ack", "backups", "etcd_age_s")
    class BackupsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    BACKUPS_FIELD_NUMBER: _ClassVar[int]
    ETCD_AGE_S_FIELD_NUMBER: _ClassVar[int]
    member: str
    role: str
    epoch: int
    lsn: int
    primary: str
    group: int
    ack: str
    backups: _containers.ScalarMap[str, int]
    etcd_age_s: float
    def __init__(self, member: _Optional[str] = ..., role: _Optional[str] = ..., epoch: _Optional[int] = ..., lsn: _Optional[int] = ..., primary: _Optional[str] = ..., group: _Optional[int] = ..., ack: _Optional[str] = ..., backups: _Optional[_Mapping[str, int]] = ..., etcd_age_s: _Optional[float] = ...) -> None: ...

class ReplicaAck(_message.Message):
    __slots__ = ("hello", "lsn")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    hello: ReplicaHello
    lsn: int
    def __init__(self, hello: _Optional[_Union[ReplicaHello, _Mapping]] = ..., lsn: _Optional[int] = ...) -> None: ...

class ReplicaHello(_message.Message):
    __slots__ = ("cluster", "shard_map", "member", "lsn", "last_epoch", "epoch", "copy")
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    LSN_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    cluster: str
    shard_map: ShardMap
    member: str
    lsn: int
    last_epoch: int
    epoch: int
    copy: bool
    def __init__(self, cluster: _Optional[str] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ..., member: _Optional[str] = ..., lsn: _Optional[int] = ..., last_epoch: _Optional[int] = ..., epoch: _Optional[int] = ..., copy: _Optional[bool] = ...) -> None: ...

class ReplicaRecord(_message.Message):
    __slots__ = ("lsn", "epoch", "kind", "payload")
    LSN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    lsn: int
    epoch: int
    kind: int
    payload: bytes
    def __init__(self, lsn: _Optional[int] = ..., epoch: _Optional[int] = ..., kind: _Optional[int] = ..., payload: _Optional[bytes] = ...) -> None: ...

class ReplicaFile(_message.Message):
    __slots__ = ("name", "offset", "data", "last")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    name: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ReplicaFrame(_message.Message):
    __slots__ = ("epoch", "records", "file", "copied", "history")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    COPIED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    records: _containers.RepeatedCompositeFieldContainer[ReplicaRecord]
    file: ReplicaFile
    copied: int
    history: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., records: _Optional[_Iterable[_Union[ReplicaRecord, _Mapping]]] = ..., file: _Optional[_Union[ReplicaFile, _Mapping]] = ..., copied: _Optional[int] = ..., history: _Optional[_Iterable[int]] = ...) -> None: ...

class DataClient(_message.Message):
    __slots__ = ("peer", "transport", "caller", "calls", "bytes", "idle_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    transport: str
    caller: str
    calls: int
    bytes: int
    idle_s: float
    def __init__(self, peer: _Optional[str] = ..., transport: _Optional[str] = ..., caller: _Optional[str] = ..., calls: _Optional[int] = ..., bytes: _Optional[int] = ..., idle_s: _Optional[float] = ...) -> None: ...

class ServingInfo(_message.Message):
    __slots__ = ("directory", "base", "delta", "applied_age_s", "error", "deltas_applied", "last_apply_s")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    APPLIED_AGE_S_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DELTAS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLY_S_FIELD_NUMBER: _ClassVar[int]
    directory: str
    base: int
    delta: int
    applied_age_s: float
    error: str
    deltas_applied: int
    last_apply_s: float
    def __init__(self, directory: _Optional[str] = ..., base: _Optional[int] = ..., delta: _Optional[int] = ..., applied_age_s: _Optional[float] = ..., error: _Optional[str] = ..., deltas_applied: _Optional[int] = ..., last_apply_s: _Optional[float] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("checkpoint_id", "phase", "hold_s")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SNAPSHOT: _ClassVar[CheckpointRequest.Phase]
        PREPARE: _ClassVar[CheckpointRequest.Phase]
        COMMIT: _ClassVar[CheckpointRequest.Phase]
        ABORT: _ClassVar[CheckpointRequest.Phase]
    SNAPSHOT: CheckpointRequest.Phase
    PREPARE: CheckpointRequest.Phase
    COMMIT: CheckpointRequest.Phase
    ABORT: CheckpointRequest.Phase
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    phase: CheckpointRequest.Phase
    hold_s: float
    def __init__(self, checkpoint_id: _Optional[str] = ..., phase: _Optional[_Union[CheckpointRequest.Phase, str]] = ..., hold_s: _Optional[float] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint_id", "version", "bytes", "pause_s")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    version: int
    bytes: int
    pause_s: float
    def __init__(self, checkpoint_id: _Optional[str] = ..., version: _Optional[int] = ..., bytes: _Optional[int] = ..., pause_s: _Optional[float] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("phase", "export_id", "hold_s", "tables", "optimizer_state", "delta", "since_version", "table", "offset", "max_rows", "read_tombstones", "shard_map")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PREPARE: _ClassVar[ExportRequest.Phase]
        BEGIN: _ClassVar[ExportRequest.Phase]
        READ: _ClassVar[ExportRequest.Phase]
        END: _ClassVar[ExportRequest.Phase]
        ABORT: _ClassVar[ExportRequest.Phase]
    PREPARE: ExportRequest.Phase
    BEGIN: ExportRequest.Phase
    READ: ExportRequest.Phase
    END: ExportRequest.Phase
    ABORT: ExportRequest.Phase
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    SINCE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    READ_TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    phase: ExportRequest.Phase
    export_id: str
    hold_s: float
    tables: _containers.RepeatedScalarFieldContainer[str]
    optimizer_state: bool
    delta: bool
    since_version: int
    table: str
    offset: int
    max_rows: int
    read_tombstones: bool
    shard_map: ShardMap
    def __init__(self, phase: _Optional[_Union[ExportRequest.Phase, str]] = ..., export_id: _Optional[str] = ..., hold_s: _Optional[float] = ..., tables: _Optional[_Iterable[str]] = ..., optimizer_state: _Optional[bool] = ..., delta: _Optional[bool] = ..., since_version: _Optional[int] = ..., table: _Optional[str] = ..., offset: _Optional[int] = ..., max_rows: _Optional[int] = ..., read_tombstones: _Optional[bool] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class ExportedTable(_message.Message):
    __slots__ = ("spec", "dense", "rows", "tombstones", "full")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    DENSE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOMBSTONES_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    dense: DenseSpec
    rows: int
    tombstones: int
    full: bool
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., dense: _Optional[_Union[DenseSpec, _Mapping]] = ..., rows: _Optional[int] = ..., tombstones: _Optional[int] = ..., full: _Optional[bool] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("version", "tables", "ids", "values", "steps", "state", "slot_map")
    class StateEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SLOT_MAP_FIELD_NUMBER: _ClassVar[int]
    version: int
    tables: _containers.RepeatedCompositeFieldContainer[ExportedTable]
    ids: Tensor
    values: Tensor
    steps: Tensor
    state: _containers.MessageMap[str, Tensor]
    slot_map: str
    def __init__(self, version: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[ExportedTable, _Mapping]]] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., steps: _Optional[_Union[Tensor, _Mapping]] = ..., state: _Optional[_Mapping[str, Tensor]] = ..., slot_map: _Optional[str] = ...) -> None: ...

class AssignRequest(_message.Message):
    __slots__ = ("table", "ids", "values", "shard_map")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SHARD_MAP_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    values: Tensor
    shard_map: ShardMap
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., values: _Optional[_Union[Tensor, _Mapping]] = ..., shard_map: _Optional[_Union[ShardMap, _Mapping]] = ...) -> None: ...

class AssignResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SlotsInfo(_message.Message):
    __slots__ = ("map_json", "accept_epoch", "moves")
    MAP_JSON_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    MOVES_FIELD_NUMBER: _ClassVar[int]
    map_json: str
    accept_epoch: int
    moves: _containers.RepeatedCompositeFieldContainer[MoveInfo]
    def __init__(self, map_json: _Optional[str] = ..., accept_epoch: _Optional[int] = ..., moves: _Optional[_Iterable[_Union[MoveInfo, _Mapping]]] = ...) -> None: ...

class MoveInfo(_message.Message):
    __slots__ = ("id", "role", "state", "peer", "slots", "epoch")
    ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    id: str
    role: str
    state: str
    peer: int
    slots: int
    epoch: int
    def __init__(self, id: _Optional[str] = ..., role: _Optional[str] = ..., state: _Optional[str] = ..., peer: _Optional[int] = ..., slots: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class MigrateRequest(_message.Message):
    __slots__ = ("op", "move_id", "move_json", "table", "since", "offset", "limit", "ids", "arrays", "map_json", "epoch", "applied_json")
    class ArraysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    OP_FIELD_NUMBER: _ClassVar[int]
    MOVE_ID_FIELD_NUMBER: _ClassVar[int]
    MOVE_JSON_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    MAP_JSON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    APPLIED_JSON_FIELD_NUMBER: _ClassVar[int]
    op: str
    move_id: str
    move_json: str
    table: str
    since: int
    offset: int
    limit: int
    ids: Tensor
    arrays: _containers.MessageMap[str, Tensor]
    map_json: str
    epoch: int
    applied_json: str
    def __init__(self, op: _Optional[str] = ..., move_id: _Optional[str] = ..., move_json: _Optional[str] = ..., table: _Optional[str] = ..., since: _Optional[int] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., arrays: _Optional[_Mapping[str, Tensor]] = ..., map_json: _Optional[str] = ..., epoch: _Optional[int] = ..., applied_json: _Optional[str] = ...) -> None: ...

class MigrateResponse(_message.Message):
    __slots__ = ("version", "ids", "total", "arrays", "state", "applied_json")
    class ArraysEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Tensor
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_JSON_FIELD_NUMBER: _ClassVar[int]
    version: int
    ids: Tensor
    total: int
    arrays: _containers.MessageMap[str, Tensor]
    state: str
    applied_json: str
    def __init__(self, version: _Optional[int] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., total: _Optional[int] = ..., arrays: _Optional[_Mapping[str, Tensor]] = ..., state: _Optional[str] = ..., applied_json: _Optional[str] = ...) -> None: ...
