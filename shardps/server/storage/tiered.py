"""A table's hot set in RAM over its rows on disk (``DiskTier``): which rows are in memory, bringing cold rows in
(one batched read per request), and writing rows back before they leave memory.

``memory_mb`` holds the hot rows and the index of the rows on disk (``segments``: 24-32 bytes a row, or 16 and a flat
map of 4 bytes an id: ``FLAT_INDEX_SHARE``): as the table grows on disk, its hot set shrinks by the index's size (the
pages of the slots it gave up handed back to the OS), down to ``MIN_HOT`` of its rows; past that, new rows are
refused, naming ``memory_mb``.

The hot rows live in the table's ``RowStore`` like any table's, with three more per-row arrays: ``access`` (the
request that last used the row: recency for the policy), ``dirty`` (changed since it was last written to disk) and
``on_disk`` (the store has a copy, maybe older). The store holds every row that ever left memory; a row in memory
is newer than its copy on disk. Room is made before anything is brought in: victims are chosen by the policy
(``Victims``: a clock hand going round the rows, or LRU or LFU over sampled rows; none of the current request nor,
while others are left, of the few before it: ``PROTECT_REQUESTS``), the dirty ones written back in one batch, then
removed. A failed write (a full disk) refuses the request before anything changed. The caller holds the table's
lock.
"""

from __future__ import annotations

import json
import pathlib
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional

import google_crc32c
import numpy as np

from shardps.core.errors import InvalidArgument, ResourceExhausted, Unavailable
from shardps.core.files import ChecksummedWriter
from shardps.core.ids import is_sorted_unique
from shardps.core.policies import DiskTier, Eviction
from shardps.core.specs import Initializer, TableSpec
from shardps.server.storage.bounded import choose_victims, clock_victims
from shardps.server.storage.budget import MemoryBudget
from shardps.server.storage.disk import META_FIELDS, DiskTierError, DiskTiers, RecordCodec, TableStore
from shardps.server.storage.index import HashIndex
from shardps.server.storage.records import Column, as_words, scatter_columns
from shardps.server.storage.rows import DIRECT_BYTES_PER_ROW, INDEX_BYTES_PER_ROW, META, RowStore
from shardps.server.storage.segments import flat_index

MIB = 1 << 20
MIN_HOT = 0.125  # the share of memory_mb's rows the hot set keeps however large the index of the rows on disk grows
# Rows used by the last requests stay in memory while others can leave (as many requests as fill half of it): a
# batch's rows prefetched by a pull stay until its push, a few requests later (TrainPipeline: a trainer's next pull
# and its push in between; more with more trainers), as FBGEMM's SSD cache locks the lines a prefetch brought in.
PROTECT_REQUESTS = 8
# The per-row arrays a hot set adds to its RowStore.
TIER_ARRAYS = {"access": np.int64, "dirty": np.uint8, "on_disk": np.uint8}
# A hot set's index, and that of its rows on disk, are flat id -> slot maps (one read a lookup, where a hash index's
# takes two cache misses on a large table) when a map, 4 bytes per id of the table, takes at most this share of
# memory_mb (both then at most twice it).
FLAT_INDEX_SHARE = 1 / 8


def flat_index_pays(tier: DiskTier, num_embeddings: Optional[int]) -> bool:
    """Whether a flat map over the table's ids (4 bytes an id) takes at most ``FLAT_INDEX_SHARE`` of memory_mb: the
    hot set's index and the index of the rows on disk are then each one."""
    return num_embeddings is not None and num_embeddings < 2**31 and (
        4 * num_embeddings <= tier.memory_mb * MIB * FLAT_INDEX_SHARE)


