"""The push pipeline: what happens to a push between ``Client.push`` and the shard's answer.

``PushPipeline`` owns, under its own lock, the pushes queued while a ``PushHold``
is held (sent together as one PushBatch per shard), the pushes in flight (at most
``max_inflight`` calls; by table, so a pull can wait for its table's), the first
error of pushes nobody waits on (raised by ``flush``), reports of synchronous
steps that did not include every worker, and dense values returned with pushes
(``DensePull``). A push a shard refuses because its slots moved (``SlotMovedError``:
``shardps reshard``) is planned again by the refreshed slot map and sent where its
rows are now (``replan``), before the caller hears of it: it was not applied, so it
applies once. Its dense pulls do not come back (their ``DensePull`` fails). A push the
shard answers UNAVAILABLE (its replica group's quorum not reached in time, say) is sent
again as it was, same sequence numbers, for up to the client's ``retry_timeout``: applied
once, or answered as a duplicate once the shard has it acknowledged.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional

import torch

from shardps.core import codec
from shardps.core.specs import DenseSpec
from shardps.v1 import shardps_pb2 as pb
from shardps_client import planner
from shardps_client.errors import (
    ShardpsError,
    ShardRemovedError,
    SlotMovedError,
    TableChangedError,
    answered_unavailable,
)
from shardps_client.transport import Transport

log = logging.getLogger(__name__)


# Pushes (calls) that wait for the next pull (``trail``) before they are sent anyway: a loop that pushes many times
# without pulling keeps at most this many in this process.
MAX_TRAILING = 64
# Longest a step's dense values wait for the prefetch that is to carry its pushes (its task in the client's pool)
# before the pushes go without it.
CARRY_WAIT_S = 1.0


class _LeftOut(Exception):
    """A shard answered a step's pushes without the dense values asked with them (a chunk of them moved)."""


class DensePull:
    """Dense values coming back with a step's pushes (``Client.send_pushes(pull_dense=...)``).

    ``result()`` waits for the pushes that carry them and returns what
    ``pull_dense_many`` returns; it raises the error of a push that failed.
    """

    def __init__(self, specs: dict[str, DenseSpec], num_shards: int, wrap: Callable[[dict[int, int]], Any],
                 again: Optional[Callable[[list[str]], dict[str, tuple[torch.Tensor, Any]]]] = None,
                 forget: Callable[[str], None] = lambda name: None) -> None:
        self.specs = specs
        self._forget = forget  # the client forgets a spec its values came back at odds with (TableChangedError)
        self._again = again  # pulls the tensors anew (``pull_dense_many``) when a shard left its part out
        self.requests: list[list[bytes]] = [[] for _ in range(num_shards)]  # framed, per shard
        self.sent = False  # its calls are out (``futures`` set)
        self.send: Optional[Callable[[], Any]] = None  # sends it while parked
        self.carry: Optional[threading.Event] = None  # set once a prefetch that would carry it has sent its calls
        self.pieces: list[list[tuple[str, int, int]]] = [[] for _ in range(num_shards)]  # (name, rows) per request
        self.futures: dict[int, Future] = {}
        self._wrap = wrap  # versions by shard -> the client's Versions

    def done(self) -> bool:
        """True once every shard has answered (``result()`` will not wait)."""
        return self.sent and all(f.done() for f in self.futures.values())

    def result(self) -> dict[str, tuple[torch.Tensor, Any]]:
        if not self.sent and self.send is not None:  # parked with its pushes (``PushPipeline.park``)
            carry = self.carry  # a prefetch on its way to carry them: they go with it (its pool task sends them)
            if carry is None or not carry.wait(CARRY_WAIT_S) or not self.sent:
                self.send()
        try:
            values = planner.assemble_dense(self.specs, self._blocks())
        except _LeftOut:  # a chunk moved to another shard while the step's pushes waited there: pulled anew
            assert self._again is not None
            return self._again(list(self.specs))
        except TableChangedError as e:
            self._forget(e.table)
            raise
        return {name: (value, self._wrap(versions)) for name, (value, versions) in values.items()}

    def _blocks(self) -> Iterator[tuple]:
        for s, f in self.futures.items():
            answer_here(f)
            replies = list(f.result().pulled_dense)
            if not replies and self.pieces[s] and self._again is not None:
                raise _LeftOut  # the shard's part moved (live resharding) before the pushes it came with were done
            if len(replies) != len(self.pieces[s]):
                raise ShardpsError(f"shard {s} answered {len(replies)} of {len(self.pieces[s])} dense pulls sent "
                                   "with its pushes (a server without PushBatch.pull_dense?)")
            for (name, a, b), r in zip(self.pieces[s], replies):
                yield s, name, a, b, codec.decode(r.rows, f"{name}: rows"), r.version  # (checked by assemble_dense)


