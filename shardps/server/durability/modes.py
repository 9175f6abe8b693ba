"""Durability: what a shard writes, beyond checkpoints, so that an acknowledged change survives a crash.

``Shard`` talks to one ``Durability`` and never to the write-ahead log itself.
Each change is turned into a record (``record_*``, outside the table lock, where
encoding costs nothing to others), appended in application order (``append``,
under the lock), then waited on before it is acknowledged (``wait``, outside the
lock). ``open`` starts storing once restore is done. Checkpoints ask for the point a snapshot covers (``cut``, with every
table locked) and report the file they wrote (``checkpointed``). Restore reads
back the records after a cut (``records``).

Three implementations, chosen by ``--durability`` (a shard without a data dir has ``none``):

- ``none``: no files. Nothing survives a restart.
- ``checkpoint``: checkpoints, plus a log of schema changes only (tables and dense tensors
  created, dropped, registered: fsynced before the reply); a crash loses the row updates since
  the last checkpoint, never a table.
- ``log`` (the default with a data dir): every change goes to the write-ahead log
  (``shardps.server.durability.wal``) before it is acknowledged, fsynced by its policy
  (``--fsync``: ``always``, ``interval``, ``none``); a process crash loses nothing acknowledged,
  a machine crash at most the last fsync interval (nothing under ``always``). Schema changes
  are fsynced before the reply under every policy.

Further implementations (replication to a follower, a delta export) fit the same
seam: they see every change, in order, and the cuts of checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Optional, Protocol, Union

import numpy as np

from shardps.core import codec, pushread, wire
from shardps.core.specs import (
    DenseSpec,
    TableSpec,
    dense_spec_from_pb,
    dense_spec_to_pb,
    table_spec_from_pb,
    table_spec_to_pb,
)
from shardps.server.durability import wal
from shardps.v1 import shardps_pb2 as pb

MODES = ("none", "checkpoint", "log")
# What ``checkpoint`` logs (and fsyncs before the reply): the tables and dense tensors themselves, the slot map and
# the rows a migration moved here (a crash must not lose a slot's rows with its ownership).
SCHEMA_KINDS = frozenset({wal.CREATE_TABLE, wal.REGISTER_DENSE, wal.DROP, wal.SLOTS, wal.ROWS_IN})
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_PER_ROW = 1 << 63  # flag in a push record's staleness word: per-row staleness follows
_TICKS = 1 << 62  # flag: the time the push was applied follows (tables that keep per-row push times by TTL)

Record = tuple[int, bytes]  # (kind, payload) as the write-ahead log stores it; kind 0: nothing to store


def record_create_table(spec: TableSpec) -> Record:
    return wal.CREATE_TABLE, table_spec_to_pb(spec).SerializeToString()


def record_register_dense(spec: DenseSpec, row_start: int = 0, values: Optional[np.ndarray] = None) -> Record:
    req = pb.RegisterDenseRequest(spec=dense_spec_to_pb(spec), row_start=row_start)
    if values is not None:
        req.values.CopyFrom(codec.encode(values))
    return wal.REGISTER_DENSE, req.SerializeToString()


def record_drop(name: str) -> Record:
    return wal.DROP, name.encode()


def record_push(name: str, ids: np.ndarray, grads: np.ndarray, client_id: str = "", seq: int = 0,
                dense_row_start: Optional[int] = None, raw: Optional[wire.Buffer] = None) -> Record:
    """A push as a record: ``raw`` (the request as received) when there is one, else encoded here.
    The payload is a PushRequest, or a PushDenseRequest when ``dense_row_start`` is given."""
    kind = wal.PUSH if dense_row_start is None else wal.PUSH_DENSE
    if raw is not None:
        return kind, bytes(raw)
    if dense_row_start is None:
        req = pb.PushRequest(table=name, ids=codec.encode(ids), grads=codec.encode(grads), client_id=client_id, seq=seq)
    else:
        req = pb.PushDenseRequest(name=name, row_start=dense_row_start, grads=codec.encode(grads),
                                  client_id=client_id, seq=seq)
    return kind, req.SerializeToString()


def record_assign(name: str, ids: np.ndarray, values: np.ndarray) -> Record:
    """Rows set to values (a loaded state dict): an AssignRequest."""
    req = pb.AssignRequest(table=name, ids=codec.encode(ids), values=codec.encode(values))
    return wal.ASSIGN, req.SerializeToString()


def record_evict(name: str, ids: np.ndarray, cause: int) -> Record:
    """Rows evicted from a table: the cause (u32), the name's length (u32) and the name, then the ids."""
    raw = name.encode()
    return wal.EVICT, _U32.pack(cause) + _U32.pack(len(raw)) + raw + np.ascontiguousarray(ids, "<i8").tobytes()


