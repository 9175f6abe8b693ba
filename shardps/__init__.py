"""shardps: a sharded embedding-table parameter server (server side).

The server package depends on numpy, grpcio, protobuf, numba and prometheus-client;
it never imports torch, so shard processes start fast and the server image stays small.
"""

__version__ = "0.1.0"