class PushHold:
    """While held, this client's asynchronous pushes queue up until ``send``: one PushBatch per shard.

    ``ShardedOptimizer`` holds one for its life, so a step's pushes (embedding rows
    from backward hooks, dense gradients) go out together at ``step()``. Its hold is a
    ``step`` hold: the row pushes made while it is held are one optimizer step, each
    table's rows' gradients summed before they go (``held_step``).
    """

    def __init__(self, pipeline: PushPipeline, send: Callable[..., Optional[DensePull]], step: bool = False) -> None:
        self._pipeline = pipeline
        self._send = send
        self.held = True
        self.step = step

    def send(self, pull_dense: tuple[str, ...] | list[str] = (), park: bool = False) -> Optional[DensePull]:
        """Send the queued pushes (see ``Client.send_pushes``)."""
        return self._send(pull_dense, park)

    def release(self) -> None:
        """Stop holding (queued pushes are sent by the next push, pull or flush)."""
        if self.held:
            self.held = False
            self._pipeline._release(self.step)


class _StepParking:
    """``PushPipeline``'s parking of a step's queued pushes for the prefetch that follows it, whose row pulls travel in
    the same PushBatch per shard (``park``, ``expect_carry``, ``carry``): a pipelined step costs a shard one call."""

    _order: threading.RLock
    _lock: threading.Lock
    _transport: Transport
    _max_message_bytes: int
    _deferred: list[tuple[str, list[planner.Call]]]
    # A step's parked: [its DensePull or None], or None when nothing is parked.
    _parked: Optional[list[Optional[DensePull]]]
    # Whether a prefetch carried the last step parked (or came since): steps park only then. A loop without a
    # ``Prefetcher`` sends its steps' pushes at once after its first, as it would without parking.
    _carrier: bool
    # Plans a held step's row pushes into the queue (``Session.plan_held``), before anything takes the queue.
    before_send: Callable[[], None]

    def send(self, returning: Optional[DensePull] = None) -> Optional[DensePull]:
        raise NotImplementedError  # (PushPipeline's)

    def _submit(self, work: list[tuple[list[str], planner.Call]], wait: bool,
                carrying: Optional[set[int]] = None) -> list[Future]:
        raise NotImplementedError  # (PushPipeline's)

    def park(self, returning: Optional[DensePull]) -> Optional[DensePull]:
        """Keep a step's queued pushes (and ``returning``'s dense pulls) for the next prefetch to carry in the same
        message per shard (``carry``): a step then costs a shard one call, not two. Anything that needs them out
        first sends them: ``returning.result()``, a pull that must see them, another push sent, ``flush``."""
        self.before_send()
        with self._order:
            if self._parked is not None:
                self.send()  # (an earlier step's, that nothing carried)
            if not self._carrier:
                return self.send(returning)
            with self._lock:
                self._parked = [returning]
        if returning is not None:
            returning.send = self.send
        return returning

    def expect_carry(self) -> Optional[threading.Event]:
        """A prefetch is about to carry the parked pushes (``carry``, from the client's pool): an event it sets once
        its calls are out, which the parked step's dense values wait for rather than sending the pushes alone. None
        when nothing is parked (a step then parks for the next prefetch)."""
        with self._lock:
            self._carrier = True
            if self._parked is None:
                return None
            event = threading.Event()
            if self._parked[0] is not None:
                self._parked[0].carry = event
            return event

    def carry(self, carried: list[list[bytes]]) -> Optional[dict[int, Future]]:
        """Send the parked pushes with ``carried`` row pulls (framed PushBatchRequest.pulls entries, per shard) in
        each shard's last batch, read there once the pushes are applied: the futures of the calls that carry them,
        by shard. None when nothing is parked (the caller pulls as it would)."""
        self.before_send()
        with self._order:
            self._carrier = True  # a prefetch came: the next step parks for the one after it
            if self._parked is None:
                return None
            deferred, parked = self._take()
            return self._send_batches(deferred, parked, carried)

    def _take(self) -> tuple[list[tuple[str, list[planner.Call]]], Optional[DensePull]]:
        """The queued pushes and a parked step's dense pulls, taken (caller holds ``_order``)."""
        with self._lock:
            deferred, self._deferred = self._deferred, []
            parked, self._parked = self._parked, None
        return deferred, parked[0] if parked is not None else None

    def _send_batches(self, deferred: list[tuple[str, list[planner.Call]]], returning: Optional[DensePull],
                      carried: Optional[list[list[bytes]]]) -> dict[int, Future]:
        """One PushBatch per shard (or a few) of ``deferred``, carrying ``returning``'s dense pulls and ``carried``
        row pulls: the futures of the calls that carry pulls, by shard."""
        if not deferred and returning is None and not carried:
            return {}
        work, carries = planner.push_batches(deferred, len(self._transport.addresses), self._max_message_bytes,
                                             returning.requests if returning is not None else None, carried)
        futures = self._submit(work, wait=False, carrying=set(carries.values()) if carried else set())
        if returning is not None:
            returning.futures = {s: futures[i] for s, i in carries.items() if returning.requests[s]}
            returning.sent = True
        return {s: futures[i] for s, i in carries.items()}


