"""Row storage of one table (or dense tensor) on one shard.

A ``Table`` owns rows, per-row optimizer state and per-row step counts in
growable numpy arrays, plus an id -> slot index (which also holds each slot's
id). It knows nothing of gRPC or versions: the shard validates ownership and
staleness, the table validates shapes and values, gathers and applies the
optimizer. Every method that reads or writes rows holds the table's lock, so no
pull sees a half-written row.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional, Union

import numpy as np

from shardps.core.errors import InvalidArgument, OutOfRange, ResourceExhausted, WrongShard
from shardps.core.ids import coalesce
from shardps.core.memory import grown, zeros
from shardps.core.optim import RowOptimizer
from shardps.core.specs import DenseSpec, Initializer, TableSpec
from shardps.server.index import DirectIndex, HashIndex
from shardps.server.limits import MemoryBudget, optional_budget

# Ownership test: ids -> boolean mask of the ids this shard owns.
OwnsFn = Callable[[np.ndarray], np.ndarray]


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
        for name, arr in self.state.items():
            init = self.optimizer.initial_state(name)
            if init != 0.0:
                arr[self.n : self.n + k] = init
        self.index.insert(new_ids, slots)
        self.n += k
        return slots

    def _slots(self, ids: np.ndarray, create: bool) -> np.ndarray:
        """Slots of ``ids``, materialising absent ones from the initializer if ``create``."""
        slots = self.index.lookup(ids)
        missing = slots < 0
        if missing.any():
            if not create or self.initializer is None:
                bad = int(ids[np.argmax(missing)])
                raise InvalidArgument(f"{self.spec.name}: row {bad} is not initialised; register the tensor first")
            new_ids, inverse = np.unique(ids[missing], return_inverse=True)
            new_slots = self._append(new_ids, self.initializer.rows(new_ids, self.dim))
            slots[missing] = new_slots[inverse]
        return slots

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows of ``ids`` (a copy), absent ones created from the initializer. Caller holds ``lock``."""
        slots = self._slots(ids, create=True)  # first: creating rows may grow (replace) self.rows
        return np.take(self.rows, slots, axis=0)

    def check_present(self, ids: np.ndarray) -> None:
        """Raise unless every row of ``ids`` exists or can be made by the initializer (dense rows
        exist once registered with values)."""
        if self.initializer is not None:
            return
        with self.lock:
            self._slots(ids, create=False)

    def apply(self, ids: np.ndarray, grads: np.ndarray, lr_scale: float) -> int:
        """Apply one optimizer step to the rows of ``ids`` (duplicates summed). Caller holds ``lock``."""
        uniq, grads = coalesce(ids, grads)
        slots = self._slots(uniq, create=True)
        step = self.steps[slots] + 1
        self.optimizer.apply(self.rows, self.state, slots, grads, step, lr_scale)
        self.steps[slots] = step
        return int(uniq.shape[0])

    def assign(self, ids: np.ndarray, values: np.ndarray) -> bool:
        """Initialise rows of a dense tensor unless already initialised (first writer wins)."""
        with self.lock:
            slots = self.index.lookup(ids)
            if (slots >= 0).all():
                return False
            fresh = slots < 0
            self._append(ids[fresh], values[fresh])
            return True

    # ---- accounting and snapshots ----------------------------------------------------

    @property
    def row_bytes(self) -> int:
        """Bytes per materialised row: value, optimizer state, step (the index holds the id)."""
        return self.dim * 4 * (1 + len(self.state)) + 4

    def nbytes(self) -> int:
        return self.n * self.row_bytes + self.index.nbytes

    def snapshot(self) -> dict[str, np.ndarray]:
        """Copies of the live part of every array. Caller holds ``lock``."""
        out = {"ids": self.ids[: self.n].copy(), "rows": self.rows[: self.n].copy(), "steps": self.steps[: self.n].copy()}
        for k, v in self.state.items():
            out["state." + k] = v[: self.n].copy()
        return out

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        """Replace the contents with a snapshot (rows of ids this shard owns)."""
        with self.lock:
            ids = arrays["ids"]
            self.release()
            self.n = 0
            cap = max(16, ids.shape[0])
            self._charge(self._index_bytes(cap), "creating the index")
            self.index = self._new_index(cap)
            self._reserve(ids.shape[0])
            slots = self._append(ids, arrays["rows"])
            self.steps[slots] = arrays["steps"]
            for k in self.state:
                self.state[k][slots] = arrays["state." + k]
