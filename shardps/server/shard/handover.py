"""The source's side of slot migrations (``shard.migration``): the copy's rows listed and read, the handover
that holds writes, the commit that gives the slots away, and giving a handover up."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from shardps.core.errors import InvalidArgument
from shardps.server.shard.move import Move, check_move
from shardps.server.shard.move_base import MoveBase
from shardps.server.storage import moves
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)


@dataclass
class _Out:
    move: Move
    since: int  # the shard version when the copy began
    state: str = "copying"  # -> "frozen" -> "committing" -> committed (then forgotten, in ``finished``)
    listed: dict[tuple[str, int], np.ndarray] = field(default_factory=dict)  # (table, since) -> ids, for paging
    timer: Optional[threading.Timer] = None


class Handovers(MoveBase):
    """Slots this shard hands over (``out``: in flight, by id)."""

    out: dict[str, _Out]

    def _get_out(self, move_id: str, *states: str) -> _Out:
        return self._get(self.out, "source", move_id, states)

    def out_begin(self, move: Move) -> int:
        """Start handing ``move`` over: the shard version the copy starts at."""
        self.shard.check.writable(f"migration {move.id}")
        with self.lock:
            existing = self.out.get(move.id)
            if existing is not None:
                return existing.since
            if move.id in self.finished:  # a late or repeated begin of a move settled here
                raise InvalidArgument(f"migration {move.id} is {self.finished[move.id]} on shard {self.shard.index}")
            check_move(move, "source", self.slots.map, self.shard.index, self.shard.registry.tables(),
                       [o.move for o in self.out.values()])
            since = self.shard.version
            self.out[move.id] = _Out(move, since)
        log.info("shard %d: migration %s: handing %d slots and %d dense chunks to shard %d", self.shard.index,
                 move.id, move.slots.size, len(move.dense), move.target)
        return since

    def out_ids(self, move_id: str, table: str, since: int, offset: int, limit: int) -> tuple[np.ndarray, int]:
        """Ids of the rows of ``table`` the move takes, changed after version ``since`` (-1: all), from ``offset``:
        (at most ``limit`` of them, how many there are). Listed once per (table, since) and paged."""
        with self.lock:
            o = self._get_out(move_id, "copying", "frozen")
            key = (table, since)
            listed = o.listed.get(key)
        if listed is None or offset == 0:
            t = self._table(table)
            with t.lock:
                listed = moves.ids_in(t, o.move.selection(t), None if since < 0 else since)
            with self.lock:
                o.listed[key] = listed
        return listed[offset:offset + limit], int(listed.shape[0])

    def out_rows(self, move_id: str, table: str, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Everything the rows of ``ids`` hold (those still present)."""
        with self.lock:
            o = self._get_out(move_id, "copying", "frozen")
        t = self._table(table)
        if not o.move.selection(t).of(t, ids).all():
            raise InvalidArgument(f"migration {move_id}: ids outside its slots requested")
        with t.lock:
            return moves.read_state(t, ids)

    def out_handover(self, move_id: str) -> tuple[int, dict]:
        """Hold writes to the move's slots (reads go on) and make every change before durable: the version the
        handover starts at (rows changed after the copy's start and up to it are read again), and this shard's
        records of applied pushes (its own and those it received), taken once every write to the slots is done,
        for the target (``in_prepare``)."""
        with self.shard.checkpointer.lock, self.lock:  # never inside a cluster-wide cut
            o = self._get_out(move_id, "copying", "frozen")
            if o.state == "frozen":
                return self.shard.version, self.shard.updates.elsewhere.to_json()
            self._check_gate("the handover")
            slots = self.slots
            with slots.cv:
                slots.frozen[o.move.slots] = True
                slots.frozen_dense.update(o.move.dense)
                slots.guarded = True
            for t in self.shard.registry.tables():  # a write past its checks applies before this returns
                with t.lock:
                    pass
            o.state = "frozen"
            o.timer = threading.Timer(self.hold_s, self._expire, (move_id,))
            o.timer.daemon = True
            o.timer.start()
        self._log({"op": "handover", "id": move_id})  # fsyncs every change before it
        return self.shard.version, self.shard.updates.elsewhere.to_json()

    def _expire(self, move_id: str) -> None:
        """A handover nobody committed within ``hold_s``: given up, the writes it held go on here."""
        try:
            self.out_abort(move_id, "it was not committed within "
                           f"{self.hold_s:.0f} s (the driving command stopped?)")
        except InvalidArgument:
            pass

    def _unfreeze(self, move: Move) -> None:
        slots = self.slots
        with slots.cv:
            slots.frozen[move.slots] = False
            slots.frozen_dense.difference_update(move.dense)
            slots.cv.notify_all()

    def out_commit(self, move_id: str) -> None:
        """Give the slots to the target (the durable commit point); their rows are dropped here.

        Once the commit record is in the log the move only goes forward. The commit is made here as it is logged
        (``_log``): if waiting for the record to be durable (an fsync, a replica group's quorum) fails, the step
        fails, the slots are given already, and a repeated ``out_commit`` (the driver's retry, ``--resume``) answers
        once the log is acknowledged; ``status`` says "committed" only then. If logging it failed (the member was
        deposed first), the move stays "committing" (writes to its slots still held) and is never given up: a repeat
        logs it again (replay applies the first of two records and skips the second)."""
        with self.lock:
            done = self.finished.get(move_id) == "committed"
            if not done:
                self._check_gate("the commit")
                o = self._get_out(move_id, "frozen", "committing")
                if o.timer is not None:
                    o.timer.cancel()
                o.state = "committing"

                def commit() -> None:
                    self.apply_out(o.move)
                    del self.out[move_id]
                    self._finish(move_id, "committed")
                self._log({"op": "out", "move": o.move.to_json()}, then=commit)
        if done:
            return self._settled()
        log.info("shard %d: migration %s committed: %d slots are shard %d's (slot map epoch %d)", self.shard.index,
                 move_id, o.move.slots.size, o.move.target, o.move.epoch)

    def apply_out(self, move: Move) -> None:
        """The committed handover (its logged commit made, live or replayed): the new map, the slots' rows dropped
        (a new version each table, as a replay makes them: no waits)."""
        slots = self.slots
        with slots.cv:
            slots.guarded = True
            slots.set_map(move.new_map)
        for t in self.shard.registry.tables():
            def drop(stamp: int, t: Table = t) -> None:
                moves.drop(t, moves.ids_in(t, move.selection(t)), stamp)
            self.shard.updates.write(t, drop, replaying=True)
        self._unfreeze(move)

    def out_abort(self, move_id: str, why: str = "the driver gave it up") -> None:
        """Give a handover up before it committed: the slots stay here and their held writes go on."""
        with self.lock:
            if self.finished.get(move_id) == "aborted":
                return
            if self._never_begun(self.out, move_id):
                return
            o = self._get_out(move_id, "copying", "frozen")  # a move "committing" only goes forward
            if o.timer is not None:
                o.timer.cancel()
            self._unfreeze(o.move)
            del self.out[move_id]
            self._finish(move_id, "aborted")
        log.warning("shard %d: migration %s given up: %s", self.shard.index, move_id, why)

