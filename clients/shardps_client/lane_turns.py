"""The socket of a client's data-plane lane, shared by the threads that use it (``SocketTurns``).

A ZeroMQ socket may be used by one thread at a time, so every use of it (a send, a receive, a poll) happens
under ``_io``. The caller's own thread does the work whenever it can: a call is sent at once by the thread that
makes it when the lock is free (``_send_now``), and a thread waiting for an answer (``result()`` of a call's
``LaneFuture``) takes the lock and receives on the socket until its answer is there, settling the other answers
it meets on the way (``lead``). No hand-off between Python threads stands on a call's path: two hops through
the lane's thread cost more than the shard's own work on a small call (measured: a one-row pull 575-710 us that
way, 422-522 us without). The lane's thread (``DataLane``) keeps the connection and takes, every ``TICK_MS``
while calls are out (backing off to ``MAX_TICK_MS`` while its ticks find nothing), the answers nobody waits for
(a push's acknowledgement); it gets the socket from a waiting caller within ``LEAD_SLICE_MS`` when it needs it
(a lost connection, a call timed out, the lane closing).
Answers are settled after the lock is let go: a future's callbacks may use the lane again.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional

import zmq

from shardps.core import protocol, region, wire, zmsg
from shardps.core.seal import HELLO_AAD, Seal, SealError
from shardps.core.wake import WakePipe
from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import ShardpsError

log = logging.getLogger(__name__)

LEAD_SLICE_MS = 50  # a caller receiving for its answer looks up this often (the lane's thread may need the socket)
TICK_MS = 2  # while calls are out, the lane's thread takes the answers nobody waits for this often
MAX_TICK_MS = 64  # ... backing off to this while its ticks find nothing (the waiting callers receive them)
ANSWER_SLOT_METHODS = frozenset({"Pull", "PullDense", "PullBatch"})  # calls offered an answer slot in a region


class LaneFuture(Future):
    """A call's future: waiting for it (``result``, ``exception``) receives on the lane's socket in the waiting
    thread when it can (``SocketTurns.lead``), instead of waiting to be woken by the lane's thread."""

    def __init__(self, lane: SocketTurns) -> None:
        super().__init__()
        self._lane = lane

    def result(self, timeout: Optional[float] = None) -> Any:
        if not self.done():
            self._lane.lead(self, timeout)
        return super().result(timeout)

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        if not self.done():
            self._lane.lead(self, timeout)
        return super().exception(timeout)


class Item:
    __slots__ = ("future", "method", "request", "sent_at", "rid", "region", "slot", "answer_slot")

    def __init__(self, method: str, request: bytes, rid: bytes, lane: SocketTurns, answer_slot: bool = False) -> None:
        self.future: Future = LaneFuture(lane)
        self.method = method
        self.answer_slot = answer_slot or method in ANSWER_SLOT_METHODS  # offered an answer slot in a region
        self.request = request  # framed as a StreamRequest
        self.rid = rid
        self.sent_at = 0.0
        self.region: Optional[region.ClientRegion] = None  # the region its last send used, and its answer slot there
        self.slot = region.NO_SLOT


