"""A trainer-side cache of recently pulled rows, with bounded staleness (``Client.cache_table``).

The sparse-parameter counterpart of Angel's PSAgent cache, HugeCTR's embedding
cache and PaddlePaddle's GEO mode, for hot rows: a row pulled at step s is
served from the trainer's memory at steps s .. s+k-1 (so it is at most k-1
steps old), and the gradients it receives meanwhile are summed locally and
pushed as one gradient when its k steps are over (at least every k steps), or
at ``flush()``. The shard's optimizer then applies the sum as one step: for SGD
that is the same update as k separate pushes; for Adagrad and Adam it is the
step of a k-times larger batch of that row.

A step is one pull of the table (``pull``, ``pull_many``, a ``RemoteEmbedding``
forward). A prefetch for the pull ``steps_ahead`` steps later pushes first the
sums of the rows that will have expired by then (they are still served until
they do) and reads only the rows the cache will not serve, so a prefetched step
needs no pull of its own; a row whose sums were pushed after a prefetch read it
is read again at its pull. Rows are kept in generations, one per step, each a sorted id array
with its rows and summed gradients, so lookups are a few ``searchsorted`` calls
and no per-row Python runs. ``max_rows`` bounds the rows held; rows pulled
while the cache is full are not cached (their gradients go out at once, as
without a cache).
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass
class _Generation:
    step: int
    ids: np.ndarray  # sorted, unique
    rows: np.ndarray  # float32 [n, dim]
    grads: np.ndarray  # float32 [n, dim], summed since the pull
    touched: np.ndarray  # bool [n]: has a gradient to push
    flushed: bool = False  # summed gradients pushed ahead of a prefetch: still served, absorbs no more


@dataclass
class CacheStats:
    """Counters of one table's cache (rows, not calls)."""

    hits: int = 0
    misses: int = 0
    rows: int = 0  # rows held (when the copy was taken)
    absorbed: int = 0  # row gradients summed locally instead of pushed
    pushed: int = 0  # summed row gradients pushed when their rows expired or at flush
    not_cached: int = 0  # rows pulled while the cache was full


