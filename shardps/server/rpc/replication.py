"""The Replicate call of a replica group over gRPC: the primary's handler (``serve``) and a backup's client of it
(``GrpcStream``), translating between ``ReplicaAck`` / ``ReplicaFrame`` and the replica layer's plain values
(``shardps.server.replica.member``).

A backup's outbound calls authenticate as every client-side tool does (``rpc.outbound``).
"""

from __future__ import annotations

import queue
from typing import Any, Iterator, Optional

import grpc

from shardps.core import protocol
from shardps.core.errors import InvalidArgument
from shardps.server.durability.replication import Shipped
from shardps.server.replica import shipping
from shardps.server.replica.frames import Frame, Hello
from shardps.server.replica.member import ReplicaMember
from shardps.server.rpc import outbound
from shardps.v1 import shardps_pb2 as pb

MAX_MESSAGE = outbound.MAX_MESSAGE


def hello_of(msg: pb.ReplicaAck) -> Hello:
    """A backup's hello, checked for its parts."""
    if not msg.HasField("hello"):
        raise InvalidArgument("a Replicate stream begins with a hello")
    h = msg.hello
    if not h.member or not h.cluster:
        raise InvalidArgument("a replica's hello names its cluster and member")
    return Hello(h.cluster, h.shard_map.shard_index, h.shard_map.num_shards, h.member, h.lsn, h.last_epoch, h.epoch,
                 h.copy)


def frame_to_pb(f: Frame) -> pb.ReplicaFrame:
    out = pb.ReplicaFrame(epoch=f.epoch, copied=f.copied, history=[x for pair in f.history for x in pair])
    out.records.extend(pb.ReplicaRecord(lsn=r.lsn, epoch=r.epoch, kind=r.kind, payload=r.payload) for r in f.records)
    if f.file is not None:
        name, offset, data, last = f.file
        out.file.CopyFrom(pb.ReplicaFile(name=name, offset=offset, data=data, last=last))
    return out


def frame_of(msg: pb.ReplicaFrame) -> Frame:
    if len(msg.history) % 2:
        raise InvalidArgument("a frame's epoch history holds (epoch, first record) pairs")
    records = [Shipped(r.lsn, r.epoch, r.kind, bytes(r.payload)) for r in msg.records]
    for a, b in zip(records, records[1:]):
        if b.lsn != a.lsn + 1 or b.epoch < a.epoch:
            raise InvalidArgument(f"records {a.lsn} and {b.lsn} of a frame do not follow each other")
    f = msg.file
    return Frame(msg.epoch, records, (f.name, f.offset, bytes(f.data), f.last) if msg.HasField("file") else None,
                 msg.copied, list(zip(msg.history[::2], msg.history[1::2])))


def serve(member: Optional[ReplicaMember], requests: Iterator[pb.ReplicaAck],
          context: grpc.ServicerContext) -> Iterator[pb.ReplicaFrame]:
    """The primary's side of a backup's stream (the call chain authenticated it)."""
    hello = hello_of(next(requests))  # (a malformed first message is refused as such)
    if member is None:
        raise InvalidArgument("this shard is not a member of a replica group (shardps serve --replicas)")

    def acks() -> Iterator[int]:
        for msg in requests:
            yield msg.lsn

    for frame in shipping.serve(member, hello, acks(), context.is_active):
        yield frame_to_pb(frame)


class GrpcStream:
    """A backup's stream to its primary at ``address``: the hello first, acknowledgements as it stores records."""

    def __init__(self, address: str, hello: Hello, timeout: float = 10.0) -> None:
        self.address = address
        self._channel = outbound.channel(address)
        method = self._channel.stream_stream(protocol.METHODS["Replicate"].path,
                                             request_serializer=pb.ReplicaAck.SerializeToString,
                                             response_deserializer=pb.ReplicaFrame.FromString)
        self._queue: queue.Queue[Optional[pb.ReplicaAck]] = queue.Queue()
        self._queue.put(pb.ReplicaAck(hello=pb.ReplicaHello(
            cluster=hello.cluster, shard_map=pb.ShardMap(shard_index=hello.shard_index, num_shards=hello.num_shards),
            member=hello.member, lsn=hello.lsn, last_epoch=hello.last_epoch, epoch=hello.epoch, copy=hello.copy)))
        self._call: Any = method(self._requests(), metadata=outbound.metadata())
        self._timeout = timeout

    def _requests(self) -> Iterator[pb.ReplicaAck]:
        while True:
            msg = self._queue.get()
            if msg is None:
                return
            yield msg

    def frames(self) -> Iterator[Frame]:
        try:
            for msg in self._call:
                yield frame_of(msg)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                raise ConnectionError(f"Replicate from {self.address}: {e.code().name}: {e.details()}") from None

    def ack(self, lsn: int) -> None:
        self._queue.put(pb.ReplicaAck(lsn=lsn))

    def close(self) -> None:
        self._queue.put(None)
        self._call.cancel()
        self._channel.close()
