"""Row storage of one table (or dense tensor) on one shard.

A ``Table`` keeps its rows, per-row optimizer state, step counts and metadata in a
``RowStore`` (``storage.rows``: slot-dense arrays, the id index, the memory budget) and
gives them a table's meaning: reads that create rows from the initializer, the optimizer
step, admission, TTL and capacity eviction, per-row staleness and export copies.
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
from typing import Any, Callable, Optional, Union

import numpy as np

from shardps.core import kernels
from shardps.core.errors import InvalidArgument
from shardps.core.ids import coalesce, is_sorted_unique
from shardps.core.optim import RowOptimizer
from shardps.core.specs import DenseSpec, Initializer, TableSpec
from shardps.server.storage import checks, expiry
from shardps.server.storage.bounded import (
    CAUSE_CAPACITY,
    CAUSE_TTL,
    CountMinSketch,
    PushHistory,
    RemovalLog,
)
from shardps.server.storage.budget import MemoryBudget, optional_budget
from shardps.server.storage.disk import DiskTiers
from shardps.server.storage.rows import RowStore
from shardps.server.storage.tiered import HotSet

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


def _stored(name: str) -> Any:
    return property(lambda self: getattr(self.store, name), doc=f"``RowStore.{name}`` (read-only here)")


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
        tiers: the shard's disk tier, where a table whose spec has ``disk`` keeps its cold rows, under ``tier_key``
            (default: its name; a serving shard keys each generation of a table apart).
    """

    # The slot-dense arrays and the index, read through to the store (which replaces arrays as it grows).
    rows = _stored("rows")
    steps = _stored("steps")
    state = _stored("state")
    last_version = _stored("last_version")
    last_time = _stored("last_time")
    touches = _stored("touches")
    index = _stored("index")
    n = _stored("n")
    ids = _stored("ids")

    def __init__(self, spec: Union[TableSpec, DenseSpec], owns: OwnsFn, expected_rows: int = 1024,
                 budget: Optional[MemoryBudget] = None, max_rows: int = 2**31 - 1,
                 tiers: Optional[DiskTiers] = None, tier_key: str = "") -> None:
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
        opt = self.optimizer
        state_init = {k: opt.initial_state(k) for k in opt.state_names()}
        tspec = spec if isinstance(spec, TableSpec) else None
        self.hot: Optional[HotSet] = None  # a table with a disk tier: its hot rows over the store
        if tspec is not None and tspec.disk is not None:
            self.hot = HotSet.make(tspec, self.dim, state_init, self.budget, tiers, tier_key or spec.name)
            self.store = self.hot.rows
        else:
            self.store = RowStore(spec.name, self.dim, state_init, self.num_embeddings, expected_rows, self.budget,
                                  max_rows)
        self.bounded = tspec is not None and tspec.bounded
        self.admission = tspec.admission if tspec is not None else None
        self.eviction = tspec.eviction if tspec is not None else None
        self.sketch: Optional[CountMinSketch] = None
        if self.admission is not None:
            self.store.charge(self.admission.sketch_bytes, "creating the admission sketch")
            self.sketch = CountMinSketch(self.admission)
        self.history: Optional[PushHistory] = PushHistory() if spec.staleness.per_row else None
        self.counts = BoundedCounts()
        self._sweep_at = 0  # the slot the next sweep starts from
        self.created_version = 0  # a delta since an earlier cut copies the whole table (shard.py sets it)
        self.removals: Optional[RemovalLog] = None  # evicted ids, while an export follows (tombstones)
        self.read_only = False  # a serving shard's table: reads never create rows

    # ---- validation (no lock needed) -------------------------------------------------

    def release(self) -> None:
        """Give the table's bytes back to the budget (the table was dropped or replaced), and its disk tier."""
        self.store.release()
        if self.hot is not None:
            self.hot.release()

    def check_ids(self, ids: np.ndarray) -> None:
        """Raise unless ``ids`` is a non-empty 1-D int64 array of in-range ids this shard owns."""
        checks.ids(self.spec.name, "rows" if self.is_dense else "ids", self.num_embeddings, self._owns, ids)

    def check_grads(self, ids: np.ndarray, grads: np.ndarray) -> None:
        """Raise unless ``grads`` has one row of ``dim`` per id and, unless the spec allows them, no NaN or Inf."""
        checks.grads(self.spec.name, self.dim, self.spec.allow_nonfinite, ids, grads)

    # ---- storage ---------------------------------------------------------------------

    def _append(self, new_ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Materialise rows for absent, unique ids; returns their slots."""
        return self.store.append(new_ids, values)

    def _slots(self, ids: np.ndarray, create: bool, stamp: int = 0) -> np.ndarray:
        """Slots of ``ids``, materialising absent ones from the initializer if ``create`` (``stamp``: their
        last change's version, so an export's next delta carries them)."""
        if self.hot is not None:
            return self.hot.slots(ids, create and self.initializer is not None, stamp)
        slots = self.index.lookup(ids)
        missing = slots < 0
        if missing.any():
            if not create or self.initializer is None:
                bad = int(ids[np.argmax(missing)])
                raise InvalidArgument(f"{self.spec.name}: row {bad} is not initialised; register the tensor first")
            new_ids, inverse = ids[missing], None
            if not is_sorted_unique(new_ids):  # (a client's ids, sorted and unique, need no dedup)
                new_ids, inverse = np.unique(new_ids, return_inverse=True)
            new_slots = self._append(new_ids, self.initializer.rows(new_ids, self.dim))
            slots[missing] = new_slots if inverse is None else new_slots[inverse]
            self.last_version[new_slots] = stamp
        return slots

    def read(self, ids: np.ndarray, version: int = 0) -> np.ndarray:
        """Rows of ``ids`` (a copy) at shard version ``version``. Caller holds ``lock``.

        An unbounded table creates absent rows from the initializer; a bounded one (and a serving
        shard's) creates nothing: absent and expired rows read their initial value."""
        if self.hot is not None:
            return self.hot.read(ids, version + 1, create=not self.read_only)
        at = self.read_slots(ids, version)  # first: may grow (replace) self.rows
        if at is not None:
            return np.take(self.rows, at, axis=0)
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

    def read_slots(self, ids: np.ndarray, version: int = 0) -> Optional[np.ndarray]:
        """Where ``read`` would take the rows of ``ids`` from in ``rows`` (absent ones created), for a caller that
        gathers them itself while it holds ``lock`` (a pull's answer, built straight from the table); None for a
        table whose rows are read otherwise (bounded, read-only; a disk tier's request larger than memory)."""
        if self.hot is not None and not self.read_only:
            return self.hot.read_slots(ids, version + 1)
        if self.hot is not None or self.bounded or self.read_only:
            return None
        return self._slots(ids, create=True, stamp=version + 1)

    def check_present(self, ids: np.ndarray) -> None:
        """Raise unless every row of ``ids`` exists or can be made by the initializer (dense rows
        exist once registered with values)."""
        if self.initializer is not None:
            return
        with self.lock:
            self._slots(ids, create=False)

    def _expired(self, slots: np.ndarray, version: int, now: int) -> np.ndarray:
        """Which rows of ``slots`` have not been pushed for longer than the eviction's TTLs."""
        return expiry.expired(self.store, self.eviction, slots, version, now)

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
            ids, grads, slots, row_scales = _bounded_slots(self, ids, grads, row_scales, version, stamp, evict, now, out)
            _step(self, ids, grads, slots, lr_scale, row_scales, stamp, now)
        elif self.hot is not None:  # a table with a disk tier takes a push larger than its memory in parts
            def part_step(part: slice) -> None:
                scales = row_scales[part] if row_scales is not None else None
                _step(self, ids[part], grads[part], self._slots(ids[part], create=True), lr_scale, scales, stamp, now)

            self.hot.in_parts(ids.shape[0], part_step)
        else:
            _step(self, ids, grads, self._slots(ids, create=True), lr_scale, row_scales, stamp, now)
        out.rows = int(ids.shape[0])
        if evict:
            out.over_capacity = self._evict_over_capacity(stamp)
        return out

    def _evict_over_capacity(self, stamp: int) -> np.ndarray:
        """Evict the rows over the eviction's ``max_rows`` (none of the push of ``stamp`` unless it alone is
        larger); their ids, for the log."""
        gone = expiry.capacity_victims(self.store, self.eviction, stamp)
        self.remove(gone, CAUSE_CAPACITY, check=False, version=stamp)
        return gone

    def assign_rows(self, ids: np.ndarray, values: np.ndarray, stamp: int, now: int, evict: bool = True) -> Applied:
        """Set the rows of unique ``ids`` to ``values`` (a loaded state dict), creating absent ones (a bounded
        table admits them: the caller chose them); optimizer state and step counts of existing rows are
        kept, as ``torch.nn.Module.load_state_dict`` leaves an optimizer's. Caller holds ``lock``."""
        if self.hot is not None:
            self.hot.assign(ids, values, stamp, now)
            return Applied(int(ids.shape[0]))
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
        ``version``); see ``expiry.row_staleness``. Caller holds ``lock``."""
        return expiry.row_staleness(self.store, self.history, ids, pulled, version, self.hot is not None)

    def remove(self, ids: np.ndarray, cause: int, check: bool = True, version: int = 0) -> None:
        """Evict the rows of present, unique ``ids`` with their state and metadata. Caller holds ``lock``.
        ``check=False``: the ids are the table's own victims (present and unique by construction).
        ``version``: the shard version from which they are gone (for an export's tombstones)."""
        k = int(ids.shape[0])
        if not k:
            return
        if self.removals is not None:
            self.removals.add(version, ids)
        self.store.remove(ids, check)
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
        return self.store.row_bytes

    def nbytes(self) -> int:
        return self.n * self.row_bytes + self.index.nbytes + (self.sketch.nbytes if self.sketch is not None else 0)

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the live part of every array. Caller holds ``lock``.

        Keys: ``ids``, ``rows``, ``steps``, ``state.*`` and ``meta.*`` hold one entry per row;
        ``table.*`` (the admission sketch) belong to the table as a whole."""
        if self.hot is not None:  # its rows go to the disk tier's checkpoint of the cut (``HotSet.spill``)
            return self.hot.snapshot()
        out = self.store.snapshot()
        if self.sketch is not None:
            out.update({"table." + k: v for k, v in self.sketch.state().items()})
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the contents with a snapshot (rows of ids this shard owns; a snapshot written before
        per-row metadata existed loads with zeros there)."""
        with self.lock:
            if self.hot is None:
                self.store.load(arrays, self._load_sketch(arrays))

    def _load_sketch(self, arrays: dict[str, np.ndarray]) -> Callable[[], None]:
        def load() -> None:
            if self.sketch is not None:
                self.store.charge(self.sketch.nbytes, "creating the admission sketch")
                self.sketch.load({k[len("table."):]: v for k, v in arrays.items() if k.startswith("table.")})
        return load

    def export_copy(self, version: int, since: Optional[int], optimizer_state: bool) -> dict[str, np.ndarray]:
        """Copies for an export at shard version ``version``; see ``expiry.export_arrays``. Caller holds ``lock``."""
        expired = self._expired(np.arange(self.n, dtype=np.int64), version, now_ticks()) if self.expires else None
        return expiry.export_arrays(self.store, expired, self.removals, since, optimizer_state)

    def restart_history(self, version: int) -> None:
        """Forget the push history: pulls before ``version`` (the version restored) count as forgotten."""
        if self.history is not None:
            self.history = PushHistory(start_version=version)


def _bounded_slots(t: Table, ids: np.ndarray, grads: np.ndarray, row_scales: Optional[np.ndarray], version: int,
                   stamp: int, evict: bool, now: int,
                   out: Applied) -> tuple[np.ndarray, np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """A bounded table's push: expired rows of ``ids`` evicted (named in ``out``), absent ids counted and the
    admitted ones created; (ids, grads, slots, row_scales) of the rows the update applies to."""
    slots = t.index.lookup(ids)
    if t.eviction is not None and evict:
        live = np.flatnonzero(slots >= 0)
        expired = live[t._expired(slots[live], version, now)]
        if expired.size:
            out.expired = ids[expired]
            t.remove(out.expired, CAUSE_TTL, check=False, version=stamp)
            slots = t.index.lookup(ids)  # the removal moved rows
    missing = slots < 0
    if not missing.any():
        return ids, grads, slots, row_scales
    keep = np.ones(ids.shape[0], dtype=bool)
    if t.sketch is not None:
        assert t.admission is not None
        where = np.flatnonzero(missing)
        refused = where[~t.sketch.admitted(ids[where], t.admission)]
        keep[refused] = False
        t.counts.rejected += int(refused.size)
    new = missing & keep
    if new.any():
        assert t.initializer is not None
        slots[new] = t._append(ids[new], t.initializer.rows(ids[new], t.dim))
        t.counts.admitted += int(new.sum())
    if keep.all():
        return ids, grads, slots, row_scales
    return ids[keep], grads[keep], slots[keep], row_scales[keep] if row_scales is not None else None


def _step(t: Table, ids: np.ndarray, grads: np.ndarray, slots: np.ndarray, lr_scale: float,
          row_scales: Optional[np.ndarray], stamp: int, now: int) -> None:
    """The optimizer step of ``t.apply`` on the rows of unique ``ids`` at ``slots``, and their metadata."""
    if not ids.size:
        return
    step = t.steps[slots] + 1
    distinct = np.unique(row_scales) if row_scales is not None else None
    if distinct is None or distinct.size == 1:
        scale = lr_scale if distinct is None else float(distinct[0])
        t.optimizer.apply(t.rows, t.state, slots, grads, step, scale)
    else:  # one optimizer call per distinct scale (rows staler by the same count share one)
        for scale in distinct.tolist():
            m = row_scales == scale
            t.optimizer.apply(t.rows, t.state, slots[m], grads[m], step[m], scale)
    k = kernels.jit()
    if k is not None:  # (the four assignments below in one pass: with the read above, 4.4 us against 6.3 for 270 rows)
        k.touch_rows(*t.store.meta_words, slots, step, stamp, max(0, now))
    else:
        t.steps[slots] = step
        t.last_version[slots] = stamp
        t.last_time[slots] = max(0, now)
        t.touches[slots] += 1
    if t.hot is not None:
        t.hot.changed(slots)
    if t.history is not None:
        t.history.add(stamp, ids)
