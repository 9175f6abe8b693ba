"""What the client's parts share: its settings, transport, spec catalog, push pipeline and worker clock.

``Session`` also holds the two steps every path takes: pushing the summed
gradients of sorted unique ids of a table (``push_rows``: a push, a row cache's
expiring sums, a drain), and making a pull see this client's own pushes
(``see_own_pushes``, read-your-writes).
"""

from __future__ import annotations

import itertools
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Iterator, Optional, TypeVar, overload

import numpy as np

from shardps.core import protocol, wire
from shardps.core.specs import TableSpec
from shardps_client import planner
from shardps_client.admin import Catalog
from shardps_client.inputs import wire_code
from shardps_client.pushes import PushPipeline
from shardps_client.transport import Transport
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
    _seq: list[Iterator[int]] = field(init=False, repr=False)
    _seq_lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)
    _encoders: dict[tuple[str, int], wire.PushEncoder] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        self._seq = [itertools.count(1) for _ in self.addresses]

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def wire(self, wire_dtype: Optional[str]) -> int:
        """The wire dtype code of a call: ``wire_dtype``, or the client's default."""
        return self.wire_dtype if wire_dtype is None else wire_code(wire_dtype)

    def next_seq(self, shard: int) -> int:
        """The next sequence number of this client's pushes to ``shard`` (exactly-once on the shard)."""
        with self._seq_lock:
            return next(self._seq[shard])

    def push_rows(self, spec: TableSpec, uniq: np.ndarray, summed: np.ndarray, versions: Optional[Versions],
                  wait: bool, wire_code: int) -> None:
        """Push the summed gradients of sorted unique ids."""
        sync_step = self.worker.next_sync_step(spec.name) if spec.sync is not None else 0
        calls = planner.push_plan(spec, uniq, summed, self.num_shards, wire_code, self.max_message_bytes,
                                  versions.by_shard if versions is not None else None, self.client_id,
                                  self.next_seq, sync_step, self.worker.rank or 0)
        self.pushes.dispatch(spec.name, calls, wait)

    def push_rows_many(self, specs: list[TableSpec], uniq: list[np.ndarray], summed: np.ndarray,
                       versions: list[Optional[Versions]], wire_code: int) -> None:
        """Push the summed gradients of several tables' sorted unique ids (one width, no synchronous step),
        stacked table after table in ``summed``: planned at once, dispatched together."""
        calls = planner.push_plan_many([s.name for s in specs], uniq, summed, self.num_shards, wire_code,
                                       self.max_message_bytes, [v.by_shard if v is not None else None for v in versions],
                                       self.push_encoder, self.next_seq)
        self.pushes.dispatch_many(calls, wait=False)

    def push_encoder(self, table: str, shard: int) -> wire.PushEncoder:
        """The encoder of this client's pushes of ``table`` to ``shard`` (made once)."""
        enc = self._encoders.get((table, shard))
        if enc is None:
            enc = self._encoders[(table, shard)] = wire.PushEncoder(
                table, self.client_id, planner.shard_map(shard, self.num_shards), frame=protocol.stream_field("Push"))
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
