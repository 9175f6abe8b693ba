"""The disk tier of one shard: a RocksDB database (through ``rocksdict``) under ``--disk-dir`` holding the cold rows
of every table with a ``DiskTier``, one column family per table. Why RocksDB and not LMDB: docs/storage.md.

Layout of the disk dir::

    shardps-disk.json      which shard the directory belongs to (a directory that is not one is never wiped)
    live/                  the database the shard reads and writes, rebuilt on every start: empty, or cloned
                           (hard links) from the checkpoint the shard restores
    checkpoints/<name>/    RocksDB checkpoints (hard links of the live files), one per shard checkpoint or export
                           cut of a shard with tiered tables

A row is one record. Key: its hash slot (u16, big-endian) then its id (u64, big-endian), so a slot's rows are one
key range; value: the row's values, optimizer state, step count and metadata, packed (``RecordCodec``). The live
database keeps no write-ahead log of its own and is never fsynced: a crash is survived by the shard's checkpoint
(with its RocksDB checkpoint) and write-ahead log, replayed through the tiered table as any other.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import threading
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from shardps.core.errors import InvalidArgument, ResourceExhausted
from shardps.core.files import fsync_dir
from shardps.server.storage.records import (  # noqa: F401 (re-exported: the tier's users import them from here)
    KEY,
    META_FIELDS,
    RecordCodec,
    decode_keys,
    encode_keys,
    slot_range,
)

log = logging.getLogger(__name__)

MARKER = "shardps-disk.json"
class DiskTierError(Exception):
    """The disk tier cannot be opened or restored: a directory that is not a shard's disk tier, another shard's,
    a checkpoint's store missing or damaged, or a store written for another table spec. The shard does not start."""


def _raise_write(root: pathlib.Path, what: str, e: Exception) -> None:
    """A failed write of the disk tier (an I/O error) as the request's refusal."""
    raise ResourceExhausted(f"disk tier {root}: {what} failed ({e}); nothing of this request was applied") from e


STUCK = ("the disk tier stopped after a failed write and takes no more: free space (or fix the disk), then restart "
         "the shard; its checkpoint and log hold every acknowledged update")


