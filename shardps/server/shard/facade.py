"""One shard: a small facade over the parts that hold its state.

``Shard`` is plain Python over numpy arrays; it takes and returns plain values and
raises the exception types of ``shardps.core.errors`` (the gRPC servicer converts
to and from protobuf). Its parts, each with one job:

- ``TableRegistry`` (registry.py): tables and dense tensors by name, limits, memory budget;
- ``UpdatePath`` (updates.py): the one way rows change (live pushes, synchronous
  steps, log replay): version counter, exactly-once records, staleness, counters;
- ``SyncCoordinator`` (sync.py): synchronous steps and worker membership, applying
  each complete step through the update path;
- ``Durability`` (durability.py): ``none``, ``checkpoint`` or ``log``;
- ``CheckpointGate`` (gate.py): holds updates back during a two-phase checkpoint.

This module keeps what ties them together: validation of requests against a
table, snapshots, checkpoints, restore and replay.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
import uuid
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import numpy as np

from shardps.core.errors import (
    AlreadyExists,
    ExportGap,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ReadOnly,
    ResourceExhausted,
    Unavailable,
    WrongShard,
)
from shardps.core.routing import dense_rows_owned, shard_of_ids
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.durability import checkpoints as ckpt
from shardps.server.durability import modes as dur
from shardps.server.durability import wal as wal_mod
from shardps.server.durability.gate import CheckpointGate
from shardps.server.shard.limits import Limits
from shardps.server.shard.metrics import NO_METRICS, NullMetrics
from shardps.server.shard.registry import TableRegistry
from shardps.server.shard.sync import Membership, SyncCoordinator, SyncPart, check_sync
from shardps.server.shard.updates import Counters, PushResult, UpdatePath
from shardps.server.storage.bounded import RemovalLog
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)

DURABILITY_LEVELS = dur.MODES
WAL_RECOVERY = ("fail", "truncate")
MAX_DENSE_CHUNKS = 1 << 16


class ShardMapMismatch(Exception):
    """A checkpoint on disk was written by a shard with another (index, count)."""


class LogReplayError(Exception):
    """A write-ahead log record that holds an acknowledged update cannot be replayed."""


@dataclass(frozen=True)
class ShardConfig:
    """Configuration of one shard.

    Args:
        shard_index: this shard's index in [0, num_shards).
        num_shards: number of shards in the cluster.
        data_dir: directory for checkpoints and the write-ahead log (None: in memory only).
        durability: "checkpoint" (a crash loses the updates since the last
            checkpoint), "log" (every acknowledged push is fsynced to a
            write-ahead log first; a crash loses nothing acknowledged) or
            "none" (no files).
        keep_checkpoints: checkpoints kept on disk (the newest and previous ones).
        checkpoint_hold_s: longest time a prepared two-phase checkpoint holds
            pushes back before the shard gives up on it and resumes.
        worker_timeout_s: a worker silent (no heartbeat, no push) for this
            long counts as gone: synchronous steps and SSP stop waiting for it.
        limits: request and memory limits (see ``shardps.server.limits.Limits``).
        wal_recovery: what a write-ahead log record that cannot be replayed does
            on start: "fail" (the shard does not start, and says which record and
            how to recover) or "truncate" (that record and every later one are
            moved aside to a ``.corrupt`` file, logged as lost, and the shard starts).
        serve_from: an export directory: the shard serves it read-only and follows its deltas
            (``shardps.server.exports.serving``); pushes and table changes are refused.
    """

    shard_index: int = 0
    num_shards: int = 1
    data_dir: Optional[str] = None
    durability: str = "checkpoint"
    keep_checkpoints: int = 2
    checkpoint_hold_s: float = 30.0
    worker_timeout_s: float = 10.0
    limits: Limits = Limits()
    wal_recovery: str = "fail"
    serve_from: Optional[str] = None

    def __post_init__(self) -> None:
        if self.serve_from is not None and self.data_dir is not None:
            raise ValueError("a serving shard (--serve-from) keeps no data dir: its state is the export's")
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard index {self.shard_index} is not in [0, {self.num_shards})")
        if self.durability not in DURABILITY_LEVELS:
            raise ValueError(f"durability must be one of {DURABILITY_LEVELS}, got {self.durability!r}")
        if self.wal_recovery not in WAL_RECOVERY:
            raise ValueError(f"wal_recovery must be one of {WAL_RECOVERY}, got {self.wal_recovery!r}")
        if self.keep_checkpoints < 2:
            raise ValueError("keep_checkpoints must be >= 2 (the previous good one is kept)")


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


@dataclass
class ExportedCopy:
    """One table of an export's copy: its spec, whether the copy is the whole table, and its arrays
    (``ids``, ``values``; ``steps`` and ``state.*`` with optimizer state; ``tombstones`` in a delta)."""

    spec: Union[TableSpec, DenseSpec]
    full: bool
    arrays: dict[str, np.ndarray]


@dataclass
class _Export:
    version: int
    tables: dict[str, ExportedCopy]
    touched: float


@dataclass
class _Checkpoints:
    """Which checkpoint files this shard wrote, and the durability cut the previous one covers."""

    seqno: int = 0
    last: str = ""
    previous_cut: int = 0


class Shard:
    """Tables and dense tensors owned by one shard, with its version counter."""

    def __init__(self, config: ShardConfig, metrics: NullMetrics = NO_METRICS,
                 before_wait: Callable[[], None] = lambda: None) -> None:
        """``before_wait`` is called on a request's thread before it waits (a log flush, a synchronous step, a
        checkpoint's hold): the gRPC face passes its fair scheduler's ``leave_slot`` so the next call runs."""
        self.config = config
        self.limits = config.limits
        self.index = config.shard_index
        self.num_shards = config.num_shards
        self.started = time.monotonic()
        self.data_dir = pathlib.Path(config.data_dir) if config.data_dir else None
        # Lock order: registry.lock -> Table.lock -> the update path's version lock -> durability.
        self.registry = TableRegistry(self.index, config.limits)
        self.metrics = metrics
        self.durability = dur.make(config.durability, self.data_dir, metrics.wal_flush if metrics.enabled else None,
                                   before_wait)
        self.gate = CheckpointGate(f"shard {self.index}")
        self.updates = UpdatePath(self.index, self.durability, self.gate, config.checkpoint_hold_s + 5, metrics,
                                  before_wait)
        self.sync = SyncCoordinator(self.index, Membership(config.worker_timeout_s, config.limits.max_workers),
                                    self._apply_step, metrics, before_wait)
        self.membership = self.sync.membership
        self._ckpt_lock = threading.Lock()
        self._ckpts = _Checkpoints()
        self.read_only = config.serve_from is not None
        self.serving: Optional[Any] = None  # set by a serving shard's follower
        self.export_floor: Optional[int] = None  # removals are tracked since this version (None: not yet)
        self._exports: dict[str, _Export] = {}
        if self.data_dir is not None and self.durability.mode != "none":
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._restore()
            self.durability.open()

    def close(self) -> None:
        """Release files (the write-ahead log); the shard must not be used afterwards."""
        self.durability.close()

    @property
    def version(self) -> int:
        return self.updates.version

    @property
    def stats(self) -> Counters:
        return self.updates.stats.snapshot()

    @property
    def last_checkpoint(self) -> str:
        return self._ckpts.last

    def count_error(self) -> None:
        self.updates.stats.count("errors")

    # ---- lookups and checks ----------------------------------------------------------

    def check_shard_map(self, shard_index: int, num_shards: int) -> None:
        """Refuse requests addressed to another (index, count) than this shard's (count 0: not given)."""
        if num_shards == 0:
            return
        if (shard_index, num_shards) != (self.index, self.num_shards):
            raise WrongShard(
                f"request meant for shard {shard_index} of {num_shards} reached "
                f"shard {self.index} of {self.num_shards}: the client's address list does not match the cluster "
                f"(expected shard map: index {self.index}, {self.num_shards} shards)"
            )

    def _check_ids_count(self, n: int) -> None:
        self.limits.check("ids in one request", n, "max_ids_per_request")

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
        if isinstance(spec, DenseSpec):
            owned = dense_rows_owned(spec.name, spec.rows, spec.chunk_rows, self.num_shards, self.index)

            def owns(ids: np.ndarray, owned: np.ndarray = owned) -> np.ndarray:
                return owned[ids]

            return owns, int(owned.sum())
        return self._owns_ids, 1024 if spec.num_embeddings is None else spec.num_embeddings // self.num_shards + 1024

    def _owns_ids(self, ids: np.ndarray) -> np.ndarray:
        return shard_of_ids(ids, self.num_shards) == self.index

    def _record(self, make: Callable[..., dur.Record], *args: Any) -> int:
        """Append the change ``make(*args)`` to the durability (callers hold the lock that orders it); a ticket
        to wait on. The record is built only when the durability keeps records (a dense tensor's values are
        encoded for the log alone)."""
        return self.durability.append(make(*args)) if self.durability.wants_records else 0

    # ---- tables ----------------------------------------------------------------------

    def create_table(self, spec: TableSpec, may_create: bool = True) -> bool:
        """Create a table; False if an equal one exists; AlreadyExists if it differs.
        ``may_create=False`` (a trainer's token): only the check, PermissionDenied if it does not exist."""
        with self.registry.lock:
            existing = self.registry.lookup(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise AlreadyExists(
                        f"table {spec.name!r} exists with a different spec: {existing.spec} (requested {spec})"
                    )
                return False
            self._writable(f"creating table {spec.name!r}")
            if not may_create:
                raise PermissionDenied(f"table {spec.name!r} does not exist, and only an admin token may create it")
            self._created(self.registry.new(spec, *self.ownership(spec)))
            ticket = self._record(dur.record_create_table, spec)
        log.info("shard %d: created table %s", self.index, spec.name)
        self.durability.wait(ticket)
        return True

    def _writable(self, what: str) -> None:
        """Refuse a change on a serving shard."""
        if self.read_only:
            raise ReadOnly(f"shard {self.index} serves the export {self.config.serve_from} read-only (--serve-from): "
                           f"{what} refused; send it to the training cluster")

    def _created(self, t: Table) -> None:
        """A new table or dense tensor: a delta since an earlier cut copies it whole; while an export follows,
        its evictions are tracked."""
        t.created_version = self.version + 1
        if self.export_floor is not None and t.eviction is not None:
            t.removals = RemovalLog(self.version)

    def drop(self, name: str) -> bool:
        self.registry.check_name(name)
        self._writable(f"dropping {name!r}")
        with self.registry.lock:
            t = self.registry.pop(name)
            ticket = self._record(dur.record_drop, name) if t is not None else 0
        if t is not None:
            with t.lock:
                t.release()
        self.durability.wait(ticket)
        return t is not None

    def describe(self, name: str) -> TableInfo:
        t = self.registry.find(name)
        if t is None:
            raise NotFound(f"unknown table or dense tensor {name!r} on shard {self.index}")
        return self._info(t)

    @staticmethod
    def _info(t: Table) -> TableInfo:
        with t.lock:
            n, nbytes, c = t.n, t.nbytes(), t.counts
            return TableInfo(spec=t.spec, num_rows=n, bytes=nbytes, payload_bytes=n * t.dim * 4,
                             admitted=c.admitted, rejected=c.rejected, evicted_ttl=c.evicted_ttl,
                             evicted_capacity=c.evicted_capacity,
                             sketch_bytes=t.sketch.nbytes if t.sketch is not None else 0)

    def pull(self, name: str, ids: np.ndarray, itemsize: int = 4) -> tuple[np.ndarray, int]:
        """Rows of ``ids`` and the version they were read at (``itemsize``: bytes per value on the wire)."""
        t = self.registry.get(name, dense=False)
        self._check_ids_count(ids.shape[0] if ids.ndim else 1)
        t.check_ids(ids)
        self.check_reply(t, ids.shape[0], itemsize)
        return self.read_rows(t, ids)

    def read_rows(self, t: Table, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of validated ``ids`` of ``t`` and the version they were read at."""
        return self.updates.read(t, ids)

    def validate_push(self, name: str, ids: np.ndarray, grads: np.ndarray, sync: Optional[SyncPart] = None) -> Table:
        """Check a row push without applying it; returns its table."""
        t = self.registry.get(name, dense=False)
        self._writable(f"a push to {name!r}")
        self._check_ids_count(ids.shape[0] if ids.ndim else 1)
        if sync is None or ids.size:  # a synchronous worker may contribute nothing to a step
            t.check_ids(ids)
        elif ids.ndim != 1:
            raise InvalidArgument(f"{name}: ids must be 1-D, got shape {list(ids.shape)}")
        t.check_grads(ids, grads)
        check_sync(t, sync)
        return t

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
            return PushResult(self.version, 0, True)
        try:
            if sync is not None:
                step = self.sync.push(t, ids, grads, sync)
                if step.late or step.recorded_only:
                    return PushResult(self.version, 0, False, late=step.late)
                return PushResult(step.version, 0, False, missing_ranks=step.missing_ranks)
            record: dur.Record = (0, b"")
            if self.durability.wants_records:
                row_start = int(ids[0]) if t.is_dense else None
                record = dur.record_push(t.spec.name, ids, grads, client_id, seq, row_start, raw)
            version, staleness = self.updates.apply(t, ids, grads, pulled_version, record)
        except BaseException as e:
            self.updates.release(client_id, seq, e)
            raise
        return PushResult(version, staleness, False)

    def _apply_step(self, t: Table, ids: np.ndarray, grads: np.ndarray) -> int:
        """The update path of a complete synchronous step: logged as a row push, even for a dense tensor."""
        record = dur.record_push(t.spec.name, ids, grads) if self.durability.wants_records else (0, b"")
        return self.updates.apply(t, ids, grads, None, record)[0]

    def heartbeat(
        self, rank: int, world_size: int, clock: int, leaving: bool,
        wait_min_clock: Optional[int] = None, wait_s: float = 0.0, active: Callable[[], bool] = lambda: True,
    ) -> tuple[int, list[int], list[int]]:
        """Record a worker's liveness and clock; optionally wait for the slowest one (while ``active()``)."""
        return self.sync.heartbeat(rank, world_size, clock, leaving, wait_min_clock, wait_s, active)

    # ---- dense tensors ---------------------------------------------------------------

    def register_dense(self, spec: DenseSpec, row_start: int, values: Optional[np.ndarray],
                       may_create: bool = True) -> tuple[bool, bool]:
        """Create or verify a dense tensor; initialise rows from ``values`` if not done before.
        ``may_create=False`` (a trainer's token): PermissionDenied if it does not exist."""
        self.limits.check(f"{spec.name}: dense tensor elements", spec.rows * spec.cols, "max_dense_elements")
        if spec.chunk_rows and -(-spec.rows // spec.chunk_rows) > MAX_DENSE_CHUNKS:
            raise InvalidArgument(f"{spec.name}: chunk_rows {spec.chunk_rows} makes more than {MAX_DENSE_CHUNKS:,} "
                                  f"chunks of {spec.rows:,} rows")
        if not 0 <= row_start <= spec.rows:
            raise OutOfRange(f"{spec.name}: row_start {row_start} outside [0, {spec.rows}]")
        with self.registry.lock:
            existing = self.registry.lookup(spec.name)
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
                self._writable(f"registering dense tensor {spec.name!r}")
                owns, expected = self.ownership(spec)
                t = self.registry.new(spec, owns, expected)
                self._created(t)
        if values is None or values.size == 0 or self.read_only:  # a serving shard's tensors hold the export's values
            if created:
                self.durability.wait(self._record(dur.record_register_dense, spec))
            return created, False
        if values.ndim != 2 or values.shape[1] != t.dim:
            raise InvalidArgument(f"{spec.name}: values must have shape [rows, {t.dim}], got {list(values.shape)}")
        ids = np.arange(row_start, row_start + values.shape[0], dtype=np.int64)
        t.check_ids(ids)
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{spec.name}: initial values contain NaN or Inf")
        with self.registry.lock:  # log order = application order for first-writer-wins
            initialized = t.assign(ids, values, stamp=self.version + 1)
            ticket = self._record(dur.record_register_dense, spec, row_start, values) if initialized or created else 0
        self.durability.wait(ticket)
        return created, initialized

    def _dense_rows(self, t: Table, row_start: int, row_end: int) -> np.ndarray:
        spec = t.spec
        assert isinstance(spec, DenseSpec)
        if not 0 <= row_start < row_end <= spec.rows:
            raise OutOfRange(f"{spec.name}: rows [{row_start}, {row_end}) outside [0, {spec.rows})")
        ids = np.arange(row_start, row_end, dtype=np.int64)
        t.check_ids(ids)
        return ids

    def validate_pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[Table, np.ndarray]:
        """Check a dense pull without reading it; returns its table and row ids."""
        t = self.registry.get(name, dense=True)
        ids = self._dense_rows(t, row_start, row_end)
        t.check_present(ids)  # here, so a PushBatch refused for it applies none of its pushes
        return t, ids

    def pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[np.ndarray, int]:
        return self.read_rows(*self.validate_pull_dense(name, row_start, row_end))

    def validate_push_dense(self, name: str, row_start: int, grads: np.ndarray,
                            sync: Optional[SyncPart] = None) -> tuple[Table, np.ndarray]:
        """Check a dense push without applying it; returns its table and row ids."""
        t = self.registry.get(name, dense=True)
        self._writable(f"a push to {name!r}")
        if grads.ndim != 2:
            raise InvalidArgument(f"{name}: grads must be 2-D [rows, {t.dim}], got shape {list(grads.shape)}")
        ids = self._dense_rows(t, row_start, row_start + grads.shape[0])
        t.check_grads(ids, grads)
        check_sync(t, sync)
        return t, ids

    # ---- info ------------------------------------------------------------------------

    def info(self) -> ShardInfo:
        with self.registry.lock:
            tables = self.registry.tables()
            version = self.version
        return ShardInfo(
            shard_index=self.index, num_shards=self.num_shards, version=version,
            tables=[self._info(t) for t in tables], uptime_s=time.monotonic() - self.started,
            stats=self.stats, durability=self.durability.mode, last_checkpoint=self._ckpts.last,
            export_floor=self.delta_floor(), serving=self.serving,
        )

    # ---- checkpoints ----------------------------------------------------------------

    def prepare_checkpoint(self, hold_s: Optional[float] = None) -> None:
        """Phase 1 of a cluster-wide checkpoint: hold new pushes back, let running ones finish.

        The hold ends with ``checkpoint`` (phase 2), ``abort_checkpoint``, or by
        itself after ``hold_s`` (default ``config.checkpoint_hold_s``) so a
        coordinator that died cannot stall training.
        """
        self._require_data_dir()
        self.hold_pushes(hold_s)

    def hold_pushes(self, hold_s: Optional[float] = None) -> None:
        """Hold new pushes back and let running ones finish: phase 1 of a cluster-wide cut (checkpoint or
        export), ended by phase 2, an abort, or after ``hold_s`` (at most ``config.checkpoint_hold_s``)."""
        self._writable("a checkpoint or export")
        hold = self.config.checkpoint_hold_s if not hold_s else min(hold_s, self.config.checkpoint_hold_s)
        with self._ckpt_lock:
            self.gate.close()
            for t in self.registry.tables():  # pushes that passed the gate before it closed finish first
                with t.lock:
                    pass
            self.gate.hold(hold)

    def abort_checkpoint(self) -> None:
        with self._ckpt_lock:
            self.gate.open()

    def _require_data_dir(self) -> pathlib.Path:
        self._writable("a checkpoint")
        if self.data_dir is None or self.durability.mode == "none":
            raise InvalidArgument(f"shard {self.index} has no data dir: start it with --data-dir to checkpoint")
        return self.data_dir

    def checkpoint(self, checkpoint_id: str = "", prepared: bool = False) -> tuple[str, int, int, float]:
        """Write a consistent snapshot to the data dir: (id, version, bytes, pause seconds).

        With ``prepared`` this is phase 2 of a cluster-wide checkpoint: pushes
        have been held since ``prepare_checkpoint`` and resume once the state
        is copied in memory, before the file is written.
        """
        data_dir = self._require_data_dir()
        checkpoint_id = checkpoint_id or uuid.uuid4().hex[:12]
        if not all(c.isalnum() or c in "-_" for c in checkpoint_id) or len(checkpoint_id) > 64:
            raise InvalidArgument(f"invalid checkpoint id {checkpoint_id!r}: use up to 64 of [A-Za-z0-9_-]")
        started = time.perf_counter()
        with self._ckpt_lock:
            if prepared and self.gate.is_open:
                raise Unavailable(f"shard {self.index}: checkpoint {checkpoint_id} was not prepared or its hold expired")
            try:
                meta, arrays, pause = self.snapshot()
            finally:
                if prepared:
                    self.gate.open()
            meta["checkpoint_id"] = checkpoint_id
            self._ckpts.seqno += 1
            meta["seqno"] = self._ckpts.seqno
            size = ckpt.write(data_dir / ckpt.file_name(self._ckpts.seqno, checkpoint_id), meta, arrays)
            ckpt.prune(data_dir, self.config.keep_checkpoints)
            # Records are kept back to the previous checkpoint, the fallback if this one breaks.
            self.durability.checkpointed(self._ckpts.previous_cut)
            self._ckpts.previous_cut = meta["wal_segment"]
            self._ckpts.last = checkpoint_id
        self.metrics.checkpoint(time.perf_counter() - started, pause)
        log.info("shard %d: checkpoint %s at version %d (%d bytes, pause %.3fs)",
                 self.index, checkpoint_id, meta["version"], size, pause)
        return checkpoint_id, meta["version"], size, pause

    # ---- exports (shardps.core.exports) ---------------------------------------------------

    MAX_EXPORTS = 4  # copies kept at once
    EXPORT_IDLE_S = 600.0  # a copy nobody read for this long is freed

    def delta_floor(self) -> int:
        """The oldest cut a delta may follow (-1: no export followed yet, so none): where removal tracking
        started, or later where a table's removals overflowed."""
        if self.export_floor is None:
            return -1
        floors = [t.removals.floor for t in self.registry.tables() if t.removals is not None]
        return max([self.export_floor, *floors])

    def export_begin(self, export_id: str, names: list[str], optimizer_state: bool, since: Optional[int],
                     prepared: bool = False) -> tuple[int, dict[str, ExportedCopy]]:
        """Copy tables for an export at one version (phase 2 after ``hold_pushes`` when ``prepared``): every
        table (or those of ``names``) whole, or with ``since`` what changed after that version, with
        tombstones. The copy is kept as ``export_id`` for ``export_read``. Returns (version, copies)."""
        self._writable("an export")
        if not export_id or len(export_id) > 64 or not all(c.isalnum() or c in "-_" for c in export_id):
            raise InvalidArgument(f"invalid export id {export_id!r}: use 1 to 64 of [A-Za-z0-9_-]")
        self._free_idle_exports()
        if len(self._exports) >= self.MAX_EXPORTS and export_id not in self._exports:
            raise ResourceExhausted(f"shard {self.index}: {self.MAX_EXPORTS} exports are being read already")
        with self._ckpt_lock:
            if prepared and self.gate.is_open:
                raise Unavailable(f"shard {self.index}: export {export_id} was not prepared or its hold expired")
            try:
                with self._all_locked() as (tables, _):
                    version = self.version
                    wanted = set(names)
                    missing = wanted - {name for name, _ in tables}
                    if missing and since is None:
                        raise NotFound(f"shard {self.index}: no table or dense tensor {sorted(missing)[0]!r} to export")
                    chosen = [(name, t) for name, t in tables if not wanted or name in wanted]
                    if since is not None:
                        floor = self.delta_floor()
                        if floor < 0 or not floor <= since <= version:
                            why = ("it has not been exported since it started" if floor < 0 else
                                   f"it keeps removals since version {floor} only" if since < floor else
                                   f"it is at version {version}, before that cut (its state was lost)")
                            raise ExportGap(f"shard {self.index}: no delta since version {since}: {why}; "
                                            "write a new base")
                    copies = {}
                    for name, t in chosen:
                        full = since is None or t.created_version > since
                        copies[name] = ExportedCopy(t.spec, full, t.export_copy(version, None if full else since,
                                                                                optimizer_state))
                        if since is not None and t.removals is not None:
                            t.removals.trim(since)
                    if self.export_floor is None:  # from this cut on, evictions are kept for the next delta
                        self.export_floor = version
                    for _, t in tables:
                        if t.eviction is not None and t.removals is None:
                            t.removals = RemovalLog(version)
            finally:
                if prepared:
                    self.gate.open()
        self._exports[export_id] = _Export(version, copies, time.monotonic())
        rows = sum(c.arrays["ids"].shape[0] for c in copies.values())
        log.info("shard %d: export %s at version %d: %d tables, %d rows%s", self.index, export_id, version,
                 len(copies), rows, "" if since is None else f" changed since version {since}")
        return version, copies

    def export_read(self, export_id: str, name: str, offset: int, max_rows: int,
                    tombstones: bool = False) -> dict[str, np.ndarray]:
        """A page of an export's copy of table ``name``: rows [offset, offset + max_rows) (at most what fits in
        a message), or with ``tombstones`` that page of its tombstones (as ``ids``)."""
        export = self._exports.get(export_id)
        if export is None:
            raise NotFound(f"shard {self.index}: no export {export_id!r} (ended, or freed after "
                           f"{self.EXPORT_IDLE_S:.0f} s unread)")
        export.touched = time.monotonic()
        copy = export.tables.get(name)
        if copy is None:
            raise NotFound(f"shard {self.index}: export {export_id} has no table {name!r}")
        if tombstones:
            ids = copy.arrays.get("tombstones", np.zeros(0, np.int64))
            page = max(1, self.limits.max_message_bytes // 16)
            return {"ids": ids[offset:offset + min(max_rows or page, page)]}
        per_row = sum(a[:1].nbytes for k, a in copy.arrays.items() if k != "tombstones")
        page = max(1, (self.limits.max_message_bytes - 65536) // max(per_row, 1))
        end = offset + min(max_rows or page, page)
        return {k: a[offset:end] for k, a in copy.arrays.items() if k != "tombstones"}

    def export_end(self, export_id: str) -> None:
        self._exports.pop(export_id, None)

    def _free_idle_exports(self) -> None:
        now = time.monotonic()
        for eid, e in list(self._exports.items()):
            if now - e.touched > self.EXPORT_IDLE_S:
                log.warning("shard %d: export %s freed unfinished (unread for %.0f s)", self.index, eid, now - e.touched)
                self._exports.pop(eid, None)

    # ---- assignments ------------------------------------------------------------------------

    def assign(self, name: str, ids: np.ndarray, values: np.ndarray) -> int:
        """Set the rows of ``ids`` (unique) to ``values``, creating absent ones: a loaded state dict. Returns
        the shard version after it."""
        t = self.registry.get(name, dense=False)
        self._writable(f"assigning rows of {name!r}")
        self._check_ids_count(ids.shape[0] if ids.ndim else 1)
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
        record = dur.record_assign(name, ids, values) if self.durability.wants_records else (0, b"")
        return self.updates.assign(t, ids, values, record)

    @contextmanager
    def _all_locked(self) -> Iterator[tuple[list[tuple[str, Table]], float]]:
        """Every (name, table) by name, with the registry lock and every table's lock held (one version), and
        when the table locks began to be taken (``time.perf_counter``: from then on pushes wait)."""
        with ExitStack() as stack:
            stack.enter_context(self.registry.lock)
            tables = self.registry.sorted_items()
            t0 = time.perf_counter()
            for _, t in tables:
                stack.enter_context(t.lock)
            yield tables, t0

    def snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray], float]:
        """Copy every table at one consistent version: (checkpoint header, arrays, seconds pushes waited)."""
        with self._all_locked() as (tables, t0):
            meta: dict[str, Any] = {
                "shard_index": self.index, "num_shards": self.num_shards, "version": self.version,
                "seen": self.updates.seen.to_json(), "tables": [], "wal_segment": self.durability.cut(),
            }
            arrays: dict[str, np.ndarray] = {}
            for i, (_, t) in enumerate(tables):
                meta["tables"].append(ckpt.spec_entry(t.spec))
                for k, v in t.snapshot().items():
                    arrays[f"t{i}.{k}"] = v
            pause = time.perf_counter() - t0
        return meta, arrays, pause

    def _restore(self) -> None:
        """Load the newest valid checkpoint, then replay the records written after it."""
        assert self.data_dir is not None
        first_segment = 0
        for loaded in ckpt.load_newest(self.data_dir):
            meta = loaded.meta
            if (meta["shard_index"], meta["num_shards"]) != (self.index, self.num_shards):
                raise ShardMapMismatch(
                    f"checkpoint {loaded.path} belongs to shard {meta['shard_index']} of {meta['num_shards']}, "
                    f"but this shard is {self.index} of {self.num_shards}; reshard it with "
                    f"`shardps reshard` or point --data-dir elsewhere"
                )
            self.load_state(meta, loaded.arrays)
            self._ckpts.seqno = int(meta["seqno"])
            self._ckpts.last = meta["checkpoint_id"]
            first_segment = self._ckpts.previous_cut = int(meta.get("wal_segment", 0))
            log.info("shard %d: restored checkpoint %s (version %d, %d tables)",
                     self.index, loaded.path.name, self.version, len(self.registry))
            break
        replayed = 0
        try:
            for record in self.durability.records(first_segment):
                try:
                    self._replay(dur.read_record(record.kind, record.payload))
                except Exception as e:  # noqa: BLE001 - any record that cannot be replayed stops the start loudly
                    self._unreplayable(record, e)
                    break
                replayed += 1
        except wal_mod.CorruptLog as e:
            self._unreplayable(e.record, e)
        if replayed:
            log.info("shard %d: replayed %d write-ahead log records (version %d)", self.index, replayed, self.version)

    def _unreplayable(self, record: wal_mod.Record, error: Exception) -> None:
        """A record that cannot be replayed: stop the start (the default), or with ``wal_recovery="truncate"``
        move it and every later record aside, saying how many acknowledged records are lost."""
        assert self.data_dir is not None
        where = (f"write-ahead log {record.path} record {record.number} at byte {record.offset} "
                 f"({wal_mod.KIND_NAMES.get(record.kind, 'damaged')})")
        if self.config.wal_recovery != "truncate":
            raise LogReplayError(
                f"shard {self.index}: {where} cannot be replayed: {error}. It and the records after it hold "
                f"acknowledged updates, so the shard does not start. To start anyway, without that record and "
                f"every later one (they are kept in a .corrupt file), restart with --wal-recovery truncate"
            ) from error
        aside, lost = wal_mod.truncate_at(self.data_dir, record)
        log.error("shard %d: %s cannot be replayed (%s); --wal-recovery truncate: %d records from there on "
                  "(acknowledged updates) moved to %s and NOT applied", self.index, where, error, lost, aside)

    def _replay(self, change: dur.Change) -> None:
        """Re-apply one stored change during restore, through the same paths as live requests."""
        if isinstance(change, dur.CreateTable):
            self.create_table(change.spec)
        elif isinstance(change, dur.RegisterDense):
            self.register_dense(change.spec, change.row_start, change.values)
        elif isinstance(change, dur.Drop):
            self.drop(change.name)
        elif isinstance(change, dur.Assign):
            found = self.registry.find(change.name)
            if found is None:
                raise NotFound(f"log record assigns to unknown table {change.name!r}")
            found.check_ids(change.ids)
            self.updates.assign(found, change.ids, change.values, replaying=True)
        elif isinstance(change, dur.Evict):
            found = self.registry.find(change.name)
            if found is None:
                raise NotFound(f"log record evicts from unknown table {change.name!r}")
            self.updates.evict(found, change.ids, change.cause)
        else:
            d = change.push
            assert d.grads is not None
            if change.dense:
                t, ids = self.validate_push_dense(d.name, d.row_start, d.grads)
            else:  # rows of a table, or of a dense tensor (a synchronous step's update)
                found = self.registry.find(d.name)
                if found is None:
                    raise NotFound(f"log record for unknown table {d.name!r}")
                assert d.ids is not None
                t, ids = found, d.ids
                if ids.size:
                    t.check_ids(ids)
                t.check_grads(ids, d.grads)
            if d.client_id:  # remembered, not counted: the snapshot may already hold it
                self.updates.seen.begin(d.client_id, d.seq)
            self.updates.apply(t, ids, d.grads, replayed_staleness=change.staleness, replayed_per_row=change.per_row,
                               replayed_ticks=change.ticks)

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Replace everything with a snapshot's contents (the rows must be owned by this shard)."""
        with self.registry.lock:
            self.registry.clear()
            for i, entry in enumerate(meta["tables"]):
                spec = ckpt.spec_of(entry)
                if isinstance(spec, DenseSpec):
                    self.register_dense(spec, 0, None)
                else:
                    self.create_table(spec)
                prefix = f"t{i}."
                t = self.registry.find(spec.name)
                assert t is not None
                t.load({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
            self.updates.version = int(meta["version"])
            self.updates.seen.load_json(meta.get("seen", {}))
            for t in self.registry.tables():
                t.restart_history(self.updates.version)

    def sweep(self, max_slots: int = 65536) -> int:
        """Reclaim expired rows: one slice of at most ``max_slots`` rows of each table with a TTL (the
        shard's sweeper calls this about once a second). How many rows were evicted."""
        return sum(self.updates.sweep(t, max_slots) for t in self.registry.tables() if t.expires)