class PushPipeline(_StepParking):
    """Queued and in-flight pushes of one client (see the module docstring)."""

    MAX_REROUTES = 16  # a push planned again this many times (slots moving under it each time) fails

    def __init__(self, transport: Transport, num_shards: int, max_message_bytes: int, max_inflight: int) -> None:
        self._transport = transport
        self._max_message_bytes = max_message_bytes
        self._lock = threading.Lock()
        # Held while calls are handed to the lanes: a client's pushes reach each shard in the order they were made,
        # also when a prefetch's thread sends those that waited for its pull (``send_trailing``).
        self._order = threading.RLock()
        self._holds = 0
        self._step_holds = 0  # of them, holds whose pushes are one optimizer step (``PushHold.step``)
        self._deferred: list[tuple[str, list[planner.Call]]] = []
        self._parked: Optional[list[Optional[DensePull]]] = None
        self._carrier = True
        self.before_send: Callable[[], None] = lambda: None
        self.held_rows: Callable[[], bool] = lambda: False  # whether a held step's row pushes wait to be planned
        self._pending: dict[str, set[Future]] = {}
        self._errors: list[BaseException] = []
        self._inflight = threading.BoundedSemaphore(max_inflight)
        #: (table, step, missing ranks, late) of synchronous steps that did not include every worker.
        self.sync_reports: collections.deque = collections.deque(maxlen=1000)
        #: A refused push call planned again by a refreshed slot map (the session's ``replan``); runs off the lanes'
        #: threads (``run_async``: the client's pool).
        self.replan: Optional[Callable[[planner.Call, Optional[list[int]], bool], list[planner.Call]]] = None
        self.run_async: Callable[..., Any] = lambda fn, *args: threading.Thread(target=fn, args=args,
                                                                                daemon=True).start()

    # ---- holding -----------------------------------------------------------------------

    def hold(self, send: Callable[..., Optional[DensePull]], step: bool = False) -> PushHold:
        with self._lock:
            self._holds += 1
            self._step_holds += step
        return PushHold(self, send, step)

    def _release(self, step: bool = False) -> None:
        with self._lock:
            self._holds -= 1
            self._step_holds -= step

    @property
    def summing(self) -> bool:
        """A step hold is held: row pushes wait, unplanned, to be summed per table (``Session.push_rows``)."""
        return self._step_holds > 0

    @property
    def holding(self) -> bool:
        return self._holds > 0

    @property
    def has_queued(self) -> bool:
        return bool(self._deferred) or self._parked is not None or self.held_rows()

    @property
    def parked(self) -> bool:
        return self._parked is not None

    # ---- sending -----------------------------------------------------------------------

    def dispatch(self, key: str, calls: list[planner.Call], wait: bool, trail: bool = False) -> None:
        """Send (or, while held, queue) the framed push calls of one table or dense tensor; with ``trail`` (a
        client without read-your-writes, a table without synchronous steps) they wait for the next pull
        (``send_trailing``)."""
        self.dispatch_many([(key, calls)], wait, trail)

    def dispatch_many(self, calls: list[tuple[str, list[planner.Call]]], wait: bool, trail: bool = False) -> None:
        """``dispatch`` of several tables' calls (key, calls) at once, in that order."""
        queued = False
        with self._lock:
            if (self._holds or trail) and not wait:
                self._deferred.extend(calls)
                if self._holds or sum(len(cs) for _, cs in self._deferred) <= MAX_TRAILING:
                    return
                queued = True  # too many trailing: sent now, with the others
        with self._order:
            if self._deferred or self.held_rows():
                self.send()  # keep this client's pushes in order (a held step's rows, planned first)
            if queued:
                return
            futures = self._submit([([key], call) for key, cs in calls for call in cs], wait)
        if wait:
            self._await(futures)

    def send_trailing(self) -> None:
        """A pull's calls are out: send the pushes that waited for it (none while a ``PushHold`` is held: those
        go at its ``send``). The shards serve the pull first and apply the pushes while its answer travels and
        the trainer computes: their apply is off the step's path."""
        if self._deferred and not self._holds:
            self.send()

    def send(self, returning: Optional[DensePull] = None) -> Optional[DensePull]:
        """Send the queued pushes, with ``returning``'s dense pulls carried by each shard's last batch (and those of
        a step parked before, with its pushes)."""
        self.before_send()
        with self._order:
            deferred, parked = self._take()
            if parked is not None:
                self._carrier = False  # nothing carried it: the next step's pushes go at once
            if parked is not None and returning is not None:  # the parked step's values with its pushes, first
                self._send_batches(deferred, parked, None)
                deferred = []
            self._send_batches(deferred, returning if returning is not None else parked, None)
        return returning

    def _submit(self, work: list[tuple[list[str], planner.Call]], wait: bool,
                carrying: Optional[set[int]] = None) -> list[Future]:
        """Send each call on its shard's lane; ``keys`` are the tables (in entry order) it carries. The futures are
        the pushes' outcomes (after any re-sending where slots moved); ``wait``: the caller waits for them
        (``_await``), their errors are its own, not ``flush()``'s."""
        futures = []
        for k, (keys, call) in enumerate(work):
            f: Future = Future()
            f.waited = wait  # type: ignore[attr-defined]  # errors of waited pushes go to the caller, not flush()
            f.keys = keys  # type: ignore[attr-defined]
            f.answer_slot = carrying is not None and k in carrying  # type: ignore[attr-defined]  # (carries pulls)
            with self._lock:
                for key in set(keys):
                    self._pending.setdefault(key, set()).add(f)
            f.add_done_callback(self._done)
            self._send(f, call, 0)
            futures.append(f)
        return futures

    @staticmethod
    def _await(futures: list[Future]) -> None:
        """Wait for pushes sent with ``wait`` (raising the first one's error)."""
        for f in futures:
            answer_here(f)
            f.result()

    def _send(self, outer: Future, call: planner.Call, attempt: int, since: Optional[float] = None) -> None:
        """``call`` on its lane (an in-flight slot taken until it is answered), its outcome ``outer``'s; ``since``:
        when the shard first answered it UNAVAILABLE (a resend)."""
        self._inflight.acquire()
        try:
            inner = self._transport.submit(*call, answer_slot=getattr(outer, "answer_slot", False))
        except BaseException as e:  # noqa: BLE001 - the push's outcome
            self._inflight.release()
            outer.set_exception(e)
            return
        outer.inner = inner  # type: ignore[attr-defined]  # what ``wait`` waits on first (a data-plane lane's call
        # is answered sooner by the thread that waits for it: ``SocketTurns.lead``)
        inner.add_done_callback(lambda f: self._answered(outer, call, f, attempt, since))

    def _answered(self, outer: Future, call: planner.Call, inner: Future, attempt: int,
                  since: Optional[float] = None) -> None:
        self._inflight.release()
        outer.inner = None  # type: ignore[attr-defined]  # (a cycle through ``inner``'s callback otherwise: the
        # call, and a request slot it was built in, would wait for the garbage collector to be let go)
        e = inner.exception()
        if answered_unavailable(e):  # e.g. applied, but a quorum of its replica group not reached in time
            since = since if since is not None else time.monotonic()
            delay = self._transport.resend_delay(since)
            if delay is not None:  # sent again as it was: applied once, or a duplicate
                timer = threading.Timer(delay, self._send, args=(outer, call, attempt, since))
                timer.daemon = True
                timer.start()
                return
        if isinstance(e, (SlotMovedError, ShardRemovedError)) and self.replan is not None \
                and attempt < self.MAX_REROUTES:
            # A shard that left may have applied the call before its answer was lost: the new owners are told
            # where it went (PushRequest.origins) and answer it as a duplicate if that shard applied it.
            self.run_async(self._reroute, outer, call, attempt + 1, None, None, isinstance(e, ShardRemovedError))
            return
        if e is not None:
            outer.set_exception(e)
            return
        reply = inner.result()
        moved = moved_entries(reply)
        if not moved:
            outer.set_result(reply)
        elif self.replan is not None and attempt < self.MAX_REROUTES:  # a batch applied but for these: sent again
            self.run_async(self._reroute, outer, call, attempt + 1, moved, reply)
        else:
            outer.set_exception(ShardpsError(f"{len(moved)} push(es) of a batch not applied: their slots kept moving "
                                             f"({self.MAX_REROUTES} reroutes)"))

    def _reroute(self, outer: Future, call: planner.Call, attempt: int, only: Optional[list[int]] = None,
                 reply: Any = None, unanswered: bool = False) -> None:
        """Plan a refused call again (``only`` those of its pushes: a batch's that were not applied, ``reply`` its
        answer; ``unanswered``: its shard left the cluster without answering) and send its parts; ``outer``
        resolves once every part has."""
        try:
            assert self.replan is not None
            calls = self.replan(call, only, unanswered)
        except BaseException as e:  # noqa: BLE001
            outer.set_exception(e)
            return
        if not calls:
            outer.set_result(reply if reply is not None else
                             pb.PushBatchResponse() if call[1] == "PushBatch" else pb.PushResponse())
            return
        parts: list[Future] = [Future() for _ in calls]
        left = [len(parts)]
        lock = threading.Lock()

        def part_done(_: Future) -> None:
            with lock:
                left[0] -= 1
                if left[0]:
                    return
            errors = [p.exception() for p in parts if p.exception() is not None]
            if errors:
                outer.set_exception(errors[0])
            elif reply is not None:  # a batch's answer stands, its moved pushes applied where they are now
                outer.set_result(reply)
            else:  # the original call's reply stands for its parts (a batch's: with no entries)
                outer.set_result(pb.PushBatchResponse() if call[1] == "PushBatch" else parts[0].result())

        for p, c in zip(parts, calls):
            p.add_done_callback(part_done)
            self._send(p, c, attempt)

    def _done(self, f: Future) -> None:
        keys: list[str] = f.keys  # type: ignore[attr-defined]
        with self._lock:
            for key in set(keys):
                self._pending.get(key, set()).discard(f)
            if f.exception() is not None:
                if not f.waited:  # type: ignore[attr-defined]
                    self._errors.append(f.exception())  # type: ignore[arg-type]
                return
        reply = f.result()
        replies = list(reply.pushes) + list(reply.dense) if isinstance(reply, pb.PushBatchResponse) else [reply]
        for key, r in zip(keys, replies):
            if r.late or r.missing_ranks:
                self.sync_reports.append((key, list(r.missing_ranks), r.late))
                if r.late:
                    log.warning("push to %s arrived after its synchronous step was applied; dropped", key)
                else:
                    log.warning("synchronous step of %s applied without ranks %s (stragglers)", key, list(r.missing_ranks))

    # ---- waiting -----------------------------------------------------------------------

    def wait(self, key: Optional[str] = None) -> None:
        """Send what is queued, then wait for the pushes in flight (of ``key``, or all); errors stay for ``flush``."""
        if self.has_queued:
            self.send()
        with self._lock:
            if key is None:
                waiting = [f for fs in self._pending.values() for f in fs]
            else:
                waiting = list(self._pending.get(key, ()))
        for f in waiting:
            answer_here(f)
            try:
                f.result()
            except BaseException:  # noqa: BLE001 - recorded by _done, raised by flush()
                pass

    def flush(self) -> None:
        """Wait until every push sent so far is applied; raise the first error any of them met."""
        self.wait()
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            for e in errors[1:]:
                log.error("another push failed: %s", e)
            raise errors[0]


def moved_entries(reply: Any) -> list[int]:
    """Positions (pushes, then dense pushes) of a PushBatch's pushes the shard did not apply because their slots
    moved while they waited (``PushResponse.moved``); empty for any other answer."""
    if not isinstance(reply, pb.PushBatchResponse):
        return []
    return [k for k, r in enumerate(list(reply.pushes) + list(reply.dense)) if r.moved]


def answer_here(outer: Future) -> None:
    """Before waiting for a push's outcome: wait for its lane's call, whose answer a data-plane lane lets the
    waiting thread receive itself (``SocketTurns.lead``) rather than wake it."""
    inner = getattr(outer, "inner", None)
    if inner is not None and not inner.done():
        inner.exception()
