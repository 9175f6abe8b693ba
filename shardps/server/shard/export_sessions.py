"""Export sessions of one shard (``shardps export``, format in ``shardps.core.exports``): a copy of the
tables at one cut, whole or changed since an earlier cut with tombstones, kept in memory and read in
pages until the exporter ends the session (or leaves it idle).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import numpy as np

from shardps.core.errors import ExportGap, InvalidArgument, NotFound, ResourceExhausted
from shardps.core.specs import DenseSpec, TableSpec
from shardps.server.shard.checkpointing import Checkpointer
from shardps.server.shard.limits import Limits
from shardps.server.shard.registry import TableRegistry
from shardps.server.storage.bounded import RemovalLog
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)


@dataclass
class ExportedCopy:
    """One table of an export's copy: its spec, whether the copy is the whole table, and its arrays
    (``ids``, ``values``; ``steps`` and ``state.*`` with optimizer state; ``tombstones`` in a delta)."""

    spec: Union[TableSpec, DenseSpec]
    full: bool
    arrays: dict[str, np.ndarray]


@dataclass
class _Export:
    version: int
    tables: dict[str, ExportedCopy]
    touched: float


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
        with self.cuts.lock, self.cuts.phase_two(f"export {export_id}", prepared):
            with self.cuts.all_locked() as (tables, _):
                version = self.version()
                copies = self._copy(tables, set(names), optimizer_state, since, version)
        self._exports[export_id] = _Export(version, copies, time.monotonic())
        rows = sum(c.arrays["ids"].shape[0] for c in copies.values())
        log.info("shard %d: export %s at version %d: %d tables, %d rows%s", self.index, export_id, version,
                 len(copies), rows, "" if since is None else f" changed since version {since}")
        return version, copies

    def _copy(self, tables: list[tuple[str, Table]], wanted: set[str], optimizer_state: bool,
              since: Optional[int], version: int) -> dict[str, ExportedCopy]:
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
            copies[name] = ExportedCopy(t.spec, full, t.export_copy(version, None if full else since, optimizer_state))
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
            ids = copy.arrays.get("tombstones", np.zeros(0, np.int64))
            page = max(1, self.limits.max_message_bytes // 16)
            return {"ids": ids[offset:offset + min(max_rows or page, page)]}
        per_row = sum(a[:1].nbytes for k, a in copy.arrays.items() if k != "tombstones")
        page = max(1, (self.limits.max_message_bytes - 65536) // max(per_row, 1))
        end = offset + min(max_rows or page, page)
        return {k: a[offset:end] for k, a in copy.arrays.items() if k != "tombstones"}

    def end(self, export_id: str) -> None:
        self._exports.pop(export_id, None)

    def _free_idle(self) -> None:
        now = time.monotonic()
        for eid, e in list(self._exports.items()):
            if now - e.touched > self.EXPORT_IDLE_S:
                log.warning("shard %d: export %s freed unfinished (unread for %.0f s)", self.index, eid, now - e.touched)
                self._exports.pop(eid, None)
