"""Start and stop a shard server.

``ShardServer`` wires a ``Shard`` to a gRPC server with the standard health
service, a periodic checkpoint thread, a thread that gives free heap memory
back when the shard falls idle, and graceful shutdown. ``serve`` runs
one until SIGTERM or SIGINT (the ``shardps serve`` command).
"""

from __future__ import annotations

import logging
import pathlib
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from shardps.core import kernels
from shardps.core.errors import NotPrimary
from shardps.core.memory import release_free_memory, tune_malloc
from shardps.probe import PORT_IN_USE_EXIT, port_free
from shardps.server.exports.serving import Follower
from shardps.server.replica.member import ReplicaConfig, ReplicaMember
from shardps.server.rpc import fair
from shardps.server.rpc.auth import TLSFiles, Tokens
from shardps.server.rpc.fair import FairConfig
from shardps.server.rpc.metrics import Metrics
from shardps.server.rpc.migrate import ArrivalResolver
from shardps.server.rpc.replication import GrpcStream
from shardps.server.rpc.servicer import ShardServicer, add_to_server
from shardps.server.shard.facade import Shard, ShardConfig
from shardps.server.shard.metrics import NO_METRICS, NullMetrics

log = logging.getLogger(__name__)

SERVICE_NAME = "shardps.v1.Shard"
SWEEP_INTERVAL_S = 1.0
DATA_PLANE_WATCH_S = 1.0
IDLE_TRIM_S = 1.0  # a shard quiet this long after traffic returns its free heap pages to the OS


class PortInUse(OSError):
    """The fixed port a shard was told to listen on is held by another socket (``shardps serve`` then exits with
    ``probe.PORT_IN_USE_EXIT``, for whoever started it to try again)."""


def _loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass(frozen=True)
class ServerConfig:
    """How a shard serves.

    Args:
        host: address to bind (127.0.0.1 for local clusters, 0.0.0.0 in containers).
        port: port to bind; 0 picks a free one.
        workers: gRPC handler threads for unary calls.
        max_streams: call streams open at once (each client opens one and
            it holds a thread of its own while open); more are refused and those
            clients make unary calls.
        max_message_mb: largest request or reply in MiB (gRPC's default is 4).
        checkpoint_interval_s: seconds between periodic checkpoints (0: none by time).
        checkpoint_log_mb: checkpoint once this many MiB of log were written since the last checkpoint, so a
            restart replays at most about that much (0: none by size).
        checkpoint_log_ratio: and not before the log since the last checkpoint is this many times the bytes that
            checkpoint wrote (0: ``checkpoint_log_mb`` alone). A checkpoint rewrites the whole shard: with a fixed
            size alone, a shard of 3 GB would be rewritten for every 256 MiB of log, 12 bytes written per byte
            logged; with the ratio it writes at most 1/ratio bytes per byte logged, and a restart replays at most
            about ratio times its checkpoint (Redis rewrites its append-only file on the same rule).
        grace_s: seconds in-flight calls get to finish on shutdown.
        metrics_port: serve Prometheus metrics at http://host:metrics_port/metrics (0: a free
            port; None: no metrics, and no cost for them).
        tls: serve TLS with these certificate and key files (mutual TLS with a client CA).
        tokens: bearer tokens with roles (``shardps.server.rpc.auth.Tokens``, e.g. ``Tokens.load(path)``);
            None: every call allowed.
        fairness: how the shard is shared among callers (``shardps.server.rpc.fair.FairConfig``).
        data_threads: sockets (and threads) of the data plane, pulls and pushes over ZeroMQ
            (``shardps.server.rpc.data_plane``); 0: none, clients use gRPC streams.
        data_port: the first data-plane port (the others follow it); 0: free ports.
        data_ipc: the data plane's sockets are also abstract Unix sockets, which clients on this machine (in its
            network namespace) use instead of TCP.
        data_regions: shared-memory regions per data-plane socket for its Unix-socket clients without TLS (a large
            pull answer, and a push that trails a pull, pass through shared memory, ``shardps.core.region``); 0: none.
        replica: this shard's place in a replica group (``shardps.server.replica.member.ReplicaConfig``; the shard
            config's ``replicas`` is the group's size); None: no replicas.
        advertise: the address clients and the group's other members reach this shard at ("host:port"; default:
            the bound host and port, or this machine's name when bound to every interface).
    """

    host: str = "127.0.0.1"
    port: int = 0
    workers: int = 8
    max_streams: int = 64
    max_message_mb: int = 4
    checkpoint_interval_s: float = 0.0
    checkpoint_log_mb: int = 256
    checkpoint_log_ratio: float = 1.0
    grace_s: float = 5.0
    metrics_port: Optional[int] = None
    tls: Optional[TLSFiles] = None
    tokens: Optional[Tokens] = None
    fairness: FairConfig = FairConfig()
    delta_poll_s: float = 1.0
    data_threads: int = 2
    data_port: int = 0
    data_ipc: bool = True
    data_regions: int = 16
    replica: Optional[ReplicaConfig] = None
    advertise: str = ""


