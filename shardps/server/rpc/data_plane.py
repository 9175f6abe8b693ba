"""The data plane: pulls and pushes over ZeroMQ (libzmq, through pyzmq), beside gRPC.

gRPC's Python server moves every message through its own threads (a polling thread, a handler thread, copies
under the interpreter lock); on this workload that was 70-75% of a shard's CPU. Here each of ``threads``
ROUTER sockets (a port each) is served by one thread of its own, which receives a request, serves it through
the same call chain as a frame of the gRPC ``Stream`` call (role, fair turn, status, metrics; the handlers of
``DataPath``) and sends the answer: libzmq does the I/O in C, and no message changes threads in Python.

A call that waits (a synchronous step's last part waits for the other workers', an fsync under
``--fsync always``, a throttled or refused caller's pause) must not hold up the other connections of its
socket: the other workers' parts may be behind it. Before it waits (``fair.waiting``) its thread hands the
socket to a new thread (leader/followers: one thread uses a socket at a time) and finishes the call alone;
its answer goes back through the socket's leader, which meanwhile holds the connection's later requests and
serves them after it, in order. Calls that do not wait never change threads.

Protocol (multipart messages; a client connects one DEALER to one of the ports, chosen by its client id):

- ``[request id, frame]``: ``frame`` is a ``StreamRequest`` as the gRPC stream carries it; the answer is
  ``[request id, StreamResponse]``. A connection's requests are served one after another, in the order they
  came (a pull sees the connection's earlier pushes).
- ``[b"", b"hello", token]``: the connection's credentials, first of all when the shard has tokens (the
  token's role then bounds what each request may call). Answered ``[b"", b"ok"]`` or
  ``[b"", b"error", StreamError]``. Until a connection's hello is accepted, its requests are refused
  (UNAUTHENTICATED) before any is decoded.

With TLS every connection is sealed (``shardps.core.seal``: AES-256-GCM under a key of its own). Its client
asks ``ShardInfo`` (over gRPC with TLS: the shard's certificate authenticates it, and the call is encrypted)
for a session, an id and a key the shard keeps for a minute, for one connection. The hello is then
``[b"", b"hello", session id, counter, sealed token]`` and takes the session (its answer sealed too);
requests are ``[request id, counter, sealed StreamRequest]`` and answers ``[request id, counter, sealed
StreamResponse]``, each answer sealed with the session its request came on. A message that does not open
(another key, a byte changed, a counter not the next) is refused before anything in it is decoded, and its
connection is forgotten (``[b"", b"error", StreamError]``, unsealed). Only the shard that holds the
certificate's key learns a session's key, so an answer that opens comes from it.
A request above the size limit (``--max-message-mb``) closes its connection (libzmq's ``MAXMSGSIZE``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Optional

import grpc
import zmq

from shardps.core import region, zmsg
from shardps.core.errors import InvalidArgument, RegionGone, ResourceExhausted, Unauthenticated
from shardps.core.seal import HELLO_AAD, Seal, SealError
from shardps.core.tokens import bearer
from shardps.core.wake import WakePipe
from shardps.server.rpc import fair
from shardps.server.rpc.auth import Tokens
from shardps.server.rpc.chain import CallChain, stream_error
from shardps.server.rpc.plane_links import Connection, Sessions, bind_unix, peer_name, regions_work

log = logging.getLogger(__name__)

HELLO = b"hello"
POLL_MS = 50  # how soon a stopping shard's data-plane threads notice
ANSWER_DRAIN_S = 0.25  # how long a stopping shard keeps its sockets open after the last answers it sent
CLOSE_LINGER_MS = 1000  # how long a stopping shard's sockets keep sending the answers already made
MAX_CONNECTIONS = 4096  # connections whose credentials a socket remembers (the oldest are forgotten first)
MAX_WAITING = 256  # calls waiting off their socket's thread at once (beyond: they wait on it)
MAX_QUEUED = 1024  # requests of one connection held behind its waiting call (beyond: RESOURCE_EXHAUSTED)
RECEIVE_BATCH = 64  # requests served per turn of the poll loop
REGION_IDLE_S = 10.0  # with every region in use, that of a connection idle this long is taken back for a new one
MAX_REVOKED = 4096  # connections whose region was taken back that a socket remembers (refused until they reconnect)


_Answer = tuple[list, Optional[Seal]]  # an answer's parts, and the session that seals it (None: sent as it is)


class _SocketState:
    """A ROUTER socket and what its leader thread keeps: connections' credentials, connections with a call
    waiting off the socket's thread (and their requests held behind it), and finished calls to answer."""

    def __init__(self, sock: zmq.Socket, port: int) -> None:
        self.sock, self.port = sock, port
        self.leader: Optional[threading.Thread] = None  # the thread serving the socket now
        self.connections: dict[bytes, Connection] = {}
        self.busy: dict[bytes, deque] = {}
        self.revoked: dict[bytes, None] = {}  # connections whose region was taken back: refused, they connect again
        self.done: deque = deque()  # (connection, answer or None, later calls held) of calls that waited, by their thread
        self.wake = WakePipe()  # a thread that finished a waiting call wakes the leader through it


