"""One shard: a thin facade over the collaborators that hold its state and do its work.

``Shard`` is plain Python over numpy arrays; it takes and returns plain values and
raises the exception types of ``shardps.core.errors`` (the gRPC servicer converts
to and from protobuf). Its collaborators, each with one job:

- ``TableRegistry`` (registry.py): tables and dense tensors by name, limits, memory budget;
- ``Validator`` (validation.py): requests checked before anything is applied;
- ``UpdatePath`` (updates.py): the one way rows change (live pushes, synchronous
  steps, log replay): version counter, exactly-once records, staleness, counters;
- ``SyncCoordinator`` (sync.py): synchronous steps and worker membership, applying
  each complete step through the update path;
- ``Checkpointer`` (checkpointing.py): holds, consistent copies and checkpoint files;
- ``ExportSessions`` (export_sessions.py): export copies and delta floors;
- ``Recovery`` (recovery.py): restore from a checkpoint and replay of the log on start;
- the durability (``shardps.server.durability``): ``none``, ``checkpoint`` or ``log``.
"""

from __future__ import annotations

import functools
import logging
import pathlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import numpy as np

from shardps.core.errors import AlreadyExists, InvalidArgument, NotFound, OutOfRange, PermissionDenied
from shardps.core.specs import DenseSpec, TableSpec, same_table
from shardps.server.durability import modes as durability
from shardps.server.durability.gate import CheckpointGate
from shardps.server.durability.replication import ACKS, ReplicatedLog
from shardps.server.durability.wal import FSYNC_POLICIES
from shardps.server.shard.checkpointing import Checkpointer
from shardps.server.shard.cuts import ShardCuts
from shardps.server.shard.export_sessions import ExportedCopy, ExportSessions
from shardps.server.shard.limits import Limits
from shardps.server.shard.metrics import NO_METRICS, NullMetrics
from shardps.server.shard.migration import Migrations
from shardps.server.shard.recovery import LogReplayError, Recovery, ShardMapMismatch
from shardps.server.shard.registry import TableRegistry
from shardps.server.shard.slots import SlotOwnership
from shardps.server.shard.sync import Membership, SyncCoordinator, SyncPart, check_sync
from shardps.server.shard.updates import Counters, PushResult, UpdatePath
from shardps.server.shard.validation import Validator
from shardps.server.storage.disk import DiskTiers
from shardps.server.storage.table import Table

__all__ = ["Shard", "ShardConfig", "ShardInfo", "TableInfo", "ExportedCopy", "LogReplayError", "ShardMapMismatch"]

log = logging.getLogger(__name__)

DURABILITY_LEVELS = durability.MODES

WAL_RECOVERY = ("fail", "truncate")


