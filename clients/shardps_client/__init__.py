"""shardps_client: the PyTorch client of the shardps parameter server."""

from shardps.core.optim import SGD, Adagrad, Adam
from shardps.core.policies import Admission, DiskTier, Eviction, Staleness, SyncPolicy
from shardps.core.specs import Initializer
from shardps_client.client import Client, Versions
from shardps_client.collection import (
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
    RemoteEmbeddingBagCollection,
    RemoteEmbeddingCollection,
)
from shardps_client.errors import (
    AuthenticationError,
    ExportGapError,
    IdOutOfRangeError,
    InvalidArgumentError,
    NotPrimaryError,
    PermissionDeniedError,
    ReadOnlyError,
    RequestTooLargeError,
    ShardMapError,
    ShardpsError,
    ShardTimeoutError,
    ShardUnavailableError,
    SlotMovedError,
    StaleUpdateError,
    SyncStepError,
    TableChangedError,
    TableExistsError,
    TableNotFoundError,
)
from shardps_client.nn import RemoteEmbedding, RemoteEmbeddingBag
from shardps_client.optim import ShardedOptimizer
from shardps_client.pipeline import TrainPipeline
from shardps_client.prefetch import Prefetcher
from shardps_client.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from shardps_client.transport import TLS

__all__ = [
    "Client", "Versions", "RemoteEmbedding", "RemoteEmbeddingBag", "RemoteEmbeddingBagCollection",
    "RemoteEmbeddingCollection", "EmbeddingBagConfig", "EmbeddingConfig", "PoolingType", "KeyedJaggedTensor",
    "JaggedTensor", "KeyedTensor", "ShardedOptimizer", "Prefetcher", "TrainPipeline", "SGD", "Adagrad", "Adam", "Initializer", "Staleness", "Admission", "Eviction", "DiskTier", "SyncPolicy", "SyncStepError",
    "ShardpsError", "InvalidArgumentError", "TableNotFoundError", "TableExistsError", "IdOutOfRangeError",
    "ShardMapError", "StaleUpdateError", "RequestTooLargeError", "ShardUnavailableError", "ShardTimeoutError",
    "TLS", "AuthenticationError", "PermissionDeniedError", "ReadOnlyError", "ExportGapError", "NotPrimaryError",
    "SlotMovedError", "TableChangedError",
]
