"""The client's transport, and its only module that imports grpc: channels, deadlines, retries, lanes.

``Transport`` holds one channel per shard and offers three ways to call:

- ``call``: one unary call with the client's deadline, retried with backoff while
  the shard is UNAVAILABLE (restarting, not yet up) for up to ``retry_timeout``;
- ``fan_out``: unary calls on several shards in parallel (gRPC's own futures);
- ``submit``: a call on the shard's ``Lane``, in order after this client's earlier ones.

Every gRPC error becomes a client exception here (``from_rpc_error``,
``from_status``; which one is decided by ``shardps_client.errors``).

Lanes
-----

Optimizers such as Adam are not commutative, so a client's pushes must reach a
shard in the order they were made, and a pull should see the client's earlier
pushes. Separate unary calls give no such order (the shard's handler threads
may run them in any order), so the lane sends every call on one ``Stream``:
the shard serves the messages in the order they arrive and answers each in
order. Pushes need no round trip each (many stay in flight), a pull needs no
wait for earlier pushes to be acknowledged, and a message on an open stream
costs both sides about half the CPU of a unary call (measured with 563 KB
replies on loopback: 0.60 ms round trip against 1.1 ms).

When the stream breaks (the shard restarts, or stops and cancels it), the
lane opens a new one and resends every call not yet answered, in order, with
backoff for up to ``retry_timeout`` seconds; (client id, seq) dedup on the
shard makes a resent push that was already applied a no-op, and pulls are
idempotent. A shard that refuses streams (RESOURCE_EXHAUSTED: too many open;
UNIMPLEMENTED: an older server) gets unary calls, one at a time, for the rest
of the client's life.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import pathlib
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Optional, Sequence

import grpc

from shardps.core import protocol, status, wire
from shardps.core.tokens import bearer
from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import ShardpsError, ShardTimeoutError, ShardUnavailableError, error_of

log = logging.getLogger(__name__)

MiB = 1 << 20
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_RESEND = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
_UNSUPPORTED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)


def from_rpc_error(e: grpc.RpcError, address: str, what: str) -> ShardpsError:
    """Translate a gRPC error of call ``what`` to ``address`` into a client exception."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    trailing = e.trailing_metadata() if hasattr(e, "trailing_metadata") else None
    kind = next((v for k, v in trailing or () if k == status.KIND_METADATA), "")
    redirect = next((v for k, v in trailing or () if k == status.REDIRECT_METADATA), "")
    return error_of(code, details, address, what, kind, redirect)


def from_status(code: int, details: str, address: str, what: str, kind: str = "", redirect: str = "") -> ShardpsError:
    """The client exception of a status carried in a message (a StreamError of a call stream)."""
    return error_of(_CODES.get(code, grpc.StatusCode.UNKNOWN), details, address, what, kind, redirect)


def _reply(field: int, view: memoryview) -> Any:
    """A StreamResponse's reply, as the unary call's stub returns it."""
    method = protocol.by_stream_field(field)
    if method is None:
        raise ShardpsError(f"unexpected StreamResponse field {field}")
    return method.decode_reply(view)


def resolve(future: Future, address: str, what: str, field: int, view: memoryview) -> None:
    """Settle the future of call ``what`` with its answer on a stream (or the data plane), a StreamResponse
    (``field``, ``view``): the reply the unary stub would return, or the client exception of its
    StreamError; a malformed reply fails that call alone."""
    try:
        if field == protocol.STREAM_ERROR_FIELD:
            err = pb.StreamError.FromString(bytes(view))
            raise from_status(err.code, err.message, address, what, err.kind, err.redirect)
        future.set_result(_reply(field, view))
    except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the call
        future.set_exception(e)


class _Item:
    __slots__ = ("future", "method", "request", "sent_at")

    def __init__(self, method: str, request: bytes) -> None:
        self.future: Future = Future()
        self.method = method
        self.request = request  # framed as a StreamRequest
        self.sent_at = 0.0


class _Deadline(Exception):
    """Raised by a request iterator to make gRPC cancel its stream."""


