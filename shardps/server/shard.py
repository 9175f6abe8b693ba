"""One shard's state: tables, dense tensors, version counter, staleness, exactly-once pushes.

``Shard`` is plain Python over numpy arrays and raises the exception types of
``shardps.core.errors``; the gRPC servicer translates to and from protobuf.
"""

from __future__ import annotations

import base64
import logging
import pathlib
import struct
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from shardps.core import codec, wire
from shardps.core.errors import (
    AlreadyExists,
    InvalidArgument,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    StaleUpdate,
    SyncStepFailed,
    Unavailable,
    WrongShard,
    clip,
)
from shardps.core.routing import dense_rows_owned, shard_of_ids
from shardps.core.specs import (
    DenseSpec,
    TableSpec,
    dense_spec_from_pb,
    dense_spec_to_pb,
    table_spec_from_pb,
    table_spec_to_pb,
)
from shardps.server import checkpoint as ckpt
from shardps.server import wal as wal_mod
from shardps.server.aggregate import combine, stack
from shardps.server.limits import Limits, MemoryBudget
from shardps.server.sync import Membership, StepBuffer, SyncTable, check_part
from shardps.server.table import Table
from shardps.v1 import shardps_pb2 as pb

log = logging.getLogger(__name__)

DURABILITY_LEVELS = ("none", "checkpoint", "log")
WAL_RECOVERY = ("fail", "truncate")
MAX_DENSE_CHUNKS = 1 << 16
_U64 = struct.Struct("<Q")


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

    def __post_init__(self) -> None:
        if self.num_shards < 1 or not 0 <= self.shard_index < self.num_shards:
            raise ValueError(f"shard index {self.shard_index} is not in [0, {self.num_shards})")
        if self.durability not in DURABILITY_LEVELS:
            raise ValueError(f"durability must be one of {DURABILITY_LEVELS}, got {self.durability!r}")
        if self.wal_recovery not in WAL_RECOVERY:
            raise ValueError(f"wal_recovery must be one of {WAL_RECOVERY}, got {self.wal_recovery!r}")
        if self.keep_checkpoints < 2:
            raise ValueError("keep_checkpoints must be >= 2 (the previous good one is kept)")


