"""Shared fixtures: in-process clusters of real gRPC shard servers on 127.0.0.1, port 0, and workers
training against them in threads."""

from __future__ import annotations

import os

# torch's OpenMP threads (2 on this machine) spin at each parallel region's barrier while they wait for each other.
# The suite keeps both cores busy with other tests' processes, so a spinning thread burns the CPU its partner needs:
# the DLRM example's local training ran 33x slower beside 3 busy processes (3,260 samples/s against 108,887 alone),
# 5x slower with passive waiting. Set before torch loads here (and in the xdist workers and every process a test
# starts, which inherit it). Users' trainers beside local shards get one thread instead (``worker_threads``).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import contextlib  # noqa: E402
import json
import threading
from typing import Any, Callable, Iterator, Optional

import pytest
from shardps_client import Client

from shardps.server.rpc import ServerConfig, ShardServer
from shardps.server.shard.facade import ShardConfig


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Tests' own breakdowns of their time (``record_property("timings", {...})``, the container test's steps),
    printed at the end of the run, so that a slow CI run says where its time went."""
    for reports in terminalreporter.stats.values():
        for rep in reports:
            for name, value in getattr(rep, "user_properties", ()):
                if name == "timings" and getattr(rep, "when", "") == "call":
                    terminalreporter.write_line(f"timings of {rep.nodeid}: {json.dumps(value)}")


def pytest_collection_modifyitems(items: list) -> None:
    """The longest tests first (the container test, then the other multi-process ``slow`` ones): with ``make
    test``'s xdist workers, the container test's image builds overlap the rest of the suite instead of
    ending it."""
    items.sort(key=lambda item: (0 if "test_containers" in item.nodeid else 1 if item.get_closest_marker("slow")
                                 else 2))


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


def run_workers(addresses: list[str], n: int, body: Callable[[Client, int], None], **client_kwargs) -> list:
    """Run ``body(client, rank)`` for ranks 0..n-1, each in a thread with its own worker Client; the
    (rank, exception) pairs they raised (asserts that none hung)."""
    errors: list = []

    def run(rank: int) -> None:
        try:
            with Client(addresses, rank=rank, world_size=n, heartbeat_s=0.2, **client_kwargs) as c:
                body(c, rank)
        except Exception as e:  # reported to the test below
            errors.append((rank, e))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return errors


@pytest.fixture
def cluster2() -> Iterator[list[ShardServer]]:
    with running_cluster(2) as servers:
        yield servers


# How each data_plane setting of client2 travels to shards on this machine (data_planes(); "": not connected yet).
_TRAVELS = {"zmq": {"zmq-shm", ""}, "zmq-tcp": {"zmq", ""}, "grpc": {"grpc-stream"}}


# The data plane over TCP differs from over a Unix socket only by its endpoint: the transport's own tests run over
# both, the other behaviour tests over the default (the Unix socket) and gRPC streams.
_EVERY_TRANSPORT = ("test_stream", "test_data_plane")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "client2" in metafunc.fixturenames:
        every = metafunc.module.__name__.rsplit(".", 1)[-1] in _EVERY_TRANSPORT
        metafunc.parametrize("client2", list(_TRAVELS) if every else ["zmq", "grpc"], indirect=True)


@pytest.fixture
def client2(cluster2: list[ShardServer], request: pytest.FixtureRequest) -> Iterator[Client]:
    """A client of a 2-shard cluster over the data plane (ZeroMQ, the default: a Unix socket and a shared-memory
    region on this machine), over
    the data plane's TCP ports (as from another machine), and over gRPC streams: the behaviour tests that use it
    run over every transport."""
    with Client([s.address for s in cluster2], timeout=10, retry_timeout=2,
                data_plane=request.param) as c:
        yield c
        assert set(c.transport.data_planes()) <= _TRAVELS[request.param]


def require_etcd() -> None:
    """Skip where Debian's etcd-server is not installed; fail instead where CI sets SHARDPS_REQUIRE_ETCD=1 (it
    installs it there, so a missing etcd is a broken setup)."""
    from shardps.server.ops.etcd import INSTALL, etcd_binary

    if etcd_binary() is None:
        (pytest.fail if os.environ.get("SHARDPS_REQUIRE_ETCD") else pytest.skip)(INSTALL)


@pytest.fixture
def etcd(tmp_path):
    """A real etcd on loopback, its data in the test's directory (``require_etcd``)."""
    from shardps.server.ops.etcd import LocalEtcd

    require_etcd()
    with LocalEtcd(str(tmp_path / "etcd")) as e:
        yield e
