"""Fair shares of a shard among its callers, so one client cannot starve the others.

A shard's handler threads share one interpreter lock, so whoever keeps the most calls
running gets the most of the shard: a client sending the largest requests the limits
allow, back to back from several threads, took 70% of a shard from a training loop
beside it (the loop ran at 0.27x of its speed alone), and one holding every handler
thread in a waiting heartbeat stopped it. Three parts answer that:

- ``FairScheduler``: data-path calls (pulls and pushes, unary or stream frames) start
  in start-time fair queuing order among callers (Goyal et al., 1996). At most ``slots``
  run at once; when more wait, the next to start is the one whose caller has used the
  least service (measured seconds, divided by its weight). A caller alone, or callers
  that never wait for a slot, pay one uncontended lock. A call gives its slot up when
  it starts waiting (a log flush, a synchronous step, a checkpoint's hold), so waiting
  never holds one.
- ``Callers``: per-caller limits on calls in flight and open streams (per token, set in
  the tokens file; per connection without tokens) and on waiting calls, answered
  RESOURCE_EXHAUSTED at once; a caller whose calls keep failing (malformed, refused)
  gets its refusals slowed down, so a flood of bad requests costs the shard little.
- Per connection, gRPC's own HTTP/2 limit on concurrent calls (``--max-calls-per-connection``):
  calls over it wait in the client, never reaching the shard's threads.

A caller is a token (when the shard has a tokens file) or a connection: without tokens,
a client that opens many connections gets a share for each; tokens bound it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from shardps.core.errors import ResourceExhausted

DEFAULT_COST_S = 0.001  # a new caller's first estimate of a call's service time
# What a byte of request or reply costs the shard outside the handler (gRPC's polling thread copies each
# message under the interpreter lock): measured 0.16 ns/byte with 4 MB pushes on the 2-core machine.
BYTE_COST_S = 0.2e-9
USAGE_HALF_LIFE_S = 0.5  # a caller's use of the shard is a moving sum over about this long
BUSY = 0.25  # callers' use, in cores, above which a shard is contended and shares are enforced
OVER_SHARE = 1.25  # a caller using more than this times its share of a contended shard is slowed down
MAX_THROTTLE_S = 0.2
RESCAN_S = 0.05
MAX_TRACKED = 4096  # callers remembered; idle ones are forgotten beyond this (they start level again)
ERROR_HALF_LIFE_S = 1.0
MAX_ERROR_DELAY_S = 0.25
ERROR_BYTES = 64 * 1024  # a refused request counts as one failure per this many bytes (and at least one)


class _Held:
    """The slot the current thread holds: its caller, start time and the cost charged in advance."""

    __slots__ = ("scheduler", "caller", "weight", "started", "estimate")

    def __init__(self, scheduler: FairScheduler, caller: str, weight: float, started: float, estimate: float) -> None:
        self.scheduler, self.caller, self.weight, self.started, self.estimate = scheduler, caller, weight, started, estimate


_local = threading.local()


class FairScheduler:
    """Start-time fair queuing of calls among callers, ``slots`` at once."""

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self._lock = threading.Lock()
        self._running = 0
        self._queue: list[tuple[float, int, threading.Lock]] = []
        self._finish: dict[str, float] = {}  # caller -> finish tag of its last call started
        self._cost: dict[str, float] = {}  # caller -> moving average of its calls' service time
        self._virtual = 0.0  # start tag of the latest call started
        self._seq = itertools.count()
        # Use of the shard: caller -> [moving sum of seconds, when updated, throttle delay in seconds].
        self._usage: dict[str, list[float]] = {}
        self._total = [0.0, 0.0]
        self._shares: dict[str, float] = {}  # while contended: each active caller's allowed moving sum
        self._scanned = 0.0
        self.waited = 0  # calls that queued for a slot (a measure of contention)
        self.throttled = 0  # calls slowed down for a caller over its share

    def _add(self, entry: list[float], amount: float, now: float) -> None:
        entry[0] = entry[0] * 0.5 ** ((now - entry[1]) / USAGE_HALF_LIFE_S) + amount
        entry[1] = now

    def charge(self, caller: str, weight: float, seconds: float, nbytes: int = 0) -> None:
        """Count ``seconds`` of the shard's time and ``nbytes`` of messages against ``caller``'s share."""
        amount = (seconds + nbytes * BYTE_COST_S) / weight
        now = time.monotonic()
        with self._lock:
            entry = self._usage.get(caller)
            if entry is None:
                if len(self._usage) >= MAX_TRACKED:
                    self._usage = {c: e for c, e in self._usage.items() if c in self._shares}
                entry = self._usage[caller] = [0.0, now, 0.0]
            self._add(entry, amount, now)
            self._add(self._total, amount, now)
            if nbytes and caller in self._finish:  # messages count in the fair order too
                self._finish[caller] += nbytes * BYTE_COST_S / weight

    def _rescan(self, now: float) -> None:
        """Every RESCAN_S: is the shard contended (callers' use over BUSY cores, two or more of them
        active), and if so, what share of it each active caller may use."""
        self._scanned = now
        total = self._total[0] * 0.5 ** ((now - self._total[1]) / USAGE_HALF_LIFE_S)
        self._shares = {}
        if total * 0.6931 / USAGE_HALF_LIFE_S < BUSY:
            return
        active = [c for c, e in self._usage.items() if e[0] * 0.5 ** ((now - e[1]) / USAGE_HALF_LIFE_S) > 0.02 * total]
        if len(active) >= 2:
            self._shares = {c: total / len(active) for c in active}

    def _throttle(self, caller: str, now: float) -> float:
        """Seconds the caller's next call waits before it starts: growing while the caller uses more than
        OVER_SHARE times its share of a contended shard, shrinking back to nothing otherwise."""
        if now - self._scanned > RESCAN_S:
            self._rescan(now)
        entry = self._usage.get(caller)
        if entry is None:
            return 0.0
        share = self._shares.get(caller)
        used = entry[0] * 0.5 ** ((now - entry[1]) / USAGE_HALF_LIFE_S)
        if share is not None and used > OVER_SHARE * share:
            entry[2] = min(MAX_THROTTLE_S, max(0.001, entry[2] * 1.5))
            self.throttled += 1
        elif entry[2]:
            entry[2] = entry[2] * 0.5 if entry[2] > 0.0005 else 0.0
        return entry[2]

    def acquire(self, caller: str, weight: float = 1.0) -> None:
        """Wait for a slot in fair order (after a pause if the caller is over its share of a contended
        shard); the current thread holds it until ``release``."""
        with self._lock:
            delay = self._throttle(caller, time.monotonic())
        if delay:
            waiting()
            time.sleep(delay)
        with self._lock:
            estimate = self._cost.get(caller, DEFAULT_COST_S) / weight
            tag = max(self._virtual, self._finish.get(caller, 0.0))
            self._finish[caller] = tag + estimate
            if self._running < self.slots and not self._queue:
                self._running += 1
                self._virtual = max(self._virtual, tag)
                turn = None
            else:
                turn = threading.Lock()
                turn.acquire()
                heapq.heappush(self._queue, (tag, next(self._seq), turn))
                self.waited += 1
        if turn is not None:
            turn.acquire()  # released by the call that hands its slot over
        _local.held = _Held(self, caller, weight, time.perf_counter(), estimate)

    def _release(self, held: _Held) -> None:
        """Give ``held`` to the next caller in fair order, charging its caller the service it used."""
        cost = time.perf_counter() - held.started
        self.charge(held.caller, held.weight, cost)
        with self._lock:
            caller = held.caller
            old = self._cost.get(caller)
            self._cost[caller] = cost if old is None else 0.8 * old + 0.2 * cost
            if caller in self._finish:  # the advance estimate, corrected to the measured cost
                self._finish[caller] += cost / held.weight - held.estimate
            if len(self._finish) > MAX_TRACKED:
                self._forget()
                self._usage = {c: e for c, e in self._usage.items() if c in self._finish}
            if self._queue:
                tag, _, turn = heapq.heappop(self._queue)
                self._virtual = max(self._virtual, tag)
                turn.release()
            else:
                self._running -= 1

    def _forget(self) -> None:
        """Drop callers that are level with the virtual time (they would start level anyway)."""
        for caller in [c for c, f in self._finish.items() if f <= self._virtual]:
            del self._finish[caller]
            self._cost.pop(caller, None)


def release() -> None:
    """Give up the slot the current thread holds, if any (the end of a call)."""
    held: Optional[_Held] = getattr(_local, "held", None)
    if held is not None:
        _local.held = None
        held.scheduler._release(held)


def leave_slot(ordered: bool = True) -> None:
    """The current call is about to wait (a log flush, a synchronous step, a checkpoint's hold): give
    its slot to the next caller now. The call finishes without one (what is left of it is small). ``ordered=False``:
    the call's change is applied and only its acknowledgement waits (a replica group's quorum), so its connection's
    later calls need not wait behind it."""
    release()
    waiting(ordered)


def on_wait(hook: Optional[Callable[[bool], None]]) -> None:
    """What the current thread calls (once) if its call is about to wait; None: nothing. The data plane's
    socket threads set it to hand their socket to another thread, so a call that waits (a synchronous step,
    an fsync, a throttled or refused caller's pause) never holds up the other connections of its socket."""
    _local.on_wait = hook


def waiting(ordered: bool = True) -> None:
    """The current call is about to wait: its thread's ``on_wait`` hook, if one is set, runs (once); ``ordered``: its
    connection's later calls wait behind it (False: they may go first)."""
    hook = getattr(_local, "on_wait", None)
    if hook is not None:
        _local.on_wait = None
        hook(ordered)


@dataclass(frozen=True)
class FairConfig:
    """How a shard shares itself among callers (``shardps serve`` flags in brackets).

    Args:
        slots: data-path calls running at once; more wait their turn in fair order [--fair-slots].
        calls_per_connection: calls one connection may have open at once, gRPC's HTTP/2 limit:
            more wait in the client [--max-calls-per-connection].
        streams_per_connection: call streams one connection may hold open (a client opens one
            per shard) [--max-streams-per-connection].
        waiting_per_connection: heartbeats one connection may have waiting for other workers
            (a worker has one at a time) [--max-waiting-per-connection].
    """

    slots: int = 1
    calls_per_connection: int = 32
    streams_per_connection: int = 4
    waiting_per_connection: int = 4

    def __post_init__(self) -> None:
        for name in ("slots", "calls_per_connection", "streams_per_connection", "waiting_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class _Caller:
    __slots__ = ("calls", "streams", "waiting", "errors", "errors_at")

    def __init__(self) -> None:
        self.calls = self.streams = self.waiting = 0
        self.errors = 0.0
        self.errors_at = 0.0


class Callers:
    """Per-caller counts of calls, streams and waiting calls against their limits, and a decaying count
    of each caller's failed calls that slows down its further refusals."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callers: dict[str, _Caller] = {}

    def _get(self, caller: str) -> _Caller:
        c = self._callers.get(caller)
        if c is None:
            if len(self._callers) >= MAX_TRACKED:
                for k in [k for k, v in self._callers.items() if not (v.calls or v.streams or v.waiting)]:
                    del self._callers[k]
            c = self._callers[caller] = _Caller()
        return c

    def enter(self, kind: str, limits: list[tuple[str, Optional[int]]], what: str) -> list[str]:
        """Count one more ``kind`` (calls, streams, waiting) for each (caller, limit) of ``limits``, or refuse
        it over a limit (None: count without one) and count nothing. Returns the callers, for ``exit``."""
        with self._lock:
            for caller, limit in limits:
                n = getattr(self._get(caller), kind)
                if limit is not None and n >= limit:
                    raise ResourceExhausted(f"{what}: {caller} has {n} {kind} open on this shard, its limit")
            for caller, _ in limits:
                c = self._callers[caller]
                setattr(c, kind, getattr(c, kind) + 1)
        return [caller for caller, _ in limits]

    def exit(self, kind: str, callers: list[str]) -> None:
        with self._lock:
            for caller in callers:
                c = self._callers.get(caller)
                if c is not None:
                    setattr(c, kind, max(0, getattr(c, kind) - 1))

    def failed(self, caller: str, nbytes: int = 0) -> float:
        """Count a failed call of ``nbytes``; the delay (seconds) its refusal should wait: nothing for the
        occasional error, up to MAX_ERROR_DELAY_S for a caller failing many calls (or megabytes) a second."""
        now = time.monotonic()
        with self._lock:
            c = self._get(caller)
            c.errors = c.errors * 0.5 ** ((now - c.errors_at) / ERROR_HALF_LIFE_S) + 1.0 + nbytes / ERROR_BYTES
            c.errors_at = now
            errors = c.errors
        return min(MAX_ERROR_DELAY_S, max(0.0, (errors - 10.0) * 1e-3))