def record_slots(change: dict[str, Any]) -> Record:
    """A change of the slot map or of a migration's state (``shard.migration``), as JSON."""
    return wal.SLOTS, json.dumps(change, separators=(",", ":")).encode()


def record_rows_in(move: str, table: str, ids: np.ndarray, arrays: dict[str, np.ndarray]) -> Record:
    """Rows a migration brought here with everything they hold (``storage.moves.read_state``'s arrays): a JSON
    header's length (u32), the header (table, migration, each array's key, dtype and shape), then the arrays."""
    parts = [("ids", np.ascontiguousarray(ids, "<i8"))] + [(k, np.ascontiguousarray(v)) for k, v in sorted(arrays.items())]
    header = json.dumps({"table": table, "move": move,
                         "arrays": [[k, v.dtype.str, list(v.shape)] for k, v in parts]}).encode()
    return wal.ROWS_IN, b"".join([_U32.pack(len(header)), header, *(v.tobytes() for _, v in parts)])


def with_staleness(record: Record, staleness: int, per_row: Optional[np.ndarray] = None,
                   ticks: Optional[int] = None) -> Record:
    """A push record as the log keeps it: the staleness it was applied with (a u64 whose top bits flag what
    follows), then with ``ticks`` the time it was applied (u32, ``table.now_ticks``: the rows' last push time),
    then with per-row staleness its count and one int32 per unique id in id order, then the request."""
    if per_row is None and ticks is None:
        return record[0], _U64.pack(staleness) + record[1]
    word = staleness | (_PER_ROW if per_row is not None else 0) | (_TICKS if ticks is not None else 0)
    out = [_U64.pack(word)]
    if ticks is not None:
        out.append(_U32.pack(ticks & 0xFFFFFFFF))
    if per_row is not None:
        rows = np.ascontiguousarray(per_row, "<i4")
        out += [_U32.pack(rows.shape[0]), rows.tobytes()]
    return record[0], b"".join(out) + record[1]


def split_staleness(payload: bytes) -> tuple[int, Optional[np.ndarray], Optional[int], memoryview]:
    """(staleness, per-row staleness or None, ticks or None, the request) of a stored push."""
    (word,) = _U64.unpack_from(payload)
    view = memoryview(payload)[_U64.size:]
    ticks = per_row = None
    if word & _TICKS:
        (ticks,) = _U32.unpack_from(view)
        view = view[_U32.size:]
    if word & _PER_ROW:
        (n,) = _U32.unpack_from(view)
        per_row = np.frombuffer(view[_U32.size:_U32.size + 4 * n], "<i4").astype(np.int64)
        if per_row.shape[0] != n:
            raise ValueError("push record cut short in its per-row staleness")
        view = view[_U32.size + 4 * n:]
    return word & ~(_PER_ROW | _TICKS), per_row, ticks, view


@dataclass(frozen=True)
class CreateTable:
    spec: TableSpec


@dataclass(frozen=True)
class RegisterDense:
    spec: DenseSpec
    row_start: int
    values: Optional[np.ndarray]


@dataclass(frozen=True)
class Drop:
    name: str


@dataclass(frozen=True)
class Push:
    push: pushread.DecodedPush  # read by the live path's own decoder: replay sees exactly what was acknowledged
    staleness: int
    dense: bool
    per_row: Optional[np.ndarray] = None  # per-row staleness, one per unique id in id order
    ticks: Optional[int] = None  # when it was applied (the rows' last push time), where the table needs it


@dataclass(frozen=True)
class Evict:
    name: str
    ids: np.ndarray
    cause: int


@dataclass(frozen=True)
class Assign:
    name: str
    ids: np.ndarray
    values: np.ndarray


@dataclass(frozen=True)
class Slots:
    change: dict[str, Any]


@dataclass(frozen=True)
class RowsIn:
    move: str
    table: str
    ids: np.ndarray
    arrays: dict[str, np.ndarray]


Change = Union[CreateTable, RegisterDense, Drop, Push, Evict, Assign, Slots, RowsIn]


