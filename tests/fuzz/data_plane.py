"""Fuzzing the data plane (pulls and pushes over ZeroMQ, ``shardps.server.rpc.data_plane``) as the pseudo-method
``DataPlane``: one example is 1..4 multipart messages on a fresh connection.

A message is the generated Stream frames the gRPC ``Stream`` method is fuzzed with, as ``[request id, frame]``,
or one of: extra parts after the frame (a shared-memory region's descriptor, ``shardps.core.region``: over
TCP the connection has none), a hello with random credentials, one asking for a region, a control message that is
not a hello, random parts, a single part (no request id: never answered), and last of all sometimes a frame over
the size limit (its connection is closed: never answered; sent once the others are answered, since answers
still on their way when the connection closes are lost with it, and a client resends those). Every other message must be answered (a request
with its id, a control message with an empty id), each answer with a status a client may get; the harness
then checks, as for every method, that refused calls changed nothing and that the shard is alive and answering.

A message travels in the fuzzer's payload (and its failure dumps) as one ``bytes``: each part as a 4-byte
little-endian length and the part. Request ids are replaced by the harness with unique ones, so that answers
can be matched to requests.
"""

from __future__ import annotations

import functools
import struct
import time
from typing import Any

from hypothesis import strategies as st

from shardps.core import region
from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.values import weighted

NAME = "DataPlane"
OVERSIZED = 4 * 1024 * 1024 + 128 * 1024  # over the fuzzed shard's limit (--max-message-mb 4, with 64 KiB of slack)


def pack(parts: list[bytes]) -> bytes:
    return b"".join(struct.pack("<I", len(p)) + p for p in parts)


def unpack(message: bytes) -> list[bytes]:
    parts, i = [], 0
    while i < len(message):
        (n,) = struct.unpack_from("<I", message, i)
        parts.append(message[i + 4: i + 4 + n])
        i += 4 + n
    return parts


@functools.cache
def payloads() -> st.SearchStrategy[list[bytes]]:
    from tests.fuzz.payloads import request_bytes

    frame = request_bytes(pb.StreamRequest)
    rid = st.just(b"r")  # replaced by a unique id when sent
    blob = st.binary(max_size=64)
    slot = st.sampled_from([0, 1, 3, 4, 0xFFFFFFFF, 2**31])
    size = st.sampled_from([0, 1, 64 << 10, 2 << 20, (2 << 20) + 1, 0xFFFFFFFF])
    descriptor = st.one_of(st.tuples(slot, size, slot).map(lambda t: region.REQUEST.pack(*t)), blob)
    message = weighted(
        (12, st.tuples(rid, frame).map(list)),
        (1, st.tuples(rid, frame, blob).map(list)),
        (1, st.tuples(rid, descriptor, st.one_of(frame, st.just(b""))).map(list)),
        (1, st.tuples(st.just(b""), st.just(b"hello"), blob, st.just(region.ASK)).map(list)),
        (1, st.tuples(st.just(b""), st.just(b"hello"), blob).map(list)),
        (1, st.tuples(st.just(b""), st.just(b"hello"), blob, blob).map(list)),
        (1, st.tuples(st.just(b""), blob).map(list)),
        (1, st.lists(blob, min_size=2, max_size=4).map(lambda ps: [b"r", *ps[1:]])),
        (1, st.tuples(blob).map(list)),
    ).map(pack)
    oversized = st.just(pack([b"r", b"\x00" * OVERSIZED]))
    closing = st.tuples(st.lists(message, max_size=3), oversized).map(lambda t: [*t[0], t[1]])
    return weighted((19, st.lists(message, min_size=1, max_size=4)), (1, closing))


def exchange(port: int, messages: list[bytes], deadline: float) -> tuple[list[tuple[list[bytes], Any]], int]:
    """Send ``messages`` on a fresh DEALER connection to ``port``; the answers each expected message got
    ([parts sent], [parts answered] or None), and how many messages expected an answer."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sent: list[list[bytes]] = []
    closing: list[list[bytes]] = []  # over the size limit: sent once the others are answered (it closes the
    # connection, and answers not yet delivered on it would be lost with it: the client resends those)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        for k, message in enumerate(messages):
            parts = unpack(message)
            if not parts:
                continue
            if parts[0]:
                parts[0] = b"fz" + k.to_bytes(6, "big")  # unique: answers name their request
            if sum(map(len, parts)) >= OVERSIZED:
                closing.append(parts)
                continue
            sock.send_multipart(parts)
            if len(parts) >= 2:
                sent.append(parts)
        waiting = {p[0]: p for p in sent if p[0]}
        controls = [p for p in sent if not p[0]]
        answers: dict[bytes, list[bytes]] = {}
        control_answers: list[list[bytes]] = []
        end = time.monotonic() + deadline
        while (len(answers) < len(waiting) or len(control_answers) < len(controls)) and time.monotonic() < end:
            if not sock.poll(max(1, int((end - time.monotonic()) * 1000))):
                break
            reply = sock.recv_multipart()
            if reply[0]:
                answers[reply[0]] = reply
            else:
                control_answers.append(reply)
        for parts in closing:
            sock.send_multipart(parts)
            sock.setsockopt(zmq.LINGER, int(deadline * 1000))  # closing waits until it has gone out
        out: list[tuple[list[bytes], Any]] = [(p, answers.get(p[0])) for p in sent if p[0]]
        out += [(p, control_answers[i] if i < len(control_answers) else None) for i, p in enumerate(controls)]
        return out, len(sent)
    finally:
        sock.close(0)
