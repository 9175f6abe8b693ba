"""``Transport``: channels, stubs and lanes to every shard of a cluster, and the three ways to call them:

- ``call``: one unary call with the client's deadline, retried with backoff while
  the shard is UNAVAILABLE (restarting, not yet up) for up to ``retry_timeout``;
- ``fan_out``: unary calls on several shards in parallel (gRPC's own futures);
- ``submit``: a call on the shard's ``Lane``, in order after this client's earlier ones.

A shard run as a replica group gets its calls at its primary, found again after a failover (``failover``); with
``stale_reads`` its pulls go to a lane of its own to one of its backups (``read_calls``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import random
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Optional, Sequence

import grpc

from shardps.core import protocol, wire
from shardps.v1 import shardps_pb2 as pb
from shardps_client.errors import ShardpsError, ShardRemovedError, answered_unavailable
from shardps_client.transport.channels import TLS, Channels, Stub, find_backup, locate_primary, members
from shardps_client.transport.lane import (
    PROBE_EVERY_S,
    STALL_PROBE_S,
    Lane,
    from_rpc_error,
    removed_error,
    resolve,
    timed_out,
    unavailable,
)

log = logging.getLogger(__name__)

DISCOVER_S = 2.0  # the deadline of a replica group member's ShardInfo when a lane connects to it
PROBE_DEADLINE_S = 0.3  # a stall probe's deadline per member (``newer_primary``)
CLOSED = "this client is closed (Client.close() was called, or its `with` block ended): make a new Client"


class Transport:
    """Channels, stubs and lanes to every shard of a cluster.

    Args:
        addresses: shard addresses, in shard index order (a replica group's: its members joined by "|").
        timeout: deadline in seconds of every call.
        retry_timeout: how long calls keep retrying a shard that is UNAVAILABLE.
        max_message_bytes: the largest request the client makes (channels accept a little more).
        tls: TLS to the shards (None: plaintext).
        token: the bearer token every call carries (None: none).
        data_plane: "zmq": a shard's pulls and pushes over its data plane (ZeroMQ, ``data_plane.DataLane``)
            when it has one (over a Unix socket when the shard runs on this machine, in this network namespace, else
            TCP), else on a gRPC stream; "zmq-tcp": the same, always over TCP; "grpc": always on gRPC streams.
        client_id: the client's id (picks the data-plane port it uses).
        stale_reads: a replica group's pulls go to one of its backups (rows as of the records it has applied).
    """

    def __init__(self, addresses: Sequence[str], timeout: float, retry_timeout: float, max_message_bytes: int,
                 tls: Optional[TLS] = None, token: Optional[str] = None, data_plane: str = "zmq",
                 client_id: str = "", stale_reads: bool = False) -> None:
        if data_plane not in ("zmq", "zmq-tcp", "grpc"):
            raise ValueError(f"data_plane must be 'zmq', 'zmq-tcp' or 'grpc', got {data_plane!r}")
        self.groups = [members(a) for a in addresses]  # [] for a shard removed from the cluster (its entry "")
        self.addresses = [g[0] if g else "" for g in self.groups]
        self.timeout, self.retry_timeout = timeout, retry_timeout
        self.closed = False  # (``close``: every later call is refused, saying so)
        self.channels = Channels(max_message_bytes, tls, token)
        self._failover_locks = [threading.Lock() for _ in self.groups]
        self.stale_reads = stale_reads
        self._read_lanes: dict[int, Lane] = {}  # a replica group's lane to a backup, for stale reads
        self.epochs = [0] * len(self.groups)  # the epoch of the primary each group's calls go to (0: unknown)
        for i, group in enumerate(self.groups):  # a replica group: start at its primary, when one answers
            if len(group) > 1:
                primary, self.epochs[i] = locate_primary(self.channels, group, timeout)
                self.addresses[i] = primary or group[0]
        self._stubs = [Stub(self.channels.get(a)) if a else None for a in self.addresses]
        self._zmq, self._ipc = data_plane != "grpc" and importlib.util.find_spec("zmq") is not None, data_plane == "zmq"
        self._client_id, self._token = client_id, token
        self._grow_lock = threading.Lock()
        # Whether a shard that does not answer is out of the cluster (the session's slot map says so).
        self.gone: Callable[[int], bool] = lambda shard: False
        # One lane per shard carries this client's pulls and pushes to it on one stream, in the
        # order they were made (optimizers such as Adam are not commutative, and a pull sees the
        # pushes before it), many in flight; lanes of different shards run in parallel.
        self.lanes: list[Any] = [self._lane(i) for i in range(len(self.addresses))]

    def _lane(self, i: int) -> Any:
        """Shard ``i``'s lane: its data plane's, over a gRPC stream lane it falls back to."""
        a = self.addresses[i]
        if not a:
            return _Removed(i)
        group = len(self.groups[i]) > 1
        lane = Lane(self.channels.get(a), a, functools.partial(self.call, i), self.timeout, self.retry_timeout,
                    functools.partial(self.failover, i), lambda: self.gone(i),
                    functools.partial(self.newer_primary, i) if group else None)
        lane.group = group
        if not self._zmq:
            return lane
        from shardps_client.data_plane import DataLane

        # (its ShardInfo is asked once per connection: a shard that does not answer is retried by the lane, which stops
        # when closed; with TLS the answer carries the connection's session)
        # A replica group's member is asked with a short deadline: one that is frozen, cut off or stuck on its disk
        # answers nothing, and the lane then asks the group who its primary is instead of waiting out the deadline.
        discover = functools.partial(self.call, i, "ShardInfo", pb.ShardInfoRequest(data_session=True), False,
                                     min(self.timeout, DISCOVER_S) if group else None)
        return DataLane(lane, discover, a, self._client_id, self._token, resolve, timed_out, unavailable, self.timeout,
                        self.retry_timeout, functools.partial(self.failover, i), removed_error,
                        sealed=self.channels.tls is not None, ipc=self._ipc,
                        newer_primary=functools.partial(self.newer_primary, i) if group else None)

    def add_shards(self, entries: Sequence[str]) -> None:
        """Shards added to the cluster (a slot map naming more than this client knew): their entries (an address,
        or a replica group's members joined by "|") take the next indices."""
        with self._grow_lock:
            for entry in entries:
                group = members(entry)
                self.groups.append(group)
                self._failover_locks.append(threading.Lock())
                primary, epoch = locate_primary(self.channels, group, self.timeout) if len(group) > 1 else (None, 0)
                self.epochs.append(epoch)
                self.addresses.append(primary or (group[0] if group else ""))
                self._stubs.append(Stub(self.channels.get(self.addresses[-1])) if group else None)
                self.lanes.append(self._lane(len(self.addresses) - 1))

    def failover(self, shard: int) -> bool:
        """Point shard ``shard``'s calls at its replica group's primary if that changed (a lost shard's caller asks);
        True when they were pointed elsewhere."""
        if len(self.groups[shard]) == 1:
            return False
        with self._failover_locks[shard]:
            primary, epoch = locate_primary(self.channels, self.groups[shard], self.timeout)
            if primary is None or primary == self.addresses[shard]:
                self.epochs[shard] = max(self.epochs[shard], epoch) if primary is not None else self.epochs[shard]
                return False
            log.info("shard %d: its primary is now %s, epoch %d (was %s, epoch %d)", shard, primary, epoch,
                     self.addresses[shard], self.epochs[shard])
            self.epochs[shard] = epoch
            self.addresses[shard] = primary
            channel = self.channels.get(primary)
            self._stubs[shard] = Stub(channel)
            lane = self.lanes[shard]
            getattr(lane, "fallback", lane).rebind(channel, primary)
            if lane is not getattr(lane, "fallback", lane):
                lane.rebind(primary)
            return True

    def group_result(self, shard: int, future: Any) -> Any:
        """A replica group's unary call's result; while it waits longer than ``STALL_PROBE_S`` the group is asked
        whether a newer primary took over, and if one did the call is cancelled (``_Deposed``: the caller sends it
        there) rather than waited on until its deadline."""
        start = time.monotonic()
        while True:
            try:
                return future.result(timeout=PROBE_EVERY_S)
            except grpc.FutureTimeoutError:
                if time.monotonic() - start >= STALL_PROBE_S and self.newer_primary(shard):
                    future.cancel()
                    raise _Deposed() from None

    def newer_primary(self, shard: int) -> bool:
        """Whether shard ``shard``'s replica group has a primary of a newer epoch than the member its calls go to
        (asked when a call has waited long: that member may be frozen, cut off, or stuck on its disk, answering
        nothing and resetting nothing while the group moved on)."""
        # (a short deadline: members answer ShardInfo in milliseconds; one that does not is the one being left)
        primary, epoch = locate_primary(self.channels, self.groups[shard], min(self.timeout, PROBE_DEADLINE_S))
        newer = primary is not None and primary != self.addresses[shard] and epoch > self.epochs[shard]
        log.debug("shard %d: a call to %s (epoch %d) waits; the group says %s (epoch %d)", shard, self.addresses[shard],
                  self.epochs[shard], primary, epoch)
        if newer:
            log.info("shard %d: a call to %s (epoch %d) waits while %s is the primary of epoch %d: leaving it", shard,
                     self.addresses[shard], self.epochs[shard], primary, epoch)
        return newer

    def _read_lane(self, shard: int) -> Lane:
        """Where shard ``shard``'s stale reads go: a lane to one of its backups (its primary's while none answers)."""
        lane = self._read_lanes.get(shard)
        if lane is not None:
            return lane
        group = self.groups[shard]
        address = find_backup(self.channels, group, self.timeout) or self.addresses[shard]

        def unary(method: str, request: bytes) -> Any:
            a = self._read_lanes[shard].address
            try:
                return getattr(Stub(self.channels.get(a)), method)(request, timeout=self.timeout)
            except grpc.RpcError as e:
                raise from_rpc_error(e, a, method) from None

        def lost() -> bool:  # another backup, when one answers
            now = self._read_lanes[shard]
            other = find_backup(self.channels, group, self.timeout, avoid=now.address)
            if other is None or other == now.address:
                return False
            now.rebind(self.channels.get(other), other)
            return True

        lane = self._read_lanes[shard] = Lane(self.channels.get(address), address, unary, self.timeout,
                                              self.retry_timeout, lost)
        return lane

    def read_calls(self, calls: list[tuple[int, str, Any]], then: Callable[[], None] = lambda: None) -> list[Any]:
        """``lane_calls`` for pulls: with ``stale_reads``, a replica group's go to a backup's lane."""
        if not self.stale_reads:
            return self.lane_calls(calls, then)
        return self.lane_calls(calls, then, lambda s: self._read_lane(s) if len(self.groups[s]) > 1 else self.lanes[s])

    @property
    def streaming(self) -> bool:
        """True while every shard takes this client's calls on streams (so a pull follows earlier pushes)."""
        return all(lane.streaming for lane in self.lanes)

    def data_planes(self) -> list[str]:
        """How each shard's pulls and pushes travel: "zmq" (TCP), "zmq-ipc" (a Unix socket), "zmq-shm" (a Unix
        socket and a shared-memory region, ``shardps.core.region``), "grpc-stream", "grpc-unary" or "" (not connected
        yet: its first hello is not answered)."""
        out = []
        for lane in self.lanes:
            mode = getattr(lane, "mode", "grpc")
            mode = None if mode == "zmq" and not getattr(lane, "_reached", True) else mode
            grpc_lane = getattr(lane, "fallback", lane)
            ipc = mode == "zmq" and lane.endpoint.startswith("ipc:")
            shm = ipc and getattr(lane, "shared_memory", False)
            out.append("zmq-shm" if shm else "zmq-ipc" if ipc else "zmq" if mode == "zmq" else "" if mode is None else
                       "grpc-stream" if grpc_lane.streaming else "grpc-unary")
        return out

    def call(self, shard: int, method: str, request: Any, retry: bool = True, timeout: Optional[float] = None) -> Any:
        """One RPC with a deadline (the client's, or ``timeout``), retried with backoff while the shard is
        UNAVAILABLE."""
        if self._stubs[shard] is None:
            raise self.lanes[shard].error(method)
        deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
        while True:
            address = self.addresses[shard]
            try:
                stub = getattr(self._stubs[shard], method)
                if len(self.groups[shard]) == 1:
                    return stub(request, timeout=timeout or self.timeout)
                return self.group_result(shard, stub.future(request, timeout=timeout or self.timeout))
            except _Deposed:
                self.failover(shard)
                continue
            except grpc.RpcError as e:
                if retry and e.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() + delay < deadline:
                    if self.failover(shard):  # a replica group's new primary: at once
                        continue
                    time.sleep(delay * (0.5 + random.random()))
                    delay = min(delay * 2, 1.0)
                    continue
                raise from_rpc_error(e, address, method) from None

    def fan_out(self, calls: list[tuple[int, str, Any]]) -> list[Any]:
        """Run calls on their shards in parallel; results in order; raises the first error.

        Uses gRPC's own futures (no thread pool), so it is safe from any thread,
        including the client's pool (prefetches); a call whose shard is
        UNAVAILABLE is then retried through ``call``'s backoff.
        """
        if len(calls) == 1:
            return [self.call(*calls[0])]
        for s, method, _ in calls:
            if self._stubs[s] is None:
                raise self.lanes[s].error(method)
        futures = [getattr(self._stubs[s], method).future(req, timeout=self.timeout) for s, method, req in calls]

        def result(call: tuple[int, str, Any], f: Any) -> Any:
            try:
                return self.group_result(call[0], f) if len(self.groups[call[0]]) > 1 else f.result()
            except _Deposed:
                self.failover(call[0])
                return self.call(*call)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_rpc_error(e, self.addresses[call[0]], call[1]) from None
                return self.call(*call)

        return results([functools.partial(result, call, f) for call, f in zip(calls, futures)])

    def submit(self, shard: int, method: str, framed: bytes, answer_slot: bool = False) -> Future:
        """Queue a call on the shard's lane (``framed``: as its StreamRequest field; ``answer_slot``: see lanes)."""
        return self.lanes[shard].submit(method, framed, answer_slot)

    def request_slot(self, shard: int, nbytes: int) -> Optional[memoryview]:
        """A buffer of ``nbytes`` in a request slot of the shared-memory region of the shard's lane to build a call to
        it in (``shardps.core.region``), or None (no region now, or no slot for it): the call goes in its message."""
        reserve = getattr(self.lanes[shard], "request_slot", None)
        return reserve(nbytes) if reserve is not None else None

    def lane_calls(self, calls: list[tuple[int, str, Any]], then: Callable[[], None] = lambda: None,
                   lane: Optional[Callable[[int], Any]] = None) -> list[Any]:
        """Run calls (messages, or serialized) on their shards' lanes (``lane(shard)``: another lane of it), in
        order after this client's earlier calls on them; ``then()`` once all are sent, before waiting for answers.

        Results in order; raises the first error once every call has finished.
        """
        submit = self.submit if lane is None else lambda s, method, framed: lane(s).submit(method, framed)
        getters = [self._patient(functools.partial(submit, s, method,
                                                   wire.frame(protocol.stream_field(method), _serialized(req))))
                   for s, method, req in calls]
        then()
        return results(getters)

    def resend_delay(self, since: float) -> Optional[float]:
        """Seconds to wait before sending again a call its shard answered UNAVAILABLE, first at ``since``
        (``time.monotonic()``): growing to 1 s, jittered; None once ``retry_timeout`` has passed since then."""
        waited = time.monotonic() - since
        if waited >= self.retry_timeout:
            return None
        return min(1.0, 0.05 + waited / 4) * (0.5 + random.random())

    def _patient(self, submit: Callable[[], Future]) -> Callable[[], Any]:
        """Submit a lane call now; a getter of its result that sends it again while the shard answers it UNAVAILABLE
        (not ready: a checkpoint holding it back too long, say), for up to ``retry_timeout`` from the first such
        answer."""
        future = submit()

        def get() -> Any:
            f, since = future, None
            while True:
                try:
                    return f.result()
                except ShardpsError as e:
                    since = since if since is not None else time.monotonic()
                    delay = self.resend_delay(since) if answered_unavailable(e) else None
                    if delay is None:
                        raise
                    time.sleep(delay)
                    f = submit()

        return get

    def close(self) -> None:
        """Send what the lanes hold, then close them and the channels; every later call fails at once, saying so."""
        for lane in [*self.lanes, *self._read_lanes.values()]:
            lane.close()
        self.channels.close()
        self.closed = True
        self.lanes, self._stubs = [_Removed(i, closed=True) for i in range(len(self.lanes))], [None] * len(self._stubs)


def _serialized(request: Any) -> Any:
    """A call's request as bytes: serialized already (a pull's, ``planner.pull_plan``), or a generated message."""
    return request if isinstance(request, (bytes, bytearray, memoryview)) else request.SerializeToString()


class _Deposed(Exception):
    """A replica group's call was left: the member it waited on is no longer the primary."""


class _Removed:
    """The lane of a shard removed from the cluster (``shardps reshard --remove``): it owns nothing, so nothing is
    routed to it; a call that is fails at once. With ``closed``, every shard's lane once the client is closed."""

    streaming = True
    mode = "grpc"

    def __init__(self, shard: int, closed: bool = False) -> None:
        self.shard = shard
        self.address = ""
        self.closed = closed

    removed = True

    def error(self, method: str) -> ShardpsError:
        if self.closed:
            return ShardpsError(f"{method}: {CLOSED}", address="")
        return ShardRemovedError(f"{method}: shard {self.shard} was removed from the cluster (it has no address)",
                                 address="")

    def submit(self, method: str, request: bytes, answer_slot: bool = False) -> Future:
        f: Future = Future()
        f.set_exception(self.error(method))
        return f

    def close(self, timeout: float = 30.0) -> None:
        return None


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
