"""The shard server, one sub-package per job; each imports only the ones listed below it.

- ``ops``: what an operator runs: the ``shardps`` command line, the local launcher, development
  certificates, the ``shardps stats`` report, offline resharding.
- ``rpc``: the gRPC face: ``ShardServer`` / ``ServerConfig`` / ``serve``, the servicer, the
  interceptor chain (authentication, fair scheduling, metrics, status codes).
- ``shard``: one shard's logic behind a thin facade (``Shard``): request validation, the update path,
  synchronous steps, the table registry, limits, checkpointing, export sessions and recovery.
- ``exports``: read-only serving of an export (a shard that follows its deltas).
- ``durability``: the write-ahead log, checkpoint files, the durability modes and the checkpoint gate.
- ``storage``: tables of rows and optimizer state, their index, bounded-table policies, the memory budget.

Nothing here imports torch or the client; ``shardps.core`` holds what client and server share. This
package imports nothing on import: ``from shardps.server.rpc import ShardServer`` starts a shard in-process.
"""
