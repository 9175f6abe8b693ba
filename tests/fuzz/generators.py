"""Valid requests of every method: which strategy generates each input type, plain or serialized."""

from __future__ import annotations

import functools

from hypothesis import strategies as st

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.admin_requests import (
    checkpoint_requests,
    create_table_requests,
    export_requests,
    heartbeat_requests,
    register_dense_requests,
)
from tests.fuzz.cluster_requests import migrate_requests, replica_acks
from tests.fuzz.data_requests import (
    assign_requests,
    pull_batch_requests,
    pull_dense_requests,
    pull_requests,
    push_batch_requests,
    push_requests,
    stream_requests,
)
from tests.fuzz.target import DENSE, FUZZ_DENSE, FUZZ_TABLES, INPUT_TYPES, TABLE
from tests.fuzz.values import names

VALID: dict[type, st.SearchStrategy] = {
    pb.CreateTableRequest: create_table_requests(),
    pb.DescribeTableRequest: st.builds(lambda n: pb.DescribeTableRequest(name=n), names(TABLE, DENSE, *FUZZ_TABLES)),
    pb.DropTableRequest: st.builds(
        lambda n: pb.DropTableRequest(name=n), names("nope", *FUZZ_TABLES, *FUZZ_DENSE, avoid=(TABLE, DENSE))
    ),
    pb.PullRequest: pull_requests(),
    pb.PushRequest: push_requests(),
    pb.RegisterDenseRequest: register_dense_requests(),
    pb.PullDenseRequest: pull_dense_requests(),
    pb.PushDenseRequest: push_requests(dense=True),
    pb.PullBatchRequest: pull_batch_requests(),
    pb.PushBatchRequest: push_batch_requests(),
    pb.StreamRequest: stream_requests(),
    pb.ShardInfoRequest: st.just(pb.ShardInfoRequest()),
    pb.CheckpointRequest: checkpoint_requests(),
    pb.HeartbeatRequest: heartbeat_requests(),
    pb.ExportRequest: export_requests(),
    pb.AssignRequest: assign_requests(),
    pb.MigrateRequest: migrate_requests(),
    pb.ReplicaAck: replica_acks(),
}
_missing = set(INPUT_TYPES.values()) - set(VALID)
assert not _missing, f"no generator for {_missing}"


def messages(cls: type) -> st.SearchStrategy:
    """Valid (well-typed) messages of ``cls``, with sensible and extreme field values."""
    return VALID[cls]


@functools.cache
def serialized(cls: type) -> st.SearchStrategy[bytes]:
    """``messages(cls)``, serialized: canonical encodings."""
    return VALID[cls].map(lambda m: m.SerializeToString())
