"""A shard's start from its data dir: load the newest valid checkpoint, then replay the log records
written after it through the same paths as live requests (the update path included), so replay
cannot drift from what was acknowledged.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any, Optional, Protocol

import numpy as np

from shardps.core.errors import InvalidArgument, NotFound
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.durability import checkpoints, wal
from shardps.server.durability import modes as durability
from shardps.server.durability.modes import Durability
from shardps.server.durability.replication import ReplicatedLog
from shardps.server.shard.checkpointing import Checkpointer
from shardps.server.shard.registry import TableRegistry
from shardps.server.shard.updates import UpdatePath
from shardps.server.storage import checks
from shardps.server.storage.disk import DiskTierError, RecordCodec
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)


class ShardMapMismatch(Exception):
    """A checkpoint on disk was written by a shard with another (index, count)."""


class LogReplayError(Exception):
    """A write-ahead log record that holds an acknowledged update cannot be replayed."""


class Replayable(Protocol):
    """What replay needs of a shard: the calls live requests make."""

    registry: TableRegistry
    updates: UpdatePath
    migrations: Any  # shard.migration.Migrations

    def create_table(self, spec: TableSpec, may_create: bool = True) -> bool: ...

    def register_dense(self, spec: DenseSpec, row_start: int, values: Optional[np.ndarray],
                       may_create: bool = True) -> tuple[bool, bool]: ...

    def drop(self, name: str) -> bool: ...


class Recovery:
    """Restores one shard (index of num_shards) from ``data_dir``; ``wal_recovery`` says what an
    unreplayable record does ("fail" or "truncate")."""

    def __init__(self, shard: Replayable, shard_index: int, num_shards: int, data_dir: pathlib.Path,
                 durability: Durability, checkpointer: Checkpointer, wal_recovery: str) -> None:
        self.shard = shard
        self.index = shard_index
        self.num_shards = num_shards
        self.data_dir = data_dir
        self.durability = durability
        self.checkpointer = checkpointer
        self.wal_recovery = wal_recovery

    def restore(self) -> None:
        """Load the newest valid checkpoint, then replay the records written after it."""
        first_segment = 0
        restored_meta: dict[str, Any] = {}
        tier_error: Optional[DiskTierError] = None
        for loaded in checkpoints.load_newest(self.data_dir):
            meta = loaded.meta
            if (meta["shard_index"], meta["num_shards"]) != (self.index, self.num_shards):
                raise ShardMapMismatch(
                    f"checkpoint {loaded.path} belongs to shard {meta['shard_index']} of {meta['num_shards']}, "
                    f"but this shard is {self.index} of {self.num_shards}; reshard it with "
                    f"`shardps reshard` or point --data-dir elsewhere"
                )
            try:
                load_state(self.shard, meta, loaded.arrays)
            except DiskTierError as e:  # the log reaches back to the previous checkpoint: fall back to it
                log.error("shard %d: checkpoint %s cannot be restored: %s", self.index, loaded.path, e)
                tier_error = tier_error or e
                continue
            tier_error = None
            restored_meta = meta
            first_segment = self.checkpointer.restored(meta, loaded.path.stat().st_size)
            log.info("shard %d: restored checkpoint %s (version %d, %d tables)",
                     self.index, loaded.path.name, self.shard.updates.version, len(self.shard.registry))
            break
        if tier_error is not None:  # no checkpoint could be restored: the log alone no longer holds every change
            raise tier_error
        replayed = 0
        try:
            for record in self.durability.records(first_segment):
                try:
                    self.replay(durability.read_record(record.kind, record.payload))
                except Exception as e:  # noqa: BLE001 - any record that cannot be replayed stops the start loudly
                    self._unreplayable(record, e)
                    break
                replayed += 1
        except wal.CorruptLog as e:
            self._unreplayable(e.record, e)
        if replayed:
            log.info("shard %d: replayed %d write-ahead log records (version %d)", self.index, replayed,
                     self.shard.updates.version)
        if isinstance(self.durability, ReplicatedLog):  # a replica group's member: where its log ends
            epochs = restored_meta.get("epochs", []) + self.durability.saved_epochs()
            self.durability.restored(int(restored_meta.get("lsn", 0)) + replayed, epochs)

    def _unreplayable(self, record: wal.Record, error: Exception) -> None:
        """A record that cannot be replayed: stop the start (the default), or with ``wal_recovery="truncate"``
        move it and every later record aside, saying how many acknowledged records are lost."""
        where = (f"write-ahead log {record.path} record {record.number} at byte {record.offset} "
                 f"({wal.KIND_NAMES.get(record.kind, 'damaged')})")
        if self.wal_recovery != "truncate":
            raise LogReplayError(
                f"shard {self.index}: {where} cannot be replayed: {error}. It and the records after it hold "
                f"acknowledged updates, so the shard does not start. To start anyway, without that record and "
                f"every later one (they are kept in a .corrupt file), restart with --wal-recovery truncate"
            ) from error
        aside, lost = wal.truncate_at(self.data_dir, record)
        log.error("shard %d: %s cannot be replayed (%s); --wal-recovery truncate: %d records from there on "
                  "(acknowledged updates) moved to %s and NOT applied", self.index, where, error, lost, aside)

    def replay(self, change: durability.Change) -> None:
        """Re-apply one stored change during restore, through the same paths as live requests."""
        replay(self.shard, change)


def replay(shard: Replayable, change: durability.Change) -> None:
    """Re-apply one stored change through the same paths as live requests: a restore's log replay, and a backup's
    records from its primary."""
    updates = shard.updates
    if isinstance(change, durability.CreateTable):
        shard.create_table(change.spec)
    elif isinstance(change, durability.RegisterDense):
        shard.register_dense(change.spec, change.row_start, change.values)
    elif isinstance(change, durability.Drop):
        shard.drop(change.name)
    elif isinstance(change, durability.Assign):
        found = _table(shard, change.name, "assigns to")
        _check_ids(found, change.ids)
        updates.assign(found, change.ids, change.values, replaying=True)
    elif isinstance(change, durability.Evict):
        updates.evict(_table(shard, change.name, "evicts from"), change.ids, change.cause)
    elif isinstance(change, durability.Slots):
        shard.migrations.replay(change.change)
    elif isinstance(change, durability.RowsIn):
        shard.migrations.apply_rows_in(change)
    else:
        d = change.push
        assert d.grads is not None
        t = _table(shard, d.name, "for")
        if change.dense:  # a dense tensor's rows from row_start
            if not t.is_dense or d.grads.ndim != 2:
                raise InvalidArgument(f"log record: a dense push to {d.name!r} that is not one")
            ids = np.arange(d.row_start, d.row_start + d.grads.shape[0], dtype=np.int64)
        else:  # rows of a table, or of a dense tensor (a synchronous step's update)
            assert d.ids is not None
            ids = d.ids
        if ids.size:
            _check_ids(t, ids)
        t.check_grads(ids, d.grads)
        if d.client_id:  # remembered, not counted: the snapshot may already hold it
            updates.seen.begin(d.client_id, d.seq)
        updates.apply(t, ids, d.grads, replayed_staleness=change.staleness, replayed_per_row=change.per_row,
                      replayed_ticks=change.ticks, claim=(d.client_id, d.seq))


def _check_ids(t: Table, ids: np.ndarray) -> None:
    """A logged change's ids: 1-D and in range. Not whether this shard owns them now: its primary (or this shard,
    live) checked that when the change was made, and the records before it in the log bring the slot map it was
    made under. A live request's check waits while its ids are in slots arriving here (``shard.slots.Owns``);
    nothing settles an arrival during a replay (the resolver runs on a primary, after it), so that wait could only
    stall a backup whose state disagreed with its log: a deposed primary that had logged a move's activation but
    never made it waited 15 s at every push of its new primary's to those slots, and never caught up (the
    campaign's reshard-under-faults; ``MoveBase._log`` now makes every logged step)."""
    checks.ids(t.spec.name, "rows" if t.is_dense else "ids", t.num_embeddings, _any_owner, ids)