class DataPlane:
    """ZeroMQ sockets serving a shard's pulls and pushes (see the module docstring).

    Args:
        chain: the shard's call chain (what a gRPC stream frame goes through).
        frames: the data path's frame handlers (``DataPath.frames``).
        host: the address to bind (the gRPC server's host).
        ports: the ports to bind, one socket and thread each (0: a free port).
        max_message_bytes: the largest request accepted.
        tokens: bearer tokens (None: every connection allowed).
        encrypted: every connection sealed under a session ``ShardInfo`` hands out (the shard serves TLS).
        ipc: each socket also bound as an abstract Unix socket (Linux), for clients in the shard's network
            namespace on its machine (``protocol.local_scope``): the same requests, answers, tokens and seals,
            with less of the kernel's TCP work per message.
        regions: shared-memory regions (``shardps.core.region``) given at once to Unix-socket connections that
            ask for one (0: none). With all in use, a new connection's takes that of one idle ``REGION_IDLE_S``.
    """

    def __init__(self, chain: CallChain, frames: dict, host: str, ports: list[int], max_message_bytes: int,
                 tokens: Optional[Tokens], encrypted: bool, ipc: bool = True, regions: int = 0) -> None:
        self.chain = chain
        self.frames = frames
        self.tokens = tokens
        self.sessions = Sessions() if encrypted else None
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self.ports: list[int] = []
        host = "*" if host in ("0.0.0.0", "::") else host
        for port in ports:
            sock = self._ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + 64 * 1024)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if port:
                sock.bind(f"tcp://{host}:{port}")
            else:
                port = sock.bind_to_random_port(f"tcp://{host}")
            self._sockets.append(sock)
            self.ports.append(port)
        self.ipc: list[str] = bind_unix(self._sockets) if ipc else []  # the Unix sockets' names, one per port
        # Regions (no TLS: a sealed connection's messages stay sealed): a slot holds an answer up to the message limit.
        self.regions = regions if self.ipc and not encrypted and regions_work() else 0
        self._slot_bytes = min(region.SLOT_BYTES, max_message_bytes)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()  # every thread serving or finishing a call
        self.waiting = 0  # calls waiting off their socket's thread now
        self.handoffs = 0  # calls that handed their socket to another thread, since start
        self.failure = ""  # why a socket stopped being served (empty: every one is)
        self._states = [_SocketState(sock, port) for sock, port in zip(self._sockets, self.ports)]

    def healthy(self) -> str:
        """Empty while every socket is served; else why one is not (the shard's health turns NOT_SERVING)."""
        if self.failure:
            return self.failure
        for st in self._states:
            if st.leader is None or not st.leader.is_alive():
                # A handover starts the next leader before the old one stops: read again before concluding.
                time.sleep(0.05)
                if st.leader is None or not st.leader.is_alive():
                    return f"data-plane port {st.port}: no thread serves it"
        return ""

    def start(self) -> DataPlane:
        for st in self._states:
            self._spawn(st)
        return self

    def stop(self) -> None:
        """Stop serving (requests not answered are resent by their clients to the next shard process)."""
        self._stop.set()
        deadline = time.monotonic() + 5.0
        while True:
            with self._lock:
                alive = [t for t in self._threads if t.is_alive()]
            if not alive or time.monotonic() > deadline:
                break
            alive[0].join(max(0.0, deadline - time.monotonic()))
        if alive:  # a thread still serves a call (it could not hand its socket over): the sockets are its
            log.warning("data plane: %d thread(s) still serving after 5 s; their answers are not sent", len(alive))
        for st in self._states if not alive else ():
            _answer_finished(st)
        if any(st.connections for st in self._states):
            # libzmq hands answers to the kernel, which must deliver them before the sockets close: a socket
            # closed with a client's bytes unread (a heartbeat, a request come too late) resets its connection,
            # and what the kernel had not sent yet is dropped. Meanwhile libzmq's I/O threads read what comes.
            time.sleep(ANSWER_DRAIN_S)
        for st in self._states:
            st.sock.close(CLOSE_LINGER_MS)  # the answers already made still go out (each client settles them)
            st.wake.close()
        self._ctx.term()

    # ---- serving a socket: one leader thread at a time ----------------------------------------

    def _spawn(self, st: _SocketState) -> None:
        t = threading.Thread(target=self._lead, args=(st,), name=f"data-plane-{st.port}", daemon=True)
        with self._lock:
            self._threads = {x for x in self._threads if x.is_alive()}
            self._threads.add(t)
        t.start()

    def _lead(self, st: _SocketState) -> None:
        """Serve ``st``'s socket until the shard stops or this thread hands the socket over (a call it serves
        is about to wait: the call finishes here, its answer goes back through the socket's next leader)."""
        st.leader = threading.current_thread()
        zmsg.answer_in_place()  # large answers made on this thread go out of libzmq's memory without a copy
        try:
            self._lead_until_handed_over(st)
        except Exception as e:  # noqa: BLE001 - the socket has no server now: health says so (NOT_SERVING)
            if not self._stop.is_set():
                log.exception("data plane: the thread of port %d failed", st.port)
                self.failure = f"data-plane port {st.port}: {e!r}"

    def _lead_until_handed_over(self, st: _SocketState) -> None:
        poller = zmq.Poller()
        poller.register(st.sock, zmq.POLLIN)
        poller.register(st.wake.fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(POLL_MS))
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                raise
            if st.wake.fd in ready:
                st.wake.drain()
            while st.done:  # calls finished off the socket's thread: answer, then their connection's next
                rid, reply, ordered = st.done.popleft()
                if reply is not None:
                    _send(st, reply)
                if ordered and not self._resume(st, rid):
                    return
            if st.sock in ready and not self._receive(st):
                return

    def _receive(self, st: _SocketState) -> bool:
        """Serve the requests waiting on the socket; False once this thread handed the socket over."""
        for _ in range(RECEIVE_BATCH):
            if not st.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # (asked first: pyzmq's Again costs a raise)
                return True
            try:
                parts = st.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return True
            rid = parts[0].bytes
            queued = st.busy.get(rid)
            if queued is not None:  # its connection's earlier call is waiting: this one goes after it
                if len(queued) >= MAX_QUEUED:
                    self._refuse_queued(st, rid, parts)
                else:
                    queued.append(parts)
                continue
            if not self._serve(st, rid, parts):
                return False
        return True

    def _resume(self, st: _SocketState, rid: bytes) -> bool:
        """Serve what a connection sent while its call waited, in order; False once this thread handed over."""
        queued = st.busy[rid]
        while queued:
            if not self._serve(st, rid, queued.popleft()):
                return False  # a queued call waits in turn: the rest stay queued behind it
        del st.busy[rid]
        return True

    def _serve(self, st: _SocketState, rid: bytes, parts: list[Any]) -> bool:
        """One request, answered; False if it waited off the socket's thread (this thread no longer leads)."""
        handed = held = False

        def hand_off(ordered: bool) -> None:
            nonlocal handed, held
            with self._lock:
                if self.waiting >= MAX_WAITING or self._stop.is_set():
                    return  # too many waiting already: this one waits on the socket's thread
                self.waiting += 1
                self.handoffs += 1
            handed = True
            # Its connection's later calls are held behind it (a quorum's wait holds none back), and so are the
            # calls still queued behind an earlier waiting call of the connection (``_resume`` serves them in
            # turn: once this one is answered the next leader goes on with them, or they would wait for good).
            if ordered or rid in st.busy:
                held = True
                st.busy.setdefault(rid, deque())
            self._spawn(st)

        fair.on_wait(hand_off)
        reply: Optional[_Answer] = None
        try:
            reply = self._one(rid, parts, st)
        except Exception:  # noqa: BLE001 - a bug must not stop the socket: logged, the request unanswered
            log.exception("data plane: request from %s failed", rid.hex())
        finally:
            fair.on_wait(None)
        if handed:
            with self._lock:
                self.waiting -= 1
            st.done.append((rid, reply, held))
            st.wake.wake()
            return False
        if reply is not None:
            _send(st, reply)
        return True

    def _refuse_queued(self, st: _SocketState, rid: bytes, parts: list[Any]) -> None:
        if len(parts) < 3 or not parts[1].bytes:
            return  # not a request (or a hello): nothing to answer
        error = ResourceExhausted(f"data plane: over {MAX_QUEUED} requests of this connection wait behind "
                                  "its waiting call")
        code, message, kind = self.chain.status(error, "Stream")
        conn = st.connections.get(rid)
        if conn is not None and conn.seal is not None:  # its counter would be skipped: the connection must go
            _send(st, _end_session(st.connections, rid, code, message, kind))
            return
        _send(st, ([rid, parts[1].bytes, stream_error(code, message, kind)], None))

    def _one(self, rid: bytes, parts: list[Any], st: _SocketState) -> Optional[_Answer]:
        if len(parts) < 3:
            self.chain.slow_refusal(peer_name(rid, parts[-1]), grpc.StatusCode.INVALID_ARGUMENT, sum(len(p) for p in parts))
            return None  # not a request: no request id to answer
        request_id = parts[1].bytes
        connections = st.connections
        if not request_id:
            fields, seal = self._hello(rid, parts[2:], peer_name(rid, parts[-1]), st)
            return [rid, b"", *fields], seal
        conn = connections.get(rid)
        if conn is None:  # (a known connection's peer was named at its first request: not looked up per request)
            peer = peer_name(rid, parts[-1])
            if rid in st.revoked:  # its region was taken back: nothing more of it is served
                return self._refuse(rid, request_id, RegionGone(
                    "data plane: this connection's shared-memory region was taken back (it was idle while other "
                    "connections needed one); connect again"), peer, 0)
            if self.tokens is not None or self.sessions is not None:
                error = Unauthenticated("data plane: this connection has not presented its credentials (hello)")
                return self._refuse(rid, request_id, error, peer, len(parts[2]))
            conn = _remember(rid, Connection(None, peer, 1.0, peer), st)
        elif next(reversed(connections)) != rid:  # the most recently used last: the first to go are the idle ones
            connections[rid] = connections.pop(rid)
        try:
            frame, answer_slot, target = _read_frame(conn, parts, request_id)
        except SealError as e:  # nothing of it decoded; the connection must make a new session
            code, message, kind = self.chain.status(Unauthenticated(f"data plane: {e}"), "Stream")
            self.chain.slow_refusal(conn.peer, code, sum(len(p) for p in parts[2:]))
            return _end_session(connections, rid, code, message, kind)
        except region.RegionError as e:  # nothing of it decoded
            return self._refuse(rid, request_id, InvalidArgument(f"data plane: {e}"), conn.peer,
                                sum(len(p) for p in parts[2:]))
        role = conn.grant.role if conn.grant is not None else None
        if conn.region is not None:
            conn.used = time.monotonic()
        if target is not None:
            zmsg.answer_into(target)  # a large answer is written into the slot the client offered
        try:
            reply = self.chain.frame(self.frames, frame, role, conn.key, conn.weight, conn.peer, conn.transport)
        finally:
            built = zmsg.taken() if target is not None else None
        if built is not None and reply is built:
            return [rid, request_id, b"", region.ANSWER.pack(answer_slot, built.nbytes)], None
        return [rid, request_id, reply], conn.seal  # (sealed with it even if the connection is forgotten meanwhile)

    def _refuse(self, rid: bytes, request_id: bytes, error: Exception, peer: str, nbytes: int) -> _Answer:
        code, message, kind = self.chain.status(error, "Stream")
        self.chain.slow_refusal(peer, code, nbytes)
        return [rid, request_id, stream_error(code, message, kind)], None

    def _hello(self, rid: bytes, fields: list[Any], peer: str, st: _SocketState) -> tuple[list, Optional[Seal]]:
        """The hello's answer, and the session to seal it with (None: no session opened); with ``[..., b"region"]``
        on a Unix socket without TLS, the answer ``[b"ok", offer]`` describes the connection's region."""
        seal = None
        try:
            if not fields or fields[0].bytes != HELLO:
                raise Unauthenticated("data plane: a control message must be a hello")
            if self.sessions is not None:
                if len(fields) != 4:
                    raise Unauthenticated("data plane: with TLS a hello is [b'hello', session id, counter, sealed "
                                          "token] (ask ShardInfo over TLS for a session)")
                seal, raw = self.sessions.open_hello(fields[1].bytes, fields[2].buffer, fields[3].buffer)
            elif len(fields) != 2 and (len(fields) != 3 or fields[2].bytes != region.ASK):
                raise Unauthenticated("data plane: a hello is [b'hello', token] or [b'hello', token, b'region']")
            else:
                raw = fields[1].bytes
            token = raw.decode("utf-8", "replace")
            grant = None
            if self.tokens is not None:
                grant = self.tokens.check(bearer(token) if token else (), "Pull")
            key, weight = (grant.key, grant.limits.weight) if grant is not None else (peer, 1.0)
            shm = (_new_region(st, self.regions, self._slot_bytes)
                   if len(fields) == 3 and seal is None and peer.startswith("unix:") else None)
            _remember(rid, Connection(grant, key, weight, peer, seal, shm, time.monotonic()), st)
            return ([b"ok"] if shm is None else [b"ok", shm.offer()]), seal
        except Exception as e:  # noqa: BLE001 - UNAUTHENTICATED / PERMISSION_DENIED, answered
            code, message, kind = self.chain.status(e, "Stream")
            self.chain.slow_refusal(peer, code)
            return [b"error", stream_error(code, message, kind)], seal


