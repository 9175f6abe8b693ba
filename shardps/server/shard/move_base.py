"""What both sides of a shard's slot migrations share: the shard, its slot ownership, the lock, the outcomes of
finished moves, and the helpers that log a change and find a table."""

from __future__ import annotations

import threading
from typing import Any, Callable

from shardps.core.errors import InvalidArgument, NotFound, Unavailable
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

    def _log(self, change: dict[str, Any], durable: bool = True, then: Callable[[], object] = lambda: None) -> None:
        """Log ``change``, make it (``then``), and wait for its record to be acknowledged (fsynced with ``durable``;
        under ``--ack quorum``, in a majority's logs).

        The change is made before the wait, so this shard's state holds every change its log holds, acknowledged or
        not. A step whose wait fails (a quorum that did not come, a member deposed meanwhile) is answered with the
        error, and its change stays made: the record is in the log, and replicas that received it make it too. A
        member that steps down follows its new primary from where its log ends; were the change missing from its
        state, nothing would make it (the campaign's reshard scenario: a deposed primary that had logged a move's
        activation, its quorum lost, never made it, and then waited at every push of its new primary's to the
        move's slots). ``then`` must not wait or fail: a write in it is made as a replay makes it. A repeat of the
        step finds the change made, and answers once the log is acknowledged (``_settled``)."""
        d = self.shard.durability
        ticket = d.append(durability.record_slots(change)) if d.wants_schema else 0
        then()
        d.wait(ticket, durable=durable)

    def _settled(self) -> None:
        """A repeated step whose change is made already: answered as the first would have been, once every record
        logged so far is acknowledged."""
        self.shard.durability.wait_all()

    def _check_gate(self, what: str) -> None:
        """Refuse (retry) a step that writes rows while a cluster-wide checkpoint or export is being cut."""
        if not self.shard.gate.is_open:
            raise Unavailable(f"shard {self.shard.index}: a checkpoint or export is being cut; retry {what}")

    def _get(self, moves: dict[str, Any], side: str, move_id: str, states: tuple[str, ...]) -> Any:
        """The move ``move_id`` in flight here as ``side`` ("source": in ``moves`` = ``out``, "target": ``into``),
        in one of ``states`` (any, when none are named); else refused, naming the state it is in."""
        m = moves.get(move_id)
        if m is None or (states and m.state not in states):
            raise InvalidArgument(f"migration {move_id} is {m.state if m else self.finished.get(move_id, 'unknown')} "
                                  f"on {side} shard {self.shard.index}, not {' or '.join(states) or 'in flight'}")
        return m

    def _never_begun(self, moves: dict[str, Any], move_id: str) -> bool:
        """An abort of a move this shard never began (the driver stopped before its begin arrived, or a restart
        forgot it before it settled): nothing to undo. Remembered as aborted, so a late begin of it is refused."""
        if move_id in moves or move_id in self.finished:
            return False
        self._finish(move_id, "aborted")
        return True

    def _finish(self, move_id: str, outcome: str) -> None:
        self.finished[move_id] = outcome
        while len(self.finished) > FINISHED_KEPT:
            del self.finished[next(iter(self.finished))]

