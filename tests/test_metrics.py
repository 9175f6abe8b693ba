"""``shardps serve --metrics-port``: a real shard process scraped over HTTP, parsed with Prometheus'
own text parser, its counters checked against the calls this test makes."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
import torch
from prometheus_client import parser
from shardps_client import SGD, Adagrad, Client, SyncPolicy

from shardps.core.specs import Initializer
from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import ShardConfig
from shardps.v1 import shardps_pb2 as pb
from shardps.v1 import shardps_pb2_grpc as pb_grpc
from tests.procs import start_shard


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the page: {(name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_scraped_counters_follow_pulls_pushes_errors_wal_checkpoints_and_workers(tmp_path):
    shard = start_shard(0, 1, tmp_path, str(tmp_path / "d"), extra=["--durability", "log", "--fsync", "always", "--metrics-port", "0"])
    try:
        url = re.findall(r"metrics on (http://\S+/metrics)", shard.log())[0]
        before = scrape(url)
        assert value(before, "shardps_requests_total", method="Pull") == 0
        with Client([shard.address], rank=0, world_size=1, heartbeat_s=0.2) as c:
            c.create_table("emb", dim=8, num_embeddings=1000, optimizer=Adagrad(lr=0.1))
            c.create_table("stepped", dim=2, num_embeddings=10, optimizer=SGD(lr=1.0), initializer=Initializer("zeros"),
                           sync=SyncPolicy(workers=1))
            ids = torch.arange(100) * 7
            c.pull("emb", ids)
            for _ in range(3):
                rows, versions = c.pull_with_version("emb", ids)
                c.push("emb", ids, torch.ones(100, 8), versions=versions, wait=True)
            c.push("stepped", torch.arange(4), torch.ones(4, 2), wait=True)  # a one-worker synchronous step
            c.checkpoint()
            time.sleep(0.5)  # a heartbeat or two
            after = scrape(url)
        with grpc.insecure_channel(shard.address) as ch:  # a call the shard refuses: NOT_FOUND
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.ShardStub(ch).DescribeTable(pb.DescribeTableRequest(name="nope"), timeout=10)
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
        refused = scrape(url)
    finally:
        shard.terminate()

    # Rows and their float32 payload, per table and direction: exactly what was pulled and pushed.
    assert value(after, "shardps_rows_total", table="emb", op="pull") == 400
    assert value(after, "shardps_rows_total", table="emb", op="push") == 300
    assert value(after, "shardps_bytes_total", table="emb", op="push") == 300 * 8 * 4
    assert value(after, "shardps_rows_total", table="stepped", op="push") == 4
    # Calls by method: the client's pulls and pushes travel as stream frames of those methods.
    pulls, pushes = value(after, "shardps_requests_total", method="Pull"), value(after, "shardps_requests_total", method="Push")
    assert pulls == 4 and pushes == 4
    assert value(after, "shardps_request_seconds_count", method="Pull") == pulls
    assert value(after, "shardps_request_seconds_bucket", method="Push", le="+Inf") == pushes
    assert value(after, "shardps_request_bytes_total", method="Push") > 300 * 8 * 4
    assert value(after, "shardps_response_bytes_total", method="Pull") > 400 * 8 * 4
    assert value(after, "shardps_requests_total", method="CreateTable") == 2
    # Staleness of each applied update (3 pushes, read at their own pull's version, and the step): 0.
    assert value(after, "shardps_push_staleness_count") == 4
    assert value(after, "shardps_push_staleness_bucket", le="0.0") == 4
    # The write-ahead log: every push (and table creation) made durable by some fsync.
    fsyncs = value(after, "shardps_wal_fsync_seconds_count")
    assert fsyncs >= 1 and value(after, "shardps_wal_group_records_count") == fsyncs
    assert value(after, "shardps_wal_group_records_sum") >= 4
    assert value(after, "shardps_checkpoint_seconds_count") == 1 and value(after, "shardps_checkpoint_pause_seconds_count") == 1
    assert value(after, "shardps_sync_wait_seconds_count") == 1 and value(after, "shardps_sync_missing_workers_total") == 0
    # Read at the scrape: the version, the tables' sizes, the live worker.
    assert value(after, "shardps_version") == 4  # 3 row pushes and the synchronous step
    assert value(after, "shardps_table_rows", table="emb") == 100
    assert value(after, "shardps_table_bytes", table="emb") >= 100 * 8 * 4 * 2  # rows and Adagrad's state
    assert value(after, "shardps_live_workers") == 1
    # The slot map: one shard owns every hash slot, no slot ever moved.
    assert value(after, "shardps_slots_owned") == 16384 and value(after, "shardps_slot_map_epoch") == 0
    # The data path's connections by transport (the client's default: the data plane, over its Unix socket on
    # this machine), and the synchronous
    # step's push, which waited off its data-plane socket's thread (--fsync always: every push did).
    assert value(after, "shardps_clients", transport="zmq-shm") == 1
    assert value(after, "shardps_clients", transport="zmq") == value(after, "shardps_clients", transport="grpc-stream") == 0
    assert value(after, "shardps_data_plane_handoffs_total") >= 4
    # The refused call, by method and status code.
    assert value(refused, "shardps_errors_total", method="DescribeTable", code="NOT_FOUND") == 1
    assert value(after, "shardps_errors_total", method="DescribeTable", code="NOT_FOUND") == 0


def test_no_metrics_unless_asked():
    server = ShardServer(ShardConfig(shard_index=0, num_shards=1), ServerConfig()).start()
    try:
        assert server.metrics_port is None and not server.shard.metrics.enabled
    finally:
        server.stop()
    server = ShardServer(ShardConfig(shard_index=0, num_shards=1), ServerConfig(metrics_port=0)).start()
    try:
        samples = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert value(samples, "shardps_version") == 0
    finally:
        server.stop()
    with pytest.raises(OSError):  # stopped: the port is closed too
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=2)
