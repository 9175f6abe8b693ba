"""What bounded tables need besides rows: the admission sketch, the push history of per-row
staleness, and the choice of eviction victims.

All three are deterministic functions of the pushes a table received (no clock, no
global random state), so a log replay makes the same admission choices; evictions,
which may depend on the clock (``ttl_seconds``), are logged instead of re-decided.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

import numpy as np

from shardps.core import kernels
from shardps.core.kernels.constants import VICTIM_DRAWS
from shardps.core.routing import mix64
from shardps.core.specs import Admission, Eviction

_U16_MAX = 65535
_DRAW_SEED = np.uint64(0x5DEECE66D1234567)
_SAMPLE_SEED = np.uint64(0x9E3779B97F4A7C15)
# Evictions are logged with their cause.
CAUSE_TTL, CAUSE_CAPACITY = 1, 2
CAUSE_NAMES = {CAUSE_TTL: "ttl", CAUSE_CAPACITY: "capacity"}


class CountMinSketch:
    """Counts of ids in ``depth`` rows of ``width`` uint16 counters (saturating at 65,535).

    An id's count is the smallest of its ``depth`` counters: never below the truth, and
    above it only when every one of them is shared with other ids. After
    ``AGE_EVERY x width`` additions every counter is halved (TinyLFU's reset), so the
    sketch keeps describing recent traffic and does not fill up under an endless stream.
    """

    AGE_EVERY = 10

    def __init__(self, spec: Admission) -> None:
        self.width, self.depth = spec.sketch_width, spec.sketch_depth
        self.counters = np.zeros((self.depth, self.width), np.uint16)
        base = np.uint64(spec.seed)
        self._seeds = [mix64(np.array([r], np.uint64), base)[0] for r in range(self.depth)]
        self.added = 0  # additions since the last halving

    @property
    def nbytes(self) -> int:
        return int(self.counters.nbytes)

    def _columns(self, ids: np.ndarray) -> list[np.ndarray]:
        w = np.uint64(self.width)
        return [(mix64(ids, seed) % w).astype(np.int64) for seed in self._seeds]

    def add(self, ids: np.ndarray) -> np.ndarray:
        """Count each of the unique ``ids`` once; returns their counts after it."""
        cols = self._columns(ids)
        est = np.full(ids.shape[0], _U16_MAX, np.int64)
        for r, c in enumerate(cols):
            row = self.counters[r]
            uniq, times = np.unique(c, return_counts=True)
            row[uniq] = np.minimum(row[uniq].astype(np.int64) + times, _U16_MAX).astype(np.uint16)
            np.minimum(est, row[c], out=est)
        self.added += ids.shape[0]
        if self.added >= self.AGE_EVERY * self.width:
            self.counters >>= 1
            self.added = 0
        return est

    def estimate(self, ids: np.ndarray) -> np.ndarray:
        est = np.full(ids.shape[0], _U16_MAX, np.int64)
        for r, c in enumerate(self._columns(ids)):
            np.minimum(est, self.counters[r][c], out=est)
        return est

    def admitted(self, ids: np.ndarray, spec: Admission) -> np.ndarray:
        """Count ``ids`` (unique, without rows) once more; which of them are admitted now."""
        counts = self.add(ids)
        ok = counts >= spec.min_count
        if spec.admit_probability < 1.0 and ok.any():
            with np.errstate(over="ignore"):
                words = mix64(ids.astype(np.uint64) ^ (counts.astype(np.uint64) << np.uint64(48)),
                              _DRAW_SEED ^ np.uint64(spec.seed))
            u = (words >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
            ok &= u < spec.admit_probability
        return ok

    def state(self) -> dict[str, np.ndarray]:
        return {"sketch": self.counters.copy(), "sketch_added": np.array([self.added], np.int64)}

    def load(self, arrays: dict[str, np.ndarray]) -> None:
        sketch = arrays.get("sketch")
        if sketch is not None and sketch.shape == self.counters.shape:
            self.counters[...] = sketch
            self.added = int(arrays["sketch_added"][0])


class PushHistory:
    """The ids of a table's recent pushes by version, for per-row staleness: the staleness of
    row r for a push that pulled at version P is the number of remembered pushes after P
    that carried r.

    At most ``max_ids`` ids are remembered; ``forgot`` is the newest version no longer
    remembered (the version the shard started at, after a restart). A push whose pull is
    older than that cannot be measured exactly: its rows updated since then count with the
    shard's staleness, an upper bound.
    """

    def __init__(self, start_version: int = 0, max_ids: int = 1 << 20) -> None:
        self._pushes: deque[tuple[int, np.ndarray]] = deque()
        self._ids = 0
        self.max_ids = max_ids
        self.forgot = start_version

    def add(self, version: int, ids: np.ndarray) -> None:
        """Remember that the push of ``version`` updated the sorted unique ``ids``."""
        self._pushes.append((version, ids.copy()))
        self._ids += ids.shape[0]
        while self._ids > self.max_ids and len(self._pushes) > 1:
            v, old = self._pushes.popleft()
            self._ids -= old.shape[0]
            self.forgot = v

    def since(self, pulled: int, ids: np.ndarray) -> Optional[np.ndarray]:
        """Pushes after version ``pulled`` that carried each of the sorted unique ``ids``; None when
        some of those pushes are forgotten."""
        if pulled < self.forgot:
            return None
        counts = np.zeros(ids.shape[0], np.int64)
        for version, carried in reversed(self._pushes):
            if version <= pulled:
                break
            pos = np.searchsorted(carried, ids)
            pos[pos == carried.shape[0]] = 0
            counts += carried[pos] == ids
        return counts


def choose_victims(spec: Eviction, n: int, count: int, ids: np.ndarray, last_version: np.ndarray,
                   touches: np.ndarray, protected_from: int, salt: int) -> np.ndarray:
    """Slots of ``count`` rows to evict from the ``n`` rows, by the spec's policy.

    Rows whose ``last_version`` is ``protected_from`` or newer (a bounded table: the push being
    applied, its version; a disk tier's hot set: the last few requests) are chosen only when
    nothing else is left. ``sample`` 0: the exact victims (policy order, ties broken by
    id), else ``sampled_victims`` (exactly, should a victim find no row to draw).
    """
    if count <= 0:
        return np.zeros(0, np.int64)
    if count >= n:
        return np.arange(n, dtype=np.int64)
    if spec.sample and spec.sample * count < n:
        k = kernels.jit()
        lfu = spec.policy == "lfu"
        if k is not None:
            chosen = k.sample_victims(last_version[:n], touches[:n], count, spec.sample, np.uint64(salt),
                                      _SAMPLE_SEED, int(protected_from), lfu)
        else:
            chosen = sampled_victims(last_version[:n], touches[:n], count, spec.sample, salt, protected_from, lfu)
        if chosen.shape[0] == count:
            return chosen
    # Exact: every row, by policy, ties by id (also when the sample drew too few old rows).
    cand = np.arange(n, dtype=np.int64)
    lv = last_version[:n]
    protected = (lv >= protected_from).astype(np.int8)
    if spec.policy == "lfu":
        order = np.lexsort((ids[:n], lv, touches[:n], protected))
    else:
        order = np.lexsort((ids[:n], lv, protected))
    return cand[order[:count]]


def sampled_victims(last: np.ndarray, touches: np.ndarray, count: int, sample: int, salt: int, protected_from: int,
                    lfu: bool) -> np.ndarray:
    """``count`` victims among the ``last.shape[0]`` rows, as Redis samples: each the best (lowest score, then
    slot) of ``sample`` usable slots drawn with a hash of ``salt``, usable when ``last`` is below ``protected_from``
    (not of the current request, nor of the last few on a disk tier) nor chosen already; at most ``sample x
    VICTIM_DRAWS`` draws a victim, fewer victims when one found none. Score: LRU the last use (``last``); LFU the
    uses (``touches``, capped at 2^22), then the last (its low 40 bits). The reference of ``kernels``'
    ``sample_victims``, draw for draw (the kernel's is 10-20x cheaper than a sort of a pool of draws in numpy was:
    the victims' choice took 15% of a tiered shard's time)."""
    n = last.shape[0]
    base = np.uint64(salt) << np.uint64(32)  # (a shift: no overflow warning past 2^32 requests)
    chunk = count * sample + 64
    draws: list[int] = []
    chosen: list[int] = []
    taken: set[int] = set()
    d = 0
    for _ in range(count):
        best, best_key, seen = -1, 0, 0
        for _ in range(sample * VICTIM_DRAWS):
            if d == len(draws):  # the next draws, a chunk at a time
                more = np.arange(d, d + chunk, dtype=np.uint64) + base
                draws += (mix64(more, _SAMPLE_SEED) % np.uint64(n)).astype(np.int64).tolist()
            c = draws[d]
            d += 1
            lv = int(last[c])
            if lv >= protected_from or c in taken:
                continue
            key = (min(int(touches[c]), (1 << 22) - 1) << 40) | (lv & ((1 << 40) - 1)) if lfu else lv
            if best < 0 or (key, c) < (best_key, best):
                best, best_key = c, key
            seen += 1
            if seen == sample:
                break
        if best < 0:
            break
        taken.add(best)
        chosen.append(best)
    return np.array(chosen, dtype=np.int64)


def clock_victims(last: np.ndarray, count: int, protected_from: int, now: int, state: np.ndarray) -> np.ndarray:
    """A disk tier's "clock" victims: up to ``count`` rows, in the order a hand going round the ``last.shape[0]``
    rows from ``state[0]`` meets them, each used (``last``) before ``protected_from`` and before ``state[1]``, the
    request at which the hand began its round (the second chance: a row used since is passed over); the hand begins
    a new round at ``now`` as it passes the last row, and looks at each row once at most. ``state`` is left at the
    hand's place and round. The compiled ``clock_victims``, else its reference (``clock_victims_numpy``)."""
    k = kernels.jit()
    if k is not None:
        return k.clock_victims(last, count, protected_from, now, state)
    return clock_victims_numpy(last, count, protected_from, now, state)


def clock_victims_numpy(last: np.ndarray, count: int, protected_from: int, now: int, state: np.ndarray) -> np.ndarray:
    """The reference of ``clock_victims``, victim for victim, in two vectorised passes: the rows from the hand to
    the last one, then (a new round) from the first to where the hand started."""
    n = last.shape[0]
    if count <= 0:
        return np.zeros(0, np.int64)
    hand, lap = int(state[0]), int(state[1])
    if hand >= n:
        hand, lap = 0, now
    start = hand
    first = np.flatnonzero((last[start:] < protected_from) & (last[start:] < lap))[:count] + start
    second = np.zeros(0, np.int64)
    if first.shape[0] == count:
        hand = int(first[-1]) + 1
    else:
        hand, lap = 0, now
        second = np.flatnonzero((last[:start] < protected_from) & (last[:start] < lap))[:count - first.shape[0]]
        hand = int(second[-1]) + 1 if second.shape[0] == count - first.shape[0] else start
    if hand >= n:
        hand, lap = 0, now
    state[0], state[1] = hand, lap
    return np.concatenate([first, second]).astype(np.int64)


class RemovalLog:
    """The ids evicted from a table since an export's last cut, for the next delta's tombstones.

    Kept only while an export follows the shard (``shardps export``; started by the first export of
    the shard), at most ``max_ids`` ids: past that the oldest are forgotten and ``floor`` (the newest
    version whose removals are forgotten) rises, so a delta since an older cut is refused and the
    exporter writes a new base instead.
    """

    def __init__(self, floor: int, max_ids: int = 1 << 23) -> None:
        self._removed: deque[tuple[int, np.ndarray]] = deque()
        self._ids = 0
        self.max_ids = max_ids
        self.floor = floor

    def add(self, version: int, ids: np.ndarray) -> None:
        """Rows of ``ids`` are gone from ``version`` on."""
        self._removed.append((version, ids.copy()))
        self._ids += ids.shape[0]
        while self._ids > self.max_ids and self._removed:
            v, old = self._removed.popleft()
            self._ids -= old.shape[0]
            self.floor = max(self.floor, v)

    def since(self, version: int) -> np.ndarray:
        """Ids removed after ``version`` (unique, sorted)."""
        parts = [ids for v, ids in self._removed if v > version]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

    def trim(self, version: int) -> None:
        """Forget removals at or before ``version`` (an export has them)."""
        while self._removed and self._removed[0][0] <= version:
            self._ids -= self._removed.popleft()[1].shape[0]
