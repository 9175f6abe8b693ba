"""Row storage of one table (or dense tensor) on one shard.

A ``Table`` owns rows, per-row optimizer state, per-row step counts and per-row
metadata (version and time of the last push, pushes) in growable numpy arrays,
plus an id -> slot index (which also holds each slot's id). Slots stay dense:
an evicted row's slot takes the last row, with everything that belongs to it.
A bounded table (admission or eviction in its spec) adds an admission sketch and
eviction; a table with per-row staleness remembers its recent pushes. It knows nothing of gRPC or versions: the shard validates ownership and
staleness, the table validates shapes and values, gathers and applies the
optimizer. Every method that reads or writes rows holds the table's lock, so no
pull sees a half-written row.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import numpy as np

from shardps.core import kernels
from shardps.core.errors import InvalidArgument, OutOfRange, ResourceExhausted, WrongShard
from shardps.core.ids import coalesce
from shardps.core.memory import grown, zeros
from shardps.core.optim import RowOptimizer
from shardps.core.specs import DenseSpec, Initializer, TableSpec
from shardps.server.storage.bounded import (
    CAUSE_CAPACITY,
    CAUSE_TTL,
    CountMinSketch,
    PushHistory,
    RemovalLog,
    choose_victims,
)
from shardps.server.storage.budget import MemoryBudget, optional_budget
from shardps.server.storage.index import DirectIndex, HashIndex

# Ownership test: ids -> boolean mask of the ids this shard owns.
OwnsFn = Callable[[np.ndarray], np.ndarray]

TIME_EPOCH = 1735689600  # 2025-01-01: last push times are kept as uint32 tenths of a second since then


def now_ticks() -> int:
    """The current time in the unit of ``Table.last_time``."""
    return int((time.time() - TIME_EPOCH) * 10)


@dataclass
class Applied:
    """What ``Table.apply`` did: rows updated, and the ids it evicted (logged by the caller)."""

    rows: int
    expired: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # before the update
    over_capacity: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # after it


@dataclass
class BoundedCounts:
    """Admission and eviction counters of a table since the shard started."""

    admitted: int = 0
    rejected: int = 0
    evicted_ttl: int = 0
    evicted_capacity: int = 0


class Table:
    """Rows and optimizer state of one table on one shard.

    Args:
        spec: the table or dense-tensor spec.
        owns: returns, for an id array, which ids this shard owns.
        expected_rows: rows this shard is expected to hold (sizes the arrays, up to
            INITIAL_ROWS; they grow beyond it as rows arrive and stay lazily allocated by the OS).
        budget: the shard's memory budget, charged before any row or index is allocated
            (None: unlimited).
        max_rows: rows this table may hold on this shard.
    """

    INITIAL_ROWS = 1 << 20  # what a declared size may reserve before any row arrives
    INDEX_BYTES_PER_ROW = 24  # the slot's id (8) and its share of the probe table (up to 16)
    META_BYTES_PER_ROW = 16  # last push's version (8) and time (4), pushes (4)

    def __init__(self, spec: Union[TableSpec, DenseSpec], owns: OwnsFn, expected_rows: int = 1024,
                 budget: Optional[MemoryBudget] = None, max_rows: int = 2**31 - 1) -> None:
        self.spec = spec
        self.lock = threading.Lock()
        self._owns = owns
        self.is_dense = isinstance(spec, DenseSpec)
        self.dim = spec.cols if isinstance(spec, DenseSpec) else spec.dim
        self.num_embeddings: Optional[int] = spec.rows if isinstance(spec, DenseSpec) else spec.num_embeddings
        self.optimizer: RowOptimizer = spec.optimizer
        self.initializer: Optional[Initializer] = None if isinstance(spec, DenseSpec) else spec.initializer
        self.budget = optional_budget(budget)
        self.max_rows = max_rows
        self.charged = 0  # bytes of the budget this table holds
        self._direct = self.num_embeddings is not None and self._direct_index_pays(max(16, int(expected_rows)))
        cap = max(16, min(int(expected_rows), self.INITIAL_ROWS))
        self._charge(self._index_bytes(cap), "creating the index")
        self.index = self._new_index(cap)
        self.n = 0
        self.rows = zeros((cap, self.dim), np.float32)
        self.steps = zeros(cap, np.int32)
        self.state = {name: zeros((cap, self.dim), np.float32) for name in self.optimizer.state_names()}
        # Per-row metadata: shard version and time (now_ticks) of the last push, and pushes.
        self.last_version = zeros(cap, np.int64)
        self.last_time = zeros(cap, np.uint32)
        self.touches = zeros(cap, np.int32)
        tspec = spec if isinstance(spec, TableSpec) else None
        self.bounded = tspec is not None and tspec.bounded
        self.admission = tspec.admission if tspec is not None else None
        self.eviction = tspec.eviction if tspec is not None else None
        self.sketch: Optional[CountMinSketch] = None
        if self.admission is not None:
            self._charge(self.admission.sketch_bytes, "creating the admission sketch")
            self.sketch = CountMinSketch(self.admission)
        self.history: Optional[PushHistory] = PushHistory() if spec.staleness.per_row else None
        self.counts = BoundedCounts()
        self._sweep_at = 0  # the slot the next sweep starts from
        self._high = 0  # slots ever used (past it the arrays are still zeros)
        self.created_version = 0  # a delta since an earlier cut copies the whole table (shard.py sets it)
        self.removals: Optional[RemovalLog] = None  # evicted ids, while an export follows (tombstones)
        self.read_only = False  # a serving shard's table: reads never create rows

    # ---- validation (no lock needed) -------------------------------------------------

    def _new_index(self, cap: int) -> Union[HashIndex, DirectIndex]:
        if self._direct:
            assert self.num_embeddings is not None
            return DirectIndex(self.num_embeddings, cap)
        return HashIndex(cap)

    def _index_bytes(self, cap: int) -> int:
        """Bytes an empty index of ``cap`` rows writes when made (its probe table or flat map)."""
        return 4 * self.num_embeddings if self._direct else 4 * HashIndex.table_size(cap)  # type: ignore[operator]

    def _charge(self, nbytes: int, doing: str) -> None:
        self.budget.charge(nbytes, f"{self.spec.name}: {doing}")
        self.charged += nbytes

    def release(self) -> None:
        """Give the table's bytes back to the budget (the table was dropped or replaced)."""
        self.budget.release(self.charged)
        self.charged = 0

    def _direct_index_pays(self, cap: int) -> bool:
        """A flat map costs 4 bytes per id of the whole table; use it when that is cheap."""
        assert self.num_embeddings is not None
        row_bytes = self.dim * 4 * (1 + len(self.optimizer.state_names()))
        return self.num_embeddings < 2**31 and self.num_embeddings * 4 <= 0.05 * cap * row_bytes

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise unless ``ids`` is a non-empty 1-D int64 array of in-range ids this shard owns."""
        what = "rows" if self.is_dense else "ids"
        if ids.ndim != 1:
            raise InvalidArgument(f"{self.spec.name}: {what} must be 1-D, got shape {list(ids.shape)}")
        if ids.shape[0] == 0:
            raise InvalidArgument(f"{self.spec.name}: request has no {what}")
        if self.num_embeddings is not None:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= self.num_embeddings:
                bad = lo if lo < 0 else hi
                raise OutOfRange(
                    f"{self.spec.name}: id {bad} out of range [0, {self.num_embeddings})"
                )
        owned = self._owns(ids)
        if not owned.all():
            bad = int(ids[np.argmin(owned)])
            raise WrongShard(f"{self.spec.name}: id {bad} is not owned by this shard")

    def check_grads(self, ids: np.ndarray, grads: np.ndarray) -> None:
        if grads.shape != (ids.shape[0], self.dim):
            raise InvalidArgument(
                f"{self.spec.name}: grads must have shape [{ids.shape[0]}, {self.dim}] (ids x dim), got {list(grads.shape)}"
            )
        if not self.spec.allow_nonfinite and not np.isfinite(grads).all():
            raise InvalidArgument(f"{self.spec.name}: gradient contains NaN or Inf; push rejected")

    # ---- storage ---------------------------------------------------------------------

    def _reserve(self, extra: int) -> None:
        need = self.n + extra
        cap = self.rows.shape[0]
        if need <= cap:
            return
        new_cap = max(need, cap + cap // 2)
        self.rows = grown(self.rows, new_cap)
        self.steps = grown(self.steps, new_cap)
        self.state = {k: grown(v, new_cap) for k, v in self.state.items()}
        self.last_version = grown(self.last_version, new_cap)
        self.last_time = grown(self.last_time, new_cap)
        self.touches = grown(self.touches, new_cap)

    def _per_row(self) -> list[np.ndarray]:
        """Every array indexed by slot, besides the index."""
        return [self.rows, self.steps, self.last_version, self.last_time, self.touches, *self.state.values()]

    @property
    def ids(self) -> np.ndarray:
        """Id of each materialised row, in slot order (a view)."""
        return self.index.ids

    def _append(self, new_ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Materialise rows for absent, unique ids; returns their slots."""
        k = new_ids.shape[0]
        if self.n + k > self.max_rows:
            raise ResourceExhausted(f"{self.spec.name}: {self.n + k:,} rows would be over the shard's limit of "
                                    f"{self.max_rows:,} rows per table (--max-table-rows)")
        self._charge(k * (self.row_bytes + self.INDEX_BYTES_PER_ROW), f"adding {k:,} rows")
        self._reserve(k)
        slots = np.arange(self.n, self.n + k, dtype=np.int64)
        self.rows[self.n : self.n + k] = values
        used = min(self.n + k, self._high)  # slots below the high-water mark held evicted rows: clear them
        if used > self.n:
            for arr in (self.steps, self.last_version, self.last_time, self.touches, *self.state.values()):
                arr[self.n : used] = 0
        for name, arr in self.state.items():
            init = self.optimizer.initial_state(name)
            if init != 0.0:
                arr[self.n : self.n + k] = init
        self.index.insert(new_ids, slots)
        self.n += k
        self._high = max(self._high, self.n)
        return slots

    def _slots(self, ids: np.ndarray, create: bool, stamp: int = 0) -> np.ndarray:
        """Slots of ``ids``, materialising absent ones from the initializer if ``create`` (``stamp``: their
        last change's version, so an export's next delta carries them)."""
        slots = self.index.lookup(ids)
        missing = slots < 0
        if missing.any():
            if not create or self.initializer is None:
                bad = int(ids[np.argmax(missing)])
                raise InvalidArgument(f"{self.spec.name}: row {bad} is not initialised; register the tensor first")
            new_ids, inverse = np.unique(ids[missing], return_inverse=True)
            new_slots = self._append(new_ids, self.initializer.rows(new_ids, self.dim))
            self.last_version[new_slots] = stamp
            slots[missing] = new_slots[inverse]
        return slots

    def read(self, ids: np.ndarray, version: int = 0) -> np.ndarray:
        """Rows of ``ids`` (a copy) at shard version ``version``. Caller holds ``lock``.

        An unbounded table creates absent rows from the initializer; a bounded one (and a serving
        shard's) creates nothing: absent and expired rows read their initial value."""
        if not self.bounded and not self.read_only:
            slots = self._slots(ids, create=True, stamp=version + 1)  # first: may grow (replace) self.rows
            return np.take(self.rows, slots, axis=0)
        slots = self.index.lookup(ids)
        live = slots >= 0
        if self.eviction is not None and not self.read_only and live.any():
            live[live] = ~self._expired(slots[live], version, now_ticks())
        out = np.take(self.rows, np.where(live, slots, 0), axis=0)
        if not live.all():
            if self.initializer is None:
                bad = int(ids[np.argmin(live)])
                raise InvalidArgument(f"{self.spec.name}: row {bad} is not initialised")
            out[~live] = self.initializer.rows(ids[~live], self.dim)
        return out

    def check_present(self, ids: np.ndarray) -> None:
        """Raise unless every row of ``ids`` exists or can be made by the initializer (dense rows
        exist once registered with values)."""
        if self.initializer is not None:
            return
        with self.lock:
            self._slots(ids, create=False)

    def _expired(self, slots: np.ndarray, version: int, now: int) -> np.ndarray:
        """Which rows of ``slots`` have not been pushed for longer than the eviction's TTLs."""
        e = self.eviction
        out = np.zeros(slots.shape[0], dtype=bool)
        if e is None:
            return out
        if e.ttl_steps is not None:
            out |= self.last_version[slots] < version - e.ttl_steps
        if e.ttl_seconds is not None:
            out |= self.last_time[slots].astype(np.int64) < now - int(round(e.ttl_seconds * 10))
        return out

    def apply(self, ids: np.ndarray, grads: np.ndarray, lr_scale: float = 1.0, row_scales: Optional[np.ndarray] = None,
              version: int = 0, stamp: int = 0, evict: bool = True, now: Optional[int] = None) -> Applied:
        """One optimizer step on the rows of ``ids`` (duplicates summed). Caller holds ``lock``.

        ``lr_scale`` (or ``row_scales``, one per unique id in id order) scales the learning rate; ``version`` is the
        shard's version before this push, ``stamp`` the one it will have after (kept as each row's
        last push). A bounded table counts absent ids and creates the admitted ones; the others
        are left out of the update. With ``evict`` (not during log replay, which applies the logged
        evictions instead) expired rows of ``ids`` are evicted first, and rows over ``max_rows``
        after: ``Applied`` names them, for the log."""
        out = Applied(0)
        ids, grads = coalesce(ids, grads)
        now = now_ticks() if now is None else now
        if self.bounded:
            slots = self.index.lookup(ids)
            if self.eviction is not None and evict:
                live = np.flatnonzero(slots >= 0)
                expired = live[self._expired(slots[live], version, now)]
                if expired.size:
                    out.expired = ids[expired]
                    self.remove(out.expired, CAUSE_TTL, check=False, version=stamp)
                    slots = self.index.lookup(ids)  # the removal moved rows
            missing = slots < 0
            if missing.any():
                keep = np.ones(ids.shape[0], dtype=bool)
                if self.sketch is not None:
                    assert self.admission is not None
                    where = np.flatnonzero(missing)
                    refused = where[~self.sketch.admitted(ids[where], self.admission)]
                    keep[refused] = False
                    self.counts.rejected += int(refused.size)
                new = missing & keep
                if new.any():
                    assert self.initializer is not None
                    slots[new] = self._append(ids[new], self.initializer.rows(ids[new], self.dim))
                    self.counts.admitted += int(new.sum())
                if not keep.all():
                    ids, grads, slots = ids[keep], grads[keep], slots[keep]
                    row_scales = row_scales[keep] if row_scales is not None else None
        else:
            slots = self._slots(ids, create=True)
        if ids.size:
            step = self.steps[slots] + 1
            distinct = np.unique(row_scales) if row_scales is not None else None
            if distinct is None or distinct.size == 1:
                scale = lr_scale if distinct is None else float(distinct[0])
                self.optimizer.apply(self.rows, self.state, slots, grads, step, scale)
            else:  # one optimizer call per distinct scale (rows staler by the same count share one)
                for scale in distinct.tolist():
                    m = row_scales == scale
                    self.optimizer.apply(self.rows, self.state, slots[m], grads[m], step[m], scale)
            self.steps[slots] = step
            self.last_version[slots] = stamp
            self.last_time[slots] = max(0, now)
            self.touches[slots] += 1
            if self.history is not None:
                self.history.add(stamp, ids)
        out.rows = int(ids.shape[0])
        if evict:
            out.over_capacity = self._evict_over_capacity(stamp)
        return out

    def _evict_over_capacity(self, stamp: int) -> np.ndarray:
        """Evict the rows over the eviction's ``max_rows`` (none of the push of ``stamp`` unless it alone is
        larger); their ids, for the log."""
        e = self.eviction
        if e is None or e.max_rows is None or self.n <= e.max_rows:
            return np.zeros(0, np.int64)
        n = self.n
        victims = choose_victims(e, n, n - e.max_rows, self.ids, self.last_version[:n], self.touches[:n],
                                 stamp, salt=stamp)
        gone = self.ids[victims].copy()
        self.remove(gone, CAUSE_CAPACITY, check=False, version=stamp)
        return gone

    def assign_rows(self, ids: np.ndarray, values: np.ndarray, stamp: int, now: int, evict: bool = True) -> Applied:
        """Set the rows of unique ``ids`` to ``values`` (a loaded state dict), creating absent ones (a bounded
        table admits them: the caller chose them); optimizer state and step counts of existing rows are
        kept, as ``torch.nn.Module.load_state_dict`` leaves an optimizer's. Caller holds ``lock``."""
        slots = self.index.lookup(ids)
        missing = slots < 0
        if missing.any():
            slots[missing] = self._append(ids[missing], values[missing])
            if self.bounded:
                self.counts.admitted += int(missing.sum())
        self.rows[slots] = values
        self.last_version[slots] = stamp
        self.last_time[slots] = max(0, now)
        out = Applied(int(ids.shape[0]))
        if evict:
            out.over_capacity = self._evict_over_capacity(stamp)
        return out

    def row_staleness(self, ids: np.ndarray, pulled: int, version: int) -> np.ndarray:
        """Per-row staleness of a push of the sorted unique ``ids`` pulled at ``pulled`` (shard now at
        ``version``): the pushes since ``pulled`` that updated each row, or the shard's staleness for
        rows updated since then when the history no longer covers it. Caller holds ``lock``."""
        out = np.zeros(ids.shape[0], np.int64)
        slots = self.index.lookup(ids)
        present = np.flatnonzero(slots >= 0)
        touched = present[self.last_version[slots[present]] > pulled]
        if touched.size:
            assert self.history is not None
            since = self.history.since(pulled, ids[touched])
            out[touched] = since if since is not None else max(0, version - pulled)
        return out

    def remove(self, ids: np.ndarray, cause: int, check: bool = True, version: int = 0) -> None:
        """Evict the rows of present, unique ``ids`` with their state and metadata. Caller holds ``lock``.
        ``check=False``: the ids are the table's own victims (present and unique by construction).
        ``version``: the shard version from which they are gone (for an export's tombstones)."""
        k = int(ids.shape[0])
        if not k:
            return
        if self.removals is not None:
            self.removals.add(version, ids)
        moves = self.index.remove(ids, check)
        k_ = kernels.jit()
        if moves.size and k_ is not None:
            for arr in self._per_row():  # the moves one after the other, compiled
                k_.apply_moves(arr.reshape(arr.shape[0], -1), moves)
        elif moves.size:
            # Compose the moves (a row may move twice): destination slot -> slot it came from.
            came_from: dict[int, int] = {}
            for frm, to in moves.tolist():
                came_from[to] = came_from.pop(frm, frm)
            left = self.n - k
            pairs = np.array([(t, f) for t, f in came_from.items() if t < left], dtype=np.int64).reshape(-1, 2)
            for arr in self._per_row():
                arr[pairs[:, 0]] = arr[pairs[:, 1]]
        self.n -= k
        freed = min(self.charged, k * (self.row_bytes + self.INDEX_BYTES_PER_ROW))
        self.budget.release(freed)
        self.charged -= freed
        if cause == CAUSE_TTL:
            self.counts.evicted_ttl += k
        elif cause == CAUSE_CAPACITY:
            self.counts.evicted_capacity += k

    @property
    def expires(self) -> bool:
        """Whether rows of this table expire (a TTL in its eviction policy)."""
        e = self.eviction
        return e is not None and (e.ttl_steps is not None or e.ttl_seconds is not None)

    def sweep(self, version: int, max_slots: int) -> np.ndarray:
        """Evict the expired rows among the next ``max_slots`` slots (a slice of the table per call, so
        no call holds the lock for long); returns their ids, for the log. Caller holds ``lock``."""
        if not self.expires or self.n == 0:
            return np.zeros(0, np.int64)
        start = self._sweep_at if self._sweep_at < self.n else 0
        end = min(self.n, start + max_slots)
        slots = np.arange(start, end, dtype=np.int64)
        ids = self.ids[slots[self._expired(slots, version, now_ticks())]].copy()
        self.remove(ids, CAUSE_TTL, check=False, version=version + 1)
        self._sweep_at = end - ids.shape[0]
        return ids

    def assign(self, ids: np.ndarray, values: np.ndarray, stamp: int = 0) -> bool:
        """Initialise rows of a dense tensor unless already initialised (first writer wins); ``stamp`` is
        their last change's version (an export's next delta copies them)."""
        with self.lock:
            slots = self.index.lookup(ids)
            if (slots >= 0).all():
                return False
            fresh = slots < 0
            self.last_version[self._append(ids[fresh], values[fresh])] = stamp
            return True

    # ---- accounting and snapshots ----------------------------------------------------

    @property
    def row_bytes(self) -> int:
        """Bytes per materialised row: value, optimizer state, step and metadata (the index holds the id)."""
        return self.dim * 4 * (1 + len(self.state)) + 4 + self.META_BYTES_PER_ROW

    def nbytes(self) -> int:
        return self.n * self.row_bytes + self.index.nbytes + (self.sketch.nbytes if self.sketch is not None else 0)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the live part of every array. Caller holds ``lock``.

        Keys: ``ids``, ``rows``, ``steps``, ``state.*`` and ``meta.*`` hold one entry per row;
        ``table.*`` (the admission sketch) belong to the table as a whole."""
        n = self.n
        out = {"ids": self.ids[:n].copy(), "rows": self.rows[:n].copy(), "steps": self.steps[:n].copy(),
               "meta.last_version": self.last_version[:n].copy(), "meta.last_time": self.last_time[:n].copy(),
               "meta.touches": self.touches[:n].copy()}
        for k, v in self.state.items():
            out["state." + k] = v[:n].copy()
        if self.sketch is not None:
            out.update({"table." + k: v for k, v in self.sketch.state().items()})
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the contents with a snapshot (rows of ids this shard owns; a snapshot written before
        per-row metadata existed loads with zeros there)."""
        with self.lock:
            ids = arrays["ids"]
            self.release()
            self.n = 0
            self._high = 0
            cap = max(16, ids.shape[0])
            self._charge(self._index_bytes(cap), "creating the index")
            if self.sketch is not None:
                self._charge(self.sketch.nbytes, "creating the admission sketch")
                self.sketch.load({k[len("table."):]: v for k, v in arrays.items() if k.startswith("table.")})
            self.index = self._new_index(cap)
            self._reserve(ids.shape[0])
            slots = self._append(ids, arrays["rows"])
            self.steps[slots] = arrays["steps"]
            for name, arr in (("last_version", self.last_version), ("last_time", self.last_time),
                              ("touches", self.touches)):
                if "meta." + name in arrays:
                    arr[slots] = arrays["meta." + name]
            for k in self.state:
                self.state[k][slots] = arrays["state." + k]

    def export_copy(self, version: int, since: Optional[int], optimizer_state: bool) -> dict[str, np.ndarray]:
        """Copies for an export at shard version ``version``. Caller holds ``lock``.

        ``since`` None: every live row (a base). Otherwise the rows changed after version ``since`` and,
        as ``tombstones``, the ids removed since then or expired now (they read as their initial value).
        Expired rows are left out either way; ``steps`` and ``state.*`` only with ``optimizer_state``."""
        n = self.n
        keep = np.ones(n, dtype=bool) if since is None else self.last_version[:n] > since
        expired = self._expired(np.arange(n, dtype=np.int64), version, now_ticks()) if self.expires else None
        if expired is not None:
            keep &= ~expired
        take: Union[slice, np.ndarray] = slice(0, n) if keep.all() else np.flatnonzero(keep)  # a slice: a memcpy
        out = {"ids": self.ids[take].copy(), "values": self.rows[take].copy()}
        if optimizer_state:
            out["steps"] = self.steps[take].astype(np.int64)
            out.update({"state." + k: v[take].copy() for k, v in self.state.items()})
        if since is not None:
            gone = [self.removals.since(since)] if self.removals is not None else []
            if expired is not None:
                gone.append(self.ids[:n][expired])
            out["tombstones"] = np.unique(np.concatenate(gone)) if gone else np.zeros(0, np.int64)
        return out

    def restart_history(self, version: int) -> None:
        """Forget the push history: pulls before ``version`` (the version restored) count as forgotten."""
        if self.history is not None:
            self.history = PushHistory(start_version=version)
