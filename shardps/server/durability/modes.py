"""Durability: what a shard writes, beyond checkpoints, so that an acknowledged change survives a crash.

``Shard`` talks to one ``Durability`` and never to the write-ahead log itself.
Each change is turned into a record (``record_*``, outside the table lock, where
encoding costs nothing to others), appended in application order (``append``,
under the lock), then waited on before it is acknowledged (``wait``, outside the
lock). ``open`` starts storing once restore is done. Checkpoints ask for the point a snapshot covers (``cut``, with every
table locked) and report the file they wrote (``checkpointed``). Restore reads
back the records after a cut (``records``).

Three implementations, chosen by ``--durability``:

- ``none``: no files. Nothing survives a restart.
- ``checkpoint``: checkpoints only; a crash loses what came after the last one.
- ``log``: every change is fsynced to the write-ahead log (``shardps.server.durability.wal``)
  before it is acknowledged; a crash loses nothing acknowledged.

Further implementations (replication to a follower, a delta export) fit the same
seam: they see every change, in order, and the cuts of checkpoints.
"""

from __future__ import annotations

import pathlib
import struct
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Union

import numpy as np

from shardps.core import codec, wire
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
    push: wire.DecodedPush  # read by the live path's own decoder: replay sees exactly what was acknowledged
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


Change = Union[CreateTable, RegisterDense, Drop, Push, Evict, Assign]


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
        return Push(wire.decode_push(body, dense=dense), staleness, dense, per_row, ticks)
    if kind == wal.ASSIGN:
        req = pb.AssignRequest.FromString(payload)
        return Assign(req.table, codec.decode(req.ids, "ids"), codec.decode(req.values, "values"))
    if kind == wal.EVICT:
        cause, n = _U32.unpack_from(payload), _U32.unpack_from(payload, 4)[0]
        name = bytes(payload[8:8 + n]).decode()
        ids = np.frombuffer(payload[8 + n:], "<i8").astype(np.int64)
        return Evict(name, ids, cause[0])
    raise ValueError(f"unknown write-ahead log record kind {kind}")


class Durability(Protocol):
    """Where a shard's changes go between checkpoints (see the module docstring)."""

    mode: str
    wants_records: bool  # False: callers may skip building records

    def open(self) -> None:
        """Start storing (after restore has read the old records back)."""

    def append(self, record: Record) -> int:
        """Store a record, in application order (callers hold the lock that orders it); a ticket to wait on."""

    def wait(self, ticket: int) -> None:
        """Return once the record of ``ticket`` survives a crash."""

    def cut(self) -> int:
        """The position a snapshot taken now covers (callers hold every table lock)."""

    def checkpointed(self, previous_cut: int) -> None:
        """A checkpoint was written; records before ``previous_cut`` are no longer needed."""

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        """The stored records from ``after_cut`` on, in order (restore)."""

    def close(self) -> None:
        """Release files; nothing is appended afterwards."""


class NoDurability:
    """``none``: nothing is written."""

    mode = "none"
    wants_records = False

    def open(self) -> None:
        return None

    def append(self, record: Record) -> int:
        return 0

    def wait(self, ticket: int) -> None:
        return None

    def cut(self) -> int:
        return 0

    def checkpointed(self, previous_cut: int) -> None:
        return None

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        return iter(())

    def close(self) -> None:
        return None


class CheckpointDurability(NoDurability):
    """``checkpoint``: checkpoints only. Log segments left by an earlier ``log`` run are still replayed
    and removed once a checkpoint covers them."""

    mode = "checkpoint"

    def __init__(self, data_dir: pathlib.Path) -> None:
        self.data_dir = data_dir

    def cut(self) -> int:
        existing = wal.segments(self.data_dir)
        return existing[-1] + 1 if existing else 0

    def checkpointed(self, previous_cut: int) -> None:
        wal.remove_before(self.data_dir, previous_cut)

    def records(self, after_cut: int) -> Iterator[wal.Record]:
        return wal.replay(self.data_dir, after_cut)


class LogDurability(CheckpointDurability):
    """``log``: every change fsynced to the write-ahead log before it is acknowledged (group commit)."""

    mode = "log"
    wants_records = True

    def __init__(self, data_dir: pathlib.Path, on_flush: Optional[Callable[[float, int], None]] = None,
                 before_wait: Callable[[], None] = lambda: None) -> None:
        super().__init__(data_dir)
        self._wal: Optional[wal.WriteAheadLog] = None
        self._on_flush = on_flush
        self._before_wait = before_wait  # the caller's scheduler lets the next call in while this one waits

    def open(self) -> None:
        """Start appending (after restore has read the old records): a new segment after the last."""
        existing = wal.segments(self.data_dir)
        self._wal = wal.WriteAheadLog(self.data_dir, (existing[-1] + 1) if existing else 1, self._on_flush)

    def append(self, record: Record) -> int:
        if self._wal is None or not record[0]:
            return 0
        return self._wal.append(*record)

    def wait(self, ticket: int) -> None:
        if ticket and self._wal is not None:
            self._before_wait()  # the flush is shared by every push waiting for it: let the next one in
            self._wal.wait(ticket)

    def cut(self) -> int:
        return self._wal.rotate() if self._wal is not None else super().cut()

    def close(self) -> None:
        if self._wal is not None:
            self._wal.close()
            self._wal = None


def make(mode: str, data_dir: Optional[pathlib.Path], on_flush: Optional[Callable[[float, int], None]] = None,
         before_wait: Callable[[], None] = lambda: None) -> Union[NoDurability, CheckpointDurability, LogDurability]:
    """The durability of ``mode`` (a shard without a data dir has none); ``on_flush`` hears of each log fsync,
    ``before_wait`` is called before a caller waits for one."""
    if mode not in MODES:
        raise ValueError(f"durability must be one of {MODES}, got {mode!r}")
    if data_dir is None or mode == "none":
        return NoDurability()
    return LogDurability(data_dir, on_flush, before_wait) if mode == "log" else CheckpointDurability(data_dir)