class SocketTurns:
    """Whose turn it is with a lane's socket, and the answers taken off it (the module docstring). ``DataLane``
    connects the socket and sets what answering needs: ``address``, ``fallback`` (its ``group``), ``_resolve``
    and ``mode``."""

    address: str
    fallback: Any
    mode: Optional[str]
    _resolve: Callable[..., None]

    def __init__(self) -> None:
        self._reached = False  # a connection of this lane got its hello answered
        self._hello_ok = False  # ... this lane's connection now did
        self._tampered = False  # ... it ended on a message that did not open (no new retry window for that)
        self._lock = threading.Lock()  # the queue (and the lane's state)
        self._queue: collections.deque[Item] = collections.deque()  # calls made, not sent yet
        self._wake = WakePipe()  # callers wake the lane's thread (which owns the connection) through it
        self._io = threading.Lock()  # held by whoever uses the socket (a caller or the lane's thread)
        self._sock: Optional[zmq.Socket] = None  # the connected socket (set and cleared under _io by the lane)
        self._seal: Optional[Seal] = None  # with TLS: its connection's sealing (set and cleared with it)
        self._region: Optional[region.ClientRegion] = None  # shared memory with the shard (set by the hello's answer)
        self._unacked: Optional[collections.OrderedDict[bytes, Item]] = None  # its calls sent and not answered
        self._broken = False  # a caller found the connection broken: the lane's thread reconnects
        self._want_io = False  # the lane's thread needs the socket: a caller receiving lets it go
        self._kick = WakePipe()  # calls queued while a caller receives: it sends them
        self._lead_poller: Optional[tuple[zmq.Socket, zmq.Poller]] = None
        self._released = threading.Condition()  # _io let go or answers settled (for callers waiting on both)
        self._released_waiters = 0
        self._dozing = False  # the lane's thread sleeps up to 250 ms (nothing was out for a second)

    @property
    def shared_memory(self) -> bool:  # the connection has a shared-memory region with its shard now
        return self._region is not None

    def _send_now(self) -> None:
        """Send the queued calls from this thread if the socket is free; else leave them to whoever holds it."""
        if self._io.acquire(blocking=False):
            answers: list[Callable[[], None]] = []
            try:
                sock = self._sock
                if sock is not None and not self._broken:
                    self._pump_or_break(sock, answers)
                    if self._dozing:  # the lane's thread sleeps long: it takes answers nobody waits for
                        self._wake.wake()
                    return
            finally:
                self._let_go(answers)
            self._wake.wake()  # not connected now: the lane's thread sends it once it is
        else:  # the socket is in use: whoever holds it sends it (a receiving caller is kicked, the thread woken)
            self._kick.wake()
            self._wake.wake()

    def _pump(self, sock: zmq.Socket, unacked: collections.OrderedDict, answers: list, block: bool = True) -> Optional[str]:
        """Send the queued calls, then receive every answer there is (``answers``: how to settle their futures,
        run after ``_io`` is let go); "broken" when the connection must be made again. A caller's thread sends
        without blocking (``block`` False): with no connection to queue on, the lane's thread reconnects."""
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
        if items:
            now = time.monotonic()
            for item in items:
                item.sent_at = now
                unacked[item.rid] = item
            try:
                flags = 0 if block else zmq.NOBLOCK
                for item in items:
                    self._send_item(sock, item, flags)
            except zmq.Again:  # no connection to send on: what is unanswered is resent on the next one
                return "broken"
        return self._receive_all(sock, unacked, answers)

    def _send_item(self, sock: zmq.Socket, item: Item, flags: int) -> None:
        """Send a call (under ``_io``), sealed as it leaves when the connection is. Copied into libzmq's message
        rather than zero-copy: pyzmq releases a zero-copy frame through its garbage-collector thread, a Python
        thread woken per message that contends for the GIL (as the shard's answers, ``data_plane._send``). A large
        push was built in a libzmq message (``zmsg``) and goes from it, no copy; it stays the call's to resend."""
        if self._seal is None:
            if self._region is None or not _send_placed(sock, item, self._region, flags):
                zmsg.send_multipart(sock, [item.rid, item.request], flags)
        else:
            zmsg.send_multipart(sock, [item.rid, *self._seal.seal(item.request, item.rid)], flags)

    def _receive_all(self, sock: zmq.Socket, unacked: collections.OrderedDict, answers: list) -> Optional[str]:
        """Take every answer the socket holds (under ``_io``); "broken" when the connection must be made again.
        Answers that arrived before a connection went are still there to take (libzmq keeps them readable)."""
        while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (asked first: pyzmq's Again costs an import and a raise)
            try:
                parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            if self._answer(parts, unacked, answers) is not None:
                return "broken"  # a new connection: the unanswered calls go (to the group's primary), in order
        return None

    def _pump_or_break(self, sock: zmq.Socket, answers: list) -> bool:
        """``_pump`` from a caller's thread; a broken connection is left to the lane's thread (False)."""
        assert self._unacked is not None
        if self._pump(sock, self._unacked, answers, block=False) is None:
            return True
        self._broken = True
        self._wake.wake()
        return False

    def lead(self, future: Future, timeout: Optional[float]) -> None:
        """Wait for ``future`` (a call of this lane) receiving on the socket in this thread while it can: when
        nobody else uses it, the connection is up and the lane's thread does not need it. Otherwise wait to be
        answered by whoever receives (the lane's thread always does, in the end)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not future.done():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return
            sock = self._sock
            if sock is None or self._broken or self._want_io or not self._io.acquire(blocking=False):
                with self._released:  # answered by whoever holds the socket, or it is let go: look again
                    self._released_waiters += 1  # counted before looking (whoever lets go looks after)
                    try:
                        if not future.done() and (self._io.locked() or self._sock is None or self._broken
                                                  or self._want_io):
                            self._released.wait(0.05 if left is None else min(0.05, left))
                    finally:
                        self._released_waiters -= 1
                continue
            answers: list[Callable[[], None]] = []
            try:
                if self._sock is not sock or self._broken:
                    continue
                if self._lead_poller is None or self._lead_poller[0] is not sock:
                    poller = zmq.Poller()
                    poller.register(sock, zmq.POLLIN)
                    poller.register(self._kick.fd, zmq.POLLIN)
                    self._lead_poller = (sock, poller)
                poller = self._lead_poller[1]
                while (self._pump_or_break(sock, answers) and not answers and not self._want_io
                       and not future.done()):  # (settled by the thread that took its answer: it kicks)
                    wait_ms = LEAD_SLICE_MS if left is None else max(0, min(LEAD_SLICE_MS, int(left * 1000)))
                    if self._kick.fd in dict(poller.poll(wait_ms)):
                        self._kick.drain()
                    if deadline is not None and time.monotonic() >= deadline:
                        break
            finally:
                self._let_go(answers)

    def _let_go(self, answers: list[Callable[[], None]]) -> None:
        """Release the socket, then settle the answers received (``_settled``); calls queued meanwhile by threads
        that found the socket held are sent now (their kick may have found nobody receiving)."""
        self._io.release()
        self._settled(answers)
        if self._queue and self._sock is not None and not self._broken:
            self._send_now()

    def _settled(self, answers: list[Callable[[], None]]) -> None:
        """Settle answers taken off the socket (``_io`` let go), and tell the callers waiting: those waiting to
        be answered or for the socket, and a caller now receiving, whose own answer may be among them (kicked out
        of its poll)."""
        settle(answers)
        if answers and self._io.locked():
            self._kick.wake()
        if self._released_waiters:
            with self._released:
                self._released.notify_all()

    def _take_io(self, force: bool) -> bool:
        """The socket, for the lane's thread: at once if it is free; else, with ``force``, once the caller receiving
        lets it go (within LEAD_SLICE_MS); else not (False)."""
        if self._io.acquire(blocking=False):
            return True
        if not force:
            return False
        self._want_io = True
        self._io.acquire()
        self._want_io = False
        return True

    @contextlib.contextmanager
    def _owning_io(self) -> Iterator[None]:
        """``_take_io`` by force, let go (and the waiting callers told) after the block."""
        self._take_io(True)
        try:
            yield
        finally:
            self._io.release()
            self._settled([])

    def _has_unacked(self, unacked: collections.OrderedDict) -> bool:
        with self._owning_io():
            return bool(unacked)

    def _answer(self, parts: list[Any], unacked: collections.OrderedDict, answers: list) -> Optional[str]:
        """Take one answer off the socket (under ``_io``); settling its call's future goes into ``answers``."""
        if len(parts[0]) == 0 and self._seal is not None:  # a control message on a sealed connection
            return self._sealed_control(parts, unacked, answers)
        if not len(parts[0]) and len(parts) >= 2 and parts[1].bytes == b"ok":  # [b"", b"ok"] (, the region)
            self._region = _open_region(self.address, parts[2].bytes) if len(parts) == 3 else None
            self._reached = self._hello_ok = True  # (after the region: data_planes() never says "zmq-ipc" between)
            return None
        if len(parts) == 3 and not len(parts[0]):  # the hello refused: [b"", b"error", StreamResponse]
            self._refused(parts[2].buffer, unacked, answers)
            return None
        body = parts[-1].buffer
        in_slot = False
        if self._seal is not None:  # every answer sealed: one that does not open ends the connection
            try:
                if len(parts) != 3:
                    raise SealError(f"an answer of {len(parts)} parts is not sealed")
                body = memoryview(self._seal.open(parts[1].buffer, parts[2].buffer, parts[0].bytes))
            except SealError as e:
                log.warning("data plane of shard at %s: %s; connecting again", self.address, e)
                self._tampered = True
                return "broken"
        elif len(parts) == 3 and not len(parts[1]):  # [request id, b"", ANSWER]: the answer is in the call's slot
            in_slot = True
        elif len(parts) != 2:
            return None
        item = unacked.get(parts[0].bytes)
        if item is None:
            return None  # the answer to a call resent after its first answer was lost: already resolved
        try:
            if in_slot:
                shm = item.region
                if shm is not self._region or shm is None:
                    raise ShardpsError(f"data plane of shard at {self.address}: an answer in a slot the call was "
                                       "not given", address=self.address)
                body = shm.answer(item.slot, parts[2].buffer)
                item.region = None  # the answer's view holds its slot now
            _release(item)
            field, view = wire.unframe(body)
            kind = protocol.error_kind(view) if field == protocol.STREAM_ERROR_FIELD else ""
        except BaseException as e:  # noqa: BLE001 - a malformed answer fails its call alone
            unacked.pop(parts[0].bytes)
            answers.append(lambda f=item.future, e=e: f.set_exception(e))
            return None
        if kind == "data_region":  # the shard took the connection's region back: connect again, send the calls again
            return "broken"
        if self.fallback.group and kind == "not_primary":  # not the primary: the call stays unanswered
            return "not primary"
        unacked.pop(parts[0].bytes)
        answers.append(lambda item=item, field=field, view=view, parts=parts:
                       self._resolve(item.future, self.address, item.method, field, view))
        return None

    def _sealed_control(self, parts: list[Any], unacked: collections.OrderedDict, answers: list) -> Optional[str]:
        """The hello's answer on a sealed connection, ``[b"", b"ok" / b"error", counter, sealed]``: trusted once it
        opens. Anything else (a refusal the shard could not seal: a session it does not hold, a request of ours that
        did not open; or a forgery) ends the connection: a new one with a new session, within the retry window."""
        assert self._seal is not None
        what = parts[1].bytes if len(parts) > 1 else b""
        try:
            if len(parts) != 4 or what not in (b"ok", b"error"):
                raise SealError("an unsealed control message")
            body = self._seal.open(parts[2].buffer, parts[3].buffer, HELLO_AAD + what)
        except SealError as e:
            reason = str(e)
            if len(parts) == 3 and what == b"error":
                try:
                    reason = "refused, unsealed: " + pb.StreamResponse.FromString(parts[2].bytes).error.message
                except Exception:  # noqa: BLE001 - a malformed refusal: said as it is
                    reason = f"refused, unsealed: {parts[2].bytes[:200]!r}"
            log.warning("data plane of shard at %s: %s; connecting again", self.address, reason)
            self._tampered = True
            return "broken"
        if what == b"ok":
            self._reached = self._hello_ok = True
        else:  # the token refused, say: every call of the connection fails with it
            self._refused(memoryview(body), unacked, answers)
        return None

    def _refused(self, refusal: memoryview, unacked: collections.OrderedDict, answers: list) -> None:
        """The hello refused (a framed StreamResponse): every call not answered yet fails with the refusal."""
        refused: Future = Future()
        try:
            field, view = wire.unframe(refusal)
            self._resolve(refused, self.address, "data-plane hello", field, view)
        except Exception as e:  # noqa: BLE001 - a malformed refusal is still a refusal
            refused.set_exception(e)
        exc = refused.exception()
        if not isinstance(exc, ShardpsError):
            exc = ShardpsError(f"data plane of shard at {self.address} refused the hello: {exc}", address=self.address)
        self._fail(unacked, exc, answers)

    def _take_all(self, unacked: collections.OrderedDict, mode: Optional[str] = None) -> list[Item]:
        """Every call not answered yet (sent first, then queued), in order; both emptied (and, in the same
        step, ``mode`` set if given: no call submitted after it can overtake them)."""
        with self._lock:
            if mode is not None:
                self.mode = mode
            items = list(unacked.values()) + list(self._queue)
            self._queue.clear()
        unacked.clear()
        return items

    def _fail(self, unacked: collections.OrderedDict, exc: ShardpsError, answers: Optional[list] = None) -> None:
        """Every call not answered yet fails with ``exc`` (at once, or through ``answers`` once _io is let go)."""
        for item in self._take_all(unacked):
            if answers is not None:
                answers.append(lambda f=item.future: f.done() or f.set_exception(exc))
            elif not item.future.done():
                item.future.set_exception(exc)


def _send_placed(sock: zmq.Socket, item: Item, shm: region.ClientRegion, flags: int) -> bool:
    """Send a call through the connection's region, ``[request id, REQUEST, frame or b""]``: a pull offers an answer
    slot, and a call built in a request slot of the region (``ClientRegion.reserve``) names it instead of carrying its
    frame. False when it takes no slot (it goes as before)."""
    placed = shm.placed(item.request)
    ans = shm.offer() if item.answer_slot else None
    if ans is None and placed is None:
        item.region = None
        return False
    item.region, item.slot = shm, region.NO_SLOT if ans is None else ans
    if placed is None:
        descriptor, frame = region.REQUEST.pack(region.NO_SLOT, 0, item.slot), item.request
    else:
        descriptor, frame = region.REQUEST.pack(placed[0], placed[1], item.slot), b""
    try:
        zmsg.send_multipart(sock, [item.rid, descriptor, frame], flags)
    except zmq.ZMQError:
        _release(item)
        raise
    return True


def _open_region(address: str, offer: bytes) -> Optional[region.ClientRegion]:
    shm = region.open_offer(offer)
    if shm is None:
        log.info("data plane of shard at %s: its shared-memory region cannot be opened from here; messages go "
                 "through the socket", address)
    return shm


def _release(item: Item) -> None:
    """Free the answer slot a call's send offered (its answer came through the socket). (A request slot is its
    request's: freed when the call, done, lets it go.)"""
    if item.region is not None:
        if item.slot != region.NO_SLOT:
            item.region.release(item.slot)
        item.region = None


def settle(answers: list[Callable[[], None]]) -> None:
    """Settle calls' futures (after the socket's lock is let go: their callbacks may use the lane)."""
    for one in answers:
        one()
