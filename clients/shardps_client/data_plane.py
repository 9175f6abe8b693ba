"""A shard's lane over the data plane: this client's pulls and pushes to one shard over ZeroMQ (libzmq).

``DataLane`` has the ``Lane`` interface (``submit``, ``close``, ``streaming``) and its semantics: calls reach
the shard in the order they were made, many in flight, each answered in order; when the connection breaks
(the shard restarts or dies) every unanswered call is resent, in order, on a new connection, for up to
``retry_timeout`` seconds ((client id, seq) dedup on the shard makes a resent push that was applied a no-op).

The lane learns the shard's data-plane ports from ``ShardInfo`` over the client's gRPC channel, connects one
DEALER socket to the port its client id picks, and presents its token. With TLS that ``ShardInfo`` call (over
TLS: the shard's certificate authenticates it, and it is encrypted) also hands out a session for the connection,
whose key seals every message both ways (``shardps.core.seal``): only the shard holding the certificate's key
can open what the client sends or seal an answer that opens.
A shard without a data plane, or a client without pyzmq, gets the gRPC ``Lane`` (``fallback``) instead.

Who uses the socket, and when (``shardps_client.lane_turns``): the thread that makes a call sends it, and the
thread that waits for an answer receives it, whenever the socket is free; the lane's thread keeps the
connection (connects, presents the credentials, watches the socket's monitor, times calls out, reconnects and
resends) and takes the answers nobody waits for (a push's acknowledgement) while calls are out. Requests are
``[request id, StreamRequest]``, answers ``[request id, StreamResponse]`` (``shardps.server.rpc.data_plane``).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time
import zlib
from concurrent.futures import Future
from typing import Any, Callable, Optional

import zmq

from shardps.core import protocol, region
from shardps.core.seal import HELLO_AAD, TO_CLIENT, TO_SHARD, Seal
from shardps_client.errors import ShardpsError, ShardUnavailableError
from shardps_client.lane_turns import MAX_TICK_MS, TICK_MS, Item, SocketTurns, settle
from shardps_client.transport.lane import Probe

log = logging.getLogger(__name__)

HELLO = b"hello"
HEARTBEAT_MS = 1000  # ZMTP heartbeats: a shard whose machine died is noticed within HEARTBEAT_TIMEOUT_MS
HEARTBEAT_TIMEOUT_MS = 5000
SEND_TIMEOUT_MS = 2000  # a send with no connection to queue on gives up (the lane reconnects)


class DataLane(SocketTurns):
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
        sealed: the client talks TLS to the shard: its data plane is used only sealed (a ``ShardInfo`` without a
            session, from a shard without TLS behind a proxy that ends TLS, say, means gRPC streams: the token never
            leaves in clear).
        ipc: a shard on this machine (in this network namespace) is reached over its Unix socket (``endpoint``).
        newer_primary: a replica group's: ``newer_primary()`` says whether a primary of a newer epoch took over (asked
            while a call waits longer than ``STALL_PROBE_S``; yes: the connection is abandoned and the unanswered
            calls resent to the new primary).
    """

    def __init__(self, fallback: Any, discover: Callable[[], Any], address: str, client_id: str, token: Optional[str],
                 resolve: Callable[..., None],
                 timed_out: Callable[[str, str], ShardpsError], unavailable: Callable[[str, str], ShardpsError],
                 timeout: float, retry_timeout: float, on_lost: Callable[[], bool] = lambda: False,
                 removed: Optional[Callable[[str, str], ShardpsError]] = None, sealed: bool = False, ipc: bool = True,
                 newer_primary: Optional[Callable[[], bool]] = None) -> None:
        self.fallback = fallback
        self.probe = Probe(newer_primary) if newer_primary is not None else None
        self._removed_error = removed
        self.address = address
        self.dialer = Dialer(discover, address, client_id, token, sealed, ipc)
        self.on_lost = on_lost  # the shard was lost: find its replica group's primary (True: the lane was rebound)
        self._resolve, self._timed_out, self._unavailable = resolve, timed_out, unavailable
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        super().__init__()
        self._closed = False
        self._ids = 0
        self._thread: Optional[threading.Thread] = None
        self.mode: Optional[str] = None  # "zmq" or "grpc" once known

    def rebind(self, address: str) -> None:
        """Connect to another member of the shard's replica group (its new primary) from the next connection on."""
        self.address = address
        self.dialer.rebind(address)

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint of the lane's last connection ("": none yet)."""
        return self.dialer.endpoint

    @property
    def streaming(self) -> bool:
        return self.fallback.streaming if self.mode == "grpc" else True

    def submit(self, method: str, request: bytes, answer_slot: bool = False) -> Future:
        """Queue a call (framed as its StreamRequest field; ``answer_slot``: offered one in the region, as pulls)."""
        if self.fallback.removed:  # the shard is out of the cluster
            return self.fallback.submit(method, request)
        with self._lock:
            if self.mode == "grpc":
                item = None
            elif self._closed:
                raise ShardpsError(f"the client's lane to {self.address} is closed", address=self.address)
            else:
                self._ids += 1
                item = Item(method, request, self._ids.to_bytes(8, "little"), self, answer_slot)
                self._queue.append(item)
                self._start()
        if item is None:
            return self.fallback.submit(method, request)
        self._send_now()
        return item.future

    def open(self) -> None:
        """Connect now, in the lane's thread, rather than at the first call (``Client`` opens its lanes once the shards
        answered its shard-map check). A replica group's lane waits for a call to find the primary: at once it could
        reach a member a fresh group's election left behind."""
        with self._lock:
            if self.mode != "grpc" and not self._closed and not self.fallback.removed and not self.fallback.group:
                self._start()

    def _start(self) -> None:
        """Start the lane's thread, once (caller holds ``_lock``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"shardps-data-{self.address}", daemon=True)
            self._thread.start()

    def request_slot(self, nbytes: int) -> Optional[memoryview]:
        """A request slot of the connection's shared-memory region to build a call of ``nbytes`` in, or None
        (``Transport.request_slot``). A call built there on a connection that is gone goes in its message."""
        shm = self._region
        return shm.reserve(nbytes) if shm is not None and self.mode != "grpc" else None

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
        self._kick.close()

    # ---- the lane's thread ----------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context.instance()
        unacked: collections.OrderedDict[bytes, Item] = collections.OrderedDict()
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
                if self._hello_ok and not self._tampered:  # it worked before it was lost: a new retry window
                    failing_since, delay = None, 0.05
            if ended == "closed":
                return  # everything answered
            if ended == "unreachable" and self.dialer.unix_missed():
                continue
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

    def _connect(self, ctx: zmq.Context) -> Optional[tuple[zmq.Socket, zmq.Socket, Optional[Seal]]]:
        """A connection to the shard's data plane (``Dialer.connect``); None: it has none."""
        conn = self.dialer.connect(ctx)
        if conn is not None:
            self.mode = "zmq"
            self._hello_ok = self._tampered = False
        return conn

    def _serve(self, conn: tuple[zmq.Socket, zmq.Socket, Optional[Seal]], unacked: collections.OrderedDict) -> str:
        """Send and answer calls until the lane closes ("closed"), the connection breaks ("broken": unanswered
        calls are then resent first, in order, on the next connection), or the data plane of a shard this
        lane never reached cannot be connected ("unreachable"). Callers use the socket too, under ``_io``."""
        sock, monitor, seal = conn
        poller = zmq.Poller()
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake.fd, zmq.POLLIN)
        retries = 0
        answers: list[Callable[[], None]] = []
        try:
            with self._owning_io():
                self._seal = seal
                try:
                    for item in unacked.values():  # resent in order (the shard drops pushes it applied)
                        item.sent_at = time.monotonic()
                        self._send_item(sock, item, 0)
                except zmq.Again:  # the connection went away under a send: resent on the next one
                    return "broken"
                self._sock, self._unacked, self._broken = sock, unacked, False
            force, last_turn, idle_since, tick = True, time.monotonic(), None, TICK_MS
            while True:
                # Forced (a caller receiving lets the socket go) when the connection needs it, or when a caller has
                # held the socket for a second (timeouts); else only if it is free: a tick.
                ended = self._turn(sock, unacked, answers, force or time.monotonic() - last_turn > 1.0)
                # Ticks back off while they find nothing (the callers receive): 2, 4, ... 64 ms.
                tick = TICK_MS if answers else min(2 * tick, MAX_TICK_MS)
                self._settled(answers)
                answers.clear()
                if ended != "busy":
                    last_turn = time.monotonic()
                    if ended:
                        return ended
                # Callers receive their own answers; what nobody waits for (a push's acknowledgement) is taken
                # here every tick while calls are out. (Polling the socket's descriptor instead woke this thread
                # for every answer a caller was receiving: a one-row pull took 567 us against 422.)
                now = time.monotonic()
                idle_since = None if unacked or self._queue else idle_since or now
                timeout = tick
                if idle_since is not None and now - idle_since > 1.0:  # nothing out for a second: sleep longer
                    self._dozing = True  # then a caller that sends wakes this thread (Dekker: set, then look)
                    timeout = tick if unacked else 250
                events = dict(poller.poll(timeout))
                self._dozing = False
                if self._wake.fd in events:
                    self._wake.drain()
                if self.probe is not None and unacked:
                    self._probe_stall(unacked)
                force = monitor in events or self._broken or self._closed
                if monitor in events:
                    event = monitor.recv_multipart()
                    what = int.from_bytes(event[0][:2], "little")
                    if what == zmq.EVENT_DISCONNECTED:
                        return "broken"
                    retries += 1
                    if retries >= 3 and not self._reached:
                        return "unreachable"
                    if retries >= 3 and self._has_unacked(unacked):  # refused: the shard moved (restarted elsewhere)?
                        return "broken"
        finally:
            with self._owning_io():
                # Whatever ended the connection (it went, a send found it gone, a timeout, the lane closed), the
                # answers that came before are taken first: a push the shard applied and answered is settled, not
                # sent again (to another shard, if this one left the cluster, where its sequence number would not
                # be known). libzmq keeps them readable after the peer went.
                try:
                    self._receive_all(sock, unacked, answers)
                except zmq.ZMQError:
                    pass
                self._sock = self._unacked = self._seal = self._region = None
                self._lead_poller = None
            settle(answers)
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _probe_stall(self, unacked: collections.OrderedDict) -> None:
        """A replica group's call waiting long: ask whether a newer primary took over; when one did, this connection
        (to a member frozen, cut off or stuck on its disk) is abandoned and its calls resent there."""
        assert self.probe is not None
        if self.probe.deposed():
            self._broken = True
            return
        try:
            oldest = next(iter(unacked.values())).sent_at  # (read while a caller may hold the socket)
        except (StopIteration, RuntimeError):
            return
        self.probe.maybe(oldest, self._wake.wake)

    def _turn(self, sock: zmq.Socket, unacked: collections.OrderedDict, answers: list, force: bool) -> Optional[str]:
        """The lane's thread's turn with the socket: send what is queued, answer what came, time calls out; why
        the connection ends, if it does ("busy": no turn, a caller holds the socket and ``force`` is not set)."""
        if not self._take_io(force):
            return "busy"
        try:
            if self._broken:
                return "broken"
            if self._pump(sock, unacked, answers) is not None:
                return "broken"
            if unacked:
                oldest = next(iter(unacked.values()))
                if time.monotonic() - oldest.sent_at > self.timeout:
                    self._fail(unacked, self._timed_out(self.address,
                        f"data plane of shard at {self.address}: no answer within {self.timeout}s"), answers)
                    return "broken"
            with self._lock:
                if self._closed and not unacked and not self._queue:
                    return "closed"
            return None
        finally:
            self._io.release()

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


