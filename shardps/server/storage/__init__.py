"""Where a shard keeps rows: ``Table`` (a table's meaning: reads that create rows, the optimizer step,
bounded-table policies, export copies) over a ``RowStore`` (``rows``: slot-dense arrays of rows, optimizer
state and metadata), its id ``index`` (hash or direct), ``bounded`` tables' admission sketch and victim
choice, ``expiry`` (what TTLs, capacity and per-row staleness decide), ``checks`` of ids and gradients,
and the shard's memory ``budget``. Knows nothing of requests, durability or gRPC; imports only
``shardps.core``.

Public names: ``storage.table.Table``, ``storage.rows.RowStore``, ``storage.index.HashIndex`` /
``DirectIndex``, ``storage.budget.MemoryBudget``, ``storage.bounded.RemovalLog``.
"""
