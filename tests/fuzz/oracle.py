"""The checks on a fuzzed shard's answers: the status codes a client may get, the pushes a call
acknowledged, and whether protobuf reads a push as the shard's own decoder did."""

from __future__ import annotations

import re
from typing import Any, Optional

import grpc
import numpy as np

from shardps.v1 import shardps_pb2 as pb
from tests.fuzz.wire import LEN, parse_fields

CODE_OF: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
# The few codes only some methods may answer: a two-phase COMMIT that was not prepared is
# UNAVAILABLE; a heartbeat may legitimately wait (wait_s is capped at 1 s here).
# A data-plane control message that is not a well-formed hello is UNAUTHENTICATED.
# A migration's handover is UNAVAILABLE while a checkpoint is being cut.
ALLOWED_FOR = {"Checkpoint": {grpc.StatusCode.UNAVAILABLE}, "Heartbeat": {grpc.StatusCode.DEADLINE_EXCEEDED},
               "DataPlane": {grpc.StatusCode.UNAUTHENTICATED}, "Migrate": {grpc.StatusCode.UNAVAILABLE}}


def allowed_codes(method: str) -> set:
    return ALLOWED | ALLOWED_FOR.get(method, set())


def exception_line(text: str) -> str:
    """The exception line (``ValueError: ...``) of the last traceback in a shard log."""
    start = text.rfind("Traceback (most recent call last):")
    if start >= 0:
        for line in text[start:].splitlines()[1:]:
            if line and not line[0].isspace() and re.match(r"^[A-Za-z_][\w.]*(: |$)", line):
                return line[:300]
    hits = [ln.strip() for ln in text.splitlines() if re.match(r"^\s*[\w.]+(Error|Exception)\b", ln)]
    return hits[-1][:300] if hits else ""


def compare_push(d: Any, msg: Any, dense: bool) -> list[str]:
    """Where a push decoded by shardps.core.wire (``d``) and protobuf's parse of the same bytes (``msg``) differ."""
    from shardps.core import codec

    problems: list[str] = []

    def tensor(t: pb.Tensor, what: str) -> Optional[np.ndarray]:
        try:
            return codec.decode(t, what)
        except Exception as e:  # noqa: BLE001 - any failure to decode what wire decoded is a disagreement
            problems.append(f"{what}: wire decoded it, but protobuf's Tensor does not decode ({type(e).__name__}: {e})")
            return None

    def same(what: str, got: Optional[np.ndarray], ref: Optional[np.ndarray]) -> None:
        if ref is None:
            return
        if got is None:
            problems.append(f"{what}: wire has none, protobuf has shape {list(ref.shape)}")
        elif got.dtype != ref.dtype or got.shape != ref.shape or got.tobytes() != ref.tobytes():
            problems.append(
                f"{what}: wire {got.dtype} {list(got.shape)} {got.tobytes()[:32].hex()}... != "
                f"protobuf {ref.dtype} {list(ref.shape)} {ref.tobytes()[:32].hex()}..."
            )

    name = msg.name if dense else msg.table
    if d.name != name:
        problems.append(f"name: wire {d.name!r} != protobuf {name!r}")
    if dense:
        if d.row_start != msg.row_start:
            problems.append(f"row_start: wire {d.row_start} != protobuf {msg.row_start}")
    elif msg.HasField("ids"):
        if msg.ids.dtype != pb.INT64:
            problems.append(f"ids: wire accepted them, protobuf reads dtype {msg.ids.dtype}")
        same("ids", d.ids, tensor(msg.ids, "ids"))
    elif d.ids is None or d.ids.size:
        problems.append(f"ids: protobuf has none, wire has {None if d.ids is None else list(d.ids.shape)}")
    if not msg.HasField("grads"):
        problems.append("grads: wire has grads, protobuf has none")
    else:
        same("grads", d.grads, tensor(msg.grads, "grads"))
    pulled = msg.pulled_version if msg.HasField("pulled_version") else None
    if d.pulled_version != pulled:
        problems.append(f"pulled_version: wire {d.pulled_version} != protobuf {pulled}")
    if d.client_id != msg.client_id:
        problems.append(f"client_id: wire {d.client_id!r} != protobuf {msg.client_id!r}")
    if d.seq != msg.seq:
        problems.append(f"seq: wire {d.seq} != protobuf {msg.seq}")
    for field in ("shard_map", "sync"):
        ref_msg = getattr(msg, field) if msg.HasField(field) else None
        got = getattr(d, field)
        if (got is None) != (ref_msg is None) or (got is not None and got != ref_msg):
            problems.append(f"{field}: wire {got!r} != protobuf {ref_msg!r}".replace("\n", " "))
    return problems


def replay_suspect(dense: bool, buf: bytes) -> Optional[str]:
    """Why an acknowledged push might not replay from the log: protobuf cannot parse it, or parses it
    to something else than the live decoder did. None if it looks fine."""
    from google.protobuf.message import DecodeError

    from shardps.core import pushread

    cls = pb.PushDenseRequest if dense else pb.PushRequest
    try:
        msg = cls.FromString(buf)
    except DecodeError as e:
        return f"protobuf cannot parse it ({e})"
    try:
        d = pushread.decode_push(buf, dense=dense)
    except Exception:  # noqa: BLE001 - refused live: not what was acknowledged
        return None
    problems = compare_push(d, msg, dense)
    return "; ".join(problems) if problems else None


def push_entries(method: str, payload: bytes) -> list[tuple[bool, bytes]]:
    """The pushes inside an acknowledged call or stream frame: (dense, serialized push)."""
    if method == "Push":
        return [(False, payload)]
    if method == "PushDense":
        return [(True, payload)]
    fields = parse_fields(payload) or []
    if method == "PushBatch":
        return [(f.number == 2, bytes(f.value)) for f in fields if f.wt == LEN and f.number in (1, 2)]  # type: ignore[arg-type]
    out: list[tuple[bool, bytes]] = []  # a Stream frame
    for f in fields:
        if f.wt == LEN and f.number in (1, 2):
            out.append((f.number == 2, bytes(f.value)))  # type: ignore[arg-type]
        elif f.wt == LEN and f.number == 3:
            out += push_entries("PushBatch", bytes(f.value))  # type: ignore[arg-type]
    return out
