"""The target's side of slot migrations (``shard.migration``): rows received and logged, prepared (requests for
the slots wait here), activated once the source committed, or dropped when it did not."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import numpy as np

from shardps.core.errors import InvalidArgument
from shardps.core.specs import DenseSpec
from shardps.server.durability import modes as durability
from shardps.server.shard.move import Move, check_arrays, check_move
from shardps.server.shard.move_base import MoveBase
from shardps.server.storage import moves
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)


@dataclass
class _In:
    move: Move
    state: str = "receiving"  # -> "prepared" -> active (then forgotten, in ``finished``)


class Arrivals(MoveBase):
    """Slots arriving at this shard (``into``: in flight, by id)."""

    into: dict[str, _In]

    def _get_in(self, move_id: str, *states: str) -> _In:
        return self._get(self.into, "target", move_id, states)

    def in_begin(self, move: Move) -> None:
        self.shard.check.writable(f"migration {move.id}")
        with self.lock:
            if move.id not in self.into:
                if move.id in self.finished:
                    raise InvalidArgument(f"migration {move.id} is {self.finished[move.id]} on shard "
                                          f"{self.shard.index}")
                check_move(move, "target", self.slots.map, self.shard.index, [], [])
                self._log({"op": "in_begin", "move": move.to_json()}, durable=False,
                          then=lambda: self.into.__setitem__(move.id, _In(move)))
                return
        self._settled()

    def in_rows(self, move_id: str, table: str, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> None:
        """Rows of the move (all they hold), written here and logged."""
        with self.lock:
            i = self._get_in(move_id, "receiving")
        t = self._table(table)
        check_arrays(t, ids, arrays)
        if not i.move.selection(t).of(t, ids).all():
            raise InvalidArgument(f"migration {move_id}: rows outside its slots sent")
        record = durability.record_rows_in(move_id, table, ids, arrays) if self.shard.durability.wants_schema \
            else (0, b"")
        self.shard.updates.write(t, lambda stamp: moves.write_state(t, ids, arrays, stamp), record)

    def apply_rows_in(self, change: durability.RowsIn) -> None:
        """A logged ``in_rows`` replayed."""
        t = self._table(change.table)
        self.shard.updates.write(t, lambda stamp: moves.write_state(t, change.ids, change.arrays, stamp),
                                 replaying=True)

    def in_drop(self, move_id: str, table: str, ids: np.ndarray) -> None:
        """Rows of the move gone on the source since they were copied: removed here (logged)."""
        with self.lock:
            i = self._get_in(move_id, "receiving")
        t = self._table(table)
        if ids.ndim != 1 or ids.dtype != np.int64 or not i.move.selection(t).of(t, ids).all():
            raise InvalidArgument(f"migration {move_id}: rows to drop must be int64 ids of its slots")
        ids = np.unique(ids)
        record = durability.record_slots({"op": "in_drop", "id": move_id, "table": table, "ids": ids.tolist()}) \
            if self.shard.durability.wants_schema else (0, b"")
        self.shard.updates.write(t, lambda stamp: moves.drop(t, ids, stamp), record)

    def in_prepare(self, move_id: str, applied: Optional[dict] = None) -> None:
        """Everything received is durable, with the source's records of applied pushes (``applied``: its
        ``out_handover``'s); requests for the slots wait here for the outcome."""
        with self.shard.checkpointer.lock, self.lock:  # never inside a cluster-wide cut
            i = self._get_in(move_id, "receiving", "prepared")
            if i.state == "receiving":
                self._check_gate("the prepare")

                def prepare() -> None:
                    self.shard.updates.elsewhere.merge(applied or {})
                    self._arriving(i.move, True)
                    i.state = "prepared"
                self._log({"op": "prepared", "id": move_id, "applied": applied or {}}, then=prepare)
                return
        self._settled()

    def _arriving(self, move: Move, on: bool) -> None:
        slots = self.slots
        with slots.cv:
            slots.arriving[move.slots] = on
            if on:
                slots.arriving_dense.update(move.dense)
            else:
                slots.arriving_dense.difference_update(move.dense)
            slots.cv.notify_all()

    def in_activate(self, move_id: str) -> None:
        """The source committed: the slots are this shard's."""
        with self.lock:
            done = self.finished.get(move_id) == "active"
            if not done:
                i = self._get_in(move_id, "prepared")
                self._log({"op": "in", "id": move_id}, then=lambda: self.apply_in(i.move))
        if done:
            return self._settled()
        log.info("shard %d: migration %s active: %d slots from shard %d (slot map epoch %d)", self.shard.index,
                 move_id, i.move.slots.size, i.move.source, i.move.epoch)

    def apply_in(self, move: Move) -> None:
        self.slots.set_map(move.new_map)
        self._arriving(move, False)
        self.into.pop(move.id, None)
        self._finish(move.id, "active")

    def in_abort(self, move_id: str) -> None:
        """Drop what the move brought (the source did not commit)."""
        with self.lock:
            done = self.finished.get(move_id) == "aborted"
            if not done:
                if self._never_begun(self.into, move_id):
                    return
                i = self._get_in(move_id, "receiving", "prepared")
                self._check_gate("the abort")
                self._log({"op": "in_abort", "id": move_id}, then=lambda: self.apply_in_abort(i.move))
        if done:
            return self._settled()
        log.warning("shard %d: migration %s given up: its rows dropped here", self.shard.index, move_id)

    def apply_in_abort(self, move: Move) -> None:
        """The move's rows dropped here, except rows this shard owns (a split slot's other part is its own): its
        logged abort made, live or replayed (as a replay makes it: no waits)."""
        for t in self.shard.registry.tables():
            def drop(stamp: int, t: Table = t) -> None:
                ids = moves.ids_in(t, move.selection(t))
                if ids.size and not isinstance(t.spec, DenseSpec):
                    ids = ids[~self.slots.owned(t.spec, ids)]
                moves.drop(t, ids, stamp)
            self.shard.updates.write(t, drop, replaying=True)
        self._arriving(move, False)
        self.into.pop(move.id, None)
        self._finish(move.id, "aborted")

