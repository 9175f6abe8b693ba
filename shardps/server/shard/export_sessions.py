"""Export sessions of one shard (``shardps export``, format in ``shardps.core.exports``): a copy of the
tables at one cut, whole or changed since an earlier cut with tombstones, kept in memory and read in
pages until the exporter ends the session (or leaves it idle).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import numpy as np

from shardps.core.errors import ExportGap, InvalidArgument, NotFound, ResourceExhausted
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.shard.checkpointing import Checkpointer
from shardps.server.shard.limits import Limits
from shardps.server.shard.registry import TableRegistry
from shardps.server.storage.bounded import RemovalLog
from shardps.server.storage.disk import CheckpointReader, RecordCodec
from shardps.server.storage.table import Table
from shardps.server.storage.tiered import read_spill

log = logging.getLogger(__name__)


class DiskRows:
    """The rows of a table with a disk tier in an export, read from the disk tier's checkpoint of its cut: the hot
    rows it spilled (``hot``: their arrays), then the rows on disk that were not hot; in a delta only those changed
    after version ``since``. Read page by page in order; a page out of order starts the scan again."""

    def __init__(self, reader: CheckpointReader, name: str, codec: RecordCodec, hot: dict[str, np.ndarray],
                 since: Optional[int], optimizer_state: bool, rows: Optional[int],
                 keep: Optional[Callable[[np.ndarray], np.ndarray]] = None) -> None:
        self.reader, self.name, self.codec, self.hot = reader, name, codec, hot
        self.keep = keep  # which ids the copy keeps (None: all)
        self.hot_ids = np.sort(hot["ids"])
        self.since, self.optimizer_state = since, optimizer_state
        self.rows = rows if rows is not None else sum(b["ids"].shape[0] for b in self._batches())
        self._restart()

    def _batches(self) -> Iterator[dict[str, np.ndarray]]:
        for lo in range(0, self.hot["ids"].shape[0], 1 << 16):
            part = {k: np.asarray(v[lo:lo + (1 << 16)]) for k, v in self.hot.items()}
            keep = part["meta.last_version"] > self.since if self.since is not None else np.ones(part["ids"].shape, bool)
            if self.keep is not None:
                keep &= self.keep(part["ids"])
            out = {"ids": part["ids"][keep], "values": part["rows"][keep]}
            if self.optimizer_state:
                out["steps"] = part["steps"][keep].astype(np.int64)
                out.update({"state." + n: part["state." + n][keep] for n in self.codec.state_names})
            if out["ids"].shape[0]:
                yield out
        for ids, rec in self.reader.scan(self.name, self.codec):
            keep = ~np.isin(ids, self.hot_ids, assume_unique=True)
            if self.since is not None:
                keep &= rec["last_version"] > self.since
            if self.keep is not None:
                keep &= self.keep(ids)
            if keep.any():
                rec = rec[keep]
                out = {"ids": ids[keep], "values": np.ascontiguousarray(rec["rows"])}
                if self.optimizer_state:
                    out["steps"] = rec["steps"].astype(np.int64)
                    out.update({"state." + n: np.ascontiguousarray(rec["state." + n]) for n in self.codec.state_names})
                yield out

    def _restart(self) -> None:
        self._scan = self._batches()
        self._at = 0  # rows handed out (or skipped) so far
        self._buf: Optional[dict[str, np.ndarray]] = None

    def page(self, offset: int, end: int) -> dict[str, np.ndarray]:
        if offset != self._at:
            self._restart()
        parts: list[dict[str, np.ndarray]] = []
        want = end - offset
        while want > 0 or self._at < offset:
            if self._buf is None:
                self._buf = next(self._scan, None)
                if self._buf is None:
                    break
            n = self._buf["ids"].shape[0]
            skip = min(n, max(0, offset - self._at))
            take = min(n - skip, want)
            if take:
                parts.append({k: v[skip:skip + take] for k, v in self._buf.items()})
            self._at += skip + take
            want -= take
            rest = {k: v[skip + take:] for k, v in self._buf.items()}
            self._buf = rest if rest["ids"].shape[0] else None
        if not parts:
            return {}
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


@dataclass
class ExportedCopy:
    """One table of an export's copy: its spec, whether the copy is the whole table, and its arrays
    (``ids``, ``values``; ``steps`` and ``state.*`` with optimizer state; ``tombstones`` in a delta), followed by
    the rows on disk (``disk``) of a table with a disk tier."""

    spec: Union[TableSpec, DenseSpec]
    full: bool
    arrays: dict[str, np.ndarray]
    disk: Optional[DiskRows] = None

    @property
    def rows(self) -> int:
        return self.arrays["ids"].shape[0] + (self.disk.rows if self.disk is not None else 0)

    @property
    def tombstones(self) -> np.ndarray:
        return self.arrays.get("tombstones", np.zeros(0, np.int64))

    def page(self, offset: int, end: int) -> dict[str, np.ndarray]:
        """Rows [offset, end) of the copy (fewer at its end)."""
        n = self.arrays["ids"].shape[0]
        out = {k: a[offset:end] for k, a in self.arrays.items() if k != "tombstones"}
        if self.disk is None or end <= n:
            return out
        more = self.disk.page(max(0, offset - n), end - n)
        if not more:
            return out
        return {k: np.concatenate([out[k], more[k]]) for k in out}


@dataclass
class _Export:
    version: int
    tables: dict[str, ExportedCopy]
    touched: float
    tier: str = ""  # the disk tier's checkpoint of the cut ("" without tables on disk)


class ExportSessions:
    """The export copies a shard holds, and since which cut it can write deltas (its removal tracking)."""

    MAX_EXPORTS = 4  # copies kept at once
    EXPORT_IDLE_S = 600.0  # a copy nobody read for this long is freed

    def __init__(self, shard_index: int, registry: TableRegistry, limits: Limits, cuts: Checkpointer,
                 version: Callable[[], int], check_writable: Callable[[str], None]) -> None:
        self.index = shard_index
        self.registry = registry
        self.limits = limits
        self.cuts = cuts
        self.version = version
        self.check_writable = check_writable
        self.floor: Optional[int] = None  # removals are tracked since this version (None: not yet)
        self._exports: dict[str, _Export] = {}
        # While slots arrive here (a migration's rows held but not yet owned), a copy keeps the owned rows only.
        self.owned: Optional[Callable[[Any, np.ndarray], np.ndarray]] = None
        self.arriving: Callable[[], bool] = lambda: False

    def created(self, t: Table) -> None:
        """A new table or dense tensor: while an export follows the shard, its evictions are tracked."""
        if self.floor is not None and t.eviction is not None:
            t.removals = RemovalLog(self.version())

    def delta_floor(self) -> int:
        """The oldest cut a delta may follow (-1: no export followed yet, so none): where removal tracking
        started, or later where a table's removals overflowed."""
        if self.floor is None:
            return -1
        floors = [t.removals.floor for t in self.registry.tables() if t.removals is not None]
        return max([self.floor, *floors])

    def begin(self, export_id: str, names: list[str], optimizer_state: bool, since: Optional[int],
              prepared: bool = False) -> tuple[int, dict[str, ExportedCopy]]:
        """Copy tables for an export at one version (phase 2 after ``hold_pushes`` when ``prepared``): every
        table (or those of ``names``) whole, or with ``since`` what changed after that version, with
        tombstones. The copy is kept as ``export_id`` for ``read``. Returns (version, copies)."""
        self.check_writable("an export")
        if not export_id or len(export_id) > 64 or not all(c.isalnum() or c in "-_" for c in export_id):
            raise InvalidArgument(f"invalid export id {export_id!r}: use 1 to 64 of [A-Za-z0-9_-]")
        self._free_idle()
        if len(self._exports) >= self.MAX_EXPORTS and export_id not in self._exports:
            raise ResourceExhausted(f"shard {self.index}: {self.MAX_EXPORTS} exports are being read already")
        self.end(export_id)
        tier = ""
        with self.cuts.lock, self.cuts.phase_two(f"export {export_id}", prepared):
            with self.cuts.all_locked() as (tables, _):
                arriving = self.arriving()
                version = self.version()
                copies = self._copy(tables, set(names), optimizer_state, since, version, arriving)
                tiered = {name: t.hot for name, t in tables if name in copies and t.hot is not None}
                if tiered:  # a checkpoint of the disk tier, the hot rows spilled into it: no copy in memory
                    tier = f"export-{export_id}"
                    assert self.registry.tiers is not None
                    tier_dir = self.registry.tiers.checkpoint(tier)
                    counts = {name: h.total_rows for name, h in tiered.items()}
                    for h in tiered.values():
                        h.spill(tier_dir)
        if tier:  # the rows, read from the tier's checkpoint of the cut, after the locks
            assert self.registry.tiers is not None
            reader = self.registry.tiers.open_checkpoint(tier)
            keep = self.owned if self.owned is not None and arriving else None
            for name, h in tiered.items():
                c = copies[name]
                hot, _ = read_spill(tier_dir, h.store.name, h.codec.describe())
                c.disk = DiskRows(reader, name, h.codec, hot, None if c.full else since, optimizer_state,
                                  counts[name] if c.full and keep is None else None,
                                  None if keep is None else functools.partial(keep, c.spec))
        self._exports[export_id] = _Export(version, copies, time.monotonic(), tier)
        rows = sum(c.rows for c in copies.values())
        log.info("shard %d: export %s at version %d: %d tables, %d rows%s", self.index, export_id, version,
                 len(copies), rows, "" if since is None else f" changed since version {since}")
        return version, copies

    def _copy(self, tables: list[tuple[str, Table]], wanted: set[str], optimizer_state: bool,
              since: Optional[int], version: int, arriving: bool = False) -> dict[str, ExportedCopy]:
        """The copies of a cut (every table locked); from it on, evictions are kept for the next delta."""
        missing = wanted - {name for name, _ in tables}
        if missing and since is None:
            raise NotFound(f"shard {self.index}: no table or dense tensor {sorted(missing)[0]!r} to export")
        if since is not None:
            floor = self.delta_floor()
            if floor < 0 or not floor <= since <= version:
                why = ("it has not been exported since it started" if floor < 0 else
                       f"it keeps removals since version {floor} only" if since < floor else
                       f"it is at version {version}, before that cut (its state was lost)")
                raise ExportGap(f"shard {self.index}: no delta since version {since}: {why}; write a new base")
        copies = {}
        for name, t in tables:
            if wanted and name not in wanted:
                continue
            full = since is None or t.created_version > since
            if t.hot is not None:  # its rows come from the disk tier's checkpoint of the cut (``DiskRows``)
                copies[name] = ExportedCopy(t.spec, full, _no_rows(t.dim, t.optimizer.state_names(), optimizer_state,
                                                                  since is not None))
                continue
            arrays = t.export_copy(version, None if full else since, optimizer_state)
            if arriving and self.owned is not None:  # rows of slots arriving here are not this shard's yet
                keep = self.owned(t.spec, arrays["ids"])
                arrays = {k: (v if k == "tombstones" else v[keep]) for k, v in arrays.items()}
            copies[name] = ExportedCopy(t.spec, full, arrays)
            if since is not None and t.removals is not None:
                t.removals.trim(since)
        if self.floor is None:
            self.floor = version
        for _, t in tables:
            if t.eviction is not None and t.removals is None:
                t.removals = RemovalLog(version)
        return copies

    def read(self, export_id: str, name: str, offset: int, max_rows: int,
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
            ids = copy.tombstones
            page = max(1, self.limits.max_message_bytes // 16)
            return {"ids": ids[offset:offset + min(max_rows or page, page)]}
        per_row = sum(a.itemsize * (a[0].size if a.shape[0] else int(np.prod(a.shape[1:])))
                      for k, a in copy.arrays.items() if k != "tombstones")
        page = max(1, (self.limits.max_message_bytes - 65536) // max(per_row, 1))
        return copy.page(offset, offset + min(max_rows or page, page))

    def end(self, export_id: str) -> None:
        export = self._exports.pop(export_id, None)
        if export is not None and export.tier:
            readers = {c.disk.reader for c in export.tables.values() if c.disk is not None}
            for r in readers:
                r.close()
            assert self.registry.tiers is not None
            self.registry.tiers.remove_checkpoint(export.tier)

    def _free_idle(self) -> None:
        now = time.monotonic()
        for eid, e in list(self._exports.items()):
            if now - e.touched > self.EXPORT_IDLE_S:
                log.warning("shard %d: export %s freed unfinished (unread for %.0f s)", self.index, eid, now - e.touched)
                self.end(eid)


def _no_rows(dim: int, state_names: Sequence[str], optimizer_state: bool, delta: bool) -> dict[str, np.ndarray]:
    """The arrays of an export's copy that holds no rows (a table with a disk tier: ``DiskRows`` has them)."""
    out = {"ids": np.zeros(0, np.int64), "values": np.zeros((0, dim), np.float32)}
    if optimizer_state:
        out["steps"] = np.zeros(0, np.int64)
        out.update({"state." + n: np.zeros((0, dim), np.float32) for n in state_names})
    if delta:
        out["tombstones"] = np.zeros(0, np.int64)
    return out
