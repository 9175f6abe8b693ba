"""The records a replica group ships: ``ReplicatedLog`` wraps a shard's durability and numbers every record it
stores (its log sequence number, LSN), stamps it with the epoch of the primary that wrote it, keeps the recent ones
for backups to read, and holds a push's acknowledgement until a quorum of the group has the record (``--ack
quorum``).

Every member of a group counts the same records the same way: the primary counts what it appends, a backup what it
receives (appended to its own log, then applied through the replay path: ``Shard`` never tells them apart), and a
restart resumes the count from the checkpoint's LSN plus the records replayed after it. So an LSN names one record
on every member, and the epoch history (which epoch wrote from which LSN on) tells whether two members' logs agree
up to a point: how a rejoining member knows whether it can catch up from the log or needs a whole copy.

Fencing is the replica layer's (``shardps.server.replica``): it gives this log the epoch to write with, and a
``fence`` called before a write is acknowledged; a backup that has seen a newer epoch refuses records of an older
one, so a deposed primary cannot gather a quorum.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pathlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Union

from shardps.core.errors import InvalidArgument, NotPrimary, Unavailable
from shardps.core.files import fsync_dir
from shardps.server.durability import wal
from shardps.server.durability.modes import CheckpointDurability, NoDurability, Record

ACKS = ("primary", "quorum")


@dataclass(frozen=True)
class Shipped:
    """One record as the group ships it."""

    lsn: int
    epoch: int
    kind: int
    payload: bytes


class Diverged(Exception):
    """A member's log does not agree with the primary's at its end: it needs a whole copy."""


class Backlog:
    """The recent records a primary keeps for backups that fall behind, about ``keep_bytes`` of them (callers lock)."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = keep_bytes
        self._records: collections.deque[Shipped] = collections.deque()
        self._bytes = 0

    def add(self, shipped: Shipped) -> None:
        self._records.append(shipped)
        self._bytes += len(shipped.payload) + 64
        while self._bytes > self.keep_bytes and len(self._records) > 1:
            self._bytes -= len(self._records.popleft().payload) + 64

    def clear(self) -> None:
        self._records.clear()
        self._bytes = 0

    def since(self, after: int, max_records: int, max_bytes: int) -> Optional[list[Shipped]]:
        """The records after LSN ``after``, at most ``max_records`` and about ``max_bytes`` (at least one); None when
        the first of them is no longer kept."""
        if not self._records or self._records[0].lsn > after + 1:
            return None
        start = after + 1 - self._records[0].lsn
        out: list[Shipped] = []
        size = 0
        for i in range(start, min(len(self._records), start + max_records)):
            rec = self._records[i]
            if out and size + len(rec.payload) > max_bytes:
                break
            out.append(rec)
            size += len(rec.payload)
        return out