def endpoint(info: Any, host: str, pick: int, ipc: bool) -> str:
    """The ZeroMQ endpoint of data-plane socket ``pick`` of the shard ``info`` (its ShardInfo) describes, at
    ``host``: its abstract Unix socket when ``ipc`` and the shard runs in this machine's network namespace
    (``protocol.local_scope``), else its TCP port."""
    if ipc and info.local_scope and info.local_scope == protocol.local_scope() and len(info.data_ipc) > pick:
        return f"ipc://@{info.data_ipc[pick]}"
    return f"tcp://[{host}]:{info.data_ports[pick]}" if ":" in host else f"tcp://{host}:{info.data_ports[pick]}"


UNIX_MISSES = 3  # connections in a row to a shard's Unix socket that fail before a lane uses TCP


class Dialer:
    """Where a lane connects and how: the shard's data-plane socket its client id picks (over the shard's Unix socket
    on this machine, ``endpoint``, until ``UNIX_MISSES`` connections in a row to it fail), its credentials (the token,
    in clear or sealed with the session ``ShardInfo`` hands out over TLS), and the hello that presents them."""

    def __init__(self, discover: Callable[[], Any], address: str, client_id: str, token: Optional[str], sealed: bool,
                 ipc: bool) -> None:
        self._discover = discover  # -> the shard's ShardInfoResponse (gRPC)
        self._pick = zlib.crc32(client_id.encode())
        self._token = (token or "").encode()
        self._sealed = sealed  # the client uses TLS: a data plane that hands out no session is not used
        self._ipc, self._unix_misses = ipc, 0
        self.endpoint = ""
        self.rebind(address)

    def rebind(self, address: str) -> None:
        self.address = address
        host = address.rsplit(":", 1)[0]
        self._host = host[1:-1] if host.startswith("[") and host.endswith("]") else host

    def connect(self, ctx: zmq.Context) -> Optional[tuple[zmq.Socket, zmq.Socket, Optional[Seal]]]:
        """A DEALER connected to the shard's data plane (its monitor, and with TLS the connection's seal), hello
        sent; None: it has none. ShardUnavailableError: not connected in time."""
        info = self._discover()
        if not info.data_ports:
            return None
        if self._sealed and not info.data_session_id:
            log.warning("shard at %s hands out no data-plane session over TLS; using gRPC streams", self.address)
            return None
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)  # no connection to queue on: never block the lane for good
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        seal, hello = None, [b"", HELLO, self._token]
        self.endpoint = endpoint(info, self._host, self._pick % len(info.data_ports), self._ipc)
        if info.data_regions and self.endpoint.startswith("ipc:") and os.environ.get("SHARDPS_DATA_REGIONS") != "0":
            hello.append(region.ASK)  # a Unix socket: ask for shared memory (``shardps.core.region``)
        if info.data_session_id:  # the shard serves TLS: this connection's session, handed out over TLS
            sid = bytes(info.data_session_id)
            seal = Seal(bytes(info.data_session_key), sending=TO_SHARD, receiving=TO_CLIENT)
            hello = [b"", HELLO, sid, *seal.seal(self._token, HELLO_AAD + sid)]
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        sock.connect(self.endpoint)
        try:
            sock.send_multipart(hello)
        except zmq.Again:  # not connected within SEND_TIMEOUT_MS (the shard died again): retried as a lost one
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            self.unix_missed()
            raise ShardUnavailableError(f"data plane of shard at {self.address} not connected",
                                        address=self.address) from None
        self._unix_misses = 0
        return sock, monitor, seal

    def unix_missed(self) -> bool:
        """Whether the connection that failed was to a Unix socket; after ``UNIX_MISSES`` in a row (the same scope
        yet not reachable, a sandbox, say; not a shard restarting) the lane uses TCP from then on."""
        if not self.endpoint.startswith("ipc:"):
            return False
        self._unix_misses += 1
        if self._unix_misses >= UNIX_MISSES:
            log.warning("data plane of shard at %s: Unix socket %s not reachable; using TCP", self.address,
                        self.endpoint)
            self._ipc = False
        return True
