"""The gRPC face of a shard: ``server`` (``ShardServer``, ``ServerConfig``, ``serve``), the ``servicer``
(protobuf in, plain calls on a ``Shard``, protobuf out), ``auth`` (TLS files and bearer tokens), ``fair``
(fair scheduling among callers and per-caller limits) and ``metrics`` (Prometheus). Imports ``shard`` and
everything below it.
"""

from shardps.server.rpc.server import ServerConfig, ShardServer, serve

__all__ = ["ServerConfig", "ShardServer", "serve"]
