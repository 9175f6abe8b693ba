"""The one path every update of a shard takes: live pushes, synchronous steps and log replay.

``UpdatePath`` owns what an update changes besides the rows: the shard's version
counter, the exactly-once records (``SeenPushes``) and the counters (``Stats``).
``apply`` takes the table lock, waits out a prepared checkpoint (``CheckpointGate``),
measures staleness and applies the table's optimizer, bumps the version and
appends the record to the shard's ``Durability``; replay calls the same ``apply``
with the staleness the log recorded.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Optional

import numpy as np

from shardps.core.errors import StaleUpdate, SyncStepFailed, Unavailable
from shardps.core.ids import coalesce
from shardps.server.durability.gate import CheckpointGate
from shardps.server.durability.modes import Durability, Record, record_evict, with_staleness
from shardps.server.shard.metrics import NO_METRICS, NullMetrics
from shardps.server.shard.slots import SlotOwnership
from shardps.server.storage.bounded import CAUSE_CAPACITY, CAUSE_TTL
from shardps.server.storage.table import Table, now_ticks


class SeenPushes:
    """Remembers which (client id, sequence number) pushes were applied.

    Per client: every seq <= ``low`` and every seq in ``above`` was claimed (``begin``). A claim stays *in flight*
    until the push is applied (``settle``, under its table's lock) or fails (``abort``): a copy of the state
    (``to_json``, a checkpoint's) leaves in-flight claims out, so a push held back by the checkpoint and lost in a
    crash before it applied is applied when its client resends it. Gaps (pushes that failed) are forgotten once
    more than ``max_pending`` seqs wait above them; the ``max_clients`` least recently seen clients are dropped.
    """

    def __init__(self, max_clients: int = 10_000, max_pending: int = 65_536, wait_s: float = 30.0) -> None:
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an in-flight claim was settled or aborted
        self._wait_s = wait_s  # longest a resend waits for its original, still in flight, to be applied or fail
        self._clients: dict[str, tuple[int, set[int]]] = {}
        self._in_flight: dict[str, set[int]] = {}
        self._max_clients = max_clients
        self._max_pending = max_pending

    def begin(self, client: str, seq: int) -> bool:
        """Mark (client, seq) as applied; False if it already was (a duplicate). A resend of a claim still in
        flight waits for it first: a duplicate once it is applied, claimed again if it failed."""
        with self._lock:
            self._wait_in_flight(client, seq)
            low, above = self._clients.pop(client, (0, set()))
            self._clients[client] = (low, above)  # most recently used last
            if seq <= low or seq in above:
                return False
            above.add(seq)
            self._in_flight.setdefault(client, set()).add(seq)
            self._keep(client, low, above)
            return True

    def _keep(self, client: str, low: int, above: set[int]) -> None:
        """Store a client's applied seqs (the lock held) as its most recently seen: seqs right above ``low`` folded
        into it, at most ``max_pending`` above it (the lower half of more folded in), and the least recently seen
        clients dropped beyond ``max_clients``."""
        while low + 1 in above:
            low += 1
            above.discard(low)
        if len(above) > self._max_pending:
            low = sorted(above)[len(above) // 2]
            above = {s for s in above if s > low}
        self._clients.pop(client, None)
        self._clients[client] = (low, above)
        while len(self._clients) > self._max_clients:
            gone = next(iter(self._clients))
            del self._clients[gone]
            if self._in_flight.pop(gone, None):
                self._settled.notify_all()

    def contains(self, client: str, seq: int) -> bool:
        """Whether (client, seq) was applied. A claim still in flight (its push waits at a handover or for a sync
        step, say) is waited for: answering its resend as a duplicate before the push applied would lose it
        should the push then fail (its rows moved on)."""
        with self._lock:
            self._wait_in_flight(client, seq)
            entry = self._clients.get(client)
            return entry is not None and (seq <= entry[0] or seq in entry[1])

    def _wait_in_flight(self, client: str, seq: int) -> None:
        """Wait (the lock held) until (client, seq) is not in flight; Unavailable after ``wait_s``."""
        deadline = None
        while seq in self._in_flight.get(client, ()):
            deadline = deadline or time.monotonic() + self._wait_s
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"push {seq} of client {client} is still being applied after {self._wait_s:g} s; "
                                  "retry it")
            self._settled.wait(left)

    def settle(self, client: str, seq: int) -> None:
        """The claimed push was applied (callers hold the lock of the table it changed)."""
        with self._lock:
            self._done(client, seq)

    def _done(self, client: str, seq: int) -> None:
        flying = self._in_flight.get(client)
        if flying is not None:
            flying.discard(seq)
            if not flying:
                del self._in_flight[client]
            self._settled.notify_all()

    def abort(self, client: str, seq: int) -> None:
        """Forget a seq whose push failed, so a retry is applied. A claim already folded into ``low`` (every seq
        below it claimed too) reopens its gap: ``low`` goes below it and the claims above stay (unless more than
        ``max_pending`` would then wait above it: the gap is forgotten, as other old gaps are). A claim settled
        already stays: its push was applied (what failed came after, a wait for its record's acknowledgement), so
        its resend must be answered as a duplicate, not applied again."""
        with self._lock:
            if seq not in self._in_flight.get(client, ()):
                return
            self._done(client, seq)
            entry = self._clients.get(client)
            if entry is None:
                return
            low, above = entry
            if seq in above:
                above.discard(seq)
            elif 0 < seq <= low and low - seq + len(above) <= self._max_pending:
                above.update(range(seq + 1, low + 1))
                self._clients[client] = (seq - 1, above)

    def to_json(self) -> dict[str, list]:
        """The applied pushes (claims in flight left out), as ``load_json`` reads them."""
        with self._lock:
            out = {}
            for c, (low, above) in self._clients.items():
                flying = self._in_flight.get(c)
                if flying:
                    new_low = min(low, min(flying) - 1)
                    out[c] = [new_low, sorted((set(range(new_low + 1, low + 1)) | above) - flying)]
                else:
                    out[c] = [low, sorted(above)]
            return out

    def load_json(self, d: dict[str, list]) -> None:
        with self._lock:
            self._clients = {c: (int(v[0]), set(int(s) for s in v[1])) for c, v in d.items()}
            self._in_flight = {}

    def merge_json(self, d: dict[str, list]) -> None:
        """Add the applied pushes of ``d`` (``to_json``'s form) to these: per client, the union of both."""
        with self._lock:
            for c, v in d.items():
                low, above = int(v[0]), {int(s) for s in v[1]}
                old_low, old_above = self._clients.get(c, (0, set()))
                new_low = max(low, old_low)
                self._keep(c, new_low, {s for s in above | old_above if s > new_low})


class PushesAppliedElsewhere:
    """Other shards' records of applied pushes, received with the slots they handed over (``in_prepare``), by
    shard index; with this shard's own (``own``), what a handover gives the target in turn.

    A push the client planned again after a shard left the cluster without answering names that shard and the seq
    it had there (``PushRequest.origins``, one per such shard): if any of them applied it, its rows came here with
    the update in them, and the push is answered as a duplicate (docs/resharding.md#exactly-once-across-shards)."""

    def __init__(self, own: SeenPushes, index: int) -> None:
        self.own, self.index = own, index
        self._lock = threading.Lock()
        self._others: dict[int, SeenPushes] = {}

    def applied(self, client: str, origins: tuple[tuple[int, int], ...]) -> bool:
        """Whether one of the shards in ``origins`` applied the push (client, its seq there)."""
        for shard, seq in origins:
            with self._lock:
                records = self.own if shard == self.index else self._others.get(shard)
            if records is not None and records.contains(client, seq):
                return True
        return False

    def merge(self, records: dict[str, dict[str, list]]) -> None:
        """Records received with slots (``to_json``'s form); this shard's own index among them is skipped (its own
        records hold them already)."""
        for shard, seen in records.items():
            if int(shard) == self.index:
                continue
            with self._lock:
                mine = self._others.setdefault(int(shard), SeenPushes())
            mine.merge_json(seen)

    def others_json(self) -> dict[str, dict[str, list]]:
        """The records received from other shards (a checkpoint's)."""
        with self._lock:
            others = dict(self._others)
        return {str(k): v.to_json() for k, v in others.items()}

    def load_others(self, records: dict[str, dict[str, list]]) -> None:
        with self._lock:
            self._others = {}
        self.merge(records)

    def to_json(self) -> dict[str, dict[str, list]]:
        """Every record this shard holds, its own under its index: what a handover gives the target."""
        return {**self.others_json(), str(self.index): self.own.to_json()}


@dataclass
class Counters:
    """A copy of a shard's counters since start (see ShardStats in the proto)."""

    pulls: int = 0
    pushes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    stale_rejected: int = 0
    duplicates: int = 0
    max_staleness: int = 0
    staleness_sum: int = 0
    errors: int = 0

    @property
    def mean_staleness(self) -> float:
        return self.staleness_sum / self.pushes if self.pushes else 0.0


class Stats:
    """A shard's counters, each change under one lock that no caller sees."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._c = Counters()

    def pulled(self, rows: int) -> None:
        with self._lock:
            self._c.pulls += 1
            self._c.rows_pulled += rows

    def pushed(self, rows: int, staleness: int) -> None:
        with self._lock:
            self._c.pushes += 1
            self._c.rows_pushed += rows
            self._c.staleness_sum += staleness
            self._c.max_staleness = max(self._c.max_staleness, staleness)

    def count(self, name: str) -> None:
        """Add one to ``stale_rejected``, ``duplicates`` or ``errors``."""
        with self._lock:
            setattr(self._c, name, getattr(self._c, name) + 1)

    def snapshot(self) -> Counters:
        with self._lock:
            return Counters(**{f.name: getattr(self._c, f.name) for f in fields(Counters)})


@dataclass
class PushResult:
    version: int
    staleness: int
    duplicate: bool
    late: bool = False
    missing_ranks: list[int] = field(default_factory=list)


class UpdatePath:
    """Version, exactly-once records and counters, and ``apply``: the only code that changes rows."""

    def __init__(self, shard_index: int, durability: Durability, gate: CheckpointGate, gate_wait_s: float,
                 metrics: NullMetrics = NO_METRICS, before_wait: Callable[[], None] = lambda: None,
                 slots: Optional[SlotOwnership] = None) -> None:
        self.shard_index = shard_index
        self.slots = slots  # what the shard owns: a change re-checks it under the table's lock (``_turn``)
        self.metrics = metrics
        self.before_wait = before_wait  # called before a push waits (a checkpoint's hold): the scheduler's hook
        self.durability = durability
        self.gate = gate
        self.gate_wait_s = gate_wait_s
        self.version = 0
        self._vlock = threading.Lock()  # after Table.lock, before the durability's own
        self.seen = SeenPushes()
        self.elsewhere = PushesAppliedElsewhere(self.seen, shard_index)
        self.stats = Stats()

    def once(self, client_id: str, seq: int) -> bool:
        """Claim a push for application; False if it was applied before (the caller answers it as a duplicate)."""
        return not client_id or self.seen.begin(client_id, seq)

    def release(self, client_id: str, seq: int, error: BaseException) -> None:
        """A claimed push failed: a retry applies it, unless it was applied (settled: its record's wait failed) or
        its synchronous step is over (it would be late: the
        claim stays, no longer in flight)."""
        if client_id and not isinstance(error, SyncStepFailed):
            self.seen.abort(client_id, seq)
        elif client_id:
            self.seen.settle(client_id, seq)

    def apply(self, t: Table, ids: np.ndarray, grads: np.ndarray, pulled_version: Optional[int] = None,
              record: Record = (0, b""), replayed_staleness: Optional[int] = None,
              replayed_per_row: Optional[np.ndarray] = None, replayed_ticks: Optional[int] = None,
              claim: tuple[str, int] = ("", 0)) -> tuple[int, int]:
        """Apply one update; returns (version after it, staleness: the largest row's, with per-row staleness).

        Live updates pass ``pulled_version`` (staleness is measured against it and
        bounded by the table's ``max_staleness``) and their ``record``, which is
        appended for durability and waited on before returning, after the records of
        the evictions it caused, and their exactly-once ``claim`` (client id, seq), settled with the change.
        Replay passes the staleness the log recorded instead
        (and the per-row staleness and the time, if any), and no record; it evicts nothing by
        itself (the log holds the evictions). Tables with ``ttl_seconds`` log the time of each push,
        so a replayed row keeps its live last push time.
        """
        replaying = replayed_staleness is not None
        uniq, summed = coalesce(ids, grads) if ids.size else (ids, grads)
        with self._turn(t, replaying, "pushes", uniq):
            staleness, per_row = self._staleness(t, uniq, pulled_version, replayed_staleness, replayed_per_row)
            stamp = self._next_version()
            policy = t.spec.staleness
            scales = None  # lr_scale is arithmetic: it maps an array of staleness row by row
            if per_row is not None and per_row.size:
                scales = np.broadcast_to(policy.lr_scale(per_row.astype(np.float64)), per_row.shape)
            timed = t.eviction is not None and t.eviction.ttl_seconds is not None
            now = replayed_ticks if replaying and replayed_ticks is not None else now_ticks()
            done = t.apply(uniq, summed, policy.lr_scale(staleness), scales, stamp - 1, stamp,
                           evict=not replaying, now=now)
            version = self._advance()
            if claim[0]:
                self.seen.settle(*claim)
            name = t.spec.name
            if done.expired.size:
                self.durability.append(record_evict(name, done.expired, CAUSE_TTL))
            ticket = self.durability.append(with_staleness(record, staleness, per_row, now if timed else None)) \
                if record[0] else 0
            if done.over_capacity.size:
                ticket = self.durability.append(record_evict(name, done.over_capacity, CAUSE_CAPACITY)) or ticket
        self.durability.wait(ticket)
        if not replaying:
            self.stats.pushed(done.rows, staleness)
            self.metrics.pushed(t.spec.name, done.rows, t.dim * 4, staleness)
        return version, staleness

    def assign(self, t: Table, ids: np.ndarray, values: np.ndarray, record: Record = (0, b""),
               replaying: bool = False) -> int:
        """Set the rows of sorted unique ``ids`` to ``values``: a new version, like a push, logged (``record``)
        before the capacity evictions it causes (replay applies the logged ones instead). The version after."""
        with self._turn(t, replaying, "changes", ids):
            stamp = self._next_version()
            done = t.assign_rows(ids, values, stamp, now_ticks(), evict=not replaying)
            if t.history is not None:
                t.history.add(stamp, ids)
            version = self._advance()
            ticket = self.durability.append(record) if record[0] else 0
            if done.over_capacity.size:
                ticket = self.durability.append(record_evict(t.spec.name, done.over_capacity, CAUSE_CAPACITY)) or ticket
        self.durability.wait(ticket)
        return version

    def write(self, t: Table, change: Callable[[int], object], record: Record = (0, b""), replaying: bool = False,
              durable: bool = False) -> int:
        """A change that is neither a push nor an assignment (rows a migration moves in or out): ``change(stamp)``
        under the table's lock (a checkpoint's hold waited out first, no slot checks), a new version, ``record``
        appended; the version after it."""
        with self._turn(t, replaying, "changes"):
            change(self._next_version())
            version = self._advance()
            ticket = self.durability.append(record) if record[0] else 0
        self.durability.wait(ticket, durable)
        return version

    @contextmanager
    def _turn(self, t: Table, replaying: bool, what: str, ids: Optional[np.ndarray] = None) -> Iterator[None]:
        """Hold ``t.lock`` for one change of ``ids``, once no prepared two-phase checkpoint holds ``what`` back and
        no slot handover holds those rows: both are waited out (bounded) outside the lock; rows this shard no longer
        owns (a handover committed since the request was checked) are refused. Replay never waits."""
        while True:
            t.lock.acquire()
            if replaying:
                try:
                    yield
                finally:
                    t.lock.release()
                return
            if not self.gate.is_open:
                t.lock.release()
                self.before_wait()
                if not self.gate.wait(self.gate_wait_s):
                    raise Unavailable(f"shard {self.shard_index}: {what} held back by a checkpoint for too long")
                continue
            slots = self.slots
            if slots is not None and slots.guarded and ids is not None and ids.size:
                try:
                    state = slots.blocked(t.spec, ids)
                except BaseException:
                    t.lock.release()
                    raise
                if state:
                    t.lock.release()
                    if state == "moved":
                        raise slots.moved(t.spec, ids)
                    slots.wait_for(t.spec, ids, True, f"{what} to {t.spec.name!r}")
                    continue
            try:
                # (a replica group's member: refused unless it is the primary now; it may have stepped down while
                # this request waited above, ReplicatedLog.origin)
                with self.durability.origin():
                    yield
            finally:
                t.lock.release()
            return

    def _next_version(self) -> int:
        """The version the change being applied will have (caller holds its table's lock)."""
        with self._vlock:
            return self.version + 1

    def _advance(self) -> int:
        """Count the change just applied; the version after it."""
        with self._vlock:
            self.version += 1
            return self.version

    def evict(self, t: Table, ids: np.ndarray, cause: int) -> None:
        """Replay of a logged eviction, in the logged order (so the slots end as they did live)."""
        with t.lock:
            t.remove(ids[t.index.lookup(ids) >= 0], cause, version=self.version + 1)

    def sweep(self, t: Table, max_slots: int) -> int:
        """Evict the expired rows of the next slice of ``t`` (logged); how many."""
        with t.lock, self.durability.origin():  # (a replica group's backup sweeps nothing of its own)
            if not self.gate.is_open:  # a checkpoint is being taken: next time
                return 0
            gone = t.sweep(self.version, max_slots)
            if gone.size:
                self.durability.append(record_evict(t.spec.name, gone, CAUSE_TTL))
        return int(gone.size)

    def _staleness(self, t: Table, uniq: np.ndarray, pulled_version: Optional[int], replayed: Optional[int],
                   replayed_per_row: Optional[np.ndarray]) -> tuple[int, Optional[np.ndarray]]:
        """(staleness, per-row staleness or None) of a push of the unique ids ``uniq``. Caller holds t.lock."""
        if replayed is not None:
            return replayed, replayed_per_row
        policy = t.spec.staleness
        staleness = max(0, self.version - pulled_version) if pulled_version is not None else 0
        per_row = None
        if policy.per_row and t.history is not None and uniq.size:
            per_row = t.row_staleness(uniq, pulled_version, self.version) if pulled_version is not None \
                else np.zeros(uniq.shape[0], np.int64)
            staleness = int(per_row.max())
        limit = policy.max_staleness
        if limit is not None and staleness > limit:
            self.stats.count("stale_rejected")
            if per_row is not None:
                raise StaleUpdate(f"{t.spec.name}: a row of the push was updated {staleness} times since its pull, "
                                  f"more than max_staleness {limit} (per row); pull again and recompute")
            raise StaleUpdate(f"{t.spec.name}: push is {staleness} versions stale, more than max_staleness "
                              f"{limit}; pull again and recompute")
        return staleness, per_row

    def read(self, t: Table, ids: np.ndarray, encode: Optional[Callable[[np.ndarray, Optional[np.ndarray], int], Any]]
             = None) -> tuple[Any, int]:
        """Rows of validated ``ids`` of ``t`` (absent ones created) and the version they were read at; with ``encode``,
        ``encode(rows, None, version)`` instead of the rows, or ``encode(t.rows, slots, version)`` (the rows at
        ``slots`` of the table's: an answer built straight from it, one copy less), called under the table's lock."""
        slots = self.slots
        while True:
            with t.lock:
                state = slots.blocked(t.spec, ids, write=False) if slots is not None and slots.guarded else ""
                if not state:
                    version = self.version
                    if encode is None:
                        rows = t.read(ids, version)
                    else:
                        at = t.read_slots(ids, version)
                        rows = encode(t.rows, at, version) if at is not None else encode(t.read(ids, version), None,
                                                                                           version)
                    break
            assert slots is not None
            if state == "moved":
                raise slots.moved(t.spec, ids)
            slots.wait_for(t.spec, ids, False, f"a pull of {t.spec.name!r}")
        self.stats.pulled(ids.shape[0])
        self.metrics.pulled(t.spec.name, ids.shape[0], t.dim * 4)
        return rows, version
