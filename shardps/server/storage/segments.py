"""One table's rows on disk: fixed-size records appended to segment files, found through an index in RAM (id ->
segment and record), read by a compiled loop of ``pread`` s (the kernel ``pread_records``), or where the numpy
references serve, by a gather from the files' read-only mappings whose pages are let go every ``READ_CHUNK`` records.

Why this and not RocksDB (what the tier used before): a batch read of cold rows costs 0.9-1.1 us a row here against
6.5-9.7 us through RocksDB's MultiGet (3.9 us tuned: 1 KiB blocks, no checksums), on the same rows (docs/storage.md).

A table's directory (``live/<hex of its key>/``, and the same under each checkpoint) holds ``seg-<n>.dat``: records
of (id, row record) in the order written, at most ``SEGMENT_BYTES`` a file. Nothing is written over: a row written
again goes to the end of the newest segment, and its older record is dead. A checkpoint seals the segment being
written (truncated to its records, its CRC-32C taken) and hard links every segment, so a checkpoint costs no copy
of the rows; it writes the index (ids, then locations) beside them. Segments whose records are mostly dead are
compacted: their live records written again at the end, the file removed (a checkpoint's link keeps its copy).

Memory: the index holds 24-32 bytes per row on disk (id, location, and the probe table's share; or 16, and a flat
map of 4 bytes per id of the table: ``flat_index``); the mappings are
address space only, their pages dropped after every ``READ_CHUNK`` records read (or ``COPY_CHUNK`` checksummed or
compacted): at most 8 MiB resident (a read fault maps 64 KiB). The pread loop costs a tiered shard 15-25% less CPU
a row than the mappings' page faults and drops did.
Writes are ``pwrite`` s into the page cache: never fsynced live (the shard's log and checkpoints survive a crash),
and a failed write changes nothing the index points at.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import shutil
from typing import Any, Iterator, Optional, Union

import google_crc32c
import numpy as np

from shardps.core import kernels
from shardps.core.files import ChecksummedWriter
from shardps.core.memory import grown, regrow, zeros
from shardps.core.routing import slot_of_ids
from shardps.server.storage.index import DirectIndex, HashIndex
from shardps.server.storage.records import RecordCodec

SEGMENT_BYTES = 64 << 20
# Records gathered between two drops of the mappings' pages: a read fault maps the 16 pages around it that the page
# cache holds (the kernel's fault-around, 64 KiB; madvise cannot turn it off), so 128 records keep 8 MiB at most.
READ_CHUNK = 128
COPY_CHUNK = 4096  # records read at a time by checksums and compactions (at most 2.5 MiB of pages, then dropped)
INDEX_FILE = "index.bin"
MAX_SMALL = 8  # sealed segments under a quarter full kept before the smallest are merged
_SEG_SHIFT = 32
log = logging.getLogger(__name__)


class SegmentError(Exception):
    """A checkpoint's segments or index are missing, truncated or damaged (the message names the file)."""


def _seg_name(number: int) -> str:
    return f"seg-{number:06d}.dat"