class TableStore:
    """One table's column family of the live database."""

    def __init__(self, tiers: DiskTiers, name: str, codec: RecordCodec) -> None:
        self.tiers = tiers
        self.name = name
        self.codec = codec

    def get(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which of ``ids`` are on disk, their records in that order): one batched read."""
        values = self.tiers.cf(self.name).get(encode_keys(ids))
        found = np.fromiter((v is not None for v in values), bool, len(values))
        return found, self.codec.decode([v for v in values if v is not None])

    def disk_bytes(self) -> int:
        """Bytes the table's rows take on disk: its live table files and memtables."""
        cf = self.tiers.cf(self.name)
        return sum(int(cf.property_int_value(p) or 0) for p in ("rocksdb.live-sst-files-size",
                                                               "rocksdb.cur-size-all-mem-tables"))

    def put(self, ids: np.ndarray, fields: dict[str, np.ndarray]) -> None:
        """Write the rows of ``ids`` (one batch; a failure raises ResourceExhausted and writes nothing the caller
        relies on: the rows are still in memory)."""
        if not ids.shape[0]:
            return
        import rocksdict

        self.tiers.check_space(ids.shape[0] * (self.codec.dtype.itemsize + KEY.itemsize))
        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.set_default_column_family(self.tiers.handle(self.name))
        for k, v in zip(encode_keys(ids), self.codec.encode(fields)):
            batch.put(k, v)
        try:
            self.tiers.db().write(batch)
        except Exception as e:  # noqa: BLE001 - rocksdict raises plain exceptions for I/O errors
            self.tiers.failed = str(e)  # RocksDB takes no write after a failed one until it is reopened
            _raise_write(self.tiers.root, f"writing {ids.shape[0]:,} rows of {self.name!r} back", e)


    def scan(self, first: int, last: int, batch: int = 65536) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of the rows of hash slots [first, last] in the live database, in batches."""
        it = self.tiers.cf(self.name).iter()
        lo, hi = slot_range(first, last)
        it.seek(lo)
        keys: list[bytes] = []
        values: list[bytes] = []
        while it.valid():
            k = it.key()
            if k >= hi:
                break
            keys.append(k)
            values.append(it.value())
            if len(keys) >= batch:
                yield decode_keys(keys), self.codec.decode(values)
                keys, values = [], []
            it.next()
        del it
        if keys:
            yield decode_keys(keys), self.codec.decode(values)

    def delete(self, ids: np.ndarray) -> None:
        """Remove the rows of ``ids`` from disk (absent ones are no-ops)."""
        if not ids.shape[0]:
            return
        import rocksdict

        batch = rocksdict.WriteBatch(raw_mode=True)
        batch.set_default_column_family(self.tiers.handle(self.name))
        for k in encode_keys(ids):
            batch.delete(k)
        try:
            self.tiers.db().write(batch)
        except Exception as e:  # noqa: BLE001
            self.tiers.failed = str(e)
            _raise_write(self.tiers.root, f"removing {ids.shape[0]:,} rows of {self.name!r}", e)


class DiskTiers:
    """The disk tier of shard ``shard_index`` of ``num_shards`` under ``root`` (see the module docstring), opened
    on first use. ``cache_mb``: RocksDB's block cache, shared by every table (memory beyond the tables' budget)."""

    def __init__(self, root: pathlib.Path, shard_index: int, num_shards: int, cache_mb: int = 32,
                 min_free_mb: int = 256) -> None:
        self.root = root
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.cache_mb = cache_mb
        self.min_free = min_free_mb << 20
        self.failed = ""  # why the live database takes no more writes (a write failed), or ""
        self._db: Any = None
        self._cfs: dict[str, Any] = {}
        self._handles: dict[str, Any] = {}
        self._lock = threading.RLock()
        self._cache: Any = None
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

    def _options(self) -> Any:
        import rocksdict

        if self._cache is None:
            self._cache = rocksdict.Cache(self.cache_mb << 20)
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_compression_type(rocksdict.DBCompressionType.none())  # float rows do not compress
        table = rocksdict.BlockBasedOptions()
        table.set_block_cache(self._cache)
        table.set_bloom_filter(10, False)  # a never-seen id costs a filter probe, not a block read
        # Index and filter blocks stay out of the block cache, held by their files' readers: about 2.6 bytes of
        # memory per row on disk (1% of a 64-wide row), and a read 1.4x faster than with them evicted by data.
        table.set_cache_index_and_filter_blocks(False)
        opts.set_block_based_table_factory(table)
        opts.set_db_write_buffer_size(16 << 20)  # memtables of every table together (flushed beyond it)
        opts.set_write_buffer_size(8 << 20)
        opts.set_max_write_buffer_number(2)
        opts.set_max_background_jobs(2)
        opts.set_keep_log_file_num(2)
        return opts

    def _open(self, tables: Sequence[str] = ()) -> None:
        import rocksdict

        opts = self._options()
        self._db = rocksdict.Rdict(str(self.live_dir), opts, column_families={n: self._options() for n in tables})
        writes = rocksdict.WriteOptions()
        writes.disable_wal = True  # type: ignore[method-assign,assignment]  # a property (its stub says a method); the shard's own log and checkpoints are what survives a crash
        self._db.set_write_options(writes)
        reads = rocksdict.ReadOptions()
        # A read of a cold row does not fill the block cache: a 4 KiB block holds ~14 rows and the row read goes into
        # the hot set anyway, so caching its block only churns the cache (a batched read 1.5x faster without it).
        reads.fill_cache(False)
        self._db.set_read_options(reads)
        self._cfs = {n: self._db.get_column_family(n) for n in tables}
        self._handles = {n: self._db.get_column_family_handle(n) for n in tables}

    def reset(self) -> None:
        """Start with an empty live database (a shard's start without a checkpoint to restore)."""
        with self._lock:
            self.close()
            self.failed = ""
            self.check_root()
            shutil.rmtree(self.live_dir, ignore_errors=True)
            self._open()

    def restore(self, name: str, tables: dict[str, RecordCodec]) -> None:
        """Rebuild the live database from checkpoint ``name`` (hard links of its files), checking that it holds
        the column families of ``tables`` written with their record layouts."""
        with self._lock:
            self.close()
            self.failed = ""
            self.check_root()
            src = self.checkpoint_root / name
            layouts = self._read_layouts(src)
            for table, codec in tables.items():
                if table not in layouts:
                    raise DiskTierError(f"{src / LAYOUTS}: the disk tier of checkpoint {name} has no table {table!r}")
                if layouts[table] != codec.describe():
                    raise DiskTierError(f"{src / LAYOUTS}: table {table!r} was written as {layouts[table]}, but its "
                                        f"spec now needs {codec.describe()}: the store belongs to another table spec")
            shutil.rmtree(self.live_dir, ignore_errors=True)
            _clone(src, self.live_dir)
            try:
                self._open(list(tables))
            except Exception as e:  # noqa: BLE001 - RocksDB's own message says what is damaged
                self.close()
                raise DiskTierError(f"the disk tier of checkpoint {name} ({src}) cannot be opened: {e}") from e
            self._layout_map = {t: layouts[t] for t in tables}
            self._restored = set(tables)

    def check_space(self, nbytes: int) -> None:
        """Refuse a write of ``nbytes`` that would leave less than the free space RocksDB needs (``min_free``: its
        memtables' flushes and compactions); a write that fails for want of space stops the database until it is
        reopened, so the request is refused before it is tried."""
        if self.failed:
            raise ResourceExhausted(f"disk tier {self.root}: {STUCK} (the failure: {self.failed})")
        st = os.statvfs(self.live_dir if self.live_dir.exists() else self.root)
        free = st.f_bavail * st.f_frsize
        if free < nbytes + self.min_free:
            raise ResourceExhausted(f"disk tier {self.root}: {free / (1 << 20):,.0f} MiB free, under the {self.min_free >> 20} "
                                    f"MiB it keeps free (--disk-min-free-mb) plus this write's {nbytes / (1 << 20):,.1f} "
                                    f"MiB: refused, nothing of it applied; free disk space or give the table more "
                                    f"memory_mb")

    def db(self) -> Any:
        with self._lock:
            if self._db is None:
                self.reset()
            return self._db

    # ---- tables ------------------------------------------------------------------------------

    def create(self, name: str, codec: RecordCodec) -> TableStore:
        """The store of a new table: the column family ``restore`` brought back for it, else an empty one (a stale
        one of the same name is dropped first)."""
        with self._lock:
            db = self.db()
            if name in self._restored:
                self._restored.discard(name)
                return TableStore(self, name, codec)
            if name in self._cfs:
                self.drop(name)
            elif name in db.list_cf(str(self.live_dir)):
                db.drop_column_family(name)
            self._cfs[name] = db.create_column_family(name, self._options())
            self._handles[name] = db.get_column_family_handle(name)
            self._layouts()[name] = codec.describe()
            return TableStore(self, name, codec)

    def drop(self, name: str) -> None:
        with self._lock:
            if self._db is None or name not in self._cfs:
                return
            self._cfs.pop(name)
            self._handles.pop(name)
            self._restored.discard(name)
            self._layouts().pop(name, None)
            self._db.drop_column_family(name)

    def cf(self, name: str) -> Any:
        return self._cfs[name]

    def handle(self, name: str) -> Any:
        return self._handles[name]

    def _layouts(self) -> dict[str, dict[str, Any]]:
        return self._layout_map

    @staticmethod
    def _read_layouts(path: pathlib.Path) -> dict[str, dict[str, Any]]:
        try:
            return json.loads((path / LAYOUTS).read_text())  # type: ignore[no-any-return]
        except FileNotFoundError as e:
            raise DiskTierError(f"{path}: the disk tier this checkpoint needs is missing (was --disk-dir changed or "
                                "the directory removed?)") from e
        except (OSError, ValueError) as e:
            raise DiskTierError(f"{path / LAYOUTS} is damaged: {e}") from e

    # ---- checkpoints -------------------------------------------------------------------------

    def checkpoint(self, name: str) -> pathlib.Path:
        """A RocksDB checkpoint of the live database as ``checkpoints/<name>`` (its memtables flushed, the files hard
        linked), with the tables' record layouts; callers hold every table's lock, so it is one consistent cut."""
        import rocksdict

        with self._lock:
            db = self.db()
            dst = self.checkpoint_root / name
            self.checkpoint_root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            self.check_space(0)
            try:
                rocksdict.Checkpoint(db).create_checkpoint(str(dst))
                tmp = dst / (LAYOUTS + ".tmp")
                tmp.write_text(json.dumps(self._layouts()))
                os.replace(tmp, dst / LAYOUTS)
            except Exception as e:  # noqa: BLE001 - a full disk or an I/O error: the checkpoint fails, nothing else
                shutil.rmtree(dst, ignore_errors=True)
                _raise_write(self.root, f"checkpoint {name}", e)
            return dst

    def sync_checkpoint(self, name: str) -> None:
        """fsync every file of checkpoint ``name`` and its directory (RocksDB syncs its own; the spilled hot rows
        are written under the cut's locks and synced after them)."""
        path = self.checkpoint_root / name
        for f in path.iterdir():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(path)

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
        """Bytes the live database takes on disk."""
        return _dir_bytes(self.live_dir)

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._cfs.clear()
                self._handles.clear()
                try:
                    self._db.close()
                except Exception as e:  # noqa: BLE001 - a database that failed a write fails its close too
                    log.warning("disk tier %s: closing: %s", self.root, e)
                finally:
                    self._db = None


LAYOUTS = "shardps-layouts.json"


class CheckpointReader:
    """A RocksDB checkpoint opened read-only, scanned table by table in key order (slot, then id)."""

    def __init__(self, path: pathlib.Path) -> None:
        import rocksdict

        self.path = path
        self.layouts = DiskTiers._read_layouts(path)
        opts = rocksdict.Options(raw_mode=True)
        try:
            self._db = rocksdict.Rdict(str(path), opts, column_families={n: rocksdict.Options(raw_mode=True)
                                                                         for n in self.layouts},
                                       access_type=rocksdict.AccessType.read_only())
        except Exception as e:  # noqa: BLE001
            raise DiskTierError(f"the disk tier checkpoint {path} cannot be opened: {e}") from e

    def scan(self, name: str, codec: RecordCodec, batch: int = 65536,
             slots: Optional[tuple[int, int]] = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """(ids, records) of table ``name`` in batches of at most ``batch`` rows, in key order; ``slots``
        (first, last) limits the scan to those hash slots."""
        if self.layouts.get(name) != codec.describe():
            raise InvalidArgument(f"{self.path}: table {name!r} has layout {self.layouts.get(name)}, "
                                  f"expected {codec.describe()}")
        it = self._db.get_column_family(name).iter()
        lo, hi = slot_range(*slots) if slots is not None else (None, None)
        it.seek(lo) if lo is not None else it.seek_to_first()
        keys: list[bytes] = []
        values: list[bytes] = []
        while it.valid():
            k = it.key()
            if hi is not None and k >= hi:
                break
            keys.append(k)
            values.append(it.value())
            if len(keys) >= batch:
                yield decode_keys(keys), codec.decode(values)
                keys, values = [], []
            it.next()
        del it
        if keys:
            yield decode_keys(keys), codec.decode(values)

    def close(self) -> None:
        self._db.close()


def _clone(src: pathlib.Path, dst: pathlib.Path) -> None:
    """A copy of a RocksDB directory: its immutable table files hard linked (copied across file systems), the rest
    copied."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name in (LAYOUTS, "LOCK") or f.name.startswith("LOG"):
            continue
        if f.suffix in (".sst", ".blob"):
            try:
                os.link(f, dst / f.name)
                continue
            except OSError:
                pass
        shutil.copy2(f, dst / f.name)


def _dir_bytes(path: pathlib.Path) -> int:
    total = 0
    for f in path.glob("*") if path.is_dir() else ():
        try:
            total += f.stat().st_size
        except OSError:
            continue
    return total
