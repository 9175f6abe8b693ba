"""The protocol table: every method of ``shardps.v1.Shard``, its messages, and how it travels.

Built from the generated descriptors, so a field number is never written by hand:
the servicer's dispatch, the client's stubs and its stream lanes all read it here.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from shardps.core import wire
from shardps.v1 import shardps_pb2 as pb

SERVICE = "shardps.v1.Shard"


def group_members(entry: str) -> list[str]:
    """A shard's entry in an address list or cluster file: its address, or its replica group's members joined by "|"
    (or ","); what clients, the reshard driver and a shard asking a source group all read it as."""
    return [m.strip() for m in re.split(r"[|,]", entry) if m.strip()]

# gRPC channel options of every channel to a shard (clients', tools', a backup's to its primary): a channel whose
# connection failed reconnects within a second. gRPC's own backoff grows to 120 s, and a client whose channel to a
# replica group's member backed off that far after a network fault could not reach it once it became the primary.
# gRPC core reads grpc.min_reconnect_backoff_ms as the least time a connection attempt (TCP, TLS, HTTP/2 SETTINGS) is
# given, not as a backoff: at 100 ms, attempts to a shard on a loaded 2-core host timed out ("connection attempt timed
# out before receiving SETTINGS frame") and a call failed UNAVAILABLE against a healthy shard. 3 s (gRPC's default is
# 20) leaves room for a busy host and still retries a blackholed address within 3 s.
CONNECT_TIMEOUT_MS = 3000
RECONNECT_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
                     ("grpc.max_reconnect_backoff_ms", 1000))

# Which methods use the hand-written wire codecs (shardps.core.wire) instead of protobuf objects:
_WIRE_REQUESTS = frozenset({"Push", "PushDense", "PushBatch", "Stream"})  # the servicer reads the bytes itself
_WIRE_RESPONSES = frozenset({"Pull", "PullDense", "PullBatch", "PushBatch", "Stream"})  # replies built as bytes


@dataclass(frozen=True)
class Method:
    """One method of the service.

    Args:
        name: the method's name, e.g. "Push".
        request: the generated request class.
        response: the generated response class.
        stream_field: its field in StreamRequest and in StreamResponse (0: not carried on a Stream).
        wire_request: the servicer reads the request's bytes with the wire codecs.
        wire_response: the servicer returns the reply already serialized.
        streaming: a bidirectional stream (Stream itself).
        encode_request: the client's request serializer (wire requests arrive already encoded).
        decode_reply: the client's reply deserializer (wire replies decoded without protobuf objects).
    """

    name: str
    request: Any  # a generated message class
    response: Any
    stream_field: int
    wire_request: bool
    wire_response: bool
    streaming: bool
    encode_request: Callable[[Any], bytes]
    decode_reply: Callable[[Any], Any]

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


def _serialize(request: Any) -> bytes:
    """A message's bytes; bytes pass as they are (a pull resent by a lane falling back to unary calls)."""
    if isinstance(request, bytes):
        return request
    return bytes(request) if isinstance(request, (bytearray, memoryview)) else request.SerializeToString()


def _reply_decoder(name: str, response: Any) -> Callable[[Any], Any]:
    if name in ("Pull", "PullDense"):
        return wire.decode_pull_response
    if name == "PullBatch":
        return wire.decode_repeated
    return lambda buf: response.FromString(bytes(buf))


def _methods() -> dict[str, Method]:
    service = pb.DESCRIPTOR.services_by_name["Shard"]
    # StreamRequest's oneof holds one field per request type; StreamResponse uses the same numbers.
    stream_fields = {f.message_type.name: f.number for f in pb.StreamRequest.DESCRIPTOR.fields}
    for f in pb.StreamResponse.DESCRIPTOR.fields:
        if f.name != "error":
            assert pb.StreamRequest.DESCRIPTOR.fields_by_number[f.number].name == f.name, f.name
    out = {}
    for m in service.methods:
        out[m.name] = Method(
            name=m.name, request=getattr(pb, m.input_type.name), response=getattr(pb, m.output_type.name),
            stream_field=0 if m.client_streaming else stream_fields.get(m.input_type.name, 0),
            wire_request=m.name in _WIRE_REQUESTS, wire_response=m.name in _WIRE_RESPONSES,
            streaming=m.client_streaming, encode_request=_serialize,
            decode_reply=_reply_decoder(m.name, getattr(pb, m.output_type.name)),
        )
    return out


METHODS: dict[str, Method] = _methods()
#: The method carried by each StreamRequest / StreamResponse field.
BY_STREAM_FIELD: dict[int, Method] = {m.stream_field: m for m in METHODS.values() if m.stream_field}
#: StreamResponse's field for a refused call.
STREAM_ERROR_FIELD = pb.StreamResponse.ERROR_FIELD_NUMBER


def stream_field(method: str) -> int:
    """The StreamRequest field that carries ``method``."""
    field = METHODS[method].stream_field
    if not field:
        raise ValueError(f"{method} is not carried on a Stream")
    return field


def by_stream_field(field: int) -> Optional[Method]:
    return BY_STREAM_FIELD.get(field)


def error_kind(view: memoryview) -> str:
    """The kind of the StreamError ``view`` holds (a StreamResponse's field ``STREAM_ERROR_FIELD``)."""
    return pb.StreamError.FromString(bytes(view)).kind


def not_primary(field: int, view: memoryview) -> bool:
    """Whether a StreamResponse (``field``, ``view``) is a replica group member's refusal because it is not the
    primary (status kind "not_primary"): the call was not applied, and goes to the primary instead."""
    return field == STREAM_ERROR_FIELD and error_kind(view) == "not_primary"


@functools.lru_cache(maxsize=1)
def local_scope() -> str:
    """Where a shard's data plane can be reached over Unix sockets: this machine's boot and network namespace.

    The data plane's Unix sockets are abstract (Linux: no file, gone with their process), and an abstract socket
    is visible in the network namespace that bound it, so a client whose scope equals a shard's connects to it
    that way instead of over TCP. Empty where it cannot be told (not Linux): TCP then.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return ""
    return f"{boot}/{netns}" if boot else ""
