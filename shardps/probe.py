"""``shardps-health``: the gRPC health probe that containers run, as cheap as a Python probe gets.

Docker and Compose run their health check as a new process every interval, beside the shards and the
trainer, on the same cores. ``shardps health`` loads the whole server package (numpy, the shard, the
optimizers: about 0.5 s of CPU per check, twice that with bytecode compiled at every start); under a
busy trainer such a check gets a small share of a core and takes longer than its timeout, so healthy
shards were marked unhealthy. This module imports only grpc and the standard health service's
messages (about a tenth of that CPU; ``tests/test_deploy.py`` holds it to that import set), and the
images compile its bytecode at build time.

    shardps-health [--timeout S] [--service NAME] HOST:PORT [HOST:PORT ...]

Exit code 0 when every address answers SERVING, 1 otherwise; one line per address on stdout.
Kubernetes does not need it: its probes speak gRPC health themselves.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def channel(address: str, ca: Optional[str] = None, cert: Optional[str] = None, key: Optional[str] = None,
            options: Sequence[tuple[str, int]] = ()) -> grpc.Channel:
    """A channel to a shard: plaintext, or TLS trusting ``ca`` (with a client certificate for mutual TLS);
    ``options``: gRPC channel options (message size limits), beside ``protocol.RECONNECT_OPTIONS``."""
    from shardps.core.protocol import RECONNECT_OPTIONS

    options = [*options, *RECONNECT_OPTIONS]
    if not ca:
        return grpc.insecure_channel(address, options=options)
    read = lambda p: open(p, "rb").read() if p else None  # noqa: E731
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(read(ca), read(key), read(cert)), options=options)


def check(address: str, timeout: float = 2.0, service: str = "", ca: Optional[str] = None,
          cert: Optional[str] = None, key: Optional[str] = None) -> str:
    """The health status name of a shard ("SERVING", "NOT_SERVING", ...), or "UNREACHABLE"
    (TLS: ``ca`` the shards' CA; ``cert``/``key`` the client's, where shards want mutual TLS)."""
    with channel(address, ca, cert, key) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as e:
            return "UNREACHABLE" if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) else e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


PORT_IN_USE_EXIT = 75  # EX_TEMPFAIL: ``shardps serve`` could not listen on its fixed port, held by another socket


def port_free(host: str, port: int) -> bool:
    """Whether a listening socket could bind ``host:port`` now, with SO_REUSEADDR as gRPC binds (a closed
    connection's TIME_WAIT does not hold the port; another socket bound to it, or an open connection's end, does)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


def wait_for_port(host: str, port: int, deadline: float) -> None:
    """Wait until ``port_free`` (``deadline``: a ``time.monotonic()`` time; past it, return and let the bind fail):
    a shard started again on its own port, which another socket may hold for a while once it went."""
    while not port_free(host, port) and time.monotonic() < deadline:
        time.sleep(0.1)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardps-health", description="gRPC health probe of shardps shards")
    p.add_argument("addresses", nargs="+", help="shard addresses host:port")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per shard")
    p.add_argument("--service", default="", help="health service name ('' is the whole server)")
    add_tls_args(p)
    return p


def add_tls_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", default=os.environ.get("SHARDPS_TLS_CA"),
                   help="TLS: the CA of the shards' certificates (PEM) [env SHARDPS_TLS_CA]")
    p.add_argument("--tls-cert", default=os.environ.get("SHARDPS_TLS_CLIENT_CERT"),
                   help="mutual TLS: this client's certificate (PEM) [env SHARDPS_TLS_CLIENT_CERT]")
    p.add_argument("--tls-key", default=os.environ.get("SHARDPS_TLS_CLIENT_KEY"),
                   help="mutual TLS: this client's key (PEM) [env SHARDPS_TLS_CLIENT_KEY]")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    statuses = [(a, check(a, args.timeout, args.service, args.tls_ca, args.tls_cert, args.tls_key))
                for a in args.addresses]
    for a, st in statuses:
        print(f"{a}\t{st}")
    return 0 if all(st == "SERVING" for _, st in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
