"""The slot-dense arrays of one table on one shard: rows, per-row optimizer state, step counts and
metadata (version and time of the last push, pushes), the id -> slot index, and what they cost against
the shard's memory budget. Slots stay dense: a removed row's slot takes the last row, with everything that
belongs to it. Knows nothing of optimizers' math, policies or versions; the caller holds the table's lock.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any, Callable, Optional, Union

import numpy as np

from shardps.core import kernels, memory
from shardps.core.errors import ResourceExhausted
from shardps.core.memory import regrow, release_pages, zeros
from shardps.server.storage.budget import AHEAD_IDLE_S, MemoryBudget
from shardps.server.storage.index import DirectIndex, HashIndex

INITIAL_ROWS = 1 << 20  # what a declared size may reserve before any row arrives
FIRST_PROBE_ROWS = 1024  # a growing table's first hash probe table is made for this many ids
# The slot's id (8) and its share of the probe table (up to 16). Charged per live row, as the row arrays are: a hash
# probe table does not shrink when rows go, so a table that shrank holds up to 16 bytes a row of its peak uncharged.
INDEX_BYTES_PER_ROW = 24
# With a flat map (``DirectIndex``, charged whole when made) a row's share of the index is its slot's id.
DIRECT_BYTES_PER_ROW = 8
# A table of known size gets a flat id -> slot map (``DirectIndex``) when it costs at most this (and a quarter of the
# rows a shard expects to hold, and 1/16 of the budget left): a lookup is then one read where the hash index's takes
# two (its probe table, then the slot's id), each a cache miss on a large table. Measured on the DLRM example's 1M-id
# tables of 16 (a 4 MB map per shard): the shards' CPU a step 6.5% lower (docs/performance.md).
DIRECT_INDEX_BYTES = 16 << 20
# A row's step count and metadata (shard version and time of its last push, pushes) as one record a row: a push
# writes all four for each of its rows, and one record shares a cache line where four arrays took four.
META = np.dtype([("last_version", np.int64), ("steps", np.int32), ("last_time", np.uint32), ("touches", np.int32),
                 ("_pad", np.int32)])
META_BYTES_PER_ROW = META.itemsize  # 24: 20 of fields, 4 of padding (records of whole 8-byte words)
# A growing table's arrays get their next rows' pages made ahead of the rows, in the background (``memory.populate``):
# up to an eighth of the rows reserved (from its creation: a first pass's new rows fault nothing), past that a quarter
# of those held, at most this many bytes of the per-row arrays; in all of a shard's tables no more than
# ``budget.AHEAD_SHARD_BYTES``, and never more than the memory budget has left. Made a step (2 MiB of the per-row
# arrays) at a time. (The eighth was once kept ahead of the rows held as well: a table that stopped growing kept it,
# made and never used. In the DLRM demo, 8 tables of a shard, that was 64 MiB of pages a shard, about 5% of its CPU.)
AHEAD_BYTES = 32 << 20
AHEAD_STEP_BYTES = 2 << 20


class RowStore:
    """Arrays indexed by slot for ``name`` (rows of ``dim``, one state array per name of ``state_init``,
    which gives each one's initial value), with a hash index, or a flat one when ``num_embeddings`` is
    small enough (``_direct_index_pays``). ``extra`` names further per-row arrays (name ->
    dtype) that move with their rows (a disk tier's flags), zero for a new row. ``sized``: the arrays are made
    for ``expected_rows`` at once (lazily allocated pages; never copied to grow), with a hash index (a store that
    holds a bounded hot set of a larger table), unless ``direct`` (a flat map over ``num_embeddings``, which the
    caller found cheap)."""

    def __init__(self, name: str, dim: int, state_init: dict[str, float], num_embeddings: Optional[int],
                 expected_rows: int, budget: MemoryBudget, max_rows: int,
                 extra: Optional[dict[str, Any]] = None, sized: bool = False, direct: bool = False) -> None:
        self.name = name
        self.dim = dim
        self.state_init = state_init
        self.num_embeddings = num_embeddings
        self.budget = budget
        self.max_rows = max_rows
        self.charged = 0  # bytes of the budget these arrays hold
        self._direct = num_embeddings is not None and (
            direct if sized else self._direct_index_pays(max(16, int(expected_rows))))
        # The index's bytes a row is charged: its slot's id, and with a hash index its share of the probe table.
        self.index_row_bytes = DIRECT_BYTES_PER_ROW if self._direct else INDEX_BYTES_PER_ROW
        cap = max(16, int(expected_rows) if sized else min(int(expected_rows), INITIAL_ROWS))
        # A hot set fills its reserved rows: its probe table is made for them. Other tables grow from a small one.
        probe = cap if sized else min(cap, FIRST_PROBE_ROWS)
        self.charge(self._index_bytes(probe), "creating the index")
        self.index = self._new_index(cap, probe)
        self.n = 0
        self.rows = zeros((cap, dim), np.float32)
        self.meta = zeros(cap, META)  # steps, and shard version and time (now_ticks) of the last push, pushes
        self._meta_fields()
        self.state = {k: zeros((cap, dim), np.float32) for k in state_init}
        self.extra = {k: zeros(cap, dt) for k, dt in (extra or {}).items()}
        self._high = 0  # slots ever used (past it the arrays are still zeros)
        # Pages made ahead (``_make_ahead``): not for a hot set, whose arrays are its budget's to the byte.
        self._ahead = not sized
        self._map_lock = threading.Lock()  # the arrays' mappings stay where they are while held (no regrow)
        self._ahead_lock = threading.Lock()
        self._made = 0  # slots whose pages are made (below it a row's first write faults nothing)
        self._asked = 0  # slots whose pages are asked for
        self._queued = False  # a step of it is on the page-making thread's list
        self._grew_at = time.monotonic()  # when the last rows arrived
        if self._ahead:
            weakref.finalize(self, budget.ahead_collected, id(self))
        self._make_ahead()

    def _meta_fields(self) -> None:
        """The fields of ``meta`` as arrays of their own (views with a stride of one record), and its records as 6
        int32 and as 3 int64 words (``meta_words``: what ``kernels.touch_rows`` writes a push's metadata through)."""
        self.steps, self.last_version = self.meta["steps"], self.meta["last_version"]
        self.last_time, self.touches = self.meta["last_time"], self.meta["touches"]
        n = self.meta.shape[0]
        self.meta_words = (self.meta.view(np.int32).reshape(n, 6), self.meta.view(np.int64).reshape(n, 3))

    # ---- the index and the budget ------------------------------------------------------

    def _new_index(self, cap: int, probe: int) -> Union[HashIndex, DirectIndex]:
        """An index for ``cap`` rows; a hash index's probe table made for ``probe`` of them (it grows as rows
        arrive)."""
        if self._direct:
            assert self.num_embeddings is not None
            return DirectIndex(self.num_embeddings, cap)
        return HashIndex(cap, probe_rows=probe)

    def _index_bytes(self, probe: int) -> int:
        """Bytes an empty index writes when made: its probe table for ``probe`` rows, or its flat map."""
        return 4 * self.num_embeddings if self._direct else 4 * HashIndex.table_size(probe)  # type: ignore[operator]

    def _direct_index_pays(self, cap: int) -> bool:
        """A flat map costs 4 bytes per id of the whole table, charged when the table is made; use it when that is
        cheap: under 5% of the rows' payload expected here, or at most ``DIRECT_INDEX_BYTES`` and a quarter of that
        payload while the budget has 16 times it left (so maps never take a budget declared tables have not used)."""
        assert self.num_embeddings is not None
        payload = cap * self.dim * 4 * (1 + len(self.state_init))
        nbytes = self.num_embeddings * 4
        return self.num_embeddings < 2**31 and (nbytes <= 0.05 * payload or (
            nbytes <= min(DIRECT_INDEX_BYTES, payload // 4) and 16 * nbytes <= self.budget.limit - self.budget.used))

    def charge(self, nbytes: int, doing: str) -> None:
        self.budget.charge(nbytes, f"{self.name}: {doing}")
        self.charged += nbytes

    def release(self) -> None:
        """Give every byte back to the budget (the table was dropped or replaced), and its pages made ahead."""
        self.budget.release(self.charged)
        self.charged = 0
        self.budget.ahead_gone(id(self))  # (counted again as rows arrive, for a store that loads a snapshot)

    @property
    def row_bytes(self) -> int:
        """Bytes per materialised row: value, optimizer state, step and metadata (the index holds the id)."""
        return self.dim * 4 * (1 + len(self.state)) + META_BYTES_PER_ROW + sum(a.itemsize for a in self.extra.values())

    @property
    def ids(self) -> np.ndarray:
        """Id of each materialised row, in slot order (a view)."""
        return self.index.ids

    # ---- rows in and out ---------------------------------------------------------------

    def reserve(self, extra: int) -> None:
        need = self.n + extra
        cap = self.rows.shape[0]
        if need <= cap:
            return
        new_cap = max(need, min(cap + cap // 2, self.max_rows))
        # In place where nothing else holds them (memory.regrow); meta's field views are dropped first.
        self.steps = self.last_version = self.last_time = self.touches = self.meta_words = None  # type: ignore
        with self._map_lock:
            regrow(self, "rows", new_cap)
            regrow(self, "meta", new_cap)
            self._meta_fields()
            for arrays in (self.state, self.extra):
                for k in arrays:
                    regrow(arrays, k, new_cap)

    def per_row(self) -> list[np.ndarray]:
        """Every array indexed by slot, besides the index (``meta``'s records as rows of three int64 words)."""
        return [self.rows, self.meta.view(np.int64).reshape(self.meta.shape[0], -1), *self.state.values(),
                *self.extra.values()]

    def append(self, new_ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Materialise rows for absent, unique ids; returns their slots."""
        k = new_ids.shape[0]
        if self.n + k > self.max_rows:
            raise ResourceExhausted(f"{self.name}: {self.n + k:,} rows would be over the shard's limit of "
                                    f"{self.max_rows:,} rows per table (--max-table-rows)")
        nbytes = k * (self.row_bytes + self.index_row_bytes)
        if self.budget.take(nbytes):  # (the refusal's message is made only when refused)
            self.charged += nbytes
        else:
            self.charge(nbytes, f"adding {k:,} rows")
        self.reserve(k)
        self.rows[self.n : self.n + k] = values
        used = min(self.n + k, self._high)  # slots below the high-water mark held removed rows: clear them
        if used > self.n:
            for arr in (self.meta, *self.state.values(), *self.extra.values()):
                arr[self.n : used] = 0
        for name, arr in self.state.items():
            init = self.state_init[name]
            if init != 0.0:
                arr[self.n : self.n + k] = init
        slots = self.index.append(new_ids)
        self.n += k
        self._high = max(self._high, self.n)
        self._grew_at = time.monotonic()
        self._make_ahead()
        return slots

    # ---- pages made ahead of the rows ----------------------------------------------------

    def _make_ahead(self) -> None:
        """Ask the page-making thread (``memory.in_background``) for the pages of the next rows, when fewer than half
        of those it should keep ahead are asked for. Measured on this project's 2-core VM, where a page's first write
        costs 1-3 ns a byte (the kernel zeroes it, and the hypervisor backs it): a created row of 64 float32 took 0.6-
        0.8 us of a shard's CPU in the write of its first value, on the request's path."""
        if not self._ahead or not memory.can_populate():
            return
        cap, row_bytes = self.rows.shape[0], self.row_bytes
        window = min(max(cap // 8 - self.n, self.n // 4), AHEAD_BYTES // row_bytes, cap - self.n)
        with self._ahead_lock:
            outstanding = max(0, self._asked - self.n)
            want = window - outstanding if window > 0 and outstanding < window // 2 + 1 else 0
            # (the budget counts this store's pages ahead as they are now, so that others' room follows its rows)
            more = self.budget.ahead(id(self), outstanding * row_bytes, want * row_bytes, row_bytes) // row_bytes
            if more <= 0:
                return
            self._asked = self.n + outstanding + more
            if self._queued:
                return
            self._queued = True
        memory.in_background(functools.partial(_ahead_step, weakref.ref(self)))

    def idle_ahead(self, now: float) -> bool:
        """Pages made ahead of rows that have not come for ``budget.AHEAD_IDLE_S``?"""
        return self._ahead and self._asked > self.n and now - self._grew_at >= AHEAD_IDLE_S

    def give_back_ahead(self, now: float) -> bool:
        """Hand an idle store's pages made ahead back to the OS (``idle_ahead``), and their room to the shard's other
        tables; asked for again when its rows arrive. Caller holds the table's lock (no row arrives meanwhile)."""
        if not self.idle_ahead(now):
            return False
        self.release_from(self.n)
        self.budget.ahead_gone(id(self))  # (no share of the room either, until its rows arrive and it asks again)
        return True

    def _populate(self, start: int, end: int) -> None:
        """Make the pages of slots ``[start, end)`` in every per-row array of a mapping of its own (caller holds
        ``_map_lock``; no view of an array outlives this call)."""
        for arr in self.per_row():
            if memory.owns_pages(arr):
                per = arr.nbytes // arr.shape[0]
                memory.populate(arr.ctypes.data + start * per, (end - start) * per)

    def remove(self, ids: np.ndarray, check: bool = True) -> None:
        """Remove the rows of present, unique ``ids`` with their state and metadata, keeping slots dense.
        ``check=False``: the ids are the table's own victims (present and unique by construction)."""
        k = int(ids.shape[0])
        moves = self.index.remove(ids, check)
        k_ = kernels.jit()
        if moves.size and k_ is not None:
            for arr in self.per_row():  # the moves one after the other, compiled
                k_.apply_moves(arr.reshape(arr.shape[0], -1), moves)
        elif moves.size:
            # Compose the moves (a row may move twice): destination slot -> slot it came from.
            came_from: dict[int, int] = {}
            for frm, to in moves.tolist():
                came_from[to] = came_from.pop(frm, frm)
            left = self.n - k
            pairs = np.array([(t, f) for t, f in came_from.items() if t < left], dtype=np.int64).reshape(-1, 2)
            for arr in self.per_row():
                arr[pairs[:, 0]] = arr[pairs[:, 1]]
        self.n -= k
        freed = min(self.charged, k * (self.row_bytes + self.index_row_bytes))
        self.budget.release(freed)
        self.charged -= freed

    @property
    def high(self) -> int:
        """Slots ever used: past it the arrays are untouched zeros."""
        return self._high

    def release_from(self, slot: int) -> None:
        """Hand the whole pages of every per-row array from ``slot`` on back to the OS; no row lives there (``slot``
        >= ``n``). The high-water mark stays: a slot reused is cleared as any below it (what a page kept is not
        zero)."""
        assert slot >= self.n
        with self._map_lock:
            for arr in self.per_row():
                release_pages(arr, slot)
            self._made = min(self._made, slot)
            with self._ahead_lock:  # (before a step waiting for the map lock could make them again)
                self._asked = min(self._asked, slot)
                if self._ahead:  # (a store that makes none is not counted among those that do)
                    self.budget.ahead(id(self), max(0, self._asked - self.n) * self.row_bytes, 0)

    # ---- copies ------------------------------------------------------------------------

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the live part of every array: ``ids``, ``rows``, ``steps``, ``state.*``, ``meta.*``."""
        n = self.n
        out = {"ids": self.ids[:n].copy(), "rows": self.rows[:n].copy(), "steps": self.steps[:n].copy(),
               "meta.last_version": self.last_version[:n].copy(), "meta.last_time": self.last_time[:n].copy(),
               "meta.touches": self.touches[:n].copy()}
        for k, v in self.state.items():
            out["state." + k] = v[:n].copy()
        return out

    def load(self, arrays: dict[str, np.ndarray], before_index: Callable[[], None] = lambda: None) -> None:
        """Replace the contents with a snapshot's (``before_index`` charges what else the table holds, after the
        old bytes are released; a snapshot written before per-row metadata existed loads with zeros there)."""
        ids = arrays["ids"]
        self.release()
        self.n = 0
        self._high = 0
        cap = max(16, ids.shape[0])
        self.charge(self._index_bytes(cap), "creating the index")
        before_index()
        self.index = self._new_index(cap, cap)
        self.reserve(ids.shape[0])
        slots = self.append(ids, arrays["rows"])
        self.steps[slots] = arrays["steps"]
        for name, arr in (("last_version", self.last_version), ("last_time", self.last_time),
                          ("touches", self.touches)):
            if "meta." + name in arrays:
                arr[slots] = arrays["meta." + name]
        for k in self.state:
            self.state[k][slots] = arrays["state." + k]


def _ahead_step(ref: weakref.ref) -> bool:
    """One step of a store's pages made ahead (``RowStore._make_ahead``), under its ``_map_lock``; False when its
    asked pages are all made (or the store is gone)."""
    store: Optional[RowStore] = ref()
    if store is None:
        return False
    with store._map_lock:
        start = max(store._made, store.n)  # (rows below n are written: their pages are made)
        with store._ahead_lock:
            end = min(store._asked, store.rows.shape[0], start + max(1, AHEAD_STEP_BYTES // store.row_bytes))
            if start >= end:
                store._queued = False
                return False
        try:
            store._populate(start, end)
        except BaseException:
            with store._ahead_lock:  # (the thread drops a step that failed: asked again as rows arrive)
                store._queued = False
            raise
        store._made = end
    return True
