"""The rows a slot migration moves: found by hash slot (dense tensors: by row), read with everything a row holds,
written on the shard they move to, dropped from the one they left. Tables with a disk tier too: their rows on disk
are found by key range (keys start with the slot) and written or removed there. The caller holds the table's lock.

What moves with a row: its values, optimizer state, step count, last push time and pushes. Its last change's
version is the receiving shard's (``stamp``): versions are per shard, and the row did change there.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from shardps.core.routing import slot_of_ids
from shardps.server.storage.table import Table

CAUSE_MOVED = 3  # a row removal's cause: it moved to another shard (counted as neither TTL nor capacity)


class Selection:
    """Which rows move: those of the marked hash ``slots`` (bool [NUM_SLOTS]) of a table, or the marked ``rows``
    (bool [rows]) of a dense tensor."""

    def __init__(self, slots: np.ndarray, rows: Optional[np.ndarray] = None) -> None:
        self.slots = slots
        self.rows = rows

    def of(self, t: Table, ids: np.ndarray) -> np.ndarray:
        """Which of ``ids`` are selected."""
        if t.is_dense:
            assert self.rows is not None
            return self.rows[ids] if ids.size else np.zeros(0, bool)
        return self.slots[slot_of_ids(ids)] if ids.size else np.zeros(0, bool)

    def runs(self) -> list[tuple[int, int]]:
        """The selected slots as [first, last] runs."""
        marked = np.flatnonzero(self.slots)
        if not marked.size:
            return []
        breaks = np.flatnonzero(np.diff(marked) > 1)
        firsts = np.r_[marked[0], marked[breaks + 1]]
        lasts = np.r_[marked[breaks], marked[-1]]
        return list(zip(firsts.tolist(), lasts.tolist()))


def ids_in(t: Table, sel: Selection, since: Optional[int] = None) -> np.ndarray:
    """Sorted ids of the rows of ``t`` that ``sel`` selects, changed after shard version ``since`` (None: all)."""
    store = t.store
    ids = store.ids[: store.n]
    keep = sel.of(t, ids)
    if since is not None:
        keep &= store.last_version[: store.n] > since
    found = [ids[keep]]
    if t.hot is not None:  # rows on disk and not in memory
        index = t.hot.rows.index
        for first, last in sel.runs():
            for disk_ids, records in t.hot.store.scan(first, last):
                cold = index.lookup(disk_ids) < 0
                if since is not None:
                    cold &= records["last_version"] > since
                found.append(disk_ids[cold])
    return np.unique(np.concatenate(found)) if len(found) > 1 else np.sort(found[0])


def read_state(t: Table, ids: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(the ids of ``ids`` still present, everything their rows hold): ``rows``, ``steps``, ``state.<name>``,
    ``meta.last_time``, ``meta.touches``."""
    store = t.store
    slots = store.index.lookup(ids)
    hot = slots >= 0
    if t.hot is None:
        ids, slots = ids[hot], slots[hot]
        return ids, _gather(store, slots)
    present = hot.copy()
    found, records = t.hot.store.get(ids[~hot]) if (~hot).any() else (np.zeros(0, bool), None)
    present[np.flatnonzero(~hot)[found]] = True
    n = int(present.sum())
    arrays = {"rows": np.empty((n, t.dim), np.float32), "steps": np.empty(n, np.int32),
              "meta.last_time": np.empty(n, np.uint32), "meta.touches": np.empty(n, np.int32)}
    arrays.update({"state." + k: np.empty((n, t.dim), np.float32) for k in store.state})
    where_hot = hot[present]
    for k, v in _gather(store, slots[hot]).items():
        arrays[k][where_hot] = v
    if records is not None and records.shape[0]:
        for k in arrays:
            arrays[k][~where_hot] = records[k[len("meta."):] if k.startswith("meta.") else k]
    return ids[present], arrays


def _gather(store: object, slots: np.ndarray) -> dict[str, np.ndarray]:
    out = {"rows": store.rows[slots], "steps": store.steps[slots],  # type: ignore[attr-defined]
           "meta.last_time": store.last_time[slots], "meta.touches": store.touches[slots]}  # type: ignore[attr-defined]
    out.update({"state." + k: v[slots] for k, v in store.state.items()})  # type: ignore[attr-defined]
    return out


def write_state(t: Table, ids: np.ndarray, arrays: dict[str, np.ndarray], stamp: int) -> None:
    """Set the rows of unique ``ids`` to everything ``arrays`` holds (``read_state``'s keys), creating absent ones;
    ``stamp``: their last change's version on this shard."""
    store = t.store
    slots = store.index.lookup(ids)
    in_memory = slots >= 0
    if t.hot is not None and not in_memory.all():  # rows not in memory go to disk as they are
        cold = ids[~in_memory]
        found = t.hot.store.contains(cold)
        fields = {k[len("meta."):] if k.startswith("meta.") else k: v[~in_memory] for k, v in arrays.items()}
        fields["last_version"] = np.full(cold.shape[0], stamp, np.int64)
        t.hot.store.put(cold, fields)
        t.hot.disk_rows += int((~found).sum())
        ids, slots, arrays = ids[in_memory], slots[in_memory], {k: v[in_memory] for k, v in arrays.items()}
        in_memory = np.ones(ids.shape[0], bool)
    missing = slots < 0
    if missing.any():
        slots[missing] = store.append(ids[missing], arrays["rows"][missing])
    store.rows[slots] = arrays["rows"]
    store.steps[slots] = arrays["steps"]
    for k, v in store.state.items():
        v[slots] = arrays["state." + k]
    store.last_time[slots] = arrays["meta.last_time"]
    store.touches[slots] = arrays["meta.touches"]
    store.last_version[slots] = stamp
    if t.hot is not None:
        t.hot.changed(slots)


def drop(t: Table, ids: np.ndarray, version: int) -> int:
    """Remove the present rows of ``ids`` (in memory and on disk); how many (``version``: the shard version from
    which they are gone, for an export's tombstones)."""
    present = ids[t.store.index.lookup(ids) >= 0]
    t.remove(present, CAUSE_MOVED, check=False, version=version)
    if t.hot is None:
        return int(present.shape[0])
    found = t.hot.store.contains(ids)
    if found.any():
        t.hot.store.delete(ids[found])
        t.hot.disk_rows -= int(found.sum())
    return int(np.union1d(present, ids[found]).shape[0])
