"""Shared fixtures: in-process clusters of real gRPC shard servers on 127.0.0.1, port 0."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import pytest
from shardps_client import Client

from shardps.server import ServerConfig, ShardServer
from shardps.server.shard import ShardConfig


@contextlib.contextmanager
def running_cluster(
    num_shards: int, data_dir: Optional[str] = None, **server_kwargs: object
) -> Iterator[list[ShardServer]]:
    """Start ``num_shards`` shard servers on free loopback ports; stop them on exit."""
    servers = []
    try:
        for i in range(num_shards):
            shard_dir = f"{data_dir}/shard-{i}" if data_dir else None
            servers.append(
                ShardServer(ShardConfig(i, num_shards, data_dir=shard_dir), ServerConfig(**server_kwargs)).start()  # type: ignore[arg-type]
            )
        yield servers
    finally:
        for s in servers:
            s.stop(checkpoint=False)


@pytest.fixture
def cluster2() -> Iterator[list[ShardServer]]:
    with running_cluster(2) as servers:
        yield servers


@pytest.fixture
def client2(cluster2: list[ShardServer]) -> Iterator[Client]:
    with Client([s.address for s in cluster2], timeout=10, retry_timeout=2) as c:
        yield c