def _any_owner(ids: np.ndarray) -> np.ndarray:
    return np.ones(ids.shape, dtype=bool)


def _table(shard: Replayable, name: str, what: str) -> Table:
    found = shard.registry.find(name)
    if found is None:
        raise NotFound(f"log record {what} unknown table {name!r}")
    return found


def load_state(shard: Replayable, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Replace everything ``shard`` holds with a snapshot's contents (the rows must be owned by the shard)."""
    registry = shard.registry
    with registry.lock:
        registry.clear()
        tier = meta.get("disk_tier")
        if tier:  # the rows on disk as of the cut: the live disk tier is rebuilt from that checkpoint first
            if registry.tiers is None:
                raise DiskTierError(f"the checkpoint keeps rows in the disk tier {tier!r}, but this shard has no "
                                    "--disk-dir (nor --data-dir)")
            specs = [checkpoints.spec_of(e) for e in meta["tables"]]
            registry.tiers.restore(tier, {s.name: RecordCodec(s.dim, list(s.optimizer.state_names()))
                                          for s in specs if isinstance(s, TableSpec) and s.disk is not None})
        for i, entry in enumerate(meta["tables"]):
            spec = checkpoints.spec_of(entry)
            if isinstance(spec, DenseSpec):
                shard.register_dense(spec, 0, None)
            else:
                shard.create_table(spec)
            prefix = f"t{i}."
            t = registry.find(spec.name)
            assert t is not None
            t.load({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
            if t.hot is not None:
                assert registry.tiers is not None and tier
                t.hot.restore(registry.tiers.checkpoint_root / tier)
        shard.updates.version = int(meta["version"])
        shard.updates.seen.load_json(meta.get("seen", {}))
        shard.updates.elsewhere.load_others(meta.get("seen_elsewhere", {}))
        shard.migrations.load_meta(meta.get("slots"))
        for t in registry.tables():
            t.restart_history(shard.updates.version)