class Lane:
    """Ordered, pipelined calls to one shard (see the module docstring).

    Args:
        channel: the shard's channel.
        address: the shard's address (for errors).
        unary: ``unary(method, request_bytes)`` makes one unary call with the
            client's deadline and retries (the fallback when streams are refused).
        timeout: seconds a call may wait for its answer before the stream is
            cancelled and it fails with ShardTimeoutError.
        retry_timeout: seconds to keep reopening a broken stream.
    """

    def __init__(self, channel: grpc.Channel, address: str, unary: Callable[[str, bytes], Any],
                 timeout: float, retry_timeout: float) -> None:
        self._open = channel.stream_stream(protocol.METHODS["Stream"].path, request_serializer=_request_bytes,
                                           response_deserializer=wire.unframe)
        self.address = address
        self._unary = unary
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        self._cv = threading.Condition()
        self._queue: collections.deque[_Item] = collections.deque()  # not yet handed to a stream
        self._unacked: collections.deque[_Item] = collections.deque()  # handed to the current stream, unanswered
        self._generation = 0  # bumped whenever a stream ends: its request iterator must stop
        self._closed = False
        self._timed_out = False
        self._answered = False  # the current stream answered at least once
        self.streaming = True  # False once the shard refused streams: unary calls from then on
        self._thread: Optional[threading.Thread] = None

    def submit(self, method: str, request: bytes) -> Future:
        """Queue a call: ``request`` is its request framed as its StreamRequest field (``protocol.stream_field``).

        The future gets the reply the unary call's stub would return, or its error.
        """
        item = _Item(method, request)
        with self._cv:
            if self._closed:
                raise ShardpsError(f"the client's lane to {self.address} is closed", address=self.address)
            self._queue.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"shardps-lane-{self.address}", daemon=True)
                self._thread.start()
            self._cv.notify_all()
        return item.future

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued, then end the stream and the lane's thread."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ---- the lane's thread ---------------------------------------------------------------

    def _run(self) -> None:
        failing_since: Optional[float] = None
        delay = 0.05
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return  # closed and everything answered
            if not self.streaming:
                self._run_unary()
                continue
            error = self._stream_once()
            if error is None:
                failing_since, delay = None, 0.05
                continue
            code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
            if code in _UNSUPPORTED and not self._answered:
                log.info("shard at %s refused a stream (%s: %s); using unary calls",
                         self.address, code.name, error.details() if hasattr(error, "details") else error)
                self.streaming = False
                continue
            if self._answered:
                failing_since, delay = None, 0.05  # the stream worked before it broke: a fresh retry window
            now = time.monotonic()
            failing_since = failing_since or now
            if code in _RESEND and not self._timed_out and now - failing_since + delay < self.retry_timeout:
                time.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, 1.0)
                continue
            if self._timed_out:
                exc: ShardpsError = ShardTimeoutError(
                    f"Stream to shard at {self.address}: no answer within {self.timeout}s", address=self.address,
                    code=grpc.StatusCode.DEADLINE_EXCEEDED)
            elif code in _RESEND:
                exc = ShardUnavailableError(
                    f"Stream to shard at {self.address} failed ({code.name}) and could not be reopened within "
                    f"{self.retry_timeout}s", address=self.address, code=code)
            else:
                exc = from_rpc_error(error, self.address, "Stream")
            self._fail_all(exc)
            failing_since, delay, self._timed_out = None, 0.05, False

    def _stream_once(self) -> Optional[grpc.RpcError]:
        """Open a stream and run it until it ends; unanswered calls go back to the front of the queue."""
        with self._cv:
            self._generation += 1
            generation = self._generation
        self._answered = False
        call = self._open(self._requests(generation))
        error: Optional[grpc.RpcError] = None
        try:
            for field, view in call:
                with self._cv:
                    item = self._unacked.popleft()
                self._answered = True
                resolve(item.future, self.address, item.method, field, view)
        except grpc.RpcError as e:
            error = e
        finally:
            call.cancel()
            with self._cv:
                self._generation += 1  # stops this stream's request iterator
                self._queue.extendleft(reversed(self._unacked))
                self._unacked.clear()
                self._cv.notify_all()
        return error

    def _requests(self, generation: int) -> Iterator[_Item]:
        """The current stream's requests: queued calls, moved to unacked as they are handed over."""
        while True:
            with self._cv:
                while True:
                    if generation != self._generation:
                        return
                    if self._unacked and time.monotonic() - self._unacked[0].sent_at > self.timeout:
                        self._timed_out = True
                        self._generation += 1
                        self._cv.notify_all()
                        raise _Deadline()  # gRPC cancels the call when its request iterator raises
                    if self._queue:
                        item = self._queue.popleft()
                        item.sent_at = time.monotonic()
                        self._unacked.append(item)
                        break
                    if self._closed:
                        return  # half-close: the shard answers what it has, then ends the stream
                    self._cv.wait(min(1.0, self.timeout))
            yield item

    def _run_unary(self) -> None:
        with self._cv:
            item = self._queue.popleft()
        try:
            item.future.set_result(self._unary(item.method, bytes(wire.unframe(item.request)[1])))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the call
            item.future.set_exception(e)

    def _fail_all(self, exc: ShardpsError) -> None:
        with self._cv:
            items = list(self._queue)
            self._queue.clear()
        for item in items:
            item.future.set_exception(exc)


