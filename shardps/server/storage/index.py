"""Vectorised id -> slot indexes.

Slots are numbered in insertion order (0, 1, 2, ...), and both indexes keep
the id of every slot in ``ids`` (the table's row order, what snapshots save).

``HashIndex`` is laid out like CPython's compact dict: the dense ``ids`` array
plus a sparse open-addressing (linear probing) array holding only int32 slot
numbers, so a row costs 8 bytes of id plus 8-16 bytes of probe table (load
kept between 1/4 and 1/2) instead of 24-48 bytes for a table of (key, value)
pairs. Every probe round is one vectorised pass over the ids still looking for
their slot, so lookups run at numpy speed instead of a Python dict's 1-2M/s.
``DirectIndex`` maps ids of a fixed table through a flat int32 array.

One contract: ``lookup`` returns -1 for absent ids; ``insert`` takes ids that
are absent and unique, with the next slots in order; ``remove`` takes present,
unique ids and keeps the slots dense by moving the last slot into each freed one,
returning those moves so the rows that follow the slots can move the same way
(eviction).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from shardps.core import kernels
from shardps.core.ids import is_sorted_unique
from shardps.core.memory import full, regrow, zeros
from shardps.core.routing import mix64

_INDEX_SEED = np.uint64(0x1D3A5EED00000002)


class _SlotIds:
    """The id of each slot, in a growable array."""

    def __init__(self, capacity: int) -> None:
        self._ids = zeros(max(16, capacity), np.int64)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    @property
    def ids(self) -> np.ndarray:
        """Id of each slot (a view; slot i holds ids[i])."""
        return self._ids[: self._count]

    def insert(self, ids: np.ndarray, values: np.ndarray) -> None:
        """Insert absent, unique ``ids`` as slots ``values`` (the next ones in order)."""
        ids = np.asarray(ids, dtype=np.int64)
        values = np.asarray(values, dtype=np.int64)
        k = ids.shape[0]
        # k values from count to count + k - 1, strictly increasing: exactly count, count + 1, ...
        if values.shape != ids.shape or (
                k and not (values[0] == self._count and values[-1] == self._count + k - 1 and is_sorted_unique(values))):
            raise ValueError(f"slots are assigned in insertion order: expected {self._count}.., got {values[:3]}..")
        self._add(ids, values)

    def append(self, ids: np.ndarray) -> np.ndarray:
        """Insert absent, unique int64 ``ids`` as the next slots (``insert`` without its check of the slots, which
        it makes): their slots. A table's new rows come this way (the check cost a few microseconds a call)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        values = np.arange(self._count, self._count + ids.shape[0], dtype=np.int64)
        self._add(ids, values)
        return values

    def _add(self, ids: np.ndarray, values: np.ndarray) -> None:
        raise NotImplementedError

    def _append_ids(self, ids: np.ndarray) -> None:
        k = ids.shape[0]
        if self._count + k > self._ids.shape[0]:
            regrow(self, "_ids", max(self._count + k, self._ids.shape[0] * 3 // 2))
        self._ids[self._count : self._count + k] = ids
        self._count += k


class HashIndex(_SlotIds):
    """Open-addressing id -> slot map for any int64 ids; 4 bytes per probe slot, load kept <= 1/2."""

    def __init__(self, capacity: int = 1024, probe_rows: Optional[int] = None) -> None:
        """``capacity``: ids the id array is made for (lazily allocated pages); ``probe_rows``: ids the probe table
        is made for (default ``capacity``). A table that fills slowly starts with a small probe table: its ids stay
        in few cache lines, where one sized for a guess spreads the same ids over a table many times larger (a
        lookup's probe then misses the cache; 1.7-2x slower here); it grows with the ids (load 1/4 to 1/2)."""
        super().__init__(capacity)
        # slots fit in 31 bits
        self._table = full(self.table_size(capacity if probe_rows is None else probe_rows), -1, np.int32)
        self._mask = np.uint64(self._table.shape[0] - 1)

    @staticmethod
    def table_size(count: int) -> int:
        """Probe-table positions for ``count`` ids (load at most 1/2)."""
        return 1 << max(4, int(np.ceil(np.log2(max(2 * count, 16)))))

    @property
    def nbytes(self) -> int:
        return 8 * self._count + self._table.nbytes  # ids past the count are never touched

    def _home(self, ids: np.ndarray) -> np.ndarray:
        return (mix64(ids, _INDEX_SEED) & self._mask).astype(np.int64)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Slot of each id (int64), -1 where absent."""
        ids = np.asarray(ids, dtype=np.int64)
        k = kernels.jit()
        if k is not None:
            return k.hash_lookup(self._table, self._ids, ids, _INDEX_SEED)
        return self.lookup_numpy(ids)

    def lookup_numpy(self, ids: np.ndarray) -> np.ndarray:
        """The reference of :meth:`lookup` (and of its kernel): one vectorised pass per probe round."""
        out = np.full(ids.shape[0], -1, dtype=np.int64)
        pending = np.arange(ids.shape[0])
        pos = self._home(ids)
        want = ids
        mask = int(self._mask)
        slot_ids = self._ids
        while pending.size:
            slots = self._table[pos]
            occupied = slots >= 0
            # An empty position (-1) reads slot_ids[-1]: any value, masked out by ``occupied``.
            hit = occupied & (slot_ids[slots] == want)
            out[pending[hit]] = slots[hit]  # widened to int64 by the assignment
            go_on = occupied & ~hit
            if not go_on.any():
                break
            pending = pending[go_on]
            want = want[go_on]
            pos = (pos[go_on] + 1) & mask
        return out

    def _add(self, ids: np.ndarray, values: np.ndarray) -> None:
        self._append_ids(ids)
        if self._count > (self._table.shape[0] >> 1):
            self._table = full(self.table_size(self._count), -1, np.int32)
            self._mask = np.uint64(self._table.shape[0] - 1)
            self._place(self._ids[: self._count], np.arange(self._count))
        else:
            self._place(ids, values)

    def remove(self, ids: np.ndarray, check: bool = True) -> np.ndarray:
        """Delete present, unique ``ids``; the slots stay 0..len-1: after each deletion the last slot moves
        into the freed one. Returns the moves, rows of (from slot, to slot) in the order made.
        ``check=False``: the caller vouches that the ids are present and unique (a table's own victims)."""
        ids = np.asarray(ids, dtype=np.int64)
        if check and ids.size and (np.unique(ids).size != ids.size or (self.lookup(ids) < 0).any()):
            raise ValueError("remove takes present, unique ids")
        k = kernels.jit()
        if k is not None:
            moves = k.hash_remove(self._table, self._ids, self._count, ids, _INDEX_SEED)
            self._count -= ids.shape[0]
            return moves
        return self.remove_numpy(ids)

    def remove_numpy(self, ids: np.ndarray) -> np.ndarray:
        """The reference of :meth:`remove` (and of its kernel): per id, backward-shift deletion in the probe
        table (no tombstones: later entries of the run move back unless their home lies between), then
        the last slot moves into the freed one."""
        mask = int(self._mask)
        size = self._table.shape[0]
        moves = []
        for x in ids.tolist():
            pos = int(self._home(np.array([x], np.int64))[0])
            while self._ids[self._table[pos]] != x:
                pos = (pos + 1) & mask
            victim = int(self._table[pos])
            hole, j = pos, (pos + 1) & mask
            while self._table[j] >= 0:
                home = int(self._home(self._ids[self._table[j]: self._table[j] + 1])[0])
                if (j - home) % size >= (j - hole) % size:  # its home is not in (hole, j]: it may move back
                    self._table[hole] = self._table[j]
                    hole = j
                j = (j + 1) & mask
            self._table[hole] = -1
            self._count -= 1
            last = self._count
            if victim != last:
                p = int(self._home(self._ids[last: last + 1])[0])
                while self._table[p] != last:
                    p = (p + 1) & mask
                self._table[p] = victim
                self._ids[victim] = self._ids[last]
                moves.append((last, victim))
        return np.array(moves, dtype=np.int64).reshape(-1, 2)

    def _place(self, ids: np.ndarray, values: np.ndarray) -> None:
        k = kernels.jit()
        if k is not None:
            k.hash_place(self._table, ids, values, _INDEX_SEED)
        else:
            self.place_numpy(ids, values)

    def place_numpy(self, ids: np.ndarray, values: np.ndarray) -> None:
        """The reference of :meth:`_place`: every probe round places the first claimant of each free position
        (the kernel places ids one by one; the layouts may differ, the lookups agree)."""
        mask = int(self._mask)
        pos = self._home(ids)
        while ids.size:
            free = self._table[pos] < 0
            cand = np.flatnonzero(free)
            # Several ids may want the same free position: the first of each wins this round.
            won, first = np.unique(pos[cand], return_index=True)
            winners = cand[first]
            self._table[won] = values[winners]
            keep = np.ones(ids.shape[0], dtype=bool)
            keep[winners] = False
            # Ids that met an occupied position probe on; losers retry (the position is now taken).
            pos = np.where(free, pos, (pos + 1) & mask)[keep]
            ids = ids[keep]
            values = values[keep]


class DirectIndex(_SlotIds):
    """id -> slot through a flat int32 array of length num_embeddings (fixed tables)."""

    def __init__(self, num_embeddings: int, capacity: int = 1024) -> None:
        super().__init__(capacity)
        self._map = full(num_embeddings, -1, np.int32)

    @property
    def nbytes(self) -> int:
        return 8 * self._count + self._map.nbytes

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        return self._map[ids].astype(np.int64)

    def remove(self, ids: np.ndarray, check: bool = True) -> np.ndarray:
        """As ``HashIndex.remove``: delete present, unique ids, moving the last slot into each freed one."""
        ids = np.asarray(ids, dtype=np.int64)
        if check and ids.size and (np.unique(ids).size != ids.size or (self._map[ids] < 0).any()):
            raise ValueError("remove takes present, unique ids")
        k = kernels.jit()
        if k is not None:
            moves = k.direct_remove(self._map, self._ids, self._count, ids)
            self._count -= ids.shape[0]
            return moves
        return self.remove_numpy(ids)

    def remove_numpy(self, ids: np.ndarray) -> np.ndarray:
        """The reference of :meth:`remove` (and of its kernel)."""
        moves = []
        for x in ids.tolist():
            victim = int(self._map[x])
            self._map[x] = -1
            self._count -= 1
            last = self._count
            if victim != last:
                moved = int(self._ids[last])
                self._ids[victim] = moved
                self._map[moved] = victim
                moves.append((last, victim))
        return np.array(moves, dtype=np.int64).reshape(-1, 2)

    def _add(self, ids: np.ndarray, values: np.ndarray) -> None:
        self._append_ids(ids)
        self._map[ids] = values
