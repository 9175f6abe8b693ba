"""What a bounded table's policies decide over its rows, as plain functions of the row store: which rows
expired (TTL in steps or seconds), which to evict over capacity (LRU or LFU victims), the per-row
staleness of a push, and what an export copies (live rows, changed rows and tombstones). The table
applies what they decide; these functions change nothing.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from shardps.core.specs import Eviction
from shardps.server.storage.bounded import PushHistory, RemovalLog, choose_victims
from shardps.server.storage.rows import RowStore


def expired(store: RowStore, e: Optional[Eviction], slots: np.ndarray, version: int, now: int) -> np.ndarray:
    """Which rows of ``slots`` have not been pushed for longer than the eviction's TTLs (shard at
    ``version``, time ``now`` in ticks)."""
    out = np.zeros(slots.shape[0], dtype=bool)
    if e is None:
        return out
    if e.ttl_steps is not None:
        out |= store.last_version[slots] < version - e.ttl_steps
    if e.ttl_seconds is not None:
        out |= store.last_time[slots].astype(np.int64) < now - int(round(e.ttl_seconds * 10))
    return out


def capacity_victims(store: RowStore, e: Optional[Eviction], stamp: int) -> np.ndarray:
    """Ids of the rows to evict for the store to hold at most the eviction's ``max_rows`` (none of the push
    of ``stamp`` unless it alone is larger): a copy, so removing them does not change it."""
    if e is None or e.max_rows is None or store.n <= e.max_rows:
        return np.zeros(0, np.int64)
    n = store.n
    victims = choose_victims(e, n, n - e.max_rows, store.ids, store.last_version[:n], store.touches[:n],
                             stamp, salt=stamp)
    return store.ids[victims].copy()


def row_staleness(store: RowStore, history: Optional[PushHistory], ids: np.ndarray, pulled: int,
                  version: int, elsewhere: bool = False) -> np.ndarray:
    """Per-row staleness of a push of the sorted unique ``ids`` pulled at ``pulled`` (shard now at
    ``version``): the pushes since ``pulled`` that updated each row, or the shard's staleness for
    rows updated since then when the history no longer covers it. ``elsewhere``: rows absent from ``store`` may
    exist (on disk, for a table with a disk tier), so the history is asked about them too."""
    out = np.zeros(ids.shape[0], np.int64)
    slots = store.index.lookup(ids)
    present = np.flatnonzero(slots >= 0)
    touched = present[store.last_version[slots[present]] > pulled]
    if elsewhere:
        touched = np.union1d(touched, np.flatnonzero(slots < 0))
    if touched.size:
        assert history is not None
        since = history.since(pulled, ids[touched])
        out[touched] = since if since is not None else max(0, version - pulled)
    return out


def export_arrays(store: RowStore, expired_rows: Optional[np.ndarray], removals: Optional[RemovalLog],
                  since: Optional[int], optimizer_state: bool) -> dict[str, np.ndarray]:
    """Copies for an export. ``since`` None: every live row (a base). Otherwise the rows changed after version
    ``since`` and, as ``tombstones``, the ids removed since then or expired now (they read as their initial
    value). Expired rows (``expired_rows``, a mask over the live slots, or None) are left out either way;
    ``steps`` and ``state.*`` only with ``optimizer_state``."""
    n = store.n
    keep = np.ones(n, dtype=bool) if since is None else store.last_version[:n] > since
    if expired_rows is not None:
        keep &= ~expired_rows
    take: Union[slice, np.ndarray] = slice(0, n) if keep.all() else np.flatnonzero(keep)  # a slice: a memcpy
    out = {"ids": store.ids[take].copy(), "values": store.rows[take].copy()}
    if optimizer_state:
        out["steps"] = store.steps[take].astype(np.int64)
        out.update({"state." + k: v[take].copy() for k, v in store.state.items()})
    if since is not None:
        gone = [removals.since(since)] if removals is not None else []
        if expired_rows is not None:
            gone.append(store.ids[:n][expired_rows])
        out["tombstones"] = np.unique(np.concatenate(gone)) if gone else np.zeros(0, np.int64)
    return out
