"""A shard's memory budget: what its tables hold, against ``--max-memory-mb`` (shared by every table of a shard)."""

from __future__ import annotations

import threading
from typing import Optional

from shardps.core.errors import ResourceExhausted

MIB = 1 << 20


class MemoryBudget:
    """Bytes a shard's tables may hold; every table charges it before allocating and releases on drop."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, what: str) -> None:
        """Reserve ``nbytes`` or raise ResourceExhausted without reserving anything."""
        with self._lock:
            if self.used + nbytes > self.limit:
                raise ResourceExhausted(
                    f"{what} needs {nbytes / MIB:,.1f} MiB more, but the shard's memory budget of "
                    f"{self.limit / MIB:,.0f} MiB has {max(0, self.limit - self.used) / MIB:,.1f} MiB left "
                    f"(--max-memory-mb; or add shards)"
                )
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)


def optional_budget(budget: Optional[MemoryBudget]) -> MemoryBudget:
    """``budget``, or one that never refuses (tools that load checkpoints offline, tests of storage alone)."""
    return budget if budget is not None else MemoryBudget(1 << 62)