class Segment:
    """One segment file: its descriptor, a read-only mapping of its records, how many were written and are dead."""

    def __init__(self, path: pathlib.Path, number: int, record: np.dtype, capacity: int, count: int = 0,
                 sealed: bool = False, crc: Optional[int] = None) -> None:
        self.path = path
        self.number = number
        self.record = record
        self.capacity = capacity
        self.count = count
        self.dead = 0
        self.sealed = sealed
        self.crc = crc
        self.fd = os.open(path, os.O_RDONLY if sealed else os.O_RDWR | os.O_CREAT, 0o644)
        try:
            size = os.fstat(self.fd).st_size
            if sealed and size < count * record.itemsize:
                raise SegmentError(f"{path}: {size:,} bytes, too short for its {count:,} records (truncated or damaged)")
            if not sealed:
                os.ftruncate(self.fd, capacity * record.itemsize)  # sparse: disk space is taken as records arrive
            length = (count if sealed else capacity) * record.itemsize
            self.mm: Optional[mmap.mmap] = mmap.mmap(self.fd, length, prot=mmap.PROT_READ) if length else None
        except BaseException:
            os.close(self.fd)
            raise
        self.view = np.frombuffer(self.mm, record) if self.mm is not None else np.zeros(0, record)

    def gather(self, records: np.ndarray) -> np.ndarray:
        """Copies of the records at ``records`` (indexes below ``count``), gathered from the mapping (its pages stay
        mapped until dropped): the numpy reference of ``SegmentStore.read``'s compiled preads."""
        return self.view[records]

    def drop_pages(self) -> None:
        if self.mm is not None:
            self.mm.madvise(mmap.MADV_DONTNEED)  # the pages stay in the page cache: only this mapping lets go

    def append(self, data: np.ndarray) -> None:
        """Write ``data`` (records) after the last one; OSError (a full or failing disk) leaves ``count`` as it was."""
        buf = memoryview(data).cast("B")  # type: ignore[arg-type]
        done = os.pwrite(self.fd, buf, self.count * self.record.itemsize)
        if done != buf.nbytes:
            raise OSError(28, f"short write ({done:,} of {buf.nbytes:,} bytes)", str(self.path))
        self.count += data.shape[0]

    def seal(self) -> None:
        """No more records go here (a checkpoint links it): the file cut to its records, its CRC-32C taken."""
        if self.sealed:
            return
        os.ftruncate(self.fd, self.count * self.record.itemsize)
        self.view = self.view[:self.count]  # past the file's end now: never read
        self.crc = records_crc(self)
        self.sealed = True

    @property
    def full(self) -> bool:
        return self.sealed or self.count >= self.capacity

    @property
    def nbytes(self) -> int:
        return self.count * self.record.itemsize

    def close(self) -> None:
        self.view = np.zeros(0, self.record)
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        os.close(self.fd)


def records_crc(seg: Segment) -> int:
    """The CRC-32C of the records of ``seg``, read ``COPY_CHUNK`` records at a time."""
    crc = 0
    for lo in range(0, seg.count, COPY_CHUNK):
        crc = google_crc32c.extend(crc, seg.view[lo:min(seg.count, lo + COPY_CHUNK)].view(np.uint8))
        seg.drop_pages()
    return crc


def check_crc(seg: Segment) -> None:
    """Raise SegmentError when the records of a sealed ``seg`` do not match its CRC-32C (a damaged file)."""
    if records_crc(seg) != seg.crc:
        raise SegmentError(f"{seg.path}: checksum mismatch (damaged)")


def flat_index(store: SegmentStore, num_embeddings: int) -> None:
    """``store`` finds ids through a flat map over ``num_embeddings`` ids (``DirectIndex``: one read a lookup) from
    here on, its rows keeping their slots (and locations)."""
    ids = store.index.ids.copy()
    flat = DirectIndex(num_embeddings, max(16, ids.shape[0]))
    flat.insert(ids, np.arange(ids.shape[0], dtype=np.int64))
    store.index = flat


