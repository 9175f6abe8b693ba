"""Vectorised id -> slot indexes.

``HashIndex`` is an open-addressing (linear probing) hash table over numpy
arrays: every probe round is one vectorised pass over the ids still looking
for their slot, so lookups run at numpy speed instead of a Python dict's 1-2M/s.
``DirectIndex`` maps ids of a fixed table through a flat array. Both share one
contract: ``lookup`` returns -1 for absent ids and ``insert`` takes ids that
are absent and unique.
"""

from __future__ import annotations

import numpy as np

from shardps.routing import mix64

_INDEX_SEED = np.uint64(0x1D3A5EED00000002)


class HashIndex:
    """Open-addressing id -> slot map for any int64 ids; load factor kept <= 1/2."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1 << max(4, int(np.ceil(np.log2(max(2 * capacity, 16)))))
        self._keys = np.zeros(cap, dtype=np.int64)
        self._vals = np.full(cap, -1, dtype=np.int32)  # slots of a shard's rows fit in 31 bits
        self._mask = np.uint64(cap - 1)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._keys.nbytes + self._vals.nbytes

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids, _INDEX_SEED) & self._mask).astype(np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id (int64), -1 where absent."""
        ids = np.asarray(ids, dtype=np.int64)
        out = np.full(ids.shape[0], -1, dtype=np.int64)
        pending = np.arange(ids.shape[0])
        slots = self._home(ids)
        want = ids
        mask = int(self._mask)
        while pending.size:
            vals = self._vals[slots]
            occupied = vals >= 0
            hit = occupied & (self._keys[slots] == want)
            out[pending[hit]] = vals[hit]  # widened to int64 by the assignment
            go_on = occupied & ~hit
            if not go_on.any():
                break
            pending = pending[go_on]
            want = want[go_on]
            slots = (slots[go_on] + 1) & mask
        return out

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Insert absent, unique ``ids`` mapping to ``values``."""
        ids = np.asarray(ids, dtype=np.int64)
        values = np.asarray(values, dtype=np.int64)
        if self._count + ids.shape[0] > (self._vals.shape[0] >> 1):
            self._grow(self._count + ids.shape[0])
        mask = int(self._mask)
        slots = self._home(ids)
        self._count += ids.shape[0]
        while ids.size:
            free = self._vals[slots] < 0
            cand = np.flatnonzero(free)
            # Several ids may want the same free slot: the first of each wins this round.
            won_slots, first = np.unique(slots[cand], return_index=True)
            winners = cand[first]
            self._keys[won_slots] = ids[winners]
            self._vals[won_slots] = values[winners]
            keep = np.ones(ids.shape[0], dtype=bool)
            keep[winners] = False
            # Ids that met an occupied slot probe on; losers retry (the slot is now taken).
            slots = np.where(free, slots, (slots + 1) & mask)[keep]
            ids = ids[keep]
            values = values[keep]

    def _grow(self, need: int) -> None:
        keys, vals = self._keys, self._vals
        live = vals >= 0
        cap = self._vals.shape[0]
        while need > (cap >> 1):
            cap <<= 1
        self._keys = np.zeros(cap, dtype=np.int64)
        self._vals = np.full(cap, -1, dtype=np.int32)
        self._mask = np.uint64(cap - 1)
        self._count = 0
        if live.any():
            self.insert(keys[live], vals[live])


class DirectIndex:
    """id -> slot through a flat int32 array of length num_embeddings (fixed tables)."""

    def __init__(self, num_embeddings: int) -> None:
        self._map = np.full(num_embeddings, -1, dtype=np.int32)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        return self._map.nbytes

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._map[ids].astype(np.int64)

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        self._map[ids] = values
        self._count += len(ids)
