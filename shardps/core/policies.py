"""A table's policies: what it does with stale pushes (``Staleness``), which new ids get a row
(``Admission``), which rows it drops (``Eviction``), which rows live on disk (``DiskTier``) and how workers' gradients meet in a synchronous step
(``SyncPolicy``). Plain frozen dataclasses that check their arguments; ``shardps.core.specs`` puts them in
a ``TableSpec`` and turns them into protobuf."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union, overload

import numpy as np

from shardps.core.errors import InvalidArgument


@dataclass(frozen=True)
class Staleness:
    """What a table does with stale pushes (staleness s = current - pulled version).

    Args:
        scaling: "none" (lr), "inverse" (lr / (1 + s)) or "linear" (lr / (1 + alpha * s)).
        alpha: the alpha of "linear", e.g. 0.1.
        max_staleness: reject pushes with s above this (None: never reject).
        per_row: measure s per row, as the updates that row received since the pull (exact while the
            shard remembers the pushes since then, see docs/client.md), instead of the updates the whole
            shard received. Scaling and max_staleness then apply row by row.
    """

    scaling: str = "none"
    alpha: float = 0.1
    max_staleness: Optional[int] = None
    per_row: bool = False

    def __post_init__(self) -> None:
        if self.scaling not in ("none", "inverse", "linear"):
            raise InvalidArgument(f"staleness scaling must be none, inverse or linear, got {self.scaling!r}")
        if not (self.alpha >= 0 and math.isfinite(self.alpha)):
            raise InvalidArgument(f"staleness alpha must be finite and >= 0, got {self.alpha}")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise InvalidArgument(f"max_staleness must be >= 0, got {self.max_staleness}")

    @overload
    def lr_scale(self, s: int) -> float: ...

    @overload
    def lr_scale(self, s: np.ndarray) -> Union[float, np.ndarray]: ...

    def lr_scale(self, s: Union[int, np.ndarray]) -> Union[float, np.ndarray]:
        """The learning-rate factor for staleness ``s`` (or, element-wise, for an array of them; "none"
        gives 1.0 for any)."""
        if self.scaling == "inverse":
            return 1.0 / (1.0 + s)
        if self.scaling == "linear":
            return 1.0 / (1.0 + self.alpha * s)
        return 1.0


MAX_SKETCH_COUNTERS = 1 << 28


@dataclass(frozen=True)
class Admission:
    """Which ids of a table get a row (feature admission).

    An id that has no row is counted in a count-min sketch each time a push carries it;
    it is admitted (its row created, the push's gradient applied) once its count reaches
    ``min_count``, and then on each push with chance ``admit_probability`` (a draw
    hashed from (seed, id, count): replay makes the same choice). Until then pulls read
    its initial value and pushes only count it.

    Args:
        min_count: pushes an id must appear in before it may get a row (1: the first).
        admit_probability: chance per push, once counted enough, that the id is admitted.
        sketch_width: counters per hash row (memory: width x depth x 2 bytes).
        sketch_depth: hash rows; a count is over-estimated (never under) when all
            ``depth`` counters of an id are shared with other ids.
        seed: seed of the sketch's hashes and the admission draws.
    """

    min_count: int = 1
    admit_probability: float = 1.0
    sketch_width: int = 1 << 20
    sketch_depth: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_count <= 65535:
            raise InvalidArgument(f"admission min_count must be in [1, 65535], got {self.min_count}")
        if not (0 < self.admit_probability <= 1):
            raise InvalidArgument(f"admission admit_probability must be in (0, 1], got {self.admit_probability}")
        if not 1 <= self.sketch_depth <= 8:
            raise InvalidArgument(f"admission sketch_depth must be in [1, 8], got {self.sketch_depth}")
        if not 64 <= self.sketch_width or self.sketch_width * self.sketch_depth > MAX_SKETCH_COUNTERS:
            raise InvalidArgument(f"admission sketch_width must be >= 64 and width x depth <= {MAX_SKETCH_COUNTERS:,}, "
                                  f"got {self.sketch_width} x {self.sketch_depth}")
        if not 0 <= self.seed < 2**64:
            raise InvalidArgument("admission seed must fit in 64 unsigned bits")

    @property
    def sketch_bytes(self) -> int:
        return self.sketch_width * self.sketch_depth * 2


EVICTION_POLICIES = ("lru", "lfu")
DISK_TIER_POLICIES = ("clock", *EVICTION_POLICIES)


@dataclass(frozen=True)
class Eviction:
    """Which rows of a table are dropped, with their optimizer state (an id that comes back starts
    from its initial value and fresh state).

    Args:
        max_rows: rows per shard; a push that takes the table past it evicts the policy's
            victims (never rows of that push, unless the push alone is larger).
        policy: "lru" (least recently pushed) or "lfu" (fewest pushes; ties: least recently).
        ttl_steps: a row not pushed for this many versions of its shard expires.
        ttl_seconds: a row not pushed for this many seconds expires.
        sample: rows sampled per victim, as Redis does (0: the exact victims over all rows,
            which costs a scan of the table per evicting push).

    An expired row reads as its initial value at once; its memory is reclaimed by the
    shard's sweep (a bounded slice of the table at a time) or by the next push of its id.
    """

    max_rows: Optional[int] = None
    policy: str = "lru"
    ttl_steps: Optional[int] = None
    ttl_seconds: Optional[float] = None
    sample: int = 8

    def __post_init__(self) -> None:
        if self.max_rows is None and self.ttl_steps is None and self.ttl_seconds is None:
            raise InvalidArgument("eviction needs max_rows, ttl_steps or ttl_seconds")
        if self.max_rows is not None and not 1 <= self.max_rows < 2**31:
            raise InvalidArgument(f"eviction max_rows must be in [1, 2^31), got {self.max_rows}")
        if self.policy not in EVICTION_POLICIES:
            raise InvalidArgument(f"eviction policy must be one of {EVICTION_POLICIES}, got {self.policy!r}")
        if self.ttl_steps is not None and not 1 <= self.ttl_steps < 2**62:
            raise InvalidArgument(f"eviction ttl_steps must be >= 1, got {self.ttl_steps}")
        if self.ttl_seconds is not None and not (0 < self.ttl_seconds < 2**31 and math.isfinite(self.ttl_seconds)):
            raise InvalidArgument(f"eviction ttl_seconds must be > 0, got {self.ttl_seconds}")
        if not (self.sample == 0 or 2 <= self.sample <= 1024):
            raise InvalidArgument(f"eviction sample must be 0 (exact) or in [2, 1024], got {self.sample}")


@dataclass(frozen=True)
class DiskTier:
    """Rows beyond RAM: a table's hot rows stay in memory, at most ``memory_mb`` of them on each shard, and
    every other row, with its optimizer state and metadata, in the shard's disk tier (segment files on local disk,
    ``shardps serve --disk-dir``). A pull or push of a cold row brings it back into memory (one batched read
    per request); a row leaving memory is written back first, so nothing a table learned is dropped. The rows of a
    shard's last few requests stay in memory while others can leave (a batch prefetched stays until its push).

    Args:
        memory_mb: RAM for the table's hot rows on each shard, MiB (values, optimizer state, metadata, index).
        policy: which hot rows go back to disk first: "clock" (a hand going round the hot rows takes those not
            pulled or pushed since it began its round: least recently used, nearly, at a few sequential reads a
            victim), "lru" (least recently pulled or pushed, of ``sample`` rows drawn) or "lfu" (fewest pushes;
            ties: least recently used).
        sample: for "lru" and "lfu", rows drawn per victim, as Redis does: each victim the best of them (0: the
            exact victims, a scan of the hot rows per miss).
    """

    memory_mb: float = 256.0
    policy: str = "clock"
    sample: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.memory_mb) and 1 <= self.memory_mb <= 1 << 30):
            raise InvalidArgument(f"disk tier memory_mb must be in [1, 2^30] MiB, got {self.memory_mb}")
        if self.policy not in DISK_TIER_POLICIES:
            raise InvalidArgument(f"disk tier policy must be one of {DISK_TIER_POLICIES}, got {self.policy!r}")
        if not (self.sample == 0 or 2 <= self.sample <= 1024):
            raise InvalidArgument(f"disk tier sample must be 0 (exact) or in [2, 1024], got {self.sample}")


AGGREGATORS = ("mean", "sum", "median", "trimmed_mean")
ON_TIMEOUT = ("wait", "proceed", "fail")


@dataclass(frozen=True)
class SyncPolicy:
    """Synchronous training: one combined update per step from ``workers`` workers.

    Args:
        workers: number of workers (world size) whose pushes make a step.
        aggregator: "mean", "sum", "median" (coordinate-wise) or "trimmed_mean".
        trim_fraction: fraction dropped from each side by "trimmed_mean", in [0, 0.5).
        timeout_s: seconds a step waits for stragglers before ``on_timeout`` applies.
        on_timeout: "wait" (keep waiting, except for workers that left or went
            silent), "proceed" (apply with the pushes received; late pushes are
            dropped and reported) or "fail" (the step fails, nothing is applied).
    """

    workers: int
    aggregator: str = "mean"
    trim_fraction: float = 0.0
    timeout_s: float = 30.0
    on_timeout: str = "wait"

    def __post_init__(self) -> None:
        if not 1 <= self.workers < 2**31:  # (the wire's field is 32 bits; a shard's --max-workers is far lower)
            raise InvalidArgument(f"sync workers must be in [1, 2**31), got {self.workers}")
        if self.aggregator not in AGGREGATORS:
            raise InvalidArgument(f"sync aggregator must be one of {AGGREGATORS}, got {self.aggregator!r}")
        if not 0 <= self.trim_fraction < 0.5:
            raise InvalidArgument(f"sync trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        if not self.timeout_s > 0:
            raise InvalidArgument(f"sync timeout_s must be > 0, got {self.timeout_s}")
        if self.on_timeout not in ON_TIMEOUT:
            raise InvalidArgument(f"sync on_timeout must be one of {ON_TIMEOUT}, got {self.on_timeout!r}")


