"""What is fuzzed: the methods of ``shardps.v1.Shard`` and the tables a fuzzed shard holds."""

from __future__ import annotations

import numpy as np

from shardps.core.optim import SGD as _SGD
from shardps.core.specs import DenseSpec, Initializer, TableSpec, dense_spec_to_pb, table_spec_to_pb
from shardps.v1 import shardps_pb2 as pb

SERVICE = "shardps.v1.Shard"
_METHODS = list(pb.DESCRIPTOR.services_by_name["Shard"].methods)
METHOD_NAMES: list[str] = [m.name for m in _METHODS]
INPUT_TYPES: dict[str, type] = {m.name: getattr(pb, m.input_type.name) for m in _METHODS}
STREAMING: set[str] = {m.name for m in _METHODS if m.client_streaming}
# The data plane (ZeroMQ), fuzzed as a method of its own (tests/fuzz/data_plane.py).
DATA_PLANE = "DataPlane"
TARGETS: list[str] = [*METHOD_NAMES, DATA_PLANE]
# Methods that may legitimately change the shard's version or the values of t and d.
PUSH_METHODS = {"Push", "PushDense", "PushBatch", "Stream", DATA_PLANE}

# The tables the setup creates; generated requests mostly target them.
TABLE, DENSE = "t", "d"
TABLE_ROWS, TABLE_DIM = 1000, 8
DENSE_SHAPE = (4, 3)
LR = 0.1
FUZZ_TABLES = ("fz0", "fz1", "fz2")
FUZZ_DENSE = ("fz3", "fz4")
KNOWN_NAMES = (TABLE, DENSE, "nope", *FUZZ_TABLES, *FUZZ_DENSE)
TABLE_SPEC = TableSpec(
    name=TABLE,
    dim=TABLE_DIM,
    num_embeddings=TABLE_ROWS,
    optimizer=_SGD(lr=LR),
    initializer=Initializer("uniform", a=0.5, seed=1),
)
DENSE_INIT = (np.arange(12, dtype=np.float32).reshape(DENSE_SHAPE) - 6) / 8
DENSE_SPEC = DenseSpec(name=DENSE, shape=DENSE_SHAPE, optimizer=_SGD(lr=LR))
TABLE_SPEC_PB = table_spec_to_pb(TABLE_SPEC)
DENSE_SPEC_PB = dense_spec_to_pb(DENSE_SPEC)
PROBE_IDS = np.arange(0, TABLE_ROWS, TABLE_ROWS // 64, dtype=np.int64)[:64]


def setup_tables(address: str) -> None:
    """Table t (1000 x 8, SGD) and dense tensor d (4 x 3, SGD), through the real client."""
    from shardps_client import SGD, Client

    with Client([address], timeout=10, retry_timeout=5, rank=None, world_size=None) as c:
        c.create_table(
            TABLE, dim=TABLE_DIM, num_embeddings=TABLE_ROWS, optimizer=SGD(lr=LR), initializer=TABLE_SPEC.initializer
        )
        c.register_dense(DENSE, DENSE_INIT.copy(), optimizer=SGD(lr=LR))
