"""Append-only write-ahead log with group commit and an fsync policy.

Every mutation (table creation, dense registration, push, drop) is appended
as one record while the shard holds the table's lock, so the log order is the
order of application. When the caller is acknowledged depends on the policy
(``FSYNC_POLICIES``, as Redis's ``appendfsync``):

- ``always``: the pushing thread waits until a flusher thread has written and
  fsynced the record; concurrent pushes share one fsync (group commit).
- ``interval``: the record is written into the file (the operating system holds
  it: a kill -9 of the process loses nothing) before the call returns; a syncer
  thread fsyncs every ``fsync_interval_s``, so a machine crash loses at most that.
- ``none``: written as under ``interval``; fsynced only when a caller asks
  (``wait(..., durable=True)``: schema changes always do), on rotation and on close.

Files are segments ``wal-<n>.log``. A checkpoint rotates to a new segment while
all tables are locked, records that segment in its metadata, and replay starts
there. Record layout: ``u32 length | u32 checksum | u8 kind | payload``. The
checksum is CRC-32C of the kind byte and the payload (``google_crc32c``, with the
CPU's CRC instruction: 8x faster than zlib's CRC-32 here, which cost more than the
write itself); such records carry ``CRC32C_FLAG`` in their kind byte. Records
without it (logs written before) are checked with zlib's CRC-32, so old logs replay. A torn
tail (the shard died while writing it) held nothing acknowledged and is skipped;
a record damaged in the middle of the log stops the start (see ``replay``).
"""

from __future__ import annotations

import logging
import os
import pathlib
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, Optional

import google_crc32c

from shardps.core.errors import LogFailed

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIB")
CRC32C_FLAG = 0x80  # in the kind byte: the checksum is CRC-32C of the kind byte and the payload
CREATE_TABLE, REGISTER_DENSE, PUSH, PUSH_DENSE, DROP, EVICT, ASSIGN, SLOTS, ROWS_IN = 1, 2, 3, 4, 5, 6, 7, 8, 9
KIND_NAMES = {CREATE_TABLE: "create table", REGISTER_DENSE: "register dense", PUSH: "push", PUSH_DENSE: "dense push",
              DROP: "drop", EVICT: "evict", ASSIGN: "assign", SLOTS: "slot map", ROWS_IN: "rows moved in"}


def checksum(kind: int, payload: bytes | memoryview) -> int:
    """The checksum a record of ``kind`` (as stored, its flag included) carries."""
    if kind & CRC32C_FLAG:
        return google_crc32c.extend(google_crc32c.value(bytes((kind,))), payload)
    return zlib.crc32(payload, kind)


def segment_path(data_dir: pathlib.Path, segment: int) -> pathlib.Path:
    return data_dir / f"wal-{segment:012d}.log"


def segments(data_dir: pathlib.Path) -> list[int]:
    """Numbers of the WAL segments in ``data_dir``, ascending."""
    out = []
    for p in data_dir.glob("wal-*.log"):
        try:
            out.append(int(p.stem.split("-", 1)[1]))
        except ValueError:
            continue
    return sorted(out)


@dataclass(frozen=True)
class Record:
    """One intact record of the log, and where it sits."""

    path: pathlib.Path
    number: int  # 0-based within its segment
    offset: int  # byte offset of its header within its segment
    kind: int
    payload: bytes


def replay(data_dir: pathlib.Path, first_segment: int) -> Iterator[Record]:
    """Yield every intact record in segments >= ``first_segment``, in order.

    A segment may end in a torn record: the shard died while writing it, so it was
    never acknowledged; it is skipped, and replay goes on with the next segment
    (written after the restart). A damaged record followed by more data is not a
    torn write: replay raises ``CorruptLog`` rather than drop the records after it.
    """
    for seg in segments(data_dir):
        if seg < first_segment:
            continue
        path = segment_path(data_dir, seg)
        data = path.read_bytes()
        pos = number = 0
        while pos < len(data):
            if pos + _HEADER.size > len(data):
                log.warning("%s: %d trailing bytes of a torn record (never acknowledged) skipped",
                            path.name, len(data) - pos)
                break
            length, crc, stored = _HEADER.unpack_from(data, pos)
            start = pos + _HEADER.size
            payload = data[start : start + length]
            if len(payload) < length:
                log.warning("%s: torn record at byte %d (never acknowledged) skipped", path.name, pos)
                break
            kind = stored & ~CRC32C_FLAG
            if checksum(stored, payload) != crc:
                if start + length == len(data):
                    log.warning("%s: torn last record at byte %d (never acknowledged) skipped", path.name, pos)
                    break
                raise CorruptLog(path, number, pos)
            yield Record(path, number, pos, kind, payload)
            pos = start + length
            number += 1


def remove_before(data_dir: pathlib.Path, segment: int) -> None:
    """Delete the segments older than ``segment`` (covered by a checkpoint)."""
    for seg in segments(data_dir):
        if seg < segment:
            segment_path(data_dir, seg).unlink(missing_ok=True)