class ShardServer:
    """A running shard: gRPC server, health service and background checkpoints."""

    def __init__(self, shard_config: ShardConfig, server_config: ServerConfig = ServerConfig()) -> None:
        tune_malloc()
        limit = server_config.max_message_mb * 1024 * 1024
        # The shard refuses, before reading a row, any reply larger than gRPC would send.
        shard_config = replace(shard_config, limits=replace(shard_config.limits, max_message_bytes=limit))
        self.metrics: NullMetrics = Metrics() if server_config.metrics_port is not None else NO_METRICS
        self.shard = Shard(shard_config, self.metrics, before_wait=fair.leave_slot)
        self.config = server_config
        self.follower: Optional[Follower] = None
        if shard_config.serve_from is not None:  # loaded before the port opens: a serving shard never serves nothing
            self.follower = Follower(self.shard, pathlib.Path(shard_config.serve_from))
            self.follower.load()
        self.metrics_port: Optional[int] = None
        self._server = grpc.server(
            # Threads start on demand: the pool grows past ``workers`` only while streams are open or
            # heartbeats wait (at most max_streams of each), so unary calls always find a thread.
            futures.ThreadPoolExecutor(max_workers=server_config.workers + 2 * server_config.max_streams,
                                       thread_name_prefix="shardps"),
            options=[
                ("grpc.max_receive_message_length", limit),
                # Replies are held to ``limit`` by the shard itself; a replica's frame may carry one record of a
                # request that size and its framing.
                ("grpc.max_send_message_length", limit + (1 << 20)),
                # Never share a port: a second shard on the same port must fail, not split traffic.
                ("grpc.so_reuseport", 0),
                # Calls one connection may have open at once (HTTP/2): more wait in the client.
                ("grpc.max_concurrent_streams", server_config.fairness.calls_per_connection),
            ],
        )
        tokens = server_config.tokens
        self._servicer = ShardServicer(self.shard, server_config.max_streams, tokens, server_config.fairness)
        add_to_server(self._servicer, self._server)
        self.data_plane: Optional[Any] = None
        if server_config.data_threads > 0:
            from shardps.server.rpc.data_plane import DataPlane

            ports = [server_config.data_port + i if server_config.data_port else 0
                     for i in range(server_config.data_threads)]
            self.data_plane = DataPlane(self._servicer.chain, self._servicer.data.frames, server_config.host, ports,
                                        limit, tokens, encrypted=server_config.tls is not None,
                                        ipc=server_config.data_ipc, regions=server_config.data_regions)
            self._servicer.data_plane = self.data_plane
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        bind = f"{server_config.host}:{server_config.port}"
        try:
            if server_config.tls is not None:
                chain, key, client_ca = server_config.tls.read()
                self.port = self._server.add_secure_port(bind, grpc.ssl_server_credentials(
                    [(key, chain)], root_certificates=client_ca, require_client_auth=client_ca is not None))
            else:
                self.port = self._server.add_insecure_port(bind)
        except RuntimeError:
            self.port = 0
        if self.port == 0:
            if server_config.port and not port_free(server_config.host, server_config.port):
                raise PortInUse(f"could not bind {bind}: another socket holds port {server_config.port}")
            raise OSError(f"could not bind {bind}")
        if not _loopback(server_config.host) and (server_config.tls is None or tokens is None):
            log.warning("shard %d listens on %s without %s: anyone who reaches the port can %s (see docs/security.md, "
                        "the threat model)", self.shard.index, bind,
                        " or ".join(w for w, on in (("TLS", server_config.tls), ("tokens", tokens)) if on is None),
                        "read it and write to it" if tokens is None else "read the traffic")
        self.replica: Optional[ReplicaMember] = None
        if server_config.replica is not None:
            self.replica = ReplicaMember(self.shard, server_config.replica, self.advertised, GrpcStream)
            self._servicer.replica = self.replica
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._ckpt_thread: Optional[threading.Thread] = None
        self._trim_thread = threading.Thread(target=self._trim_when_idle, name="trimmer", daemon=True)
        self._sweep_thread = threading.Thread(target=self._sweep_loop, name="sweeper", daemon=True)
        self._follow_thread = threading.Thread(target=self._follow_loop, name="follower", daemon=True)
        # A move prepared here and left so by its driver is settled with its source (``rpc.migrate``).
        self._arrivals = ArrivalResolver(self.shard, lambda: self.replica is None or self.replica.is_primary)
        self._started = False

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def advertised(self) -> str:
        """The address others reach this shard at."""
        if self.config.advertise:
            return self.config.advertise
        host = self.config.host if self.config.host not in ("0.0.0.0", "::", "") else socket.gethostname()
        return f"{host}:{self.port}"

    def start(self) -> ShardServer:
        """Start serving (idempotent); returns self."""
        if self._started:
            return self
        self._started = True
        self._server.start()
        if self.data_plane is not None:
            self.data_plane.start()
        if isinstance(self.metrics, Metrics):
            self.metrics.watch(self.shard)
            self.metrics.watch_transports(self._servicer.chain.peers, self.data_plane)
            if self.replica is not None:
                self.metrics.watch_replica(self.replica.info)
            assert self.config.metrics_port is not None
            self.metrics_port = self.metrics.serve(self.config.host, self.config.metrics_port)
            log.info("shard %d: metrics on http://%s:%d/metrics", self.shard.index, self.config.host, self.metrics_port)
        for name in ("", SERVICE_NAME):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        automatic = self.config.checkpoint_interval_s > 0 or self.config.checkpoint_log_mb > 0
        if automatic and self.shard.data_dir is not None and self.shard.durability.mode != "none":
            self._ckpt_thread = threading.Thread(target=self._checkpoint_loop, name="checkpointer", daemon=True)
            self._ckpt_thread.start()
        self._trim_thread.start()
        self._sweep_thread.start()
        if self.data_plane is not None:
            threading.Thread(target=self._watch_data_plane, name="data-plane-watch", daemon=True).start()
        if self.follower is not None:
            self._follow_thread.start()
        if self.replica is not None:
            self.replica.start()
        if not self.shard.read_only:
            self._arrivals.start()
        log.info("shard %d of %d serving on %s%s; %s", self.shard.index, self.shard.num_shards, self.address,
                 f" (data plane: ports {', '.join(map(str, self.data_plane.ports))})" if self.data_plane else "",
                 self._keeps())
        return self

    def _keeps(self) -> str:
        """What survives a crash, for the start-up line."""
        shard, d = self.shard, self.shard.durability
        if shard.read_only:
            return f"serving the export {shard.config.serve_from} read-only"
        if shard.data_dir is None or d.mode == "none":
            return "no data dir: nothing is kept, a restart starts empty (--data-dir to keep tables and rows)"
        if d.mode == "checkpoint":
            return (f"durability checkpoint in {shard.data_dir}: tables are logged, row updates since the last "
                    "checkpoint are lost in a crash")
        policy = shard.config.fsync
        machine = {"always": "nothing", "none": "what the OS had not written",
                   "interval": f"at most the last {shard.config.fsync_interval_s:g} s"}[policy]
        group = (f"; member {self.replica.config.member} of a group of {shard.config.replicas} (--ack "
                 f"{shard.config.ack}), coordinated by etcd at {self.replica.config.etcd}") if self.replica else ""
        return (f"durability log in {shard.data_dir} (fsync {policy}): a process crash loses nothing acknowledged, "
                f"a machine crash {machine}{group}")

    def _checkpoint_loop(self) -> None:
        """Automatic checkpoints: every ``checkpoint_interval_s``, and whenever the log since the last checkpoint
        reaches ``checkpoint_log_mb`` and ``checkpoint_log_ratio`` times that checkpoint's size (what bounds a
        restart's replay, and what a checkpoint costs against the log it saves replaying)."""
        every, log_bytes = self.config.checkpoint_interval_s, self.config.checkpoint_log_mb << 20
        last = time.monotonic()
        while not self._stop.wait(min(every, 1.0) if every > 0 else 1.0):
            due_time = every > 0 and time.monotonic() - last >= every
            due_size = log_bytes > 0 and self.shard.durability.log_bytes() >= self.log_bytes_due()
            if not (due_time or due_size):
                continue
            try:
                self.shard.checkpoint()
            except Exception:
                log.exception("automatic checkpoint failed")
            last = time.monotonic()

    def log_bytes_due(self) -> int:
        """Bytes of log since the last checkpoint at which the next automatic one is due (by size)."""
        ratio = self.config.checkpoint_log_ratio
        return max(self.config.checkpoint_log_mb << 20, int(ratio * self.shard.last_checkpoint_bytes))

    def _sweep_loop(self) -> None:
        """Reclaim the memory of expired rows (TTL eviction), a slice of each table per second; the rows
        already read as their initial value, so this only frees memory. And the pages made ahead of tables that
        stopped growing, while another table finds no room for its own (``TableRegistry.give_back_pages_ahead``)."""
        while not self._stop.wait(SWEEP_INTERVAL_S):
            try:
                self.shard.registry.give_back_pages_ahead()
            except Exception:
                log.exception("giving back pages made ahead failed")
            if self.replica is not None and not self.replica.is_primary:
                continue  # a backup's evictions are its primary's records
            try:
                self.shard.sweep()
            except Exception:
                log.exception("eviction sweep failed")

    def _watch_data_plane(self) -> None:
        """Health covers the data plane: a socket no thread serves any more turns the shard NOT_SERVING (its
        probes then restart it), since clients would time out on it rather than fall back to gRPC."""
        assert self.data_plane is not None
        while not self._stop.wait(DATA_PLANE_WATCH_S):
            why = self.data_plane.healthy()
            if why and not self._stop.is_set():
                log.error("shard %d: not serving: %s", self.shard.index, why)
                for name in ("", SERVICE_NAME):
                    self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
                return

    def _follow_loop(self) -> None:
        """A serving shard: apply the export's next deltas as they appear."""
        assert self.follower is not None
        while not self._stop.wait(self.config.delta_poll_s):
            while self.follower.poll() and not self._stop.is_set():
                pass

    def _trim_when_idle(self) -> None:
        """Message buffers stay in the heap while traffic flows (``tune_malloc``); once calls
        stop for IDLE_TRIM_S, hand the free pages back, so a shard's memory after a burst
        (a bulk load, say) is what its tables hold."""
        seen = trimmed = 0
        while not self._stop.wait(IDLE_TRIM_S):
            stats = self.shard.stats
            calls = stats.pulls + stats.pushes
            if calls == seen and calls != trimmed:
                release_free_memory()
                trimmed = calls
            seen = calls

    def stop(self, checkpoint: bool = True) -> None:
        """Stop serving: refuse new calls, let in-flight ones finish, then checkpoint."""
        if self._stopped.is_set():
            return
        self._stop.set()
        self._arrivals.stop()
        if self.replica is not None:  # a primary gives its key back: its backups elect at once
            self.replica.stop()
        self._health.enter_graceful_shutdown()
        if self.data_plane is not None:
            self.data_plane.stop()
        stopped = self._server.stop(self.config.grace_s)
        self._servicer.end_streams()  # an idle stream would otherwise hold the server for the whole grace period
        stopped.wait()
        if self._ckpt_thread is not None:
            self._ckpt_thread.join()
        if self._trim_thread.is_alive():
            self._trim_thread.join()
        if checkpoint and self.shard.data_dir is not None and self.shard.config.durability != "none":
            try:
                self.shard.checkpoint("shutdown")
            except NotPrimary as e:  # a replica group's member that is not (or no longer) the primary: its log
                log.info("shard %d: no checkpoint on shutdown (%s); its log holds every record", self.shard.index, e)
        self.shard.close()
        if isinstance(self.metrics, Metrics):
            self.metrics.close()
        self._stopped.set()
        log.info("shard %d stopped", self.shard.index)

    def wait(self) -> None:
        self._stopped.wait()

    def __enter__(self) -> ShardServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(shard_config: ShardConfig, server_config: ServerConfig, ready_file: Optional[str] = None) -> int:
    """Run a shard until SIGTERM or SIGINT; returns the process exit code."""
    # The compiled kernels load (or compile, with an empty cache) before the shard listens: the first request
    # is then as fast as the others, and a shard that is serving has its memory already. (numba's BLAS probe
    # is skipped: see kernels.without_scipy.)
    kernels.without_scipy()
    kernels.warm_up(client=False)
    try:
        server = ShardServer(shard_config, server_config).start()
    except PortInUse as e:  # for now, it may be: whoever started it (a launcher restarting it) tries again
        print(f"shardps serve: {e}", file=sys.stderr, flush=True)
        return PORT_IN_USE_EXIT
    print(f"shardps shard {shard_config.shard_index}/{shard_config.num_shards} listening on {server.address} "
          f"(kernels: {kernels.describe()})", flush=True)
    if server.metrics_port is not None:
        print(f"shardps shard {shard_config.shard_index}: metrics on "
              f"http://{server_config.host}:{server.metrics_port}/metrics", flush=True)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(server.address)
    done = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        log.info("signal %d: shutting down", signum)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not done.wait(0.5):
        pass
    server.stop()
    return 0
