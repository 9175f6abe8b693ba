"""A shard's memory budget: what its tables hold, against ``--max-memory-mb`` (shared by every table of a shard)."""

from __future__ import annotations

import collections
import threading
import time
from typing import Optional

from shardps.core.errors import ResourceExhausted

MIB = 1 << 20
# Pages made ahead of a growing table's rows (``RowStore._make_ahead``) are resident but not charged until their rows
# arrive: at most this many bytes of them in all of a shard's tables, and never more than the budget has left.
AHEAD_SHARD_BYTES = 64 << 20
# A table that has had no new row for this long gives its pages ahead back while another table of its shard finds no
# room for its own (``TableRegistry.give_back_pages_ahead``, about once a second): the room is first come, and a
# table that stopped growing would otherwise keep it until it was dropped.
AHEAD_IDLE_S = 5.0


class MemoryBudget:
    """Bytes a shard's tables may hold; every table charges it before allocating and releases on drop."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self._lock = threading.Lock()
        self._ahead: dict[int, int] = {}  # a store's key -> bytes of pages made (or asked) ahead of its rows
        self._ahead_total = 0
        self._collected: collections.deque[int] = collections.deque()  # keys of stores garbage-collected
        self._short_at = float("-inf")  # time.monotonic() a store last found less room than it asked for

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

    def take(self, nbytes: int) -> bool:
        """``charge`` without its message: reserve ``nbytes`` if the budget has them, else False (nothing reserved)."""
        with self._lock:
            if self.used + nbytes > self.limit:
                return False
            self.used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used = max(0, self.used - nbytes)

    @property
    def ahead_bytes(self) -> int:
        """Bytes of pages made (or asked) ahead of rows in all of the shard's tables: resident, not charged."""
        with self._lock:
            self._drain_collected()
            return self._ahead_total

    def ahead(self, key: int, outstanding: int, want: int, unit: int = 1) -> int:
        """A store (``key``) holds ``outstanding`` bytes of pages made ahead of its rows and would make ``want`` more:
        the bytes it may make (0..want), then counted as its own. With every other store's pages ahead, no more than
        ``AHEAD_SHARD_BYTES`` in all, nor than the budget has left; and no store more than its share of them (the
        stores that asked, alike). Each store's count falls as its rows arrive and are charged, so the room of one
        that found none returns as the others' rows arrive, or when they stopped growing (``AHEAD_IDLE_S``)."""
        with self._lock:
            self._drain_collected()
            others = self._ahead_total - self._ahead.get(key, 0)
            share = AHEAD_SHARD_BYTES // (len(self._ahead) + (key not in self._ahead))  # every store that asked
            room = min(AHEAD_SHARD_BYTES - others, self.limit - self.used - others, share) - outstanding
            grant = max(0, min(want, room)) // unit * unit  # (in whole rows of ``unit`` bytes)
            if grant < want and others:
                self._short_at = time.monotonic()
            self._count_ahead(key, outstanding + grant)
            return grant

    def short_within(self, seconds: float) -> bool:
        """Did a store find less room for pages ahead than it asked for, with others holding some, in the last
        ``seconds``?"""
        return time.monotonic() - self._short_at <= seconds

    def ahead_gone(self, key: int) -> None:
        """A store's pages ahead are no longer its own to count (it was dropped, or is gone)."""
        with self._lock:
            self._drain_collected()
            self._ahead_total -= self._ahead.pop(key, 0)

    def ahead_collected(self, key: int) -> None:
        """A store was garbage-collected (its finalizer): its count goes at the next call that takes the lock. Takes
        no lock itself: a collection may run inside any allocation, of a thread that holds it."""
        self._collected.append(key)

    def _drain_collected(self) -> None:
        while self._collected:  # (before a new store can be given a collected one's key: its finalizer ran first)
            self._ahead_total -= self._ahead.pop(self._collected.popleft(), 0)

    def _count_ahead(self, key: int, nbytes: int) -> None:
        self._ahead_total += nbytes - self._ahead.get(key, 0)
        self._ahead[key] = nbytes


def optional_budget(budget: Optional[MemoryBudget]) -> MemoryBudget:
    """``budget``, or one that never refuses (tools that load checkpoints offline, tests of storage alone)."""
    return budget if budget is not None else MemoryBudget(1 << 62)