def _request_bytes(item: _Item) -> bytes:
    return item.request


@dataclasses.dataclass(frozen=True)
class TLS:
    """TLS to the shards: ``ca`` (PEM file) is the CA that signed the shards' certificates; ``cert``
    and ``key`` (PEM files) the client's own, for shards that want mutual TLS; ``server_name``
    overrides the name checked against the shards' certificates (default: the address's host)."""

    ca: str
    cert: Optional[str] = None
    key: Optional[str] = None
    server_name: Optional[str] = None

    @classmethod
    def from_environment(cls) -> Optional[TLS]:
        """TLS from SHARDPS_TLS_CA, SHARDPS_TLS_CLIENT_CERT and SHARDPS_TLS_CLIENT_KEY (the variables
        ``shardps-health`` reads), or None when SHARDPS_TLS_CA is not set."""
        ca = os.environ.get("SHARDPS_TLS_CA")
        if not ca:
            return None
        return cls(ca, os.environ.get("SHARDPS_TLS_CLIENT_CERT") or None, os.environ.get("SHARDPS_TLS_CLIENT_KEY") or None)

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise ValueError("TLS: a client certificate needs its key, and the key its certificate")
        read = lambda p: pathlib.Path(p).read_bytes() if p else None  # noqa: E731
        return grpc.ssl_channel_credentials(read(self.ca), read(self.key), read(self.cert))


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call (only when the client has a token)."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer(token)

    def _details(self, details: Any) -> Any:
        return details._replace(metadata=tuple(details.metadata or ()) + self._metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


class Transport:
    """Channels, stubs and lanes to every shard of a cluster.

    Args:
        addresses: shard addresses, in shard index order.
        timeout: deadline in seconds of every call.
        retry_timeout: how long calls keep retrying a shard that is UNAVAILABLE.
        max_message_bytes: the largest request the client makes (channels accept a little more).
        tls: TLS to the shards (None: plaintext).
        token: the bearer token every call carries (None: none).
        data_plane: "zmq": a shard's pulls and pushes over its data plane (ZeroMQ, ``data_plane.DataLane``)
            when it has one, else on a gRPC stream; "grpc": always on gRPC streams.
        client_id: the client's id (picks the data-plane port it uses).
    """

    def __init__(self, addresses: Sequence[str], timeout: float, retry_timeout: float, max_message_bytes: int,
                 tls: Optional[TLS] = None, token: Optional[str] = None, data_plane: str = "zmq",
                 client_id: str = "") -> None:
        if data_plane not in ("zmq", "grpc"):
            raise ValueError(f"data_plane must be 'grpc' or 'zmq', got {data_plane!r}")
        self.addresses = list(addresses)
        self.timeout = timeout
        self.retry_timeout = retry_timeout
        limit = max(max_message_bytes + 64 * 1024, 4 * MiB)
        options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", limit),
                                          ("grpc.max_send_message_length", limit),
                                          # A connection of its own per client: shards share themselves
                                          # fairly among connections (several clients in one process
                                          # would otherwise share one).
                                          ("grpc.use_local_subchannel_pool", 1)]
        if tls is None:
            self._channels = [grpc.insecure_channel(a, options=options) for a in self.addresses]
        else:
            creds = tls.credentials()
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            self._channels = [grpc.secure_channel(a, creds, options=options) for a in self.addresses]
        if token is not None:
            self._channels = [grpc.intercept_channel(ch, _Token(token)) for ch in self._channels]
        self._stubs = [_Stub(ch) for ch in self._channels]
        # One lane per shard carries this client's pulls and pushes to it on one stream, in the
        # order they were made (optimizers such as Adam are not commutative, and a pull sees the
        # pushes before it), many in flight; lanes of different shards run in parallel.
        self.lanes: list[Any] = [
            Lane(ch, a, functools.partial(self.call, i), timeout, retry_timeout)
            for i, (ch, a) in enumerate(zip(self._channels, self.addresses))
        ]
        if data_plane == "zmq" and _have_zmq():
            from shardps_client.data_plane import DataLane

            self.lanes = [DataLane(lane, functools.partial(self.call, i, "ShardInfo", pb.ShardInfoRequest()),
                                   _host(a), client_id, token, functools.partial(resolve, address=a),
                                   functools.partial(_timed_out, a), functools.partial(_unavailable, a),
                                   timeout, retry_timeout)
                          for i, (lane, a) in enumerate(zip(self.lanes, self.addresses))]

    @property
    def streaming(self) -> bool:
        """True while every shard takes this client's calls on streams (so a pull follows earlier pushes)."""
        return all(lane.streaming for lane in self.lanes)

    def data_planes(self) -> list[str]:
        """How each shard's pulls and pushes travel: "zmq", "grpc-stream", "grpc-unary" or "" (no call yet)."""
        out = []
        for lane in self.lanes:
            mode = getattr(lane, "mode", "grpc")
            grpc_lane = getattr(lane, "fallback", lane)
            out.append("zmq" if mode == "zmq" else "" if mode is None else
                       "grpc-stream" if grpc_lane.streaming else "grpc-unary")
        return out

    def call(self, shard: int, method: str, request: Any, retry: bool = True) -> Any:
        """One RPC with a deadline, retried with backoff while the shard is UNAVAILABLE."""
        stub_method = getattr(self._stubs[shard], method)
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        while True:
            try:
                return stub_method(request, timeout=self.timeout)
            except grpc.RpcError as e:
                if retry and e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() + delay < deadline:
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
                    continue
                raise from_rpc_error(e, self.addresses[shard], method) from None

    def fan_out(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Run calls on their shards in parallel; results in order; raises the first error.

        Uses gRPC's own futures (no thread pool), so it is safe from any thread,
        including the client's pool (prefetches); a call whose shard is
        UNAVAILABLE is then retried through ``call``'s backoff.
        """
        if len(calls) == 1:
            return [self.call(*calls[0])]
        futures = [getattr(self._stubs[s], method).future(req, timeout=self.timeout) for s, method, req in calls]

        def result(call: tuple[int, str, Any], f: Any) -> Any:
            try:
                return f.result()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, self.addresses[call[0]], call[1]) from None
                return self.call(*call)

        return results([functools.partial(result, call, f) for call, f in zip(calls, futures)])

    def submit(self, shard: int, method: str, framed: bytes) -> Future:
        """Queue a call on the shard's lane (``framed``: its request as its StreamRequest field)."""
        return self.lanes[shard].submit(method, framed)

    def lane_calls(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Run calls (messages) on their shards' lanes, in order after this client's earlier calls.

        Results in order; raises the first error once every call has finished.
        """
        futures = [self.submit(s, method, wire.frame(protocol.stream_field(method), req.SerializeToString()))
                   for s, method, req in calls]
        return results([f.result for f in futures])

    def close(self) -> None:
        """Send what the lanes hold, then close them and the channels."""
        for lane in self.lanes:
            lane.close()
        for ch in self._channels:
            ch.close()


def _timed_out(address: str, message: str) -> ShardpsError:
    return ShardTimeoutError(message, address=address, code=grpc.StatusCode.DEADLINE_EXCEEDED)


def _unavailable(address: str, message: str) -> ShardpsError:
    return ShardUnavailableError(message, address=address, code=grpc.StatusCode.UNAVAILABLE)


def _have_zmq() -> bool:
    import importlib.util

    return importlib.util.find_spec("zmq") is not None


def _host(address: str) -> str:
    """The host part of ``host:port`` (``[v6]:port`` too)."""
    host = address.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def results(getters: list[Callable[[], Any]]) -> list[Any]:
    """Every getter's result, in order; once all have finished, raise the first ShardpsError any raised."""
    out, first_error = [], None
    for get in getters:
        try:
            out.append(get())
        except ShardpsError as e:
            first_error = first_error or e
            out.append(None)
    if first_error is not None:
        raise first_error
    return out


class _Stub:
    """A callable per method, with the protocol table's (de)serializers (wire-level for the bulk methods)."""

    def __init__(self, channel: grpc.Channel) -> None:
        for m in protocol.METHODS.values():
            if not m.streaming:
                setattr(self, m.name, channel.unary_unary(m.path, request_serializer=m.encode_request,
                                                          response_deserializer=m.decode_reply))
