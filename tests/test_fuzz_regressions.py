"""Regression tests for the bugs the fuzzing of a shard found: each sends the exact bytes or call.

Shards run as real processes (``shardps serve``, tests/procs.py) on 127.0.0.1, port 0.
"""

from __future__ import annotations

import pathlib
import struct
import zlib

import grpc
import numpy as np
import pytest
from shardps_client import SGD, Client

from shardps.core import codec
from shardps.server.durability import wal
from shardps.v1 import shardps_pb2 as pb
from tests.procs import ShardProcess, start_shard

METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Shard"].methods]


def _call(address: str, method: str, request: bytes, timeout: float = 10) -> tuple[grpc.StatusCode, bytes, str]:
    """Send raw request bytes; (code, reply bytes, details)."""
    with grpc.insecure_channel(address) as ch:
        if method == "Stream":
            call = ch.stream_stream(f"/shardps.v1.Shard/{method}")
            try:
                replies = list(call(iter([request]), timeout=timeout))
            except grpc.RpcError as e:
                return e.code(), b"", e.details() or ""
            reply = pb.StreamResponse.FromString(replies[0])
            if reply.HasField("error"):
                code = next(c for c in grpc.StatusCode if c.value[0] == reply.error.code)
                return code, b"", reply.error.message
            return grpc.StatusCode.OK, replies[0], ""
        try:
            return grpc.StatusCode.OK, ch.unary_unary(f"/shardps.v1.Shard/{method}")(request, timeout=timeout), ""
        except grpc.RpcError as e:
            return e.code(), b"", e.details() or ""


def _expect(address: str, method: str, request: bytes, code: grpc.StatusCode, match: str) -> str:
    got, _, details = _call(address, method, request)
    assert got == code, (method, got, details)
    assert match in details, details
    return details


def _rss_mb(proc: ShardProcess) -> float:
    for line in pathlib.Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _owned_push(table: str = "t", ids=(1, 2), dim: int = 8, **kw) -> pb.PushRequest:
    grads = np.ones((len(ids), dim), np.float32)
    return pb.PushRequest(table=table, ids=codec.encode(np.asarray(ids, np.int64)), grads=codec.encode(grads), **kw)


@pytest.fixture
def shard(tmp_path):
    p = start_shard(0, 1, tmp_path, extra=["--max-memory-mb", "256", "--max-tables", "8"])
    c = Client([p.address], timeout=10, retry_timeout=2)
    c.create_table("t", dim=8, num_embeddings=1000, optimizer=SGD(lr=0.5))
    yield p, c
    c.close()
    p.kill()


# ---- 1. a push the shard accepts live must replay after kill -9 ---------------------------------


@pytest.mark.slow
def test_pushes_protobuf_reads_differently_are_refused_and_the_log_replays(tmp_path):
    data = str(tmp_path / "data")
    p = start_shard(0, 1, tmp_path, data_dir=data, extra=["--durability", "log"])
    try:
        with Client([p.address], timeout=10, retry_timeout=2) as c:
            c.create_table("t", dim=8, num_embeddings=1000, optimizer=SGD(lr=1.0))
            valid = _owned_push().SerializeToString()
            assert valid[0] == 0x0A
            overlong_tag = bytes.fromhex("8a8080808000") + valid[1:]
            _expect(p.address, "Push", overlong_tag, grpc.StatusCode.INVALID_ARGUMENT, "overlong varint")
            grads_field = pb.PushRequest(grads=_owned_push().grads).SerializeToString()
            _expect(p.address, "Push", valid + grads_field, grpc.StatusCode.INVALID_ARGUMENT, "more than once")
            assert _call(p.address, "Push", valid)[0] == grpc.StatusCode.OK  # one acknowledged push
            before = c.pull("t", np.arange(1000)).numpy()
            version = c.shard_info()[0].version
        p.kill()
        p = start_shard(0, 1, tmp_path, data_dir=data, extra=["--durability", "log"])
        with Client([p.address], timeout=10, retry_timeout=2) as c:
            np.testing.assert_array_equal(c.pull("t", np.arange(1000)).numpy(), before)
            assert c.shard_info()[0].version == version == 1
    finally:
        p.kill()


def _log_record(kind: int, payload: bytes) -> bytes:
    return struct.pack("<IIB", len(payload), zlib.crc32(payload, kind), kind) + payload


def _segment(data: pathlib.Path) -> pathlib.Path:
    return wal.segment_path(data, wal.segments(data)[-1])