class SeenPushes:
    """Remembers which (client id, sequence number) pushes were applied.

    Per client: every seq <= ``low`` and every seq in ``above`` was applied.
    Gaps (pushes that failed) are forgotten once more than ``max_pending`` seqs
    wait above them; the ``max_clients`` least recently seen clients are dropped.
    """

    def __init__(self, max_clients: int = 10_000, max_pending: int = 65_536) -> None:
        self._lock = threading.Lock()
        self._clients: dict[str, tuple[int, set[int]]] = {}
        self._max_clients = max_clients
        self._max_pending = max_pending

    def begin(self, client: str, seq: int) -> bool:
        """Mark (client, seq) as applied; False if it already was (a duplicate)."""
        with self._lock:
            low, above = self._clients.pop(client, (0, set()))
            self._clients[client] = (low, above)  # most recently used last
            if seq <= low or seq in above:
                return False
            above.add(seq)
            while low + 1 in above:
                low += 1
                above.discard(low)
            if len(above) > self._max_pending:
                low = sorted(above)[len(above) // 2]
                above = {s for s in above if s > low}
            self._clients[client] = (low, above)
            if len(self._clients) > self._max_clients:
                del self._clients[next(iter(self._clients))]
            return True

    def abort(self, client: str, seq: int) -> None:
        """Forget a seq whose push failed, so a retry is applied."""
        with self._lock:
            entry = self._clients.get(client)
            if entry is not None:
                entry[1].discard(seq)

    def to_json(self) -> dict[str, list]:
        with self._lock:
            return {c: [low, sorted(above)] for c, (low, above) in self._clients.items()}

    def load_json(self, d: dict[str, list]) -> None:
        with self._lock:
            self._clients = {c: (int(v[0]), set(int(s) for s in v[1])) for c, v in d.items()}


@dataclass
class Stats:
    """Counters since start (see ShardStats in the proto)."""

    pulls: int = 0
    pushes: int = 0
    rows_pulled: int = 0
    rows_pushed: int = 0
    stale_rejected: int = 0
    duplicates: int = 0
    max_staleness: int = 0
    staleness_sum: int = 0
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def as_pb(self) -> pb.ShardStats:
        with self.lock:
            return pb.ShardStats(
                pulls=self.pulls, pushes=self.pushes, rows_pulled=self.rows_pulled, rows_pushed=self.rows_pushed,
                stale_rejected=self.stale_rejected, duplicates=self.duplicates, max_staleness=self.max_staleness,
                mean_staleness=self.staleness_sum / self.pushes if self.pushes else 0.0, errors=self.errors,
            )


@dataclass
class PushResult:
    version: int
    staleness: int
    duplicate: bool
    late: bool = False
    missing_ranks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class SyncPart:
    """Where a push sits in a synchronous step (see SyncPart in the proto)."""

    step: int
    rank: int
    part: int = 0
    parts: int = 1


class Shard:
    """Tables and dense tensors owned by one shard, with its version counter."""

    def __init__(self, config: ShardConfig) -> None:
        self.config = config
        self.limits = config.limits
        self.budget = MemoryBudget(config.limits.memory_bytes)
        self.index = config.shard_index
        self.num_shards = config.num_shards
        # Lock order: _lock (table dict) -> Table.lock -> _vlock (version) -> WAL.
        self._lock = threading.RLock()
        self._vlock = threading.Lock()
        self._tables: dict[str, Table] = {}
        self.version = 0
        self.stats = Stats()
        self.seen = SeenPushes()
        self.membership = Membership(config.worker_timeout_s, config.limits.max_workers)
        self._sync_cond = threading.Condition()
        self._sync_tables: dict[str, SyncTable] = {}
        self.started = time.monotonic()
        self._ckpt_lock = threading.Lock()
        self._ckpt_seqno = 0
        self.last_checkpoint = ""
        self.data_dir = pathlib.Path(config.data_dir) if config.data_dir else None
        self._wal: Optional[wal_mod.WriteAheadLog] = None
        self._prev_wal_segment = 0  # WAL segments from here on are kept (the previous checkpoint needs them)
        self._gate = threading.Event()  # closed while a two-phase checkpoint is prepared
        self._gate.set()
        self._gate_timer: Optional[threading.Timer] = None
        if self.data_dir is not None and config.durability != "none":
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._restore()
            if config.durability == "log":
                existing = wal_mod.segments(self.data_dir)
                self._wal = wal_mod.WriteAheadLog(self.data_dir, (existing[-1] + 1) if existing else 1)

    def close(self) -> None:
        """Release files (the write-ahead log); the shard must not be used afterwards."""
        if self._wal is not None:
            self._wal.close()
            self._wal = None

    # ---- lookups and checks ----------------------------------------------------------

    def check_shard_map(self, shard_map: Optional[pb.ShardMap]) -> None:
        """Refuse requests addressed to another (index, count) than this shard's."""
        if shard_map is None or shard_map.num_shards == 0:
            return
        if (shard_map.shard_index, shard_map.num_shards) != (self.index, self.num_shards):
            raise WrongShard(
                f"request meant for shard {shard_map.shard_index} of {shard_map.num_shards} reached "
                f"shard {self.index} of {self.num_shards}: the client's address list does not match the cluster "
                f"(expected shard map: index {self.index}, {self.num_shards} shards)"
            )

    def _check_name(self, name: str) -> None:
        if len(name) > self.limits.max_name_length:
            raise InvalidArgument(f"name {clip(repr(name), 60)} is longer than the shard's limit of "
                                  f"{self.limits.max_name_length} characters (--max-name-length)")

    def _find(self, name: str) -> Optional[Table]:
        self._check_name(name)
        with self._lock:
            return self._tables.get(name)

    def _table(self, name: str, dense: bool) -> Table:
        t = self._find(name)
        if t is None or t.is_dense != dense:
            what = "dense tensor" if dense else "table"
            raise NotFound(f"unknown {what} {name!r} on shard {self.index}")
        return t

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

    def _new_table(self, spec: Union[TableSpec, DenseSpec], owns: Any, expected: int) -> Table:
        """A table charged to this shard's budget (caller holds _lock and adds it)."""
        self.limits.check("tables and dense tensors", len(self._tables) + 1, "max_tables")
        self._check_name(spec.name)
        if spec.sync is not None:
            self.limits.check(f"{spec.name}: sync workers", spec.sync.workers, "max_workers")
        return Table(spec, owns, expected, budget=self.budget, max_rows=self.limits.max_table_rows)

    def _owns_ids(self, ids: np.ndarray) -> np.ndarray:
        return shard_of_ids(ids, self.num_shards) == self.index

    # ---- tables ----------------------------------------------------------------------

    def create_table(self, spec: TableSpec) -> bool:
        """Create a table; False if an equal one exists; AlreadyExists if it differs."""
        with self._lock:
            existing = self._tables.get(spec.name)
            if existing is not None:
                if existing.spec != spec:
                    raise AlreadyExists(
                        f"table {spec.name!r} exists with a different spec: {existing.spec} (requested {spec})"
                    )
                return False
            expected = 1024 if spec.num_embeddings is None else spec.num_embeddings // self.num_shards + 1024
            self._tables[spec.name] = self._new_table(spec, self._owns_ids, expected)
            ticket = self._log(wal_mod.CREATE_TABLE, table_spec_to_pb(spec).SerializeToString())
        log.info("shard %d: created table %s", self.index, spec.name)
        self._wait_durable(ticket)
        return True

    def _log(self, kind: int, *parts: bytes) -> int:
        """Append a record to the write-ahead log (if any); returns the ticket to wait on."""
        if self._wal is None:
            return 0
        return self._wal.append(kind, b"".join(parts))

    def _wait_durable(self, ticket: int) -> None:
        if ticket and self._wal is not None:
            self._wal.wait(ticket)

    def drop(self, name: str) -> bool:
        self._check_name(name)
        with self._lock:
            t = self._tables.pop(name, None)
            dropped = t is not None
            ticket = self._log(wal_mod.DROP, name.encode()) if dropped else 0
        if t is not None:
            with t.lock:
                t.release()
        self._wait_durable(ticket)
        return dropped

    def describe(self, name: str) -> pb.TableInfo:
        t = self._find(name)
        if t is None:
            raise NotFound(f"unknown table or dense tensor {name!r} on shard {self.index}")
        return self._info(t)

    def _info(self, t: Table) -> pb.TableInfo:
        with t.lock:
            n, nbytes = t.n, t.nbytes()
        info = pb.TableInfo(num_rows=n, bytes=nbytes, bytes_per_row=nbytes / n if n else 0.0, payload_bytes=n * t.dim * 4)
        if isinstance(t.spec, DenseSpec):
            info.dense.CopyFrom(dense_spec_to_pb(t.spec))
        else:
            info.spec.CopyFrom(table_spec_to_pb(t.spec))
        return info

    def pull(self, name: str, ids: np.ndarray, itemsize: int = 4) -> tuple[np.ndarray, int]:
        """Rows of ``ids`` and the version they were read at (``itemsize``: bytes per value on the wire)."""
        t = self._table(name, dense=False)
        self._check_ids_count(ids.shape[0] if ids.ndim else 1)
        t.check_ids(ids)
        self.check_reply(t, ids.shape[0], itemsize)
        return self.read_rows(t, ids)

    def read_rows(self, t: Table, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """Rows of validated ``ids`` of ``t`` and the version they were read at."""
        with t.lock:
            slots = t._slots(ids, create=True)
            version = self.version
            rows = np.take(t.rows, slots, axis=0)
        with self.stats.lock:
            self.stats.pulls += 1
            self.stats.rows_pulled += ids.shape[0]
        return rows, version

    def validate_push(self, name: str, ids: np.ndarray, grads: np.ndarray, sync: Optional[SyncPart] = None) -> Table:
        """Check a row push without applying it; returns its table."""
        t = self._table(name, dense=False)
        self._check_ids_count(ids.shape[0] if ids.ndim else 1)
        if sync is None or ids.size:  # a synchronous worker may contribute nothing to a step
            t.check_ids(ids)
        elif ids.ndim != 1:
            raise InvalidArgument(f"{name}: ids must be 1-D, got shape {list(ids.shape)}")
        t.check_grads(ids, grads)
        self._check_sync(t, sync)
        return t

    def _check_sync(self, t: Table, sync: Optional[SyncPart]) -> None:
        """A push carries a step part exactly when its table is synchronous, and a valid one."""
        policy = t.spec.sync
        if policy is not None and sync is None:
            raise InvalidArgument(f"{t.spec.name} is synchronous: pushes must carry a step and rank")
        if policy is None and sync is not None:
            raise InvalidArgument(f"{t.spec.name} is asynchronous: pushes must not carry a sync step")
        if policy is not None and sync is not None:
            check_part(policy, sync.step, sync.rank, sync.part, sync.parts)

    def _push_record(self, t: Table, ids: np.ndarray, grads: np.ndarray, client_id: str, seq: int,
                     as_rows: bool = False) -> tuple[int, bytes]:
        """The WAL record of a push (built before taking the table lock)."""
        if self._wal is None:
            return 0, b""
        if t.is_dense and not as_rows:
            req = pb.PushDenseRequest(name=t.spec.name, row_start=int(ids[0]), grads=codec.encode(grads),
                                      client_id=client_id, seq=seq)
            return wal_mod.PUSH_DENSE, req.SerializeToString()
        req2 = pb.PushRequest(table=t.spec.name, ids=codec.encode(ids), grads=codec.encode(grads),
                              client_id=client_id, seq=seq)
        return wal_mod.PUSH, req2.SerializeToString()

    def apply_push(
        self, t: Table, ids: np.ndarray, grads: np.ndarray, pulled_version: Optional[int], client_id: str, seq: int,
        sync: Optional[SyncPart] = None, raw: Optional[Any] = None,
    ) -> PushResult:
        """Apply a validated push (``validate_push`` / ``validate_push_dense``): the gradients
        of ``ids`` (duplicates summed) with the table's optimizer.

        ``raw`` is the serialized PushRequest when the caller has it: it becomes
        the write-ahead log record as is. For a table with a SyncPolicy, ``sync``
        is required (see ``_push_sync`` for when the call returns).
        """
        self._check_sync(t, sync)
        if client_id and not self.seen.begin(client_id, seq):
            with self.stats.lock:
                self.stats.duplicates += 1
            return PushResult(self.version, 0, True)
        try:
            if sync is not None:
                return self._push_sync(t, ids, grads, sync)
            if raw is not None and self._wal is not None:
                kind, record = (wal_mod.PUSH_DENSE if t.is_dense else wal_mod.PUSH), bytes(raw)
            else:
                kind, record = self._push_record(t, ids, grads, client_id, seq)
            version, staleness = self._apply_update(t, ids, grads, pulled_version, kind, record)
        except SyncStepFailed:
            raise  # the step is over; a retry would be late, so the seq stays consumed
        except BaseException:
            if client_id:
                self.seen.abort(client_id, seq)
            raise
        return PushResult(version, staleness, False)

    def _apply_update(
        self, t: Table, ids: np.ndarray, grads: np.ndarray, pulled_version: Optional[int], kind: int, record: bytes
    ) -> tuple[int, int]:
        """Apply one update under the table lock (waiting out a prepared checkpoint); log it; count it."""
        while True:
            with t.lock:
                if self._gate.is_set():
                    staleness = max(0, self.version - pulled_version) if pulled_version is not None else 0
                    policy = t.spec.staleness
                    if policy.max_staleness is not None and staleness > policy.max_staleness:
                        with self.stats.lock:
                            self.stats.stale_rejected += 1
                        raise StaleUpdate(
                            f"{t.spec.name}: push is {staleness} versions stale, more than max_staleness "
                            f"{policy.max_staleness}; pull again and recompute"
                        )
                    rows = t.apply(ids, grads, policy.lr_scale(staleness)) if ids.size else 0
                    with self._vlock:
                        self.version += 1
                        version = self.version
                    ticket = self._log(kind, _U64.pack(staleness), record) if kind else 0
                    break
            # A two-phase checkpoint is prepared: wait for it (bounded) outside the lock.
            if not self._gate.wait(self.config.checkpoint_hold_s + 5):
                raise Unavailable(f"shard {self.index}: pushes held back by a checkpoint for too long")
        self._wait_durable(ticket)
        with self.stats.lock:
            self.stats.pushes += 1
            self.stats.rows_pushed += rows
            self.stats.staleness_sum += staleness
            self.stats.max_staleness = max(self.stats.max_staleness, staleness)
        return version, staleness

    # ---- synchronous steps and membership --------------------------------------------

    def _push_sync(self, t: Table, ids: np.ndarray, grads: np.ndarray, part: SyncPart) -> PushResult:
        """Add one worker's part of a step.

        The part that completes the worker's contribution returns once the step
        is applied (or failed); earlier parts return once recorded. They must:
        a worker's parts arrive in order on one stream, so a part that waited for
        the step would hold back the worker's remaining parts, and the step with them.
        """
        policy = t.spec.sync
        assert policy is not None
        self.membership.touch(part.rank, policy.workers)
        with self._sync_cond:
            st = self._sync_tables.get(t.spec.name)
            if st is None or st.policy != policy:
                st = self._sync_tables[t.spec.name] = SyncTable(policy, t.dim)
            buf = st.add(part.step, part.rank, part.part, part.parts, ids, np.asarray(grads, dtype=np.float32))
            if buf is None:
                return PushResult(self.version, 0, False, late=True)
            if part.rank not in buf.complete_ranks():
                return PushResult(self.version, 0, False)
            while not buf.done:
                self._try_finish_step(t, st, part.step, buf)
                if not buf.done:
                    self._sync_cond.wait(0.05)
        if buf.error:
            raise SyncStepFailed(buf.error)
        return PushResult(buf.version, 0, False, missing_ranks=buf.missing)

    def _try_finish_step(self, t: Table, st: SyncTable, step: int, buf: StepBuffer) -> None:
        """Apply (or fail) a step if every worker is in, or its straggler policy says so. Holds _sync_cond."""
        policy = st.policy
        complete = buf.complete_ranks()
        waiting = [r for r in range(policy.workers) if r not in complete]
        if waiting:
            timed_out = time.monotonic() - buf.started >= policy.timeout_s
            all_gone = all(self.membership.is_gone(r) for r in waiting)
            if timed_out and policy.on_timeout == "fail":
                buf.error = (f"sync step {step} of {t.spec.name} failed: no push from ranks {waiting} "
                             f"within {policy.timeout_s}s")
                st.finish(step, buf)
                self._sync_cond.notify_all()
                return
            proceed = all_gone or (timed_out and policy.on_timeout == "proceed")
            if not (proceed and complete):
                return
            log.warning("shard %d: step %d of %s proceeds without ranks %s", self.index, step, t.spec.name, waiting)
        union, stacked = stack(st.contributions(buf, complete), t.dim)
        combined = combine(stacked, policy.aggregator, policy.trim_fraction)
        kind, record = self._push_record(t, union, combined, "", 0, as_rows=True)
        buf.version, _ = self._apply_update(t, union, combined, None, kind, record)
        buf.missing = waiting
        st.finish(step, buf)
        self._sync_cond.notify_all()

    def heartbeat(
        self, rank: int, world_size: int, clock: int, leaving: bool,
        wait_min_clock: Optional[int] = None, wait_s: float = 0.0,
    ) -> tuple[int, list[int], list[int]]:
        """Record a worker's liveness and clock; optionally wait for the slowest one."""
        self.membership.heartbeat(rank, world_size, clock, leaving)
        if wait_min_clock is not None and wait_s > 0:  # NaN compares False: no wait
            self.membership.wait_min_clock(wait_min_clock, min(wait_s, 60.0))
        with self._sync_cond:  # a rank that left may complete a waiting step
            self._sync_cond.notify_all()
        return self.membership.status()

    # ---- dense tensors ---------------------------------------------------------------

    def register_dense(self, spec: DenseSpec, row_start: int, values: Optional[np.ndarray]) -> tuple[bool, bool]:
        """Create or verify a dense tensor; initialise rows from ``values`` if not done before."""
        self.limits.check(f"{spec.name}: dense tensor elements", spec.rows * spec.cols, "max_dense_elements")
        if spec.chunk_rows and -(-spec.rows // spec.chunk_rows) > MAX_DENSE_CHUNKS:
            raise InvalidArgument(f"{spec.name}: chunk_rows {spec.chunk_rows} makes more than {MAX_DENSE_CHUNKS:,} "
                                  f"chunks of {spec.rows:,} rows")
        if not 0 <= row_start <= spec.rows:
            raise OutOfRange(f"{spec.name}: row_start {row_start} outside [0, {spec.rows}]")
        with self._lock:
            existing = self._tables.get(spec.name)
            created = existing is None
            if existing is not None:
                if existing.spec != spec:
                    raise AlreadyExists(
                        f"dense tensor {spec.name!r} exists with a different spec: {existing.spec} (requested {spec})"
                    )
                t = existing
            else:
                owned = dense_rows_owned(spec.name, spec.rows, spec.chunk_rows, self.num_shards, self.index)

                def owns(ids: np.ndarray, owned: np.ndarray = owned) -> np.ndarray:
                    return owned[ids]

                t = self._new_table(spec, owns, int(owned.sum()))
                self._tables[spec.name] = t
        if values is None or values.size == 0:
            if created:
                self._wait_durable(self._log(wal_mod.REGISTER_DENSE, pb.RegisterDenseRequest(spec=dense_spec_to_pb(spec)).SerializeToString()))
            return created, False
        if values.ndim != 2 or values.shape[1] != t.dim:
            raise InvalidArgument(f"{spec.name}: values must have shape [rows, {t.dim}], got {list(values.shape)}")
        ids = np.arange(row_start, row_start + values.shape[0], dtype=np.int64)
        t.check_ids(ids)
        if not np.isfinite(values).all():
            raise InvalidArgument(f"{spec.name}: initial values contain NaN or Inf")
        with self._lock:  # log order = application order for first-writer-wins
            initialized = t.assign(ids, values)
            ticket = 0
            if initialized or created:
                req = pb.RegisterDenseRequest(spec=dense_spec_to_pb(spec), row_start=row_start, values=codec.encode(values))
                ticket = self._log(wal_mod.REGISTER_DENSE, req.SerializeToString())
        self._wait_durable(ticket)
        return created, initialized

    def _dense_rows(self, t: Table, row_start: int, row_end: int) -> np.ndarray:
        if not 0 <= row_start < row_end <= t.spec.rows:
            raise OutOfRange(f"{t.spec.name}: rows [{row_start}, {row_end}) outside [0, {t.spec.rows})")
        ids = np.arange(row_start, row_end, dtype=np.int64)
        t.check_ids(ids)
        return ids

    def validate_pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[Table, np.ndarray]:
        """Check a dense pull without reading it; returns its table and row ids."""
        t = self._table(name, dense=True)
        ids = self._dense_rows(t, row_start, row_end)
        t.check_present(ids)  # here, so a PushBatch refused for it applies none of its pushes
        return t, ids

    def pull_dense(self, name: str, row_start: int, row_end: int) -> tuple[np.ndarray, int]:
        return self.read_rows(*self.validate_pull_dense(name, row_start, row_end))

    def validate_push_dense(self, name: str, row_start: int, grads: np.ndarray,
                            sync: Optional[SyncPart] = None) -> tuple[Table, np.ndarray]:
        """Check a dense push without applying it; returns its table and row ids."""
        t = self._table(name, dense=True)
        if grads.ndim != 2:
            raise InvalidArgument(f"{name}: grads must be 2-D [rows, {t.dim}], got shape {list(grads.shape)}")
        ids = self._dense_rows(t, row_start, row_start + grads.shape[0])
        t.check_grads(ids, grads)
        self._check_sync(t, sync)
        return t, ids

    # ---- info ------------------------------------------------------------------------

    def info(self) -> pb.ShardInfoResponse:
        with self._lock:
            tables = list(self._tables.values())
            version = self.version
        return pb.ShardInfoResponse(
            shard_index=self.index, num_shards=self.num_shards, version=version,
            tables=[self._info(t) for t in tables], uptime_s=time.monotonic() - self.started,
            stats=self.stats.as_pb(),
            durability=self.config.durability if self.data_dir else "none",
            last_checkpoint=self.last_checkpoint,
        )

    # ---- checkpoints ----------------------------------------------------------------

    def prepare_checkpoint(self, hold_s: Optional[float] = None) -> None:
        """Phase 1 of a cluster-wide checkpoint: hold new pushes back, let running ones finish.

        The hold ends with ``checkpoint`` (phase 2), ``abort_checkpoint``, or by
        itself after ``hold_s`` (default ``config.checkpoint_hold_s``) so a
        coordinator that died cannot stall training.
        """
        self._require_data_dir()
        hold = self.config.checkpoint_hold_s if not hold_s else min(hold_s, self.config.checkpoint_hold_s)
        with self._ckpt_lock:
            self._open_gate()
            self._gate.clear()
            with self._lock:
                tables = list(self._tables.values())
            for t in tables:  # pushes that passed the gate before it closed finish first
                with t.lock:
                    pass
            self._gate_timer = threading.Timer(hold, self._expire_gate)
            self._gate_timer.daemon = True
            self._gate_timer.start()

    def _expire_gate(self) -> None:
        log.warning("shard %d: prepared checkpoint was neither committed nor aborted; resuming pushes", self.index)
        self._gate.set()

    def _open_gate(self) -> None:
        if self._gate_timer is not None:
            self._gate_timer.cancel()
            self._gate_timer = None
        self._gate.set()

    def abort_checkpoint(self) -> None:
        with self._ckpt_lock:
            self._open_gate()

    def _require_data_dir(self) -> pathlib.Path:
        if self.data_dir is None or self.config.durability == "none":
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
        with self._ckpt_lock:
            if prepared and self._gate.is_set():
                raise Unavailable(f"shard {self.index}: checkpoint {checkpoint_id} was not prepared or its hold expired")
            try:
                meta, arrays, pause = self._snapshot()
            finally:
                if prepared:
                    self._open_gate()
            meta["checkpoint_id"] = checkpoint_id
            self._ckpt_seqno += 1
            meta["seqno"] = self._ckpt_seqno
            path = data_dir / ckpt.file_name(self._ckpt_seqno, checkpoint_id)
            size = ckpt.write(path, meta, arrays)
            ckpt.prune(data_dir, self.config.keep_checkpoints)
            # WAL segments are kept back to the previous checkpoint, the fallback if this one breaks.
            wal_mod.remove_before(data_dir, self._prev_wal_segment)
            self._prev_wal_segment = meta["wal_segment"]
            self.last_checkpoint = checkpoint_id
        log.info("shard %d: checkpoint %s at version %d (%d bytes, pause %.3fs)",
                 self.index, checkpoint_id, meta["version"], size, pause)
        return checkpoint_id, meta["version"], size, pause

    def _snapshot(self) -> tuple[dict[str, Any], dict[str, np.ndarray], float]:
        """Copy every table at one consistent version: pushes wait while the arrays are copied."""
        assert self.data_dir is not None
        with ExitStack() as stack:
            stack.enter_context(self._lock)
            tables = sorted(self._tables.items())
            t0 = time.perf_counter()
            for _, t in tables:
                stack.enter_context(t.lock)
            if self._wal is not None:
                wal_segment = self._wal.rotate()
            else:
                existing = wal_mod.segments(self.data_dir)
                wal_segment = existing[-1] + 1 if existing else 0
            meta: dict[str, Any] = {
                "shard_index": self.index, "num_shards": self.num_shards, "version": self.version,
                "seen": self.seen.to_json(), "tables": [], "wal_segment": wal_segment,
            }
            arrays: dict[str, np.ndarray] = {}
            for i, (name, t) in enumerate(tables):
                spec_pb = dense_spec_to_pb(t.spec) if t.is_dense else table_spec_to_pb(t.spec)  # type: ignore[arg-type]
                meta["tables"].append(
                    {"name": name, "dense": t.is_dense, "spec": base64.b64encode(spec_pb.SerializeToString()).decode()}
                )
                for k, v in t.snapshot().items():
                    arrays[f"t{i}.{k}"] = v
            pause = time.perf_counter() - t0
        return meta, arrays, pause

    def _restore(self) -> None:
        """Load the newest valid checkpoint, then replay the write-ahead log written after it."""
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
            self._ckpt_seqno = int(meta["seqno"])
            self.last_checkpoint = meta["checkpoint_id"]
            first_segment = self._prev_wal_segment = int(meta.get("wal_segment", 0))
            log.info("shard %d: restored checkpoint %s (version %d, %d tables)",
                     self.index, loaded.path.name, self.version, len(self._tables))
            break
        replayed = 0
        try:
            for record in wal_mod.replay(self.data_dir, first_segment):
                try:
                    self._apply_record(record.kind, record.payload)
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

    def _apply_record(self, kind: int, payload: bytes) -> None:
        """Re-apply one write-ahead log record during restore."""
        if kind == wal_mod.CREATE_TABLE:
            self.create_table(table_spec_from_pb(pb.TableSpec.FromString(payload)))
        elif kind == wal_mod.REGISTER_DENSE:
            req = pb.RegisterDenseRequest.FromString(payload)
            values = codec.decode(req.values, "values") if req.HasField("values") else None
            self.register_dense(dense_spec_from_pb(req.spec), req.row_start, values)
        elif kind == wal_mod.DROP:
            self.drop(payload.decode())
        elif kind in (wal_mod.PUSH, wal_mod.PUSH_DENSE):
            # The live path's own decoder reads the record: replay sees exactly what was acknowledged.
            (staleness,) = _U64.unpack_from(payload)
            d = wire.decode_push(memoryview(payload)[8:], dense=kind == wal_mod.PUSH_DENSE)
            assert d.grads is not None
            if kind == wal_mod.PUSH:  # rows of a table, or of a dense tensor (a synchronous step's update)
                found = self._tables.get(d.name)
                if found is None:
                    raise NotFound(f"log record for unknown table {d.name!r}")
                t, ids, grads = found, d.ids, d.grads
                assert ids is not None
                if ids.size:
                    t.check_ids(ids)
                t.check_grads(ids, d.grads)
            else:
                t, ids = self.validate_push_dense(d.name, d.row_start, d.grads)
                grads = d.grads
            client_id, seq = d.client_id, d.seq
            if client_id:
                self.seen.begin(client_id, seq)
            with t.lock:
                if ids.size:
                    t.apply(ids, grads, t.spec.staleness.lr_scale(staleness))
                with self._vlock:
                    self.version += 1
        else:
            raise ValueError(f"unknown write-ahead log record kind {kind}")

    def load_state(self, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        """Replace everything with a snapshot's contents (the rows must be owned by this shard)."""
        with self._lock:
            self._tables.clear()
            for i, entry in enumerate(meta["tables"]):
                raw = base64.b64decode(entry["spec"])
                spec: Union[TableSpec, DenseSpec]
                if entry["dense"]:
                    dspec = dense_spec_from_pb(pb.DenseSpec.FromString(raw))
                    self.register_dense(dspec, 0, None)
                    spec = dspec
                else:
                    spec = table_spec_from_pb(pb.TableSpec.FromString(raw))
                    self.create_table(spec)
                prefix = f"t{i}."
                self._tables[spec.name].load({k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)})
            self.version = int(meta["version"])
            self.seen.load_json(meta.get("seen", {}))