def _new_region(st: _SocketState, regions: int, slot_bytes: int) -> Optional[region.ShardRegion]:
    """A new region for a connection of ``st``'s socket, or None: regions are off, or the socket's are all in
    use by connections that sent a request within ``REGION_IDLE_S``. Else the longest idle of them is forgotten
    to make room: its next request is refused (``RegionGone``, and so is all it sends after), and its client
    connects again and sends its calls again, in order."""
    if not regions:
        return None
    live = [(c.used, rid) for rid, c in st.connections.items() if c.region is not None]
    if len(live) >= regions:
        used, rid = min(live)
        if time.monotonic() - used < REGION_IDLE_S:
            return None
        del st.connections[rid]
        _forget_region(st, rid)
    try:
        return region.ShardRegion(slot_bytes)
    except OSError as e:  # (out of descriptors or memory): the connection goes through the socket
        log.warning("data plane: no shared-memory region for a connection: %s", e)
        return None


def _remember(rid: bytes, conn: Connection, st: _SocketState) -> Connection:
    connections = st.connections
    connections.pop(rid, None)
    connections[rid] = conn
    while len(connections) > MAX_CONNECTIONS:
        gone = next(iter(connections))
        if connections.pop(gone).region is not None:  # refused from now on, as a region taken back
            _forget_region(st, gone)
    return conn


