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
forward). Rows are kept in generations, one per step, each a sorted id array
with its rows and summed gradients, so lookups are a few ``searchsorted`` calls
and no per-row Python runs. ``max_rows`` bounds the rows held; rows pulled
while the cache is full are not cached (their gradients go out at once, as
without a cache).
"""

from __future__ import annotations

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


@dataclass
class CacheStats:
    """Counters of one table's cache (rows, not calls)."""

    hits: int = 0
    misses: int = 0
    rows: int = 0  # rows held now
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
        self.stats = CacheStats()

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
                out.extend(self._take(self._gens.popleft()))
            self.stats.rows = self.rows_held
            return out

    def drain(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Empty the cache; the summed gradients of every row (to push now)."""
        with self.lock:
            out = []
            while self._gens:
                out.extend(self._take(self._gens.popleft()))
            self.stats.rows = 0
            return out

    def _take(self, g: _Generation) -> list[tuple[np.ndarray, np.ndarray]]:
        n = int(g.touched.sum())
        if not n:
            return []
        self.stats.pushed += n
        return [(g.ids[g.touched], g.grads[g.touched])]

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
            self.stats.hits += n
            self.stats.misses += uniq.shape[0] - n
            return hit, rows[hit]

    def held(self, uniq: np.ndarray) -> np.ndarray:
        """Mask of the sorted unique ids held now."""
        with self.lock:
            hit = np.zeros(uniq.shape[0], dtype=bool)
            for _, found, _ in self._find(uniq):
                hit |= found
            return hit

    def admit(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep rows pulled at this step (sorted unique ids, none held), as far as ``max_rows`` allows."""
        with self.lock:
            room = self.max_rows - self.rows_held
            if room <= 0 or not ids.shape[0]:
                self.stats.not_cached += ids.shape[0]
                return
            if ids.shape[0] > room:
                self.stats.not_cached += ids.shape[0] - room
                ids, rows = ids[:room], rows[:room]
            n = ids.shape[0]
            self._gens.append(_Generation(self.step, ids.copy(), np.array(rows, dtype=np.float32, copy=True),
                                          np.zeros((n, self.dim), np.float32), np.zeros(n, dtype=bool)))
            self.stats.rows = self.rows_held

    def accumulate(self, uniq: np.ndarray, grads: np.ndarray) -> np.ndarray:
        """Sum the gradients of held rows (sorted unique ids) locally; returns the mask of the ids absorbed
        (the others are pushed as usual)."""
        with self.lock:
            absorbed = np.zeros(uniq.shape[0], dtype=bool)
            for g, found, pos in self._find(uniq):
                g.grads[pos] += grads[found]
                g.touched[pos] = True
                absorbed |= found
            self.stats.absorbed += int(absorbed.sum())
            return absorbed
