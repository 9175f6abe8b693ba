"""Slot migrations, one shard's side: handing slots over (the source) and taking them in (the target).

A migration (``Move``) takes a batch of hash slots (and dense row chunks) from one shard to another, while
both keep serving. ``shardps reshard`` drives it (``shardps.server.ops.resharding``), in this order:

1. ``out_begin`` on the source: the move is checked against its map; the shard version now is the copy's start.
2. ``in_begin`` on the target, then every row of the slots read from the source (``out_ids``, ``out_rows``) and
   written on the target (``in_rows``, logged there): the source keeps serving meanwhile.
3. ``out_handover`` on the source: writes to the slots wait from now on (reads go on), every change before is
   made durable, and the rows changed since the copy began are read again and written on the target, and the
   ones gone since removed there (``in_drop``). It answers with the source's records of applied pushes, its
   own and those it received with slots before.
4. ``in_prepare`` on the target (durable): it holds everything, those records too; requests for the slots wait
   there.
5. ``out_commit`` on the source: a durable record gives the slots to the target, the source drops their rows and
   answers requests for them with ``Moved``. This record is the move's one commit point.
6. ``in_activate`` on the target (durable): it owns the slots and serves them.

A crash before (5) loses nothing: the source still owns the slots (its handover is given up: by ``out_abort``,
after ``hold_s``, or by the crash itself) and the target drops what it received (``in_abort``, or once it learns
the source did not commit). A crash after (5) loses nothing either: the target holds every row durably, and
activates once the driver (``--resume``) or its own question to the source (``rpc.migrations``) finds the commit.
A push the source applied before the handover and resends after it is found by the source's exactly-once record
(checked before ownership), so it never applies twice; one refused with ``Moved`` was not applied, and the
client sends it again under its new map. One the source applied but whose answer never reached its client (the
source left the cluster first) is planned again by the client naming the source and its seq there
(``PushRequest.origins``); the new owner finds it in the source's records it received, and answers it as a
duplicate.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec
from shardps.server.shard.arrival import Arrivals, _In
from shardps.server.shard.handover import Handovers, _Out
from shardps.server.shard.move import Move
from shardps.server.shard.move_base import MoveBase
from shardps.server.storage import moves

__all__ = ["Migrations", "Move"]


class Migrations(Handovers, Arrivals):
    """The migrations of one shard (see the module docstring); ``hold_s``: longest a handover holds writes."""

    def __init__(self, shard: Any, hold_s: float = 30.0) -> None:
        MoveBase.__init__(self, shard, hold_s)
        self.out: dict[str, _Out] = {}
        self.into: dict[str, _In] = {}

    # ---- what others ask ------------------------------------------------------------------

    def status(self, move_id: str) -> str:
        """How ``move_id`` stands here, as the acknowledged log has it: a step whose wait failed made its change
        already (``_log``), so the answer waits until every record logged so far is acknowledged (a source's
        "committed" before its commit reached a quorum would let the target activate, and the backup that takes
        over from a dying source primary would own the slots too)."""
        self._settled()
        with self.lock:
            if move_id in self.out:
                return self.out[move_id].state
            if move_id in self.into:
                return self.into[move_id].state
            return self.finished.get(move_id, "unknown")

    def handing_over(self) -> str:
        """The id of a move handing over here (frozen on the source, prepared on the target), else ""."""
        with self.lock:
            return next((k for k, o in self.out.items() if o.state in ("frozen", "committing")),
                        next((k for k, i in self.into.items() if i.state == "prepared"), ""))

    def pending(self) -> list[Move]:
        """Moves prepared here and not yet activated (a target waiting for its source's outcome)."""
        with self.lock:
            return [i.move for i in self.into.values() if i.state == "prepared"]

    def in_flight(self) -> list[dict[str, Any]]:
        """Every move in flight here, for ``shardps stats``."""
        with self.lock:
            return ([{"id": k, "role": "source", "state": o.state, "peer": o.move.target, "slots": int(o.move.slots.size),
                      "epoch": o.move.epoch} for k, o in self.out.items()]
                    + [{"id": k, "role": "target", "state": i.state, "peer": i.move.source,
                        "slots": int(i.move.slots.size), "epoch": i.move.epoch} for k, i in self.into.items()])

    # ---- the map outside migrations ---------------------------------------------------------------

    def install(self, new: SlotMap) -> None:
        """The driver's broadcast of a map (a move elsewhere committed): adopted if it changes nothing here."""
        self.shard.check.writable("installing a slot map")
        with self.lock:
            cur = self.slots.map
            done = new == cur or (new.epoch == cur.epoch and new.key() == cur.key() and new.addresses == cur.addresses)
            if not done:
                dense = [t.spec for t in self.shard.registry.tables() if isinstance(t.spec, DenseSpec)]
                self.slots.check_install(new, dense)
                self._log({"op": "install", "map": new.to_json()}, then=lambda: self.slots.set_map(new))
                return
        self._settled()

    def announce(self, epoch: int) -> None:
        """A move to ``epoch`` is about to commit elsewhere: requests naming it are accepted from now on."""
        with self.lock:
            if epoch > self.slots.accept_epoch:
                self._log({"op": "announce", "epoch": int(epoch)}, durable=False,
                          then=lambda: self.slots.announce(epoch))

    # ---- replay and checkpoints -------------------------------------------------------------------

    def replay(self, change: dict[str, Any]) -> None:
        """A logged slot change, re-applied (a restart's replay, a backup following its primary)."""
        op = change["op"]
        if op == "install":
            self.slots.set_map(SlotMap.from_json(change["map"]))
        elif op == "announce":
            self.slots.announce(int(change["epoch"]))
        elif op == "out":
            move = Move.from_json(change["move"])
            if self.finished.get(move.id) != "committed":  # a commit logged twice (its first wait failed) applies once
                self.apply_out(move)
            self.out.pop(move.id, None)
            self._finish(move.id, "committed")
        elif op == "in_begin":
            move = Move.from_json(change["move"])
            self.into.setdefault(move.id, _In(move))
        elif op == "prepared":
            self.shard.updates.elsewhere.merge(change.get("applied", {}))
            i = self.into.get(change["id"])
            if i is not None:
                i.state = "prepared"
                self._arriving(i.move, True)
        elif op == "in":
            i = self.into.get(change["id"])
            if i is not None:
                self.apply_in(i.move)
        elif op == "in_abort":
            i = self.into.get(change["id"])
            if i is not None:
                self.apply_in_abort(i.move)
        elif op == "in_drop":
            t = self._table(change["table"])
            ids = np.asarray(change["ids"], np.int64)
            self.shard.updates.write(t, lambda stamp: moves.drop(t, ids, stamp), replaying=True)
        elif op != "handover":
            raise ValueError(f"unknown slot map change {op!r}")

    def to_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps: the map, the accepted epoch, moves arriving here, recent outcomes."""
        with self.lock:
            return {"map": self.slots.map.to_json(), "accept_epoch": self.slots.accept_epoch,
                    "into": [{"move": i.move.to_json(), "state": i.state} for i in self.into.values()],
                    "finished": dict(self.finished)}

    def load_meta(self, meta: Optional[dict[str, Any]]) -> None:
        """A snapshot's slot state as this shard's: its map and its moves, in place of every move this shard had in
        flight (a whole copy from a new primary replaces a deposed one's state, the arrivals and handovers it had
        begun included: their marks would hold requests for those slots with nothing left to settle them)."""
        with self.lock:
            self._forget_in_flight()
            if not meta:
                return
            self.slots.set_map(SlotMap.from_json(meta["map"]))
            self.slots.announce(int(meta.get("accept_epoch", 0)))
            for entry in meta.get("into", []):
                move = Move.from_json(entry["move"])
                self.into[move.id] = _In(move, entry["state"])
                if entry["state"] == "prepared":
                    self._arriving(move, True)
            self.finished = {str(k): str(v) for k, v in meta.get("finished", {}).items()}

    def _forget_in_flight(self) -> None:
        for o in self.out.values():
            if o.timer is not None:
                o.timer.cancel()
        self.out, self.into = {}, {}
        slots = self.slots
        with slots.cv:
            slots.frozen[:] = False
            slots.arriving[:] = False
            slots.frozen_dense.clear()
            slots.arriving_dense.clear()
            slots.cv.notify_all()