class CorruptLog(Exception):
    """A record inside a segment fails its checksum, with records after it."""

    def __init__(self, path: pathlib.Path, number: int, offset: int) -> None:
        super().__init__(f"{path} record {number} at byte {offset} fails its checksum, and records follow it")
        self.record = Record(path, number, offset, 0, b"")


def truncate_at(data_dir: pathlib.Path, record: Record) -> tuple[pathlib.Path, int]:
    """Move ``record`` and everything after it (rest of its segment, later segments) into one
    ``.corrupt`` file beside the log; returns (that file, how many records it holds, at least)."""
    seg = int(record.path.stem.split("-", 1)[1])
    aside = record.path.with_name(f"{record.path.name}.corrupt-{int(time.time())}")
    later = [segment_path(data_dir, s) for s in segments(data_dir) if s > seg]
    with open(aside, "wb") as out:
        rest = record.path.read_bytes()[record.offset :]
        out.write(rest)
        lost = _count_records(rest)
        for p in later:
            rest = p.read_bytes()
            out.write(rest)
            lost += _count_records(rest)
        out.flush()
        os.fsync(out.fileno())
    with open(record.path, "r+b") as f:
        f.truncate(record.offset)
        os.fsync(f.fileno())
    for p in later:
        p.unlink()
    return aside, lost


def _count_records(data: bytes) -> int:
    """Records whose headers can be followed in ``data`` (an estimate past a damaged one)."""
    pos = n = 0
    while pos + _HEADER.size <= len(data):
        length = _HEADER.unpack_from(data, pos)[0]
        pos += _HEADER.size + length
        n += 1
    return max(n, 1) if data else 0


FSYNC_POLICIES = ("always", "interval", "none")