@pytest.mark.slow
def test_unreplayable_record_stops_the_start_loudly_and_truncate_recovers(tmp_path):
    data = tmp_path / "data"
    p = start_shard(0, 1, tmp_path, data_dir=str(data), extra=["--durability", "log"])
    with Client([p.address], timeout=10, retry_timeout=2) as c:
        c.create_table("t", dim=8, num_embeddings=1000, optimizer=SGD(lr=1.0))
        c.push("t", np.array([1, 2]), np.ones((2, 8), np.float32))
        acknowledged = c.pull("t", np.arange(10)).numpy()
    p.kill()
    # A record whose checksum holds but whose push cannot be read (as an older shard could have written),
    # then an intact push after it.
    later = _log_record(wal.PUSH, struct.pack("<Q", 0) + _owned_push(ids=(3,)).SerializeToString())
    with open(_segment(data), "ab") as f:
        f.write(_log_record(wal.PUSH, struct.pack("<Q", 0) + b"\x0a\x01t\x12\x03\x08\x04\x10") + later)
    with pytest.raises(RuntimeError) as info:
        start_shard(0, 1, tmp_path, data_dir=str(data), extra=["--durability", "log"])
    message = str(info.value)
    assert "record 2" in message and "cannot be replayed" in message and "--wal-recovery truncate" in message
    p = start_shard(0, 1, tmp_path, data_dir=str(data), extra=["--durability", "log", "--wal-recovery", "truncate"])
    try:
        assert "2 records from there on" in p.log() and "NOT applied" in p.log()
        assert list(data.glob("wal-*.log.corrupt-*"))
        with Client([p.address], timeout=10, retry_timeout=2) as c:
            np.testing.assert_array_equal(c.pull("t", np.arange(10)).numpy(), acknowledged)
            assert c.shard_info()[0].version == 1
    finally:
        p.kill()


def _replayed(data: pathlib.Path):
    from shardps.server.shard.facade import Shard, ShardConfig

    s = Shard(ShardConfig(0, 1, data_dir=str(data), durability="log"))
    try:
        return s, s.pull("t", np.arange(10))[0]
    finally:
        s.close()


def test_torn_tail_of_a_segment_does_not_hide_the_segments_after_it(tmp_path):
    from shardps.server.shard.facade import Shard, ShardConfig

    data = tmp_path / "data"
    s = Shard(ShardConfig(0, 1, data_dir=str(data), durability="log"))
    s.create_table(_spec())
    t = s.registry.get("t", dense=False)
    s.apply_push(t, np.array([1]), np.ones((1, 8), np.float32), None, "", 0)
    s.close()
    with open(_segment(data), "ab") as f:  # died while writing a record: never acknowledged
        f.write(_log_record(wal.PUSH, b"x" * 40)[:20])
    s = Shard(ShardConfig(0, 1, data_dir=str(data), durability="log"))  # restart: a new segment
    s.apply_push(s.registry.get("t", dense=False), np.array([2]), np.ones((1, 8), np.float32), None, "", 0)
    s.close()
    s, rows = _replayed(data)
    assert s.version == 2
    assert (rows[1] != rows[0]).any() and (rows[2] != rows[0]).any()


def test_damaged_record_inside_the_log_is_not_taken_for_a_torn_tail(tmp_path):
    from shardps.server.shard.facade import LogReplayError, Shard, ShardConfig

    data = tmp_path / "data"
    s = Shard(ShardConfig(0, 1, data_dir=str(data), durability="log"))
    s.create_table(_spec())
    for i in range(3):
        s.apply_push(s.registry.get("t", dense=False), np.array([i]), np.ones((1, 8), np.float32), None, "", 0)
    s.close()
    seg = _segment(data)
    second_push = list(wal.replay(data, 0))[-2]
    raw = bytearray(seg.read_bytes())
    raw[second_push.offset + 12] ^= 0xFF  # inside the second push: the third follows it
    seg.write_bytes(bytes(raw))
    with pytest.raises(LogReplayError, match="checksum"):
        Shard(ShardConfig(0, 1, data_dir=str(data), durability="log"))


def _spec():
    from shardps.core.specs import Initializer, TableSpec

    return TableSpec("t", 8, 1000, SGD(lr=1.0), Initializer("zeros"))


# ---- 3. heartbeats ---------------------------------------------------------------------------------


