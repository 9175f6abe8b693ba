"""One shard's logic, in plain Python over numpy arrays: the ``Shard`` facade (``facade``) over its
collaborators, each with one job: the table ``registry``, request ``limits``, the ``updates`` path
(the only code that changes rows: pushes, synchronous steps, replay), ``sync`` (synchronous steps and
worker membership), ``aggregate`` (combining workers' gradients), and ``metrics`` (what a shard reports;
a no-op by default). Knows nothing of gRPC or protobuf; imports ``exports``, ``durability``, ``storage``
and ``shardps.core``.

Public names: ``shard.facade.Shard`` / ``ShardConfig``, ``shard.limits.Limits``.
"""