class ReplicatedLog:
    """A ``Durability`` (the modes' protocol) over ``inner`` that numbers, stamps, keeps and waits for records.

    Args:
        inner: the shard's own durability (its log, or none).
        group: members of the replica group (this one included).
        ack: "primary" (a write is acknowledged once this member has it) or "quorum" (once a majority of the group
            has it in its log).
        keep_bytes: the recent records kept for backups that fall behind; one further behind gets a whole copy.
        quorum_timeout_s: how long a write waits for a quorum before it is refused (not acknowledged).
        before_wait: called before a write waits for the quorum (the scheduler lets the next call in).
        epochs_path: where the epoch history is kept (fsynced at each new epoch; None: in memory only).
    """

    wants_records = True
    wants_schema = True

    def __init__(self, inner: Union[NoDurability, CheckpointDurability], group: int, ack: str = "quorum",
                 keep_bytes: int = 64 << 20, quorum_timeout_s: float = 10.0,
                 before_wait: Callable[[], None] = lambda: None, epochs_path: Optional[pathlib.Path] = None) -> None:
        if ack not in ACKS:
            raise ValueError(f"ack must be one of {ACKS}, got {ack!r}")
        if group < 1:
            raise ValueError(f"a replica group has at least 1 member, got {group}")
        self.inner = inner
        self.mode = inner.mode
        self.group = group
        self.ack = ack
        self.keep_bytes = keep_bytes
        self.quorum_timeout_s = quorum_timeout_s
        self.before_wait = before_wait
        self.lsn = 0  # records stored so far (restore sets it: the checkpoint's, plus those replayed)
        self.epoch = 0  # the epoch this member writes with (the replica layer sets it)
        self.history: list[tuple[int, int]] = []  # (epoch, first lsn written in it), ascending
        self.fence: Callable[[], None] = lambda: None  # raises when this member may not acknowledge a write
        self.originates = True  # False on a backup: it stores only what its primary ships, never records of its own
        self.applying: Callable[[], bool] = lambda: False  # True in a thread applying the primary's records here
        self.epochs_path = epochs_path
        self._open = False
        self._cv = threading.Condition()
        self._kept = Backlog(keep_bytes)
        self._tickets: dict[int, int] = {}  # lsn -> the inner durability's ticket
        self._acks: dict[str, int] = {}  # backup -> the lsn it has in its log
        self._originating = 0  # changes and records of this member's own (as primary) under way (a slow disk's)
        self._origin = threading.local()  # .depth: this thread is inside ``origin()``

    # ---- the Durability protocol -------------------------------------------------------------

    def open(self) -> None:
        self.inner.open()
        self._open = True

    @contextlib.contextmanager
    def origin(self) -> Iterator[None]:
        """Around a change of this member's own (a push, a migration's rows: applied, then its record appended):
        NotPrimary unless this member is the primary now, when the change has not been applied. A request that
        passed the primary's check at its start may have waited (for arriving slots, a checkpoint) while the member
        stepped down: it is refused here instead of being applied and answered with no record behind it (a
        backup's ``append`` stored nothing and its wait checked nothing: the campaign's reshard scenario found such
        a push acknowledged and lost). Inside, the record is appended even if the member steps down meanwhile
        (numbered: the divergence a whole copy repairs; its wait's fence refuses the acknowledgement), and the
        member follows no other primary until it is in (``originating``)."""
        if self.applying():  # a backup applying what its primary shipped: the primary's change
            yield
            return
        with self._cv:
            if self._open and not self.originates:
                raise NotPrimary("this member stepped down while the request waited: not applied; retry on the "
                                 "primary")
            self._originating += 1
        self._origin.depth = getattr(self._origin, "depth", 0) + 1
        try:
            yield
        finally:
            self._origin.depth -= 1
            with self._cv:
                self._originating -= 1
                self._cv.notify_all()

    def append(self, record: Record) -> int:
        """Store a record (callers hold the lock that orders it): in the inner log, numbered, kept for backups. During
        restore (before ``open``) nothing is stored or counted: restore counts what it replays. NotPrimary on a
        member that is not the primary, unless inside ``origin`` (the change it records is applied already)."""
        if not self._open or not record[0]:
            return 0
        with self._cv:
            if not self.originates and not getattr(self._origin, "depth", 0):
                if self.applying():  # a backup applying what its primary shipped: the primary's record, stored
                    return 0
                raise NotPrimary("this member is not the primary: it records nothing of its own; retry on the "
                                 "primary")
            self._originating += 1
        try:
            ticket = self.inner.append(record)
        finally:
            with self._cv:
                self._originating -= 1
                self._cv.notify_all()
        with self._cv:  # numbered even if this member stepped down meanwhile: its log holds it (a divergence)
            self.lsn += 1
            self._kept.add(Shipped(self.lsn, self.epoch, record[0], bytes(record[1])))
            if ticket:
                self._tickets[self.lsn] = ticket
            self._cv.notify_all()
            return self.lsn

    def originating(self) -> int:
        """Records of this member's own still being stored (it was primary; its disk is slow): until they are in its
        log and numbered, it neither follows another primary nor stands in an election, or its log would hold them
        unnumbered beside the new primary's (the same pushes applied twice, unseen)."""
        with self._cv:
            return self._originating

    def wait(self, ticket: int, durable: bool = False) -> None:
        """Return once the record of ``ticket`` is acknowledged: in this member's log (by its fsync policy) and, with
        ``ack="quorum"``, in the logs of a majority of the group; then the fence (a deposed primary refuses)."""
        if not ticket:
            return
        with self._cv:
            inner = self._tickets.pop(ticket, 0)
        self.inner.wait(inner, durable)
        if self.ack == "quorum" and self.group > 1:
            self._wait_quorum(ticket)
        self.fence()

    def wait_all(self) -> None:
        """Every record numbered so far acknowledged: in this member's log and, with ``ack="quorum"``, a majority's."""
        with self._cv:
            lsn = self.lsn
        self.inner.wait_all()
        if lsn and self.ack == "quorum" and self.group > 1:
            self._wait_quorum(lsn)
        self.fence()

    def _wait_quorum(self, lsn: int) -> None:
        need = self.group // 2  # backups beside this member
        deadline = time.monotonic() + self.quorum_timeout_s
        with self._cv:
            if sum(1 for a in self._acks.values() if a >= lsn) >= need:
                return
        self.before_wait()
        with self._cv:
            while sum(1 for a in self._acks.values() if a >= lsn) < need:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Unavailable(f"record {lsn} reached {sum(1 for a in self._acks.values() if a >= lsn)} of the "
                                      f"{need} backups a quorum of {self.group} needs within {self.quorum_timeout_s:g} s: "
                                      "not acknowledged (it may be applied once a quorum is back; the client retries)")
                self._cv.wait(min(left, 0.5))

    def log_bytes(self) -> int:
        return self.inner.log_bytes()

    def cut(self) -> int:
        return self.inner.cut()

    def checkpointed(self, previous_cut: int) -> None:
        self.inner.checkpointed(previous_cut)

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        return self.inner.records(after_cut)

    def close(self) -> None:
        with self._cv:
            self._open = False
            self._cv.notify_all()
        self.inner.close()

    def disk_stalled_s(self) -> float:
        return self.inner.disk_stalled_s()

    def disk_error(self) -> Optional[BaseException]:
        return self.inner.disk_error()

    # ---- what the group needs ----------------------------------------------------------------

    def restored(self, lsn: int, history: list[tuple[int, int]]) -> None:
        """Restore read records up to ``lsn``, written in the epochs of ``history`` (those beginning past it are
        left out: records this member never stored)."""
        with self._cv:
            self.lsn = lsn
            self.history = sorted({(int(e), int(s)) for e, s in history if int(s) <= lsn + 1})
            self.epoch = self.history[-1][0] if self.history else 0
            self._kept.clear()
            self._save_epochs()

    def begin_epoch(self, epoch: int) -> None:
        """This member writes from the next record on in ``epoch`` (it became primary, or follows one that did)."""
        with self._cv:
            if self.history and epoch < self.history[-1][0]:
                raise InvalidArgument(f"epoch {epoch} is older than this member's {self.history[-1][0]}")
            if not self.history or self.history[-1][0] != epoch:
                self.history.append((epoch, self.lsn + 1))
                self._save_epochs()
            self.epoch = epoch
            self._acks.clear()

    def _save_epochs(self) -> None:
        """The epoch history on disk (atomically, fsynced): a restart knows which epoch wrote which records."""
        if self.epochs_path is None:
            return
        tmp = self.epochs_path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump(self.history, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.epochs_path)
        fsync_dir(self.epochs_path.parent)

    def saved_epochs(self) -> list[tuple[int, int]]:
        """The epoch history kept on disk (empty: none)."""
        if self.epochs_path is None or not self.epochs_path.exists():
            return []
        return [(int(e), int(s)) for e, s in json.loads(self.epochs_path.read_text())]

    def last_epoch(self) -> int:
        """The epoch of the last record stored (0: none)."""
        with self._cv:
            return self._epoch_of(self.lsn)

    def _epoch_of(self, lsn: int) -> int:
        epoch = 0
        for e, start in self.history:
            if start <= lsn:
                epoch = e
        return epoch

    def end_of(self, epoch: int) -> int:
        """The last LSN this member has of ``epoch`` (its log agrees with a member whose last record is of ``epoch``
        up to there)."""
        with self._cv:
            later = [start for e, start in self.history if e > epoch]
            return (min(later) - 1) if later else self.lsn

    def check_follower(self, lsn: int, epoch: int) -> None:
        """Raise ``Diverged`` unless a member whose last record is ``lsn`` of ``epoch`` holds a prefix of this log."""
        if lsn > self.lsn or lsn > self.end_of(epoch) or (lsn and epoch not in {e for e, _ in self.history}):
            raise Diverged(f"a log ending at record {lsn} of epoch {epoch} is not a prefix of this one "
                           f"(record {self.lsn}, epochs {self.history})")

    def ack_from(self, member: str, lsn: int) -> None:
        """Backup ``member`` has the records up to ``lsn`` in its log."""
        with self._cv:
            if lsn > self._acks.get(member, 0):
                self._acks[member] = lsn
                self._cv.notify_all()

    def forget(self, member: str) -> None:
        with self._cv:
            self._acks.pop(member, None)

    def acked(self) -> dict[str, int]:
        with self._cv:
            return dict(self._acks)

    def read(self, after: int, max_records: int = 256, timeout: float = 0.5,
             max_bytes: int = 8 << 20) -> Optional[list[Shipped]]:
        """The kept records after LSN ``after`` (waiting up to ``timeout`` for one), at most ``max_records`` and about
        ``max_bytes`` (at least one); None when they are no longer kept (the reader needs a whole copy)."""
        with self._cv:
            if after >= self.lsn:
                self._cv.wait_for(lambda: self.lsn > after or not self._open, timeout)
            if after >= self.lsn:
                return []
            return self._kept.since(after, max_records, max_bytes)

    def store(self, shipped: Shipped) -> int:
        """A backup stores a record the primary shipped (the next LSN; of its last epoch or a later one, which begins
        there); a ticket to wait on."""
        with self._cv:
            if self._originating:
                raise Unavailable(f"record {shipped.lsn}: this member is still storing {self._originating} record(s) "
                                  "of its own (it was the primary): it follows once they are in its log")
            if shipped.lsn != self.lsn + 1:
                raise Diverged(f"record {shipped.lsn} does not follow this member's {self.lsn}")
            last = self.history[-1][0] if self.history else 0
            if shipped.epoch < last:
                raise InvalidArgument(f"record {shipped.lsn} of epoch {shipped.epoch} is older than this member's "
                                      f"epoch {last}")
            if shipped.epoch > last:
                self.history.append((shipped.epoch, shipped.lsn))
                self.epoch = shipped.epoch
                self._save_epochs()
        ticket = self.inner.append((shipped.kind, shipped.payload))
        with self._cv:
            self.lsn = shipped.lsn
            self._kept.add(shipped)
            self._cv.notify_all()
        return ticket

    def wait_stored(self, ticket: int, durable: bool = False) -> None:
        """A backup's stored record is in its log, by its fsync policy (``durable``: fsynced)."""
        if ticket:
            self.inner.wait(ticket, durable)