def _read_rows_in(payload: bytes) -> RowsIn:
    (n,) = _U32.unpack_from(payload)
    header = json.loads(bytes(payload[4:4 + n]))
    at, arrays = 4 + n, {}
    for key, dtype, shape in header["arrays"]:
        dt = np.dtype(dtype)
        size = int(np.prod(shape)) * dt.itemsize
        if at + size > len(payload):
            raise ValueError("rows-moved-in record cut short")
        arrays[key] = np.frombuffer(payload, dt, int(np.prod(shape)), at).reshape(shape).copy()
        at += size
    if at != len(payload):
        raise ValueError("rows-moved-in record has trailing bytes")
    ids = arrays.pop("ids")
    return RowsIn(str(header["move"]), str(header["table"]), ids, arrays)


def read_record(kind: int, payload: bytes) -> Change:
    """The change a stored record holds (any malformed payload raises)."""
    if kind == wal.CREATE_TABLE:
        return CreateTable(table_spec_from_pb(pb.TableSpec.FromString(payload)))
    if kind == wal.REGISTER_DENSE:
        req = pb.RegisterDenseRequest.FromString(payload)
        values = codec.decode(req.values, "values") if req.HasField("values") else None
        return RegisterDense(dense_spec_from_pb(req.spec), req.row_start, values)
    if kind == wal.DROP:
        return Drop(payload.decode())
    if kind in (wal.PUSH, wal.PUSH_DENSE):
        staleness, per_row, ticks, body = split_staleness(payload)
        dense = kind == wal.PUSH_DENSE
        return Push(pushread.decode_push(body, dense=dense), staleness, dense, per_row, ticks)
    if kind == wal.ASSIGN:
        req = pb.AssignRequest.FromString(payload)
        return Assign(req.table, codec.decode(req.ids, "ids"), codec.decode(req.values, "values"))
    if kind == wal.EVICT:
        cause, n = _U32.unpack_from(payload), _U32.unpack_from(payload, 4)[0]
        name = bytes(payload[8:8 + n]).decode()
        ids = np.frombuffer(payload[8 + n:], "<i8").astype(np.int64)
        return Evict(name, ids, cause[0])
    if kind == wal.SLOTS:
        change = json.loads(bytes(payload))
        if not isinstance(change, dict) or "op" not in change:
            raise ValueError("slot map record without an op")
        return Slots(change)
    if kind == wal.ROWS_IN:
        return _read_rows_in(payload)
    raise ValueError(f"unknown write-ahead log record kind {kind}")


class Durability(Protocol):
    """Where a shard's changes go between checkpoints (see the module docstring)."""

    mode: str
    wants_records: bool  # False: callers may skip building records of row changes
    wants_schema: bool  # False: callers may skip building records of schema changes

    def open(self) -> None:
        """Start storing (after restore has read the old records back)."""

    def append(self, record: Record) -> int:
        """Store a record, in application order (callers hold the lock that orders it); a ticket to wait on."""

    def wait(self, ticket: int, durable: bool = False) -> None:
        """Return once the record of ``ticket`` is acknowledged by the policy (with ``durable``: fsynced)."""

    def wait_all(self) -> None:
        """Return once every record appended so far is acknowledged by the policy (a resend's answer)."""

    def log_bytes(self) -> int:
        """Bytes of log written since the last cut (what a restart would replay)."""

    def cut(self) -> int:
        """The position a snapshot taken now covers (callers hold every table lock)."""

    def checkpointed(self, previous_cut: int) -> None:
        """A checkpoint was written; records before ``previous_cut`` are no longer needed."""

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        """The stored records from ``after_cut`` on, in order (restore)."""

    def close(self) -> None:
        """Release files; nothing is appended afterwards."""

    def origin(self) -> ContextManager[None]:
        """Around a change of this shard's own, applied and then recorded (a replica group's member refuses one
        unless it is the primary: ``ReplicatedLog.origin``)."""

    def disk_stalled_s(self) -> float:
        """Seconds the log's write or fsync in progress has waited for the disk (0: none)."""

    def disk_error(self) -> Optional[BaseException]:
        """Why the log failed (it then refuses every write), or None."""


class NoDurability:
    """``none``: nothing is written."""

    mode = "none"
    wants_records = False
    wants_schema = False

    def open(self) -> None:
        return None

    def append(self, record: Record) -> int:
        return 0

    def wait(self, ticket: int, durable: bool = False) -> None:
        return None

    def wait_all(self) -> None:
        return None

    def log_bytes(self) -> int:
        return 0

    def cut(self) -> int:
        return 0

    def checkpointed(self, previous_cut: int) -> None:
        return None

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        return iter(())

    def close(self) -> None:
        return None

    def origin(self) -> ContextManager[None]:
        """A shard alone applies and records every change of its own."""
        return contextlib.nullcontext()

    def disk_stalled_s(self) -> float:
        """Seconds the log's write or fsync in progress has waited for the disk (0: none)."""
        return 0.0

    def disk_error(self) -> Optional[BaseException]:
        """Why the log failed (it then refuses every write), or None."""
        return None


