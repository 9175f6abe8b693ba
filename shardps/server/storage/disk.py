"""The disk tier of one shard under ``--disk-dir``: the cold rows of every table with a ``DiskTier``, each table in
its own segment store (``segments``: records appended to files, an index in RAM). Why not RocksDB, which it used
before: docs/storage.md.

Layout of the disk dir::

    shardps-disk.json      which shard the directory belongs to (a directory that is not one is never wiped)
    live/<hex of key>/     each table's segments, which the shard reads and writes, rebuilt on every start: empty, or
                           linked from the checkpoint the shard restores
    checkpoints/<name>/    one per shard checkpoint or export cut of a shard with tiered tables: each table's segments
                           (hard links of the live ones, sealed) and index, the tables' layouts and manifests

A row is one record: the row's values, optimizer state, step count and metadata, packed (``RecordCodec``). The live
segments are never fsynced: a crash is survived by the shard's checkpoint (with its tier checkpoint) and write-ahead
log, replayed through the tiered table as any other.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import threading
import time
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from shardps.core.errors import InvalidArgument, ResourceExhausted
from shardps.core.files import fsync_dir
from shardps.server.storage.records import META_FIELDS, Column, RecordCodec, as_words, gather_columns  # noqa: F401
from shardps.server.storage.segments import SegmentError, SegmentStore

log = logging.getLogger(__name__)

MARKER = "shardps-disk.json"
LAYOUTS = "shardps-layouts.json"  # a checkpoint's tables: their record layouts
MANIFESTS = "shardps-segments.json"  # a checkpoint's tables: their segments, counts, checksums and index
STAT_EVERY_S = 0.5  # how old the free space ``check_space`` counts from may be


class DiskTierError(Exception):
    """The disk tier cannot be opened or restored: a directory that is not a shard's disk tier, another shard's,
    a checkpoint's store missing or damaged, or a store written for another table spec. The shard does not start."""


def _raise_write(root: pathlib.Path, what: str, e: Exception) -> None:
    """A failed write of the disk tier (an I/O error) as the request's refusal."""
    raise ResourceExhausted(f"disk tier {root}: {what} failed ({e}); nothing of this request was applied") from e


def table_dir(key: str) -> str:
    """The directory of the table stored as ``key`` (table names may hold '/': hex)."""
    return "t-" + key.encode().hex()