def _answer_finished(st: _SocketState) -> None:
    """Calls that finished off the socket's thread (they waited: a synchronous step, a checkpoint's hold) after its
    last leader stopped left their answers in ``st.done``: sent, so a push applied is not left unanswered (its client
    would send it again: to another shard, if this one left the cluster)."""
    sent = 0
    while st.done:
        _, reply, _ = st.done.popleft()
        if reply is not None:
            try:
                _send(st, reply, zmq.NOBLOCK)
                sent += 1
            except zmq.ZMQError as e:  # that connection is gone: its client resends the call
                log.info("data plane: an answer made while stopping was not sent: %s", e)
    if sent:
        log.info("data plane: %d answer(s) of calls that finished while it stopped sent", sent)


def _read_frame(conn: Connection, parts: list[Any], request_id: bytes) -> tuple[Any, int, Optional[memoryview]]:
    """A request's frame (opened with its connection's seal; copied out of its region's request slot), the answer slot
    of the region it offers and a view of it (NO_SLOT, None: none). SealError, RegionError: nothing of it was read."""
    if conn.seal is not None:
        if len(parts) != 4:
            raise SealError(f"a sealed request has 3 parts (request id, counter, sealed), got {len(parts) - 1}")
        return conn.seal.open(parts[2].buffer, parts[3].buffer, request_id), region.NO_SLOT, None
    if len(parts) != 4:
        return parts[2].buffer, region.NO_SLOT, None
    if conn.region is None:  # [rid, request id, region descriptor, frame or b""]
        raise region.RegionError("a request names a shared-memory region this connection was not given (its hello "
                                 "asked for none, or it is not over the Unix socket)")
    return conn.region.request(parts[2].buffer, parts[3].buffer)