class SegmentStore:
    """The rows of one table in ``directory`` (see the module docstring). ``codec``: the table's record layout."""

    def __init__(self, directory: pathlib.Path, codec: RecordCodec, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.dir = directory
        self.codec = codec
        self.record = np.dtype([("id", "<i8"), ("rec", f"V{codec.dtype.itemsize}")])
        self.per_segment = max(16, segment_bytes // self.record.itemsize)
        self.segments: dict[int, Segment] = {}
        self.index: Union[HashIndex, DirectIndex] = HashIndex(1024, probe_rows=1024)
        self.loc = zeros(1024, np.int64)  # location of the row of each index slot: segment << 32 | record
        self.next_number = 1
        self._touched: set[int] = set()  # segments read since their pages were last dropped
        self._gathered = 0  # records read since then
        self.compactions = 0  # compactions begun: locations read before one may be stale
        self._fd_table, self._fd_key = np.zeros(0, np.int32), (-1, -1)  # ``_fds``, and when it was made
        directory.mkdir(parents=True, exist_ok=True)

    # ---- reads --------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.index)

    @property
    def index_bytes(self) -> int:
        """Memory of the index: its ids and probe table (or flat map), and a location per row."""
        return self.index.nbytes + 8 * len(self.index)

    @property
    def disk_bytes(self) -> int:
        return sum(s.nbytes for s in self.segments.values())

    def locate(self, ids: np.ndarray) -> np.ndarray:
        """Location of each of ``ids`` (-1 where not on disk)."""
        slots = self.index.lookup(ids)
        return np.where(slots >= 0, self.loc[np.maximum(slots, 0)], -1)

    def read(self, locs: np.ndarray) -> np.ndarray:
        """The records (``codec.dtype``) at ``locs`` (all present), in that order: by the kernel ``pread_records``
        (one call, each record's part after its id read straight into the answer), else gathered from the mappings
        in file order, their pages dropped after every ``READ_CHUNK`` records (of every segment touched: one call
        each, where a drop per segment and chunk cost 9.5% of a tiered shard's time)."""
        out = np.empty(locs.shape[0], self.codec.dtype)
        if not locs.shape[0]:
            return out
        k = kernels.jit()
        if k is not None:  # read by pread: nothing mapped
            size = self.codec.dtype.itemsize
            done = k.pread_records(self._fds(), locs, self.record.itemsize, self.record.itemsize - size, size,
                                   out.view(np.uint8))
            if done != locs.shape[0]:
                seg = self.segments.get(int(locs[done]) >> _SEG_SHIFT)
                where = str(seg.path if seg is not None else self.dir)
                raise OSError(5, f"record {int(locs[done]) & 0xFFFFFFFF} could not be read in full", where)
            return out
        raw = out.view(f"V{self.codec.dtype.itemsize}")
        order = np.argsort(locs, kind="stable")
        ordered = locs[order]
        segs = ordered >> _SEG_SHIFT
        cuts = np.flatnonzero(np.diff(segs)) + 1
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, ordered.shape[0]].tolist()):
            seg = self.segments[int(segs[a])]
            lo = a
            while lo < b:  # (fewer than READ_CHUNK gathered since the last drop: hi > lo)
                hi = min(b, lo + READ_CHUNK - self._gathered)
                raw[order[lo:hi]] = seg.gather(ordered[lo:hi] & 0xFFFFFFFF)["rec"]
                self._touched.add(seg.number)
                self._gathered += hi - lo
                if self._gathered >= READ_CHUNK:
                    self.drop_pages()
                lo = hi
        return out

    def _fds(self) -> np.ndarray:
        """Each segment's descriptor by its number (-1: none), made again when one came (always the newest) or went."""
        key = (self.next_number, len(self.segments))
        if self._fd_key != key:
            fds = np.full(self.next_number, -1, np.int32)
            for number, seg in self.segments.items():
                fds[number] = seg.fd
            self._fd_table, self._fd_key = fds, key
        return self._fd_table

    def drop_pages(self) -> None:
        """Let the mappings of the segments read since the last drop go of their pages."""
        for number in self._touched:
            seg = self.segments.get(number)
            if seg is not None:
                seg.drop_pages()
        self._touched.clear()
        self._gathered = 0

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of ``ids`` are on disk, their records in that order)."""
        locs = self.locate(ids)
        found = locs >= 0
        return found, self.read(locs[found])

    def scan(self, first: int, last: int, batch: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of the rows of hash slots [first, last], in (slot, id) order, in batches."""
        ids = self.index.ids
        slots = slot_of_ids(ids)
        pick = np.flatnonzero((slots >= first) & (slots <= last))
        pick = pick[np.lexsort((ids[pick].view(np.uint64), slots[pick]))]
        for lo in range(0, pick.shape[0], batch):
            part = pick[lo:lo + batch]
            yield ids[part].copy(), self.read(self.loc[part])

    # ---- writes -------------------------------------------------------------------------------

    def _active(self) -> Segment:
        newest = self.segments.get(self.next_number - 1)
        if newest is not None and not newest.full:
            return newest
        seg = Segment(self.dir / _seg_name(self.next_number), self.next_number, self.record, self.per_segment)
        self.segments[seg.number] = seg
        self.next_number += 1
        return seg

    def put(self, ids: np.ndarray, records: np.ndarray) -> None:
        """Write ``records`` (``codec.dtype``) of unique ``ids`` at the end; OSError when the disk refuses, with the
        index unchanged (what was written of the batch is dead)."""
        data = np.empty(ids.shape[0], self.record)
        data["id"] = ids
        data["rec"] = records.view(f"V{self.codec.dtype.itemsize}")
        self.put_data(ids, data)

    def put_data(self, ids: np.ndarray, data: np.ndarray) -> None:
        """``put`` of whole records (``record``: each id and its row's record) made by the caller."""
        self._point(ids, self._append(data))
        self.maybe_compact()

    def _append(self, data: np.ndarray) -> np.ndarray:
        """Write whole records (id and row record) at the end, filling segments in turn; their locations. OSError
        when the disk refuses: what was written of ``data`` is dead (nothing points at it)."""
        n = data.shape[0]
        locs = np.empty(n, np.int64)
        pos = 0
        written: list[tuple[Segment, int]] = []
        try:
            while pos < n:
                seg = self._active()
                k = min(n - pos, seg.capacity - seg.count)
                start = seg.count
                seg.append(np.ascontiguousarray(data[pos:pos + k]))
                written.append((seg, k))
                locs[pos:pos + k] = (seg.number << _SEG_SHIFT) | np.arange(start, start + k, dtype=np.int64)
                pos += k
        except BaseException:
            for seg, k in written:
                seg.dead += k
            raise
        return locs

    def _point(self, ids: np.ndarray, locs: np.ndarray) -> None:
        """The index: ``ids`` now at ``locs``; their older records dead."""
        slots = self.index.lookup(ids)
        old = slots >= 0
        if old.any():
            self._kill(self.loc[slots[old]])
            self.loc[slots[old]] = locs[old]
        new = np.flatnonzero(~old)
        if new.size:
            count = len(self.index)
            if count + new.size > self.loc.shape[0]:
                # In place where nothing else holds it (memory.regrow): a copy would hold old and new at once.
                self.loc[count:] = 0
                regrow(self, "loc", max(count + new.size, self.loc.shape[0] * 3 // 2))
            self.index.insert(ids[new], np.arange(count, count + new.size, dtype=np.int64))
            self.loc[count:count + new.size] = locs[new]

    def _kill(self, locs: np.ndarray) -> None:
        counts = np.bincount(locs >> _SEG_SHIFT)  # (segment numbers are small: counted, not sorted)
        for number in np.flatnonzero(counts).tolist():
            seg = self.segments.get(number)
            if seg is not None:
                seg.dead += int(counts[number])

    def delete(self, ids: np.ndarray) -> None:
        """Forget the rows of ``ids`` (absent ones are no-ops): their records are dead."""
        slots = self.index.lookup(ids)
        present = np.unique(ids[slots >= 0])
        if not present.size:
            return
        self._kill(self.locate(present))
        moves = self.index.remove(present, check=False)
        k = kernels.jit()
        if moves.size and k is not None:
            k.apply_moves(self.loc.reshape(-1, 1), moves)
        else:
            for frm, to in moves.tolist():
                self.loc[to] = self.loc[frm]
        self.maybe_compact()

    # ---- compaction ---------------------------------------------------------------------------

    def maybe_compact(self) -> None:
        """Compact the full segment (not the newest) with the most dead records while the dead outnumber the live
        (and a segment's worth): disk space stays within twice the rows, plus a segment. Then merge small sealed
        segments (every checkpoint seals the one being written) while more than ``MAX_SMALL`` are left, the smallest
        first, so a shard that checkpoints often keeps few files open. A compaction that fails (a full disk) leaves
        every row where the index says and is tried again at the next write."""
        try:
            while True:
                newest = self.next_number - 1
                dead = sum(s.count for s in self.segments.values()) - len(self.index)
                candidates = [s for s in self.segments.values() if s.full and s.number != newest and s.dead]
                if dead > max(len(self.index), self.per_segment) and candidates:
                    self.compact(max(candidates, key=lambda s: s.dead))
                    continue
                small = [s for s in self.segments.values()
                         if s.sealed and s.number != newest and s.count < self.per_segment // 4]
                if len(small) <= MAX_SMALL:
                    return
                self.compact(min(small, key=lambda s: s.count - s.dead))
        except OSError as e:
            log.warning("disk tier %s: compaction stopped (%s); the rows stay where they are", self.dir, e)

    def compact(self, seg: Segment) -> None:
        """Write the live records of ``seg`` again at the end, then remove its file."""
        self.compactions += 1  # (first: a location read before may be stale from here on)
        for lo in range(0, seg.count, COPY_CHUNK):
            hi = min(seg.count, lo + COPY_CHUNK)
            part = seg.view[lo:hi].copy()
            seg.drop_pages()
            here = (seg.number << _SEG_SHIFT) | np.arange(lo, hi, dtype=np.int64)
            live = self.locate(part["id"]) == here
            if live.any():
                live_part = part[live]
                self._point(live_part["id"].copy(), self._append(live_part))
        self.segments.pop(seg.number)
        seg.close()
        seg.path.unlink(missing_ok=True)

    # ---- checkpoints --------------------------------------------------------------------------

    def checkpoint(self, dst: pathlib.Path) -> dict[str, Any]:
        """Seal the segment being written, hard link every segment into ``dst`` (copied across file systems) and
        write the index there; the manifest that ``load`` reads back."""
        dst.mkdir(parents=True, exist_ok=True)
        for seg in self.segments.values():
            seg.seal()
            _link(seg.path, dst / seg.path.name)
        n = len(self.index)
        with open(dst / INDEX_FILE, "wb") as f:
            w = ChecksummedWriter(f)
            for arr in (self.index.ids, self.loc[:n]):
                w.write(arr)
        return {"rows": n, "index_crc": w.crc, "record_bytes": self.record.itemsize, "per_segment": self.per_segment,
                "segments": {str(s.number): [s.count, s.crc] for s in self.segments.values()}}

    @classmethod
    def load(cls, src: pathlib.Path, directory: Optional[pathlib.Path], codec: RecordCodec,
             manifest: dict[str, Any], verify: bool = True) -> SegmentStore:
        """The store a checkpoint's ``src`` holds (``manifest``: what ``checkpoint`` returned), its segments linked
        into ``directory`` (None: read in place, read only). SegmentError names a missing or damaged file."""
        store = cls(directory or src, codec)
        if manifest["record_bytes"] != store.record.itemsize:
            raise SegmentError(f"{src}: records of {manifest['record_bytes']} bytes, the table's are "
                               f"{store.record.itemsize}")
        store.per_segment = int(manifest["per_segment"])
        try:
            for number, (count, crc) in sorted(((int(k), v) for k, v in manifest["segments"].items())):
                path = src / _seg_name(number)
                if not path.exists():
                    raise SegmentError(f"{path}: missing")
                if directory is not None:
                    _link(path, directory / path.name)
                    path = directory / path.name
                seg = Segment(path, number, store.record, store.per_segment, count, sealed=True, crc=crc)
                store.segments[number] = seg
                if verify:
                    check_crc(seg)
                store.next_number = number + 1
            n = int(manifest["rows"])
            try:
                raw = np.fromfile(src / INDEX_FILE, np.uint8)
            except OSError as e:
                raise SegmentError(f"{src / INDEX_FILE}: {e}") from e
            if raw.nbytes != 16 * n or google_crc32c.value(raw) != manifest["index_crc"]:
                raise SegmentError(f"{src / INDEX_FILE}: damaged or truncated")
            ids, locs = raw[:8 * n].view(np.int64), raw[8 * n:].view(np.int64)
            store.index = HashIndex(max(16, n), probe_rows=max(16, n))
            store.index.insert(ids, np.arange(n, dtype=np.int64))
            store.loc = grown(locs, max(16, n))
            live = dict(zip(*(a.tolist() for a in np.unique(locs >> _SEG_SHIFT, return_counts=True))))
            for number in live:
                if number not in store.segments:
                    raise SegmentError(f"{src / INDEX_FILE}: points into segment {number}, which is not there")
            for seg in store.segments.values():
                seg.dead = seg.count - live.get(seg.number, 0)
        except BaseException:
            store.close()
            raise
        return store

    def close(self) -> None:
        for seg in self.segments.values():
            seg.close()
        self.segments.clear()


def _link(src: pathlib.Path, dst: pathlib.Path) -> None:
    try:
        os.link(src, dst)
    except FileExistsError:
        pass
    except OSError:
        shutil.copy2(src, dst)

