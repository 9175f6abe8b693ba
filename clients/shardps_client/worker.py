"""The worker clock: this worker's rank, liveness heartbeats, SSP clock and waits, barrier, sync steps.

Every wait has a deadline: ``barrier(timeout)`` and the bounded-staleness wait
before a pull (``ssp_wait``, at most ``SSP_WAIT_S``) raise ShardTimeoutError
instead of blocking for ever behind a worker that neither advances nor leaves.
"""

from __future__ import annotations

import logging
import operator
import os
import threading
import time
from typing import Any, Callable, Optional

from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import InvalidArgumentError, ShardpsError, ShardTimeoutError, ShardUnavailableError
from shardps_client.transport import Transport

log = logging.getLogger(__name__)

SSP_WAIT_S = 600.0  # longest wait of a pull for slow workers under ssp_bound (as barrier's default)
# A worker without ssp_bound tells the shards its clock from its heartbeat thread: within this long of a step
# (whether more steps follow or not), besides the liveness heartbeats. Nothing of its own waits on it, and a
# heartbeat per step was a gRPC call per shard per step (about 100 a second per shard in the DLRM example; at 0.1 s
# the example still ran 6% slower than at 0.5 s). A worker under ssp_bound reports every step; one without it,
# in a group whose other workers use SSP or call barrier, makes them wait up to this much longer for its clock.
CLOCK_REPORT_S = 0.5


def env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgumentError(f"environment variable {name}={raw!r} is not an integer") from None


