"""What both sides of a shard's slot migrations share: the shard, its slot ownership, the lock, the outcomes of
finished moves, and the helpers that log a change and find a table."""

from __future__ import annotations

import threading
from typing import Any

from shardps.core.errors import NotFound
from shardps.server.durability import modes as durability
from shardps.server.shard.slots import SlotOwnership
from shardps.server.storage.table import Table

FINISHED_KEPT = 4096  # outcomes of finished moves remembered (for a driver or a target asking after a crash)


class MoveBase:
    """The state both sides of the migrations share (``Migrations`` is both)."""

    def __init__(self, shard: Any, hold_s: float = 30.0) -> None:
        self.shard = shard
        self.slots: SlotOwnership = shard.slots
        self.hold_s = hold_s
        self.lock = threading.RLock()
        self.finished: dict[str, str] = {}  # id -> "committed" / "aborted" (source), "active" / "aborted" (target)

    def _table(self, name: str) -> Table:
        t = self.shard.registry.find(name)
        if t is None:
            raise NotFound(f"unknown table or dense tensor {name!r} on shard {self.shard.index}")
        return t

    def _log(self, change: dict[str, Any], durable: bool = True) -> None:
        d = self.shard.durability
        d.wait(d.append(durability.record_slots(change)) if d.wants_schema else 0, durable=durable)

    def _finish(self, move_id: str, outcome: str) -> None:
        self.finished[move_id] = outcome
        while len(self.finished) > FINISHED_KEPT:
            del self.finished[next(iter(self.finished))]

