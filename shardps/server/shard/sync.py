"""Worker membership (heartbeats, SSP clocks) and synchronous steps of one shard.

``SyncCoordinator`` collects the workers' parts of each step of each synchronous
table and, once a step is complete (or its straggler policy says so), combines
them and hands the result to the apply callback it was given (the shard's update
path), so a step is applied, logged and counted like any other update.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from shardps.core.errors import InvalidArgument, ResourceExhausted, SyncStepFailed
from shardps.core.ids import coalesce
from shardps.core.specs import SyncPolicy
from shardps.server.shard.aggregate import combine, stack
from shardps.server.shard.metrics import NO_METRICS, NullMetrics
from shardps.server.storage.table import Table

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    clock: int = 0
    last_seen: float = 0.0
    left: bool = False
    incarnation: int = 0  # the client in this rank now (HeartbeatRequest.incarnation; 0: not told)
    generation: int = 0  # its group's restarts (HeartbeatRequest.generation)


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

    def heartbeat(self, rank: int, world_size: int, clock: int, leaving: bool, incarnation: int = 0,
                  generation: int = 0) -> None:
        """Record a rank's heartbeat. Under its client's incarnation (or none given) its clock only rises and its
        leaving is for good. Another incarnation (another client in the rank) of a later ``generation`` (torchrun
        started the group again: the rank's client is gone) takes the rank at once; of the same generation, once the
        rank's client has left or been silent for ``dead_after_s``: a worker started again is then live again, at its
        own clock. Until then (a second client of a live worker, an old worker's late heartbeat or leaving), and from
        an earlier generation, it changes nothing. A live rank whose client gave none takes the first incarnation
        it is given."""
        self.check_rank(rank, world_size)
        with self.cond:
            w = self._workers.get(rank)
            if w is not None and incarnation and w.incarnation != incarnation and (w.incarnation or w.left):
                if generation < w.generation or generation == w.generation and (
                        leaving or not (w.left or time.monotonic() - w.last_seen > self.dead_after_s)):
                    return
                w.clock, w.left = clock, False
            w = self._seen(rank, world_size)
            if incarnation:
                w.incarnation, w.generation = incarnation, generation
            w.clock = max(w.clock, clock)
            w.left = w.left or leaving
            self.cond.notify_all()

    def touch(self, rank: int, world_size: int) -> None:
        """A synchronous push of ``rank``'s: live now. Not a rank whose client left under its incarnation: a push
        carries none, and a client made again in the rank takes it with its first heartbeat, before any push, so
        this is a late push of the worker that left."""
        self.check_rank(rank, world_size)
        with self.cond:
            w = self._workers.get(rank)
            if w is not None and w.left and w.incarnation:
                return
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
            live: list[int] = []
            gone: list[int] = []
            for r in range(max(self._world_size, max(self._workers, default=-1) + 1)):
                (gone if self.is_gone(r, now) else live).append(r)
            clocks = [self._workers[r].clock if r in self._workers else 0 for r in live]
            return (min(clocks) if clocks else 0), live, gone

    def wait_min_clock(self, target: int, timeout: float, active: Callable[[], bool] = lambda: True) -> None:
        """Block until every live worker's clock is >= target, ``timeout`` passes, or ``active()`` turns
        False (the call was cancelled, or the shard is stopping)."""
        deadline = time.monotonic() + timeout
        while True:
            min_clock, _, _ = self.status()
            left = deadline - time.monotonic()
            if min_clock >= target or left <= 0 or not active():
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



@dataclass(frozen=True)
class SyncPart:
    """Where a push sits in a synchronous step (see SyncPart in the proto)."""

    step: int
    rank: int
    part: int = 0
    parts: int = 1


@dataclass
class StepOutcome:
    """What a worker's part of a step got: the version after the step, or that it came too late."""

    version: int = 0
    late: bool = False
    missing_ranks: list[int] = field(default_factory=list)
    recorded_only: bool = False  # an earlier part of the worker's contribution: recorded, the step not awaited


ApplyStep = Callable[[Table, np.ndarray, np.ndarray], int]  # (table, ids, combined grads) -> version after


def check_sync(t: Table, sync: Optional[SyncPart]) -> None:
    """A push carries a step part exactly when its table is synchronous, and a valid one."""
    policy = t.spec.sync
    if policy is not None and sync is None:
        raise InvalidArgument(f"{t.spec.name} is synchronous: pushes must carry a step and rank")
    if policy is None and sync is not None:
        raise InvalidArgument(f"{t.spec.name} is asynchronous: pushes must not carry a sync step")
    if policy is not None and sync is not None:
        check_part(policy, sync.step, sync.rank, sync.part, sync.parts)


class SyncCoordinator:
    """The synchronous steps of one shard's tables; applies each complete step through ``apply``."""

    def __init__(self, shard_index: int, membership: Membership, apply: ApplyStep,
                 metrics: NullMetrics = NO_METRICS, before_wait: Callable[[], None] = lambda: None) -> None:
        self.metrics = metrics
        self.before_wait = before_wait  # called before a part waits for the step: the scheduler's hook
        self.shard_index = shard_index
        self.membership = membership
        self._apply = apply
        self._cond = threading.Condition()
        self._tables: dict[str, SyncTable] = {}

    def push(self, t: Table, ids: np.ndarray, grads: np.ndarray, part: SyncPart) -> StepOutcome:
        """Add one worker's part of a step.

        The part that completes the worker's contribution returns once the step
        is applied (or failed: SyncStepFailed); earlier parts return once recorded.
        They must: a worker's parts arrive in order on one stream, so a part that
        waited for the step would hold back the worker's remaining parts, and the
        step with them.
        """
        policy = t.spec.sync
        assert policy is not None
        self.membership.touch(part.rank, policy.workers)
        with self._cond:
            st = self._tables.get(t.spec.name)
            if st is None or st.policy != policy:
                st = self._tables[t.spec.name] = SyncTable(policy, t.dim)
            buf = st.add(part.step, part.rank, part.part, part.parts, ids, np.asarray(grads, dtype=np.float32))
            if buf is None:
                return StepOutcome(late=True)
            if part.rank not in buf.complete_ranks():
                return StepOutcome(recorded_only=True)
            waiting_since = time.perf_counter()
            self.before_wait()  # the other workers' parts of the step need a turn
            while not buf.done:
                self._try_finish(t, st, part.step, buf)
                if not buf.done:
                    self._cond.wait(0.05)
        self.metrics.sync_step(time.perf_counter() - waiting_since, len(buf.missing))
        if buf.error:
            raise SyncStepFailed(buf.error)
        return StepOutcome(version=buf.version, missing_ranks=buf.missing)

    def _try_finish(self, t: Table, st: SyncTable, step: int, buf: StepBuffer) -> None:
        """Apply (or fail) a step if every worker is in, or its straggler policy says so. Holds _cond."""
        policy = st.policy
        complete = buf.complete_ranks()
        waiting = [r for r in range(policy.workers) if r not in complete]
        if waiting:
            timed_out = time.monotonic() - buf.started >= policy.timeout_s
            all_gone = all(self.membership.is_gone(r) for r in waiting)
            if timed_out and policy.on_timeout == "fail":
                buf.error = (f"sync step {step} of {t.spec.name} failed: no push from ranks {waiting} "
                             f"within {policy.timeout_s}s")
                st.finish(step, buf)
                self._cond.notify_all()
                return
            proceed = all_gone or (timed_out and policy.on_timeout == "proceed")
            if not (proceed and complete):
                return
            log.warning("shard %d: step %d of %s proceeds without ranks %s", self.shard_index, step, t.spec.name,
                        waiting)
        union, stacked = stack(st.contributions(buf, complete), t.dim)
        combined = combine(stacked, policy.aggregator, policy.trim_fraction)
        buf.version = self._apply(t, union, combined)
        buf.missing = waiting
        st.finish(step, buf)
        self._cond.notify_all()

    def heartbeat(self, rank: int, world_size: int, clock: int, leaving: bool,
                  wait_min_clock: Optional[int] = None, wait_s: float = 0.0,
                  active: Callable[[], bool] = lambda: True, incarnation: int = 0,
                  generation: int = 0) -> tuple[int, list[int], list[int]]:
        """Record a worker's liveness and clock (``Membership.heartbeat``); optionally wait (at most 60 s, while
        ``active()``) for the slowest one."""
        self.membership.heartbeat(rank, world_size, clock, leaving, incarnation, generation)
        if wait_min_clock is not None and wait_s > 0:  # NaN compares False: no wait
            self.membership.wait_min_clock(wait_min_clock, min(wait_s, 60.0), active)
        with self._cond:  # a rank that left may complete a waiting step
            self._cond.notify_all()
        return self.membership.status()
