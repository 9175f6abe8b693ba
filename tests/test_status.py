"""The status table: every shard error kind has one code and one client exception, and the kind
travels as data (trailing metadata, StreamError.kind), never recovered from the message text."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from shardps_client import SGD, Client, Staleness, StaleUpdateError, SyncStepError, transport
from shardps_client import errors as client_errors

from shardps.core import errors, status
from shardps.v1 import shardps_pb2 as pb
from tests.conftest import running_cluster
from tests.test_fuzz_regressions import _owned_push


def test_every_shard_error_has_one_kind_one_code_one_client_exception():
    shard_errors = {c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.ShardError)}
    assert {s.shard_error for s in status.TABLE} == shard_errors - {errors.ShardError}
    assert len({s.kind for s in status.TABLE}) == len(status.TABLE)
    for s in status.TABLE:
        assert grpc.StatusCode[s.code]
        assert issubclass(getattr(client_errors, s.client_error), client_errors.ShardpsError)


def test_kind_not_text_decides_the_client_exception():
    misleading = "push is stale; mentions a sync step in its text"
    e = transport.from_status(grpc.StatusCode.ABORTED.value[0], misleading, "a:1", "Push", "stale_update")
    assert type(e) is StaleUpdateError
    e = transport.from_status(grpc.StatusCode.ABORTED.value[0], "no hint here", "a:1", "Push", "sync_step_failed")
    assert type(e) is SyncStepError


def test_validation_has_one_exception_type():
    with pytest.raises(errors.InvalidArgument):
        SGD(lr=-1.0)
    with pytest.raises(ValueError):  # still a ValueError for callers that catch that
        SGD(lr=float("nan"))


@pytest.mark.parametrize("max_streams", [64, 0])  # 0: the shard refuses streams, the client makes unary calls
def test_shard_sends_the_kind_on_unary_calls_and_streams(max_streams):
    with running_cluster(2, max_streams=max_streams) as servers:
        _stale_push_and_unknown_table([s.address for s in servers])


def _stale_push_and_unknown_table(addresses: list[str]) -> None:
    with Client(addresses, timeout=10, retry_timeout=1) as c:
        c.create_table("t", dim=8, num_embeddings=100, optimizer=SGD(lr=0.1), staleness=Staleness(max_staleness=0))
        ids = np.arange(100)
        _, versions = c.pull_with_version("t", ids)
        c.push("t", ids, np.ones((100, 8), np.float32), versions=versions)
        c.flush()
        with pytest.raises(StaleUpdateError):
            c.push("t", ids, np.ones((100, 8), np.float32), versions=versions)
            c.flush()
    req = pb.PushRequest.FromString(_owned_push(table="nope").SerializeToString())
    with grpc.insecure_channel(addresses[0]) as ch:
        with pytest.raises(grpc.RpcError) as info:
            ch.unary_unary("/shardps.v1.Shard/Push")(req.SerializeToString(), timeout=5)
    assert (status.KIND_METADATA, "not_found") in tuple(info.value.trailing_metadata())
