"""Requests checked against a shard before anything is applied: the shard map, ownership of ids and
dense rows, request and reply sizes, shapes and dtypes of pushes, and read-only serving. A request
refused here changes nothing.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np

from shardps.core.errors import InvalidArgument, OutOfRange, ReadOnly, ResourceExhausted
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.shard.limits import Limits
from shardps.server.shard.registry import TableRegistry
from shardps.server.shard.slots import Owns, SlotOwnership
from shardps.server.shard.sync import SyncPart, check_sync
from shardps.server.storage.table import Table


class Validator:
    """Checks of one shard (what it owns: ``slots``); ``serve_from`` is set on a read-only serving shard."""

    def __init__(self, slots: SlotOwnership, registry: TableRegistry, limits: Limits,
                 serve_from: Optional[str]) -> None:
        self.index = slots.index
        self.slots = slots
        self.registry = registry
        self.limits = limits
        self.serve_from = serve_from
        self.guard: Optional[Callable[[str], None]] = None  # a replica group's member: refuses unless primary

    def writable(self, what: str) -> None:
        """Refuse a change on a serving shard, and on a replica group's member that is not its primary."""
        if self.serve_from is not None:
            raise ReadOnly(f"shard {self.index} serves the export {self.serve_from} read-only (--serve-from): "
                           f"{what} refused; send it to the training cluster")
        if self.guard is not None:
            self.guard(what)

    def _to_change(self, name: str, dense: bool, what: str) -> Table:
        """The table a change names, once this shard may make it: a member that is not its group's primary refuses
        before it looks for the table (it may lack one the primary has: the client goes on to the primary), and the
        name is checked before a refusal quotes it."""
        self.registry.check_name(name)
        self.writable(what)
        return self.registry.get(name, dense=dense)

    def check_shard_map(self, shard_index: int, num_shards: int, map_epoch: int = 0, map_id: str = "") -> None:
        """Refuse requests addressed to another shard, or naming another cluster's slot map or one from the future
        (count 0: no shard map given)."""
        if num_shards == 0 and not map_epoch and not map_id:
            return
        self.slots.check_request(shard_index, num_shards, map_epoch, map_id)

    def check_ids_count(self, ids: np.ndarray) -> None:
        self.limits.check("ids in one request", ids.shape[0] if ids.ndim else 1, "max_ids_per_request")

    def check_reply(self, t: Table, rows: int, itemsize: int) -> None:
        """Refuse a read whose reply would exceed the largest message, before any row is read."""
        nbytes = rows * t.dim * itemsize
        if nbytes > self.limits.max_message_bytes:
            raise ResourceExhausted(
                f"{t.spec.name}: a reply of {rows:,} rows x {t.dim} would be {nbytes:,} bytes, over the "
                f"largest message of {self.limits.max_message_bytes:,} bytes (--max-message-mb); split the request"
            )

    def ownership(self, spec: Union[TableSpec, DenseSpec]) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
        """(which ids of an array this shard owns, rows it is expected to hold) of a table or dense tensor."""
        return Owns(self.slots, spec), self.slots.expected_rows(spec)

    def pull(self, name: str, ids: np.ndarray, itemsize: int) -> Table:
        """Check a row pull; returns its table."""
        t = self.registry.get(name, dense=False)
        self.check_ids_count(ids)
        t.check_ids(ids)
        self.check_reply(t, ids.shape[0], itemsize)
        return t

    def push(self, name: str, ids: np.ndarray, grads: np.ndarray, sync: Optional[SyncPart] = None) -> Table:
        """Check a row push without applying it; returns its table."""
        t = self._to_change(name, False, f"a push to {name!r}")
        self.check_ids_count(ids)
        if sync is None or ids.size:  # a synchronous worker may contribute nothing to a step
            t.check_ids(ids)
        elif ids.ndim != 1:
            raise InvalidArgument(f"{name}: ids must be 1-D, got shape {list(ids.shape)}")
        t.check_grads(ids, grads)
        check_sync(t, sync)
        return t

    def assign(self, name: str, ids: np.ndarray, values: np.ndarray) -> tuple[Table, np.ndarray, np.ndarray]:
        """Check an assignment of rows; returns its table and the ids and values sorted by id."""
        t = self._to_change(name, False, f"assigning rows of {name!r}")
        self.check_ids_count(ids)
        t.check_ids(ids)
        if values.shape != (ids.shape[0], t.dim):
            raise InvalidArgument(f"{name}: values must have shape [{ids.shape[0]}, {t.dim}] (ids x dim), "
                                  f"got {list(values.shape)}")
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{name}: values contain NaN or Inf; assignment refused")
        order = np.argsort(ids, kind="stable")
        ids, values = ids[order], np.ascontiguousarray(values[order], dtype=np.float32)
        if ids.shape[0] > 1 and (ids[1:] == ids[:-1]).any():
            raise InvalidArgument(f"{name}: assigned ids must be unique (id {int(ids[1:][ids[1:] == ids[:-1]][0])} "
                                  "appears twice)")
        return t, ids, values

    def dense_rows(self, t: Table, row_start: int, row_end: int) -> np.ndarray:
        spec = t.spec
        assert isinstance(spec, DenseSpec)
        if not 0 <= row_start < row_end <= spec.rows:
            raise OutOfRange(f"{spec.name}: rows [{row_start}, {row_end}) outside [0, {spec.rows})")
        ids = np.arange(row_start, row_end, dtype=np.int64)
        t.check_ids(ids)
        return ids

    def pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[Table, np.ndarray]:
        """Check a dense pull without reading it; returns its table and row ids."""
        t = self.registry.get(name, dense=True)
        ids = self.dense_rows(t, row_start, row_end)
        t.check_present(ids)  # here, so a PushBatch refused for it applies none of its pushes
        return t, ids

    def push_dense(self, name: str, row_start: int, grads: np.ndarray,
                   sync: Optional[SyncPart] = None) -> tuple[Table, np.ndarray]:
        """Check a dense push without applying it; returns its table and row ids."""
        t = self._to_change(name, True, f"a push to {name!r}")
        if grads.ndim != 2:
            raise InvalidArgument(f"{name}: grads must be 2-D [rows, {t.dim}], got shape {list(grads.shape)}")
        ids = self.dense_rows(t, row_start, row_start + grads.shape[0])
        t.check_grads(ids, grads)
        check_sync(t, sync)
        return t, ids