class CheckpointDurability(NoDurability):
    """``checkpoint``: checkpoints, and a log of schema changes (each fsynced before the reply). Log segments
    are replayed on start and removed once a checkpoint covers them."""

    mode = "checkpoint"
    wants_schema = True
    schema_only = True  # row changes (pushes, evictions, assignments) wait for the next checkpoint

    def __init__(self, data_dir: pathlib.Path, on_flush: Optional[Callable[[float, int], None]] = None,
                 before_wait: Callable[[], None] = lambda: None, fsync: str = "always",
                 fsync_interval_s: float = 1.0) -> None:
        self.data_dir = data_dir
        self._wal: Optional[wal.WriteAheadLog] = None
        self._on_flush = on_flush
        self._before_wait = before_wait  # the caller's scheduler lets the next call in while this one waits
        self.fsync = fsync
        self.fsync_interval_s = fsync_interval_s

    def open(self) -> None:
        """Start appending (after restore has read the old records): a new segment after the last."""
        existing = wal.segments(self.data_dir)
        self._wal = wal.WriteAheadLog(self.data_dir, (existing[-1] + 1) if existing else 1, self._on_flush,
                                      self.fsync, self.fsync_interval_s)

    def append(self, record: Record) -> int:
        if self._wal is None or not record[0] or (self.schema_only and record[0] not in SCHEMA_KINDS):
            return 0
        return self._wal.append(*record)

    def wait(self, ticket: int, durable: bool = False) -> None:
        if ticket and self._wal is not None:
            if durable or self.fsync == "always":
                self._before_wait()  # the fsync is shared by every call waiting for it: let the next one in
            self._wal.wait(ticket, durable)

    def wait_all(self) -> None:
        if self._wal is not None:
            self.wait(self._wal.records)

    def log_bytes(self) -> int:
        return self._wal.segment_bytes if self._wal is not None else 0

    @property
    def fsyncs(self) -> int:
        """fsyncs of the log since it was opened."""
        return self._wal.fsyncs if self._wal is not None else 0

    @property
    def logged(self) -> int:
        """Records appended to the log since it was opened."""
        return self._wal.records if self._wal is not None else 0

    def cut(self) -> int:
        if self._wal is not None:
            return self._wal.rotate()
        existing = wal.segments(self.data_dir)
        return existing[-1] + 1 if existing else 0

    def checkpointed(self, previous_cut: int) -> None:
        wal.remove_before(self.data_dir, previous_cut)

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        return wal.replay(self.data_dir, after_cut)

    def close(self) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None

    def disk_stalled_s(self) -> float:
        w = self._wal
        return w.stalled_s() if w is not None else 0.0

    def disk_error(self) -> Optional[BaseException]:
        w = self._wal
        return w.error if w is not None else None


class LogDurability(CheckpointDurability):
    """``log``: every change written to the write-ahead log before it is acknowledged, fsynced by its policy."""

    mode = "log"
    wants_records = True
    schema_only = False


def make(mode: str, data_dir: Optional[pathlib.Path], on_flush: Optional[Callable[[float, int], None]] = None,
         before_wait: Callable[[], None] = lambda: None, fsync: str = "interval",
         fsync_interval_s: float = 1.0) -> Union[NoDurability, CheckpointDurability, LogDurability]:
    """The durability of ``mode`` (a shard without a data dir has none); ``on_flush`` hears of each log fsync,
    ``before_wait`` is called before a caller waits for one; ``fsync`` is the log's policy (``checkpoint``'s
    schema log fsyncs every record)."""
    if mode not in MODES:
        raise ValueError(f"durability must be one of {MODES}, got {mode!r}")
    if fsync not in wal.FSYNC_POLICIES:
        raise ValueError(f"fsync must be one of {wal.FSYNC_POLICIES}, got {fsync!r}")
    if data_dir is None or mode == "none":
        return NoDurability()
    if mode == "log":
        return LogDurability(data_dir, on_flush, before_wait, fsync, fsync_interval_s)
    return CheckpointDurability(data_dir, on_flush, before_wait)