class WriteAheadLog:
    """The open log of one shard: append under a table lock, then ``wait`` for the policy's acknowledgement.

    Args:
        data_dir: where the segments are.
        segment: the number of the segment to append to.
        on_flush: hears of each fsync: (seconds it took, records it made durable); the metrics.
        fsync: ``always``, ``interval`` or ``none`` (see the module's docstring).
        fsync_interval_s: under ``interval``, the longest time a written record waits for its fsync.
    """

    def __init__(self, data_dir: pathlib.Path, segment: int, on_flush: Optional[Callable[[float, int], None]] = None,
                 fsync: str = "always", fsync_interval_s: float = 1.0) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if fsync == "interval" and not fsync_interval_s > 0:
            raise ValueError(f"fsync interval must be > 0 seconds, got {fsync_interval_s}")
        self.data_dir = data_dir
        self._on_flush = on_flush
        self.policy = fsync
        self.interval_s = fsync_interval_s
        self.segment = segment
        self._file: BinaryIO = open(segment_path(data_dir, segment), "ab")
        self._cond = threading.Condition()
        self._buffer: list[bytes] = []
        self._appended = 0  # tickets handed out
        self._written = 0  # tickets in the file (a process crash keeps them)
        self._durable = 0  # tickets fsynced (a machine crash keeps them)
        self._sync_wanted = 0  # a caller waits for an fsync up to this ticket
        self._writing = False  # the flusher writes (``always``)
        self._syncing = False  # the syncer fsyncs (``interval``, ``none``): the file stays open meanwhile
        self._closed = False
        self._error: Optional[BaseException] = None
        self._busy_since = 0.0  # time.monotonic() a write or fsync began that has not returned (0: none)
        self.fsyncs = 0
        self.segment_bytes = 0  # bytes appended to this segment (since the last rotation: the last checkpoint)
        loop = self._flush_loop if fsync == "always" else self._sync_loop
        self._flusher = threading.Thread(target=loop, name="wal-flusher", daemon=True)
        self._flusher.start()

    @property
    def records(self) -> int:
        """Records appended since the log was opened."""
        return self._appended

    def append(self, kind: int, payload: bytes) -> int:
        """Append a record (queued for the flusher under ``always``, written into the file otherwise);
        returns the ticket to ``wait`` on."""
        stored = kind | CRC32C_FLAG
        header = _HEADER.pack(len(payload), checksum(stored, payload), stored)
        with self._cond:
            if self._closed:
                raise RuntimeError("write-ahead log is closed")
            if self._error is not None:
                raise LogFailed(f"write-ahead log failed: {self._error}; nothing more is acknowledged")
            if self.policy == "always":
                self._buffer.append(header)
                self._buffer.append(payload)
            else:
                self._write_now(header, payload)
            self._appended += 1
            self.segment_bytes += len(header) + len(payload)
            if self.policy != "always":
                self._written = self._appended
            self._cond.notify_all()
            return self._appended

    def _write_now(self, header: bytes, payload: bytes) -> None:
        """Write one record into the file (the caller holds ``_cond``). A failed write is cut off again, so the
        log never holds a torn record followed by others; the log then refuses further appends."""
        f = self._file
        start = f.tell()
        self._busy_since = time.monotonic()
        try:
            f.write(header)
            f.write(payload)
            f.flush()
            self._busy_since = 0.0
        except BaseException as e:
            self._busy_since = 0.0
            log.exception("write-ahead log write failed")
            self._error = e
            try:
                f.truncate(start)
            except OSError:
                log.exception("write-ahead log: could not cut off a failed write")
            self._cond.notify_all()
            raise LogFailed(f"write-ahead log write failed: {e}; the write is not acknowledged") from e

    def wait(self, ticket: int, durable: bool = False) -> None:
        """Block until the record of ``ticket`` is acknowledged by the policy: fsynced under ``always`` or with
        ``durable``, in the file otherwise."""
        with self._cond:
            if self._error is not None:  # nothing is acknowledged once the log failed: a record after it may be
                # missing (its append failed), and what was written before a failed fsync may be gone (fsyncgate)
                raise LogFailed(f"write-ahead log failed: {self._error}; the write is not acknowledged")
            if durable or self.policy == "always":
                if self.policy != "always" and self._durable < ticket:
                    self._sync_wanted = max(self._sync_wanted, ticket)
                    self._cond.notify_all()
                while self._durable < ticket and self._error is None:
                    self._cond.wait()
                if self._durable < ticket:
                    raise LogFailed(f"write-ahead log failed: {self._error}; the write is not acknowledged")
            elif self._written < ticket:
                raise LogFailed(f"write-ahead log failed: {self._error}; the write is not acknowledged")

    def _sync_loop(self) -> None:
        """``interval`` and ``none``: fsync what was written, every interval or when a caller asks."""
        while True:
            with self._cond:
                deadline = time.monotonic() + self.interval_s if self.policy == "interval" else None
                while not self._closed and self._sync_wanted <= self._durable:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        break
                    self._cond.wait(left)
                upto, closed = self._written, self._closed
                syncing = self._syncing = upto > self._durable
            if syncing:
                self._fsync(upto)
            if closed:
                return

    def _fsync(self, upto: int) -> None:
        """fsync the file and count tickets up to ``upto`` durable (outside ``_cond``: appends go on)."""
        try:
            t0 = time.perf_counter()
            self._busy_since = time.monotonic()
            os.fsync(self._file.fileno())
            self._busy_since = 0.0
            if self._on_flush is not None:
                self._on_flush(time.perf_counter() - t0, upto - self._durable)
        except BaseException as e:  # noqa: BLE001 - waiting callers must learn of it
            self._busy_since = 0.0
            log.exception("write-ahead log fsync failed")
            self._done(upto, e)
            return
        self._done(upto, None)

    def _done(self, upto: int, error: Optional[BaseException]) -> None:
        """The flusher's or syncer's write and fsync ended: tickets up to ``upto`` are durable, or ``error``
        fails every caller waiting (and every later append)."""
        with self._cond:
            if error is None:
                self.fsyncs += 1
                self._durable = max(self._durable, upto)
            else:
                self._error = error
            self._writing = self._syncing = False
            self._cond.notify_all()

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                while not self._buffer and not self._closed:
                    self._cond.wait()
                if not self._buffer and self._closed:
                    return
                data, self._buffer = self._buffer, []
                upto, f = self._appended, self._file
                self._writing = True
            try:
                t0 = time.perf_counter()
                self._busy_since = time.monotonic()
                f.write(b"".join(data))
                f.flush()
                os.fsync(f.fileno())
                self._busy_since = 0.0
                if self._on_flush is not None:
                    self._on_flush(time.perf_counter() - t0, len(data) // 2)
            except BaseException as e:  # noqa: BLE001 - waiting pushes must learn of it
                self._busy_since = 0.0
                log.exception("write-ahead log write failed")
                self._done(upto, e)
                return
            self._done(upto, None)

    def stalled_s(self) -> float:
        """Seconds the write or fsync in progress has been waiting for the disk (0: none in progress). Read without
        the log's lock, which a write blocked on the disk holds."""
        since = self._busy_since
        return time.monotonic() - since if since else 0.0

    @property
    def error(self) -> Optional[BaseException]:
        """Why the log failed (a write or an fsync did): it refuses every append from then on, and a failed fsync is
        never retried as if nothing happened (the kernel may have dropped what it could not write)."""
        return self._error

    def rotate(self) -> int:
        """Start a new segment (callers hold every table lock, so nothing is appended meanwhile); what the old
        one holds is fsynced first."""
        with self._cond:
            while (self._buffer or self._writing or self._syncing) and self._error is None:
                self._cond.wait()
            if self.policy != "always" and self._written > self._durable and self._error is None:
                os.fsync(self._file.fileno())
                self.fsyncs += 1
                self._durable = self._written
                self._cond.notify_all()
            self._file.close()
            self.segment += 1
            self.segment_bytes = 0
            self._file = open(segment_path(self.data_dir, self.segment), "ab")
            return self.segment

    def close(self) -> None:
        """Flush and fsync what is left, and close (a clean stop loses nothing, under any policy)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._flusher.join()
        self._file.close()
