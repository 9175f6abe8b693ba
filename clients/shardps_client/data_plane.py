"""A shard's lane over the data plane: this client's pulls and pushes to one shard over ZeroMQ (libzmq).

``DataLane`` has the ``Lane`` interface (``submit``, ``close``, ``streaming``) and its semantics: calls reach
the shard in the order they were made, many in flight, each answered in order; when the connection breaks
(the shard restarts or dies) every unanswered call is resent, in order, on a new connection, for up to
``retry_timeout`` seconds ((client id, seq) dedup on the shard makes a resent push that was applied a no-op).

The lane learns the shard's data-plane ports, its CURVE public key and its ticket from ``ShardInfo`` over the
client's gRPC channel (authenticated, and with TLS encrypted: the key is then as trusted as the shard's
certificate), connects one DEALER socket to the port its client id picks, and presents its token and ticket.
A shard without a data plane, or a client without pyzmq, gets the gRPC ``Lane`` (``fallback``) instead.

One thread per lane owns the socket (ZeroMQ sockets belong to one thread): callers queue calls and wake it
through a pipe; it sends them, receives answers and resolves the callers' futures. Requests are
``[request id, StreamRequest]``, answers ``[request id, StreamResponse]`` (``shardps.server.rpc.data_plane``).
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
import zlib
from concurrent.futures import Future
from typing import Any, Callable, Optional

import zmq

from shardps.core import protocol, wire
from shardps.core.wake import WakePipe
from shardps_client.errors import ShardpsError, ShardUnavailableError

log = logging.getLogger(__name__)

HELLO = b"hello"
HEARTBEAT_MS = 1000  # ZMTP heartbeats: a shard whose machine died is noticed within HEARTBEAT_TIMEOUT_MS
HEARTBEAT_TIMEOUT_MS = 5000
SEND_TIMEOUT_MS = 2000  # a send with no connection to queue on gives up (the lane reconnects)


class _Item:
    __slots__ = ("future", "method", "request", "sent_at", "rid")

    def __init__(self, method: str, request: bytes, rid: bytes) -> None:
        self.future: Future = Future()
        self.method = method
        self.request = request  # framed as a StreamRequest
        self.rid = rid
        self.sent_at = 0.0


class DataLane:
    """Ordered, pipelined calls to one shard over its data plane (see the module docstring).

    Args:
        fallback: the shard's gRPC ``Lane`` (used when the shard has no data plane).
        discover: ``discover()`` -> the shard's ``ShardInfoResponse`` (gRPC, retried while UNAVAILABLE).
        address: the shard's address ("host:port"; its data plane is on that host).
        client_id: picks which of the shard's data-plane ports this client uses.
        token: the client's bearer token (None: none).
        resolve: ``resolve(future, address, what, field, view)`` settles a call's future with its answer (a
            StreamResponse): the stub's reply or the error (``transport.resolve``); ``timed_out(address, message)`` /
            ``unavailable(address, message)`` -> the exceptions of a call with no answer in time / a shard that
            could not be reached again.
        timeout: seconds a call may wait for its answer; retry_timeout: seconds to keep reconnecting.
    """

    def __init__(self, fallback: Any, discover: Callable[[], Any], address: str, client_id: str, token: Optional[str],
                 resolve: Callable[..., None],
                 timed_out: Callable[[str, str], ShardpsError], unavailable: Callable[[str, str], ShardpsError],
                 timeout: float, retry_timeout: float, on_lost: Callable[[], bool] = lambda: False,
                 removed: Optional[Callable[[str, str], ShardpsError]] = None) -> None:
        self.fallback = fallback
        self._removed_error = removed
        self._discover = discover
        self.rebind(address)
        self.on_lost = on_lost  # the shard was lost: find its replica group's primary (True: the lane was rebound)
        self._pick = zlib.crc32(client_id.encode())
        self._token = (token or "").encode()
        self._resolve, self._timed_out, self._unavailable = resolve, timed_out, unavailable
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self._lock = threading.Lock()
        self._queue: collections.deque[_Item] = collections.deque()
        self._closed = False
        self._ids = 0
        self._thread: Optional[threading.Thread] = None
        self._wake = WakePipe()  # callers wake the lane's thread (which owns the socket) through it
        self.mode: Optional[str] = None  # "zmq" or "grpc" once known
        self._reached = False  # a connection of this lane got its hello answered
        self.endpoint = ""

    def rebind(self, address: str) -> None:
        """Connect to another member of the shard's replica group (its new primary) from the next connection on."""
        self.address = address
        host = address.rsplit(":", 1)[0]
        self._host = host[1:-1] if host.startswith("[") and host.endswith("]") else host

    @property
    def streaming(self) -> bool:
        return self.fallback.streaming if self.mode == "grpc" else True

    def submit(self, method: str, request: bytes) -> Future:
        """Queue a call (``request`` framed as its StreamRequest field); the future gets the stub's reply."""
        if self.fallback.removed:  # the shard is out of the cluster
            return self.fallback.submit(method, request)
        with self._lock:
            if self.mode == "grpc":
                item = None
            elif self._closed:
                raise ShardpsError(f"the client's lane to {self.address} is closed", address=self.address)
            else:
                self._ids += 1
                item = _Item(method, request, self._ids.to_bytes(8, "little"))
                wake = not self._queue
                self._queue.append(item)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=f"shardps-data-{self.address}",
                                                    daemon=True)
                    self._thread.start()
        if item is None:
            return self.fallback.submit(method, request)
        if wake:
            self._wake.wake()
        return item.future

    def close(self, timeout: float = 30.0) -> None:
        """Answer what is queued, then stop the lane's thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.wake()
        if thread is not None:
            thread.join(timeout)
        self.fallback.close(timeout)
        self._wake.close()

    # ---- the lane's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        unacked: collections.OrderedDict[bytes, _Item] = collections.OrderedDict()
        failing_since: Optional[float] = None
        delay = 0.05
        while True:
            with self._lock:
                if self._closed and not unacked and not self._queue:
                    return  # closed with nothing left to answer: no reconnecting (the shard may be gone)
            try:
                conn = self._connect(ctx)
            except ShardUnavailableError:  # the shard does not answer now: as a lost connection (retried below)
                conn, ended = None, "lost"
            except ShardpsError as e:
                self._fail(unacked, e)
                failing_since = None
                if self._wait_for_work():
                    continue
                return
            else:
                if conn is None:  # no data plane: the gRPC lane takes every call from now on
                    self._hand_over(unacked)
                    return
                ended = self._serve(conn, unacked)
            if ended == "closed":
                return  # everything answered
            if ended == "unreachable":  # never reached (a firewall, a port not mapped): gRPC from now on
                log.warning("data plane of shard at %s (%s) unreachable; using gRPC streams", self.address,
                            self.endpoint)
                self._hand_over(unacked)
                return
            if self.on_lost():  # a replica group's new primary: reconnect there at once
                failing_since, delay = None, 0.05
                continue
            if self.fallback.gone() and self._removed_error is not None:  # out of the cluster: planned again elsewhere
                self.fallback.removed = True
                self._fail(unacked, self._removed_error(self.address, "data plane call"))
                failing_since = None
                if self._wait_for_work():
                    continue
                return
            now = time.monotonic()
            failing_since = failing_since or now
            if now - failing_since + delay >= self.retry_timeout:
                self._fail(unacked, self._unavailable(self.address,
                    f"data plane of shard at {self.address} lost and not reachable again within {self.retry_timeout}s"))
                failing_since = None
                continue
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, 1.0)

    def _connect(self, ctx: zmq.Context) -> Optional[tuple[zmq.Socket, zmq.Socket]]:
        """A DEALER connected to the shard's data plane (and its monitor), hello sent; None: it has none."""
        info = self._discover()
        if not info.data_ports:
            return None
        port = info.data_ports[self._pick % len(info.data_ports)]
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # no connection to queue on: never block the lane for good
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        if info.data_public_key:
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey = info.data_public_key.encode()
            sock.curve_publickey = public
            sock.curve_secretkey = secret
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.endpoint = f"tcp://{host}:{port}"
        sock.connect(self.endpoint)
        try:
            sock.send_multipart([b"", HELLO, self._token, bytes(info.data_ticket)])
        except zmq.Again:  # not connected within SEND_TIMEOUT_MS (the shard died again): retried as a lost one
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            raise ShardUnavailableError(f"data plane of shard at {self.address} not connected",
                                        address=self.address) from None
        self.mode = "zmq"
        return sock, monitor

    def _serve(self, conn: tuple[zmq.Socket, zmq.Socket], unacked: collections.OrderedDict) -> str:
        """Send and answer calls until the lane closes ("closed"), the connection breaks ("broken": unanswered
        calls are then resent first, in order, on the next connection), or the data plane of a shard this
        lane never reached cannot be connected ("unreachable")."""
        sock, monitor = conn
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        retries = 0
        try:
            for item in unacked.values():  # resent in order (the shard drops pushes it applied)
                item.sent_at = time.monotonic()
                sock.send_multipart([item.rid, item.request], copy=False)
            while True:
                events = dict(poller.poll(250))
                if self._wake.fd in events:
                    self._wake.drain()
                with self._lock:
                    items = list(self._queue)
                    self._queue.clear()
                    closed = self._closed
                now = time.monotonic()
                for item in items:
                    item.sent_at = now
                    unacked[item.rid] = item
                for item in items:
                    sock.send_multipart([item.rid, item.request], copy=False)
                if sock in events:
                    while True:
                        try:
                            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        if self._answer(parts, unacked) == "not primary":
                            return "broken"  # the unanswered calls go to the group's primary, in order
                if monitor in events:
                    event = monitor.recv_multipart()
                    what = int.from_bytes(event[0][:2], "little")
                    if what == zmq.EVENT_DISCONNECTED:
                        return "broken"
                    retries += 1
                    if retries >= 3 and not self._reached:
                        return "unreachable"
                    if unacked and retries >= 3:  # connection refused: the shard moved (restarted elsewhere)?
                        return "broken"
                if unacked:
                    oldest = next(iter(unacked.values()))
                    if time.monotonic() - oldest.sent_at > self.timeout:
                        self._fail(unacked, self._timed_out(self.address,
                            f"data plane of shard at {self.address}: no answer within {self.timeout}s"))
                        return "broken"
                if closed and not unacked:
                    with self._lock:
                        if not self._queue:
                            return "closed"
        except zmq.Again:  # the connection went away under a send: what is unanswered is resent on the next one
            return "broken"
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _answer(self, parts: list[Any], unacked: collections.OrderedDict) -> Optional[str]:
        if len(parts) == 3 and not len(parts[0]):  # the hello refused: [b"", b"error", StreamResponse]
            refused: Future = Future()
            try:
                field, view = wire.unframe(parts[2].buffer)
                self._resolve(refused, self.address, "data-plane hello", field, view)
            except Exception as e:  # noqa: BLE001 - a malformed refusal is still a refusal
                refused.set_exception(e)
            exc = refused.exception()
            if not isinstance(exc, ShardpsError):
                exc = ShardpsError(f"data plane of shard at {self.address} refused the hello: {exc}",
                                   address=self.address)
            self._fail(unacked, exc)
            return None
        if len(parts) == 2 and not len(parts[0]) and parts[1].bytes == b"ok":
            self._reached = True
            return None
        if len(parts) != 2:
            return None
        item = unacked.get(parts[0].bytes)
        if item is None:
            return None  # the answer to a call resent after its first answer was lost: already resolved
        try:
            field, view = wire.unframe(parts[1].buffer)
        except BaseException as e:  # noqa: BLE001 - a malformed answer fails its call alone
            unacked.pop(parts[0].bytes)
            item.future.set_exception(e)
            return None
        if self.fallback.group and protocol.not_primary(field, view):  # not the primary: the call stays unanswered
            return "not primary"
        unacked.pop(parts[0].bytes)
        self._resolve(item.future, self.address, item.method, field, view)
        return None

    def _take_all(self, unacked: collections.OrderedDict, mode: Optional[str] = None) -> list[_Item]:
        """Every call not answered yet (sent first, then queued), in order; both emptied (and, in the same
        step, ``mode`` set if given: no call submitted after it can overtake them)."""
        with self._lock:
            if mode is not None:
                self.mode = mode
            items = list(unacked.values()) + list(self._queue)
            self._queue.clear()
        unacked.clear()
        return items

    def _fail(self, unacked: collections.OrderedDict, exc: ShardpsError) -> None:
        for item in self._take_all(unacked):
            if not item.future.done():
                item.future.set_exception(exc)

    def _wait_for_work(self) -> bool:
        """After a failure: wait for the next call (True), or the lane's close (False)."""
        while True:
            with self._lock:
                if self._queue:
                    return True
                if self._closed:
                    return False
            self._wake.wait()

    def _hand_over(self, unacked: collections.OrderedDict) -> None:
        for item in self._take_all(unacked, mode="grpc"):  # from now on submit goes to the gRPC lane
            f = self.fallback.submit(item.method, item.request)
            f.add_done_callback(lambda f, item=item: _chain(f, item.future))


def _chain(source: Future, target: Future) -> None:
    if source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