class WorkerClock:
    """One worker's place in the training group, as the shards see it through heartbeats."""

    def __init__(self, transport: Transport, shards: Callable[[], list[int]], rank: Optional[int],
                 world_size: Optional[int], ssp_bound: Optional[int], submit: Callable[[Callable[[], Any]], Any]) -> None:
        self._transport = transport
        self._shards = shards  # the shards heartbeats go to: those of the cluster now
        self._submit = submit  # runs a heartbeat in the background (the client's pool)
        self.rank = rank if rank is not None else env_int("RANK")
        self.world_size = world_size if world_size is not None else env_int("WORLD_SIZE")
        if self.rank is not None and self.world_size is not None and not 0 <= self.rank < self.world_size:
            raise InvalidArgumentError(f"rank {self.rank} is not in [0, world_size {self.world_size})")
        if ssp_bound is not None and (ssp_bound < 0 or self.rank is None):
            raise InvalidArgumentError("ssp_bound needs a rank (RANK or rank=) and must be >= 0")
        self.ssp_bound = ssp_bound
        self.clock = 0
        self.min_clock = 0
        self._sync_steps: dict[str, int] = {}
        self._reported = 0  # the clock the last heartbeat carried
        # This client's own number in its rank (HeartbeatRequest.incarnation): a worker started again in the rank
        # (torchrun's restart) is live again at its own clock, and the old one's late leaving cannot remove it.
        self.incarnation = int.from_bytes(os.urandom(8), "little") >> 1 or 1
        # Its group's restarts (torchrun's, HeartbeatRequest.generation): the rank passes to a later one at once.
        self.generation = env_int("TORCHELASTIC_RESTART_COUNT") or 0
        if not 0 <= self.generation < 2**32:
            raise InvalidArgumentError(f"TORCHELASTIC_RESTART_COUNT={self.generation} is not a restart count")
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self, period: float) -> None:
        """Announce this worker and send heartbeats every ``period`` seconds (when its rank is known)."""
        if self.rank is None:
            return
        try:
            self.heartbeat()
        except ShardpsError as e:
            # A shard refused it (a world size over its --max-workers, a token): the shards that took it hear at once
            # that this worker left, where they would count it live until it timed out. Its incarnation is its own,
            # so a worker started again in the rank is live again there. Not after a shard that did not answer: its
            # retries took the caller's retry_timeout once already.
            if not isinstance(e, (ShardUnavailableError, ShardTimeoutError)):
                try:
                    self.heartbeat(leaving=True)
                except ShardpsError as again:
                    log.debug("leaving heartbeat after a refused one: %s", again)
            raise
        self._thread = threading.Thread(target=self._loop, args=(period,), name="shardps-heartbeat", daemon=True)
        self._thread.start()

    def heartbeat(self, leaving: bool = False, wait_min_clock: Optional[int] = None, wait_s: float = 0.0) -> None:
        clock = self.clock
        req = pb.HeartbeatRequest(rank=self.rank or 0, world_size=self.world_size or 0, clock=clock,
                                  leaving=leaving, wait_s=wait_s, incarnation=self.incarnation,
                                  generation=self.generation)
        if wait_min_clock is not None:
            req.wait_min_clock = wait_min_clock
        replies = self._transport.fan_out([(s, "Heartbeat", req) for s in self._shards()])
        self.min_clock = min(r.min_clock for r in replies)
        self._reported = max(self._reported, clock)

    def _loop(self, period: float) -> None:
        """A liveness heartbeat every ``period``; without ssp_bound, also one within ``CLOCK_REPORT_S`` of a step
        whose clock the shards have not heard."""
        tick = period if self.ssp_bound is not None else min(period, CLOCK_REPORT_S)
        due = time.monotonic() + period
        while not self._stop.wait(tick):
            now = time.monotonic()
            if now < due - tick / 10 and self.clock == self._reported:  # (a wait may end a hair early)
                continue
            due = now + period
            try:
                self.heartbeat()
            except ShardpsError as e:
                log.debug("heartbeat failed: %s", e)

    def advance(self, steps: int = 1) -> int:
        """End of a training step (or of ``steps``): the clock goes up and the shards hear of it in the background:
        at once under ssp_bound, else from the heartbeat thread within ``CLOCK_REPORT_S`` (one call for all the steps
        since)."""
        try:
            n = operator.index(steps)  # (an int, numpy's or torch's; 0: a checkpoint of step 0)
        except TypeError:
            n = -1
        if isinstance(steps, bool) or n < 0:
            raise InvalidArgumentError(f"steps must be an integer >= 0, got {steps!r}")
        self.clock += n
        if self.rank is not None and self.ssp_bound is not None:
            self._submit(self.heartbeat)
        return self.clock

    def wait_until(self, target: int, timeout: float, what: str) -> None:
        """Wait until every live worker's clock is at least ``target``; ShardTimeoutError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while self.min_clock < target and not self._stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShardTimeoutError(f"{what}: workers still below clock {target} after {timeout}s")
            self.heartbeat(wait_min_clock=target, wait_s=min(1.0, left))

    def barrier(self, timeout: float) -> None:
        if self.rank is None:
            raise InvalidArgumentError("barrier needs a rank (RANK/WORLD_SIZE or Client(rank=...))")
        self.heartbeat()
        self.wait_until(self.clock, timeout, "barrier")

    def ssp_wait(self) -> None:
        """Bounded staleness: wait while this worker is more than ssp_bound steps ahead of the slowest."""
        if self.ssp_bound is not None and self.clock - self.min_clock > self.ssp_bound:
            self.wait_until(self.clock - self.ssp_bound, SSP_WAIT_S, f"ssp_bound {self.ssp_bound}")

    def next_sync_step(self, key: str) -> int:
        """The step number of this worker's next push to synchronous ``key``."""
        if self.rank is None:
            raise InvalidArgumentError(
                f"{key} is synchronous: the client needs its rank (RANK/WORLD_SIZE as set by torchrun, or Client(rank=...))"
            )
        self._sync_steps[key] = self._sync_steps.get(key, 0) + 1
        return self._sync_steps[key]

    def stop(self) -> None:
        """Stop the heartbeats and tell the shards this worker left."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            try:
                self.heartbeat(leaving=True)
            except ShardpsError as e:
                log.debug("leaving heartbeat failed: %s", e)
