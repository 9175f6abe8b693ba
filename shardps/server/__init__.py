"""The shard server: a gRPC servicer over a shard of tables, and the tools that run shards.

``ShardServer`` / ``ServerConfig`` / ``serve`` (in ``grpc_server``) are the entry points.
"""

from shardps.server.grpc_server import ServerConfig, ShardServer, serve

__all__ = ["ServerConfig", "ShardServer", "serve"]
