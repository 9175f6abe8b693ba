"""Channels to a cluster's members: TLS, the bearer token, one channel per address for the client's life, stubs
with the protocol table's (de)serializers; and a shard run as a replica group: which member is its primary, which
backups answer.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import threading
import time
from typing import Any, Optional, Sequence

import grpc

from shardps.core import protocol
from shardps.core.tokens import bearer
from shardps.v1 import shardps_pb2 as pb

MiB = 1 << 20


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


class Channels:
    """One channel per address (a shard, or a replica group's member), with the client's options, TLS and token."""

    def __init__(self, max_message_bytes: int, tls: Optional[TLS], token: Optional[str]) -> None:
        limit = max(max_message_bytes + 64 * 1024, 4 * MiB)
        self._options: list[tuple[str, Any]] = [("grpc.max_receive_message_length", limit),
                                                ("grpc.max_send_message_length", limit),
                                                # A connection of its own per client: shards share themselves
                                                # fairly among connections (several clients in one process
                                                # would otherwise share one).
                                                ("grpc.use_local_subchannel_pool", 1),
                                                *protocol.RECONNECT_OPTIONS]
        self._creds = None
        self.tls = tls
        if tls is not None:
            self._creds = tls.credentials()
            if tls.server_name:
                self._options.append(("grpc.ssl_target_name_override", tls.server_name))
        self._token = token
        self._channels: dict[str, grpc.Channel] = {}

    def get(self, address: str) -> grpc.Channel:
        """The channel to ``address`` (made on first use, kept for the client's life)."""
        ch = self._channels.get(address)
        if ch is None:
            ch = grpc.insecure_channel(address, options=self._options) if self._creds is None else \
                grpc.secure_channel(address, self._creds, options=self._options)
            if self._token is not None:
                ch = grpc.intercept_channel(ch, _Token(self._token))
            self._channels[address] = ch
        return ch

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()


members = protocol.group_members  # a shard's entry: its address, or its replica group's members


GRACE_S = 0.1  # once a member has said it is the primary, how long the others' answers are waited for


def ask_members(channels: Channels, group: Sequence[str], timeout: float) -> list[tuple[str, Optional[Any]]]:
    """Every member's ShardInfo, asked at once, each within ``min(1, timeout)`` seconds (None: no answer): a member
    that is frozen, cut off or stuck on its disk costs that deadline once, not once per member, and not at all once
    a member has said it is the primary and the others had ``GRACE_S`` more to answer."""
    done = threading.Condition()
    answers: dict[str, Optional[Any]] = {}

    def settle(member: str, f: Any) -> None:
        try:
            value = f.result()
        except grpc.RpcError:
            value = None
        with done:
            answers[member] = value
            done.notify_all()

    for member in group:
        try:
            f = Stub(channels.get(member)).ShardInfo.future(pb.ShardInfoRequest(), timeout=min(1.0, timeout))
        except grpc.RpcError:
            answers[member] = None
            continue
        f.add_done_callback(lambda f, member=member: settle(member, f))
    deadline = time.monotonic() + min(1.0, timeout) + 0.05
    with done:
        while len(answers) < len(group):
            now = time.monotonic()
            if any(a is not None and (not a.HasField("replica") or a.replica.role == "primary")
                   for a in answers.values()):
                deadline = min(deadline, now + GRACE_S)
            if now >= deadline:
                break
            done.wait(deadline - now)
        return [(m, answers.get(m)) for m in group]


def locate_primary(channels: Channels, group: Sequence[str], timeout: float) -> tuple[Optional[str], int]:
    """The primary of a replica group and its epoch: the member that says it is (the newest epoch, should two say
    so), else the address a member names (epoch 0: unconfirmed); (None, 0) while none is known (an election is
    under way)."""
    found: list[tuple[int, str]] = []
    named = ""
    for member, info in ask_members(channels, group, timeout):
        if info is None:
            continue
        if not info.HasField("replica"):
            return member, 0
        if info.replica.role == "primary":
            found.append((info.replica.epoch, member))
        named = named or info.replica.primary
    if found:
        epoch, member = max(found)
        return member, epoch
    return (named or None), 0


def find_primary(channels: Channels, group: Sequence[str], timeout: float) -> Optional[str]:
    """``locate_primary``'s address."""
    return locate_primary(channels, group, timeout)[0]


def find_backup(channels: Channels, group: Sequence[str], timeout: float, avoid: str = "") -> Optional[str]:
    """A backup of a replica group that answers (the least behind; ``avoid`` last); None when none does."""
    found: list[tuple[bool, int, str]] = []
    for member, info in ask_members(channels, group, timeout):
        if info is not None and info.replica.role == "backup":
            found.append((member == avoid, -int(info.replica.lsn), member))
    return min(found)[2] if found else None


class Stub:
    """A callable per method, with the protocol table's (de)serializers (wire-level for the bulk methods)."""

    def __init__(self, channel: grpc.Channel) -> None:
        for m in protocol.METHODS.values():
            if not m.streaming:
                setattr(self, m.name, channel.unary_unary(m.path, request_serializer=m.encode_request,
                                                          response_deserializer=m.decode_reply))
