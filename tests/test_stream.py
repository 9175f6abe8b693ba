"""The Stream RPC and the client's lanes: order, errors inside a stream, fallback, shutdown, deadlines."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch
from shardps_client import SGD, Adam, Client, ShardTimeoutError, TableNotFoundError

from shardps.core import codec, wire
from shardps.core.routing import shard_of_ids
from shardps.core.specs import Initializer
from shardps.v1 import shardps_pb2 as pb
from tests.conftest import running_cluster
from tests.procs import start_shard


def _interleaved_adam_matches_torch(c: Client) -> None:
    """Pushes and pulls with no flush in between: each pull must equal torch Adam after the pushes before it."""
    ids = torch.arange(12)
    c.create_table("ordered", dim=4, num_embeddings=12, optimizer=Adam(lr=0.05))
    ref = torch.nn.Parameter(c.pull("ordered", ids).clone())
    opt = torch.optim.Adam([ref], lr=0.05)
    for step in range(25):
        g = torch.randn(12, 4, generator=torch.Generator().manual_seed(step))
        c.push("ordered", ids, g)  # asynchronous; Adam is not commutative, so order matters
        ref.grad = g
        opt.step()
        if step % 5 == 4:  # read_your_writes: the pull must see every push above, without a flush
            torch.testing.assert_close(c.pull("ordered", ids), ref.detach(), rtol=1e-5, atol=1e-5)
    c.flush()
    torch.testing.assert_close(c.pull("ordered", ids), ref.detach(), rtol=1e-5, atol=1e-5)


def test_pipelined_pushes_and_pulls_follow_program_order(client2):
    assert all(lane.streaming for lane in client2.transport.lanes)
    _interleaved_adam_matches_torch(client2)
    assert all(lane.streaming for lane in client2.transport.lanes)


def test_unary_fallback_when_a_shard_refuses_streams(tmp_path):
    """`shardps serve --max-streams 0`: a gRPC client falls back to unary calls, with the same results."""
    procs = [start_shard(i, 2, tmp_path, extra=["--max-streams", "0"]) for i in range(2)]
    try:
        with Client([p.address for p in procs], timeout=10, retry_timeout=5, data_plane="grpc") as c:
            _interleaved_adam_matches_torch(c)
            assert not any(lane.streaming for lane in c.transport.lanes)
    finally:
        for p in procs:
            p.kill()


def _raw_stream(address: str, requests: list[bytes]) -> list[tuple[int, bytes]]:
    with grpc.insecure_channel(address) as ch:
        call = ch.stream_stream("/shardps.v1.Shard/Stream", request_serializer=lambda b: b,
                                response_deserializer=wire.unframe)
        return [(field, bytes(view)) for field, view in call(iter(requests), timeout=10)]


def test_a_refused_call_is_answered_in_order_and_the_stream_goes_on(cluster2, client2):
    c = client2
    c.create_table("t", dim=2, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    ids = np.arange(100)[shard_of_ids(np.arange(100), 2) == 0][:3]
    smap = pb.ShardMap(shard_index=0, num_shards=2)
    push = wire.encode_push("t", np.ones((3, 2), np.float32), pb.FLOAT32, ids=ids, shard_map=smap, frame=1)
    unknown = wire.encode_push("nope", np.ones((3, 2), np.float32), pb.FLOAT32, ids=ids, shard_map=smap, frame=1)
    wrong_dim = wire.encode_push("t", np.ones((3, 5), np.float32), pb.FLOAT32, ids=ids, shard_map=smap, frame=1)
    pull = wire.frame(4, pb.PullRequest(table="t", ids=wire_ids(ids), shard_map=smap).SerializeToString())
    replies = _raw_stream(cluster2[0].address, [push, unknown, wrong_dim, push, pull, b"\x08\x01"])
    assert [f for f, _ in replies] == [1, 7, 7, 1, 4, 7]
    errors = [pb.StreamError.FromString(b) for f, b in replies if f == 7]
    assert errors[0].code == grpc.StatusCode.NOT_FOUND.value[0] and "nope" in errors[0].message
    assert errors[1].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "shard 0" in errors[1].message
    assert errors[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]  # not a length-delimited field
    rows, _ = wire.decode_pull_response(replies[4][1])
    np.testing.assert_array_equal(rows, -2 * np.ones((3, 2), np.float32))  # both good pushes, neither bad one


def wire_ids(ids: np.ndarray) -> pb.Tensor:
    return codec.encode(np.asarray(ids, np.int64))


def test_stream_errors_reach_the_caller_as_typed_exceptions(client2):
    c = client2
    c.create_table("t", dim=2, num_embeddings=10)
    c.drop_table("t")
    with pytest.raises(TableNotFoundError, match="t"):
        c.transport.lane_calls([(0, "Pull", pb.PullRequest(table="t", ids=wire_ids(np.array([0]))))])
    c.create_table("u", dim=2, num_embeddings=10)
    assert c.pull("u", [1, 2]).shape == (2, 2)  # the lane still works


def test_stop_does_not_wait_for_idle_streams():
    with running_cluster(1, grace_s=300) as servers:
        with Client([servers[0].address], timeout=10, retry_timeout=1) as c:
            c.create_table("t", dim=2, num_embeddings=10)
            c.pull("t", [1])  # the lane's stream is now open and idle
            t0 = time.monotonic()
            servers[0].stop(checkpoint=False)
            # (a generous bound, well under the 300 s grace: a suite run beside it once took 10.35 s)
            assert time.monotonic() - t0 < 120, "stop waited out its grace period for an idle stream"


def test_a_push_held_past_the_deadline_fails_with_a_timeout(tmp_path):
    with running_cluster(1, data_dir=str(tmp_path)) as servers:
        with Client([servers[0].address], timeout=3.0, retry_timeout=1) as c:
            c.create_table("t", dim=2, num_embeddings=10)
            servers[0].shard.prepare_checkpoint(hold_s=60)  # holds pushes back, as a stalled coordinator would
            t0 = time.monotonic()
            c.push("t", [1], torch.ones(1, 2))
            with pytest.raises(ShardTimeoutError, match="no answer within"):
                c.flush()
            assert time.monotonic() - t0 < 30
            servers[0].shard.abort_checkpoint()
            c.push("t", [1], torch.ones(1, 2), wait=True)  # a new stream; the shard answers again
