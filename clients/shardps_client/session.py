"""What the client's parts share: its settings, transport, spec catalog, push pipeline and worker clock.

``Session`` also holds the two steps every path takes: pushing the summed
gradients of sorted unique ids of a table (``push_rows``: a push, a row cache's
expiring sums, a drain), and making a pull see this client's own pushes
(``see_own_pushes``, read-your-writes); and the slot map requests are routed by
(``slots``), adopted from the shards on connect and again when one answers that
a slot moved (``refresh_slots``: a map of more shards adds them to the transport).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterator, Optional, TypeVar, Union, overload

import numpy as np

from shardps.core import protocol, wire
from shardps.core.slots import SlotMap
from shardps.core.specs import DenseSpec, TableSpec
from shardps.core.wire import PushEncoder
from shardps.v1 import shardps_pb2 as pb
from shardps_client import planner
from shardps_client.admin import Catalog, maps_of
from shardps_client.errors import ShardMapError, ShardpsError, ShardRemovedError, SlotMovedError, TableChangedError
from shardps_client.held_step import HeldRows, Unit, summed_parts
from shardps_client.inputs import check_sent, wire_code
from shardps_client.pushes import PushPipeline
from shardps_client.transport import CLOSED, Transport
from shardps_client.versions import Versions
from shardps_client.worker import WorkerClock

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class Session:
    """The state of one client that its parts share (the ``Client`` attributes of the same names)."""

    addresses: list[str]
    timeout: float
    retry_timeout: float
    wire_dtype: int  # the default wire dtype's code
    max_message_bytes: int
    read_your_writes: bool
    client_id: str
    transport: Transport
    catalog: Catalog
    pushes: PushPipeline
    worker: WorkerClock
    pool: ThreadPoolExecutor  # prefetches, worker heartbeats
    slots: SlotMap = field(init=False)
    _seq: list[Iterator[int]] = field(init=False, repr=False)
    _seq_lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _slots_lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _encoders: dict[tuple[str, int, int, str], PushEncoder] = field(init=False, repr=False, default_factory=dict)
    held: HeldRows = field(init=False, repr=False, default_factory=HeldRows)  # a held step's row pushes, unplanned

    def __post_init__(self) -> None:
        self._seq = [itertools.count(1) for _ in self.addresses]
        self.slots = SlotMap.uniform(len(self.addresses), self.transport.addresses)
        self.transport.gone = self.shard_gone
        self.pushes.before_send, self.pushes.held_rows = self.plan_held, lambda: self.held.pending

    @property
    def num_shards(self) -> int:
        return self.slots.num_shards

    def active_shards(self) -> list[int]:
        """Shards that own slots or dense chunks (a removed shard owns nothing; an added one, once slots moved)."""
        return self.slots.active()

    def adopt_slots(self, maps: list[SlotMap]) -> SlotMap:
        """Route by the newest of ``maps`` (the shards' own), when newer than the one held; shards it has beyond the
        client's address list are added at the addresses it names."""
        with self._slots_lock:
            newest = max(maps, key=lambda m: (m.epoch, bool(m.map_id)), default=self.slots)
            cur = self.slots
            if (newest.epoch, bool(newest.map_id)) <= (cur.epoch, bool(cur.map_id)):
                return cur
            known = self.transport.addresses
            if newest.num_shards > len(known):
                missing = [i for i in range(len(known), newest.num_shards) if not newest.addresses[i]]
                if missing:
                    raise ShardMapError(f"the cluster's slot map (epoch {newest.epoch}) has shard {missing[0]}, but "
                                        "names no address for it; give the client every shard's address")
                self.transport.add_shards(list(newest.addresses[len(known):]))
                self.addresses[:] = list(self.transport.addresses)
                with self._seq_lock:
                    self._seq += [itertools.count(1) for _ in range(newest.num_shards - len(self._seq))]
            self.slots = newest.with_addresses(self.transport.addresses)
            log.info("client %s: routing by slot map epoch %d (%d shards)", self.client_id[:8], newest.epoch,
                     newest.num_shards)
            return self.slots

    def refresh_slots(self, planned: SlotMap) -> SlotMap:
        """After a shard said a slot moved: the shards' newest map (asked only when the one held is still the
        map ``planned`` was made by: a refresh by another call since is used as it is)."""
        return self._refresh(planned.epoch)

    def _refresh(self, planned_epoch: int) -> SlotMap:
        if self.slots.epoch > planned_epoch:
            return self.slots
        infos = []
        for s in self.active_shards():  # each asked once: a shard that does not answer (gone, restarting) is skipped
            try:
                infos.append(self.transport.call(s, "ShardInfo", pb.ShardInfoRequest(), retry=False))
            except ShardpsError:
                continue
        return self.adopt_slots(maps_of(infos))

    def shard_gone(self, shard: int) -> bool:
        """Whether shard ``shard`` (which does not answer) is out of the cluster: it owns nothing in the newest slot
        map the other shards hold."""
        slots = self._refresh(self.slots.epoch)
        return shard not in slots.active()

    def wire(self, wire_dtype: Optional[str]) -> int:
        """The wire dtype code of a call: ``wire_dtype``, or the client's default. Every pull and push asks it first,
        so a closed client refuses them here (a push would otherwise be queued and never sent)."""
        if self.transport.closed:
            raise ShardpsError(CLOSED, address="")
        return self.wire_dtype if wire_dtype is None else wire_code(wire_dtype)

    def routed(self, call: Callable[[SlotMap], T]) -> T:
        """``call(slots)``: plan by the map ``slots`` and make the calls; planned again by a refreshed map while a
        shard answers that a slot moved (within ``retry_timeout``)."""
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.02
        while True:
            slots = self.slots
            try:
                return call(slots)
            except TableChangedError as e:  # (a pull's rows in another shape: the spec here is stale)
                self.catalog.forget(e.table)
                raise
            except (SlotMovedError, ShardRemovedError):
                if time.monotonic() + delay > deadline:
                    raise
                if self.refresh_slots(slots) is slots:  # no newer map yet (a move is being activated): wait a little
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)

    def replan(self, call: planner.Call, only: Optional[list[int]] = None, unanswered: bool = False) -> list[planner.Call]:
        """A push call a shard refused because its slots moved (``only``: those of its pushes, by position, a
        batch's answer marked moved), planned again by a refreshed map. ``unanswered``: the shard left the cluster
        without answering, so it may have applied the call: each push names it and its seq there among its
        ``origins``, which its new owners check against the records of applied pushes that came with the slots."""
        pushes = planner.pushes_of(call)
        if only is not None:
            pushes = [pushes[k] for k in only]
        planned = max((d.shard_map.map_epoch for _, d in pushes if d.shard_map is not None), default=0)
        slots = self._refresh(planned)
        out: list[planner.Call] = []
        for dense, d in pushes:
            spec = self.catalog.dense(d.name) if dense else self.catalog.table(d.name)
            origins = d.origins + ((call[0], d.seq),) if unanswered and d.client_id and d.seq else d.origins
            out += planner.replan_push(d, spec, slots, self.max_message_bytes, self.next_seq, origins)
        return out

    def next_seq(self, shard: int) -> int:
        """The next sequence number of this client's pushes to ``shard`` (exactly-once on the shard)."""
        with self._seq_lock:
            while len(self._seq) <= shard:
                self._seq.append(itertools.count(1))
            return next(self._seq[shard])

    def push_rows(self, spec: TableSpec, uniq: np.ndarray, summed: np.ndarray, versions: Optional[Versions],
                  wait: bool, wire_code: int) -> None:
        """Push the summed gradients of sorted unique ids (under a step hold: planned at its send, ``plan_held``)."""
        if not wait and self.pushes.summing:  # (copies: the caller may change its arrays before the step is sent)
            self.held.add(Unit([spec], [np.array(uniq)], np.array(summed), [versions], wire_code, stacked=False))
            return
        self._push_rows(spec, uniq, summed, versions, wait, wire_code)

    def _push_rows(self, spec: TableSpec, uniq: np.ndarray, summed: np.ndarray, versions: Optional[Versions],
                   wait: bool, wire_code: int) -> None:
        sync_step = self.worker.next_sync_step(spec.name) if spec.sync is not None else 0
        trail = self.trails(spec)  # (a push that trails a pull is built in a request slot of a shard's region)
        calls = planner.push_plan(spec, uniq, summed, self.slots, wire_code, self.max_message_bytes,
                                  versions.by_shard if versions is not None else None, self.client_id,
                                  self.next_seq, sync_step, self.worker.rank or 0,
                                  into=self.transport.request_slot if trail and not wait else None)
        self.pushes.dispatch(spec.name, calls, wait, trail)

    def trails(self, spec: Union[TableSpec, DenseSpec]) -> bool:
        """Whether a push to ``spec`` waits for this client's next pull (``PushPipeline.send_trailing``): without
        read-your-writes, unless the table takes synchronous steps (its pull may wait for the step the push is
        part of)."""
        return not self.read_your_writes and spec.sync is None

    def push_rows_many(self, specs: list[TableSpec], uniq: list[np.ndarray], summed: np.ndarray,
                       versions: list[Optional[Versions]], wire_code: int) -> None:
        """Push the summed gradients of several tables' sorted unique ids (one width, no synchronous step),
        stacked table after table in ``summed``: planned at once, dispatched together (in a held step: at its send)."""
        if self.pushes.summing:  # (copies, as above)
            self.held.add(Unit(list(specs), [np.array(u) for u in uniq], np.array(summed), list(versions), wire_code,
                               stacked=True))
            return
        self._push_rows_many(specs, uniq, summed, versions, wire_code)

    def _push_rows_many(self, specs: list[TableSpec], uniq: list[np.ndarray], summed: np.ndarray,
                        versions: list[Optional[Versions]], wire_code: int) -> None:
        calls = planner.push_plan_many([s.name for s in specs], uniq, summed, self.slots, wire_code,
                                       self.max_message_bytes, [v.by_shard if v is not None else None for v in versions],
                                       self.push_encoder, self.next_seq)
        self.pushes.dispatch_many(calls, wait=False, trail=all(self.trails(s) for s in specs))

    def plan_held(self) -> None:
        """Plan the row pushes a held step made (``held_step``): before its pushes are sent, or a pull must see them.
        A table pushed more than once in the step is pushed once, each row's gradients summed."""
        if not self.held.pending:
            return
        keep, again = self.held.take()
        for u in keep:
            if u.stacked:
                self._push_rows_many(u.specs, u.uniq, u.summed, u.versions, u.wire)
            else:
                self._push_rows(u.specs[0], u.uniq[0], u.summed, u.versions[0], False, u.wire)
        for name, parts in again.items():
            uniq, summed, versions = summed_parts(parts)
            check_sent(summed, name, parts[0][4], parts[0][0].allow_nonfinite, summed=True)
            self._push_rows(parts[0][0], uniq, summed, versions, False, parts[0][4])

    def push_encoder(self, table: str, shard: int) -> PushEncoder:  # (``wire`` here would be the method)
        """The encoder of this client's pushes of ``table`` to ``shard`` under the current slot map (made once)."""
        slots = self.slots
        key = (table, shard, slots.epoch, slots.map_id)
        enc = self._encoders.get(key)
        if enc is None:
            if len(self._encoders) > 4096:
                self._encoders.clear()
            enc = self._encoders[key] = wire.PushEncoder(
                table, self.client_id, planner.shard_map(shard, slots), frame=protocol.stream_field("Push"))
        return enc

    def see_own_pushes(self, key: str) -> None:
        """Before a pull of ``key`` (read_your_writes): make it see this client's pushes.

        Streaming lanes serve a pull after every push sent before it, so queued
        (deferred) pushes only need sending; over unary calls, wait for them.
        """
        if self.transport.streaming:
            if self.pushes.has_queued:
                self.pushes.send()
        else:
            self.pushes.wait(key)


class Shared(Generic[T]):
    """An attribute of an object with a ``_session`` (the ``Client``) that is the session's attribute of the
    same name: read and written there, so every part sees a change."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: Any = None) -> Shared[T]: ...
    @overload
    def __get__(self, obj: object, objtype: Any = None) -> T: ...
    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else getattr(obj._session, self.name)

    def __set__(self, obj: Any, value: T) -> None:
        setattr(obj._session, self.name, value)