def test_heartbeat_rank_and_world_size_are_bounded(shard):
    p, _ = shard
    rss = _rss_mb(p)
    _expect(p.address, "Heartbeat", pb.HeartbeatRequest(rank=4_000_000_000).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT, "--max-workers")
    _expect(p.address, "Heartbeat", pb.HeartbeatRequest(rank=5, world_size=4).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT, "not in [0, world_size 4)")
    _expect(p.address, "Heartbeat", pb.HeartbeatRequest(rank=1, world_size=4_000_000_000).SerializeToString(),
            grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-workers")
    ok = pb.HeartbeatResponse.FromString(_call(p.address, "Heartbeat", pb.HeartbeatRequest(rank=1, world_size=2)
                                               .SerializeToString(), timeout=5)[1])
    assert list(ok.live_ranks) == [0, 1]
    assert _rss_mb(p) < rss + 50


def test_heartbeat_wait_answers_before_the_deadline(shard):
    p, _ = shard
    req = pb.HeartbeatRequest(rank=0, world_size=2, wait_min_clock=10**6, wait_s=1e9).SerializeToString()
    code, reply, _ = _call(p.address, "Heartbeat", req, timeout=8)  # (waits 6 s: 2 s to answer in)
    assert code == grpc.StatusCode.OK and pb.HeartbeatResponse.FromString(reply).min_clock == 0


# ---- 4. no INTERNAL for bad input ------------------------------------------------------------------


def test_bytes_protobuf_cannot_parse_are_invalid_argument_on_every_method(shard):
    p, _ = shard
    for method in METHODS:
        _expect(p.address, method, b"\x0a", grpc.StatusCode.INVALID_ARGUMENT, "malformed")


def test_huge_shapes_without_data(shard):
    p, _ = shard
    for shape in ([2**32, 2**32], [2**62, 4]):
        req = pb.PullRequest(table="t", ids=pb.Tensor(dtype=pb.INT64, shape=shape))
        _expect(p.address, "Pull", req.SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "is too large")
    req = pb.PullRequest(table="t", ids=pb.Tensor(dtype=pb.INT64, shape=[2**20, 2**20]))
    _expect(p.address, "Pull", req.SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "do not match shape")
    dense = pb.PushDenseRequest(name="d", grads=pb.Tensor(dtype=pb.FLOAT32, shape=[1] * 66, data=b"\0" * 4))
    _expect(p.address, "PushDense", dense.SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "66 dimensions")


def test_register_dense_row_start_past_the_tensor(shard):
    p, _ = shard
    req = pb.RegisterDenseRequest(spec=pb.DenseSpec(name="d", shape=[4, 2], optimizer=pb.OptimizerSpec(
        sgd=pb.SGDSpec(lr=0.1))), row_start=2**64 - 1, values=codec.encode(np.ones((1, 2), np.float32)))
    _expect(p.address, "RegisterDense", req.SerializeToString(), grpc.StatusCode.OUT_OF_RANGE, "row_start")


def test_empty_tensor_with_a_dimension_numpy_cannot_hold(shard):
    p, _ = shard
    req = pb.RegisterDenseRequest(spec=pb.DenseSpec(name="d", shape=[4, 3], optimizer=pb.OptimizerSpec(
        sgd=pb.SGDSpec(lr=0.1))), row_start=2, values=pb.Tensor(dtype=pb.FLOAT32, shape=[2**63 - 1, 0, 3]))
    _expect(p.address, "RegisterDense", req.SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "too large")


def test_push_batch_refused_by_a_later_entry_applies_none(shard):
    p, c = shard
    ok = _owned_push()
    sync_on_async = _owned_push(ids=(3,), sync=pb.SyncPart(step=1, rank=0))
    batch = pb.PushBatchRequest(pushes=[ok, sync_on_async]).SerializeToString()
    _expect(p.address, "PushBatch", batch, grpc.StatusCode.INVALID_ARGUMENT, "asynchronous")
    assert c.shard_info()[0].version == 0


def test_push_batch_reading_uninitialised_dense_rows_applies_none(shard):
    p, c = shard
    spec = pb.DenseSpec(name="u", shape=[4, 3], optimizer=pb.OptimizerSpec(sgd=pb.SGDSpec(lr=0.1)))
    assert _call(p.address, "RegisterDense", pb.RegisterDenseRequest(spec=spec).SerializeToString())[0] == \
        grpc.StatusCode.OK  # registered, no values yet
    batch = pb.PushBatchRequest(pushes=[_owned_push()], pull_dense=[pb.PullDenseRequest(name="u", row_end=1)])
    for method, body in (("PushBatch", batch.SerializeToString()),
                         ("Stream", bytes([0x1A, len(batch.SerializeToString())]) + batch.SerializeToString())):
        _expect(p.address, method, body, grpc.StatusCode.INVALID_ARGUMENT, "not initialised")
    assert c.shard_info()[0].version == 0


def test_garbage_shard_map_or_sync_in_pushes_and_streams(shard):
    p, _ = shard
    valid = _owned_push().SerializeToString()
    for field in (7, 8):  # shard_map, sync: a sub-message protobuf cannot parse
        bad = valid + bytes([field << 3 | 2, 1, 0x0A])
        _expect(p.address, "Push", bad, grpc.StatusCode.INVALID_ARGUMENT, "cannot be parsed")
        _expect(p.address, "PushBatch", bytes([0x0A, len(bad)]) + bad, grpc.StatusCode.INVALID_ARGUMENT,
                "cannot be parsed")
        _expect(p.address, "Stream", bytes([0x0A, len(bad)]) + bad, grpc.StatusCode.INVALID_ARGUMENT,
                "cannot be parsed")
    pull = pb.PullRequest(table="t", ids=codec.encode(np.array([1]))).SerializeToString() + b"\x22\x01\x0a"
    _expect(p.address, "Pull", pull, grpc.StatusCode.INVALID_ARGUMENT, "malformed PullRequest")


# ---- 5. limits ------------------------------------------------------------------------------------


def test_declared_table_size_reserves_nothing_and_rows_stop_at_the_memory_budget(shard):
    p, c = shard
    rss = _rss_mb(p)
    for i in range(2):
        c.create_table(f"big{i}", dim=8, num_embeddings=200_000_000, optimizer=SGD(lr=0.1))
    assert _rss_mb(p) < rss + 100, (rss, _rss_mb(p))
    # 256 MiB at 8 x 4 + 4 + 16 + 24 bytes a row (value, step, metadata, index): about 3.5M rows fit, less
    # what the index's growth takes; pulls of new rows stop there, whole.
    ids = np.arange(100_000, dtype=np.int64)  # one message each way
    with pytest.raises(Exception) as info:
        for k in range(60):
            c.pull("big0", ids + k * 100_000)
    assert "--max-memory-mb" in str(info.value)
    rows = c.describe_table("big0")[0].num_rows
    assert 3_000_000 <= rows <= 3_600_000 and rows % 100_000 == 0, rows  # the refused pull added nothing
    c.drop_table("big0")  # dropping gives the budget back
    c.pull("big1", ids)


def test_create_table_beyond_max_tables(shard):
    p, c = shard
    for i in range(7):
        c.create_table(f"x{i}", dim=2, optimizer=SGD())
    with pytest.raises(Exception, match="--max-tables"):
        c.create_table("one-too-many", dim=2, optimizer=SGD())


def test_dense_tensor_over_the_element_limit(shard):
    p, _ = shard
    req = pb.RegisterDenseRequest(spec=pb.DenseSpec(name="huge", shape=[10**9, 1], optimizer=pb.OptimizerSpec(
        sgd=pb.SGDSpec(lr=0.1))))
    rss = _rss_mb(p)
    _expect(p.address, "RegisterDense", req.SerializeToString(), grpc.StatusCode.RESOURCE_EXHAUSTED,
            "--max-dense-elements")
    assert _rss_mb(p) < rss + 50


def test_infinite_learning_rate_is_refused(shard):
    p, _ = shard
    spec = pb.TableSpec(name="inf", dim=4, optimizer=pb.OptimizerSpec(sgd=pb.SGDSpec(lr=float("inf"))))
    _expect(p.address, "CreateTable", pb.CreateTableRequest(spec=spec).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT, "lr must be finite")


def test_megabyte_name_gets_a_short_error(shard):
    p, _ = shard
    name = "n" * 1_000_000
    for method, req in [
        ("DropTable", pb.DropTableRequest(name=name)),
        ("DescribeTable", pb.DescribeTableRequest(name=name)),
        ("CreateTable", pb.CreateTableRequest(spec=pb.TableSpec(name=name, dim=4, optimizer=pb.OptimizerSpec(
            sgd=pb.SGDSpec(lr=0.1))))),
        ("Pull", pb.PullRequest(table=name, ids=codec.encode(np.array([1])))),
    ]:
        details = _expect(p.address, method, req.SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "name")
        assert len(details) <= 1024, (method, len(details))


def test_pull_whose_reply_would_be_too_large_is_refused_before_reading(shard):
    p, c = shard
    c.create_table("wide", dim=64, optimizer=SGD())
    req = pb.PullRequest(table="wide", ids=codec.encode(np.arange(500_000, dtype=np.int64)))
    rss = _rss_mb(p)
    _expect(p.address, "Pull", req.SerializeToString(), grpc.StatusCode.RESOURCE_EXHAUSTED, "--max-message-mb")
    assert c.describe_table("wide")[0].num_rows == 0
    assert _rss_mb(p) < rss + 60


def test_ids_per_request_limit(tmp_path):
    p = start_shard(0, 1, tmp_path, extra=["--max-ids-per-request", "100"])
    try:
        with Client([p.address], timeout=10, retry_timeout=2) as c:
            c.create_table("t", dim=4, optimizer=SGD())
            c.pull("t", np.arange(100))
            req = pb.PullRequest(table="t", ids=codec.encode(np.arange(101, dtype=np.int64)))
            _expect(p.address, "Pull", req.SerializeToString(), grpc.StatusCode.RESOURCE_EXHAUSTED,
                    "--max-ids-per-request")
    finally:
        p.kill()