def hot_store(name: str, dim: int, state_init: dict[str, float], tier: DiskTier,
              num_embeddings: Optional[int]) -> RowStore:
    """The RowStore of a table's hot rows: as many as ``tier.memory_mb`` holds with their flags and index (a
    private budget of that size: the shard's budget is charged ``memory_mb`` once, when the table is made). The index
    is a flat map over the table's ids when it takes at most ``FLAT_INDEX_SHARE`` of the memory, else a hash index."""
    budget = MemoryBudget(int(tier.memory_mb * MIB))
    probe = RowStore(name, dim, state_init, None, 16, MemoryBudget(1 << 62), 16, extra=TIER_ARRAYS)
    flat = flat_index_pays(tier, num_embeddings)
    if flat:
        assert num_embeddings is not None
        cap = max(16, (budget.limit - 4 * num_embeddings) // (probe.row_bytes + DIRECT_BYTES_PER_ROW))
    else:
        per_row = probe.row_bytes + INDEX_BYTES_PER_ROW
        cap = max(16, budget.limit // per_row)
        cap = max(16, (budget.limit - 4 * HashIndex.table_size(cap)) // per_row)  # the probe table is made at once
    return RowStore(name, dim, state_init, num_embeddings if flat else None, cap, budget, cap, extra=TIER_ARRAYS,
                    sized=True, direct=flat)


def hot_columns(rows: RowStore, codec: RecordCodec, values: bool = True) -> list[Column]:
    """Where each field of a record is in a hot set's arrays (``records.Column``; the values' unless not ``values``),
    as they are now (a RowStore replaces its arrays as it grows)."""
    cols = [(as_words(rows.rows), 0, rows.dim, codec.word("rows"))] if values else []
    cols += [(as_words(arr), 0, rows.dim, codec.word("state." + name)) for name, arr in rows.state.items()]
    meta = as_words(rows.meta)
    for name, _ in META_FIELDS:
        field, first = META.fields[name][:2]  # type: ignore[index]
        cols.append((meta, first // 4, field.itemsize // 4, codec.word(name)))
    return cols


class RecentRequests:
    """The sizes of a hot set's last requests, for the rows kept in memory while others can leave."""

    def __init__(self) -> None:
        self._sizes: deque[int] = deque(maxlen=PROTECT_REQUESTS - 1)  # ids in each of the requests before this one

    def protected_from(self, clock: int, size: int, capacity: int) -> int:
        """The oldest request whose rows are kept (``PROTECT_REQUESTS``, as many of them as fill half of the
        ``capacity`` rows with the current request, ``clock``, of ``size`` ids), counting this one in."""
        room = capacity // 2 - size
        keep = 0
        for k in reversed(self._sizes):
            room -= k
            if room < 0:
                break
            keep += 1
        self._sizes.append(size)
        return clock - keep


class Victims:
    """Which hot rows leave memory, by the tier's policy: "clock", a hand going round the rows
    (``bounded.clock_victims``; should it find too few, the exact least recently used are taken), or "lru" and "lfu"
    over sampled rows (``bounded.choose_victims``)."""

    def __init__(self, tier: DiskTier, capacity: int) -> None:
        self.by_clock = tier.policy == "clock"
        self.hand = np.zeros(2, np.int64)  # the clock hand's place, and the request its round began at
        self.policy = Eviction(max_rows=capacity, policy="lru" if self.by_clock else tier.policy,
                               sample=0 if self.by_clock else tier.sample)

    def choose(self, rows: RowStore, count: int, protected_from: int, now: int) -> np.ndarray:
        """Slots of ``count`` of the ``rows`` (none used since request ``protected_from`` while others are left), at
        request ``now``."""
        n, access = rows.n, rows.extra["access"]
        if self.by_clock and count < n:
            victims = clock_victims(access[:n], count, protected_from, now, self.hand)
            if victims.shape[0] == count:
                return victims
        return choose_victims(self.policy, n, count, rows.ids, access[:n], rows.touches[:n], protected_from, salt=now)


@dataclass
class TierCounts:
    """A tiered table's traffic since the shard started."""

    hits: int = 0  # rows a request found in memory
    misses: int = 0  # rows a request did not find in memory (read from disk, or new)
    promoted: int = 0  # rows read back from disk
    written_back: int = 0  # rows written to disk as they left memory (changed since they came in)
    dropped_clean: int = 0  # rows that left memory unchanged (their copy on disk is current)


class HotSet:
    """The hot rows of one table over its ``store`` (see the module docstring); ``reserved``: the bytes of the
    shard's ``budget`` it holds."""

    def __init__(self, tier: DiskTier, rows: RowStore, store: TableStore, initializer: Optional[Initializer],
                 name: str, budget: MemoryBudget, tiers: DiskTiers) -> None:
        self.tier = tier
        self.rows = rows
        self.store = store
        self.initializer = initializer
        self.name = name
        self.budget = budget
        self.tiers = tiers
        self.reserved = int(tier.memory_mb * MIB)
        self.full_capacity = rows.max_rows  # hot rows memory_mb holds with nothing on disk
        self.row_cost = rows.row_bytes + rows.index_row_bytes
        self._released = self.full_capacity  # slots from which the pages were last handed back
        self.clock = 0  # requests served: a row's ``access`` is the last one that used it
        self.recent = RecentRequests()
        self.disk_rows = 0  # rows the store holds
        self.counts = TierCounts()
        self.broken = ""  # why the table refuses every request until the shard restarts ("" while it serves)
        self.victims = Victims(tier, self.full_capacity)
        self.codec = store.codec

    @property
    def capacity(self) -> int:
        """Rows the hot set may hold now: memory_mb's rows less the index of the rows on disk (at least MIN_HOT)."""
        taken = -(-self.store.index_bytes // self.row_cost)
        return max(int(self.full_capacity * MIN_HOT), 16, self.full_capacity - taken)

    def _check_growth(self, new_rows: int) -> None:
        """Refuse ``new_rows`` more rows when the index of the rows on disk already leaves the hot set its least."""
        if new_rows and self.capacity <= max(int(self.full_capacity * MIN_HOT), 16):
            raise ResourceExhausted(f"{self.name}: {self.disk_rows:,} rows on disk on this shard, whose index takes "
                                    f"{self.store.index_bytes / MIB:,.1f} MiB of the disk tier's memory_mb "
                                    f"{self.tier.memory_mb:g}: no room for {new_rows:,} new rows; raise memory_mb "
                                    "(or add shards)")

    @classmethod
    def make(cls, spec: TableSpec, dim: int, state_init: dict[str, float], budget: MemoryBudget,
             tiers: Optional[DiskTiers], key: str) -> HotSet:
        """The hot set of a table with a disk tier, its store made in ``tiers`` as ``key``; ``memory_mb`` is taken
        from the shard's ``budget`` at once."""
        assert spec.disk is not None
        if tiers is None:
            raise InvalidArgument(f"table {spec.name!r} has a disk tier, but this shard has no --disk-dir "
                                  "(nor --data-dir, under which it would be made)")
        rows = hot_store(spec.name, dim, state_init, spec.disk, spec.num_embeddings)
        reserved = int(spec.disk.memory_mb * MIB)
        budget.charge(reserved, f"{spec.name}: the disk tier's memory_mb")
        try:
            store = tiers.create(key, RecordCodec(dim, list(state_init)))
            if flat_index_pays(spec.disk, spec.num_embeddings):
                assert spec.num_embeddings is not None
                flat_index(store.segments, spec.num_embeddings)
        except DiskTierError as e:  # a --disk-dir that is not this shard's: the request is refused, naming it
            budget.release(reserved)
            raise InvalidArgument(f"table {spec.name!r}: {e}") from e
        except BaseException:
            budget.release(reserved)
            raise
        return cls(spec.disk, rows, store, spec.initializer, spec.name, budget, tiers)

    def release(self) -> None:
        """The table is gone: its memory back to the shard's budget, its rows off the disk."""
        self.budget.release(self.reserved)
        self.reserved = 0
        self.tiers.drop(self.store.name)

    @property
    def total_rows(self) -> int:
        """Rows of the table on this shard: on disk, or in memory only."""
        on_disk = self.rows.extra["on_disk"][: self.rows.n]
        return self.disk_rows + int(self.rows.n - np.count_nonzero(on_disk))

    def slots(self, ids: np.ndarray, create: bool, stamp: int = 0, values: Optional[np.ndarray] = None,
              absent_ok: bool = False) -> np.ndarray:
        """Slots of ``ids`` in memory, bringing absent rows in: from disk, else (``create``) new, from ``values``
        (one row per id) or the initializer, with ``stamp`` as their last change's version. ``absent_ok`` (and
        not ``create``): a row neither in memory nor on disk gets slot -1."""
        if self.broken:
            raise Unavailable(self.broken)
        self.clock += 1
        protected_from = self.recent.protected_from(self.clock, ids.shape[0], self.capacity)
        rows = self.rows
        access = rows.extra["access"]
        slots = rows.index.lookup(ids)
        hit = slots >= 0
        access[slots[hit]] = self.clock
        missing = np.flatnonzero(~hit)
        n_hit = ids.shape[0] - missing.shape[0]
        if not missing.size:
            self.counts.hits += n_hit
            return slots
        absent = ids[missing]
        if is_sorted_unique(absent):  # a client's request: its ids unique and sorted already
            new_ids, first = absent, np.arange(absent.shape[0])
            inverse = first
        else:
            new_ids, first, inverse = np.unique(absent, return_index=True, return_inverse=True)
        capacity = self.capacity
        if n_hit + new_ids.shape[0] > capacity:
            raise ResourceExhausted(f"{self.name}: a request touching {n_hit + new_ids.shape[0]:,} rows does not fit "
                                    f"the table's memory of {capacity:,} rows on this shard (disk tier "
                                    f"memory_mb {self.tier.memory_mb:g}): split the request or raise memory_mb")
        locs, stamp = self.store.locate(new_ids)
        found = locs >= 0
        fresh = ~found
        if fresh.any() and not create and not absent_ok:
            raise InvalidArgument(f"{self.name}: row {int(new_ids[np.argmax(fresh)])} is not initialised")
        if create:
            self._check_growth(int(fresh.sum()))
        self.counts.hits += n_hit
        self.counts.misses += new_ids.shape[0]
        self._make_room(rows.n + new_ids.shape[0] - capacity, protected_from)
        new_slots = np.full(new_ids.shape[0], -1, np.int64)
        if found.any():
            records = self.store.read_at(new_ids[found], locs[found], stamp)
            new_slots[found] = self._bring_in(new_ids[found], records)
        if fresh.any() and create:
            init = values[missing[first[fresh]]] if values is not None else self._initial(new_ids[fresh])
            added = rows.append(new_ids[fresh], init)
            rows.last_version[added] = stamp
            rows.extra["dirty"][added] = 1
            rows.extra["access"][added] = self.clock
            new_slots[fresh] = added
        slots = rows.index.lookup(ids) if n_hit else slots  # making room moved rows
        slots[missing] = new_slots[inverse]
        return slots

    def _fits(self, ids: np.ndarray) -> bool:
        """Whether the rows of ``ids`` fit in memory together."""
        return ids.shape[0] <= self.capacity or np.unique(ids).shape[0] <= self.capacity

    def read_slots(self, ids: np.ndarray, stamp: int) -> Optional[np.ndarray]:
        """The slots ``read`` would copy the rows of ``ids`` from (rows brought in or made), for a caller that copies
        them itself under the table's lock (a pull's answer, one copy less); None when ``read`` must serve (a table
        without initializer, a request larger than memory)."""
        if self.initializer is None or not self._fits(ids):
            return None
        return self.slots(ids, True, stamp)

    def read(self, ids: np.ndarray, stamp: int, create: bool = True) -> np.ndarray:
        """Rows of ``ids`` (a copy): brought into memory as by ``slots`` (rows never seen are made, unless not
        ``create``: a serving shard's), unless the request alone holds more rows than memory does; then the cold
        ones are read from disk (or initialised) without staying."""
        rows = self.rows
        if self.broken:
            raise Unavailable(self.broken)
        if self._fits(ids):
            create = create and self.initializer is not None
            slots = self.slots(ids, create, stamp, absent_ok=not create)
            out = np.take(rows.rows, slots, axis=0)
            if not create and (slots < 0).any():
                out[slots < 0] = self._initial(ids[slots < 0])
            return out
        slots = rows.index.lookup(ids)
        hot = slots >= 0
        out = np.empty((ids.shape[0], rows.dim), np.float32)
        out[hot] = rows.rows[slots[hot]]
        cold, inverse = np.unique(ids[~hot], return_inverse=True)
        found, records = self.store.get(cold)
        values = np.empty((cold.shape[0], rows.dim), np.float32)
        values[found] = records["rows"]
        if not found.all():
            fresh = cold[~found]
            values[~found] = self._initial(fresh)
            if create and self.initializer is not None:  # made on disk, as a pull makes rows of a table in RAM
                self._write_new(fresh, values[~found], stamp)
        out[~hot] = values[inverse]
        self.counts.hits += int(hot.sum())
        self.counts.misses += cold.shape[0]
        return out

    def _write_new(self, ids: np.ndarray, values: np.ndarray, stamp: int) -> None:
        """Rows never seen, made straight on disk with ``values`` and fresh optimizer state."""
        n = ids.shape[0]
        self._check_growth(n)
        fields = {"rows": values, "steps": np.zeros(n, np.int32), "last_version": np.full(n, stamp, np.int64),
                  "last_time": np.zeros(n, np.uint32), "touches": np.zeros(n, np.int32)}
        fields.update({"state." + k: np.full((n, self.rows.dim), v, np.float32) for k, v in self.rows.state_init.items()})
        self.store.put(ids, fields)
        self.disk_rows += n

    def _initial(self, ids: np.ndarray) -> np.ndarray:
        if self.initializer is None:
            raise InvalidArgument(f"{self.name}: row {int(ids[0])} is not initialised")
        return self.initializer.rows(ids, self.rows.dim)

    def _bring_in(self, ids: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Append rows read from disk with everything they carry; their slots."""
        rows = self.rows
        added = rows.append(ids, records["rows"])
        scatter_columns(as_words(records), hot_columns(rows, self.codec, values=False), added)
        rows.extra["on_disk"][added] = 1
        rows.extra["access"][added] = self.clock
        self.counts.promoted += ids.shape[0]
        return added

    def _make_room(self, count: int, protected_from: int) -> None:
        """Take ``count`` rows out of memory, writing the changed ones back first: none used since request
        ``protected_from`` (the current one's among them) while others are left."""
        if count <= 0:
            return
        rows = self.rows
        victims = self.victims.choose(rows, count, protected_from, self.clock)
        self.write_back(victims)
        rows.remove(rows.ids[victims].copy(), check=False)
        capacity = self.capacity
        if self._released - capacity > max(64, self.full_capacity >> 6):  # slots given up to the index: to the OS
            rows.release_from(max(capacity, rows.n))
            self._released = max(capacity, rows.n)

    def write_back(self, slots: np.ndarray) -> None:
        """Write the changed rows of ``slots`` to disk (one batch; a failure changes nothing) and mark them clean."""
        rows = self.rows
        dirty = slots[rows.extra["dirty"][slots] != 0]
        if dirty.size:
            self.store.put_slots(rows.ids, hot_columns(rows, self.codec), dirty)
            self.disk_rows += int(dirty.size - np.count_nonzero(rows.extra["on_disk"][dirty]))
            rows.extra["on_disk"][dirty] = 1
            rows.extra["dirty"][dirty] = 0
        self.counts.written_back += int(dirty.size)
        self.counts.dropped_clean += int(slots.size - dirty.size)

    def in_parts(self, n: int, apply: Callable[[slice], None]) -> None:
        """``apply`` to slices of a request of ``n`` unique rows that each fit in memory (half of it: the rest stays
        hot), one after the other. A request of several parts has room on disk for all of its write backs checked
        first; should a part fail anyway, those before it are applied but the request is not acknowledged (nor
        logged): the table then refuses every request until the shard restarts from its checkpoint and log."""
        step = max(1, self.capacity // 2)
        if n <= step:
            apply(slice(0, n))
            return
        self.store.tiers.check_space(2 * n * (self.codec.dtype.itemsize + 8))  # twice: compactions too
        for lo in range(0, n, step):
            try:
                apply(slice(lo, lo + step))
            except BaseException as e:
                if lo:
                    self.broken = (f"{self.name}: a request larger than the table's memory failed after part of it "
                                   f"was applied ({e}); restart the shard: its checkpoint and log hold every "
                                   "acknowledged update")
                raise

    def assign(self, ids: np.ndarray, values: np.ndarray, stamp: int, now: int) -> None:
        """Set the rows of unique ``ids`` to ``values`` (a loaded state dict or export), in parts that fit memory;
        optimizer state and step counts of existing rows are kept."""
        rows = self.rows

        def assign(part: slice) -> None:
            slots = self.slots(ids[part], True, stamp, values[part])
            rows.rows[slots] = values[part]
            rows.last_version[slots] = stamp
            rows.last_time[slots] = max(0, now)
            self.changed(slots)

        self.in_parts(ids.shape[0], assign)

    def changed(self, slots: np.ndarray) -> None:
        """The rows of ``slots`` were updated in memory: their copies on disk are stale."""
        self.rows.extra["dirty"][slots] = 1

    # ---- cuts: checkpoints and exports --------------------------------------------------------

    def snapshot(self) -> dict[str, np.ndarray]:
        """What a checkpoint file keeps of the table (its rows are in the tier's checkpoint: ``spill``)."""
        return {"table.disk_rows": np.array([self.disk_rows], np.int64)}

    def spill(self, directory: pathlib.Path) -> pathlib.Path:
        """Write the hot rows, with everything a row holds and whether the store has a copy, into ``directory``
        (a checkpoint of the disk tier taken at the same cut; callers hold the table's lock): a cut's copy of
        memory made on disk, not in RAM. ``sync_spills`` makes it durable after the locks are let go."""
        rows, n = self.rows, self.rows.n
        arrays = [("ids", rows.ids[:n]), ("rows", rows.rows[:n]), ("steps", rows.steps[:n])]
        arrays += [("state." + k, v[:n]) for k, v in rows.state.items()]
        arrays += [("meta." + k, getattr(rows, k)[:n]) for k in ("last_version", "last_time", "touches")]
        arrays.append(("meta.on_disk", rows.extra["on_disk"][:n]))
        return write_spill(directory, self.store.name, self.name, self.codec.describe(), self.disk_rows, arrays)

    def restore(self, directory: pathlib.Path) -> None:
        """Bring back the hot rows ``spill`` wrote in ``directory`` (the checkpoint restored; the table is empty),
        in chunks; every one counts as changed (the store restored with it may hold an older copy)."""
        arrays, meta = read_spill(directory, self.store.name, self.codec.describe())
        rows = self.rows
        for lo in range(0, meta["rows"], 1 << 16):
            part = {k: np.asarray(v[lo:lo + (1 << 16)]) for k, v in arrays.items()}
            added = rows.append(part["ids"], part["rows"])
            rows.steps[added] = part["steps"]
            for k, arr in rows.state.items():
                arr[added] = part["state." + k]
            for k in ("last_version", "last_time", "touches"):
                getattr(rows, k)[added] = part["meta." + k]
            rows.extra["on_disk"][added] = part["meta.on_disk"]
            rows.extra["dirty"][added] = 1
        self.disk_rows = int(meta["disk_rows"])


def spill_name(key: str) -> str:
    """The spill file of the table stored as ``key`` (table names may hold '/': hex)."""
    return f"hot-{key.encode().hex()}.json"


def write_spill(directory: pathlib.Path, key: str, table: str, layout: dict[str, Any], disk_rows: int,
                arrays: list[tuple[str, np.ndarray]]) -> pathlib.Path:
    """Write the hot rows of the table stored as ``key`` (``arrays``: ids, rows, steps, state.*, meta.*, one entry per
    row) into ``directory``: their bytes, then a header with their layout and CRC-32C; the header's path."""
    path = directory / spill_name(key)
    entries = []
    with open(path.with_suffix(".bin"), "wb") as f:
        w = ChecksummedWriter(f)
        for name, arr in arrays:
            entries.append({"name": name, "dtype": arr.dtype.str, "shape": list(arr.shape), "offset": w.pos})
            w.write(arr)
    path.write_text(json.dumps({"table": table, "rows": arrays[0][1].shape[0], "disk_rows": disk_rows, "crc32c": w.crc,
                                "layout": layout, "arrays": entries}))
    return path


def read_spill(directory: pathlib.Path, key: str, layout: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays ``HotSet.spill`` wrote for ``key`` (memory-mapped, checked against their CRC-32C first) and its
    header; DiskTierError names the file when it is missing, damaged, or written for another layout."""
    path = directory / spill_name(key)
    try:
        meta = json.loads(path.read_text())
        data = path.with_suffix(".bin")
        crc = 0
        with open(data, "rb") as f:
            while chunk := f.read(8 << 20):
                crc = google_crc32c.extend(crc, chunk)
    except (OSError, ValueError) as e:
        raise DiskTierError(f"{path}: the hot rows of table {key!r} at this cut cannot be read: {e}") from e
    if crc != meta["crc32c"]:
        raise DiskTierError(f"{data}: checksum mismatch (truncated or damaged)")
    if meta["layout"] != layout:
        raise DiskTierError(f"{path}: table {key!r} was written as {meta['layout']}, but its spec now needs {layout}: "
                            "the store belongs to another table spec")
    size = data.stat().st_size
    arrays = {e["name"]: np.memmap(data, dtype=np.dtype(e["dtype"]), mode="r", offset=e["offset"],
                                   shape=tuple(e["shape"])) if size and meta["rows"] else
              np.zeros(e["shape"], np.dtype(e["dtype"])) for e in meta["arrays"]}
    return arrays, meta