class RowCache:
    """Rows of one table pulled in its last ``steps`` pulls.

    Args:
        dim: the table's row width.
        steps: k, the steps a pulled row is served for (>= 1).
        max_rows: the most rows held.
    """

    def __init__(self, dim: int, steps: int, max_rows: int) -> None:
        if steps < 1:
            raise ValueError(f"cache steps must be >= 1, got {steps}")
        if max_rows < 1:
            raise ValueError(f"cache max_rows must be >= 1, got {max_rows}")
        self.dim = dim
        self.steps = steps
        self.max_rows = max_rows
        self.step = 0
        self.lock = threading.Lock()
        self._gens: deque[_Generation] = deque()
        self.epoch = 0  # counts pushes of summed gradients
        self._pushed: deque[tuple[int, np.ndarray]] = deque(maxlen=64)  # (epoch, sorted ids) of the last ones
        self._stats = CacheStats()

    @property
    def stats(self) -> CacheStats:
        """A copy of the counters, with the rows held now."""
        with self.lock:
            return dataclasses.replace(self._stats, rows=self.rows_held)

    @property
    def rows_held(self) -> int:
        return sum(g.ids.shape[0] for g in self._gens)

    def advance(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Start a step: generations pulled ``steps`` steps ago expire. Returns their summed gradients
        (ids, grads), to push before this step's pull."""
        with self.lock:
            self.step += 1
            out = []
            while self._gens and self._gens[0].step + self.steps <= self.step:
                g = self._gens.popleft()
                if not g.flushed:
                    out.extend(self._take(g))
            return out

    def flush_expiring(self, steps_ahead: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Before a prefetch for the pull ``steps_ahead`` steps from now: push (return) the summed gradients of
        the rows that will have expired by then, so the prefetch reads them with those updates. They are still
        served until they expire; their later gradients go straight out."""
        with self.lock:
            out = []
            for g in self._gens:
                if not g.flushed and g.step + self.steps <= self.step + steps_ahead:
                    g.flushed = True
                    out.extend(self._take(g))
            return out

    def drain(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Empty the cache; the summed gradients of every row (to push now)."""
        with self.lock:
            out = []
            while self._gens:
                out.extend(self._take(self._gens.popleft()))
            return out

    def _take(self, g: _Generation) -> list[tuple[np.ndarray, np.ndarray]]:
        n = int(g.touched.sum())
        if not n:
            return []
        self._stats.pushed += n
        ids = g.ids[g.touched]
        self.epoch += 1
        self._pushed.append((self.epoch, ids))
        return [(ids, g.grads[g.touched])]

    def pushed_since(self, epoch: int, ids: np.ndarray) -> np.ndarray:
        """Mask of the sorted unique ids whose summed gradients were pushed after ``epoch`` (rows read before
        then lack them)."""
        with self.lock:
            if epoch == self.epoch:
                return np.zeros(ids.shape[0], dtype=bool)
            if not self._pushed or self._pushed[0][0] > epoch + 1:
                return np.ones(ids.shape[0], dtype=bool)  # (older than what is remembered: all of them)
            out = np.zeros(ids.shape[0], dtype=bool)
            for e, pushed in self._pushed:
                if e > epoch:
                    out |= np.isin(ids, pushed, assume_unique=True)
            return out

    def _find(self, ids: np.ndarray) -> list[tuple[_Generation, np.ndarray, np.ndarray]]:
        """(generation, mask over ids, positions in the generation) of the ids each generation holds."""
        out = []
        for g in self._gens:
            n = g.ids.shape[0]
            if not n:
                continue
            pos = np.searchsorted(g.ids, ids)
            pos[pos == n] = n - 1
            found = g.ids[pos] == ids
            if found.any():
                out.append((g, found, pos[found]))
        return out

    def lookup(self, uniq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For sorted unique ids: (mask of the ids held, their rows in the order of the mask's True entries)."""
        with self.lock:
            hit = np.zeros(uniq.shape[0], dtype=bool)
            rows = np.empty((uniq.shape[0], self.dim), dtype=np.float32)
            for g, found, pos in self._find(uniq):
                hit |= found
                rows[found] = g.rows[pos]
            n = int(hit.sum())
            self._stats.hits += n
            self._stats.misses += uniq.shape[0] - n
            return hit, rows[hit]

    def held(self, uniq: np.ndarray) -> np.ndarray:
        """Mask of the sorted unique ids held now and still summing their gradients (not flushed)."""
        with self.lock:
            hit = np.zeros(uniq.shape[0], dtype=bool)
            for g, found, _ in self._find(uniq):
                if not g.flushed:
                    hit |= found
            return hit

    def admit(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep rows pulled at this step (sorted unique ids, none held), as far as ``max_rows`` allows."""
        with self.lock:
            room = self.max_rows - self.rows_held
            if room <= 0 or not ids.shape[0]:
                self._stats.not_cached += ids.shape[0]
                return
            if ids.shape[0] > room:
                self._stats.not_cached += ids.shape[0] - room
                ids, rows = ids[:room], rows[:room]
            n = ids.shape[0]
            self._gens.append(_Generation(self.step, ids.copy(), np.array(rows, dtype=np.float32, copy=True),
                                          np.zeros((n, self.dim), np.float32), np.zeros(n, dtype=bool)))

    def accumulate(self, uniq: np.ndarray, grads: np.ndarray) -> np.ndarray:
        """Sum the gradients of held rows (sorted unique ids) locally; returns the mask of the ids absorbed
        (the others are pushed as usual)."""
        with self.lock:
            absorbed = np.zeros(uniq.shape[0], dtype=bool)
            for g, found, pos in self._find(uniq):
                if g.flushed:
                    continue
                g.grads[pos] += grads[found]
                g.touched[pos] = True
                absorbed |= found
            self._stats.absorbed += int(absorbed.sum())
            return absorbed