@dataclass(frozen=True)
class ShardConfig:
    """Configuration of one shard.

    Args:
        shard_index: this shard's index in [0, num_shards).
        num_shards: number of shards in the cluster.
        data_dir: directory for checkpoints and the write-ahead log (None: in memory only).
        durability: "log" (the default: every acknowledged change is in the write-ahead log first, fsynced
            by ``fsync``; a process crash loses nothing acknowledged), "checkpoint" (a crash loses the row
            updates since the last checkpoint; tables and dense tensors are logged all the same) or "none"
            (no files). Without a data dir nothing is kept, whatever this says.
        fsync: the log's fsync policy: "interval" (the default: written before the acknowledgement,
            fsynced every ``fsync_interval_s``; a machine crash loses at most that), "always" (fsynced
            before the acknowledgement, group commit) or "none" (left to the operating system).
            Schema changes are fsynced before the reply under every policy.
        fsync_interval_s: seconds between the log's fsyncs under "interval".
        keep_checkpoints: checkpoints kept on disk (the newest and previous ones).
        checkpoint_hold_s: longest time a prepared two-phase checkpoint holds
            pushes back before the shard gives up on it and resumes.
        worker_timeout_s: a worker silent (no heartbeat, no push) for this
            long counts as gone: synchronous steps and SSP stop waiting for it.
        limits: request and memory limits (see ``shardps.server.shard.limits.Limits``).
        wal_recovery: what a write-ahead log record that cannot be replayed does
            on start: "fail" (the shard does not start, and says which record and
            how to recover) or "truncate" (that record and every later one are
            moved aside to a ``.corrupt`` file, logged as lost, and the shard starts).
        serve_from: an export directory: the shard serves it read-only and follows its deltas
            (``shardps.server.exports.serving``); pushes and table changes are refused.
        disk_dir: where tables with a disk tier keep their cold rows (``shardps.server.storage.disk``; default:
            ``<data_dir>/disk``, none without a data dir).
        disk_min_free_mb: free space the disk tier keeps on its file system: a write that would leave less is
            refused before it is tried (room for checkpoints' sealed segments and compactions).
        join: a shard added to a running cluster (``shardps reshard --add``): it owns no slot until the driver moves
            some to it (without a data dir holding a slot map).
        handover_hold_s: longest a slot handover holds writes to its slots before it is given up.
        replicas: members of this shard's replica group (1: no replicas); with more, its changes are numbered and
            shipped (``shardps.server.durability.replication``) and ``shardps.server.replica`` runs the group.
        ack: with replicas, when a write is acknowledged: "quorum" (a majority of the group has it in its log) or
            "primary" (this member has it; a failover may lose the last writes).
        quorum_timeout_s: with ``ack="quorum"``, longest a write waits for a majority of the group before it is
            answered UNAVAILABLE (applied, not acknowledged: its client's resend is answered once a quorum has it).
    """

    shard_index: int = 0
    num_shards: int = 1
    data_dir: Optional[str] = None
    durability: str = "log"
    fsync: str = "interval"
    fsync_interval_s: float = 1.0
    keep_checkpoints: int = 2
    checkpoint_hold_s: float = 30.0
    worker_timeout_s: float = 10.0
    limits: Limits = Limits()
    wal_recovery: str = "fail"
    serve_from: Optional[str] = None
    disk_dir: Optional[str] = None
    disk_min_free_mb: int = 256
    replicas: int = 1
    ack: str = "quorum"
    quorum_timeout_s: float = 10.0
    join: bool = False
    handover_hold_s: float = 10.0

    def __post_init__(self) -> None:
        if self.serve_from is not None and self.data_dir is not None:
            raise ValueError("a serving shard (--serve-from) keeps no data dir: its state is the export's")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard index {self.shard_index} is not in [0, {self.num_shards})")
        if self.durability not in DURABILITY_LEVELS:
            raise ValueError(f"durability must be one of {DURABILITY_LEVELS}, got {self.durability!r}")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {self.fsync!r}")
        if not self.fsync_interval_s > 0:
            raise ValueError(f"fsync_interval_s must be > 0, got {self.fsync_interval_s}")
        if self.wal_recovery not in WAL_RECOVERY:
            raise ValueError(f"wal_recovery must be one of {WAL_RECOVERY}, got {self.wal_recovery!r}")
        if self.keep_checkpoints < 2:
            raise ValueError("keep_checkpoints must be >= 2 (the previous good one is kept)")
        if self.replicas < 1 or self.ack not in ACKS:
            raise ValueError(f"replicas must be >= 1 and ack one of {ACKS}, got {self.replicas}, {self.ack!r}")
        if self.replicas > 1 and (self.serve_from or (self.data_dir and self.durability == "checkpoint")):
            raise ValueError("a replica group's members log every change they store: --durability log (or none "
                             "without a data dir), and no --serve-from")

    def disk_tiers(self) -> Optional[DiskTiers]:
        """The shard's disk tier (opened on first use), or None when it has neither a disk dir nor a data dir."""
        root = self.disk_dir or (str(pathlib.Path(self.data_dir) / "disk") if self.data_dir else None)
        return DiskTiers(pathlib.Path(root), self.shard_index, self.num_shards,
                         self.disk_min_free_mb) if root else None