class TableStore:
    """One table's rows on disk: its ``SegmentStore`` in the live directory, behind the tier's space checks."""

    def __init__(self, tiers: DiskTiers, name: str, codec: RecordCodec, segments: SegmentStore) -> None:
        self.tiers = tiers
        self.name = name
        self.codec = codec
        self.segments = segments

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of ``ids`` are on disk, their records in that order): one batched read."""
        try:
            return self.segments.get(ids)
        except OSError as e:  # a disk that fails its reads
            raise ResourceExhausted(f"disk tier {self.tiers.root}: reading {ids.shape[0]:,} rows of {self.name!r} "
                                    f"failed ({e}); nothing of this request was applied") from e

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` are on disk (the index alone: nothing is read)."""
        return self.segments.locate(ids) >= 0

    def locate(self, ids: np.ndarray) -> tuple[np.ndarray, int]:
        """(where each of ``ids`` is on disk, -1 where not; a stamp for ``read_at``): the index alone."""
        return self.segments.locate(ids), self.segments.compactions

    def read_at(self, ids: np.ndarray, locs: np.ndarray, stamp: int) -> np.ndarray:
        """The records of ``ids`` (all on disk) from ``locs``, ``locate``'s with its ``stamp``: located again only
        when a compaction moved records since (writes move only the rows written)."""
        if stamp != self.segments.compactions:
            locs = self.segments.locate(ids)
        try:
            return self.segments.read(locs)
        except OSError as e:  # a disk that fails its reads
            raise ResourceExhausted(f"disk tier {self.tiers.root}: reading {ids.shape[0]:,} rows of {self.name!r} "
                                    f"failed ({e}); nothing of this request was applied") from e

    def disk_bytes(self) -> int:
        """Bytes the table's records take on disk (live and dead, until compacted)."""
        return self.segments.disk_bytes

    @property
    def index_bytes(self) -> int:
        """Memory the index of the rows on disk holds."""
        return self.segments.index_bytes

    def put(self, ids: np.ndarray, fields: dict[str, np.ndarray]) -> None:
        """Write the rows of ``ids``, unique (every caller's are: a hot set's slots, a request's unique ids; not checked
        here, where a check cost 4% of a tiered shard's time), in one batch; a failure raises ResourceExhausted and
        changes nothing the caller relies on: the rows are still in memory."""
        if not ids.shape[0]:
            return
        self.tiers.check_space(ids.shape[0] * self.segments.record.itemsize)
        try:
            self.segments.put(ids, self.codec.pack(fields))
        except OSError as e:
            _raise_write(self.tiers.root, f"writing {ids.shape[0]:,} rows of {self.name!r} back", e)

    def put_slots(self, ids: np.ndarray, columns: Sequence[Column], slots: np.ndarray) -> None:
        """``put`` of the rows at ``slots`` of per-row arrays: their ids in ``ids`` (an array by slot) and their
        records' fields in ``columns`` (``records.Column``: every field of ``codec``), copied straight into the
        records written (``records.gather_columns``)."""
        n = slots.shape[0]
        if not n:
            return
        self.tiers.check_space(n * self.segments.record.itemsize)
        data = np.empty(n, self.segments.record)
        gather_columns(as_words(data), [(as_words(ids), 0, 2, 0)] + [(src, first, width, at + 2)
                                                                      for src, first, width, at in columns], slots)
        try:
            self.segments.put_data(ids[slots], data)
        except OSError as e:
            _raise_write(self.tiers.root, f"writing {n:,} rows of {self.name!r} back", e)

    def scan(self, first: int, last: int, batch: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of the rows of hash slots [first, last] on disk, in batches."""
        return self.segments.scan(first, last, batch)

    def delete(self, ids: np.ndarray) -> None:
        """Remove the rows of ``ids`` from disk (absent ones are no-ops)."""
        if not ids.shape[0]:
            return
        try:
            self.segments.delete(ids)
        except OSError as e:  # a compaction's write
            _raise_write(self.tiers.root, f"removing {ids.shape[0]:,} rows of {self.name!r}", e)


class DiskTiers:
    """The disk tier of shard ``shard_index`` of ``num_shards`` under ``root`` (see the module docstring), opened
    on first use."""

    def __init__(self, root: pathlib.Path, shard_index: int, num_shards: int, min_free_mb: int = 256) -> None:
        self.root = root
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.min_free = min_free_mb << 20
        self._free = 0  # bytes free at the last statvfs, less what was written since
        self._free_at = -1e9  # time.monotonic() of that statvfs
        self._open = False
        self._stores: dict[str, SegmentStore] = {}
        self._lock = threading.RLock()
        self._layout_map: dict[str, dict[str, Any]] = {}  # table -> record layout, written with each checkpoint
        self._restored: set[str] = set()  # tables of the checkpoint restored, not yet taken by their table

    @property
    def live_dir(self) -> pathlib.Path:
        return self.root / "live"

    @property
    def checkpoint_root(self) -> pathlib.Path:
        return self.root / "checkpoints"

    # ---- opening ---------------------------------------------------------------------------

    def check_root(self, create: bool = True) -> None:
        """Refuse a disk dir that holds anything but this shard's disk tier (never wipe what is not ours); with
        ``create``, make it this shard's (its marker) when it is empty or new."""
        marker = self.root / MARKER
        if marker.exists():
            try:
                owner = json.loads(marker.read_text())
            except (OSError, ValueError) as e:
                raise DiskTierError(f"{marker} is damaged ({e}); remove the disk dir {self.root} or choose another "
                                    "--disk-dir") from e
            if (owner.get("shard_index"), owner.get("num_shards")) != (self.shard_index, self.num_shards):
                raise DiskTierError(f"{marker}: the disk dir {self.root} belongs to shard {owner.get('shard_index')} "
                                    f"of {owner.get('num_shards')}, not {self.shard_index} of {self.num_shards}; "
                                    "give each shard its own --disk-dir")
            return
        if self.root.exists() and any(self.root.iterdir()):
            raise DiskTierError(f"--disk-dir {self.root} holds files but no {MARKER}: it is not a shardps disk tier "
                                "(nothing there was touched); choose an empty or new directory")
        if not create:
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"shard_index": self.shard_index, "num_shards": self.num_shards}))
        os.replace(tmp, marker)

    def reset(self) -> None:
        """Start with an empty live directory (a shard's start without a checkpoint to restore)."""
        with self._lock:
            self.close()
            self.check_root()
            shutil.rmtree(self.live_dir, ignore_errors=True)
            self.live_dir.mkdir(parents=True)
            self._open = True

    def restore(self, name: str, tables: dict[str, RecordCodec]) -> None:
        """Rebuild the live directory from checkpoint ``name`` (hard links of its segments, checked against their
        checksums), checking that it holds ``tables`` written with their record layouts."""
        with self._lock:
            self.close()
            self.check_root()
            src = self.checkpoint_root / name
            layouts = self._read_layouts(src)
            manifests = self._read_json(src / MANIFESTS)
            for table, codec in tables.items():
                if table not in layouts or table not in manifests:
                    raise DiskTierError(f"{src / LAYOUTS}: the disk tier of checkpoint {name} has no table {table!r}")
                if layouts[table] != codec.describe():
                    raise DiskTierError(f"{src / LAYOUTS}: table {table!r} was written as {layouts[table]}, but its "
                                        f"spec now needs {codec.describe()}: the store belongs to another table spec")
            shutil.rmtree(self.live_dir, ignore_errors=True)
            self.live_dir.mkdir(parents=True)
            self._open = True
            try:
                for table, codec in tables.items():
                    self._stores[table] = SegmentStore.load(src / table_dir(table), self.live_dir / table_dir(table),
                                                            codec, manifests[table])
            except (SegmentError, OSError, ValueError, KeyError) as e:
                self.close()
                raise DiskTierError(f"the disk tier of checkpoint {name} ({src}) cannot be opened: {e}") from e
            self._layout_map = {t: layouts[t] for t in tables}
            self._restored = set(tables)

    def check_space(self, nbytes: int, fresh: bool = False) -> None:
        """Refuse a write of ``nbytes`` that would leave less than ``min_free`` on the file system (room for the
        checkpoints' sealed segments and compactions), before it is tried. The file system is asked (statvfs) at
        most every ``STAT_EVERY_S`` while the writes since fit, and always before a refusal and when ``fresh``: a
        statvfs per write cost a tiered shard 0.35 us a row it read (another writer's bytes in between are in the
        margin; past it, the write itself fails, refused the same way)."""
        now = time.monotonic()
        if fresh or now - self._free_at > STAT_EVERY_S or self._free < nbytes + self.min_free:
            st = os.statvfs(self.live_dir if self.live_dir.exists() else self.root)
            self._free, self._free_at = st.f_bavail * st.f_frsize, now
        free = self._free
        if free < nbytes + self.min_free:
            raise ResourceExhausted(f"disk tier {self.root}: {free / (1 << 20):,.0f} MiB free, under the {self.min_free >> 20} "
                                    f"MiB it keeps free (--disk-min-free-mb) plus this write's {nbytes / (1 << 20):,.1f} "
                                    f"MiB: refused, nothing of it applied; free disk space or give the table more "
                                    f"memory_mb")
        self._free -= nbytes

    def _ensure_open(self) -> None:
        with self._lock:
            if not self._open:
                self.reset()

    # ---- tables ------------------------------------------------------------------------------

    def create(self, name: str, codec: RecordCodec) -> TableStore:
        """The store of a new table: the one ``restore`` brought back for it, else an empty one (a stale one of the
        same name is dropped first)."""
        with self._lock:
            self._ensure_open()
            if name in self._restored:
                self._restored.discard(name)
                return TableStore(self, name, codec, self._stores[name])
            self.drop(name)
            self._stores[name] = SegmentStore(self.live_dir / table_dir(name), codec)
            self._layout_map[name] = codec.describe()
            return TableStore(self, name, codec, self._stores[name])

    def drop(self, name: str) -> None:
        with self._lock:
            store = self._stores.pop(name, None)
            self._restored.discard(name)
            self._layout_map.pop(name, None)
            if store is not None:
                store.close()
            shutil.rmtree(self.live_dir / table_dir(name), ignore_errors=True)

    @staticmethod
    def _read_json(path: pathlib.Path) -> dict[str, Any]:
        try:
            return json.loads(path.read_text())  # type: ignore[no-any-return]
        except FileNotFoundError as e:
            raise DiskTierError(f"{path}: the disk tier this checkpoint needs is missing (was --disk-dir changed or "
                                "the directory removed?)") from e
        except (OSError, ValueError) as e:
            raise DiskTierError(f"{path} is damaged: {e}") from e

    @classmethod
    def _read_layouts(cls, path: pathlib.Path) -> dict[str, dict[str, Any]]:
        return cls._read_json(path / LAYOUTS)

    # ---- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, name: str) -> pathlib.Path:
        """Checkpoint ``checkpoints/<name>``: every table's segments sealed and hard linked, its index written, with
        the tables' layouts and manifests; callers hold every table's lock, so it is one consistent cut."""
        with self._lock:
            self._ensure_open()
            dst = self.checkpoint_root / name
            self.checkpoint_root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            self.check_space(0, fresh=True)
            try:
                dst.mkdir()
                manifests = {t: s.checkpoint(dst / table_dir(t)) for t, s in self._stores.items()}
                for file, data in ((MANIFESTS, manifests), (LAYOUTS, self._layout_map)):
                    tmp = dst / (file + ".tmp")
                    tmp.write_text(json.dumps(data))
                    os.replace(tmp, dst / file)
            except OSError as e:  # a full disk or an I/O error: the checkpoint fails, nothing else
                shutil.rmtree(dst, ignore_errors=True)
                _raise_write(self.root, f"checkpoint {name}", e)
            return dst

    def sync_checkpoint(self, name: str) -> None:
        """fsync every file of checkpoint ``name`` and its directories (the live segments it links were never
        synced; the spilled hot rows are written under the cut's locks and synced after them)."""
        path = self.checkpoint_root / name
        for d in [path, *(p for p in path.iterdir() if p.is_dir())]:
            for f in d.iterdir():
                if f.is_file():
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            fsync_dir(d)

    def remove_checkpoint(self, name: str) -> None:
        shutil.rmtree(self.checkpoint_root / name, ignore_errors=True)

    def checkpoints(self) -> list[str]:
        root = self.checkpoint_root
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def open_checkpoint(self, name: str) -> CheckpointReader:
        """A read-only view of checkpoint ``name`` (for scans: exports, offline resharding)."""
        return CheckpointReader(self.checkpoint_root / name)

    # ---- accounting --------------------------------------------------------------------------

    def disk_bytes(self) -> int:
        """Bytes the live segments take on disk."""
        return sum(s.disk_bytes for s in self._stores.values())

    def close(self) -> None:
        with self._lock:
            for store in self._stores.values():
                store.close()
            self._stores.clear()
            self._open = False


class CheckpointReader:
    """A disk tier checkpoint opened read-only, scanned table by table in (slot, id) order."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.layouts = DiskTiers._read_layouts(path)
        self.manifests = DiskTiers._read_json(path / MANIFESTS)
        self._stores: dict[str, SegmentStore] = {}

    def scan(self, name: str, codec: RecordCodec, batch: int = 65536,
             slots: Optional[tuple[int, int]] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of table ``name`` in batches of at most ``batch`` rows, in (slot, id) order; ``slots``
        (first, last) limits the scan to those hash slots."""
        if self.layouts.get(name) != codec.describe() or name not in self.manifests:
            raise InvalidArgument(f"{self.path}: table {name!r} has layout {self.layouts.get(name)}, "
                                  f"expected {codec.describe()}")
        if name not in self._stores:
            try:
                self._stores[name] = SegmentStore.load(self.path / table_dir(name), None, codec, self.manifests[name],
                                                       verify=False)
            except (SegmentError, OSError) as e:
                raise DiskTierError(f"the disk tier checkpoint {self.path} cannot be read: {e}") from e
        first, last = slots if slots is not None else (0, 1 << 16)
        return self._stores[name].scan(first, last, batch)

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self._stores.clear()