def _end_session(connections: dict[bytes, Connection], rid: bytes, code: grpc.StatusCode, message: str,
                 kind: str) -> _Answer:
    """Forget a sealed connection whose counters can no longer agree (a request that did not open, one refused
    unread): its answer is an unsealed error in the hello's place, and the client makes a new session."""
    connections.pop(rid, None)
    return [rid, b"", b"error", stream_error(code, message, kind)], None


def _send(st: _SocketState, answer: _Answer, flags: int = 0) -> None:
    """Send an answer, ``[rid, request id, StreamResponse]`` or a hello's ``[rid, b"", b"ok" / b"error", ...]``,
    sealed now with the session its request came on (in the order answers leave: the counters rise as the
    client receives them). Only refusals of what came with no session (no hello, a hello that did not open, a
    request that did not open) leave unsealed."""
    reply, seal = answer
    if seal is not None:
        rid, request_id, body = reply[0], reply[1], reply[-1]
        if request_id:
            reply = [rid, request_id, *seal.seal(body, request_id)]
        else:  # the hello's answer: b"ok", or b"error" and its StreamError
            what = reply[2]
            reply = [rid, b"", what, *seal.seal(body if what != b"ok" else b"", HELLO_AAD + what)]
    # A large answer was built in a libzmq message (``zmsg``: sent from it, no copy); the rest is copied into libzmq's
    # messages, not sent zero-copy: pyzmq frees a zero-copy frame through its garbage-collector thread, a Python
    # thread woken per message that takes the GIL from the thread serving calls (docs/performance.md).
    zmsg.send_multipart(st.sock, reply, flags)


def _forget_region(st: _SocketState, rid: bytes) -> None:
    """Connection ``rid`` of ``st``'s socket lost its region: its requests are refused until it connects again (one
    naming the region cannot be read, and none sent after it may be served before it)."""
    st.revoked[rid] = None
    while len(st.revoked) > MAX_REVOKED:
        st.revoked.pop(next(iter(st.revoked)))