@dataclass(frozen=True)
class TableInfo:
    """What ``describe`` reports of one table or dense tensor on this shard."""

    spec: Union[TableSpec, DenseSpec]
    num_rows: int
    bytes: int
    payload_bytes: int
    admitted: int = 0
    rejected: int = 0
    evicted_ttl: int = 0
    evicted_capacity: int = 0
    sketch_bytes: int = 0
    hot_rows: int = 0  # a table with a disk tier: rows in memory (num_rows counts those on disk too)
    disk_rows: int = 0
    disk_bytes: int = 0
    tier_hits: int = 0
    tier_misses: int = 0
    promoted: int = 0
    written_back: int = 0

    @property
    def bytes_per_row(self) -> float:
        return self.bytes / self.num_rows if self.num_rows else 0.0


@dataclass(frozen=True)
class ShardInfo:
    """What ``info`` reports of this shard."""

    shard_index: int
    num_shards: int
    version: int
    tables: list[TableInfo]
    uptime_s: float
    stats: Counters
    durability: str
    last_checkpoint: str
    export_floor: int = -1  # deltas may follow a cut at this version or later (-1: no export followed yet)
    serving: Optional[Any] = None  # a serving shard's ServingState (shardps.server.exports.serving)


class Shard(ShardCuts):
    """Tables and dense tensors owned by one shard, with its version counter: a thin facade that hands each
    call to the collaborator whose job it is (its cuts, checkpoints and exports, in ``ShardCuts``)."""

    def __init__(self, config: ShardConfig, metrics: NullMetrics = NO_METRICS,
                 before_wait: Callable[..., None] = lambda ordered=True: None) -> None:
        """``before_wait`` is called on a request's thread before it waits (a log flush, a synchronous step, a
        checkpoint's hold): the gRPC face passes its fair scheduler's ``leave_slot`` so the next call runs."""
        self.config = config
        self.limits = config.limits
        self.index = config.shard_index
        self.num_shards = config.num_shards
        self.started = time.monotonic()
        self.data_dir = pathlib.Path(config.data_dir) if config.data_dir else None
        # Lock order: checkpointer.lock -> registry.lock -> Table.lock -> the update path's version lock
        # -> durability.
        self.registry = TableRegistry(self.index, config.limits, config.disk_tiers(), config.disk_dir is not None)
        self.metrics = metrics
        self.durability: durability.Durability = durability.make(config.durability, self.data_dir,
                                          metrics.wal_flush if metrics.enabled else None, before_wait,
                                          config.fsync, config.fsync_interval_s)
        if config.replicas > 1:  # numbered, kept for backups, and acknowledged by the group
            self.durability = ReplicatedLog(self.durability, config.replicas, config.ack,
                                            quorum_timeout_s=config.quorum_timeout_s,
                                            before_wait=functools.partial(before_wait, ordered=False),
                                            epochs_path=self.data_dir / "replica-epochs.json" if self.data_dir else None)
        self.gate = CheckpointGate(f"shard {self.index}")
        self.slots = SlotOwnership(self.index, self.num_shards, config.join, before_wait)
        self.slots.hold_s = config.handover_hold_s + 5
        self.updates = UpdatePath(self.index, self.durability, self.gate, config.checkpoint_hold_s + 5, metrics,
                                  before_wait, self.slots)
        self.sync = SyncCoordinator(self.index, Membership(config.worker_timeout_s, config.limits.max_workers),
                                    self._apply_step, metrics, before_wait)
        self.membership = self.sync.membership
        self.read_only = config.serve_from is not None
        self.serving: Optional[Any] = None  # set by a serving shard's follower
        self.check = Validator(self.slots, self.registry, self.limits, config.serve_from)
        self.checkpointer = Checkpointer(self.index, self.num_shards, self.data_dir, self.registry, self.updates,
                                         self.durability, self.gate, config.checkpoint_hold_s,
                                         config.keep_checkpoints, metrics, self.check.writable)
        self.exports = ExportSessions(self.index, self.registry, self.limits, self.checkpointer,
                                      lambda: self.updates.version, self.check.writable)
        self.migrations = Migrations(self, config.handover_hold_s)
        self.checkpointer.migrations = self.migrations  # cuts and handovers exclude each other
        self.exports.owned, self.exports.arriving = self.slots.owned, lambda: bool(self.migrations.into)
        if self.data_dir is not None and self.durability.mode != "none":
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._recovery().restore()
            self.durability.open()
        elif isinstance(self.durability, ReplicatedLog):  # a member in memory only: records shipped all the same
            self.durability.open()

    def _recovery(self) -> Recovery:
        assert self.data_dir is not None
        return Recovery(self, self.index, self.num_shards, self.data_dir, self.durability, self.checkpointer,
                        self.config.wal_recovery)

    def close(self) -> None:
        """Release files (the write-ahead log, the disk tier); the shard must not be used afterwards."""
        self.durability.close()
        self.registry.close()

    @property
    def version(self) -> int:
        return self.updates.version

    @property
    def stats(self) -> Counters:
        return self.updates.stats.snapshot()

    @property
    def last_checkpoint(self) -> str:
        return self.checkpointer.files.last

    @property
    def last_checkpoint_bytes(self) -> int:
        """Bytes the last checkpoint written or restored holds (its file and the hot rows it spilled)."""
        return self.checkpointer.files.bytes

    def count_error(self) -> None:
        self.updates.stats.count("errors")

    # ---- checks (shard.validation) ------------------------------------------------------

    def check_shard_map(self, shard_index: int, num_shards: int, map_epoch: int = 0, map_id: str = "") -> None:
        self.check.check_shard_map(shard_index, num_shards, map_epoch, map_id)

    def check_reply(self, t: Table, rows: int, itemsize: int) -> None:
        self.check.check_reply(t, rows, itemsize)

    def ownership(self, spec: Union[TableSpec, DenseSpec]) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
        return self.check.ownership(spec)

    def validate_push(self, name: str, ids: np.ndarray, grads: np.ndarray, sync: Optional[SyncPart] = None) -> Table:
        return self.check.push(name, ids, grads, sync)

    def validate_pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[Table, np.ndarray]:
        return self.check.pull_dense(name, row_start, row_end)

    def validate_push_dense(self, name: str, row_start: int, grads: np.ndarray,
                            sync: Optional[SyncPart] = None) -> tuple[Table, np.ndarray]:
        return self.check.push_dense(name, row_start, grads, sync)

    def _record(self, make: Callable[..., durability.Record], *args: Any) -> int:
        """Append the schema change ``make(*args)`` to the durability (callers hold the lock that orders it); a
        ticket to wait on with ``durable=True``. The record is built only when the durability keeps schema
        changes (a dense tensor's values are encoded for the log alone)."""
        return self.durability.append(make(*args)) if self.durability.wants_schema else 0

    # ---- tables ----------------------------------------------------------------------

    def create_table(self, spec: TableSpec, may_create: bool = True) -> bool:
        """Create a table; False if an equal one exists; AlreadyExists if it differs.
        ``may_create=False`` (a trainer's token): only the check, PermissionDenied if it does not exist."""
        with self.registry.lock:
            existing = self.registry.existing(spec.name, dense=False)
            if existing is not None:
                if not same_table(existing.spec, spec):  # type: ignore[arg-type]  # (a table's: existing checked it)
                    raise AlreadyExists(
                        f"table {spec.name!r} exists with a different spec: {existing.spec} (requested {spec})"
                    )
                return False
            self.check.writable(f"creating table {spec.name!r}")
            if not may_create:
                raise PermissionDenied(f"table {spec.name!r} does not exist, and only an admin token may create it")
            self._created(self.registry.new(spec, *self.ownership(spec)))
            ticket = self._record(durability.record_create_table, spec)
        log.info("shard %d: created table %s", self.index, spec.name)
        self.durability.wait(ticket, durable=True)
        return True

    def _created(self, t: Table) -> None:
        """A new table or dense tensor: a delta since an earlier cut copies it whole."""
        t.created_version = self.version + 1
        self.exports.created(t)

    def drop(self, name: str) -> bool:
        self.registry.check_name(name)
        self.check.writable(f"dropping {name!r}")
        with self.registry.lock:
            t = self.registry.pop(name)
            ticket = self._record(durability.record_drop, name) if t is not None else 0
        if t is not None:
            with t.lock:
                t.release()
        self.durability.wait(ticket, durable=True)
        return t is not None

    def describe(self, name: str) -> TableInfo:
        t = self.registry.find(name)
        if t is None:
            raise NotFound(f"unknown table or dense tensor {name!r} on shard {self.index}")
        return _info(t)

    def pull(self, name: str, ids: np.ndarray, itemsize: int = 4, encode: Optional[Callable] = None) -> tuple[Any, int]:
        """Rows of ``ids`` and the version they were read at (``itemsize``: bytes per value on the wire; ``encode``:
        as ``UpdatePath.read`` takes it)."""
        return self.updates.read(self.check.pull(name, ids, itemsize), ids, encode)

    def read_rows(self, t: Table, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of validated ``ids`` of ``t`` and the version they were read at."""
        return self.updates.read(t, ids)

    def apply_push(
        self, t: Table, ids: np.ndarray, grads: np.ndarray, pulled_version: Optional[int], client_id: str, seq: int,
        sync: Optional[SyncPart] = None, raw: Optional[Any] = None,
    ) -> PushResult:
        """Apply a validated push (``validate_push`` / ``validate_push_dense``): the gradients
        of ``ids`` (duplicates summed) with the table's optimizer.

        ``raw`` is the serialized PushRequest when the caller has it: it becomes
        the write-ahead log record as is. For a table with a SyncPolicy, ``sync``
        is required (see ``SyncCoordinator.push`` for when the call returns).
        """
        check_sync(t, sync)
        if not self.updates.once(client_id, seq):
            return self.duplicate_push()
        try:
            if sync is not None:
                step = self.sync.push(t, ids, grads, sync)
                self.updates.seen.settle(client_id, seq)  # in its step's buffer, as a crash finds it
                if step.late or step.recorded_only:
                    return PushResult(self.version, 0, False, late=step.late)
                return PushResult(step.version, 0, False, missing_ranks=step.missing_ranks)
            record: durability.Record = (0, b"")
            if self.durability.wants_records:
                row_start = int(ids[0]) if t.is_dense else None
                record = durability.record_push(t.spec.name, ids, grads, client_id, seq, row_start, raw)
            version, staleness = self.updates.apply(t, ids, grads, pulled_version, record, claim=(client_id, seq))
        except BaseException as e:
            self.updates.release(client_id, seq, e)
            raise
        return PushResult(version, staleness, False)

    def duplicate_push(self) -> PushResult:
        """The answer to a push applied before (its resend), counted; given once every record logged so far is
        acknowledged by the durability policy, the original's with them (its own wait may have failed: a quorum
        not reached in time, its client told UNAVAILABLE and resending)."""
        self.updates.stats.count("duplicates")
        self.durability.wait_all()
        return PushResult(self.version, 0, True)

    def _apply_step(self, t: Table, ids: np.ndarray, grads: np.ndarray) -> int:
        """The update path of a complete synchronous step: logged as a row push, even for a dense tensor."""
        record = durability.record_push(t.spec.name, ids, grads) if self.durability.wants_records else (0, b"")
        return self.updates.apply(t, ids, grads, None, record)[0]

    def heartbeat(
        self, rank: int, world_size: int, clock: int, leaving: bool,
        wait_min_clock: Optional[int] = None, wait_s: float = 0.0, active: Callable[[], bool] = lambda: True,
        incarnation: int = 0, generation: int = 0,
    ) -> tuple[int, list[int], list[int]]:
        """Record a worker's liveness and clock (``incarnation``, ``generation``: its client's and its group's start,
        ``Membership.heartbeat``); optionally wait for the slowest one (while ``active()``)."""
        return self.sync.heartbeat(rank, world_size, clock, leaving, wait_min_clock, wait_s, active, incarnation,
                                   generation)

    def assign(self, name: str, ids: np.ndarray, values: np.ndarray) -> int:
        """Set the rows of ``ids`` (unique) to ``values``, creating absent ones: a loaded state dict. Returns
        the shard version after it."""
        t, ids, values = self.check.assign(name, ids, values)
        record = durability.record_assign(name, ids, values) if self.durability.wants_records else (0, b"")
        return self.updates.assign(t, ids, values, record)

    def sweep(self, max_slots: int = 65536) -> int:
        """Reclaim expired rows: one slice of at most ``max_slots`` rows of each table with a TTL (the
        shard's sweeper calls this about once a second). How many rows were evicted."""
        return sum(self.updates.sweep(t, max_slots) for t in self.registry.tables() if t.expires)

    # ---- dense tensors ---------------------------------------------------------------

    def register_dense(self, spec: DenseSpec, row_start: int, values: Optional[np.ndarray],
                       may_create: bool = True) -> tuple[bool, bool]:
        """Create or verify a dense tensor; initialise rows from ``values`` if not done before.
        ``may_create=False`` (a trainer's token): PermissionDenied if it does not exist."""
        self.limits.check(f"{spec.name}: dense tensor elements", spec.rows * spec.cols, "max_dense_elements")
        if not 0 <= row_start <= spec.rows:
            raise OutOfRange(f"{spec.name}: row_start {row_start} outside [0, {spec.rows}]")
        with self.registry.lock:
            existing = self.registry.existing(spec.name, dense=True)
            created = existing is None
            if existing is not None:
                if existing.spec != spec:
                    raise AlreadyExists(
                        f"dense tensor {spec.name!r} exists with a different spec: {existing.spec} (requested {spec})"
                    )
                t = existing
            elif not may_create:
                raise PermissionDenied(f"dense tensor {spec.name!r} does not exist, and only an admin token may create it")
            else:
                self.check.writable(f"registering dense tensor {spec.name!r}")
                t = self.registry.new(spec, *self.ownership(spec))
                self._created(t)
        if values is None or values.size == 0 or self.read_only:  # a serving shard's tensors hold the export's values
            if created:
                self.durability.wait(self._record(durability.record_register_dense, spec), durable=True)
            return created, False
        if values.ndim != 2 or values.shape[1] != t.dim:
            raise InvalidArgument(f"{spec.name}: values must have shape [rows, {t.dim}], got {list(values.shape)}")
        ids = np.arange(row_start, row_start + values.shape[0], dtype=np.int64)
        t.check_ids(ids)
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{spec.name}: initial values contain NaN or Inf")
        # Log order = application order for first-writer-wins; a replica group's member that is not its primary applies
        # nothing (origin: NotPrimary before the assign; it had set the rows, then found it could record nothing).
        with self.registry.lock, self.durability.origin():
            initialized = t.assign(ids, values, stamp=self.version + 1)
            ticket = self._record(durability.record_register_dense, spec, row_start, values) if initialized or created else 0
        self.durability.wait(ticket, durable=True)
        return created, initialized

    def pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[np.ndarray, int]:
        return self.read_rows(*self.validate_pull_dense(name, row_start, row_end))

    # ---- info ------------------------------------------------------------------------

    def info(self) -> ShardInfo:
        with self.registry.lock:
            tables = self.registry.tables()
            version = self.version
        return ShardInfo(
            shard_index=self.index, num_shards=self.num_shards, version=version,
            tables=[_info(t) for t in tables], uptime_s=time.monotonic() - self.started,
            stats=self.stats, durability=self.durability.mode, last_checkpoint=self.last_checkpoint,
            export_floor=self.exports.delta_floor(), serving=self.serving,
        )


def _info(t: Table) -> TableInfo:
    with t.lock:
        n, nbytes, c = t.n, t.nbytes(), t.counts
        tier: dict[str, int] = {}
        if t.hot is not None:
            h = t.hot
            tier = dict(hot_rows=n, disk_rows=h.disk_rows, disk_bytes=h.store.disk_bytes(), tier_hits=h.counts.hits,
                        tier_misses=h.counts.misses, promoted=h.counts.promoted, written_back=h.counts.written_back)
            n = h.total_rows
        return TableInfo(spec=t.spec, num_rows=n, bytes=nbytes, payload_bytes=n * t.dim * 4,
                         admitted=c.admitted, rejected=c.rejected, evicted_ttl=c.evicted_ttl,
                         evicted_capacity=c.evicted_capacity,
                         sketch_bytes=t.sketch.nbytes if t.sketch is not None else 0, **tier)
