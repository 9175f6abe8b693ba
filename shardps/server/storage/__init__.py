"""Where a shard keeps rows: ``Table`` (rows, optimizer state, per-row metadata, the optimizer step),
its id ``index`` (hash or direct), ``bounded`` tables' admission and eviction policies, and the shard's
memory ``budget``. Knows nothing of requests, durability or gRPC; imports only ``shardps.core``.

Public names: ``storage.table.Table``, ``storage.index.HashIndex`` / ``DirectIndex``,
``storage.budget.MemoryBudget``, ``storage.bounded.RemovalLog``.
"""
