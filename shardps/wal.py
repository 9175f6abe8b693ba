"""Append-only write-ahead log with group commit (durability level ``log``).

Every mutation (table creation, dense registration, push, drop) is appended
as one record while the shard holds the table's lock, so the log order is the
order of application. The pushing thread then waits until a flusher thread has
written and fsynced the record: concurrent pushes share one fsync (group
commit). A push is acknowledged only after its record is on disk.

Files are segments ``wal-<n>.log``. A checkpoint rotates to a new segment while
all tables are locked, records that segment in its metadata, and replay starts
there. Record layout: ``u32 length | u32 crc32 | u8 kind | payload``. A torn or
corrupted tail stops replay: it can only hold records never acknowledged.
"""

from __future__ import annotations

import logging
import os
import pathlib
import struct
import threading
import zlib
from typing import BinaryIO, Iterator, Optional

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IIB")
CREATE_TABLE, REGISTER_DENSE, PUSH, PUSH_DENSE, DROP = 1, 2, 3, 4, 5


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


def replay(data_dir: pathlib.Path, first_segment: int) -> Iterator[tuple[int, bytes]]:
    """Yield (kind, payload) of every intact record in segments >= ``first_segment``."""
    for seg in segments(data_dir):
        if seg < first_segment:
            continue
        path = segment_path(data_dir, seg)
        data = path.read_bytes()
        pos = 0
        while pos + _HEADER.size <= len(data):
            length, crc, kind = _HEADER.unpack_from(data, pos)
            start = pos + _HEADER.size
            payload = data[start : start + length]
            if len(payload) < length or zlib.crc32(payload, kind) != crc:
                log.warning("%s: torn or corrupt record at byte %d; replay stops there", path.name, pos)
                return
            yield kind, payload
            pos = start + length
        if pos != len(data):
            log.warning("%s: %d trailing bytes of a torn record ignored", path.name, len(data) - pos)
            return


class WriteAheadLog:
    """The open log of one shard: append under a table lock, then ``wait`` for durability."""

    def __init__(self, data_dir: pathlib.Path, segment: int) -> None:
        self.data_dir = data_dir
        self.segment = segment
        self._file: BinaryIO = open(segment_path(data_dir, segment), "ab")
        self._cond = threading.Condition()
        self._buffer: list[bytes] = []
        self._appended = 0  # tickets handed out
        self._durable = 0  # tickets on disk
        self._writing = False
        self._closed = False
        self._error: Optional[BaseException] = None
        self.fsyncs = 0
        self._flusher = threading.Thread(target=self._flush_loop, name="wal-flusher", daemon=True)
        self._flusher.start()

    def append(self, kind: int, payload: bytes) -> int:
        """Queue a record; returns the ticket to ``wait`` on."""
        header = _HEADER.pack(len(payload), zlib.crc32(payload, kind), kind)
        with self._cond:
            if self._closed:
                raise RuntimeError("write-ahead log is closed")
            self._buffer.append(header)
            self._buffer.append(payload)
            self._appended += 1
            self._cond.notify_all()
            return self._appended

    def wait(self, ticket: int) -> None:
        """Block until the record of ``ticket`` is fsynced."""
        with self._cond:
            while self._durable < ticket and self._error is None:
                self._cond.wait()
            if self._durable < ticket:
                raise OSError(f"write-ahead log failed: {self._error}")

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
                f.write(b"".join(data))
                f.flush()
                os.fsync(f.fileno())
            except BaseException as e:  # noqa: BLE001 - waiting pushes must learn of it
                log.exception("write-ahead log write failed")
                with self._cond:
                    self._error = e
                    self._writing = False
                    self._cond.notify_all()
                return
            with self._cond:
                self.fsyncs += 1
                self._durable = max(self._durable, upto)
                self._writing = False
                self._cond.notify_all()

    def rotate(self) -> int:
        """Start a new segment (callers hold every table lock, so nothing is appended meanwhile)."""
        with self._cond:
            while (self._buffer or self._writing) and self._error is None:
                self._cond.wait()
            self._file.close()
            self.segment += 1
            self._file = open(segment_path(self.data_dir, self.segment), "ab")
            return self.segment

    def remove_before(self, segment: int) -> None:
        """Delete segments older than ``segment`` (covered by a checkpoint)."""
        for seg in segments(self.data_dir):
            if seg < segment:
                segment_path(self.data_dir, seg).unlink(missing_ok=True)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._flusher.join()
        self._file.close()
