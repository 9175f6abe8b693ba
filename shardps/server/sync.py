"""Worker membership (heartbeats, SSP clocks) and synchronous step buffers of one shard."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from shardps.core.errors import InvalidArgument, ResourceExhausted
from shardps.core.ids import coalesce
from shardps.core.specs import SyncPolicy


@dataclass
class _Worker:
    clock: int = 0
    last_seen: float = 0.0
    left: bool = False


class Membership:
    """Which workers of the training group are alive, and their clocks.

    A rank is gone once it said it is leaving, or when nothing was heard from
    it for ``dead_after_s`` (a rank never heard from counts from the moment
    the group was first seen). Ranks and world sizes are below ``max_workers``
    (``status`` walks every rank).
    """

    def __init__(self, dead_after_s: float = 10.0, max_workers: int = 4096) -> None:
        self.dead_after_s = dead_after_s
        self.max_workers = max_workers
        self.cond = threading.Condition()
        self._workers: dict[int, _Worker] = {}
        self._world_size = 0
        self._born = 0.0

    def _seen(self, rank: int, world_size: int = 0) -> _Worker:
        now = time.monotonic()
        if not self._born:
            self._born = now
        if world_size:
            self._world_size = max(self._world_size, world_size)
        w = self._workers.setdefault(rank, _Worker())
        w.last_seen = now
        return w

    def check_rank(self, rank: int, world_size: int) -> None:
        """Refuse a world size over ``max_workers`` and a rank outside it (before anything is recorded)."""
        if world_size > self.max_workers:
            raise ResourceExhausted(f"world_size {world_size:,} is over the shard's limit of {self.max_workers:,} "
                                    "workers (--max-workers)")
        if rank >= (world_size or self.max_workers):
            raise InvalidArgument(f"rank {rank:,} is not in [0, {'world_size ' if world_size else '--max-workers '}"
                                  f"{world_size or self.max_workers:,})")

    def heartbeat(self, rank: int, world_size: int, clock: int, leaving: bool) -> None:
        self.check_rank(rank, world_size)
        with self.cond:
            w = self._seen(rank, world_size)
            w.clock = max(w.clock, clock)
            w.left = w.left or leaving
            self.cond.notify_all()

    def touch(self, rank: int, world_size: int) -> None:
        self.check_rank(rank, world_size)
        with self.cond:
            w = self._seen(rank, world_size)
            w.left = False
            self.cond.notify_all()

    def is_gone(self, rank: int, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        w = self._workers.get(rank)
        if w is None:
            return bool(self._born) and now - self._born > self.dead_after_s
        return w.left or now - w.last_seen > self.dead_after_s

    def status(self) -> tuple[int, list[int], list[int]]:
        """(min clock of live ranks, live ranks, gone ranks); unseen live ranks have clock 0."""
        with self.cond:
            now = time.monotonic()
            live, gone = [], []
            for r in range(max(self._world_size, max(self._workers, default=-1) + 1)):
                (gone if self.is_gone(r, now) else live).append(r)
            clocks = [self._workers[r].clock if r in self._workers else 0 for r in live]
            return (min(clocks) if clocks else 0), live, gone

    def wait_min_clock(self, target: int, timeout: float) -> None:
        """Block until every live worker's clock is >= target, or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            min_clock, _, _ = self.status()
            left = deadline - time.monotonic()
            if min_clock >= target or left <= 0:
                return
            with self.cond:
                self.cond.wait(min(left, 0.1))


def check_part(policy: SyncPolicy, step: int, rank: int, part: int, parts: int) -> None:
    """Refuse a step part that names a rank outside the table's workers or an impossible part."""
    if rank >= policy.workers:
        raise InvalidArgument(f"rank {rank} is not in [0, {policy.workers}) workers of this synchronous table")
    if step < 1 or parts < 1 or part >= parts:
        raise InvalidArgument(f"bad sync part: step {step}, part {part} of {parts}")


@dataclass
class StepBuffer:
    """The pushes received for one step of one synchronous table."""

    started: float = field(default_factory=time.monotonic)
    parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    expected_parts: dict[int, int] = field(default_factory=dict)
    done: bool = False
    error: Optional[str] = None
    missing: list[int] = field(default_factory=list)
    version: int = 0

    def complete_ranks(self) -> list[int]:
        return sorted(r for r, n in self.expected_parts.items() if len(self.parts.get(r, ())) >= n)


class SyncTable:
    """Step buffers of one synchronous table or dense tensor on one shard."""

    def __init__(self, policy: SyncPolicy, dim: int) -> None:
        self.policy = policy
        self.dim = dim
        self.finalized_upto = 0  # steps <= this are applied or failed, except those still in buffers
        self.buffers: dict[int, StepBuffer] = {}
        self.finished: dict[int, StepBuffer] = {}

    def add(self, step: int, rank: int, part: int, parts: int, ids: np.ndarray, grads: np.ndarray) -> Optional[StepBuffer]:
        """Record one part; None if the step is already finalized (a late push)."""
        check_part(self.policy, step, rank, part, parts)
        if step in self.finished or (step <= self.finalized_upto and step not in self.buffers):
            return None
        buf = self.buffers.setdefault(step, StepBuffer())
        if buf.expected_parts.setdefault(rank, parts) != parts:
            raise InvalidArgument(f"rank {rank} announced {buf.expected_parts[rank]} parts for step {step}, now {parts}")
        buf.parts.setdefault(rank, []).append((ids, grads))
        return buf

    def contributions(self, buf: StepBuffer, ranks: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for r in ranks:
            pieces = [p for p in buf.parts.get(r, []) if p[0].size]
            if not pieces:
                out.append((np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)))
                continue
            out.append(coalesce(np.concatenate([p[0] for p in pieces]), np.concatenate([p[1] for p in pieces])))
        return out

    def finish(self, step: int, buf: StepBuffer) -> None:
        buf.done = True
        self.buffers.pop(step, None)
        self.finished[step] = buf
        self.finalized_upto = max(self.finalized_upto, step)
        for old in [s for s in self.finished if s < step - 64]:
            del self.finished[old]

