"""The tables and dense tensors of one shard, by name."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional, Union

from shardps.core.errors import AlreadyExists, InvalidArgument, NotFound, clip
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.shard.limits import Limits
from shardps.server.storage.budget import AHEAD_IDLE_S, MemoryBudget
from shardps.server.storage.disk import DiskTiers
from shardps.server.storage.table import Table


class TableRegistry:
    """Name -> Table, with the limits on names and counts, and the memory budget new tables charge.

    ``lock`` orders changes to the set of tables; it comes before any table's lock. ``tiers``: the shard's disk
    tier, where tables with a ``DiskTier`` keep their cold rows (None: such tables are refused).
    """

    def __init__(self, shard_index: int, limits: Limits, tiers: Optional[DiskTiers] = None,
                 explicit_disk_dir: bool = False) -> None:
        self.shard_index = shard_index
        self.limits = limits
        self.tiers = tiers
        if tiers is not None and explicit_disk_dir:  # a --disk-dir that is not this shard's stops the start
            tiers.check_root(create=False)
        self.budget = MemoryBudget(limits.memory_bytes)
        self.lock = threading.RLock()
        self._tables: dict[str, Table] = {}

    def check_name(self, name: str) -> None:
        if len(name) > self.limits.max_name_length:
            raise InvalidArgument(f"name {clip(repr(name), 60)} is longer than the shard's limit of "
                                  f"{self.limits.max_name_length} characters (--max-name-length)")

    def find(self, name: str) -> Optional[Table]:
        """The table ``name``, or None (a name over the length limit is refused)."""
        self.check_name(name)
        return self.lookup(name)

    def lookup(self, name: str) -> Optional[Table]:
        """The table ``name``, or None (no name check: ``new`` checks the names it adds)."""
        with self.lock:
            return self._tables.get(name)

    def existing(self, name: str, dense: bool) -> Optional[Table]:
        """What a create of a table (or with ``dense`` a dense tensor) named ``name`` finds, or None; AlreadyExists
        when the name is the other kind's (a table and a dense tensor never share a name)."""
        t = self.lookup(name)
        if t is not None and t.is_dense != dense:
            kinds = ("an embedding table", "a dense tensor")
            raise AlreadyExists(f"{name!r} is {kinds[t.is_dense]} on shard {self.shard_index}: {kinds[dense]} "
                                "cannot take its name")
        return t

    def get(self, name: str, dense: bool) -> Table:
        """The table (or dense tensor) ``name``; NotFound if there is none of that kind."""
        t = self.find(name)
        if t is None or t.is_dense != dense:
            what = "dense tensor" if dense else "table"
            raise NotFound(f"unknown {what} {name!r} on shard {self.shard_index}")
        return t

    def new(self, spec: Union[TableSpec, DenseSpec], owns: Any, expected_rows: int) -> Table:
        """Create and add a table charged to the budget (callers hold ``lock`` and checked it is absent)."""
        self.limits.check("tables and dense tensors", len(self._tables) + 1, "max_tables")
        t = self.build(spec, owns, expected_rows)
        self._tables[spec.name] = t
        return t

    def build(self, spec: Union[TableSpec, DenseSpec], owns: Any, expected_rows: int, tier_key: str = "") -> Table:
        """A table charged to the budget, not added (``put`` adds it: a serving shard swaps tables in whole, each
        generation's disk tier under its own ``tier_key``)."""
        self.check_name(spec.name)
        if spec.sync is not None:
            self.limits.check(f"{spec.name}: sync workers", spec.sync.workers, "max_workers")
        return Table(spec, owns, expected_rows, budget=self.budget, max_rows=self.limits.max_table_rows,
                     tiers=self.tiers, tier_key=tier_key)

    def put(self, t: Table) -> Optional[Table]:
        """Add ``t``, replacing the table of its name (callers hold ``lock``); the one replaced, or None."""
        old = self._tables.get(t.spec.name)
        self._tables[t.spec.name] = t
        return old

    def pop(self, name: str) -> Optional[Table]:
        """Remove a table (callers hold ``lock``); its memory is released by the caller under its lock."""
        return self._tables.pop(name, None)

    def tables(self) -> list[Table]:
        with self.lock:
            return list(self._tables.values())

    def give_back_pages_ahead(self) -> int:
        """Pages made ahead of tables that have had no new row for ``AHEAD_IDLE_S``, handed back while another table
        finds no room for its own (the shard's sweeper, about once a second); how many tables gave some back."""
        if not self.budget.short_within(AHEAD_IDLE_S):
            return 0
        now, gave = time.monotonic(), 0
        for t in self.tables():
            if t.store.idle_ahead(now):
                with t.lock:
                    gave += t.store.give_back_ahead(now)
        return gave

    def sorted_items(self) -> list[tuple[str, Table]]:
        with self.lock:
            return sorted(self._tables.items())

    def clear(self) -> None:
        with self.lock:
            for t in self._tables.values():
                with t.lock:
                    t.release()
            self._tables.clear()

    def tiered(self) -> bool:
        """Whether a table keeps rows in the disk tier (a cut then checkpoints the tier too)."""
        with self.lock:
            return any(t.hot is not None for t in self._tables.values())

    def close(self) -> None:
        """Close the disk tier (the shard is closing)."""
        if self.tiers is not None:
            self.tiers.close()

    def __len__(self) -> int:
        return len(self._tables)
