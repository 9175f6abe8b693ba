"""PullBatch / PushBatch: several tables per call, all-or-nothing validation, order, exactly-once."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from shardps_client import SGD, Adam, Client, SyncPolicy, TableNotFoundError
from shardps_client.pushes import MAX_TRAILING

from shardps.core import wire
from shardps.core.routing import shard_of_ids
from shardps.core.specs import Initializer
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc


def test_pull_many_equals_single_pulls(client2):
    c = client2
    c.create_table("a", dim=3, num_embeddings=1000)
    c.create_table("b", dim=5)
    c.register_dense("d1", torch.randn(4, 3))
    c.register_dense("d2", torch.randn(300, 20), chunk_bytes=4096)
    req = {"a": torch.tensor([[5, 1, 5], [999, 0, 1]]), "b": torch.tensor([10**12, -3, 7, -3])}
    many = c.pull_many(req)
    for table, ids in req.items():
        torch.testing.assert_close(many[table][0], c.pull(table, ids), rtol=0, atol=0)
    dense = c.pull_dense_many(["d1", "d2"])
    assert dense["d2"][0].shape == (300, 20)
    torch.testing.assert_close(dense["d1"][0], c.pull_dense("d1")[0], rtol=0, atol=0)


def test_push_batch_validates_every_entry_before_applying_any(cluster2, client2):
    c = client2
    c.create_table("t", dim=2, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    stub = pb_grpc.ShardStub(grpc.insecure_channel(cluster2[0].address))
    ids = np.arange(100)[shard_of_ids(np.arange(100), 2) == 0][:3]
    smap = pb.ShardMap(shard_index=0, num_shards=2)
    good = wire.encode_push("t", np.ones((3, 2), np.float32), pb.FLOAT32, ids=ids, shard_map=smap)
    bad_grads = np.ones((3, 2), np.float32)
    bad_grads[1, 1] = np.nan
    bad = wire.encode_push("t", bad_grads, pb.FLOAT32, ids=ids, shard_map=smap)
    body = wire.encode_repeated([(1, [good, bad])])
    with pytest.raises(grpc.RpcError) as e:
        stub.PushBatch(pb.PushBatchRequest.FromString(body))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "NaN or Inf" in e.value.details()
    torch.testing.assert_close(c.pull("t", torch.from_numpy(ids)), torch.zeros(3, 2))  # the good entry was not applied
    reply = stub.PushBatch(pb.PushBatchRequest.FromString(wire.encode_repeated([(1, [good, good])])))
    assert len(reply.pushes) == 2
    torch.testing.assert_close(c.pull("t", torch.from_numpy(ids)), torch.full((3, 2), -2.0))


def test_deferred_pushes_keep_order_and_apply_once(client2):
    c = client2
    w0 = torch.randn(5, 4)
    c.register_dense("w", w0, optimizer=Adam(lr=0.1))
    c.create_table("e", dim=4, num_embeddings=50, optimizer=Adam(lr=0.1), initializer=Initializer("zeros"))
    ref_w = torch.nn.Parameter(w0.clone())
    ref_e = torch.nn.Parameter(torch.zeros(50, 4))
    opt = torch.optim.Adam([ref_w, ref_e], lr=0.1)
    c.defer_pushes = True
    for step in range(8):
        g = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
        c.push_dense("w", g)
        c.push("e", torch.arange(50), g.repeat(10, 1))
        ref_w.grad, ref_e.grad = g, g.repeat(10, 1)
        opt.step()
        if step % 3 == 2:
            c.send_pushes()  # several steps may queue up before they are sent
    c.flush()
    torch.testing.assert_close(c.pull_dense("w")[0], ref_w.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.pull("e", torch.arange(50)), ref_e.detach(), rtol=1e-5, atol=1e-5)
    assert sum(i.stats.pushes for i in c.shard_info()) == 8 * (1 + 2)  # one dense piece + a row push per shard


def test_read_your_writes_sends_deferred_pushes_first(client2):
    c = client2
    c.create_table("r", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    c.defer_pushes = True
    c.push("r", torch.arange(10), torch.ones(10, 2))
    torch.testing.assert_close(c.pull("r", torch.arange(10)), -torch.ones(10, 2))


def test_without_read_your_writes_a_push_trails_the_next_pull(cluster2, client2):
    """read_your_writes=False: a push waits for the next pull and leaves right after its calls, so the shards serve
    that pull first and apply the push after it (off the step's path); flush, close, a push that waits and a
    return to read_your_writes send it too. Nothing is lost or applied twice."""
    c = client2
    c.create_table("t", dim=2, num_embeddings=50, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    ids = torch.arange(50)
    c.read_your_writes = False
    c.push("t", ids, torch.ones(50, 2))
    assert c.pushes.has_queued
    torch.testing.assert_close(c.pull("t", ids), torch.zeros(50, 2))  # served before the push it sent out
    assert not c.pushes.has_queued
    c.flush()
    assert sum(i.stats.pushes for i in c.shard_info()) == 2  # one per shard, applied once
    torch.testing.assert_close(c.pull("t", ids), -torch.ones(50, 2))
    c.push("t", ids, torch.ones(50, 2))
    c.flush()  # sends it
    torch.testing.assert_close(c.pull("t", ids), torch.full((50, 2), -2.0))
    c.push("t", ids, torch.ones(50, 2))
    c.push("t", ids, torch.ones(50, 2), wait=True)  # sent after the one before it, both applied now
    assert not c.pushes.has_queued
    c.push("t", ids, torch.ones(50, 2))
    c.read_your_writes = True  # the pull sees it again
    torch.testing.assert_close(c.pull("t", ids), torch.full((50, 2), -5.0))
    with Client([s.address for s in cluster2], read_your_writes=False) as other:
        for _ in range(3 * MAX_TRAILING):  # pushing without pulling: at most MAX_TRAILING calls stay here
            other.push("t", ids[:1], torch.ones(1, 2))
            assert sum(len(calls) for _, calls in other.pushes._deferred) <= MAX_TRAILING
        other.push("t", ids, torch.ones(50, 2))  # sent by close
    expected = torch.full((50, 2), -6.0)
    expected[0] -= 3 * MAX_TRAILING
    torch.testing.assert_close(c.pull("t", ids), expected)


def test_a_synchronous_tables_push_does_not_wait_for_a_pull(client2):
    c = client2
    c.create_table("s", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                   sync=SyncPolicy(workers=1))
    c.worker.rank, c.worker.world_size = 0, 1
    c.read_your_writes = False
    c.push("s", torch.arange(10), torch.ones(10, 2))
    assert not c.pushes.has_queued  # its pull may wait for the step the push completes
    c.flush()
    torch.testing.assert_close(c.pull("s", torch.arange(10)), -torch.ones(10, 2))


def _sgd_reference(w0: torch.Tensor, grads: list[torch.Tensor], lr: float) -> torch.Tensor:
    w = torch.nn.Parameter(w0.clone())
    opt = torch.optim.SGD([w], lr=lr)
    for g in grads:
        w.grad = g
        opt.step()
    return w.detach()


def test_dense_values_come_back_with_the_pushes(client2):
    c = client2
    w0 = torch.randn(300, 20)
    c.register_dense("w", w0, optimizer=SGD(lr=0.1), chunk_bytes=4096)  # rows on both shards
    c.create_table("e", dim=4, num_embeddings=50, optimizer=SGD(lr=0.1), initializer=Initializer("zeros"))
    c.defer_pushes = True
    grads = [torch.randn(300, 20, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    for g in grads:
        c.push_dense("w", g)
    c.push("e", torch.arange(50), torch.ones(50, 4))
    back = c.send_pushes(pull_dense=["w"])
    assert back is not None and set(back.futures) == {0, 1}
    value, versions = back.result()["w"]
    # Read once the pushes were applied: what torch.optim.SGD gives, and what a pull gives now.
    torch.testing.assert_close(value, _sgd_reference(w0, grads, 0.1), rtol=1e-6, atol=1e-6)
    pulled, pulled_versions = c.pull_dense("w")
    torch.testing.assert_close(value, pulled, rtol=0, atol=0)
    assert versions.by_shard == pulled_versions.by_shard
    c.flush()
    torch.testing.assert_close(c.pull("e", torch.arange(50)), torch.full((50, 4), -0.1))
    # With nothing queued, the values come back alone (a PushBatch of pulls only).
    alone = c.send_pushes(pull_dense=["w"])
    assert alone is not None
    torch.testing.assert_close(alone.result()["w"][0], pulled, rtol=0, atol=0)


def test_dense_values_too_large_for_one_reply_are_not_sent_back(cluster2):
    with Client([s.address for s in cluster2], timeout=10, max_message_bytes=256 * 1024) as c:
        c.register_dense("big", torch.zeros(200, 400))  # 320 KB on one shard: over half the limit
        c.register_dense("small", torch.zeros(10, 10))
        c.defer_pushes = True
        c.push_dense("big", torch.ones(200, 400))
        assert c.send_pushes(pull_dense=["big", "small"]) is None
        c.flush()  # the pushes went out all the same
        torch.testing.assert_close(c.pull_dense("big")[0], torch.full((200, 400), -1e-3))
        assert c.send_pushes(pull_dense=["small"]) is not None


def test_unknown_dense_tensor_fails_before_queued_pushes_are_taken(client2):
    c = client2
    c.register_dense("w", torch.zeros(4, 4), optimizer=SGD(lr=1.0))
    c.defer_pushes = True
    c.push_dense("w", torch.ones(4, 4))
    with pytest.raises(TableNotFoundError, match="nope"):
        c.send_pushes(pull_dense=["nope"])
    c.flush()  # sends the queued push, which was kept
    torch.testing.assert_close(c.pull_dense("w")[0], -torch.ones(4, 4))


def test_push_batch_validates_its_dense_pulls_before_applying(cluster2, client2):
    c = client2
    c.create_table("t", dim=2, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    c.register_dense("d", torch.zeros(3, 3))
    stub = pb_grpc.ShardStub(grpc.insecure_channel(cluster2[0].address))
    ids = np.arange(100)[shard_of_ids(np.arange(100), 2) == 0][:3]
    smap = pb.ShardMap(shard_index=0, num_shards=2)
    push = wire.encode_push("t", np.ones((3, 2), np.float32), pb.FLOAT32, ids=ids, shard_map=smap)
    for pull, code, words in [
        (pb.PullDenseRequest(name="nope", row_start=0, row_end=1, shard_map=smap), grpc.StatusCode.NOT_FOUND, "nope"),
        (pb.PullDenseRequest(name="d", row_start=2, row_end=9, shard_map=smap), grpc.StatusCode.OUT_OF_RANGE,
         "rows [2, 9) outside [0, 3)"),
        (pb.PullDenseRequest(name="d", row_start=0, row_end=3, shard_map=pb.ShardMap(shard_index=1, num_shards=2)),
         grpc.StatusCode.FAILED_PRECONDITION, "meant for shard 1 of 2"),
    ]:
        body = wire.encode_repeated([(1, [push]), (3, [pull.SerializeToString()])])
        with pytest.raises(grpc.RpcError) as e:
            stub.PushBatch(pb.PushBatchRequest.FromString(body))
        assert e.value.code() == code and words in e.value.details()
    torch.testing.assert_close(c.pull("t", torch.from_numpy(ids)), torch.zeros(3, 2))  # no push was applied


def test_push_batch_carries_row_pulls_read_after_its_pushes(cluster2, client2):
    """A PushBatch's row pulls (``pulls``) are read once its pushes are applied; when any cannot be served, all are
    left out and the pushes' outcomes stand."""
    c = client2
    c.create_table("t", dim=2, num_embeddings=100, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"))
    stub = pb_grpc.ShardStub(grpc.insecure_channel(cluster2[0].address))
    ids = np.arange(100)[shard_of_ids(np.arange(100), 2) == 0][:3]
    other = np.arange(100)[shard_of_ids(np.arange(100), 2) == 1][:1]
    smap = pb.ShardMap(shard_index=0, num_shards=2)
    field = wire.message_field(pb.PullRequest.SHARD_MAP_FIELD_NUMBER, smap)
    push = wire.encode_push("t", np.ones((3, 2), np.float32), pb.FLOAT32, ids=ids, shard_map=smap)
    pulls = [wire.encode_pull("t", ids, pb.FLOAT32, field), wire.encode_pull("t", ids[:1], pb.FLOAT32, field)]
    reply = stub.PushBatch(pb.PushBatchRequest.FromString(wire.encode_repeated([(1, [push]), (4, pulls)])))
    assert len(reply.pushes) == 1 and len(reply.pulled) == 2
    np.testing.assert_array_equal(np.frombuffer(reply.pulled[0].rows.data, np.float32).reshape(3, 2), -np.ones((3, 2)))
    np.testing.assert_array_equal(np.frombuffer(reply.pulled[1].rows.data, np.float32), [-1.0, -1.0])
    assert reply.pulled[0].version == reply.pushes[0].version  # read at the version the push made
    # A pull of an unknown table, or of ids of the other shard: the pushes apply, the pulls are all left out.
    for bad in (wire.encode_pull("nope", ids, pb.FLOAT32, field), wire.encode_pull("t", other, pb.FLOAT32, field)):
        reply = stub.PushBatch(pb.PushBatchRequest.FromString(
            wire.encode_repeated([(1, [push]), (4, [pulls[0], bad])])))
        assert len(reply.pushes) == 1 and not reply.pulled
    torch.testing.assert_close(c.pull("t", torch.from_numpy(ids)), torch.full((3, 2), -3.0))
    # Pulls alone (no push) are served as well.
    reply = stub.PushBatch(pb.PushBatchRequest.FromString(wire.encode_repeated([(4, pulls[:1])])))
    assert not reply.pushes and len(reply.pulled) == 1
